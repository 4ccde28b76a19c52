"""Copy finished table runs from another MLflow store (e.g. one filled on a GPU machine) into this one.

Params, tags, final metric values, start and end time are copied; a copied run is tagged `merged_from` with its
original id, so merging the same store twice copies nothing twice. The export then treats the copies like any
other run (their `device` tag still names the machine they ran on).
"""

from __future__ import annotations

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from xmc_repro.report.export import finished_runs, tracking_uri

MERGED_FROM = "merged_from"


def merge_runs(source_uri: str, target_uri: str | None = None, experiment_name: str = "xmc_repro") -> int:
    """Copy every finished run with a `table` tag from `source_uri`; returns how many were new."""
    target = MlflowClient(tracking_uri(target_uri))
    experiment = target.get_experiment_by_name(experiment_name)
    experiment_id = experiment.experiment_id if experiment else target.create_experiment(experiment_name)
    present = {run.data.tags.get(MERGED_FROM) for run in finished_runs(tracking_uri(target_uri))}
    copied = 0
    for run in finished_runs(source_uri):
        if run.info.run_id in present:
            continue
        new = target.create_run(experiment_id, start_time=run.info.start_time, run_name=run.info.run_name)
        tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
        tags[MERGED_FROM] = run.info.run_id
        end = run.info.end_time or run.info.start_time
        params = [Param(k, v) for k, v in run.data.params.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            target.log_batch(new.info.run_id, params=params[start : start + 100])
        target.log_batch(
            new.info.run_id,
            metrics=[Metric(k, v, end, 0) for k, v in run.data.metrics.items()],
            tags=[RunTag(k, v) for k, v in tags.items()],
        )
        target.set_terminated(new.info.run_id, "FINISHED", end_time=end)
        copied += 1
    return copied
