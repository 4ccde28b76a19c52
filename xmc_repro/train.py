"""One experiment, from a composed config to a closed MLflow run: data -> model -> fit -> test -> summary.

Once its MLflow run is open, a run always ends FINISHED or FAILED; a FAILED run carries the one-line reason
as tag `error` (and the step it stopped at, `failed_at_step`). `checkpoints/<run_id>/last.ckpt` is kept
current every epoch and every `trainer.checkpoint_every_n_steps` steps; `resume=<run id or .ckpt path>`
continues the same run from it with the run's own settings (see `xmc_repro.resume`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import signal
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from xmc_repro import checkpoints, tracking
from xmc_repro.callbacks import MemoryPeakReport, SigtermStopsEveryRank, StepProfile, sigterm_noted
from xmc_repro.cli import sweep_config
from xmc_repro.console import EpochLine, EvaluationProgress, ProgressBar
from xmc_repro.data import build_datamodule
from xmc_repro.describe import run_name
from xmc_repro.distributed import another_rank_stopped, launch_problem, launch_rank
from xmc_repro.errors import ConfigError, StorageError, UserError, left_running
from xmc_repro.metrics import inverse_propensity
from xmc_repro.model import NonFiniteLossError, XMCClassifier, check_targets, instantiate_with
from xmc_repro.report.records import WRITER
from xmc_repro.resume import CHECKPOINT_ROOT, note_started, prepare
from xmc_repro.tracking import RunTracker, device_name, git_commit, is_contention, short_error, writer_tag
from xmc_repro.validation import BEFORE_THE_SETTING
from xmc_repro.validation import validate as validate_values


def validate(cfg: DictConfig) -> None:
    """The config's values (`xmc_repro.validation`), then whether this launch can run it."""
    validate_values(cfg)
    check_targets(cfg)  # imports the user's own heads, losses and callbacks: after torch, before the data
    accelerator = str(cfg.trainer.accelerator)
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():  # Lightning's error is a traceback
        raise ConfigError(f"trainer.accelerator={accelerator} but no CUDA device is visible here; use "
                          "trainer.accelerator=auto (a GPU when there is one) or cpu")
    devices = cfg.trainer.devices
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and (OmegaConf.is_list(devices) or (isinstance(devices, str) and "," in devices)):
        raise ConfigError(f"trainer.devices={devices} names GPU ids, and this run is on the CPU; give a number of "
                          "processes there, e.g. trainer.devices=2")
    problem = launch_problem(cfg.trainer, multirun=bool(sweep_tags()))
    if problem:
        raise ConfigError(problem)


def interruption(error: BaseException) -> str:
    """What stopped a run from outside: SIGTERM, Ctrl+C (Lightning turns it into exit(1)), or an exit."""
    if type(error).__name__ == "SIGTERMException":
        return "SIGTERM"
    if isinstance(error, KeyboardInterrupt) or isinstance(error.__context__, KeyboardInterrupt):
        return "Ctrl+C"
    return f"exit {getattr(error, 'code', None)}"


def failure_message(error: BaseException, run_id: str | None = None, last_checkpoint: Path | None = None,
                    store: str | None = None) -> str:
    """One line saying what happened and what to do, for the terminal and the run's `error` tag (`store`: the run's
    tracking URI)."""
    kept = last_checkpoint is not None and last_checkpoint.is_file()
    # A run resumed from its best.ckpt (or a copy under another name) continues from that until last.ckpt is written.
    resumable = kept or (last_checkpoint is not None and any(last_checkpoint.parent.glob("*.ckpt")))

    def then_go_on(fix: str) -> str:  # a run with a checkpoint continues from it; one without has nothing to resume
        return f"{fix}, then " + (f"continue the run with resume={run_id}" if resumable and run_id
                                  else "start it again (no checkpoint yet)")

    in_store = f"the MLflow store {store}" if store else "the MLflow store"
    if isinstance(error, UserError):
        text = str(error).replace("resume=<run id>", f"resume={run_id or '<run id>'}")
    elif disk_full(error):
        text = f"no space left on the device ({short_error(error)}); " + then_go_on("free space")
    elif read_only_store(error):
        text = (f"{in_store} cannot be written ({short_error(error)}): it was deleted, moved or made read-only "
                "while the run wrote it; " + then_go_on("restore it or make it and its folder writable"))
    elif is_contention(error):
        text = f"{locked(in_store, error)}; " + then_go_on(LET_IT_FINISH)
    elif refused_by_the_os(error):
        where = f" {error.filename}" if error.filename else ""
        verb, fix = ("write", "make it writable") if error.errno == errno.EROFS else ("access", "fix its permissions")
        text = f"cannot {verb}{where} ({error.strerror}); " + then_go_on(fix)
    elif isinstance(error, BrokenPipeError):
        text = ("its standard output was closed (piped into a program that stopped reading, such as head); "
                + then_go_on("write it to a file (> log.txt) or to a program that reads it all"))
    elif worker_died(error):
        text = (f"a data-loading worker process died ({short_error(error)}; killed for lack of memory, most often); "
                + then_go_on("lower trainer.num_workers or free memory"))
    elif isinstance(error, NonFiniteLossError):
        text = f"{error}; " + (f"the last good checkpoint is kept: {last_checkpoint}" if kept else "no checkpoint yet")
    elif isinstance(error, (KeyboardInterrupt, SystemExit)):
        text = f"interrupted ({interruption(error)})"
        if resumable and run_id:
            text += f"; continue it with resume={run_id}"
    elif another_rank_stopped(error):
        text = (f"another DDP rank stopped (its own error line says why: {type(error).__name__} in a collective); "
                + (f"continue the run with resume={run_id}" if resumable and run_id else "no checkpoint yet"))
    elif isinstance(error, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        text = (
            "out of GPU memory; lower trainer.batch_size and trainer.eval_batch_size (scores are batch x labels), "
            "model.connectivity or model.intermediate"
        )
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())


LET_IT_FINISH = "let that process finish or stop it"


def locked(store: str, error: BaseException) -> str:
    """What a store that stayed busy through all retries is told as, in failure_message and open_run alike."""
    return f"{store} stayed locked by another process for {tracking.RETRY_SECONDS:.0f} s ({short_error(error)})"


def disk_full(error: BaseException) -> bool:
    """A full disk, as the OS (ENOSPC, quota) or SQLite ("database or disk is full") reports it."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return _says(error, "disk is full")


def worker_died(error: BaseException) -> bool:
    """A data-loading worker process killed: PyTorch's "DataLoader worker (pid 42) is killed by signal" or "...
    exited unexpectedly", not an error raised in a worker ("Caught ... in DataLoader worker process 0": a bug)."""
    return isinstance(error, RuntimeError) and "DataLoader worker (pid" in str(error)


def damaged_store(error: BaseException) -> bool:
    """SQLite's words for a database file that is corrupted, truncated or not a database at all."""
    return _says(error, "database disk image is malformed", "file is not a database")


def read_only_store(error: BaseException) -> bool:
    """SQLite's word for a database whose file was deleted or moved while open, or made read-only."""
    return _says(error, "readonly database")


def _says(error: BaseException, *phrases: str) -> bool:
    """Whether an error or its cause (MLflow wraps SQLAlchemy's, which wraps SQLite's) says one of `phrases`."""
    text = f"{error} {error.__cause__ or ''}"
    return any(phrase in text for phrase in phrases)


def refused_by_the_os(error: BaseException) -> bool:
    """A read-only file system or a permission the OS denies."""
    return isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES)


def unwritable(error: BaseException) -> bool:
    """A disk or store that refuses writes (full, read-only, locked for good): a StorageError, in one line."""
    return disk_full(error) or read_only_store(error) or is_contention(error) or refused_by_the_os(error)


def build_model(cfg: DictConfig, dm) -> XMCClassifier:
    """The classifier of `model` (its head: `model._target_`) and `loss`, trained as `trainer` says."""
    t = cfg.trainer
    inv_prop = inverse_propensity(dm.train_label_counts, cfg.dataset.propensity.A, cfg.dataset.propensity.B)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if model.get("head") == "unstructured" and cfg.get("resume"):  # resumed from before the setting: distinct positions
        model.setdefault("distinct_sources", True)
    return XMCClassifier(
        num_features=dm.num_features,
        num_labels=dm.num_labels,
        **model,
        dropout=float(cfg.dataset.dropout),
        loss=OmegaConf.to_container(cfg.loss, resolve=True),
        lr=t.lr,
        adam_eps=float(t.get("adam_eps", 1e-7)),
        adam_eps_placement=t.get("adam_eps_placement", BEFORE_THE_SETTING["adam_eps_placement"]),
        lr_factor=t.lr_factor,
        lr_patience=t.lr_patience,
        lr_threshold=t.lr_threshold,
        min_lr=t.min_lr,
        cuda_graph=bool(t.get("cuda_graph", True)),
        inv_propensity=inv_prop,
    )


def _on_cuda(cfg: DictConfig) -> bool:
    return torch.cuda.is_available() and str(cfg.trainer.accelerator) in ("auto", "gpu", "cuda")


def check_memory(cfg: DictConfig, dm) -> None:
    """ConfigError (one line) when the model's parameters, gradients and Adam state cannot fit in the memory the
    machine has available now (`xmc_repro.host_memory`)."""
    from xmc_repro.host_memory import check_fits

    if launch_rank() != 0:  # rank 0 checked for every rank of this machine; a later rank sees rank 0's copy already
        return              # taken, and refusing alone would leave rank 0 killed and the run RUNNING
    on_cpu = not _on_cuda(cfg)
    devices = cfg.trainer.devices
    processes = int(devices) if on_cpu and isinstance(devices, int) else 1  # CPU DDP: every rank holds a copy
    half = str(cfg.trainer.get("precision", "32-true")) in ("bf16-true", "16-true")  # 16-bit weights and Adam state
    train, test = dm.num_train_points, dm.test_split.num_points
    rows = max(min(int(cfg.trainer.batch_size), train), min(int(cfg.trainer.eval_batch_size), max(train, test)))
    check_fits(cfg.model, int(dm.num_features), int(dm.num_labels), on_cpu, processes, value_bytes=2 if half else 4,
               batch_rows=rows)


def check_train_batches(cfg: DictConfig, dm) -> None:
    """ConfigError (one line) for a fraction `trainer.limit_train_batches` of an epoch's batches that is less than one
    batch, known once the data is read: Lightning refuses it as fit starts, with a traceback."""
    limit = cfg.trainer.get("limit_train_batches")
    batches = math.ceil(dm.num_train_points / int(cfg.trainer.batch_size))
    if isinstance(limit, float) and int(batches * limit) < 1:  # Lightning's own test
        raise ConfigError(f"trainer.limit_train_batches={limit} of an epoch's {batches} training batches is less than "
                          f"one batch; set a fraction of at least 1/{batches}, a number of batches, or null for all")


def build_callbacks(cfg: DictConfig, checkpoint_dir: Path, info: dict | None = None) -> dict[str, pl.Callback]:
    """`callbacks` (conf/callbacks/), by name; partial ones get the run's checkpoint folder here."""
    run_args = {
        "best": {"dirpath": checkpoint_dir},
        "last": {"dirpath": checkpoint_dir, "every_n_steps": cfg.trainer.get("checkpoint_every_n_steps"),
                 "info": info},
    }
    callbacks = {}
    for name, spec in cfg.callbacks.items():
        made = instantiate_with(spec)
        callbacks[name] = made(**run_args.get(name, {})) if isinstance(made, functools.partial) else made
    # Not from the config: these settings may change when a run is resumed.
    callbacks["progress"] = ProgressBar() if cfg.trainer.progress_bar else EpochLine()  # the latter: a line an epoch
    if cfg.trainer.get("profile_steps"):
        callbacks["profile"] = StepProfile(checkpoint_dir, int(cfg.trainer.profile_steps))
    if cfg.trainer.get("memory_report"):
        callbacks["memory_report"] = MemoryPeakReport(checkpoint_dir)
    callbacks["sigterm"] = SigtermStopsEveryRank()  # last: a batch's checkpoint is written before the ranks stop
    return callbacks


def explicit_settings() -> list[str]:
    """Config keys given on this command line (`model=dense` gives `model`); none outside a Hydra app."""
    try:
        from hydra.core.hydra_config import HydraConfig

        from xmc_repro.cli import task_overrides

        overrides = task_overrides(HydraConfig.get())
    except ValueError:
        return []
    return [o.split("=", 1)[0].lstrip("+~").split("@", 1)[0] for o in overrides]


def sweep_tags() -> dict[str, str]:
    """sweep_id and job number of a Hydra multirun job; nothing for a single run."""
    hc = sweep_config()
    if hc is None:
        return {}
    return {"sweep_id": Path(hc.sweep.dir).as_posix(), "job_num": str(hc.job.num)}


def open_run(cfg: DictConfig, run_id: str | None, interrupted: list[int] | None = None,
             held: tuple[str, ...] = ()) -> RunTracker:
    """A new MLflow run, or the one `resume` continues; a UserError (one line) if the store cannot be used.
    `interrupted`: the signals `interruptions_deferred` noted; one ends the wait for a busy store. `held`: the
    `writer_tag`s of the resumed run's locks, taken."""
    uri = cfg.logger.tracking_uri
    pending = functools.partial(raise_deferred, interrupted) if interrupted is not None else None
    try:
        return RunTracker(uri, cfg.logger.experiment_name, run_id=run_id, run_name=run_name(cfg),
                          raise_pending=pending, held=held)
    except UserError:
        raise
    except Exception as error:
        again = f"run it again with resume={run_id}" if run_id else "run it again"
        created = f"; {error.unopened_run}" if hasattr(error, "unopened_run") else ""  # a run created, then failing
        if is_contention(error):
            raise StorageError(f"logger.tracking_uri={uri}: {locked('the MLflow store', error)}; "
                               f"{LET_IT_FINISH}, then {again}{created}") from error
        if disk_full(error):
            raise StorageError(f"logger.tracking_uri={uri}: no space left on the disk holding the MLflow store "
                               f"({short_error(error)}); free space, then {again}{created}") from error
        if damaged_store(error):
            raise StorageError(f"logger.tracking_uri={uri}: the MLflow store's database is damaged "
                               f"({short_error(error)}); restore it from a backup, or move it aside for a new store, "
                               f"then {again}{created}") from error
        if refused_by_the_os(error):
            where = f" {error.filename}" if error.filename else ""
            raise StorageError(f"logger.tracking_uri={uri}: cannot write{where} ({error.strerror}); make its folder "
                               f"writable or choose another store, then {again}{created}") from error
        raise ConfigError(
            f"logger.tracking_uri={uri}: cannot use this MLflow store ({short_error(error)}); "
            f"use sqlite:///mlruns.db, an http://host:port tracking server, or set MLFLOW_TRACKING_URI{created}"
        ) from error


_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
_written_workspace: str | None = None  # the value this process wrote: the next run of a sweep may change it


def limit_cublas_workspace(mib: float | None) -> None:
    """`trainer.cublas_workspace_mib`: the size of the workspace cuBLAS gets for each thread and stream it runs on
    (a training step has two: the forward's and autograd's), through `CUBLAS_WORKSPACE_CONFIG` (read by torch
    whenever it allocates one), unless the user set that variable.

    torch gives Hopper GPUs 32 MiB, other GPUs 8 MiB, from the caching allocator, so it counts in the peak memory;
    the pipeline's matmuls (a batch of 32 against at most a few hundred thousand columns) leave most of it unused.
    """
    global _written_workspace
    current = os.environ.get(_WORKSPACE)
    if current is not None and current != _written_workspace:
        return  # the user's own
    if mib is None:
        os.environ.pop(_WORKSPACE, None)
        _written_workspace = None
    else:
        _written_workspace = os.environ[_WORKSPACE] = f":{max(1, round(mib * 1024))}:1"  # :KiB:count


@contextlib.contextmanager
def sigterm_ends_the_run(progress: dict):
    """A SIGTERM raises SIGTERMException wherever the run is, so the run ends FAILED with one line instead of the
    process dying with the run left RUNNING (Lightning's own handler covers `trainer.fit` only). Inside fit, Lightning
    calls this handler after its own, which has noted the signal: its loops then stop where they can (under DDP at the
    batch where the ranks agree on it, `SigtermStopsEveryRank`)."""
    def on_sigterm(signum, frame):
        if not sigterm_noted(progress.get("trainer")):  # Lightning's handler has not taken it (inside fit it has)
            raise SIGTERMException()

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interruptions_deferred():
    """SIGTERM and Ctrl+C only noted while the MLflow run is being created or reopened: raised there, they would
    leave a run RUNNING that no tracker can close. Yields the list of signals that came; the caller raises them
    once it can end the run FAILED, or while it waits for a busy store before anything of the run is written
    (`open_run`): that wait may last minutes."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield received
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}  # fmt: skip
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_deferred(received: list[int]) -> None:
    if signal.SIGTERM in received:
        raise SIGTERMException()
    if received:
        raise KeyboardInterrupt()


def run(cfg: DictConfig) -> dict:
    """Train and test one configuration (or continue one, `resume=`); returns the final metrics and run id."""
    cfg, resume_from, run_id = prepare(cfg, explicit_settings(), multirun=bool(sweep_tags()))
    validate(cfg)
    limit_cublas_workspace(cfg.trainer.get("cublas_workspace_mib"))  # before the first matmul on a GPU
    if launch_rank() != 0:  # a further DDP rank: trains in step with rank 0, which alone records the run
        return _fit_and_test(cfg, None, CHECKPOINT_ROOT / "other-rank", resume_from, {})
    progress: dict = {}  # the trainer, once there is one: for the step a failure happened at
    with sigterm_ends_the_run(progress):
        results = _run_and_record(cfg, resume_from, run_id, progress)
    results["config"] = cfg  # what ran: a resumed run's own settings, which the summary describes
    return results


def _run_and_record(cfg: DictConfig, resume_from: Path | None, run_id: str | None, progress: dict) -> dict:
    """Rank 0: open (or reopen) the MLflow run, train and test; the run always ends FINISHED or FAILED."""
    # One writer per run: a resumed run's locks are taken before its MLflow run is touched.
    locks = _hold_resumed(resume_from, run_id) if resume_from else []
    try:
        with interruptions_deferred() as interrupted:
            tracker = open_run(cfg, run_id, interrupted, tuple(writer_tag(lock.path) for lock in locks))
    except BaseException as error:
        _release(locks)
        if isinstance(error, (KeyboardInterrupt, SIGTERMException)):  # while waiting for a busy store
            created = getattr(error, "unopened_run", None)  # the run was created, then its setup waited
            error.run_failure = (f"interrupted ({interruption(error)}) " + (
                f"while the MLflow run was being opened; {created}" if created else
                "before the MLflow run was opened; nothing was recorded"))
        raise
    checkpoint_dir = resume_from.parent if resume_from else CHECKPOINT_ROOT / tracker.run_id
    try:
        raise_deferred(interrupted)  # a signal that came while the run was opening: it ends FAILED here
        if not locks:  # a new run: the lock also marks its folder, for resume to tell a dead run from a live one
            locks = [checkpoints.hold_run(checkpoint_dir, tracker.run_id)]
        if sweep_tags():  # a sweep's job: its launcher may kill it before it can close its run (Ctrl+C, joblib)
            note_started(tracker.run_id, tracker.tracking_uri, checkpoint_dir)
        tracker.log_config(
            cfg,
            {"table": cfg.table, "scale": cfg.scale, "git_commit": git_commit(), "dataset": cfg.dataset.name,
             WRITER: writer_tag(locks[0].path), **sweep_tags()},  # a resume from elsewhere checks this lock
        )
        return _fit_and_test(cfg, tracker, checkpoint_dir, resume_from, progress)
    except BaseException as error:  # KeyboardInterrupt included: the run must not stay RUNNING
        if tracker.closed_as == "FINISHED":  # e.g. a signal after the run was recorded: it stays FINISHED
            stopped = failure_message(error).split(";")[0]
            error.run_failure = f"{stopped} after run {tracker.run_id} had FINISHED; its results are recorded"
            raise
        trainer = progress.get("trainer")
        tags = {"failed_at_step": trainer.global_step} if trainer is not None else {}
        message = failure_message(error, tracker.run_id, checkpoint_dir / checkpoints.LAST, tracker.tracking_uri)
        # A store found locked for the whole retry window: a few seconds more, not another window on the same lock.
        retry = tracking.CLOSE_RETRY_SECONDS if is_contention(error) else None
        try:
            tracker.finish("FAILED", message, tags, retry_seconds=retry)
        except Exception as store_error:  # e.g. the store's disk is full too: say so in the same line
            message += f"; {left_running([tracker.run_id], [short_error(store_error)[:200]])}"
        except (KeyboardInterrupt, SIGTERMException) as again:  # a second Ctrl+C while a slow store is written
            message += (f"; {interruption(again)} again while the MLflow run was being marked FAILED: it shows "
                        f"RUNNING; resume={tracker.run_id} continues or closes it")
        if unwritable(error) and not isinstance(error, UserError):  # one line, like other storage errors
            error = StorageError(message)
            error.run_failure = message
            raise error from None
        error.run_failure = message  # what the command line prints: the same line as the run's tag
        raise
    finally:
        _release(locks)


def _hold_resumed(resume_from: Path, run_id: str) -> list[checkpoints.RunLock]:
    """The writer locks of a resumed run: its checkpoint's folder's and, when that checkpoint is a copy elsewhere
    (`resume=backup/last.ckpt`), the run's own folder's here, whose process may still be writing the run."""
    folders = [resume_from.parent]
    own = CHECKPOINT_ROOT / run_id
    if own.is_dir() and own.resolve() != resume_from.parent.resolve():
        folders.append(own)
    locks = []
    try:
        for folder in folders:
            locks.append(checkpoints.hold_run(folder, run_id))
    except BaseException:
        _release(locks)
        raise
    return locks


def _release(locks: list[checkpoints.RunLock]) -> None:
    for lock in locks:
        lock.release()


def restores_best(restore_best: str, early_stop) -> bool:
    """Whether the run is tested with its best epoch's weights: `always`, or with `early_stop` (the authors' Keras 2
    EarlyStopping) only when early stopping ended the run; a run that reached max_epochs is tested as it ends."""
    return restore_best == "always" or (early_stop is not None and early_stop.stopped_epoch > 0)


class _TagsTheDevice(pl.Callback):
    """The run's `device` tag again once fit has set up its processes, where that changed it: DDP on the CPU gives
    each rank its share of the threads."""

    def __init__(self, tracker, device, tagged: str):
        self.tracker, self.device, self.tagged = tracker, device, tagged

    def on_fit_start(self, trainer, pl_module):
        if device_name(self.device) != self.tagged:  # one store write less for every other run
            self.tracker.set_tags({"device": device_name(self.device)})


def _fit_and_test(cfg, tracker, checkpoint_dir: Path, resume_from: Path | None, progress: dict) -> dict:
    """Fit, then (with a tracker: on DDP rank 0 only) test and record; other ranks return {} after fit."""
    from xmc_repro.sparse import backend, repeated_connections_pct

    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    dm = build_datamodule(
        cfg.dataset,
        batch_size=int(cfg.trainer.batch_size),
        num_workers=int(cfg.trainer.num_workers),
        seed=int(cfg.seed),
        validate_on=cfg.validate_on,
        eval_batch_size=int(cfg.trainer.eval_batch_size),
        shuffle_buffer=cfg.trainer.get("shuffle_buffer"),  # absent in runs from before it: a uniform permutation
        # Pinned batches copy to the GPU without waiting for it; from pageable memory each copy syncs the host.
        pin_memory=_on_cuda(cfg),
    )
    started = time.perf_counter()
    if tracker is not None:  # generating or reading 670k-label data takes up to a minute: say what is going on
        print(f"data: {cfg.dataset.name}, loading ...", flush=True)
    dm.setup("fit")
    if tracker is not None:
        print(f"data: {dm.num_train_points:,} training and {dm.test_split.num_points:,} test points, "
              f"{dm.num_features:,} features, {dm.num_labels:,} labels ({time.perf_counter() - started:.1f} s)",
              flush=True)
    check_memory(cfg, dm)  # before the model is built: one that cannot fit would be OOM-killed without a word
    check_train_batches(cfg, dm)
    if tracker is not None:
        tracker.log_dataset(cfg.dataset, dm)
        # File-backed datasets learn their sizes from the files: the report needs them for the state bytes.
        tracker.log_params({f"dataset/{key}": getattr(dm, key) for key in ("num_features", "num_labels")
                            if key not in cfg.dataset})
    model = build_model(cfg, dm)

    info = {"config": OmegaConf.to_yaml(cfg, resolve=True), "run_id": tracker.run_id if tracker else None}
    callbacks = build_callbacks(cfg, checkpoint_dir, info)
    t = cfg.trainer
    trainer = pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=instantiate(t.strategy) if OmegaConf.is_dict(t.strategy) else t.strategy,  # e.g. trainer=ddp
        num_nodes=int(t.get("num_nodes", 1)),
        precision=t.precision,
        max_epochs=int(t.max_epochs),
        limit_train_batches=t.limit_train_batches,
        callbacks=list(callbacks.values()),
        logger=tracker.lightning_logger() if tracker else False,
        enable_progress_bar=bool(t.progress_bar),
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
        use_distributed_sampler=False,  # the DataModule gives each DDP rank its share of every global batch
        plugins=[checkpoints.SafeCheckpointIO(model)],  # loads nothing unchecked, writes without a memory copy
    )
    progress["trainer"] = trainer
    if (trainer.global_rank == 0) != (tracker is not None):
        raise RuntimeError(f"DDP rank {trainer.global_rank} disagrees with the launch environment (rank {launch_rank()})")
    device = trainer.strategy.root_device
    trainer.callbacks.append(checkpoints.RandomStateKeptThroughSetup())  # a DDP run draws what one process draws
    if tracker is None:  # checkpoints (rank 0 writes them; the folder is rank 0's) and logging are rank 0's
        trainer.fit(model, datamodule=dm, ckpt_path=resume_from)
        if sigterm_noted(trainer):  # the ranks stopped together at the end of training, or it came after that
            raise SIGTERMException()
        return {}
    tracker.set_tags(
        {
            "sparse_backend": backend(device) if cfg.model.head in ("uniform", "mach") else "none",
            "device": device_name(device),
            "world_size": trainer.world_size,
        }
    )
    trainer.callbacks.append(_TagsTheDevice(tracker, device, device_name(device)))
    trainer.fit(model, datamodule=dm, ckpt_path=resume_from)
    if sigterm_noted(trainer):  # flagged after the loops' last look (e.g. in on_train_end): fit returned normally
        raise SIGTERMException()

    best = callbacks["best"].best_model_path
    if best and restores_best(t.get("restore_best", BEFORE_THE_SETTING["restore_best"]), callbacks.get("early_stop")):
        # Via the host: the checkpoint also holds Adam's moments, which must not count as GPU memory.
        model.load_state_dict(checkpoints.load_checked(best, model, "best checkpoint")["state_dict"])
        tested_weights = "best epoch"
    else:
        tested_weights = "last epoch"
    tracker.set_tags({"tested_weights": tested_weights})
    model.to(device)
    inv_prop = model.val_metrics.inv_propensity
    evaluate = functools.partial(model.evaluate, inv_propensity=inv_prop, precision=trainer.precision_plugin)
    shown = EvaluationProgress(bool(t.progress_bar))  # minutes at 670k labels on a CPU: never a silent terminal
    with contextlib.closing(shown.track(dm.test_dataloader(), "Test")) as batches:  # a bar ends with its loop or error
        test = evaluate(batches)
    train_points = dm.train_eval_dataloader(max_points=t.train_eval_max_points)
    with contextlib.closing(shown.track(train_points, "Train P@k")) as batches:
        train = evaluate(batches)
    callbacks["memory"].update(model)
    results = {f"test/{k}": v for k, v in test.items()}
    results.update({f"train/{k}": v for k, v in train.items()})
    # A run resumed after its last epoch validates nothing itself: the checkpoint knows the count.
    results["epochs"] = max(callbacks["time"].epochs, callbacks["last"].epochs_done)
    results["time_per_epoch_s"] = callbacks["time"].fit_seconds / max(results["epochs"], 1)
    if callbacks["time"].step_ms_median is not None:
        results["train/ms_per_step_median"] = callbacks["time"].step_ms_median
    if callbacks["memory"].peak_gib is not None:
        results["peak_gpu_memory_gib"] = callbacks["memory"].peak_gib
    # Exact sizes of what training holds besides activations (Adam adds two moments per parameter).
    results["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    results["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.head.buffers())
    placed = [layer for layer in model.sparse_layers() if hasattr(layer, "positions")]  # a user's head may not say
    if placed:  # drawn with replacement, an unstructured layer's connections pile up (README)
        results["sparse/repeated_connections_pct"] = repeated_connections_pct(placed)
    # At the last step, not 0: MLflow's value of a metric is the one at its highest step, and the per-epoch
    # peak_gpu_memory_gib lies at the epochs' steps, below the peak testing may reach.
    tracker.log_metrics(results, step=trainer.global_step)
    tracker.finish("FINISHED")
    results["run_id"] = tracker.run_id
    results["ui"] = tracker.browse_hint()
    results["device"] = device_name(device)  # as tagged at the start of fit
    results["tested_weights"] = tested_weights
    return results
