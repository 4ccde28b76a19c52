"""A 2-job sweep through the submitit_local launcher, both jobs logging to a real `mlflow server` on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "dataset.num_train=300", "dataset.num_test=100", "dataset.num_labels=40", "dataset.num_features=16",
    "dataset.max_epochs=1", "dataset.rewire_every_n_steps=4", "model.connectivity=8", "trainer.progress_bar=false",
    "trainer.train_eval_max_points=100",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a free local port with its own database and artifact folder; stopped afterwards."""
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it started, nothing else
        server.wait(timeout=30)
        log.close()


def wait_healthy(uri: str, server, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, "mlflow server exited"
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {uri} not up after {timeout_s} s")


@pytest.mark.slow  # 50 s: a tracking server and two submitit jobs
def test_submitit_local_sweep_logs_to_tracking_server(tmp_path, mlflow_server):
    uri, server = mlflow_server
    sweep_dir = tmp_path / "multirun"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MLFLOW_TRACKING_URI": "sqlite:///must-not-be-used.db"}
    # A server that does not answer is refused at once (within seconds, not after minutes of retries): wait for it.
    wait_healthy(uri, server)
    sweep = subprocess.run(
        [sys.executable, "-m", "xmc_repro", "-m", "hydra/launcher=submitit_local", "model=dense,uniform",
         f"logger.tracking_uri={uri}", "logger.experiment_name=sweep_test", f"hydra.sweep.dir={sweep_dir}",
         *TINY],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("sweep_test")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.params["model/head"] for r in runs) == ["dense", "uniform"]
    for run in runs:
        assert run.info.status == "FINISHED"
        assert 0 <= run.data.metrics["test/p_at_1"] <= 100 and "train/p_at_5" in run.data.metrics
        assert "val/p_at_3" in run.data.metrics  # per-epoch metrics went through Lightning's logger too
        assert run.data.tags["sweep_id"] == sweep_dir.as_posix()
        assert client.list_artifacts(run.info.run_id)[0].path == "config.yaml"  # proxied to the server's store
    assert sorted(r.data.tags["job_num"] for r in runs) == ["0", "1"]
    # Two submitit jobs, i.e. two processes, each with its own result.
    assert len(list(sweep_dir.glob(".submitit/*/*_result.pkl"))) == 2
    assert not (tmp_path / "must-not-be-used.db").exists()
