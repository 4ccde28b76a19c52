"""MLflow bookkeeping of one run: params, tags, the resolved config, final metrics and status.

The model knows nothing of MLflow; per-epoch metrics reach the same run through Lightning's MLFlowLogger,
whose own `finalize` is disabled so that only `RunTracker.finish` decides FINISHED or FAILED.

Many jobs of a sweep may write one sqlite store at once. SQLite lets one writer in at a time; MLflow waits up
to 20 s for the lock (busy_timeout), but a transaction that read before it writes gets "database is locked" at
once when another process is writing, and several processes creating a fresh store race on its schema. So:
every write here retries with exponential backoff and jitter (`with_retries`) while the error is lock
contention, and the first contact with a store (schema creation, the experiment) happens under an exclusive
file lock beside the database. We keep SQLite's default journal rather than WAL: WAL needs shared memory,
which breaks when the database sits on a network filesystem, as it does for sweeps over cluster nodes; and we
need no tracking server process that would have to outlive every job. A team that sweeps at scale points
`logger.tracking_uri` at an MLflow server instead; nothing here changes for that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import random
import re
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from xmc_repro.errors import ConfigError, left_running
from xmc_repro.report.records import RESUMED_PREFIX, STARTED_BY, WRITER
from xmc_repro.validation import callback_wiring

try:
    import fcntl
except ImportError:  # not POSIX: no lock, the retries still apply
    fcntl = None

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
RETRY_SECONDS = 600.0  # give up on a locked store after this long
# Closing a run that failed because its store stayed locked for RETRY_SECONDS: a few more seconds, not another
# RETRY_SECONDS on the same lock (each try may also wait out SQLite's own busy timeout, 20 s in MLflow).
CLOSE_RETRY_SECONDS = 5.0
WAIT_NOTICE_SECONDS = 10.0  # a wait for a locked store longer than this is said on stderr, once
_CONTENTION = ("database is locked", "database table is locked", "database schema has changed",
               # two jobs logging the same dataset at once: the loser's retry finds the row and links to it
               "unique constraint failed: datasets.")
_jitter = random.Random()  # its own generator: retries must not move the global RNG that training uses
TAG_KEYS = ("table", "scale")  # config keys recorded as tags (what the report filters on), not as params
LOGGED_TARGETS = ("model/_target_", "loss/_target_")  # the classes and functions that are params (`run_params`)


def run_params(cfg: DictConfig) -> dict[str, str]:
    """The params of a run: its resolved config flattened with `/`, each setting once.

    Not: the callbacks' wiring (their values are model/dataset/trainer settings, logged there: judged from the
    callback's file, since a resumed run's stored config holds them resolved), the classes objects are built from
    (but the head's class and the loss's function, `LOGGED_TARGETS`: a head or loss file of one's own may share
    another's `head` or `name`, and the report tells the two apart by them), the names derived from other settings,
    and `table`/`scale` (tags). The callbacks' own settings are params (`callbacks/best/monitor`), and `callbacks`
    names those in use, in order (`~callbacks.early_stop` shows there).
    """
    wired = {f"callbacks/{name}/{key}" for name in cfg.get("callbacks") or {} for key in callback_wiring(name)}
    params = {key: value for key, value in flatten(cfg).items()
              if key not in TAG_KEYS and key not in wired and key not in ("model/label", "model/description")
              and (key in LOGGED_TARGETS or key.rsplit("/", 1)[-1] not in ("_target_", "_partial_"))}
    params["callbacks"] = ",".join(cfg.get("callbacks") or {})
    return params


# Without this experiment tag MLflow 3's UI opens an experiment on its (empty) GenAI overview, not the runs table.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# A tracking server that does not answer is reported within seconds, not after MLflow's default 7 retries
# with exponential backoff and a 120 s timeout per request (over five minutes of silence).
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
CONNECT_SECONDS = 5.0


def is_contention(error: BaseException) -> bool:
    """Whether an MLflow/SQLAlchemy error is a busy SQLite database (worth retrying), not a real failure."""
    text = f"{error} {error.__cause__ or ''}".lower()
    return any(marker in text for marker in _CONTENTION)


# MLflow's run ids (mlflow.utils.validation._RUN_ID_REGEX): a store refuses any other id as INVALID_PARAMETER_VALUE.
RUN_ID = re.compile(r"[a-zA-Z0-9][\w\-]{0,255}")


def no_such_run(error: BaseException, run_id: str) -> bool:
    """Whether an MLflow error says the store holds no run `run_id`. A store answers RESOURCE_DOES_NOT_EXIST for an
    id it has no run of, INVALID_PARAMETER_VALUE for one that cannot be a run id; the latter code is also its answer
    to other refused requests (a write to a deleted run, a value too long), so for a run id it means nothing here."""
    code = getattr(error, "error_code", None)
    return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and not RUN_ID.fullmatch(run_id))


def short_error(error: BaseException) -> str:
    """`Type: text` of an error in one line; for a database error the driver's own words (`OperationalError: database
    is locked`), not SQLAlchemy's statement and parameters (over a thousand characters)."""
    cause = error
    while cause is not None:
        if isinstance(getattr(cause, "orig", None), BaseException):  # SQLAlchemy's DBAPIError, maybe wrapped by MLflow
            error = cause.orig
            break
        cause = cause.__cause__
    text = " ".join(str(error).split("[SQL:")[0].split())  # a tracking server's text may still carry the statement
    return f"{type(error).__name__}: {text}"[:300]


def with_retries(fn, *args, while_waiting=None, deadline=None, **kwargs):
    """fn(*args, **kwargs), retried with exponential backoff and jitter while the store is locked, until `deadline`
    (`time.monotonic()`; default RETRY_SECONDS from now).

    `while_waiting()`, if given, is called after each failed attempt and each wait; it may raise to give up (a Ctrl+C
    that came meanwhile: a failed attempt wrote nothing)."""
    delay = 0.05
    began = time.monotonic()
    if deadline is None:
        deadline = began + RETRY_SECONDS
    notice = None  # made at the first wait only: every metric a run logs comes through here
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            if not is_contention(error) or time.monotonic() > deadline:
                raise
            notice = notice or _WaitNotice(began, deadline, "the MLflow store is locked by another process")
            notice.say()
            if while_waiting is not None:
                while_waiting()
            time.sleep(delay * (0.5 + _jitter.random()))
            if while_waiting is not None:
                while_waiting()
            delay = min(2 * delay, 5.0)


class _WaitNotice:
    """One stderr line once a wait for a locked store has lasted WAIT_NOTICE_SECONDS: it may last minutes."""

    def __init__(self, began: float, deadline: float, why: str):
        self.began, self.deadline, self.why, self.said = began, deadline, why, False

    def say(self) -> None:
        now = time.monotonic()
        if self.said or now - self.began < WAIT_NOTICE_SECONDS:
            return
        self.said = True
        print(f"waiting: {self.why}; retrying for up to {max(self.deadline - now, 0):.0f} s more", file=sys.stderr,
              flush=True)


def mark_failed(client, run_id: str, message: str, deadline: float | None = None) -> None:
    """Tag a run's one-line `message` as `error` and close it FAILED, each write retried as `with_retries` does."""
    with_retries(client.set_tag, run_id, "error", message, deadline=deadline)
    with_retries(client.set_terminated, run_id, "FAILED", deadline=deadline)


@contextmanager
def _quiet(*loggers: str):
    """Only warnings and errors from these loggers meanwhile (or less, where a logger was quieter already)."""
    saved = [(log, log.level) for log in map(logging.getLogger, loggers)]
    for log, level in saved:
        log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        for log, level in saved:
            log.setLevel(level)


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI (None for other stores and in-memory databases)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///") :].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def not_a_store(path: Path) -> str | None:
    """Why the existing file `path` is no MLflow sqlite store, or None when it is one. For tools that only read
    runs: MLflow writes its whole schema into any SQLite file it is given (another project's database, an empty
    file), so the file is looked at read-only first."""
    import sqlite3

    try:
        db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.Error as error:
        return f"not an SQLite database ({error})"
    if not {"alembic_version", "experiments", "runs"} <= tables:
        return "an SQLite database without MLflow's tables (another program's, or empty)"
    return None


@contextmanager
def store_lock(tracking_uri: str, while_waiting=None):
    """Exclusive lock on `<db>.lock` while a process first touches a sqlite store (schema, experiment).

    The lock is polled, for up to RETRY_SECONDS as a locked database is (a process stopped with Ctrl+Z while it held
    the lock kept every new run waiting without a word); `while_waiting()`, if given, is called between tries (see
    `with_retries`): a blocking flock would hold a deferred Ctrl+C for as long as another process waits."""
    path = sqlite_path(tracking_uri)
    if path is None or fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    began = time.monotonic()
    deadline = began + RETRY_SECONDS
    notice = _WaitNotice(began, deadline, f"another process holds {lock}")
    with open(lock, "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # worded as SQLite's lock, which it guards: `is_contention`
                    raise TimeoutError(f"database is locked: another process holds {lock}") from None
                notice.say()
                if while_waiting is not None:
                    while_waiting()
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def started_by() -> str:
    """`<pid>@<host>:<folder>`: the process creating a run, for the tag STARTED_BY."""
    return f"{os.getpid()}@{platform.node()}:{Path.cwd().resolve()}"


def writer_tag(lock: Path) -> str:
    """`<host>:<lock file>`: the writer lock (checkpoints.RunLock) held by the process writing a run (tag WRITER)."""
    return f"{platform.node()}:{Path(lock).resolve()}"


def create_store_whole(tracking_uri: str) -> None:
    """Create a sqlite store that does not exist yet in a temporary file, renamed into place once MLflow's schema is
    complete. MLflow's migrations are not one transaction (some commit part-way): a process killed among them
    would leave a store that every later run refuses ("table ... already exists"). Call under `store_lock`."""
    path = sqlite_path(tracking_uri)
    if path is None or path.exists():
        return
    tmp = path.with_name(path.name + ".init.tmp")
    for leftover in (tmp, tmp.with_name(tmp.name + "-journal")):  # from a process killed while creating it
        leftover.unlink(missing_ok=True)
    query = tracking_uri.partition("?")[1:]
    tmp_uri = f"sqlite:///{tmp}{''.join(query)}"
    client = MlflowClient(tmp_uri)
    client.search_experiments()  # creates the schema
    engine = getattr(getattr(getattr(client, "_tracking_client", None), "store", None), "engine", None)
    if engine is not None:
        engine.dispose()  # no connection left open on the file being renamed
    os.replace(tmp, path)


def check_store(tracking_uri: str, setting: str = "logger.tracking_uri=") -> None:
    """Fail fast, in one line starting with `setting` and the URI, where MLflow would spend minutes retrying: a
    sqlite store whose file is a folder, or an http(s) server that does not answer (MLflow's retries are bounded
    unless set in the environment)."""
    path = sqlite_path(tracking_uri)
    if path is not None and (path.is_dir() or any(p.exists() and not p.is_dir() for p in path.parents)):
        raise ConfigError(f"{setting}{tracking_uri}: {path} is a folder or lies under a file, not a database; "
                          "name a database file, e.g. sqlite:///mlruns.db")
    if not tracking_uri.startswith(("http://", "https://")):
        return
    for name, value in HTTP_LIMITS.items():
        os.environ.setdefault(name, value)
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=CONNECT_SECONDS).close()
    except urllib.error.HTTPError:
        pass  # it answers (a server without /health, or behind a proxy): MLflow itself will tell the rest
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        raise ConfigError(
            f"{setting}{tracking_uri}: the tracking server does not answer ({reason}); start it "
            "(mlflow server --host 0.0.0.0 --port 5000 ...), fix the address, or use sqlite:///mlruns.db"
        ) from None


def flatten(cfg, prefix: str = "") -> dict[str, str]:
    """Resolved config as `{'model/head': 'uniform', ...}`."""
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    flat: dict[str, str] = {}
    for key, value in container.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = str(value)[:MAX_PARAM_CHARS]
    return flat


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    """HEAD's short hash, "-dirty" appended when tracked files other than results differ from it (the code run is
    then not that commit).

    `XMC_GIT_COMMIT`, when set, is taken instead: for a copy of a working tree whose git metadata is not the code's
    (scripts/gpu_all.sh on a lent machine is given the commit it was sent at)."""
    given = os.environ.get("XMC_GIT_COMMIT", "").strip()
    if given:
        return given
    head = _git("rev-parse", "--short=12", "HEAD")
    # results/ and dvc.lock are what `records add` and `dvc repro` rewrite between sweeps, read by no run: changed,
    # they made every later run "-dirty" ("no commit reproduces them") with the code at HEAD
    code = ("--", ".", ":(exclude)results", ":(exclude)dvc.lock")
    if head and _git("status", "--porcelain", "--untracked-files=no", *code):
        head += "-dirty"
    return head or "unknown"


def device_name(accelerator_device) -> str:
    """What the run ran on, for the tables: the CUDA card's name, or the CPU."""
    import torch

    if accelerator_device is not None and accelerator_device.type == "cuda":
        return torch.cuda.get_device_name(accelerator_device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


class RunTracker:
    """One MLflow run: created (or reopened for `resume`), filled, and closed with a status.

    Every call to the store goes through `with_retries` (see the module docstring).
    """

    def __init__(self, tracking_uri: str, experiment_name: str, run_id: str | None = None, run_name: str | None = None,
                 raise_pending=None, held: tuple[str, ...] = ()):
        """`raise_pending()`, if given, raises a signal deferred while the run opens (`train.interruptions_deferred`);
        it is called while the store is busy and nothing of the run is written yet, so waiting stays interruptible.
        `held`: the `writer_tag`s of the writer locks this process holds for the run it reopens."""
        self.tracking_uri = tracking_uri
        self.held = held
        self.closed_as: str | None = None  # the status `finish` gave the run
        self.reopened = run_id is not None  # a resumed run: what it logged before may be logged again
        check_store(tracking_uri)
        with store_lock(tracking_uri, raise_pending), _quiet("mlflow.store.db.utils", "alembic"):  # schema chatter
            create_store_whole(tracking_uri)
            # MLflow's client reads the schema as it is made: it too may find the store locked
            self.client = with_retries(MlflowClient, tracking_uri, while_waiting=raise_pending)
            # A resumed run stays in its own experiment (set by _reopen), whatever logger.experiment_name says now
            self.experiment_id = (with_retries(self._experiment, experiment_name, while_waiting=raise_pending)
                                  if run_id is None else None)
        if run_id is None:
            # created with the process that made it, so that a kill before its folder exists can be told apart
            # from a run still starting (resume.close_unstarted)
            run_id = with_retries(self.client.create_run, self.experiment_id, run_name=run_name,
                                  tags={STARTED_BY: started_by()}, while_waiting=raise_pending).info.run_id
            try:
                if run_name:  # a piece of the id keeps names unique when a configuration runs again
                    with_retries(self.client.update_run, run_id, name=f"{run_name} {run_id[:4]}",
                                 while_waiting=raise_pending)
            except BaseException as error:  # no tracker will close the run: close it here, or name it
                error.unopened_run = self._close_unopened(run_id, error)
                raise
        else:
            self._reopen(run_id, raise_pending)
        self.run_id = run_id

    def _close_unopened(self, run_id: str, error: BaseException) -> str:
        """Mark FAILED a run created but not set up; the clause that says what became of it. Briefly
        (CLOSE_RETRY_SECONDS): the store has just refused a write, maybe after a whole RETRY_SECONDS."""
        why = short_error(error) if isinstance(error, Exception) else "interrupted"
        deadline = time.monotonic() + CLOSE_RETRY_SECONDS
        try:
            mark_failed(self.client, run_id, f"the run could not be set up ({why})", deadline)
        except Exception as close_error:
            return left_running([run_id], [short_error(close_error)[:200]],
                                f"resume={run_id} closes it, from this folder on this machine")
        return f"the new MLflow run {run_id} is marked FAILED"

    def _experiment(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment:
            if EXPERIMENT_KIND[0] not in experiment.tags:  # made by an older version or another tool
                self.client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, tags=dict([EXPERIMENT_KIND]))
        except MlflowException as error:  # another job of the sweep created it meanwhile (a tracking server)
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.client.get_experiment_by_name(name).experiment_id

    def _reopen(self, run_id: str, raise_pending=None) -> None:
        try:
            run = with_retries(self.client.get_run, run_id, while_waiting=raise_pending)
        except MlflowException as error:
            if not no_such_run(error, run_id):  # e.g. a store still locked: not a wrong store
                raise
            raise ConfigError(
                f"resume: MLflow run {run_id} is not in {self.tracking_uri}; set logger.tracking_uri "
                "(or MLFLOW_TRACKING_URI) to the store the run was started with"
            ) from None
        if run.info.status == "FINISHED":
            raise ConfigError(f"resume={run_id}: that run already FINISHED; start a new run (without resume=)")
        if run.info.lifecycle_stage == "deleted":  # MLflow refuses every write to it
            raise ConfigError(f"resume={run_id}: that MLflow run was deleted; restore it to continue it (mlflow runs "
                              f"restore --run-id {run_id}, with MLFLOW_TRACKING_URI={self.tracking_uri}), or start a "
                              "new run (without resume=)")
        self._refuse_a_live_writer(run)
        self.experiment_id = run.info.experiment_id  # the runs table the summary links to is the run's
        # The status first: until it is written, giving up on a busy store leaves the run as it was.
        with_retries(self.client.update_run, run_id, status="RUNNING", while_waiting=raise_pending)
        try:
            for tag in ("error", "failed_at_step"):  # the failure it resumes from is history now
                if tag in run.data.tags:
                    with_retries(self.client.delete_tag, run_id, tag)
            resumed = int(run.data.tags.get("resumed", 0)) + 1
            with_retries(self.client.log_batch, run_id, tags=[RunTag("resumed", str(resumed))])
        except BaseException:  # no tracker will close it: its status as it was (if the store takes that write)
            with suppress(Exception):
                self.client.update_run(run_id, status=run.info.status)
            raise

    def _refuse_a_live_writer(self, run) -> None:
        """ConfigError when another process on this machine writes the run, maybe from another folder (a copy of its
        checkpoint resumed elsewhere): its lock, named by the tag WRITER, is held. Before anything is written."""
        writer = run.data.tags.get(WRITER, "")
        host, _, lock = writer.partition(":")
        if run.info.status != "RUNNING" or host != platform.node() or not lock or writer in self.held:
            return
        from xmc_repro.checkpoints import RunLock, written_elsewhere

        holder = RunLock(Path(lock).parent)
        if holder.is_held():
            raise written_elsewhere(run.info.run_id, holder)

    def status(self) -> str:
        return with_retries(self.client.get_run, self.run_id).info.status

    def log_config(self, cfg: DictConfig, tags: dict[str, str]) -> None:
        """Params: the resolved config flattened with `/`, once each; `table` and `scale` go to `tags`. MLflow keeps
        a param's first value: a setting that a resume changed (e.g. trainer.max_epochs) is the tag
        `resumed/<key>`, which the report reads in place of the param (`records.used_params`)."""
        params = [Param(k, v) for k, v in run_params(cfg).items()]
        run = with_retries(self.client.get_run, self.run_id)
        existing = run.data.params
        changed = {f"{RESUMED_PREFIX}{p.key}": p.value for p in params
                   if p.key in existing and existing[p.key] != p.value and p.key != "resume"}  # fmt: skip
        started_at = run.data.tags.get("git_commit")
        if started_at and tags.get("git_commit", started_at) != started_at:  # resumed from other code: keep both
            tags = {**tags, "git_commit": started_at, "git_commit_resumed": tags["git_commit"]}
        params = [p for p in params if p.key not in existing]
        for start in range(0, len(params), 100):  # MLflow's batch limit
            with_retries(self.client.log_batch, self.run_id, params=params[start : start + 100])
        self.set_tags({**tags, **changed})
        with_retries(self.client.log_text, self.run_id, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")

    def log_params(self, params: dict) -> None:
        """Params learnt only once the data is read (a data file's sizes); kept as they are on a resumed run."""
        existing = with_retries(self.client.get_run, self.run_id).data.params
        batch = [Param(k, str(v)) for k, v in params.items() if k not in existing]
        if batch:
            with_retries(self.client.log_batch, self.run_id, params=batch)

    def set_tags(self, tags: dict[str, str | None], deadline: float | None = None) -> None:
        tag_list = [RunTag(k, str(v)) for k, v in tags.items() if v is not None]
        if tag_list:
            with_retries(self.client.log_batch, self.run_id, tags=tag_list, deadline=deadline)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        """Log at `step`; in a reopened run, a value already logged at that step is not logged again (a run killed
        after recording its final results, before being marked FINISHED, records them again when resumed). A new
        value is logged: a run resumed with a larger trainer.max_epochs tests other weights."""
        now = int(time.time() * 1000)
        if self.reopened:
            metrics = {k: v for k, v in metrics.items() if v is None or (step, float(v)) not in
                       {(m.step, m.value) for m in with_retries(self.client.get_metric_history, self.run_id, k)}}
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        if batch:
            with_retries(self.client.log_batch, self.run_id, metrics=batch)

    def lightning_logger(self) -> MLFlowLogger:
        return _RunOwnedMLFlowLogger(tracking_uri=self.tracking_uri, run_id=self.run_id, resumed=self.reopened)

    def finish(self, status: str = "FINISHED", message: str | None = None, tags: dict[str, str] | None = None,
               retry_seconds: float | None = None) -> None:
        """Close the run; a FAILED run gets the one-line `message` as tag `error` (plus any `tags`). `retry_seconds`:
        how long a locked store is waited for, all writes together (default RETRY_SECONDS each)."""
        deadline = None if retry_seconds is None else time.monotonic() + retry_seconds
        extra = dict(tags or {})
        if message:
            extra["error"] = message[:5000]
        self.set_tags(extra, deadline)
        with_retries(self.client.set_terminated, self.run_id, status, deadline=deadline)
        self.closed_as = status

    def log_dataset(self, dataset_cfg: DictConfig, datamodule) -> None:
        """The data as an MLflow dataset input (the runs table's Dataset column): name, digest, sizes."""
        existing = with_retries(self.client.get_run, self.run_id).inputs.dataset_inputs
        entity = dataset_entity(dataset_cfg, datamodule)
        if existing:  # a resumed run logged it already: it must go on with the same files (synthetic data: its settings)
            digests = sorted({item.dataset.digest for item in existing})
            if entity.digest not in digests and dataset_cfg.get("kind") != "synthetic":
                raise ConfigError(
                    f"resume: the data read now (digest {entity.digest}) differs from what run {self.run_id} trained "
                    f"on (digest {', '.join(digests)}); restore the files it was started with, or start a new run"
                )
            return
        context = InputTag("mlflow.data.context", "training")
        with_retries(self.client.log_inputs, self.run_id, [DatasetInput(entity, [context])])

    def ui_command(self) -> str:
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"

    def runs_table_url(self) -> str:
        """The experiment's runs table: on the tracking server itself, or on a local `mlflow ui`."""
        base = self.tracking_uri if self._served() else UI_ADDRESS
        return f"{base.rstrip('/')}/#/experiments/{self.experiment_id}/runs"

    def browse_hint(self) -> str:
        """How to look at the runs: the runs table's address (after starting `mlflow ui` for a local store)."""
        if self._served():
            return self.runs_table_url()
        return f"{self.ui_command()}, then open {self.runs_table_url()}"

    def _served(self) -> bool:
        return self.tracking_uri.startswith(("http://", "https://"))


UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


def _files_read(datamodule) -> list[Path]:
    """The data files behind the splits: each split's `source` names its file(s), joined by ' + '."""
    files = []
    for split in (datamodule.train_split, datamodule.test_split):
        files += [Path(part) for part in split.source.split(" + ") if Path(part).is_file()]
    return files


def dataset_entity(dataset_cfg: DictConfig, datamodule) -> Dataset:
    """An MLflow dataset whose digest tells data apart: the bytes of the files read, or for synthetic data
    its generating settings (two copies of "the same" dataset that differ in content get different digests)."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    from xmc_repro.describe import dataset_label

    plain = OmegaConf.to_container(dataset_cfg, resolve=True)
    digest = hashlib.sha256()
    if plain.get("kind") == "synthetic":
        from xmc_repro.data.synthetic import SyntheticSpec

        settings = dataclasses.asdict(SyntheticSpec.from_config(plain))
        digest.update(json.dumps(settings, sort_keys=True).encode())
        source = CodeDatasetSource({"generator": "xmc_repro.data.synthetic", **{k: str(v) for k, v in settings.items()}})
    else:
        files = _files_read(datamodule)
        for path in files:
            with open(path, "rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
        source = LocalArtifactDatasetSource(os.path.commonpath([str(f.absolute()) for f in files]) if files else "")
    profile = {
        "train_points": datamodule.train_split.num_points,
        "test_points": datamodule.test_split.num_points,
        "features": datamodule.num_features,
        "labels": datamodule.num_labels,
        # points whose file lists their labels out of order, where the authors' P@k can miss hits
        "train_unsorted_label_lines": datamodule.train_split.labels.unsorted_rows,
        "test_unsorted_label_lines": datamodule.test_split.labels.unsorted_rows,
    }
    # MLflow's convention: an 8-character digest.
    fields = MetaDataset(source, name=dataset_label(plain), digest=digest.hexdigest()[:8]).to_dict()
    return Dataset(**fields, profile=json.dumps(profile))


class _RunOwnedMLFlowLogger(MLFlowLogger):
    """Lightning's MLflow logger writing into a run that RunTracker opened and will close; writes retry. In a
    resumed run, a metric already logged at a step is not logged again: a run killed after an epoch's validation
    but before that epoch's checkpoint replays the epoch and would log its `val/p_at_k` twice."""

    def __init__(self, *args, resumed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._logged_steps: dict[str, set[int]] | None = {} if resumed else None  # per metric, read once

    def log_metrics(self, metrics, step=None) -> None:
        if self._logged_steps is not None and step is not None:
            metrics = {key: value for key, value in metrics.items() if step not in self._steps_logged(key)}
            if not metrics:
                return
        with_retries(super().log_metrics, metrics, step)

    def _steps_logged(self, key: str) -> set[int]:
        if key not in self._logged_steps:
            history = with_retries(self.experiment.get_metric_history, self.run_id, key)
            self._logged_steps[key] = {metric.step for metric in history}
        return self._logged_steps[key]

    def log_hyperparams(self, params) -> None:
        # RunTracker.log_config records the whole config under its Hydra keys; the module's hyperparameters
        # (`lr`, `connectivity`, ...) would log the same settings a second time under other names.
        pass

    def finalize(self, status: str = "success") -> None:
        # Flush nothing special; the status is set by RunTracker.finish once testing is done too.
        pass
