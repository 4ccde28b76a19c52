"""Concurrent sweeps: several jobs writing one sqlite MLflow store at once lose no run and never fail on a lock."""

from __future__ import annotations

import sqlite3
import time

import pytest

from test_reliability_common import TINY, copy_store, make_store, runs, start
from xmc_repro import tracking


@pytest.mark.slow  # 45 s of four processes; test_a_process_killed_while_creating_the_store_leaves_it_usable stays
def test_four_jobs_write_one_fresh_store_at_once(tmp_path):
    # A fresh store: the four processes also race to create its schema and the experiment.
    processes = [start(tmp_path, [*TINY, "trainer.max_epochs=1", f"seed={seed}"]) for seed in range(4)]
    outputs = [p.communicate(timeout=600) for p in processes]
    for process, (_, err) in zip(processes, outputs):
        assert process.returncode == 0, err[-3000:]
        assert "locked" not in err, err[-3000:]
    found = runs(tmp_path)
    assert sorted(r.data.params["seed"] for r in found) == ["0", "1", "2", "3"]
    for run in found:
        assert run.info.status == "FINISHED"
        assert {"test/p_at_1", "train/p_at_5", "val/p_at_3", "epochs"} <= set(run.data.metrics)


def test_retries_ride_out_lock_contention(monkeypatch):
    monkeypatch.setattr(tracking.time, "sleep", lambda seconds: None)
    calls = []

    def flaky(value):
        calls.append(value)
        if len(calls) < 4:
            raise sqlite3.OperationalError("database is locked")
        return value * 2

    assert tracking.with_retries(flaky, 21) == 42 and len(calls) == 4


def test_retries_do_not_hide_real_errors(monkeypatch):
    monkeypatch.setattr(tracking.time, "sleep", lambda seconds: None)
    calls = []

    def broken():
        calls.append(1)
        raise sqlite3.OperationalError("no such table: runs")

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        tracking.with_retries(broken)
    assert len(calls) == 1


def test_retries_give_up_after_the_deadline(monkeypatch):
    clock = iter(range(0, 10_000, 100))
    monkeypatch.setattr(tracking.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(tracking.time, "sleep", lambda seconds: None)

    def always_locked():
        raise sqlite3.OperationalError("database is locked")

    with pytest.raises(sqlite3.OperationalError, match="locked"):
        tracking.with_retries(always_locked)


def test_a_long_wait_for_a_locked_store_is_said_once(monkeypatch, capsys):
    clock = iter(range(0, 10_000, 4))
    monkeypatch.setattr(tracking.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(tracking.time, "sleep", lambda seconds: None)
    calls = []

    def locked_for_a_while():
        calls.append(1)
        if len(calls) < 10:
            raise sqlite3.OperationalError("database is locked")

    tracking.with_retries(locked_for_a_while)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("waiting: the MLflow store is locked by another process; retrying for up to 5")


def test_contention_is_recognised_through_mlflow_wrapping():
    from mlflow.exceptions import MlflowException

    try:
        try:
            raise sqlite3.OperationalError("database is locked")
        except sqlite3.OperationalError as cause:
            raise MlflowException("(sqlite3.OperationalError) database is locked") from cause
    except MlflowException as wrapped:
        assert tracking.is_contention(wrapped)
    assert not tracking.is_contention(ValueError("bad value"))
    # Two sweep jobs logging the same dataset into one store at once (seen through a tracking server).
    race = MlflowException("BAD_REQUEST: (sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                           "datasets.name, datasets.digest")
    assert tracking.is_contention(race)
    assert not tracking.is_contention(MlflowException("UNIQUE constraint failed: runs.run_uuid"))


def test_sqlite_path():
    assert str(tracking.sqlite_path("sqlite:///mlruns.db")) == "mlruns.db"
    assert str(tracking.sqlite_path("sqlite:////abs/dir/m.db")) == "/abs/dir/m.db"
    assert tracking.sqlite_path("http://localhost:5000") is None
    assert tracking.sqlite_path("sqlite:///:memory:") is None


def _dataset(cfg: dict):
    from omegaconf import OmegaConf

    from xmc_repro.data import build_datamodule

    dm = build_datamodule(cfg)
    dm.setup("fit")
    return tracking.dataset_entity(OmegaConf.create(cfg), dm)


def test_the_dataset_digest_follows_the_files_read_not_their_names(tmp_path):
    train, test = "3 5 3\n0,1 0:1.0 2:0.5\n2 1:1.0\n1 3:0.25 4:1\n", "2 5 3\n0 0:1.0\n1,2 4:2.0\n"
    copies = []
    for name, test_text in (("a", test), ("b", test), ("c", test.replace("4:2.0", "4:3.0"))):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "train.txt").write_text(train)
        (folder / "test.txt").write_text(test_text)
        cfg = {"kind": "xc", "name": "Tiny-XC", "features": "bow", "data_dir": str(folder),
               "train_file": "train.txt", "test_file": "test.txt"}
        copies.append(_dataset(cfg))
    same, copy, changed = copies
    assert same.name == "Tiny-XC" and len(same.digest) == 8
    assert same.digest == copy.digest != changed.digest  # one changed value in test.txt
    assert same.source_type == "local" and str(tmp_path / "a") in same.source
    assert '"labels": 3' in same.profile and '"train_points": 3' in same.profile


def test_synthetic_data_is_told_apart_by_its_generating_settings():
    base = {"kind": "synthetic", "name": "Synthetic", "features": "synthetic", "num_train": 60, "num_test": 20,
            "num_features": 8, "num_labels": 12, "latent_dim": 4}
    first, again, other_seed = (_dataset({**base, **extra}) for extra in ({}, {}, {"data_seed": 1}))
    assert first.digest == again.digest != other_seed.digest
    assert first.source_type == "code"


def test_git_commit_says_when_the_code_differs_from_the_commit(tmp_path, monkeypatch):
    import subprocess

    from xmc_repro import tracking

    def git(*args):
        subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("commit", "-qm", "one")
    monkeypatch.setattr(tracking, "PROJECT_ROOT", tmp_path)
    clean = tracking.git_commit()
    assert len(clean) == 12 and not clean.endswith("-dirty")
    (tmp_path / "new.py").write_text("untracked files do not count\n")
    assert tracking.git_commit() == clean
    # what `records add` and `dvc repro` write between sweeps is no code: the next sweep's runs were all "-dirty"
    for data in ("results/runs.csv", "results/records/r.json", "dvc.lock"):
        (tmp_path / data).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / data).write_text("one\n")
        git("add", data)
    git("commit", "-qm", "results")
    clean = tracking.git_commit()
    for data in ("results/runs.csv", "results/records/r.json", "dvc.lock"):
        (tmp_path / data).write_text("two\n")
    assert tracking.git_commit() == clean
    (tmp_path / "f.py").write_text("a = 2\n")
    assert tracking.git_commit() == clean + "-dirty"
    monkeypatch.setenv("XMC_GIT_COMMIT", "17de686")  # a copy whose git metadata is stale says what it is
    assert tracking.git_commit() == "17de686"
    monkeypatch.delenv("XMC_GIT_COMMIT")
    monkeypatch.setattr(tracking, "PROJECT_ROOT", tmp_path / "missing")
    assert tracking.git_commit() == "unknown"


def test_a_sqlite_store_that_is_a_folder_is_refused_at_once(tmp_path):
    """MLflow spent about two minutes retrying such a store before its own error."""
    import time

    from xmc_repro.errors import ConfigError

    (tmp_path / "a_file").write_text("")
    for path in (tmp_path, tmp_path / "a_file" / "mlruns.db"):
        began = time.monotonic()
        with pytest.raises(ConfigError, match=r"^logger\.tracking_uri=sqlite:///.*: .* is a folder or lies under a "
                                              r"file, not a database; name a database file"):  # fmt: skip
            tracking.RunTracker(f"sqlite:///{path}", "xmc_repro")
        assert time.monotonic() - began < 5
    tracking.check_store(f"sqlite:///{tmp_path / 'new' / 'mlruns.db'}")  # a file to be created in a new folder
    tracking.check_store("sqlite:///:memory:")


def test_a_setting_a_resume_changes_is_recorded_and_read_in_place_of_the_param(tmp_path, tmp_path_factory):
    """MLflow keeps a param's first value: a run resumed with more epochs still said trainer/max_epochs=2. The code
    a run was resumed with was recorded over the one it started with."""
    from omegaconf import OmegaConf

    from xmc_repro.report import records

    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)  # its schema takes seconds
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    config = {"trainer": {"max_epochs": 2, "lr": 0.001}, "resume": None, "table": "t", "scale": "s"}
    first = tracking.RunTracker(uri, "xmc_repro")
    first.log_config(OmegaConf.create(config), {"table": "t", "git_commit": "aaa"})
    resumed = tracking.RunTracker(uri, "xmc_repro", run_id=first.run_id)
    config.update(trainer={"max_epochs": 4, "lr": 0.001}, resume=first.run_id)
    resumed.log_config(OmegaConf.create(config), {"table": "t", "git_commit": "bbb-dirty"})
    resumed.finish("FINISHED")
    run = resumed.client.get_run(first.run_id)
    assert run.data.params["trainer/max_epochs"] == "2" and run.data.tags["resumed/trainer/max_epochs"] == "4"
    assert not [tag for tag in run.data.tags if tag.startswith("resumed/") and tag != "resumed/trainer/max_epochs"]
    assert (run.data.tags["git_commit"], run.data.tags["git_commit_resumed"]) == ("aaa", "bbb-dirty")  # both kept
    used = records.used_params(records.record_of_run(run))
    assert used["trainer/max_epochs"] == "4" and used["trainer/lr"] == "0.001"


def test_a_resumed_run_logs_a_replayed_step_once(tmp_path, tmp_path_factory):
    """Killed after an epoch's validation was logged but before its checkpoint, a run replays that epoch when
    resumed: its val/p_at_3 was logged twice at the same step."""
    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    first = tracking.RunTracker(uri, "xmc_repro")
    first.lightning_logger().log_metrics({"val/p_at_3": 4.0}, step=312)
    resumed = tracking.RunTracker(uri, "xmc_repro", run_id=first.run_id)
    logger = resumed.lightning_logger()
    for step in (312, 625):  # the replayed epoch, then the next one
        logger.log_metrics({"val/p_at_3": 4.0 if step == 312 else 7.0, "train/loss_epoch": 0.5}, step=step)
    history = lambda key: [(m.step, m.value) for m in resumed.client.get_metric_history(first.run_id, key)]
    assert sorted(history("val/p_at_3")) == [(312, 4.0), (625, 7.0)]
    assert sorted(history("train/loss_epoch")) == [(312, 0.5), (625, 0.5)]  # not logged before: logged
    resumed.finish("FINISHED")


_KILLED_WHILE_CREATING_THE_STORE = """
import os, signal, sys
from alembic.operations import Operations

create_table = Operations.create_table

def killed_after(self, name, *args, **kwargs):  # MLflow's migrations commit part-way: past such a commit
    result = create_table(self, name, *args, **kwargs)
    if name == "secrets":
        os.kill(os.getpid(), signal.SIGKILL)
    return result

Operations.create_table = killed_after
from xmc_repro.tracking import RunTracker
RunTracker(sys.argv[1], "e")
"""


def test_a_process_killed_while_creating_the_store_leaves_it_usable(tmp_path):
    """SIGKILL among MLflow's schema migrations (the first run in a directory) left a half-made mlruns.db that
    every later run refused ("table secrets already exists"): the store is made in a temporary file, renamed
    whole."""
    import subprocess
    import sys

    from test_reliability_common import cli_env

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_CREATING_THE_STORE, uri], env=cli_env(),
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path / "mlruns.db").exists()  # nothing half-made where the store goes
    tracker = tracking.RunTracker(uri, "e")
    tracker.finish("FINISHED")
    assert [r.info.status for r in runs(tmp_path)] == ["FINISHED"]
    assert not (tmp_path / "mlruns.db.init.tmp").exists()


def test_store_errors_are_cut_to_the_databases_own_words():
    """SQLAlchemy's text carries the statement and all its parameters (about 1,500 characters in a run's line)."""
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException

    driver = sqlite3.OperationalError("database or disk is full")
    statement = sqlalchemy.exc.OperationalError("INSERT INTO metrics (key, value) VALUES (?, ?)", [("a", 1.0)] * 50,
                                                driver)  # fmt: skip
    try:
        raise MlflowException(statement, error_code="TEMPORARILY_UNAVAILABLE") from statement
    except MlflowException as wrapped:
        assert tracking.short_error(wrapped) == "OperationalError: database or disk is full"
    assert tracking.short_error(statement) == "OperationalError: database or disk is full"
    assert tracking.short_error(ValueError("bad\n value")) == "ValueError: bad value"
    served = MlflowException("(sqlite3.OperationalError) database is locked\n[SQL: SELECT runs.run_uuid ...]")
    assert tracking.short_error(served) == "MlflowException: (sqlite3.OperationalError) database is locked"


def test_mlflows_store_tracebacks_are_silenced_for_the_whole_process():
    """MLflow logged each failed store call with its SQL and traceback, also those a retry then rode out: 68 lines
    for one lock waited out. The tracker's own quieting while it opens a run lowered the level back meanwhile."""
    import logging

    from xmc_repro.console import quiet

    store_log = logging.getLogger("mlflow.store.db.utils")
    before = store_log.level
    try:
        quiet()
        assert not store_log.isEnabledFor(logging.ERROR)
        with tracking._quiet("mlflow.store.db.utils"):
            assert not store_log.isEnabledFor(logging.ERROR)
        assert not store_log.isEnabledFor(logging.ERROR)
    finally:
        store_log.setLevel(before)


def _locked(database, seconds: float):
    """Hold an EXCLUSIVE lock on `database` (neither reads nor writes get in) in a thread, for `seconds` or until
    `release()`; returns `release` once the lock is taken."""
    import threading

    taken, released = threading.Event(), threading.Event()

    def hold():
        connection = sqlite3.connect(database, isolation_level=None)
        connection.execute("BEGIN EXCLUSIVE")
        taken.set()
        released.wait(seconds)
        connection.execute("COMMIT")
        connection.close()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    taken.wait(10)
    return lambda: (released.set(), holder.join())


def test_a_store_locked_when_the_run_opens_is_waited_for(tmp_path, tmp_path_factory):
    """MLflow's client reads the schema as it is made: under a lock that failed at once ("cannot use this MLflow
    store"), not retried like every other store call."""
    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}?timeout=1"  # sqlite's wait for a lock: 1 s, not 5
    _locked(tmp_path / "mlruns.db", 2.5)
    began = time.monotonic()
    tracker = tracking.RunTracker(uri, "xmc_repro")
    assert time.monotonic() - began > 2
    tracker.finish("FINISHED")
    assert [r.info.status for r in runs(tmp_path)] == ["FINISHED"]


def test_a_resumed_run_in_a_busy_store_is_not_called_missing(tmp_path, tmp_path_factory, monkeypatch):
    """Only MLflow's RESOURCE_DOES_NOT_EXIST means the run is not in the store; a store locked for good said so."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from xmc_repro.errors import ConfigError

    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    first = tracking.RunTracker(uri, "xmc_repro")
    first.finish("FAILED", "interrupted (Ctrl+C)")
    with pytest.raises(ConfigError, match=r"^resume: MLflow run 0123456789abcdef is not in sqlite:///"):
        tracking.RunTracker(uri, "xmc_repro", run_id="0123456789abcdef")

    def locked(self, run_id):
        raise MlflowException("(sqlite3.OperationalError) database is locked", error_code="TEMPORARILY_UNAVAILABLE")

    monkeypatch.setattr(tracking, "RETRY_SECONDS", 0.0)
    monkeypatch.setattr(MlflowClient, "get_run", locked)
    with pytest.raises(MlflowException, match="database is locked") as info:
        tracking.RunTracker(uri, "xmc_repro", run_id=first.run_id)
    assert tracking.is_contention(info.value)


def test_ctrl_c_ends_the_wait_for_a_locked_store_before_any_run_exists(tmp_path, tmp_path_factory, monkeypatch):
    """Signals are deferred while the run is opened (one there would leave a run nobody closes); the wait for a
    locked store (up to RETRY_SECONDS) ignored Ctrl+C and SIGTERM."""
    import functools
    import os
    import signal
    import threading

    from xmc_repro import train

    monkeypatch.setattr(tracking, "RETRY_SECONDS", 20.0)  # bounds the test when the wait is not interruptible
    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}?timeout=1"
    release = _locked(tmp_path / "mlruns.db", 60)
    began = time.monotonic()
    with train.interruptions_deferred() as interrupted:
        ctrl_c = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            tracking.RunTracker(uri, "xmc_repro", raise_pending=functools.partial(train.raise_deferred, interrupted))
        ctrl_c.join()
    assert time.monotonic() - began < 5
    release()
    assert runs(tmp_path) == []


def test_a_store_lock_held_for_good_is_reported_after_the_retry_window(tmp_path, monkeypatch, capsys):
    """A process stopped (Ctrl+Z) while it held `mlruns.db.lock` kept every new run waiting without a word, for ever;
    a wait longer than WAIT_NOTICE_SECONDS says so, once."""
    import fcntl

    from xmc_repro import train
    from xmc_repro.errors import StorageError
    from test_reliability_common import tiny_config

    monkeypatch.setattr(tracking, "RETRY_SECONDS", 0.5)
    monkeypatch.setattr(tracking, "WAIT_NOTICE_SECONDS", 0.2)
    import threading

    held = open(tmp_path / "m.db.lock", "a")  # another open file: flock refuses this process too
    fcntl.flock(held, fcntl.LOCK_EX)
    threading.Timer(5, held.close).start()  # a waiting open ends then (without a bound it waited for this)
    began = time.monotonic()
    with pytest.raises(StorageError) as info:
        train.open_run(tiny_config(tmp_path / "m.db"), None)
    assert time.monotonic() - began < 5
    assert str(info.value) == (f"logger.tracking_uri=sqlite:///{tmp_path}/m.db: the MLflow store stayed locked by "
                               f"another process for 0 s (TimeoutError: database is locked: another process holds "
                               f"{tmp_path}/m.db.lock); let that process finish or stop it, then run it again")
    assert capsys.readouterr().err.splitlines() == [f"waiting: another process holds {tmp_path}/m.db.lock; retrying "
                                                    "for up to 0 s more"]


def test_resume_without_a_checkpoint_tells_a_busy_store_from_a_missing_run(tmp_path, tmp_path_factory, monkeypatch):
    """`resume=<id>` of a run with no checkpoint reads the run to close it: a locked store was taken for a store
    without the run ("no MLflow run ... set logger.tracking_uri"), or its client failed unretried."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from xmc_repro.errors import StorageError
    from xmc_repro.resume import close_orphan

    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run_dir = tmp_path / "checkpoints" / "0123456789abcdef"
    run_dir.mkdir(parents=True)
    assert close_orphan(uri, "0123456789abcdef", run_dir).startswith("no checkpoint in ")  # truly not there

    def locked(self, run_id):
        raise MlflowException("(sqlite3.OperationalError) database is locked", error_code="TEMPORARILY_UNAVAILABLE")

    monkeypatch.setattr(tracking, "RETRY_SECONDS", 0.0)
    monkeypatch.setattr(MlflowClient, "get_run", locked)
    with pytest.raises(StorageError, match=r"^resume=0123456789abcdef: cannot read the run from the MLflow store "
                                           r"sqlite:///.* \(MlflowException: .*database is locked\); once the store"):
        close_orphan(uri, "0123456789abcdef", run_dir)


def test_resume_of_a_deleted_run_without_a_checkpoint_says_it_was_deleted(tmp_path, tmp_path_factory, monkeypatch):
    """A RUNNING run deleted in MLflow cannot be marked FAILED (MLflow refuses every write to it): `resume=<id>`
    said "marking it FAILED failed (... must be in the 'active' state ...)"."""
    from mlflow.tracking import MlflowClient

    from xmc_repro import resume

    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run_id = tracking.RunTracker(uri, "xmc_repro").run_id  # then killed: RUNNING
    MlflowClient(uri).delete_run(run_id)
    monkeypatch.chdir(tmp_path)
    said = f"run {run_id} has no checkpoint and was deleted in MLflow; nothing to resume: start a new run"
    assert resume.close_unstarted(uri, run_id) == said  # no folder: killed before it had one
    run_dir = tmp_path / "checkpoints" / run_id
    run_dir.mkdir(parents=True)
    assert resume.close_orphan(uri, run_id, run_dir) == said


def test_a_reopen_that_fails_after_its_status_write_puts_the_status_back(tmp_path, tmp_path_factory, monkeypatch):
    """Reopening writes RUNNING first; a store that then failed left a FAILED run RUNNING, which no tracker closes."""
    from mlflow.tracking import MlflowClient

    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    first = tracking.RunTracker(uri, "xmc_repro")
    first.finish("FAILED", "interrupted (Ctrl+C)")

    def store_fails(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MlflowClient, "log_batch", store_fails)
    with pytest.raises(OSError):
        tracking.RunTracker(uri, "xmc_repro", run_id=first.run_id)
    assert MlflowClient(uri).get_run(first.run_id).info.status == "FAILED"


def _failing_after_create(monkeypatch, error: Exception, calls=("update_run", "set_tag", "set_terminated"),
                          first_failure=None):
    """MlflowClient whose `calls` raise `error` once a run was created (as a store locked or filled from then on);
    `first_failure()`, if given, runs before the first such error."""
    from mlflow.tracking import MlflowClient

    created, failed = [], []
    create_run = MlflowClient.create_run

    def create(self, *args, **kwargs):
        created.append(True)
        return create_run(self, *args, **kwargs)

    def failing(original):
        def call(self, *args, **kwargs):
            if not created:
                return original(self, *args, **kwargs)
            if first_failure is not None and not failed:
                first_failure()
            failed.append(True)
            raise error
        return call

    monkeypatch.setattr(MlflowClient, "create_run", create)
    for name in calls:
        monkeypatch.setattr(MlflowClient, name, failing(getattr(MlflowClient, name)))


@pytest.mark.parametrize("store", ["full", "locked"])
def test_a_run_whose_setup_fails_after_its_creation_is_closed_or_named(tmp_path, tmp_path_factory, monkeypatch,
                                                                       store):
    """The run's name is written once MLflow has created the run: a store that failed from then on left a RUNNING
    run that no tracker closes, and the line did not name it."""
    from mlflow.tracking import MlflowClient

    from test_reliability_common import tiny_config
    from xmc_repro import resume, train
    from xmc_repro.errors import StorageError

    monkeypatch.chdir(tmp_path)
    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    cfg = tiny_config(tmp_path / "mlruns.db")
    uri = cfg.logger.tracking_uri
    monkeypatch.setattr(tracking, "RETRY_SECONDS", 1.0)
    monkeypatch.setattr(tracking, "CLOSE_RETRY_SECONDS", 0.5)
    if store == "full":  # the close is let in
        _failing_after_create(monkeypatch, sqlite3.OperationalError("database or disk is full"), ["update_run"])
    else:  # nothing is let in
        _failing_after_create(monkeypatch, sqlite3.OperationalError("database is locked"))
    began = time.monotonic()
    with pytest.raises(StorageError) as info:
        train.open_run(cfg, None)
    assert time.monotonic() - began < 5  # the retry window, then CLOSE_RETRY_SECONDS
    monkeypatch.undo()
    (run,) = runs(tmp_path)
    run_id, line = run.info.run_id, str(info.value)
    assert "\n" not in line
    if store == "full":
        assert line == (f"logger.tracking_uri={uri}: no space left on the disk holding the MLflow store "
                        f"(OperationalError: database or disk is full); free space, then run it again; the new "
                        f"MLflow run {run_id} is marked FAILED")
        assert run.info.status == "FAILED"
        assert run.data.tags["error"] == "the run could not be set up (OperationalError: database or disk is full)"
        return
    assert line.startswith(f"logger.tracking_uri={uri}: the MLflow store stayed locked by another process for 1 s")
    assert line.endswith(f"then run it again; the MLflow run {run_id} could not be marked FAILED "
                         f"(OperationalError: database is locked) and may show RUNNING: once the store is writable, "
                         f"resume={run_id} closes it, from this folder on this machine")
    assert run.info.status == "RUNNING"
    # What resume=<id> does here for a run without a folder, once its process is gone (this one is alive: said gone)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(resume, "alive", lambda pid, started: False)
    assert "so it is now marked FAILED" in resume.close_unstarted(uri, run_id)
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"


def test_ctrl_c_while_a_new_runs_setup_waits_for_the_store_closes_the_run(tmp_path, tmp_path_factory, monkeypatch):
    """Ctrl+C while the new run's name waited for a locked store was deferred until the store let it in or the
    retry window (10 minutes) ended, not taken at once as while the run is being created."""
    import os
    import signal

    from test_reliability_common import tiny_config
    from xmc_repro import train

    monkeypatch.chdir(tmp_path)
    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    monkeypatch.setattr(tracking, "RETRY_SECONDS", 5.0)  # bounds the test when the wait is not interruptible
    monkeypatch.setattr(tracking, "CLOSE_RETRY_SECONDS", 0.5)
    _failing_after_create(monkeypatch, sqlite3.OperationalError("database is locked"), ["update_run"],
                          first_failure=lambda: os.kill(os.getpid(), signal.SIGINT))
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        train.run(tiny_config(tmp_path / "mlruns.db"))
    assert time.monotonic() - began < 3
    monkeypatch.undo()
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["error"] == "the run could not be set up (interrupted)"
    assert info.value.run_failure == (f"interrupted (Ctrl+C) while the MLflow run was being opened; the new MLflow "
                                      f"run {run.info.run_id} is marked FAILED")


def test_the_final_peak_memory_is_what_mlflow_shows(tmp_path, tmp_path_factory, monkeypatch):
    """The peak after testing was logged at step 0, under the per-epoch peaks at later steps: MLflow's value of
    peak_gpu_memory_gib (runs table, records, report) was the last epoch's, not the peak the summary printed."""
    import itertools

    from test_reliability_common import tiny_config
    from xmc_repro import callbacks, train

    monkeypatch.chdir(tmp_path)
    copy_store(make_store(tmp_path_factory.getbasetemp() / "store"), tmp_path)
    peaks = itertools.count(1.0)  # a CPU run has no peak: each reading higher, as testing can raise it
    monkeypatch.setattr(callbacks.PeakMemory, "update", lambda self, pl_module: setattr(self, "peak_gib", next(peaks)))
    results = train.run(tiny_config(tmp_path / "mlruns.db"))
    (run,) = runs(tmp_path)
    assert results["peak_gpu_memory_gib"] == 3.0  # two epochs, then testing
    assert run.data.metrics["peak_gpu_memory_gib"] == 3.0
    assert run.data.metrics["test/p_at_1"] == results["test/p_at_1"]
