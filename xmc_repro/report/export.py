"""Run records -> results/runs.csv: one row per configuration of the paper's tables and machine it ran on.

Only FINISHED runs tagged with a `table` count (a FAILED or still RUNNING run is never a result). Per
configuration (with the settings its runs differ in, `identity.split_by_settings`), machine (`machine`: a CPU or
the CUDA card's name, times the processes of a DDP run) and seed the latest run wins (a rerun replaces the old
one); over seeds the row gives the mean and the sample standard deviation of every metric. Runs of one
configuration on two cards, or on one and on several devices, stay two rows: their memory and time are not
comparable.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from xmc_repro.report import records as run_records
from xmc_repro.report.atomic import replacing
from xmc_repro.report.csv_file import read_rows
from xmc_repro.report.identity import (
    CONFIG_COLUMNS, DEFAULT_SETTINGS_TABLES, SETTINGS, SHARED_SETTINGS, trained_with, config_key, configuration,
    split_by_settings)
from xmc_repro.report.state import model_state_bytes, param

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
# Derived from the config (see state.py): what a CPU run can plot instead of GPU memory.
STATE_MIB = "state_mib"
PROVENANCE = ("device", "sparse_backend", "git_commit")
COLUMNS = (
    *CONFIG_COLUMNS,
    "seeds",
    "runs",
    *(name for metric in METRICS for name in (metric, f"{metric}_std")),
    STATE_MIB,
    *PROVENANCE,
    "run_ids",
    "last_end_time",
    "sources",
)


def summarize(records: list[dict]) -> list[dict[str, str]]:
    """One row per configuration: the latest record of each seed, then mean and spread over seeds."""
    records = [r for r in records if r["status"] == "FINISHED" and r["tags"].get("table")]
    params = [run_records.used_params(r) for r in records]
    configs = [configuration(p, r["tags"]) for p, r in zip(params, records)]
    split_by_settings(configs, params)
    groups: dict[tuple, list] = {}
    for record, config in zip(records, configs):
        order = (record.get("start_time") or record.get("end_time") or "", record["run_id"])
        entry = {"order": order, "config": config, "seed": _param(record["params"], "seed"), "record": record}
        groups.setdefault((*config_key(config), machine(record["tags"])), []).append(entry)
    # the settings first, then each seed's latest run at them: a seed whose latest run is at other settings still
    # has its run at the winning ones
    return [_row(_latest_per_seed(_at_latest_settings(groups[key]))) for key in sorted(groups, key=natural_order)]


def _latest_per_seed(entries: list[dict]) -> list[dict]:
    """A rerun replaces the older run of its seed."""
    latest: dict[str, dict] = {}
    for entry in entries:
        if entry["seed"] not in latest or entry["order"] > latest[entry["seed"]]["order"]:
            latest[entry["seed"]] = entry
    return list(latest.values())


def _at_latest_settings(entries: list[dict]) -> list[dict]:
    """In the tables that run the defaults (no `settings` column), the runs at the settings of the configuration's
    latest run: a rerun at other settings replaces the other seeds' older runs as well, which were otherwise averaged
    with it as seeds of one configuration, and a seed rerun back at older settings brings the other seeds' runs at
    those back. A setting a run predates differs from none."""
    if entries[0]["config"]["table"] not in DEFAULT_SETTINGS_TABLES:
        return entries  # split_by_settings keeps runs of other settings apart

    def settings(entry: dict) -> dict[str, str]:
        used = run_records.used_params(entry["record"])
        return {key: trained_with(used, key) for key in SETTINGS}

    wanted = settings(max(entries, key=lambda e: e["order"]))
    return [e for e in entries if all(value == wanted[key] or "" in (value, wanted[key])
                                      for key, value in settings(e).items())]


def shared_settings(records: list[dict]) -> dict[str, dict[str, str]]:
    """Run id (each one a runs.csv row lists) -> the run's values of the settings every head trains with
    (`identity.SHARED_SETTINGS`), which runs.csv does not carry: for `same_settings`."""
    found = {}
    for record in records:
        used = run_records.used_params(record)
        values = {key: trained_with(used, key) for key in SHARED_SETTINGS}
        for run_id in record.get("aggregate", {}).get("run_ids") or [record["run_id"]]:
            found[run_id] = values
    return found


def same_settings(a: dict, b: dict, settings: dict[str, dict[str, str]]) -> bool:
    """Whether runs.csv rows `a` and `b` (of two heads) trained alike but for the heads: the same precision and
    `shared_settings`. A setting whose value one side's runs do not tell (they predate it: '') is not compared, so
    an older dense run still serves newer runs. Not where a row's runs are not in `settings`."""
    if a["precision"] != b["precision"]:
        return False
    sides = [[settings.get(run_id) for run_id in row["run_ids"].split(";")] for row in (a, b)]
    if None in sides[0] + sides[1]:
        return False
    for key in SHARED_SETTINGS:
        known = [{values[key] for values in side} - {""} for side in sides]
        if all(known) and known[0] != known[1]:
            return False
    return True


def machine(tags: dict) -> str:
    """What a run ran on: its `device` tag, preceded by "N x " for a DDP run of N processes (`world_size`), whose
    time per epoch is that of N devices and whose memory is one rank's."""
    device, ranks = tags.get("device", ""), tags.get("world_size", "")
    return f"{ranks} x {device}" if device and ranks not in ("", "1") else device


def on_one_device(row: dict) -> bool:
    """Whether a runs.csv row ran in one process (not a DDP row of `machine`'s "N x " form)."""
    count, times, _ = row["device"].partition(" x ")
    return not (times and count.isdigit())


def _param(params: dict, key: str) -> str:
    return param(params, key) or ""


def _row(entries: list[dict]) -> dict[str, str]:
    entries = sorted(entries, key=lambda e: _seed_order(e["seed"]))
    records = [e["record"] for e in entries]
    row = dict(entries[0]["config"])
    # a record migrated from an older runs.csv may stand for the mean over several seeds' runs
    seeds = [s for e in entries for s in (e["record"].get("aggregate", {}).get("seeds") or [e["seed"]])]
    row["seeds"] = ";".join(seeds)
    row["runs"] = str(sum(len(r.get("aggregate", {}).get("run_ids") or [r["run_id"]]) for r in records))
    for column, key in METRICS.items():
        values = [r["metrics"][key] for r in records if key in r["metrics"]]
        row[column] = _number(statistics.fmean(values)) if values else ""
        spread = [r["aggregate"]["std"][column] for r in records if column in r.get("aggregate", {}).get("std", {})]
        if len(values) > 1:
            row[f"{column}_std"] = _number(statistics.stdev(values))
        else:
            row[f"{column}_std"] = _number(spread[0]) if spread else ""
    state = {model_state_bytes(run_records.used_params(r), r["metrics"]) for r in records}
    row[STATE_MIB] = _number(state.pop() / 2**20) if len(state) == 1 and None not in state else ""
    for tag in PROVENANCE:
        values = {machine(r["tags"]) if tag == "device" else r["tags"].get(tag, "") for r in records}
        row[tag] = "; ".join(sorted(values - {""}))
    row["run_ids"] = ";".join(i for r in records for i in (r.get("aggregate", {}).get("run_ids") or [r["run_id"]]))
    row["last_end_time"] = max(r.get("end_time") or "" for r in records)
    row["sources"] = "; ".join(sorted({r.get("source", "") for r in records} - {""}))
    return row


def _seed_order(seed: str):
    return (0, int(seed), "") if seed.lstrip("-").isdigit() else (1, 0, seed)


def natural_order(values: tuple[str, ...]) -> tuple:
    """Sort key that puts 16384 before 100000."""
    return tuple(_seed_order(value) for value in values)


def _number(value: float) -> str:
    return f"{value:.6g}"


def write_runs_csv(rows: list[dict], path: Path) -> None:
    with replacing(path, "the export (`dvc repro`)", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def read_runs_csv(path: Path) -> list[dict[str, str]]:
    numeric = (*(name for metric in METRICS for name in (metric, f"{metric}_std")), STATE_MIB, "runs")
    return read_rows(path, COLUMNS, numeric, "write it again from the records with `python -m xmc_repro.report export`")


def export(path: Path, directory: Path = run_records.RECORDS_DIR) -> list[dict[str, str]]:
    """Write runs.csv from the records in `directory`."""
    rows = summarize(run_records.load(directory))
    write_runs_csv(rows, path)
    return rows
