"""MLflow bookkeeping of one run: params, tags, the resolved config, final metrics and status.

The model knows nothing of MLflow; per-epoch metrics reach the same run through Lightning's MLFlowLogger,
whose own `finalize` is disabled so that only `RunTracker.finish` decides FINISHED or FAILED.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


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


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(accelerator_device) -> str:
    """What the run ran on, for the tables: the CUDA card's name, or the CPU."""
    import torch

    if accelerator_device is not None and accelerator_device.type == "cuda":
        return torch.cuda.get_device_name(accelerator_device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


class RunTracker:
    """One MLflow run: created (or reopened for `resume`), filled, and closed with a status."""

    def __init__(self, tracking_uri: str, experiment_name: str, run_id: str | None = None, run_name: str | None = None):
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        experiment = self.client.get_experiment_by_name(experiment_name)
        self.experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        )
        if run_id is None:
            run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log_config(self, cfg: DictConfig, tags: dict[str, str]) -> None:
        params = [Param(k, v) for k, v in flatten(cfg).items()]
        existing = self.client.get_run(self.run_id).data.params
        params = [p for p in params if p.key not in existing]  # a resumed run keeps its params
        for start in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.set_tags(tags)
        self.client.log_text(self.run_id, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")

    def set_tags(self, tags: dict[str, str | None]) -> None:
        tag_list = [RunTag(k, str(v)) for k, v in tags.items() if v is not None]
        if tag_list:
            self.client.log_batch(self.run_id, tags=tag_list)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def lightning_logger(self) -> MLFlowLogger:
        return _RunOwnedMLFlowLogger(tracking_uri=self.tracking_uri, run_id=self.run_id)

    def finish(self, status: str = "FINISHED", message: str | None = None) -> None:
        if message:
            self.set_tags({"error": message[:5000]})
        self.client.set_terminated(self.run_id, status)

    def ui_command(self) -> str:
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"


class _RunOwnedMLFlowLogger(MLFlowLogger):
    """Lightning's MLflow logger writing into a run that RunTracker opened and will close."""

    def finalize(self, status: str = "success") -> None:
        # Flush nothing special; the status is set by RunTracker.finish once testing is done too.
        pass
