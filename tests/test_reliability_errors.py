"""Every failure explained in one line, through the real command line.

For each kind of bad input the command must exit non-zero with exactly one line on stderr, `error: ...`,
naming file:line or the setting and the fix, with no traceback; if the MLflow run had been opened, it is
FAILED with that same message as its tag `error`. Also: a non-finite loss, and a sweep with a failing job.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from test_reliability_common import (
    TINY, cli, copy_store, make_store, runs, start, stderr_lines, tiny_config, together,
)
from test_reliability_common import no_run_left_running  # noqa: F401  (autouse)

GOOD_TRAIN = "3 5 3\n0,1 0:1.0 2:0.5\n2 1:1.0\n1 3:0.25 4:1\n"
GOOD_TEST = "2 5 3\n0 0:1.0\n1,2 4:2.0\n"
LABELS = "3 768 3\n0 0:1\n1,2 1:1\n2 0:1\n"  # labels beside .npy embeddings (features there are ignored)
XC = ["dataset=xc", "dataset.train_file=train.txt", "dataset.test_file=test.txt", "trainer.progress_bar=false"]
NPY = ["dataset=wiki10_31k", "dataset.data_dir=.", "trainer.progress_bar=false"]


def _npy(x):
    def write(d: Path):
        for split in ("train", "test"):
            d.joinpath(f"{split}-labels.txt").write_text(LABELS)
        np.save(d / "train-cascade.npy", x)
        np.save(d / "test-cascade.npy", np.zeros((3, 768), np.float32))

    return write


def _xc(train=GOOD_TRAIN, test=GOOD_TEST):
    return lambda d: (d.joinpath("train.txt").write_text(train), d.joinpath("test.txt").write_text(test))


nan_rows = np.zeros((3, 768), np.float32)
nan_rows[1, 5] = np.nan

# case: (files to write, command line, what the one line must say, whether the MLflow run had been opened)
CASES = {
    "malformed_header": (_xc(train="3 five 3\n0,1 0:1.0\n"), XC, "train.txt:1: malformed header", True),
    "malformed_line": (_xc(train="3 5 3\n0,1 0:1.0\n0,x 1:1.0\n1 3:1\n"), XC, "train.txt:3: label 'x'", True),
    "label_beyond_count": (_xc(train="3 5 3\n0,1 0:1.0\n7 1:1.0\n1 3:1\n"), XC, "train.txt:3: label id 7 >= 3", True),
    "feature_beyond_count": (_xc(test="2 5 3\n0 0:1.0\n1 9:2.0\n"), XC, "test.txt:3: feature index 9 >= 5", True),
    "nan_feature": (_xc(train="3 5 3\n0,1 0:1.0\n2 1:nan\n1 3:1\n"), XC, "train.txt:3: value nan", True),
    "empty_file": (_xc(test=""), XC, "test.txt:1: empty file", True),
    "dimension_mismatch": (_xc(test="2 6 3\n0 0:1.0\n1 5:2.0\n"), XC, "6 features per point but", True),
    "npy_wrong_shape": (_npy(np.zeros((3, 10), np.float32)), NPY, "10 features per point, expected 768", True),
    "npy_wrong_dtype": (_npy(np.zeros((3, 768), np.float64)), NPY, "dtype float64, expected float32", True),
    "npy_nan": (_npy(nan_rows), NPY, "row 1 (0-based), column 5 is nan", True),
    "missing_file": (_xc(), [*XC, "dataset.test_file=nope.txt"], "missing", True),
    "connectivity_too_large": (None, [*TINY, "model.connectivity=100"], "connectivity=100 exceeds", True),
    "limit_below_one_batch": (None, [*TINY, "trainer.limit_train_batches=0.001"],
                              "trainer.limit_train_batches=0.001 of an epoch's 20 training batches", True),
    "intermediate_not_positive": (None, [*TINY, "model.intermediate=0"], "model.intermediate=0 must be", False),
    "unknown_config_choice": (None, ["model=nope"], "Could not find 'model/nope'; choose one of: bottleneck", False),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("store"))


def _run_case(directory: Path, store: Path, write, args):
    directory.mkdir()
    copy_store(store, directory)
    if write:
        write(directory)
    return cli(directory, args)


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, store):
    """The selected cases at once, three at a time: each is a whole interpreter start (torch, Lightning, MLflow)."""
    def run(directory: Path, case: str):
        return directory / case, _run_case(directory / case, store, *CASES[case][:2])

    return together(request, tmp_path_factory, {"test_bad_input_ends_in_one_line": run})


# One case per source of errors runs by default (XC parser, .npy loader, layer sizes, Hydra);
# the others take as long each (an interpreter start) and run with -m slow.
DEFAULT_CASES = ("malformed_line", "npy_wrong_dtype", "connectivity_too_large", "limit_below_one_batch",
                 "unknown_config_choice")


@pytest.mark.parametrize(
    "case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_bad_input_ends_in_one_line(case, outcomes, request):
    _, _, expected, run_opened = CASES[case]
    directory, result = outcomes[request.node.name].result()
    assert result.returncode == 2, result.stderr[-2000:]
    lines = stderr_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    found = runs(directory)
    if run_opened:
        (run,) = found
        assert run.info.status == "FAILED"
        assert run.data.tags["error"] == lines[0].removeprefix("error: ")
    else:
        assert found == []


@pytest.mark.slow
def test_full_traceback_on_request(tmp_path, store):
    copy_store(store, tmp_path)
    result = cli(tmp_path, [*TINY, "model.intermediate=-3"], env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError: model.intermediate=-3" in result.stderr


def _non_finite_loss(directory: Path):
    # An absurd learning rate: after one Adam step the weights are ~1e30 and the next loss overflows.
    return cli(directory, [*TINY, "trainer.lr=1e30", "trainer.checkpoint_every_n_steps=1"])


def _failed_job(directory: Path):
    return cli(directory, [*TINY, "trainer.max_epochs=1", "model.connectivity=8,100,4"], multirun=True)


def _a_bug(directory: Path):
    import subprocess
    import sys

    from test_reliability_common import cli_env

    (directory / "bug.py").write_text(A_BUG_IN_A_RUN)
    return subprocess.run([sys.executable, str(directory / "bug.py"), *TINY,
                           f"logger.tracking_uri=sqlite:///{directory / 'mlruns.db'}"],
                          cwd=directory, env=cli_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def side_by_side(request, tmp_path_factory, store):
    """The command lines of three tests below, run together when the first of them starts (each is mostly one core
    importing torch, Lightning and MLflow): {test name: future of (its directory, the finished command)}."""
    def in_a_copy_of_the_store(command):
        def run(directory: Path):
            copy_store(store, directory)
            return directory, command(directory)
        return run

    commands = {"test_non_finite_loss_fails_the_run_and_keeps_the_last_good_checkpoint": _non_finite_loss,
                "test_failed_job_does_not_stop_its_sweep": _failed_job,
                "test_a_bug_in_a_run_shows_its_traceback_then_what_became_of_the_run": _a_bug}
    return together(request, tmp_path_factory,
                    {name: in_a_copy_of_the_store(command) for name, command in commands.items()})


def test_non_finite_loss_fails_the_run_and_keeps_the_last_good_checkpoint(side_by_side, request):
    tmp_path, result = side_by_side[request.node.name].result()
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in stderr_lines(result.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    # the epoch as the epoch lines and the progress bar count it (epoch 1/N): the first
    assert re.search(r"the training loss is (nan|inf) at step 1 \(epoch 1\);", errors[0]), errors[0]
    assert "the last good checkpoint is kept: checkpoints/" in errors[0]
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == errors[0].removeprefix("error: ")
    assert run.data.tags["failed_at_step"] == "1"
    checkpoint = torch.load(tmp_path / "checkpoints" / run.info.run_id / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 1
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values())


def test_the_sweep_summary_counts_the_jobs_that_failed():
    """A one-job sweep read 'all 1 jobs failed', and jobs were joined by '; ', which their reasons contain too."""
    from xmc_repro.entry import _sweep_summary

    assert _sweep_summary(["ok", "ok"]) is None
    assert _sweep_summary(["failed #0: broke"]) == "sweep finished; the 1 job failed: job #0: broke"
    assert _sweep_summary(["ok", "failed #1 (a=1): broke", "ok"]) == (
        "sweep finished; 1 of 3 jobs failed: job #1 (a=1): broke")
    # The reasons contain "; " themselves: the jobs are told apart by " | job #".
    assert _sweep_summary(["failed #0 (a=0): x; fix x", "ok", "failed #2 (a=2): y; fix y"]) == (
        "sweep finished; 2 of 3 jobs failed: job #0 (a=0): x; fix x | job #2 (a=2): y; fix y")
    assert _sweep_summary(["failed #0 (a=0): x", "failed #1 (a=1): y"]) == (
        "sweep finished; all 2 jobs failed: job #0 (a=0): x | job #1 (a=1): y")


def test_the_other_ddp_ranks_of_a_sweeps_job_record_no_outcome(tmp_path, monkeypatch):
    """Every rank of a DDP job runs it (submitit_slurm with tasks_per_node, srun): each appended `ok`, and a sweep
    of 2 jobs on 2 ranks each counted 4 jobs ('1 of 4 jobs failed')."""
    from xmc_repro.entry import OUTCOMES_ENV, _record_outcome

    outcomes = tmp_path / "outcomes.txt"
    monkeypatch.setenv(OUTCOMES_ENV, str(outcomes))
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "NODE_RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    _record_outcome("ok")  # rank 0
    monkeypatch.setenv("RANK", "1")
    _record_outcome("ok")
    _record_outcome("failed #0 (seed=1): another rank's reason")
    assert outcomes.read_text().splitlines() == ["ok"]


def test_a_closed_standard_output_fails_the_run_in_one_line(tmp_path, store):
    """`python -m xmc_repro ... | head -1`: the first line after the reader stopped fails; no traceback, not even
    from Python's flush at exit."""
    copy_store(store, tmp_path)
    process = start(tmp_path, TINY)
    process.stdout.close()  # the reader stops before the run's first line
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1, stderr[-2000:]
    assert "Exception ignored" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    (line,) = [line for line in stderr_lines(stderr) if line.startswith("error:")]
    assert line.startswith("error: its standard output was closed (piped into a program that stopped reading"), line
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["error"] == line.removeprefix("error: ")


def test_failed_job_does_not_stop_its_sweep(side_by_side, request):
    tmp_path, result = side_by_side[request.node.name].result()
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in stderr_lines(result.stderr) if line.startswith("error:")]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 2, errors
    # The job is named by its number and the setting the sweep varies, not by the sweep's every override.
    assert errors[0].startswith("error: job #1 (model.connectivity=100): connectivity=100 exceeds"), errors
    assert errors[0].endswith("or use a dense layer (model=dense)"), errors  # the fix stays
    assert errors[1] == f"error: sweep finished; 1 of 3 jobs failed: {errors[0].removeprefix('error: ')}"
    by_connectivity = {r.data.params["model/connectivity"]: r for r in runs(tmp_path)}
    assert {k: r.info.status for k, r in by_connectivity.items()} == {"8": "FINISHED", "100": "FAILED", "4": "FINISHED"}
    assert "exceeds" in by_connectivity["100"].data.tags["error"]
    assert not list(tmp_path.glob("multirun/.outcomes-*"))


A_BUG_IN_A_RUN = """
import sys
import xmc_repro.entry as entry
import xmc_repro.train as train

def _fit_and_test(*args, **kwargs):
    raise RuntimeError("a bug")

train._fit_and_test = _fit_and_test
sys.argv = ["xmc_repro", *sys.argv[1:]]
entry.main()
"""


def test_a_bug_in_a_run_shows_its_traceback_then_what_became_of_the_run(side_by_side, request):
    """A bug once the MLflow run was open printed Hydra's traceback alone: not the line saying the run was marked
    FAILED (or, with the store unwritable, that it shows RUNNING and how to close it)."""
    tmp_path, result = side_by_side[request.node.name].result()
    assert result.returncode == 1 and "Traceback" in result.stderr, result.stderr[-2000:]
    assert stderr_lines(result.stderr)[-1] == "error: RuntimeError: a bug", result.stderr[-2000:]
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["error"] == "RuntimeError: a bug"


def _store_error(text: str):
    """A store call's failure as MLflow raises it: SQLAlchemy's error (statement, parameters) under MlflowException."""
    import sqlite3

    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException

    statement = sqlalchemy.exc.OperationalError("INSERT INTO metrics (key, value, run_uuid) VALUES (?, ?, ?)",
                                                [("val/p_at_1", 8.3, "0" * 32)] * 40, sqlite3.OperationalError(text))
    try:
        raise MlflowException(statement, error_code="TEMPORARILY_UNAVAILABLE") from statement
    except MlflowException as error:
        return error


def _open_run_fails_with(monkeypatch, tmp_path, error, run_id=None):
    """train.open_run's one line when the store raises `error` as the run opens."""
    from xmc_repro import train
    from xmc_repro.errors import StorageError

    def store_fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(train, "RunTracker", store_fails)
    cfg = tiny_config(tmp_path / "m.db")
    with pytest.raises(StorageError) as info:
        train.open_run(cfg, run_id)
    return str(info.value).replace(str(tmp_path), "<dir>")


def test_a_full_or_locked_store_at_the_start_says_so(tmp_path, monkeypatch):
    """Both were "cannot use this MLflow store (... 1,500 characters of SQL ...); use sqlite:///mlruns.db, an
    http://..." as if the setting were wrong."""
    full = _open_run_fails_with(monkeypatch, tmp_path, _store_error("database or disk is full"))
    assert full == ("logger.tracking_uri=sqlite:///<dir>/m.db: no space left on the disk holding the MLflow store "
                    "(OperationalError: database or disk is full); free space, then run it again")
    full = _open_run_fails_with(monkeypatch, tmp_path, _store_error("database or disk is full"), run_id="r1")
    assert full.endswith("free space, then run it again with resume=r1")
    locked = _open_run_fails_with(monkeypatch, tmp_path, _store_error("database is locked"), run_id="r1")
    assert locked == ("logger.tracking_uri=sqlite:///<dir>/m.db: the MLflow store stayed locked by another process "
                      "for 600 s (OperationalError: database is locked); let that process finish or stop it, then run "
                      "it again with resume=r1")


def test_a_damaged_or_unwritable_store_at_the_start_says_so(tmp_path, monkeypatch):
    """Both said "cannot use this MLflow store (...); use sqlite:///mlruns.db, ..." (the very store that failed)."""
    workdir = tmp_path / "damaged"
    workdir.mkdir()
    workdir.joinpath("mlruns.db").write_bytes(bytes(range(256)) * 64)  # not a database
    result = cli(workdir, TINY)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert stderr_lines(result.stderr)[-1] == (
        f"error: logger.tracking_uri=sqlite:///{workdir}/mlruns.db: the MLflow store's database is damaged "
        "(DatabaseError: file is not a database); restore it from a backup, or move it aside for a new store, then "
        "run it again")
    workdir.joinpath("mlruns.db").unlink()  # no run can be in it (and the check after the test could not read it)
    refused = _open_run_fails_with(monkeypatch, tmp_path, OSError(30, "Read-only file system", "/data/mlruns.db.lock"))
    assert refused == ("logger.tracking_uri=sqlite:///<dir>/m.db: cannot write /data/mlruns.db.lock (Read-only file "
                       "system); make its folder writable or choose another store, then run it again")


@pytest.mark.parametrize("error, says", [
    (_store_error("database or disk is full"),
     "no space left on the device (OperationalError: database or disk is full); free space, then {go_on}"),
    (_store_error("attempt to write a readonly database"),
     "the MLflow store sqlite:///m.db cannot be written (OperationalError: attempt to write a readonly database): it "
     "was deleted, moved or made read-only while the run wrote it; restore it or make it and its folder writable, "
     "then {go_on}"),
    (_store_error("database is locked"),
     "the MLflow store sqlite:///m.db stayed locked by another process for 600 s (OperationalError: database is "
     "locked); let that process finish or stop it, then {go_on}"),
    (OSError(30, "Read-only file system", "/data/mlruns/1"),
     "cannot write /data/mlruns/1 (Read-only file system); make it writable, then {go_on}"),
    (RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. "),
     "a data-loading worker process died (RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.; "
     "killed for lack of memory, most often); lower trainer.num_workers or free memory, then {go_on}"),
], ids=["store full", "store deleted", "store locked", "read-only folder", "worker killed"])  # fmt: skip
def test_store_and_system_failures_say_what_to_do_in_one_short_line(tmp_path, error, says):
    """Such failures said `MlflowException: ` and 1,500 characters of SQL, or a bare `OSError: ...`, or nothing of
    resume= though last.ckpt existed; a full store before the first checkpoint said to resume a run that has none."""
    from xmc_repro.train import failure_message

    last = tmp_path / "last.ckpt"
    before = failure_message(error, "r1", last, "sqlite:///m.db")
    assert before == says.format(go_on="start it again (no checkpoint yet)")
    last.write_bytes(b"")
    assert failure_message(error, "r1", last, "sqlite:///m.db") == says.format(go_on="continue the run with resume=r1")
    if isinstance(error, RuntimeError):  # explained: the line alone, no traceback (the others become StorageErrors)
        from xmc_repro.entry import _explained

        assert _explained(error)


@pytest.mark.parametrize("error", [OSError(30, "Read-only file system", "mlruns/1"),
                                   _store_error("attempt to write a readonly database")])
def test_an_unwritable_artifact_folder_or_store_ends_the_run_in_one_line(monkeypatch, tmp_path, error):
    """A read-only ./mlruns (the run's artifacts) printed Hydra's `Error executing job` and the bare OSError."""
    from xmc_repro import train
    from xmc_repro.errors import StorageError

    monkeypatch.chdir(tmp_path)
    copy_store(make_store(tmp_path / "store"), tmp_path)

    def fit_fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(train, "_fit_and_test", fit_fails)
    cfg = tiny_config(tmp_path / "mlruns.db")
    with pytest.raises(StorageError) as info:
        train.run(cfg)
    message = info.value.run_failure
    assert str(info.value) == message and "\n" not in message and "INSERT" not in message
    assert message.endswith("then start it again (no checkpoint yet)")
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["error"] == message


def test_an_error_raised_in_a_data_loading_worker_is_a_bug_not_a_killed_worker():
    """A worker's own error comes back as "Caught RuntimeError in DataLoader worker process 0": it was taken for a
    killed worker (advice: fewer workers, more memory) and its traceback hidden."""
    from torch.utils.data import DataLoader

    from xmc_repro.entry import _explained
    from xmc_repro.train import worker_died

    def mismatched(batch):
        return torch.stack([torch.zeros(2), torch.zeros(3)])

    with pytest.raises(RuntimeError) as info:
        list(DataLoader(range(4), batch_size=2, num_workers=1, collate_fn=mismatched))
    assert "in DataLoader worker process 0" in str(info.value)
    assert not worker_died(info.value) and not _explained(info.value)
    assert worker_died(RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly"))
