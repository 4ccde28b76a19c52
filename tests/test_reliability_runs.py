"""A run has one writer and never stays RUNNING: a second concurrent resume is refused, a run killed before its
first checkpoint is closed as FAILED by `resume=`, an unreachable tracking server is reported within seconds."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_reliability_common import (
    TINY, cli, cli_env, command, copy_store, make_store, runs, start, stderr_lines, tiny_config, together,
)
from test_reliability_common import _USED
from test_reliability_common import no_run_left_running  # noqa: F401  (autouse)
from xmc_repro import checkpoints
from xmc_repro.errors import ConfigError


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("store"))


def _failed_run_with_checkpoint(directory: Path, finished_run) -> str:
    """A copy of a real tiny run (conftest's, trained once), then marked FAILED as if it had crashed: resumable."""
    from mlflow.tracking import MlflowClient

    source, run_id, _ = finished_run
    shutil.copytree(source, directory, dirs_exist_ok=True)
    MlflowClient(f"sqlite:///{directory / 'mlruns.db'}").set_terminated(run_id, "FAILED")
    return run_id


def _trained_failed_run_with_checkpoint(directory: Path, store: Path) -> str:
    """A real tiny run of its own, then marked FAILED as if it had crashed: resumable, and its checkpoint names
    this folder (a resume from a copy elsewhere finds the run's folder through it)."""
    from mlflow.tracking import MlflowClient

    copy_store(store, directory)
    result = cli(directory, [*TINY, "trainer.max_epochs=1"])
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(directory)
    MlflowClient(f"sqlite:///{directory / 'mlruns.db'}").set_terminated(run.info.run_id, "FAILED")
    return run.info.run_id


@pytest.mark.parametrize("resume", ["id", "copy"])
def test_second_writer_of_a_run_is_refused(tmp_path, finished_run, resume):
    """Also when the second resumes from a copy of the run's checkpoint (`resume=backup/last.ckpt`): that locked the
    copy's folder only, and both processes wrote the run (its metrics twice)."""
    run_id = _failed_run_with_checkpoint(tmp_path, finished_run)
    given = run_id
    if resume == "copy":
        (tmp_path / "backup").mkdir()
        shutil.copy(tmp_path / "checkpoints" / run_id / "last.ckpt", tmp_path / "backup" / "last.ckpt")
        given = "backup/last.ckpt"
    lock = checkpoints.RunLock(tmp_path / "checkpoints" / run_id)
    assert lock.acquire()  # as a first `resume=<id>` still training would hold it
    try:
        result = cli(tmp_path, [f"resume={given}", "trainer.max_epochs=2"])
    finally:
        lock.release()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = stderr_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: resume={run_id}: run {run_id} is being written by another "
                                                   "process (pid "), result.stderr[-3000:]
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and "resumed" not in run.data.tags  # the refused resume touched nothing


@pytest.mark.slow
def test_second_writer_from_another_folder_is_refused(tmp_path, store):
    """A copy of the checkpoint resumed in another folder, while the run trains here: both processes wrote the run
    (its metric history twice, steps interleaved). The tag writer_lock names the live writer's lock."""
    from mlflow.tracking import MlflowClient

    run_id = _trained_failed_run_with_checkpoint(tmp_path, store)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(tmp_path / "checkpoints" / run_id / "last.ckpt", elsewhere / "last.ckpt")
    lock = checkpoints.RunLock(tmp_path / "checkpoints" / run_id)
    assert lock.acquire()  # as a first `resume=<id>` still training here would hold it
    client.update_run(run_id, status="RUNNING")
    try:
        result = subprocess.run(command(tmp_path, ["resume=last.ckpt", "trainer.max_epochs=2"]), cwd=elsewhere,
                                env=cli_env(), capture_output=True, text=True, timeout=300)
    finally:
        lock.release()
        client.set_terminated(run_id, "FAILED")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = stderr_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: resume={run_id}: run {run_id} is being written by another "
                                                   "process (pid "), result.stderr[-3000:]
    assert str(lock.path.resolve()) in lines[0]
    (run,) = runs(tmp_path)
    assert "resumed" not in run.data.tags and run.data.tags["writer_lock"].endswith(str(lock.path.resolve()))


def test_lock_is_exclusive_and_dies_with_its_process(tmp_path):
    first, second = checkpoints.RunLock(tmp_path), checkpoints.RunLock(tmp_path)
    assert first.acquire() and not second.acquire() and second.is_held()
    with pytest.raises(ConfigError, match=r"is being written by another process \(pid \d+"):
        checkpoints.hold_run(tmp_path, "abc")
    first.release()
    assert not second.is_held() and second.acquire()
    second.release()


def test_the_runs_writer_removes_what_a_killed_checkpoint_write_left(tmp_path, capsys):
    """kill -9 mid-write leaves `last.ckpt.tmp`, as large as the checkpoint, beside the last good one: the next
    writer of the run removes it (it alone holds the lock, so no one is writing it) and says so."""
    (tmp_path / "last.ckpt").write_bytes(b"good")
    (tmp_path / "last.ckpt.tmp").write_bytes(bytes(3 * 2**20))
    (tmp_path / "best.ckpt.tmp").symlink_to(tmp_path / "elsewhere")  # not a write's leftover: kept
    (tmp_path / "notes.tmp").write_text("the user's")
    lock = checkpoints.hold_run(tmp_path, "abc")
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt.tmp", "last.ckpt", "notes.tmp", "writer.lock"]
    assert (tmp_path / "last.ckpt").read_bytes() == b"good"
    assert f"removed {tmp_path / 'last.ckpt.tmp'} (3.0 MiB), a checkpoint write" in capsys.readouterr().out


def test_run_killed_before_its_first_checkpoint_is_closed_by_resume(tmp_path, store):
    copy_store(store, tmp_path)
    # Large enough that no checkpoint can exist yet when the run's folder appears.
    process = start(tmp_path, [*TINY, "dataset.num_train=200000", "trainer.max_epochs=1"])
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("checkpoints/*/writer.lock")):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    run_id = next(tmp_path.glob("checkpoints/*/writer.lock")).parent.name
    assert not list(tmp_path.glob("checkpoints/*/last.ckpt"))
    assert [r.info.status for r in runs(tmp_path)] == ["RUNNING"]  # nothing could close it
    result = cli(tmp_path, [f"resume={run_id}"])
    assert result.returncode == 2, result.stderr[-3000:]
    lines = stderr_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: resume={run_id}: run {run_id} stopped before its first checkpoint")
    assert "now marked FAILED; start it again without resume=" in lines[0]
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and "before its first checkpoint" in run.data.tags["error"]
    again = cli(tmp_path, [f"resume={run_id}"])  # a second try says what the run is now
    assert again.returncode == 2 and "ended FAILED before its first checkpoint" in again.stderr


def test_resume_without_checkpoint_of_a_live_run_waits(tmp_path):
    from xmc_repro.resume import close_orphan

    folder = tmp_path / "checkpoints" / "abc"
    lock = checkpoints.RunLock(folder)
    assert lock.acquire()
    try:
        message = close_orphan(f"sqlite:///{tmp_path / 'mlruns.db'}", "abc", folder)
    finally:
        lock.release()
    assert "still being written by another process" in message and "wait for its first checkpoint" in message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_tracking_server_is_reported_within_30_s(tmp_path):
    refused = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    silent = socket.socket()  # accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
    try:
        for uri in (refused, f"http://127.0.0.1:{silent.getsockname()[1]}"):
            began = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "xmc_repro", *TINY, f"logger.tracking_uri={uri}"],
                                    cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
            took = time.monotonic() - began
            assert result.returncode == 2, result.stderr[-3000:]
            lines = stderr_lines(result.stderr)
            assert len(lines) == 1, result.stderr[-3000:]
            assert lines[0].startswith(f"error: logger.tracking_uri={uri}: the tracking server does not answer")
            assert took < 30, took
    finally:
        silent.close()


def test_sigterm_outside_fit_ends_the_run_instead_of_the_process():
    """Lightning handles SIGTERM inside `trainer.fit` only; before it (data, model) and after it (the final test and
    train evaluations) the default handler killed the process and left the MLflow run RUNNING."""
    import os
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from xmc_repro.train import failure_message, sigterm_ends_the_run

    before = signal.getsignal(signal.SIGTERM)
    progress: dict = {}
    with pytest.raises(SIGTERMException) as info, sigterm_ends_the_run(progress):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at once
    assert failure_message(info.value) == "interrupted (SIGTERM)"
    # inside fit Lightning's own handler runs first and flags the signal; its loops then stop where they can
    progress["trainer"] = SimpleNamespace(_signal_connector=SimpleNamespace(received_sigterm=True))
    with sigterm_ends_the_run(progress):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    assert signal.getsignal(signal.SIGTERM) is before


# The command line with a SIGTERM sent to itself at one point of the run (a patched hook), then what it left.
SIGTERM_AT = """
import os, signal, sys
where = sys.argv.pop(1)
def sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
if where == "opening":  # between MLflow creating the run and the tracker holding it
    from mlflow.tracking import MlflowClient
    create_run = MlflowClient.create_run
    MlflowClient.create_run = lambda self, *a, **k: (create_run(self, *a, **k), sigterm())[0]
elif where == "train_end":  # after the loops' last look at Lightning's SIGTERM flag
    from xmc_repro.callbacks import EpochTime
    EpochTime.on_train_end = lambda self, trainer, module: sigterm()
elif where == "finished":  # just after the run is closed FINISHED
    from xmc_repro.tracking import RunTracker
    finish = RunTracker.finish
    RunTracker.finish = lambda self, status="FINISHED", *a, **k: (finish(self, status, *a, **k), sigterm())[0]
from xmc_repro.entry import main
sys.argv = ["xmc_repro", *sys.argv[1:]]
main()
"""


def _sigterm_at(directory: Path, where: str, **_):
    from test_reliability_common import tracking_uri

    (directory / "sigterm_at.py").write_text(SIGTERM_AT)
    _USED.add(directory)
    done = subprocess.run([sys.executable, str(directory / "sigterm_at.py"), where, *TINY, "trainer.max_epochs=1",
                           f"logger.tracking_uri={tracking_uri(directory)}"], cwd=directory, env=cli_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    return directory, done


@pytest.fixture(scope="module")
def sigterm_outcomes(request, tmp_path_factory):
    """The cases of the test below, side by side: (directory, finished process) per case id."""
    return together(request, tmp_path_factory,
                    {"test_a_sigterm_anywhere_in_the_run_ends_it_in_one_line_with_exit_143": _sigterm_at})


@pytest.mark.parametrize("where, status, line", [
    ("opening", "FAILED", "interrupted (SIGTERM)"),  # exit 0, nothing said, and the run RUNNING for good
    ("train_end", "FAILED", "interrupted (SIGTERM)"),  # flagged by Lightning, then ignored: FINISHED, exit 0
    ("finished", "FINISHED", "interrupted (SIGTERM) after run "),  # was turned into FAILED, left out of the tables
])  # fmt: skip
def test_a_sigterm_anywhere_in_the_run_ends_it_in_one_line_with_exit_143(
        sigterm_outcomes, request, where, status, line):
    tmp_path, done = sigterm_outcomes[request.node.name].result()
    lines = [text for text in stderr_lines(done.stderr) if text.startswith("error: ")]
    assert done.returncode == 143 and len(lines) == 1 and line in lines[0], done.stderr[-3000:]
    (run,) = runs(tmp_path)
    assert run.info.status == status
    assert ("test/p_at_1" in run.data.metrics) == (where == "finished")


def test_a_closed_terminal_ends_the_run_as_sigterm_does(tmp_path, store):
    """SIGHUP (the terminal closed, an ssh session dropped) ended the process without a word, its run RUNNING."""
    copy_store(store, tmp_path)
    process = start(tmp_path, [*TINY, "trainer.max_epochs=50"])
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("checkpoints/*/last.ckpt")):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGHUP)
    _, stderr = process.communicate(timeout=120)
    run_id = next(tmp_path.glob("checkpoints/*/last.ckpt")).parent.name
    line = f"interrupted (SIGTERM); continue it with resume={run_id}"
    assert process.returncode == 143 and stderr_lines(stderr)[-1] == f"error: {line}", stderr[-3000:]
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["error"] == line


def test_runs_of_sweep_jobs_killed_by_their_launcher_are_closed_by_the_sweep(tmp_path, store):
    """joblib kills its workers on Ctrl+C before a job can mark its run FAILED; the sweep's own process then closes
    the runs its jobs listed that no process writes any more, and leaves a run whose job is alive to that job."""
    from mlflow.tracking import MlflowClient

    from xmc_repro.resume import close_interrupted
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    killed, killed_early, alive = (RunTracker(uri, "e") for _ in range(3))
    dirs = {run.run_id: tmp_path / "checkpoints" / run.run_id for run in (killed, killed_early, alive)}
    for folder in dirs.values():
        folder.mkdir(parents=True)
    (dirs[killed.run_id] / checkpoints.LAST).write_bytes(b"a checkpoint")
    lock = checkpoints.hold_run(dirs[alive.run_id], alive.run_id)
    listed = tmp_path / "runs.txt"
    listed.write_text("".join(f"{run_id}\t{uri}\t{folder}\n" for run_id, folder in dirs.items()))
    try:
        closed, unclosed = close_interrupted(listed, "Ctrl+C")
        assert sorted(closed) == sorted([killed.run_id, killed_early.run_id]) and unclosed == ""
    finally:
        lock.release()
    client = MlflowClient(uri)
    status = {run_id: client.get_run(run_id) for run_id in dirs}
    assert status[killed.run_id].info.status == "FAILED"
    assert status[killed.run_id].data.tags["error"] == f"interrupted (Ctrl+C); continue it with resume={killed.run_id}"
    assert status[killed_early.run_id].data.tags["error"] == "interrupted (Ctrl+C); no checkpoint yet"
    assert status[alive.run_id].info.status == "RUNNING"  # its job closes it
    alive.finish("FAILED", "closed by its job")


def test_closing_a_sweeps_runs_passes_over_deleted_runs_only(tmp_path, store, monkeypatch):
    """MLflow's INVALID_PARAMETER_VALUE, its answer to a write to a deleted run, was read as "deleted meanwhile"
    whatever it refused: a live run whose closing the store refused (here a reason longer than MLflow keeps, with
    MLFLOW_TRUNCATE_LONG_VALUES=false) stayed RUNNING and nothing said so."""
    from mlflow.tracking import MlflowClient

    from xmc_repro.resume import close_interrupted
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    deleted, refused = RunTracker(uri, "e"), RunTracker(uri, "e")
    client = MlflowClient(uri)
    client.delete_run(deleted.run_id)
    listed = tmp_path / "runs.txt"
    listed.write_text("".join(f"{run.run_id}\t{uri}\t{tmp_path / run.run_id}\n" for run in (deleted, refused)))
    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")
    closed, unclosed = close_interrupted(listed, "x" * 8000)
    assert closed == [] and unclosed.startswith(f"the MLflow run {refused.run_id} could not be marked FAILED "
                                                "(MlflowException: 'value' exceeds the maximum length of 8000")
    assert client.get_run(deleted.run_id).info.lifecycle_stage == "deleted"  # passed over, as before
    refused.finish("FAILED", "closed by the test")


@pytest.mark.parametrize("store_is", ["locked", "left by a second ctrl_c"])
def test_closing_a_sweeps_runs_takes_seconds_and_names_those_left_running(tmp_path, store, monkeypatch, store_is):
    """On a locked store each run was retried for the whole retry window (10 minutes): Ctrl+C on a sweep hung that
    long per run, then said nothing of the runs left RUNNING; Ctrl+C again meanwhile ended in a traceback."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    from xmc_repro import tracking
    from xmc_repro.resume import close_interrupted
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    trackers = [RunTracker(uri, "e") for _ in range(3)]
    ids = [tracker.run_id for tracker in trackers]
    listed = tmp_path / "runs.txt"
    listed.write_text("".join(f"{run_id}\t{uri}\t{tmp_path / 'checkpoints' / run_id}\n" for run_id in ids))
    monkeypatch.setattr(tracking, "RETRY_SECONDS", 3.0)
    monkeypatch.setattr(tracking, "CLOSE_RETRY_SECONDS", 0.5)
    get_run, reads = MlflowClient.get_run, []

    def read(self, run_id):
        reads.append(run_id)
        if store_is == "locked":
            raise sqlite3.OperationalError("database is locked")
        if len(reads) == 2:
            raise KeyboardInterrupt()
        return get_run(self, run_id)

    monkeypatch.setattr(MlflowClient, "get_run", read)
    began = time.monotonic()
    try:
        result = close_interrupted(listed, "Ctrl+C")
    except KeyboardInterrupt:  # not raised on: pytest would stop
        pytest.fail("Ctrl+C again while the runs were being closed ended in a traceback")
    assert time.monotonic() - began < 2  # CLOSE_RETRY_SECONDS for all runs together, not RETRY_SECONDS each
    monkeypatch.undo()
    closed, unclosed = result
    if store_is == "locked":
        assert closed == [] and set(reads) == set(ids[:1])  # the store refused: its other runs were not tried
        reason = "OperationalError: database is locked"
    else:
        assert closed == ids[:1]
        reason = "interrupted while closing them"
    left = ids[len(closed):]
    assert unclosed == (f"the MLflow runs {', '.join(left)} could not be marked FAILED ({reason}) and may show "
                        "RUNNING: once the store is writable, resume=<its id> continues or closes each")
    assert [MlflowClient(uri).get_run(run_id).info.status for run_id in left] == ["RUNNING"] * len(left)
    from xmc_repro.entry import _closing  # the sweep's line

    assert _closing(closed, unclosed, "killed jobs") == (
        f"; the runs of killed jobs are marked FAILED ({ids[0]}): continue each with resume=<its id>; {unclosed}"
        if closed else f"; {unclosed}")
    for tracker in trackers[len(closed):]:
        tracker.finish("FAILED", "closed by the test")


SWEEP_WAITING = """
import sys, time
import xmc_repro.entry as entry
entry._task = lambda: (print("waiting", flush=True), time.sleep(120))  # as a launcher waits for its workers
sys.argv = ["xmc_repro", "-m", "seed=1,2"]
entry.main()
"""


def test_sigterm_to_a_sweeps_own_process_stops_it_as_ctrl_c_does(tmp_path):
    """SIGTERM to the process running a sweep (a joblib launcher's parent, waiting for its workers) killed it
    without a word and orphaned the workers, which went on training."""
    (tmp_path / "sweep.py").write_text(SWEEP_WAITING)
    process = subprocess.Popen([sys.executable, str(tmp_path / "sweep.py")], cwd=tmp_path, env=cli_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "waiting\n"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143 and stderr_lines(stderr) == ["error: interrupted (SIGTERM)"], stderr
    assert not list(tmp_path.glob("multirun/.*"))  # the sweep's bookkeeping files are gone


SWEEP_WRITING = """
import os, sys, time
import xmc_repro.entry as entry
from xmc_repro.cli import STARTED_RUNS_ENV

wait, run = float(sys.argv[1]), sys.argv[2]  # run: "<id>\\t<store>\\t<folder>"


def task():  # a job's bookkeeping (its outcome, its run), then `wait` seconds
    entry._record_outcome("ok")
    with open(os.environ[STARTED_RUNS_ENV], "a") as handle:
        handle.write(run + "\\n")
    print("written", flush=True)
    time.sleep(wait)

entry._task = task
sys.argv = ["xmc_repro", "-m", "seed=1,2"]
entry.main()
"""


def test_a_sweep_killed_with_sigkill_leaves_files_the_next_start_removes(tmp_path, store):
    """A sweep killed with SIGKILL cannot remove its hidden files in multirun/: they piled up there, one pair per
    killed sweep, and the runs its jobs had open stayed RUNNING. The next start closes those runs and removes the
    files of this host whose process is gone, and only those."""
    from mlflow.tracking import MlflowClient

    from xmc_repro import sweep_files
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    left_open = RunTracker(uri, "e").run_id  # a job's run, RUNNING when its sweep was killed
    run = f"{left_open}\t{uri}\t{tmp_path / 'checkpoints' / left_open}"
    (tmp_path / "sweep.py").write_text(SWEEP_WRITING)
    killed = subprocess.Popen([sys.executable, str(tmp_path / "sweep.py"), "120", run], cwd=tmp_path, env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert killed.stdout.readline() == "written\n", killed.stderr.read()[-2000:]
    killed.kill()
    killed.communicate(timeout=60)
    folder = tmp_path / "multirun"
    stale = sorted(p.name for p in folder.iterdir())
    assert len(stale) == 2 and all(f"-{killed.pid}-" in name for name in stale), stale
    legacy = folder / f".runs-{killed.pid}-0123abcd.txt"  # named as before the host was part of the name
    live = folder / f".outcomes-{sweep_files._host()}-{os.getpid()}-89abcdef.txt"  # this process's: alive
    elsewhere = folder / f".runs-otherhost-{killed.pid}-456789ab.txt"  # another machine's sweep in a shared folder
    other = folder / ".notes.txt"
    for path in (legacy, live, elsewhere, other):
        path.write_text("r2\n")
    done = subprocess.run([sys.executable, str(tmp_path / "sweep.py"), "0", "r3\tsqlite:///x.db\tnowhere"],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "written\n", done.stderr[-2000:]
    assert sorted(folder.iterdir()) == sorted([live, elsewhere, other])  # and none of the finished sweep's own
    assert MlflowClient(uri).get_run(left_open).info.status == "FAILED"
    assert (f"note: the runs of a process killed here before are marked FAILED ({left_open}): continue each with "
            "resume=<its id>") in done.stderr


SIGTERM_HANDLER = """
import signal, sys
import xmc_repro.entry as entry
entry._task = lambda: print(signal.getsignal(signal.SIGTERM) is entry._sigterm_stops_like_ctrl_c, flush=True)
sys.argv = ["xmc_repro"]
entry.main()
"""


@pytest.mark.parametrize("ranked, installed", [({}, "True"), ({"RANK": "1", "LOCAL_RANK": "1",
                                                                "TORCHELASTIC_RUN_ID": "x"}, "False")])
def test_sigterm_stops_like_ctrl_c_only_outside_other_ddp_ranks(tmp_path, ranked, installed):
    """A torchrun/srun rank other than 0 runs main too: with the Ctrl+C handler, a SIGTERM inside fit reached
    Lightning as a KeyboardInterrupt, which ends the rank with a silent exit(1) instead of its own error line."""
    (tmp_path / "handler.py").write_text(SIGTERM_HANDLER)
    env = cli_env({"WORLD_SIZE": "2", **ranked})
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "TORCHELASTIC_RUN_ID"):
        if key not in ranked:
            env.pop(key, None)
    done = subprocess.run([sys.executable, str(tmp_path / "handler.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == [installed], done.stderr[-2000:]


def _alive(process) -> bool:
    """Running and not a zombie waiting to be reaped (psutil also tells a reused pid from the process)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow  # about 40 s: two workers train until both runs are open
def test_a_joblib_sweep_stopped_by_sigterm_closes_its_runs_and_leaves_no_worker(tmp_path, store):
    """A joblib sweep end to end: its workers train (no Hydra warning about the launcher config), SIGTERM to the
    sweep's own process stops it in one line with exit 143, both runs end FAILED, no worker keeps training."""
    import psutil

    copy_store(store, tmp_path)
    long = ["dataset.num_train=20000", "trainer.max_epochs=50", "trainer.limit_train_batches=1.0"]
    _USED.add(tmp_path)
    sweep = subprocess.Popen(command(tmp_path, ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *TINY, *long,
                                                "seed=1,2"], multirun=True),  # fmt: skip
                             cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len([r for r in runs(tmp_path) if r.info.status == "RUNNING"]) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    workers = psutil.Process(sweep.pid).children()
    sweep.send_signal(signal.SIGTERM)
    _, stderr = sweep.communicate(timeout=120)
    lines = [line for line in stderr_lines(stderr) if not line.startswith("INFO")]
    assert sweep.returncode == 143 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: interrupted (SIGTERM)"), lines
    assert [r.info.status for r in runs(tmp_path)] == ["FAILED", "FAILED"]
    deadline = time.monotonic() + 30
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert workers and not any(map(_alive, workers)), workers


def test_ddp_lines_name_another_ranks_stop_and_the_rank_that_prints(tmp_path, monkeypatch):
    """Rank 1 stopping (a NaN on its share, a kill) failed rank 0's collective with gloo's traceback as the run's
    reason; rank 1's own lines read like rank 0's ('SIGTERM before the MLflow run was opened')."""
    from xmc_repro.entry import _explained, _rank_prefix
    from xmc_repro.train import failure_message

    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1937. This is ...")
    (tmp_path / "last.ckpt").write_bytes(b"")
    assert _explained(gone)
    assert failure_message(gone, "r1", tmp_path / "last.ckpt") == (
        "another DDP rank stopped (its own error line says why: RuntimeError in a collective); continue the run "
        "with resume=r1")
    assert not _explained(RuntimeError("something else"))
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "NODE_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    assert _rank_prefix() == ""
    monkeypatch.setenv("LOCAL_RANK", "1")  # as Lightning's ddp launcher starts rank 1
    assert _rank_prefix() == "rank 1: "


AROUND_THE_RUNS = """
import sys
import hydra._internal.utils as hydra_utils
import xmc_repro.entry as entry
from xmc_repro.resume import note_started
from xmc_repro.tracking import RunTracker

what, uri = sys.argv[1:]

def launch():  # as Hydra runs a sweep: a job opens its run, then the launcher fails around it
    if what == "folder":
        raise NotADirectoryError(20, "Not a directory", "outputs/a-file/run")
    if what == "full":  # a write to a full disk names no file
        raise OSError(28, "No space left on device")
    TerminatedWorkerError = type("TerminatedWorkerError", (RuntimeError,), {})  # as joblib's loky names it
    tracker = RunTracker(uri, "e")
    note_started(tracker.run_id, tracker.tracking_uri, entry.Path("checkpoints") / tracker.run_id)
    print(tracker.run_id, flush=True)
    raise (TerminatedWorkerError if what == "launcher" else RuntimeError)(
        "A worker process managed by the executor was unexpectedly terminated.")

entry._task = lambda: hydra_utils.run_and_report(launch)
sys.argv = ["xmc_repro", "-m", "seed=1,2"]
entry.main()
"""


@pytest.fixture(scope="module")
def around_outcomes(request, tmp_path_factory, store):
    """The cases of the test below, side by side: (directory, finished process) per case id."""
    def run(directory: Path, what: str):
        copy_store(store, directory)
        (directory / "around.py").write_text(AROUND_THE_RUNS)
        return directory, subprocess.run([sys.executable, str(directory / "around.py"), what,
                                          f"sqlite:///{directory / 'mlruns.db'}"], cwd=directory, env=cli_env(),
                                         capture_output=True, text=True, timeout=300)  # fmt: skip

    return together(request, tmp_path_factory,
                    {"test_what_fails_around_the_runs_is_one_line_and_leaves_no_run_running": run}, workers=4)


@pytest.mark.parametrize("what", ["folder", "full", "launcher", "bug"])
def test_what_fails_around_the_runs_is_one_line_and_leaves_no_run_running(around_outcomes, request, what):
    """Hydra's output folder that cannot be written, and a sweep's launcher failing (joblib's TerminatedWorkerError
    when the OOM killer kills a worker) printed Hydra's traceback; the launcher's left the workers' runs RUNNING."""
    from mlflow.tracking import MlflowClient

    tmp_path, done = around_outcomes[request.node.name].result()
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    where = "(hydra.run.dir=..., with -m hydra.sweep.dir=...)"
    if what == "folder":
        assert done.returncode == 2 and stderr_lines(done.stderr) == [
            f"error: cannot write outputs/a-file/run (Not a directory); fix that folder or choose another {where}"
        ], done.stderr
        return
    if what == "full":
        assert done.returncode == 2 and stderr_lines(done.stderr) == [
            "error: no space left on the device (No space left on device) before any run started; free space on the "
            f"disk of Hydra's output folder or choose another {where}"], done.stderr
        return
    (run_id,) = done.stdout.split()
    kind = "TerminatedWorkerError" if what == "launcher" else "RuntimeError"
    lines = stderr_lines(done.stderr)
    assert done.returncode == 1 and lines[-1] == (
        f"error: the sweep's launcher failed ({kind}: A worker process managed by the executor was unexpectedly "
        f"terminated.); the runs of its unfinished jobs are marked FAILED ({run_id}): continue each with "
        "resume=<its id>"), done.stderr
    assert (len(lines) == 1) == (what == "launcher")  # a bug: its traceback first
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == f"interrupted (the sweep's launcher failed: {kind}); no checkpoint yet"
    assert not list(tmp_path.glob("multirun/.*"))


SUMMARY_CUT_SHORT = """
import sys
import xmc_repro.entry as entry
import xmc_repro.train as train

train.run = lambda cfg: {"config": cfg, "run_id": "r1"}  # a run that FINISHED

def print_summary(cfg, results):
    raise KeyboardInterrupt  # Ctrl+C while the summary prints

entry.print_summary = print_summary
sys.argv = ["xmc_repro", "trainer.accelerator=cpu"]
entry.main()
"""


def test_ctrl_c_during_the_summary_says_the_run_is_recorded(tmp_path):
    """It said `interrupted (Ctrl+C)` alone, as if the run were lost, and the run id was never printed."""
    (tmp_path / "summary.py").write_text(SUMMARY_CUT_SHORT)
    done = subprocess.run([sys.executable, str(tmp_path / "summary.py")], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and stderr_lines(done.stderr) == [
        "error: interrupted (Ctrl+C) after run r1 had FINISHED; its results are recorded"], done.stderr


LOCK_HOLDER = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN EXCLUSIVE")  # as another tool reading or writing the store for a while
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_ctrl_c_while_waiting_for_a_locked_store_ends_in_one_line(tmp_path, store):
    """A store locked when a run starts is waited for (up to tracking.RETRY_SECONDS, 10 minutes); meanwhile Ctrl+C
    and SIGTERM were ignored, being deferred while the run opens. Now: exit 130 and one line, no run created."""
    copy_store(store, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path / "mlruns.db"), "120"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        _USED.add(tmp_path)
        process = subprocess.Popen(command(tmp_path, TINY), cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (tmp_path / "mlruns.db.lock").exists():  # the run has reached the store
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
            time.sleep(0.05)
        time.sleep(1)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert process.returncode == 130, stderr[-3000:]
    assert stderr_lines(stderr) == ["error: interrupted (Ctrl+C) before the MLflow run was opened; nothing was "
                                    "recorded"], stderr[-3000:]
    assert runs(tmp_path) == []


def test_a_second_ctrl_c_while_the_run_is_marked_failed_says_it_shows_running(monkeypatch, tmp_path, store):
    """Ctrl+C, then Ctrl+C again while a slow (or locked) store is being told FAILED: the run stayed RUNNING and the
    second interrupt's traceback said nothing of it."""
    from xmc_repro import train
    from xmc_repro.tracking import RunTracker

    monkeypatch.chdir(tmp_path)
    copy_store(store, tmp_path)

    def fit_interrupted(*args, **kwargs):
        raise KeyboardInterrupt()

    def finish_interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt()

    monkeypatch.setattr(train, "_fit_and_test", fit_interrupted)
    monkeypatch.setattr(RunTracker, "finish", finish_interrupted)
    cfg = tiny_config(tmp_path / "mlruns.db")
    with pytest.raises(KeyboardInterrupt) as info:
        train.run(cfg)
    (run,) = runs(tmp_path)
    assert run.info.status == "RUNNING"  # the store was never told
    assert info.value.run_failure == (f"interrupted (Ctrl+C); Ctrl+C again while the MLflow run was being marked "
                                      f"FAILED: it shows RUNNING; resume={run.info.run_id} continues or closes it")
    monkeypatch.undo()
    RunTracker(cfg.logger.tracking_uri, "xmc_repro", run_id=run.info.run_id).finish("FAILED", "closed by the test")


def test_a_run_failed_by_a_locked_store_is_closed_briefly_or_said_to_show_running(monkeypatch, tmp_path, store):
    """A run that failed because its store stayed locked for the whole retry window then waited that window again,
    on the same lock, to be marked FAILED: ten more minutes of silence before the same news."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    from xmc_repro import tracking, train
    from xmc_repro.tracking import RunTracker

    monkeypatch.chdir(tmp_path)
    copy_store(store, tmp_path)
    locked = []

    def fit_locked_out(*args, **kwargs):  # the store stays locked from here on
        locked.append(True)
        raise sqlite3.OperationalError("database is locked")

    def store_call(original):
        def call(self, *args, **kwargs):
            if locked:
                raise sqlite3.OperationalError("database is locked")
            return original(self, *args, **kwargs)
        return call

    monkeypatch.setattr(tracking, "RETRY_SECONDS", 30.0)
    monkeypatch.setattr(tracking, "CLOSE_RETRY_SECONDS", 0.5)
    monkeypatch.setattr(train, "_fit_and_test", fit_locked_out)
    for name in ("log_batch", "set_terminated"):
        monkeypatch.setattr(MlflowClient, name, store_call(getattr(MlflowClient, name)))
    cfg = tiny_config(tmp_path / "mlruns.db")
    began = time.monotonic()
    with pytest.raises(train.StorageError) as info:
        train.run(cfg)
    assert time.monotonic() - began < 10  # not RETRY_SECONDS again
    (run,) = runs(tmp_path)
    assert run.info.status == "RUNNING"  # the store never let the close in
    message = info.value.run_failure
    assert "\n" not in message and message.startswith(f"the MLflow store {cfg.logger.tracking_uri} stayed locked")
    assert message.endswith(f"the MLflow run {run.info.run_id} could not be marked FAILED (OperationalError: database "
                            f"is locked) and may show RUNNING: once the store is writable, resume={run.info.run_id} "
                            "continues or closes it")
    monkeypatch.undo()
    RunTracker(cfg.logger.tracking_uri, "xmc_repro", run_id=run.info.run_id).finish("FAILED", "closed by the test")


def test_ctrl_c_again_while_the_closing_imports_still_names_the_runs(tmp_path, monkeypatch):
    """Closing a stopped sweep's runs first imports Lightning and MLflow (seconds): a second Ctrl+C then ended in a
    traceback that named none of the runs left RUNNING."""
    from xmc_repro import entry, resume

    listed = tmp_path / "runs.txt"
    listed.write_text("".join(f"run{i}\tsqlite:///x.db\t{tmp_path / f'run{i}'}\n" for i in range(2)))

    def interrupted(path, why):
        raise KeyboardInterrupt()

    monkeypatch.setattr(resume, "close_interrupted", interrupted)
    assert entry._close_killed_jobs(listed, "Ctrl+C") == (
        "; the MLflow runs run0, run1 could not be marked FAILED (interrupted again before closing them) and may show "
        "RUNNING: once the store is writable, resume=<its id> continues or closes each")


def test_ctrl_c_while_a_start_closes_a_killed_sweeps_runs_stops_that_start(tmp_path, store, monkeypatch):
    """The runs a SIGKILLed sweep left open are closed as the next command starts: Ctrl+C meanwhile must stop that
    command (exit 130), not be taken as the end of the closing and let training start."""
    from mlflow.tracking import MlflowClient

    from xmc_repro.resume import close_interrupted
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run_id = RunTracker(uri, "e").run_id
    listed = tmp_path / "runs.txt"
    listed.write_text(f"{run_id}\t{uri}\t{tmp_path / run_id}\n")

    def interrupted(self, run_id):
        raise KeyboardInterrupt()

    monkeypatch.setattr(MlflowClient, "get_run", interrupted)
    assert close_interrupted(listed, "SIGKILL")[1].endswith("resume=" + run_id + " continues or closes it")
    with pytest.raises(KeyboardInterrupt):
        close_interrupted(listed, "SIGKILL", stop_on_ctrl_c=True)
