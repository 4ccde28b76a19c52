"""Resuming a run: `resume=<run id or .ckpt path>` continues the same MLflow run from its last checkpoint,
with the run's own settings; only settings that do not change what is trained may differ.

A run killed before its first checkpoint has nothing to continue: `resume=<its id>` closes it as FAILED
(it would otherwise stay RUNNING forever) and says so. A run's folder holds its writer lock
(`checkpoints.RunLock`), which tells a dead run from one that is still training towards its first checkpoint;
a run killed before its folder existed is told by the process its tag `started_by` names.
"""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from xmc_repro import checkpoints
from xmc_repro.cli import STARTED_RUNS_ENV
from xmc_repro.distributed import launch_rank
from xmc_repro.errors import ConfigError, StorageError, left_running
from xmc_repro.sweep_files import alive, listed_runs
from xmc_repro.validation import implied_before

CHECKPOINT_ROOT = Path("checkpoints")
# Settings a resumed run may change: none of them alters what is trained. Everything else comes from the run.
RESUMABLE_SETTINGS = (
    "trainer.max_epochs",
    "trainer.progress_bar",
    "trainer.num_workers",
    "trainer.eval_batch_size",
    "trainer.checkpoint_every_n_steps",
    "trainer.profile_steps",
    "trainer.memory_report",
    "trainer.cublas_workspace_mib",
)
LIVE_SECTIONS = ("resume", "logger", "hydra")  # always taken from the command line
_ABSENT = object()  # a setting a config does not have (a run's config predating it)


def resume_checkpoint(value, tracking_uri: str | None = None) -> Path:
    """The checkpoint named by `resume=`: a file path, or the run id of a run started in this directory.

    With `tracking_uri`, a run whose folder is here but holds no checkpoint is closed as FAILED (see above).
    """
    given = Path(str(value)).expanduser()
    if given.is_file():
        return given
    if given.is_dir() and (given / checkpoints.LAST).is_file():
        return given / checkpoints.LAST
    if given.suffix == ".ckpt" or len(given.parts) > 1:  # a path, not a run id
        raise ConfigError(f"resume={value}: no such checkpoint file in {Path.cwd()}; give the path of a run's "
                          f"{checkpoints.LAST}, or its run id")
    run_dir = CHECKPOINT_ROOT / str(value)
    by_run = run_dir / checkpoints.LAST
    if by_run.is_file():
        return by_run
    others = sorted(path.name for path in run_dir.glob("*.ckpt")) if run_dir.is_dir() else []
    if others:  # its last.ckpt is gone (deleted by hand): another checkpoint of the run can still continue it
        raise ConfigError(f"resume={value}: {by_run} is missing, the run's folder holds {', '.join(others)}; continue "
                          f"from that checkpoint's epoch with resume={run_dir / others[0]}")
    if run_dir.is_dir() and tracking_uri is not None:
        raise ConfigError(f"resume={value}: {close_orphan(tracking_uri, str(value), run_dir)}")
    unstarted = close_unstarted(tracking_uri, str(value)) if tracking_uri is not None else None
    if unstarted:
        raise ConfigError(f"resume={value}: {unstarted}")
    # A run's name ends with the first characters of its id (`... seed0 df94`): those alone name no folder.
    started = sorted(d.name for d in CHECKPOINT_ROOT.glob(glob.escape(str(value)) + "*")
                     if (d / checkpoints.LAST).is_file())
    if started:
        raise ConfigError(f"resume={value}: no run has this whole id; runs here whose id starts so: "
                          f"{', '.join(started[:3])}{' ...' if len(started) > 3 else ''}; pass the whole id, e.g. "
                          f"resume={started[0]}")
    raise ConfigError(
        f"resume={value}: neither a checkpoint file nor a run with {by_run} in {Path.cwd()}; pass the run id from "
        "the directory the run was started in, or the path of its last.ckpt"
    )


def close_orphan(tracking_uri: str, run_id: str, run_dir: Path) -> str:
    """What became of a run that has a folder here but no checkpoint; a dead RUNNING one is marked FAILED."""
    lock = checkpoints.RunLock(run_dir)
    if lock.is_held():
        return (f"run {run_id} has no checkpoint yet and is still being written by another process (pid "
                f"{lock.holder()}); wait for its first checkpoint (every epoch, or trainer.checkpoint_every_n_steps)")
    client, run = _stored_run(tracking_uri, run_id)
    if run is None:
        return (f"no checkpoint in {run_dir} and no MLflow run {run_id} in {tracking_uri}; set logger.tracking_uri "
                "to the store the run was started with, or start a new run")
    if run.info.lifecycle_stage == "deleted":
        return _deleted(run_id)
    status = run.info.status
    if status == "RUNNING":
        return _mark_failed(client, run_id)
    why = run.data.tags.get("error")
    return (f"run {run_id} ended {status} before its first checkpoint{f' ({why})' if why else ''}; nothing to "
            "resume: start it again without resume=")


def close_unstarted(tracking_uri: str, run_id: str) -> str | None:
    """A run with no folder here: one killed between its creation in MLflow and its folder (a few ms; SIGTERM and
    Ctrl+C wait for the folder, SIGKILL cannot) is RUNNING, was started in this folder on this machine, and its
    process is gone: it is marked FAILED. None for any other run (one started elsewhere may be alive)."""
    from xmc_repro.report.records import STARTED_BY
    from xmc_repro.tracking import sqlite_path, started_by

    store = sqlite_path(tracking_uri)
    if store is not None and not store.is_file():
        return None  # no store here (and MLflow would create one)
    client, run = _stored_run(tracking_uri, run_id)
    if run is None:
        return None
    if run.info.lifecycle_stage == "deleted":
        return _deleted(run_id)
    pid, _, place = run.data.tags.get(STARTED_BY, "").partition("@")
    if run.info.status != "RUNNING" or not pid.isdigit() or place != started_by().partition("@")[2]:
        return None
    if alive(int(pid), run.info.start_time / 1000 if run.info.start_time is not None else None):
        return (f"run {run_id} is still being started by process {pid}; wait for its first checkpoint (every epoch, "
                "or trainer.checkpoint_every_n_steps)")
    return _mark_failed(client, run_id)


def _stored_run(tracking_uri: str, run_id: str):
    """(client, the run), or (client, None) when the store has no such run. A store that stays locked, or cannot
    be read, is a StorageError: a busy store is not a wrong one."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from xmc_repro.tracking import no_such_run, short_error, with_retries

    client = None
    try:
        client = with_retries(MlflowClient, tracking_uri)
        return client, with_retries(client.get_run, run_id)
    except MlflowException as error:
        if no_such_run(error, run_id):
            return client, None
        reason = short_error(error)
    except Exception as error:
        reason = short_error(error)
    raise StorageError(f"resume={run_id}: cannot read the run from the MLflow store {tracking_uri} ({reason}); "
                       "once the store can be read, resume again")


def _deleted(run_id: str) -> str:
    """A run without a checkpoint that was deleted in MLflow: nothing to continue, and MLflow refuses to close it."""
    return f"run {run_id} has no checkpoint and was deleted in MLflow; nothing to resume: start a new run"


def _mark_failed(client, run_id: str) -> str:
    """Mark a RUNNING run whose process is gone FAILED; the line that says so."""
    from xmc_repro.tracking import mark_failed

    message = "stopped before its first checkpoint (its process ended without closing it); nothing to resume"
    try:
        mark_failed(client, run_id, message)
    except Exception as error:
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        return f"run {run_id} {message}; marking it FAILED failed ({reason}): retry once the store is writable"
    return (f"run {run_id} {message}, so it is now marked FAILED; start it again without resume= "
            "(set trainer.checkpoint_every_n_steps to checkpoint within an epoch)")


def note_started(run_id: str, tracking_uri: str, run_dir: Path) -> None:
    """List a run this job opened, for the process that launched the sweep (`close_interrupted`)."""
    path = os.environ.get(STARTED_RUNS_ENV)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(f"{run_id}\t{tracking_uri}\t{run_dir.resolve()}\n")


def close_interrupted(path: Path, why: str, stop_on_ctrl_c: bool = False) -> tuple[list[str], str]:
    """After a sweep was interrupted: mark FAILED the listed runs that are still RUNNING with no process writing them.
    A launcher such as joblib kills its workers on Ctrl+C, before a job can close its own run.

    Returns the ids it marked FAILED, and a clause naming the runs it could not close ("" when none). The user waits
    for the prompt meanwhile: a locked store gets CLOSE_RETRY_SECONDS for all runs together, and once it has refused,
    its other runs are not tried (each try may also wait out SQLite's own busy timeout); Ctrl+C again stops it
    (`stop_on_ctrl_c`: and is raised, where no Ctrl+C came before)."""
    listed = listed_runs(path)
    if not listed:
        return [], ""  # no job started a run: nothing to close (and no MLflow to load)
    from mlflow.tracking import MlflowClient

    from xmc_repro import tracking
    from xmc_repro.tracking import is_contention, mark_failed, no_such_run, short_error, with_retries

    deadline = time.monotonic() + tracking.CLOSE_RETRY_SECONDS
    clients, locked, reasons = {}, set(), {}  # per store: its client; stores given up on; why runs stay open
    closed, left = [], []
    for index, (run_id, uri, run_dir) in enumerate(listed):
        if checkpoints.RunLock(Path(run_dir)).is_held():
            continue  # its job is alive: it closes the run itself
        if uri in locked:
            left.append(run_id)
            continue
        try:
            if uri not in clients:
                clients[uri] = with_retries(MlflowClient, uri, deadline=deadline)
            client = clients[uri]
            run = with_retries(client.get_run, run_id, deadline=deadline)
            if run.info.status != "RUNNING" or run.info.lifecycle_stage == "deleted":  # MLflow refuses every write
                continue  # to a deleted run, which no runs table shows
            kept = (Path(run_dir) / checkpoints.LAST).is_file()
            message = f"interrupted ({why}); " + (f"continue it with resume={run_id}" if kept else "no checkpoint yet")
            mark_failed(client, run_id, message, deadline)
        except KeyboardInterrupt:  # Ctrl+C (or SIGTERM) again: stop here and name what is left
            if stop_on_ctrl_c:
                raise
            reasons["interrupted while closing them"] = None
            left += [other for other, _, folder in listed[index:] if not checkpoints.RunLock(Path(folder)).is_held()]
            break
        except Exception as error:  # the store is gone, full or locked: `resume=<id>` closes the run later
            if no_such_run(error, run_id):
                continue  # gone from the store meanwhile: nothing shows RUNNING
            if is_contention(error):
                locked.add(uri)
            reasons[short_error(error)[:200]] = None
            left.append(run_id)
            continue
        closed.append(run_id)
    return closed, left_running(left, list(reasons))


def keep_cpu_threads(threads: int | None) -> None:
    """A run trained on the CPU continues on as many threads as it trained with, whatever this process was given:
    they set the order of the kernels' sums (so the bits of what is trained), and they are part of the run's
    `device` tag, which the report's rows are told apart by. A sweep's `hydra.job.env_set` (the smoke scale's
    OMP_NUM_THREADS=1) does not reach a resume's command line."""
    import torch

    if not threads:
        return
    if threads != torch.get_num_threads() and launch_rank() == 0:
        print(f"resume: {threads} CPU thread(s) per process, as the run trained with", flush=True)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # DDP's ranks: Lightning keeps it rather than share the cores out
    torch.set_num_threads(threads)


def resume_config(cfg: DictConfig, stored: DictConfig, explicit: list[str]) -> DictConfig:
    """The run's stored config, with this command line's `logger`, `resume` and any RESUMABLE_SETTINGS.

    A setting given explicitly that would change what the run trains is refused: a resumed run equals the
    run it continues. Sections this code has and the run's config lacks come from the command line.
    """
    merged = stored.copy()
    for key in explicit:
        section = key.split(".")[0]
        if section in LIVE_SECTIONS or key in RESUMABLE_SETTINGS or section not in stored:  # the last: newer than
            continue  # the run, taken from this command line below
        now = OmegaConf.select(cfg, key, default=_ABSENT)
        if now is _ABSENT:  # not a setting of this config (`~key`, a group packaged elsewhere)
            continue
        differs = _difference(stored, key, _plain(now))
        if differs:
            name, then, value = differs
            given = f" (from {key}=...)" if name != key else ""
            raise ConfigError(
                f"resume: {name} was {then} in the run and is {value} on this command line{given}; a resumed run "
                f"keeps its settings (only {', '.join(RESUMABLE_SETTINGS)} may change): drop {key}=..."
            )
    for key in RESUMABLE_SETTINGS:
        if key in explicit:
            OmegaConf.update(merged, key, OmegaConf.select(cfg, key), force_add=True)
    for key in cfg:
        if key in LIVE_SECTIONS:
            merged[key] = _plain(cfg[key])
        elif key not in merged:  # a section newer than the run: its interpolations resolve against the run's settings
            merged[key] = OmegaConf.to_container(cfg[key], resolve=False) if isinstance(cfg[key], DictConfig) else cfg[key]
    return merged


def _difference(stored: DictConfig, key: str, now):
    """(setting, the run's value, this command line's value), as shown, of the first setting at or under `key` whose
    value on this command line differs from what the run trained with; None when there is none. A null on either
    side counts, and so does a setting the run predates, by the value it trained with (`implied_before`)."""
    then = _plain(OmegaConf.select(stored, key, default=_ABSENT))
    if isinstance(then, dict) and isinstance(now, dict):  # a group choice (model=uniform): name the setting
        for name in [*then, *(k for k in now if k not in then)]:
            found = _difference(stored, f"{key}.{name}", now.get(name, _ABSENT))
            if found:
                return found
        return None
    if then is not _ABSENT:
        return None if then == now else (key, _shown(then), _shown(now))
    implied = implied_before(key, OmegaConf.select(stored, "model.head", default=None))
    if implied is None:
        return None if now is _ABSENT else (key, "absent (the run predates this setting)", _shown(now))
    return None if implied == now else (key, f"{_shown(implied)} (the run predates this setting and trained so)",
                                        _shown(now))


def _shown(value) -> str:
    if value is _ABSENT:
        return "absent (not a setting of this version)"
    return "null" if value is None else _short(OmegaConf.create(value) if isinstance(value, dict) else value)


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _short(value) -> str:
    text = OmegaConf.to_yaml(value).strip() if isinstance(value, DictConfig) else repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def prepare(cfg: DictConfig, explicit: list[str], multirun: bool) -> tuple[DictConfig, Path | None, str | None]:
    """(config to run, checkpoint to resume from, MLflow run id to continue); the last two None for a new run.

    `explicit`: the config keys given on the command line; `multirun`: launched by `-m`.
    """
    if cfg.get("resume") is None:
        return cfg, None, None
    if not str(cfg.resume).strip():  # e.g. resume=$RUN_ID with the variable unset: not a new run
        raise ConfigError("resume= is empty; pass the run id or checkpoint path to continue, or drop resume= to "
                          "start a new run")
    if multirun:
        raise ConfigError(f"resume={cfg.resume} continues one run: run it without -m")
    path = resume_checkpoint(cfg.resume, OmegaConf.select(cfg, "logger.tracking_uri", default=None))
    saved = checkpoints.read(path)
    merged = resume_config(cfg, OmegaConf.create(saved["config"]), explicit)
    keep_cpu_threads(saved.get("cpu_threads"))  # absent from GPU runs' and older checkpoints
    done, max_epochs = saved["completed_epochs"], OmegaConf.select(merged, "trainer.max_epochs")
    if isinstance(max_epochs, int) and max_epochs < done:  # Lightning refuses it with a traceback, mid-run
        raise ConfigError(f"resume: trainer.max_epochs={max_epochs} is below the {done} epochs the run had completed "
                          f"at its last checkpoint; set trainer.max_epochs={done} or more")
    return merged, path, saved["run_id"]
