"""The real command line under DDP: `python -m xmc_repro trainer=ddp` on 2 CPU processes records one MLflow run;
`-m` with the relaunching ddp strategy is refused before any job trains."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "dataset.num_train=512", "dataset.num_test=128", "dataset.num_labels=60", "dataset.num_features=24",
    "dataset.max_epochs=2", "dataset.rewire_every_n_steps=4", "model.connectivity=8", "trainer.progress_bar=false",
    "trainer.accelerator=cpu", "trainer.train_eval_max_points=128",
]


def cli(args, cwd, timeout=400):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "xmc_repro", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow  # two interpreters start one after the other (Lightning relaunches the command for rank 1)
def test_ddp_command_line_records_one_run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    # 513 points: the last global batch has one point, for rank 0; rank 1's share of it is empty. Dropout on.
    tiny = [arg.replace("num_train=512", "num_train=513") for arg in TINY] + ["dataset.dropout=0.3"]
    done = cli(["trainer=ddp", "trainer.devices=2", f"logger.tracking_uri={uri}", f"hydra.run.dir={tmp_path}/out",
                *tiny], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("MLflow run") == 1  # rank 1 reports nothing

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("xmc_repro").experiment_id])
    assert len(runs) == 1  # rank 1 opened no run of its own
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2"
    # The threads each rank trained with: Lightning splits the cores over the ranks unless OMP_NUM_THREADS is set.
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // 2))
    assert run.data.tags["device"] == f"cpu ({platform.machine()}, {threads} threads)"
    assert run.data.params["trainer/strategy/broadcast_buffers"] == "False"
    assert run.data.metrics["epochs"] == 2 and "test/p_at_1" in run.data.metrics
    # 513 points in global batches of 32: 17 steps an epoch whatever the number of ranks.
    steps = client.get_metric_history(run.info.run_id, "train/loss_epoch")
    assert [m.step for m in steps] == [16, 33]
    assert (tmp_path / "checkpoints" / run.info.run_id / "best.ckpt").is_file()

    # One process trains the same weights: every rank draws the dropout masks one process draws.
    alone = cli([f"logger.tracking_uri={uri}", f"hydra.run.dir={tmp_path}/alone", *tiny], tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    (single,) = [r for r in client.search_runs([run.info.experiment_id]) if r.info.run_id != run.info.run_id]
    weights = [torch.load(tmp_path / "checkpoints" / r.info.run_id / "last.ckpt", weights_only=True)["state_dict"]
               for r in (run, single)]
    assert torch.equal(weights[0]["head.indices"], weights[1]["head.indices"])  # rewired alike
    for key in ("head.weight", "head.bias"):
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=1e-5, atol=1e-6, msg=key)
    # ... and logs its epoch losses: DDP's are the mean over both ranks' points.
    losses = [[m.value for m in client.get_metric_history(r.info.run_id, "train/loss_epoch")] for r in (run, single)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.slow
def test_ddp_relaunch_refused_in_a_sweep(tmp_path):
    done = cli(["-m", "trainer=ddp", "trainer.devices=2", "model=dense,uniform",
                f"logger.tracking_uri=sqlite:///{tmp_path / 'm.db'}", f"hydra.sweep.dir={tmp_path}/sweep", *TINY],
               tmp_path)
    assert done.returncode != 0
    assert "trainer.devices=1" in done.stderr and "tasks_per_node" in done.stderr
    assert "Initializing distributed" not in done.stdout + done.stderr  # refused before any rank started
