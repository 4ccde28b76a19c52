"""Helpers of the reliability tests: the real command line in a scratch directory, and what it left in MLflow.

(No tests here; the test_reliability_*.py files import it, and `no_run_left_running` with it: after every
test, no MLflow run in a directory the command line ran in may be left RUNNING.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A run that trains in a second or two: 20 steps per epoch, rewiring every 7 steps, dropout on.
TINY = [
    "dataset=synthetic",
    "dataset.num_train=320",
    "dataset.num_test=96",
    "dataset.num_features=24",
    "dataset.num_labels=40",
    "dataset.latent_dim=8",
    "dataset.rewire_every_n_steps=7",
    "model.connectivity=8",
    "trainer.batch_size=16",
    "trainer.max_epochs=2",
    "trainer.train_eval_max_points=96",
    "trainer.progress_bar=false",
]


def tracking_uri(directory: Path) -> str:
    return f"sqlite:///{directory / 'mlruns.db'}"


def tiny_config(store: Path):
    """The config the command line composes from TINY, with the MLflow store `store` (a sqlite file)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*TINY, f"logger.tracking_uri=sqlite:///{store}"])


def cli_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def command(cwd: Path, args, multirun: bool = False) -> list[str]:
    """`python -m xmc_repro [-m] args` with the MLflow store in `cwd`."""
    return [sys.executable, "-m", "xmc_repro", *(["-m"] if multirun else []), *args,
            f"logger.tracking_uri={tracking_uri(cwd)}"]


_USED: set[Path] = set()  # directories the command line ran in since the last check


def cli(cwd: Path, args, multirun: bool = False, timeout: float = 300, env: dict | None = None):
    _USED.add(Path(cwd))
    return subprocess.run(command(cwd, args, multirun), cwd=cwd, env=cli_env(env), capture_output=True, text=True,
                          timeout=timeout)


def start(cwd: Path, args, env: dict | None = None) -> subprocess.Popen:
    _USED.add(Path(cwd))
    return subprocess.Popen(command(cwd, args), cwd=cwd, env=cli_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def together(request, tmp_path_factory, run_cases: dict, workers: int = 3) -> dict:
    """For a module fixture: ``run_cases[name](directory, **its parameters)`` for every selected test of this module
    named in ``run_cases``, ``workers`` at a time, each in a new directory. A case that starts the command line spends
    its seconds mostly importing torch, Lightning and MLflow on one core: side by side they take little longer than
    one. Returns {the test's ``request.node.name``: its finished future}, whose ``result()`` raises that case's own
    error only."""
    items = [item for item in request.session.items
             if item.module is request.module and item.originalname in run_cases]
    with ThreadPoolExecutor(workers) as pool:  # leaving the block waits for every case
        return {item.name: pool.submit(run_cases[item.originalname], tmp_path_factory.mktemp("case"),
                                       **(item.callspec.params if hasattr(item, "callspec") else {}))
                for item in items}


def stderr_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def runs(directory: Path) -> list:
    """Every MLflow run in `directory`'s store (none when there is no store)."""
    from mlflow.tracking import MlflowClient

    if not (directory / "mlruns.db").is_file():
        return []
    client = MlflowClient(tracking_uri(directory))
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids) if ids else []


def make_store(directory: Path) -> Path:
    """An initialised, empty MLflow sqlite store, made once per test session (its schema takes seconds):
    tests copy it (`copy_store`)."""
    global _TEMPLATE
    if _TEMPLATE is None or not _TEMPLATE.is_file():
        from mlflow.tracking import MlflowClient

        directory.mkdir(parents=True, exist_ok=True)
        MlflowClient(tracking_uri(directory)).search_experiments()
        _TEMPLATE = directory / "mlruns.db"
    return _TEMPLATE


_TEMPLATE: Path | None = None


def copy_store(template: Path, directory: Path) -> None:
    shutil.copy(template, directory / "mlruns.db")


def running_runs(directory: Path) -> list[str]:
    return [r.info.run_id for r in runs(directory) if r.info.status == "RUNNING"]


@pytest.fixture(autouse=True)
def no_run_left_running():
    """After each test (its module fixtures included): every run the command line started is closed."""
    yield
    pending = sorted(_USED)
    _USED.clear()
    left = {str(d): running_runs(d) for d in pending if running_runs(d)}
    assert not left, f"MLflow runs left RUNNING: {left}"
