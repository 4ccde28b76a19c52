"""One-off: turn the rows of a runs.csv written before run records existed into records.

The MLflow store behind such a file may be gone (the NVIDIA H200 runs of the committed tables survive only in
results/runs.csv), so each row becomes a record that keeps its run id and says where it came from: params are
rebuilt from the row's configuration columns under their Hydra keys (plus the dataset's shape from conf/dataset),
metrics from its metric columns, tags from its provenance columns. A row that averaged several seeds keeps their
run ids, seeds and spread under `aggregate`: its metrics are that mean, not one run's values. Each record is checked
as `records add` checks a run's (`records.malformed`); one row that fails stops the migration before any record is
written.
"""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

from xmc_repro.errors import DataError
from xmc_repro.report.export import METRICS
from xmc_repro.report.records import RECORDS_DIR, malformed, save

PARAM_KEYS = {  # runs.csv configuration column -> the Hydra key it came from
    "dataset": "dataset/name",
    "features": "dataset/features",
    "setup": "model/head",
    "connectivity": "model/connectivity",
    "intermediate": "model/intermediate",
    "bottleneck": "model/bottleneck",
    "mach_hashes": "model/mach/num_hashes",
    "mach_buckets": "model/mach/num_buckets",
    "loss": "loss/name",
}
TAGS = ("table", "scale", "device", "sparse_backend", "git_commit")


def dataset_shapes(conf_dir: Path) -> dict[str, dict[str, str]]:
    """dataset name -> {num_features, num_labels} of every conf/dataset file that sets them."""
    shapes = {}
    for path in sorted((conf_dir / "dataset").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text()) or {}
        for base in cfg.get("defaults", []):  # e.g. a smoke stand-in on top of synthetic.yaml
            if isinstance(base, str) and base != "_self_":
                cfg = {**(yaml.safe_load((path.parent / f"{base}.yaml").read_text()) or {}), **cfg}
        if cfg.get("name") and cfg.get("num_features") and cfg.get("num_labels"):
            shapes[cfg["name"]] = {"num_features": str(cfg["num_features"]), "num_labels": str(cfg["num_labels"])}
    return shapes


def record_of_row(row: dict[str, str], shapes: dict, origin: str) -> dict:
    params = {key: row[column] or "None" for column, key in PARAM_KEYS.items()}
    seeds = [s for s in row["seeds"].split(";") if s]
    params["seed"] = seeds[0] if len(seeds) == 1 else "None"
    for key, value in shapes.get(row["dataset"], {}).items():
        params[f"dataset/{key}"] = value
    run_ids = [i for i in row["run_ids"].split(";") if i]
    if not run_ids:
        raise ValueError("no run id in column run_ids: a record is its run's")
    record = {
        "run_id": run_ids[0],
        "run_name": "",
        "status": "FINISHED",
        "start_time": "",
        "end_time": row["last_end_time"],
        "params": params,
        "metrics": {key: float(row[column]) for column, key in METRICS.items() if row.get(column)},
        "tags": {tag: row[tag] for tag in TAGS if row.get(tag)},
        "source": f"migrated from {origin}",
        "note": "params rebuilt from the row's configuration columns (other settings were not kept); "
        "dataset shape from conf/dataset at migration",
    }
    if len(run_ids) > 1 or len(seeds) > 1:
        record["aggregate"] = {
            "run_ids": run_ids,
            "seeds": seeds,
            "std": {c: float(row[f"{c}_std"]) for c in METRICS if row.get(f"{c}_std")},
            "note": f"the mean over {len(run_ids)} runs (seeds {', '.join(seeds)}), not one run's values",
        }
    return record


def checked_records(runs_csv: Path, shapes: dict, origin: str) -> list[dict]:
    """The record of every row of `runs_csv`; a DataError naming the first row whose record the export would refuse
    (e.g. no test P@1, a blank dataset, a NaN)."""
    migrated = []
    with open(runs_csv, newline="") as f:
        reader = csv.DictReader(f)
        absent = [column for column in (*PARAM_KEYS, "seeds", "run_ids", "last_end_time")
                  if column not in (reader.fieldnames or ())]
        if absent:
            raise DataError(f"{runs_csv}: no column {absent[0]}; give a runs.csv written by the export")
        for row in reader:
            if None in row or None in row.values():  # csv's marks of a row longer or shorter than the header
                fields = len(row.get(None, ())) + sum(value is not None for key, value in row.items() if key)
                raise DataError(f"{runs_csv}:{reader.line_num}: {fields} fields against the header's "
                                f"{len(reader.fieldnames)}; fix or remove that row, then migrate again")
            try:
                record = record_of_row(row, shapes, origin)
                problem = malformed(record)
            except ValueError as error:  # a metric column that holds no number, no run id
                problem = str(error)
            if problem:
                raise DataError(f"{runs_csv}:{reader.line_num}: {problem}; fix or remove that row, then migrate again")
            migrated.append(record)
    return migrated


def migrate(runs_csv: Path, conf_dir: Path, directory: Path = RECORDS_DIR, origin: str = "") -> dict[str, int]:
    """Write the records of the rows of `runs_csv` into `directory`, once every row's record is sound."""
    migrated = checked_records(runs_csv, dataset_shapes(conf_dir), origin or str(runs_csv))
    counts = {"new": 0, "updated": 0, "unchanged": 0}
    for record in migrated:
        counts[save(record, directory)] += 1
    return counts
