"""Run records: one JSON file per finished run under results/records/, the only input of the report.

A record holds what the tables need from an MLflow run — its params (the config flattened under its Hydra keys),
final metrics, tags (table, scale, device, sparse_backend, git_commit, ...), status and times — as sorted,
indented JSON, so that a reviewer reads a diff of results like a diff of code, and `dvc repro` renders the same
tables on any clone. `add_from_store` copies the FINISHED table runs of an MLflow store into records (the file is
named by the run id, so adding a store twice changes nothing).
"""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path

from xmc_repro.errors import DataError
from xmc_repro.report.atomic import write_text

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RECORDS_DIR = Path("results") / "records"
DEFAULT_TRACKING_URI = "sqlite:///mlruns.db"  # as conf/logger/mlflow.yaml: relative to the working directory
REQUIRED = ("run_id", "status", "params", "metrics", "tags")
RESUMED_PREFIX = "resumed/"  # tag of a setting that a resume changed: `resumed/trainer/max_epochs`
STARTED_BY = "started_by"  # tag `<pid>@<host>:<folder>` of the process that created the run; local, not recorded
WRITER = "writer_lock"  # tag `<host>:<lock file>` of the process writing the run (checkpoints.RunLock); not recorded


def iso_time(milliseconds: int | None) -> str:
    """MLflow's epoch milliseconds as an ISO time in UTC ('' when unknown)."""
    if not milliseconds:
        return ""
    return datetime.fromtimestamp(milliseconds / 1000, timezone.utc).isoformat(timespec="seconds")


def record_of_run(run) -> dict:
    """The record of an MLflow run. MLflow's own tags (`mlflow.user`, source paths), `started_by` and `writer_lock` are
    left out."""
    info, data = run.info, run.data
    return {
        "run_id": info.run_id,
        "run_name": info.run_name or "",
        "status": info.status,
        "start_time": iso_time(info.start_time),
        "end_time": iso_time(info.end_time),
        "params": dict(data.params),
        "metrics": dict(data.metrics),
        "tags": {k: v for k, v in data.tags.items() if not k.startswith("mlflow.") and k not in (STARTED_BY, WRITER)},
        "source": "mlflow",
    }


def used_params(record: dict) -> dict:
    """The settings a run trained with: its params, with those a resume changed (tags `resumed/<key>`, see
    `tracking.RunTracker.log_config`) in place of the values it started with."""
    changed = {key[len(RESUMED_PREFIX) :]: value for key, value in record["tags"].items()
               if key.startswith(RESUMED_PREFIX)}  # fmt: skip
    return {**record["params"], **changed}


def dump(record: dict) -> str:
    return json.dumps(record, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def save(record: dict, directory: Path = RECORDS_DIR) -> str:
    """Write `<run_id>.json` (whole or not at all: a full disk leaves the old record or none); returns 'new',
    'updated' or 'unchanged'."""
    path = directory / f"{record['run_id']}.json"
    text = dump(record)
    if not path.exists():
        state = "new"
    elif path.read_text() == text:
        return "unchanged"
    else:
        state = "updated"
    write_text(path, text, "`records add`")
    return state


def load(directory: Path = RECORDS_DIR) -> list[dict]:
    """Every record in `directory`, ordered by run id (a missing directory holds none). Hidden files (an editor's
    `.#<id>.json` lock, a temporary file being written) are not records."""
    records = []
    for path in sorted(p for p in directory.glob("*.json") if not p.name.startswith(".")):
        remedy = f"rerun `records add` with the store that holds the run, or `git checkout -- {path}`"
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DataError(f"{path}: not valid JSON ({error}); {remedy}") from None
        missing = [key for key in REQUIRED if key not in record] if isinstance(record, dict) else list(REQUIRED)
        if missing:
            raise DataError(f"{path}: not a run record (no {', '.join(missing)}); move it out of {directory}")
        problem = malformed(record)
        if problem:
            raise DataError(f"{path}: {problem}; {remedy}")
        if path.stem != record["run_id"]:
            name = f"{record['run_id']}.json"
            if (directory / name).exists():
                raise DataError(f"{path}: a second copy of run {record['run_id']}, whose record is {directory / name}; "
                                "remove this copy")
            raise DataError(f"{path}: holds run {record['run_id']}; rename it to {name}")
        records.append(record)
    return records


STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")  # MLflow's RunStatus
# Params a run the export counts must name: its configuration's columns (`identity.configuration`) would be blank.
NEEDED_PARAMS = ("model/head", "dataset/name", "dataset/features", "loss/name")
# Scores it must have (every run tests P@1, P@3 and P@5 together): without one, its seed would be listed in a row
# whose test P@k is the mean of the other seeds only.
NEEDED_METRICS = ("test/p_at_1", "test/p_at_3", "test/p_at_5")


def malformed(record: dict) -> str | None:
    """What is wrong with a record's fields, as `record_of_run` writes them; None when nothing is. A record the
    export counts (FINISHED, with a `table` tag) must also have its test P@k and the params that name its
    configuration. The one check of what a record needs: `load` (the export) and `add_from_store` both apply it."""
    from xmc_repro.report.state import param

    for key in ("params", "metrics", "tags"):
        if not isinstance(record.get(key, {}), dict):
            return f'"{key}" must be an object of names and values'
    for key in ("run_id", "start_time", "end_time"):  # the export orders a configuration's runs by these
        if not isinstance(record.get(key) or "", str):
            return f'"{key}" is {json.dumps(record[key])}, not a string'
    if record.get("status") not in STATUSES:
        return f"status is {record.get('status')!r}, not one of {', '.join(STATUSES)}"
    for name, value in record.get("metrics", {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"metric {name} is {value!r}, not a number"
        if not math.isfinite(value):
            return f"metric {name} is {value}, not a finite number"
        if abs(value) == sys.float_info.max:  # how MLflow's database stores keep an infinite value
            return f"metric {name} is {value} (infinite, as MLflow stores it), not a finite number"
    for name, value in record.get("tags", {}).items():
        if not isinstance(value, str):
            quoted = f' (write it as "{value}")' if isinstance(value, (int, float)) else ""
            return f"tag {name} is {json.dumps(value)}, not a string{quoted}"
    if record["status"] != "FINISHED" or not record["tags"].get("table"):
        return None  # never a result (export.summarize)
    if not record["params"]:
        return "no params: a finished table run has its config's settings"
    absent = [key for key in NEEDED_PARAMS if param(record["params"], key) is None]
    if absent:
        state = "null" if _has(record["params"], absent[0]) else "missing"
        return f"param {absent[0]} is {state}: it names the run's configuration"
    if not record["metrics"]:
        return "no metrics: a finished table run has its test scores"
    absent = [key for key in NEEDED_METRICS if key not in record["metrics"]]
    if absent:
        return f"metric {absent[0]} is missing: a finished table run has its test scores"
    return None


def _has(params: dict, key: str) -> bool:
    return key in params or key.replace("/", ".") in params


def tracking_uri(uri: str | None = None) -> str:
    import os

    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def table_runs(uri: str) -> tuple[list, dict[str, int]]:
    """The FINISHED runs with a `table` tag, from every experiment of the store, and counts of the runs passed
    over: by status (RUNNING, FAILED, KILLED, ...) and, among finished ones, `untagged` (no `table` tag)."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    runs, skipped, token = [], {}, None
    while experiment_ids:
        page = client.search_runs(experiment_ids, run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                  page_token=token)  # fmt: skip
        for run in page:
            if run.info.status != "FINISHED":
                skipped[run.info.status] = skipped.get(run.info.status, 0) + 1
            elif not run.data.tags.get("table"):
                skipped["untagged"] = skipped.get("untagged", 0) + 1
            else:
                runs.append(run)
        token = page.token
        if not token:
            break
    return runs, skipped


def add_from_store(uri: str | None = None, directory: Path = RECORDS_DIR) -> dict:
    """Copy the FINISHED table runs of the store at `uri` into records. Returns the counts of new, updated and
    unchanged records, under `skipped` those of the runs left out (see `table_runs`; `unusable`: runs whose record
    `malformed` refuses, e.g. a NaN metric or no test P@1, each with its problem under `unusable`), and under
    `uncommitted` how many copied runs ran code that was no commit (`git_commit` ending in "-dirty")."""
    uri = tracking_uri(uri)
    _check_store(uri)
    try:
        runs, skipped = table_runs(uri)
    except Exception as error:  # a folder, file://, an unknown scheme: MLflow's long tracebacks
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise DataError(f"{uri}: cannot read runs from this MLflow store ({reason}); pass the store that holds them, "
                        "e.g. sqlite:///mlruns.db or http://host:5000") from None
    counts = {"new": 0, "updated": 0, "unchanged": 0}
    copied, unusable = [], []
    for run in runs:
        record = record_of_run(run)
        problem = malformed(record)
        if problem:  # e.g. a NaN metric: the export would refuse the record, so the run stays in its store only
            unusable.append(f"run {run.info.run_id}: {problem}")
            continue
        counts[save(record, directory)] += 1
        copied.append(run)
    uncommitted = sum(run.data.tags.get("git_commit", "").endswith("-dirty") for run in copied)
    if unusable:
        skipped["unusable"] = len(unusable)
    return {**counts, "skipped": skipped, "uncommitted": uncommitted, "unusable": unusable}


def uncommitted_line(uncommitted: int) -> str:
    """'; 2 copied runs ran uncommitted code ...' ('' when none did): no commit reproduces such a run."""
    if not uncommitted:
        return ""
    return (f"; {uncommitted} copied run(s) ran uncommitted code (git_commit ends in -dirty): no commit reproduces "
            "them; rerun them from a clean checkout before citing their numbers")


def skipped_line(skipped: dict[str, int], unusable: list[str] = ()) -> str:
    """'; left out 2 runs: 1 FAILED, 1 without a `table` tag' ('' when none were); with the first of the `unusable`
    runs' problems (see `add_from_store`)."""
    if not skipped:
        return ""
    names = {"untagged": "without a `table` tag", "unusable": "unusable as records"}
    names["unusable"] += f" ({unusable[0]}{'; ...' if len(unusable) > 1 else ''})" if unusable else ""
    parts = [f"{n} {names.get(why, why)}" for why, n in sorted(skipped.items())]
    return f"; left out {sum(skipped.values())} runs: {', '.join(parts)}"


def _check_store(uri: str) -> None:
    """A sqlite store that does not exist would be created empty by MLflow, and another SQLite file would get MLflow's
    tables written into it: refuse both instead."""
    from xmc_repro import tracking

    if "://" not in uri and Path(uri).is_file():  # `records add gpu.db`: MLflow reads a bare path as a file store
        raise DataError(f"{uri}: a database file, not a store's URI; pass sqlite:///{uri}")
    tracking.check_store(uri, setting="")  # a folder, a silent server: one line in seconds, not minutes of retries
    path = tracking.sqlite_path(uri)
    if path is not None and not path.is_file():
        raise DataError(f"{uri}: no such MLflow store; pass the store that holds the runs, e.g. sqlite:///gpu.db")
    problem = tracking.not_a_store(path) if path is not None else None
    if problem:
        raise DataError(f"{uri}: {problem}, not an MLflow store; pass the store that holds the runs, e.g. "
                        "sqlite:///gpu.db")
