"""MLflow -> results/runs.csv: one row per configuration of the paper's tables and machine it ran on.

Only FINISHED runs tagged with a `table` count (a FAILED or still RUNNING run is never a result). Per
configuration, machine (the `device` tag: a CPU, or the CUDA card's name) and seed the latest run wins (a rerun
replaces the old one); over seeds the row gives the mean and the sample standard deviation of every metric.
Runs of one configuration on two cards stay two rows: their memory and time are not comparable.
"""

from __future__ import annotations

import csv
import os
import statistics
from datetime import datetime, timezone
from pathlib import Path

from xmc_repro.report.identity import CONFIG_COLUMNS, config_key, configuration

DEFAULT_TRACKING_URI = "sqlite:///mlruns.db"  # as conf/logger/mlflow.yaml: relative to the working directory

# runs.csv column -> MLflow metric key; the names follow the paper's CSV where it has the column.
METRICS = {
    **{f"test_p{k}": f"test/p_at_{k}" for k in (1, 3, 5)},
    **{f"train_p{k}": f"train/p_at_{k}" for k in (1, 3, 5)},
    **{f"test_ndcg{k}": f"test/ndcg_at_{k}" for k in (1, 3, 5)},
    **{f"test_psp{k}": f"test/psp_at_{k}" for k in (1, 3, 5)},
    "val_p3": "val/p_at_3",
    "memory_gib": "peak_gpu_memory_gib",
    "epochs": "epochs",
    "time_per_epoch_s": "time_per_epoch_s",
}
PROVENANCE = ("device", "sparse_backend", "git_commit")
COLUMNS = (
    *CONFIG_COLUMNS,
    "seeds",
    "runs",
    *(name for metric in METRICS for name in (metric, f"{metric}_std")),
    *PROVENANCE,
    "run_ids",
    "last_end_time",
)


def tracking_uri(uri: str | None = None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def finished_runs(uri: str) -> list:
    """Every FINISHED run with a `table` tag, from every experiment of the store."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    runs, token = [], None
    while experiment_ids:
        page = client.search_runs(
            experiment_ids,
            filter_string="attributes.status = 'FINISHED'",
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=1000,
            page_token=token,
        )
        runs.extend(run for run in page if run.data.tags.get("table"))
        token = page.token
        if not token:
            break
    return runs


def summarize(runs) -> list[dict[str, str]]:
    """One row per configuration: the latest run of each seed, then mean and spread over seeds."""
    latest: dict[tuple, dict[str, object]] = {}
    for run in runs:
        if run.info.status != "FINISHED":  # callers may pass any runs; only finished ones are results
            continue
        config = configuration(run.data.params, run.data.tags)
        seed = run.data.params.get("seed", "")
        slot = (config_key(config), run.data.tags.get("device", ""), seed)
        order = (run.info.start_time or 0, run.info.run_id)
        if slot not in latest or order > latest[slot]["order"]:
            latest[slot] = {"order": order, "config": config, "seed": seed, "run": run}

    groups: dict[tuple, list] = {}
    for (key, device, _), entry in latest.items():
        groups.setdefault((*key, device), []).append(entry)
    return [_row(groups[key]) for key in sorted(groups, key=natural_order)]


def _row(entries: list[dict]) -> dict[str, str]:
    entries = sorted(entries, key=lambda e: _seed_order(e["seed"]))
    runs = [e["run"] for e in entries]
    row = dict(entries[0]["config"])
    row["seeds"] = ";".join(e["seed"] for e in entries)
    row["runs"] = str(len(runs))
    for column, key in METRICS.items():
        values = [run.data.metrics[key] for run in runs if key in run.data.metrics]
        row[column] = _number(statistics.fmean(values)) if values else ""
        row[f"{column}_std"] = _number(statistics.stdev(values)) if len(values) > 1 else ""
    for tag in PROVENANCE:
        row[tag] = "; ".join(sorted({run.data.tags.get(tag, "") for run in runs} - {""}))
    row["run_ids"] = ";".join(run.info.run_id for run in runs)
    end = max(run.info.end_time or 0 for run in runs)
    row["last_end_time"] = datetime.fromtimestamp(end / 1000, timezone.utc).isoformat(timespec="seconds") if end else ""
    return row


def _seed_order(seed: str):
    return (0, int(seed), "") if seed.lstrip("-").isdigit() else (1, 0, seed)


def natural_order(values: tuple[str, ...]) -> tuple:
    """Sort key that puts 16384 before 100000."""
    return tuple(_seed_order(value) for value in values)


def _number(value: float) -> str:
    return f"{value:.6g}"


def write_runs_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def read_runs_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def export(path: Path, uri: str | None = None) -> list[dict[str, str]]:
    """Write runs.csv from the store at `uri` (default: $MLFLOW_TRACKING_URI or sqlite:///mlruns.db)."""
    rows = summarize(finished_runs(tracking_uri(uri)))
    write_runs_csv(rows, path)
    return rows
