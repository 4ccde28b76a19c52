"""The `smoke_runs` stage: make sure the MLflow store holds smoke-scale runs of every table.

A table without any finished smoke run gets its sweep run (`python -m xmc_repro -m experiment=<table>
scale=smoke`); a table with runs is left alone (rerun a sweep by hand to refresh it). A sweep in which some jobs
failed still counts: those configurations render as missing, and the marker file names the sweep. A sweep that
leaves its table without a single finished run stops the stage. The marker records the finished smoke runs per
table afterwards: what the tables were rendered from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from xmc_repro.report.export import finished_runs, tracking_uri
from xmc_repro.report.grid import TABLES
from xmc_repro.report.identity import configuration

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class SweepFailed(Exception):
    """A table's smoke sweep finished no run at all."""


def smoke_counts(uri: str) -> dict[str, int]:
    """Finished smoke-scale runs per table."""
    counts = dict.fromkeys(TABLES, 0)
    for run in finished_runs(uri):
        config = configuration(run.data.params, run.data.tags)
        if config["scale"] == "smoke" and config["table"] in counts:
            counts[config["table"]] += 1
    return counts


def sweep_command(table: str, scale: str = "smoke") -> list[str]:
    preset = [f"experiment={table}", f"scale={scale}", "trainer.progress_bar=false"]
    return [sys.executable, "-m", "xmc_repro", "-m", *preset]


def ensure_smoke_runs(marker: Path, uri: str | None = None, run=subprocess.run) -> dict[str, int]:
    """Run the smoke sweep of every table without smoke runs; write the marker; return runs per table."""
    uri = absolute(tracking_uri(uri))
    counts = smoke_counts(uri)
    failed = []
    for table in [table for table, n in counts.items() if n == 0]:
        print(f"smoke_runs: no smoke runs of {table} in {uri}: {' '.join(sweep_command(table)[1:])}", flush=True)
        if run(sweep_command(table), cwd=PROJECT_ROOT, env=_env(uri)).returncode != 0:
            failed.append(table)
    if failed:
        counts = smoke_counts(uri)
        print(f"smoke_runs: some jobs of the sweeps of {', '.join(failed)} failed (see above); they render as missing")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"finished_smoke_runs": counts, "sweeps_with_failed_jobs": failed}, indent=2) + "\n")
    empty = [table for table, n in counts.items() if n == 0]
    if empty:
        raise SweepFailed(f"the smoke sweeps of {', '.join(empty)} finished no run at all: the pipeline is broken")
    return counts


def absolute(uri: str) -> str:
    """A relative sqlite store made absolute, so that the sweeps (run from the project root) use the same file."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def _env(uri: str) -> dict[str, str]:
    return {**os.environ, "MLFLOW_TRACKING_URI": uri}
