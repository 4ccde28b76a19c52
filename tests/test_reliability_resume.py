"""Interrupted runs: kill a training process, resume it, and get what an uninterrupted run gets.

Each scenario starts the reference run (never interrupted) and the run to kill at the same time, kills the
latter (SIGKILL mid-epoch; SIGTERM after an epoch) right after its first checkpoint lands, resumes it with
`resume=<run id>`, and compares: the same MLflow run continues and ends FINISHED; the final sparse
connections are identical, weights and every metric (test/train P@k, nDCG, PSP, the per-epoch validation
P@3 history) equal within float tolerance.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from test_reliability_common import TINY, cli, cli_env, command, copy_store, make_store, runs, start
from test_reliability_common import no_run_left_running  # noqa: F401  (autouse)
from xmc_repro import checkpoints
from xmc_repro.errors import ConfigError

# 40 steps per epoch, 3 epochs; the LR halves after every epoch (no epoch beats the last by 100 points),
# so a resumed run that missed a plateau-scheduler step would train differently.
CONFIG = [*TINY, "dataset.num_train=640", "trainer.max_epochs=3", "trainer.lr_patience=0", "trainer.lr_threshold=1.0"]
STEPS_PER_EPOCH = 40


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("store"))


def _workdir(base: Path, name: str, store: Path) -> Path:
    path = base / name
    path.mkdir()
    copy_store(store, path)
    return path


def _kill_after_first_checkpoint(process, workdir: Path, how: signal.Signals, timeout: float = 240) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(workdir.glob("checkpoints/*/last.ckpt"))
        if found:
            process.send_signal(how)
            process.wait(timeout=120)
            return found[0]
        if process.poll() is not None:
            pytest.fail(f"the run ended before its first checkpoint:\n{process.stderr.read()[-3000:]}")
        time.sleep(0.01)
    process.kill()
    pytest.fail("no checkpoint appeared")


def _finished_run(workdir: Path):
    (run,) = runs(workdir)
    assert run.info.status == "FINISHED", run.data.tags.get("error")
    return run


def _history(workdir: Path, run_id: str, metric: str = "val/p_at_3") -> list[float]:
    from mlflow.tracking import MlflowClient

    history = MlflowClient(f"sqlite:///{workdir / 'mlruns.db'}").get_metric_history(run_id, metric)
    by_step = {m.step: m.value for m in history}
    assert len(by_step) == len(history), f"{metric}: a step logged twice"  # a replayed step is logged once
    return [by_step[s] for s in sorted(by_step)]


def _compare(reference: Path, resumed: Path) -> None:
    ref_run, res_run = _finished_run(reference), _finished_run(resumed)
    for key, value in ref_run.data.metrics.items():
        if key.startswith(("test/", "train/p_at", "train/ndcg", "train/psp")) or key == "epochs":
            assert res_run.data.metrics[key] == pytest.approx(value, abs=1e-4), key
    for metric in ("val/p_at_3", "train/loss_epoch"):  # the interrupted epoch's mean loss counts all its batches
        assert _history(resumed, res_run.info.run_id, metric) == pytest.approx(
            _history(reference, ref_run.info.run_id, metric), rel=1e-6), metric
    ref_state, res_state = (
        torch.load(next(d.glob("checkpoints/*/last.ckpt")), map_location="cpu", weights_only=False)["state_dict"]
        for d in (reference, resumed)
    )
    assert torch.equal(ref_state["head.indices"], res_state["head.indices"])
    for key in ref_state:
        torch.testing.assert_close(res_state[key], ref_state[key], rtol=1e-5, atol=1e-6, msg=key)


def _scenario(tmp_path: Path, store: Path, extra: list[str], how: signal.Signals = signal.SIGKILL):
    reference, killed = _workdir(tmp_path, "reference", store), _workdir(tmp_path, "killed", store)
    ref_process, process = start(reference, CONFIG + extra), start(killed, CONFIG + extra)
    checkpoint = _kill_after_first_checkpoint(process, killed, how)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    run_id = checkpoint.parent.name
    (interrupted,) = runs(killed)
    if how == signal.SIGKILL:
        assert interrupted.info.status == "RUNNING"  # no chance to close it
    else:  # SIGTERM (a scheduler's preemption): stops after the current batch, FAILED with how to go on
        assert process.returncode == 143
        message = f"interrupted (SIGTERM); continue it with resume={run_id}"
        assert f"error: {message}" in process.stderr.read().splitlines()
        assert interrupted.info.status == "FAILED" and interrupted.data.tags["error"] == message
    result = cli(killed, [f"resume={run_id}", "trainer.progress_bar=false"])
    assert result.returncode == 0, result.stderr[-3000:]
    if saved["xmc_repro"]["at"] == "step":  # the epoch the run was resumed in gets its line too
        assert f"epoch {saved['epoch'] + 1}/" in result.stdout + result.stderr
    _, ref_err = ref_process.communicate(timeout=300)
    assert ref_process.returncode == 0, ref_err[-3000:]
    (resumed,) = runs(killed)
    assert resumed.info.run_id == run_id and resumed.data.tags["resumed"] == "1"
    assert "error" not in resumed.data.tags
    _compare(reference, killed)
    return saved


def test_sigkill_mid_epoch_then_resume_equals_uninterrupted(tmp_path, store):
    saved = _scenario(tmp_path, store, ["trainer.checkpoint_every_n_steps=3"])
    assert saved["xmc_repro"]["at"] == "step"
    assert saved["global_step"] % STEPS_PER_EPOCH != 0  # really mid-epoch
    # TINY rewires every 7 steps on the authors' schedule (after steps 1, 8, 15, ...): the checkpoint counts them all
    assert saved["callbacks"]["Rewiring"]["rewirings"] == len(range(1, saved["global_step"] + 1, 7)) > 0


@pytest.mark.slow
def test_sigterm_after_an_epoch_then_resume_equals_uninterrupted(tmp_path, store):
    saved = _scenario(tmp_path, store, [], how=signal.SIGTERM)
    assert saved["xmc_repro"]["at"] == "epoch" and saved["global_step"] == STEPS_PER_EPOCH


@pytest.mark.slow
def test_data_loading_workers_do_not_change_what_is_trained(tmp_path, store):
    """trainer.num_workers may change on resume: a run with a worker trains what one without does. Persistent
    workers drew their base seed from the global RNG (dropout's) once per loader instead of once per epoch, so the
    masks differed from the second epoch on, and a run resumed after an epoch (new loaders) drew where the
    uninterrupted one did not."""
    without, with_worker = _workdir(tmp_path, "without", store), _workdir(tmp_path, "worker", store)
    for workdir, workers in ((without, 0), (with_worker, 1)):
        result = cli(workdir, CONFIG + ["trainer.max_epochs=2", f"trainer.num_workers={workers}"])
        assert result.returncode == 0, result.stderr[-3000:]
    _compare(without, with_worker)


# The command line, SIGKILLed by itself right after its first epoch-end checkpoint is in place.
KILLED_AFTER_THE_EPOCH_CHECKPOINT = """
import os, signal, sys
from xmc_repro import checkpoints, entry
save = checkpoints.LastCheckpoint._save
def save_then_die(self, trainer, pl_module, at):
    save(self, trainer, pl_module, at)
    if at == "epoch":
        os.kill(os.getpid(), signal.SIGKILL)
checkpoints.LastCheckpoint._save = save_then_die
sys.argv[0] = "xmc_repro"
entry.main()
"""


@pytest.mark.slow
def test_a_kill_right_after_an_epoch_checkpoint_loses_none_of_the_epoch_metrics(tmp_path, store):
    """Lightning logs an epoch's training metrics after the epoch-end checkpoint is written; the resumed run, which
    starts from the next epoch, logs those the killed process had not."""
    reference, killed = _workdir(tmp_path, "reference", store), _workdir(tmp_path, "killed", store)
    result = cli(reference, CONFIG + ["trainer.max_epochs=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    args = command(killed, CONFIG + ["trainer.max_epochs=2"])[3:]  # after `python -m xmc_repro`
    died = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_EPOCH_CHECKPOINT, *args], cwd=killed,
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
    (checkpoint,) = killed.glob("checkpoints/*/last.ckpt")
    result = cli(killed, [f"resume={checkpoint.parent.name}"])
    assert result.returncode == 0, result.stderr[-3000:]
    ref_run, res_run = _finished_run(reference), _finished_run(killed)
    assert _history(killed, res_run.info.run_id, "train/loss_epoch") == pytest.approx(
        _history(reference, ref_run.info.run_id, "train/loss_epoch"), rel=1e-6)
    assert len(_history(killed, res_run.info.run_id, "epoch_time_s")) == 2


def test_resume_refuses_data_files_that_changed_since_the_run_started(tmp_path, store):
    """The run's settings name the same files, whose content changed: the run is not continued on other data."""
    workdir = _workdir(tmp_path, "changed", store)
    workdir.joinpath("train.txt").write_text("3 5 3\n0,1 0:1.0 2:0.5\n2 1:1.0\n1 3:0.25 4:1\n")
    workdir.joinpath("test.txt").write_text("2 5 3\n0 0:1.0\n1,2 4:2.0\n")
    xc = ["dataset=xc", "dataset.train_file=train.txt", "dataset.test_file=test.txt", "model.connectivity=2",
          "trainer.batch_size=1", "trainer.max_epochs=100", "trainer.progress_bar=false"]
    checkpoint = _kill_after_first_checkpoint(start(workdir, xc), workdir, signal.SIGKILL)
    run_id = checkpoint.parent.name
    workdir.joinpath("train.txt").write_text("3 5 3\n0,1 0:1.0 2:0.5\n2 1:1.0\n1 3:0.5 4:1\n")  # one value
    result = cli(workdir, [f"resume={run_id}"])
    assert result.returncode == 2, result.stderr[-3000:]
    line = "resume: the data read now (digest "
    assert result.stderr.splitlines()[-1].startswith(f"error: {line}") and "Traceback" not in result.stderr
    (run,) = runs(workdir)
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith(line)


def test_resume_names_what_is_missing(tmp_path, monkeypatch):
    from xmc_repro.errors import ConfigError
    from xmc_repro.resume import resume_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"resume=0123abc: neither a checkpoint file nor a run with checkpoints/0123"):
        resume_checkpoint("0123abc")
    for path in ("gone/last.ckpt", "gone.ckpt"):  # a path, not a run id: named as given
        with pytest.raises(ConfigError, match=rf"^resume={path}: no such checkpoint file in .*; give the path of a"):
            resume_checkpoint(path)
    (tmp_path / "checkpoints" / "0123abc").mkdir(parents=True)
    (tmp_path / "checkpoints" / "0123abc" / "best.ckpt").write_bytes(b"")  # last.ckpt deleted: not "no checkpoint"
    with pytest.raises(ConfigError, match=r"last.ckpt is missing, the run's folder holds best.ckpt; continue from that "
                                          r"checkpoint's epoch with resume=checkpoints/0123abc/best.ckpt$"):
        resume_checkpoint("0123abc", "sqlite:///unused.db")
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint .*; give a run id or a .ckpt file"):
        checkpoints.read(resume_checkpoint(str(tmp_path / "junk.ckpt")))
    for run_id in ("df94aa11", "df94bb22"):  # the id's first characters, as a run's name ends with them
        (tmp_path / "checkpoints" / run_id).mkdir()
        (tmp_path / "checkpoints" / run_id / "last.ckpt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^resume=df94: no run has this whole id; runs here whose id starts so: "
                                          r"df94aa11, df94bb22; pass the whole id, e.g. resume=df94aa11$"):
        resume_checkpoint("df94", "sqlite:///unused.db")
    with pytest.raises(ConfigError, match="resume=df9\*: neither a checkpoint file"):  # no pattern
        resume_checkpoint("df9*")


CREATED_THEN_KILLED = """
import os, sys
from xmc_repro.tracking import RunTracker
print(RunTracker(sys.argv[1], "e").run_id, flush=True)
os._exit(0)  # as a SIGKILL between the run's creation and its folder: no folder, the run RUNNING
"""


def test_a_run_killed_before_its_folder_existed_is_closed_by_resume(tmp_path, store, monkeypatch):
    """Created in MLflow, killed before `checkpoints/<id>/` existed: resume= said the run was not in this directory
    and left it RUNNING for good. Its tag `started_by` names the process, gone, and this folder: resume closes it."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from test_reliability_common import cli_env
    from xmc_repro.resume import resume_checkpoint
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    made = subprocess.run([sys.executable, "-c", CREATED_THEN_KILLED, uri], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    run_id = made.stdout.split()[-1]
    with pytest.raises(ConfigError, match=rf"^resume={run_id}: run {run_id} stopped before its first checkpoint .* "
                                          "now marked FAILED"):
        resume_checkpoint(run_id, uri)
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FAILED"
    alive = RunTracker(uri, "e")  # started by this process, which lives: still starting
    with pytest.raises(ConfigError, match=rf"run {alive.run_id} is still being started by process \d+"):
        resume_checkpoint(alive.run_id, uri)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # started in another folder: may be alive there; not touched
    with pytest.raises(ConfigError, match="neither a checkpoint file nor a run with"):
        resume_checkpoint(alive.run_id, uri)
    assert client.get_run(alive.run_id).info.status == "RUNNING"
    alive.finish("FINISHED")


def test_a_pid_reused_since_the_run_was_created_does_not_keep_it_running(tmp_path, store, monkeypatch):
    """The pid in `started_by` taken by a later process (pid 1 here; after a container's restart, the resuming
    process itself): resume said the run was still being started, for good."""
    import os

    import psutil
    from mlflow.tracking import MlflowClient

    from xmc_repro.resume import resume_checkpoint
    from xmc_repro.tracking import started_by

    copy_store(store, tmp_path)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("reused")
    place = started_by().partition("@")[2]
    for pid in (1, os.getpid()):  # live processes, both created after the run below
        created = psutil.Process(pid).create_time()
        run = client.create_run(experiment, start_time=int((created - 60) * 1000),  # a minute before the process
                                tags={"started_by": f"{pid}@{place}"})
        with pytest.raises(ConfigError, match="now marked FAILED"):
            resume_checkpoint(run.info.run_id, uri)
        assert client.get_run(run.info.run_id).info.status == "FAILED"


def test_an_empty_resume_or_fewer_epochs_than_done_are_refused_before_the_run_is_touched(tmp_path):
    """`resume=` with an unset variable would start a new run; `trainer.max_epochs` below the epochs a checkpoint has
    completed failed inside Lightning, with a traceback, after the run was reopened."""
    import torch

    from xmc_repro.resume import prepare

    with pytest.raises(ConfigError, match=r"^resume= is empty; pass the run id or checkpoint path"):
        prepare(OmegaConf.create({"resume": " "}), explicit=["resume"], multirun=False)
    stored = {"trainer": {"max_epochs": 6}, "resume": None}
    path = tmp_path / "last.ckpt"
    # As written at the end of epoch 3: Lightning counts that epoch as completed only after its checkpoints.
    progress = {"ready": 3, "started": 3, "processed": 3, "completed": 2}
    for ours in ({"epochs_done": 3}, {}):  # checkpoints from before epochs_done: Lightning's processed epochs
        torch.save({"state_dict": {}, "loops": {"fit_loop": {"epoch_progress": {"current": progress}}},
                    checkpoints.STATE_KEY: {"config": OmegaConf.to_yaml(stored), "run_id": "r1", **ours}}, path)
        command_line = lambda epochs: OmegaConf.create({"resume": str(path), "trainer": {"max_epochs": epochs}})
        with pytest.raises(ConfigError,
                           match=r"^resume: trainer.max_epochs=2 is below the 3 epochs .*max_epochs=3 or more$"):
            prepare(command_line(2), explicit=["resume", "trainer.max_epochs"], multirun=False)
        merged, resumed_from, run_id = prepare(command_line(3), explicit=["resume", "trainer.max_epochs"],
                                               multirun=False)
        assert merged.trainer.max_epochs == 3 and resumed_from == path and run_id == "r1"


def test_reopening_a_run(tmp_path, store):
    from xmc_repro.errors import ConfigError
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    failed = RunTracker(uri, "e")
    failed.finish("FAILED", "the training loss is nan at step 3")
    reopened = RunTracker(uri, "e", run_id=failed.run_id)
    run = reopened.client.get_run(failed.run_id)
    assert run.info.status == "RUNNING" and "error" not in run.data.tags and run.data.tags["resumed"] == "1"
    reopened.finish("FINISHED")
    with pytest.raises(ConfigError, match="already FINISHED"):
        RunTracker(uri, "e", run_id=failed.run_id)
    for unknown in ("0" * 32, "no run/id"):  # the second no store can hold (MLflow: INVALID_PARAMETER_VALUE)
        with pytest.raises(ConfigError, match="is not in sqlite"):
            RunTracker(uri, "e", run_id=unknown)


def test_resuming_a_deleted_run_says_how_to_restore_it(tmp_path, store):
    """It said "cannot use this MLflow store (MlflowException: The run ... must be in the 'active' state ...); use
    sqlite:///mlruns.db, ..." of the store the run is in."""
    from xmc_repro.errors import ConfigError
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    failed = RunTracker(uri, "e")
    failed.finish("FAILED", "interrupted (SIGTERM)")
    failed.client.delete_run(failed.run_id)
    with pytest.raises(ConfigError, match=rf"^resume={failed.run_id}: that MLflow run was deleted; restore it to "
                                          rf"continue it \(mlflow runs restore --run-id {failed.run_id}, with "):
        RunTracker(uri, "e", run_id=failed.run_id)
    assert failed.client.get_run(failed.run_id).info.status == "FAILED"


def test_a_resumed_run_stays_in_its_experiment_whatever_the_experiment_name(tmp_path, store):
    """`logger` comes from the resuming command line: without the run's logger.experiment_name, the summary linked
    the runs table of another (new, empty) experiment."""
    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    first = RunTracker(uri, "ablation")
    first.finish("FAILED", "interrupted (SIGTERM)")
    reopened = RunTracker(uri, "xmc_repro", run_id=first.run_id)
    assert reopened.experiment_id == first.experiment_id
    assert reopened.runs_table_url().endswith(f"/#/experiments/{first.experiment_id}/runs")
    assert reopened.client.get_experiment_by_name("xmc_repro") is None
    reopened.finish("FINISHED")


def test_resume_config_keeps_the_run_settings():
    from xmc_repro.resume import resume_config

    stored = OmegaConf.create({"model": {"head": "uniform", "connectivity": 8}, "trainer": {"max_epochs": 3, "lr": 0.1},
                               "logger": {"tracking_uri": "sqlite:///old.db"}, "resume": None})
    now = OmegaConf.create({"model": {"head": "dense", "connectivity": None}, "trainer": {"max_epochs": 5, "lr": 0.1},
                            "logger": {"tracking_uri": "sqlite:///new.db"}, "resume": "abc", "new_section": {"x": 1},
                            "callbacks": {"size": "${model.connectivity}"}})
    merged = resume_config(now, stored, explicit=["resume", "trainer.max_epochs", "trainer.lr"])
    assert merged.model.head == "uniform" and merged.model.connectivity == 8  # not given: the run's own
    assert merged.trainer.max_epochs == 5  # may change
    assert merged.logger.tracking_uri == "sqlite:///new.db" and merged.resume == "abc"
    assert merged.new_section.x == 1
    assert merged.callbacks.size == 8  # a section the run lacks reads the run's settings, not this command line's
    with pytest.raises(Exception, match="model.head was .uniform. in the run and is .dense. on this command line"):
        resume_config(now, stored, explicit=["model"])


def test_resume_refuses_a_setting_the_run_has_as_null_or_predates_and_names_it_in_a_group():
    from xmc_repro.resume import resume_config

    # a run from before trainer.adam_eps_placement and the unstructured head's distinct_sources (commit bd3f846):
    # it trained with torch's Adam and distinct positions, without an intermediate layer
    stored = OmegaConf.create({"model": {"head": "unstructured", "intermediate": None, "rewire_fraction": 0.1},
                               "trainer": {"max_epochs": 4, "lr": 0.001}, "logger": {}, "resume": None})
    now = OmegaConf.create({"model": {"head": "unstructured", "intermediate": 64, "rewire_fraction": 0.01,
                                      "distinct_sources": False},
                            "trainer": {"max_epochs": 4, "lr": 0.001, "adam_eps_placement": "keras"},
                            "logger": {}, "resume": "abc"})
    refused = {"model.intermediate": r"model.intermediate was null in the run and is 64",
               "trainer.adam_eps_placement": r"trainer.adam_eps_placement was 'torch' \(the run predates",
               "model.distinct_sources": r"model.distinct_sources was True \(the run predates"}
    for key, message in refused.items():  # each was dropped without a word: the run went on as before
        with pytest.raises(ConfigError, match=message):
            resume_config(now, stored, explicit=["resume", key])
    # the same command line again: the setting of the group that differs is named, not the whole group
    with pytest.raises(ConfigError, match=r"model.intermediate was null .* \(from model=...\).*drop model="):
        resume_config(now, stored, explicit=["resume", "model"])
    as_it_trained = OmegaConf.create({"model": {"head": "unstructured", "intermediate": None, "rewire_fraction": 0.1,
                                                "distinct_sources": True},
                                      "trainer": {"max_epochs": 4, "lr": 0.001, "adam_eps_placement": "torch"},
                                      "logger": {}, "resume": "abc"})
    merged = resume_config(as_it_trained, stored, explicit=["resume", "model", "trainer.adam_eps_placement"])
    assert "adam_eps_placement" not in merged.trainer and merged.model.rewire_fraction == 0.1


def test_prepare_starts_new_runs_and_refuses_resume_in_a_sweep():
    from xmc_repro.resume import prepare

    fresh = OmegaConf.create({"resume": None, "seed": 0})
    assert prepare(fresh, explicit=[], multirun=True) == (fresh, None, None)
    with pytest.raises(ConfigError, match="continues one run: run it without -m"):
        prepare(OmegaConf.create({"resume": "abc"}), explicit=["resume"], multirun=True)


def test_final_results_recorded_again_by_a_resume_are_logged_once(tmp_path, store):
    """Killed after logging its final test/train metrics but before being marked FINISHED, a run resumed with
    resume= tests again and logged every final metric a second time at step 0."""
    from mlflow.tracking import MlflowClient

    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    killed = RunTracker(uri, "e")
    killed.log_metrics({"test/p_at_1": 41.5, "epochs": 3})  # then SIGKILL: the run stays RUNNING
    resumed = RunTracker(uri, "e", run_id=killed.run_id)
    resumed.log_metrics({"test/p_at_1": 41.5, "epochs": 3, "train/p_at_1": 40.0})
    resumed.finish("FINISHED")
    client = MlflowClient(uri)
    for key in ("test/p_at_1", "epochs", "train/p_at_1"):
        assert [m.step for m in client.get_metric_history(killed.run_id, key)] == [0], key


def test_final_results_that_changed_on_resume_are_logged(tmp_path, store):
    """Killed between its final metrics and FINISHED, then resumed with a larger trainer.max_epochs: the results
    of the longer training were dropped as 'already logged at step 0'; the run showed the first attempt's."""
    from mlflow.tracking import MlflowClient

    from xmc_repro.tracking import RunTracker

    copy_store(store, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    killed = RunTracker(uri, "e")
    killed.log_metrics({"test/p_at_1": 41.5, "epochs": 3})
    resumed = RunTracker(uri, "e", run_id=killed.run_id)
    resumed.log_metrics({"test/p_at_1": 47.0, "epochs": 10})
    resumed.finish("FINISHED")
    assert MlflowClient(uri).get_run(killed.run_id).data.metrics == {"test/p_at_1": 47.0, "epochs": 10.0}


def test_a_resumed_cpu_run_trains_on_the_threads_it_trained_with(tmp_path, store):
    """A sweep's `hydra.job.env_set` (the smoke scale's OMP_NUM_THREADS=1) does not reach `resume=`: the run went on
    with the process's threads, so with other sums and another `device` tag (a report row of its own)."""
    workdir = _workdir(tmp_path, "threads", store)
    started = start(workdir, [*TINY, "trainer.checkpoint_every_n_steps=3"], env={"OMP_NUM_THREADS": "1"})
    run_id = _kill_after_first_checkpoint(started, workdir, signal.SIGKILL).parent.name
    (run,) = runs(workdir)
    tagged = run.data.tags["device"]
    assert tagged.endswith(", 1 threads)")
    result = cli(workdir, [f"resume={run_id}"], env={"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(workdir)
    assert run.data.tags["device"] == tagged and run.info.status == "FINISHED"
    assert "resume: 1 CPU thread(s) per process, as the run trained with" in result.stdout.splitlines()
