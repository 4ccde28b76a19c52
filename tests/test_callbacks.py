"""Callbacks in a real fit: Adam's moments are zeroed exactly at the rewired slots; epoch rewiring fires; step times;
the step profile and the memory report."""

from __future__ import annotations

import re
import statistics
import time

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY, quiet_trainer

from lightning.pytorch.loggers import Logger

from xmc_repro.callbacks import EpochTime, MemoryPeakReport, Rewiring, StepProfile
from xmc_repro.data import build_datamodule
from xmc_repro.model import XMCClassifier


def _model(head: str) -> XMCClassifier:
    # BCE: every output gradient is nonzero, so after a step both Adam moments are nonzero at every slot
    return XMCClassifier(TINY["num_features"], TINY["num_labels"], head=head, connectivity=4, intermediate=32,
                         loss="bce")


class _Snapshot(pl.Callback):
    """Copies the head's weights, sources and Adam moments at the end of the given optimizer step."""

    def __init__(self, step: int):
        self.step, self.taken = step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            head = pl_module.head
            state = trainer.optimizers[0].state[head.weight]
            self.taken = {"weight": head.weight.detach().clone(), "indices": head.indices.clone(),
                          **{k: state[k].clone() for k in ("exp_avg", "exp_avg_sq")}}


@pytest.mark.parametrize("head", ["uniform", "unstructured"])
def test_adam_moments_are_zeroed_exactly_at_the_rewired_slots(tmp_path, head):
    rewiring = Rewiring(0.2, every_n_steps=3, seed=1)
    step = next(s for s in range(2, 10) if rewiring.due(s))  # a rewiring after real Adam steps
    # Lightning runs a hook's callbacks in list order: one snapshot on each side of the rewiring
    before, after = _Snapshot(step), _Snapshot(step)
    trainer = quiet_trainer(tmp_path, max_steps=step, limit_val_batches=0, callbacks=[before, rewiring, after])
    trainer.fit(_model(head), datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    a, b = before.taken, after.taken
    assert torch.equal(a["weight"], b["weight"])  # values are kept
    n = a["weight"].numel()
    for key in ("exp_avg", "exp_avg_sq"):
        assert (a[key] != 0).all()
    zeroed = (b["exp_avg"] == 0).view(-1)
    assert torch.equal(zeroed, (b["exp_avg_sq"] == 0).view(-1))
    # the zeroed slots are the globally lowest |w| (a prefix of the magnitude order), about the fraction
    order = a["weight"].abs().view(-1).argsort()
    count = int(zeroed.sum())
    assert abs(count - 0.2 * n) <= 1 and zeroed[order[:count]].all()
    for key in ("exp_avg", "exp_avg_sq"):  # nothing else is touched
        torch.testing.assert_close(b[key].view(-1)[~zeroed], a[key].view(-1)[~zeroed], rtol=0, atol=0)
    moved = a["indices"] != b["indices"]
    moved = moved.view(-1) if head == "uniform" else moved.any(0)
    assert moved.any() and zeroed[moved].all()  # every slot given a new source starts with fresh moments


def test_epoch_rewiring_fires_at_every_epoch_start_but_the_first(tmp_path):
    rewiring = Rewiring(0.25, every_epoch=True, seed=2)
    model = _model("uniform")
    seen = []

    class _Sources(pl.Callback):  # after Rewiring in the list: sees each epoch's sources once rewired
        def on_train_epoch_start(self, trainer, pl_module):
            seen.append(pl_module.head.indices.clone())

    trainer = quiet_trainer(tmp_path, max_epochs=3, limit_train_batches=3, limit_val_batches=1,
                            callbacks=[rewiring, _Sources()])
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert rewiring.rewirings == 2
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    step_only = Rewiring(0.25, every_n_steps=None, every_epoch=False)
    assert not any(step_only.due(s) for s in range(1, 100))


class _Kept(Logger):
    """A logger that keeps what it is given, in order."""

    name, version = "kept", 0

    def __init__(self):
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_the_epoch_line_says_where_a_long_epoch_is_while_it_runs(tmp_path, capsys):
    """With the progress bar off, an hour-long epoch (670k labels on a CPU) printed nothing until it ended."""
    from xmc_repro.console import EpochLine

    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4)
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=2,
                            callbacks=[EpochLine(every_s=0.0)])
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    lines = [line.rsplit("  ", 1)[0] for line in capsys.readouterr().out.splitlines() if " batch " in line]
    assert lines == ["epoch 1/1  batch 1/3", "epoch 1/1  batch 2/3", "epoch 1/1  batch 3/3",
                     "epoch 1/1  validation batch 1/2", "epoch 1/1  validation batch 2/2"]
    quiet = EpochLine()  # the default: a line a minute
    quiet.on_train_epoch_start(trainer, model)
    quiet._where(trainer, "batch", 0, 3)
    assert " batch " not in capsys.readouterr().out


def test_step_times_are_window_means_per_epoch_logged_at_each_windows_last_step(tmp_path, capsys):
    from xmc_repro.console import EpochLine

    class _Slow(pl.Callback):  # every step takes at least 15 ms more
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(0.015)

    times, logger = EpochTime(step_window=3), _Kept()
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    trainer = quiet_trainer(tmp_path, max_epochs=2, limit_train_batches=8, limit_val_batches=1, logger=logger,
                            log_every_n_steps=1000, callbacks=[_Slow(), times, EpochLine()])
    start = time.perf_counter()
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    fit_ms = (time.perf_counter() - start) * 1000
    logged = [(step, m["train/ms_per_step"]) for step, m in logger.metrics if "train/ms_per_step" in m]
    # Windows start at batches 0, 3, 6 of each epoch; the last one of an epoch (2 batches) ends at validation,
    # which no window includes: two windows an epoch, logged at the step that ends them.
    assert [step for step, _ in logged] == [3, 6, 11, 14]
    assert [ms for _, ms in logged] == times.step_ms
    assert all(ms >= 15 for ms in times.step_ms) and 3 * sum(times.step_ms) < fit_ms  # per step, not per window
    assert times.step_ms_median == statistics.median(times.step_ms)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 2/2")]
    assert lines and lines[0].endswith(f"{statistics.median(times.step_ms[2:]):.2f} ms/step")
    resumed = EpochTime()
    resumed.load_state_dict(times.state_dict())
    assert resumed.step_ms == times.step_ms
    resumed.load_state_dict({"fit_seconds": 1.0})  # a checkpoint from before step times
    assert resumed.step_ms == [] and resumed.step_ms_median is None


def test_an_epoch_shorter_than_the_step_window_is_one_window(tmp_path):
    """Epochs of step_window batches or fewer (Bibtex's, at the default 100) logged no step time at all."""
    times, logger = EpochTime(step_window=10), _Kept()
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4)
    trainer = quiet_trainer(tmp_path, max_epochs=2, limit_train_batches=4, limit_val_batches=1, logger=logger,
                            log_every_n_steps=1000, callbacks=[times])
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    logged = [(step, m["train/ms_per_step"]) for step, m in logger.metrics if "train/ms_per_step" in m]
    assert [step for step, _ in logged] == [4, 8] and [ms for _, ms in logged] == times.step_ms
    assert all(ms > 0 for ms in times.step_ms) and times.epoch_step_ms == times.step_ms[1:]


def test_a_resumed_epochs_time_counts_the_time_before_its_checkpoint():
    """A run resumed mid-epoch logged as that epoch's epoch_time_s only the time since the resume."""
    logged = {}

    class _Module:
        device = torch.device("cpu")

        def log(self, key, value, **kwargs):
            logged[key] = value

    killed = EpochTime()
    killed.on_fit_start(None, _Module())
    killed.on_train_epoch_start(None, _Module())
    killed._epoch_start -= 30.0  # 30 s into the epoch when its checkpoint is written
    resumed = EpochTime()
    resumed.load_state_dict(killed.state_dict())
    resumed.on_fit_start(None, _Module())
    resumed.on_train_start(None, _Module())  # mid-epoch: no on_train_epoch_start
    resumed.on_train_epoch_end(None, _Module())
    assert 30.0 <= logged["epoch_time_s"] < 40.0
    resumed.on_train_epoch_start(None, _Module())  # the next epoch starts its own clock
    resumed.on_train_epoch_end(None, _Module())
    assert logged["epoch_time_s"] < 10.0
    resumed.load_state_dict({"fit_seconds": 1.0})  # a checkpoint from before epoch times: the resume's time only
    resumed.on_train_start(None, _Module())
    resumed.on_train_epoch_end(None, _Module())
    assert logged["epoch_time_s"] < 10.0


def test_a_long_epoch_resumed_near_its_end_logs_no_window_of_its_last_batches():
    """A run resumed at batch 240 of 250 (step_window 100) logged those 10 batches, restart included, as a window of
    their own: an epoch longer than the window drops its tail, resumed or not."""
    from types import SimpleNamespace

    logger = _Kept()
    trainer = SimpleNamespace(num_training_batches=250, loggers=[logger], global_step=0)
    module = SimpleNamespace(device=torch.device("cpu"))
    resumed = EpochTime(step_window=100)
    resumed.on_train_start(trainer, module)  # mid-epoch: no on_train_epoch_start
    for batch_idx in range(240, 250):
        resumed.on_train_batch_start(trainer, module, None, batch_idx)
        resumed.on_train_batch_end(trainer, module, None, None, batch_idx)
    assert resumed.step_ms == [] and not logger.metrics
    short = SimpleNamespace(num_training_batches=100, loggers=[logger], global_step=0)
    resumed.on_train_epoch_start(short, module)  # an epoch of step_window batches: one window, closed at its end
    for batch_idx in range(100):
        resumed.on_train_batch_start(short, module, None, batch_idx)
        resumed.on_train_batch_end(short, module, None, None, batch_idx)
    assert len(resumed.step_ms) == 1 and len(logger.metrics) == 1


def test_a_step_profile_covers_the_asked_steps_and_lands_in_the_runs_folder(tmp_path, capsys):
    from xmc_repro import trace_gaps

    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    profile = StepProfile(tmp_path / "run", steps=3, start=2)
    trainer = quiet_trainer(tmp_path, max_steps=8, limit_val_batches=0, accelerator="cpu", callbacks=[profile])
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    text = (tmp_path / "run" / "profile.txt").read_text()
    assert text.startswith("profile of training steps 3-5") and "xmc_sparse::forward" in text
    assert "profile of training steps 3-5" in capsys.readouterr().out
    ops = [e["name"] for e in trace_gaps.load(tmp_path / "run" / "profile-trace.json.gz")]
    assert ops.count("xmc_sparse::forward") == 3  # the three profiled steps' forwards, nothing else


def test_a_run_too_short_for_its_step_profile_says_so(tmp_path, capsys):
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    trainer = quiet_trainer(tmp_path, max_steps=3, limit_val_batches=0, accelerator="cpu",
                            callbacks=[StepProfile(tmp_path / "run", steps=3)])
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert "no profile: training ended at step 3, before step 101" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_a_memory_report_off_a_gpu_says_so_and_writes_nothing(tmp_path, capsys):
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    trainer = quiet_trainer(tmp_path, max_steps=2, limit_val_batches=0, accelerator="cpu",
                            callbacks=[MemoryPeakReport(tmp_path / "run")])
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert "no memory report: the run is not on a CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_memory_report_breaks_down_the_runs_peak(tmp_path):
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    trainer = quiet_trainer(tmp_path, max_steps=4, limit_val_batches=0, accelerator="gpu",
                            callbacks=[MemoryPeakReport(tmp_path / "run")])
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    text = (tmp_path / "run" / "memory-peak.txt").read_text()
    peak = float(text.split("above the start of the recording: ")[1].split(" MiB")[0])
    # The model was made on the CPU, so its move to the GPU is recorded too: the recorded peak is the fit's own,
    # earlier tests' cuBLAS workspaces (freed by the graph capture, which allocates its own) counted against it.
    assert abs(peak - (torch.cuda.max_memory_allocated() - before) / 2**20) < 0.1
    listed = [float(line.split(" MiB")[0]) for line in text.splitlines()[1:]]
    assert abs(sum(listed) - peak) < 0.1 * len(listed)  # the sites (to 0.1 MiB each) sum to the peak
    assert re.search(r"\(\w+\.py:\d+\)", text)  # sites are named by their Python frames


def _step_times_script():
    """scripts/step_times.py as a module (a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "step_times", Path(__file__).resolve().parents[1] / "scripts" / "step_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_step_times_script_gives_each_curves_quarters_in_order(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'runs.db'}"
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("steps"), tags={"sparse_backend": "compiled-cuda"})
    for step, ms in enumerate([9.0, 7.0, 5.0, 4.0, 3.0, 3.5, 2.0, 2.5], start=1):  # out of order: step decides
        client.log_metric(run.info.run_id, "train/ms_per_step", ms, step=100 * (9 - step))
    client.log_param(run.info.run_id, "trainer/precision", "32-true")
    client.create_run(client.get_experiment_by_name("steps").experiment_id)  # no curve: no row
    _step_times_script().cli([str(tmp_path / "runs.db")])  # a plain path: MLflow's file-store error before
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(f"| `{run.info.run_id[:8]}`")]
    assert len(out.splitlines()) == 3 and len(rows) == 1
    # logged at steps 800 (9.0) down to 100 (2.5): in step order 2.5, 2.0 | 3.5, 3.0 | 4.0, 5.0 | 7.0, 9.0
    assert rows[0].endswith("| 32-true | compiled-cuda | 8 | 2.25 / 3.25 / 4.50 / 8.00 | 3.75 |")


def test_the_step_times_script_refuses_a_missing_store_instead_of_creating_it(tmp_path, capsys):
    """A mistyped store path made MLflow create an empty database (and its folder): an empty table, exit 0."""
    from mlflow.tracking import MlflowClient

    step_times = _step_times_script()
    missing = tmp_path / "typo" / "runs.db"
    with pytest.raises(SystemExit) as info:
        step_times.cli([f"sqlite:///{missing}"])
    assert info.value.code == 2 and f"sqlite:///{missing}: no such database" in capsys.readouterr().err
    assert not missing.parent.exists()
    store = tmp_path / "runs.db"
    MlflowClient(f"sqlite:///{store}").search_experiments()  # an existing store, named with sqlite's options
    with pytest.raises(SystemExit) as info:  # empty: was a table's header alone, exit 0
        step_times.cli([f"sqlite:///{store}?timeout=5"])
    assert info.value.code == 2 and capsys.readouterr().err.endswith(
        f"error: sqlite:///{store}?timeout=5: none of its 0 runs has a train/ms_per_step curve; give the store the "
        "runs logged to (their MLFLOW_TRACKING_URI)\n")
    with pytest.raises(SystemExit) as info:
        step_times.cli(["--help"])  # was taken for a store
    assert info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_the_step_times_script_reads_every_page_of_runs(capsys, monkeypatch):
    """MLflow returns at most 1,000 runs a call: a sweep's later runs were silently left out of the table."""
    import mlflow.tracking
    from mlflow.entities import Metric
    from mlflow.store.entities import PagedList

    class Client:  # 3 runs, 2 a page
        def __init__(self, store):
            pass

        def search_experiments(self):
            return [type("Experiment", (), {"experiment_id": "0"})]

        def search_runs(self, experiments, order_by=None, page_token=None):
            start = int(page_token or 0)
            runs = [type("Run", (), {"info": type("Info", (), {"run_id": f"run{i}abcd", "run_name": f"n{i}"}),
                                     "data": type("Data", (), {"params": {}, "tags": {}})}) for i in range(3)]
            return PagedList(runs[start:start + 2], str(start + 2) if start + 2 < 3 else None)

        def get_metric_history(self, run_id, key):
            return [Metric(key, 5.0, 0, 1)]

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Client)
    assert _step_times_script().main("bogus://store") == (3, 3)
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row[:10] for row in rows] == ["| `run0abc", "| `run1abc", "| `run2abc"]


def test_the_step_times_script_leaves_another_programs_database_untouched(tmp_path, capsys):
    """MLflow wrote its whole schema (some 200 tables) into any SQLite file given as the store, then printed an
    empty table, exit 0; a file that is no database ended in a traceback."""
    import sqlite3

    step_times = _step_times_script()
    other, junk, empty = tmp_path / "other.db", tmp_path / "junk.db", tmp_path / "empty.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    junk.write_text("not a database")
    empty.touch()
    for path, why in ((other, "without MLflow's tables"), (empty, "without MLflow's tables"),
                      (junk, "not an SQLite database")):
        before = path.read_bytes()
        with pytest.raises(SystemExit) as info:
            step_times.cli([str(path)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"{path}: " in err and why in err and "not an MLflow store" in err, err
        assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db", "junk.db", "other.db"]
