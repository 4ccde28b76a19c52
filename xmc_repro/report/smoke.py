"""`python -m xmc_repro.report smoke`: train the smoke sweeps of the tables (by hand; `dvc repro` never trains).

Runs `python -m xmc_repro -m experiment=<table> scale=smoke` for each table in the current folder (its
`multirun/` and `checkpoints/` go there, as for any sweep, not into the package's folder: site-packages for an
installed wheel), into the MLflow store, narrowed to the datasets whose files are here: a dataset read from files
that are absent (Bibtex, Delicious outside a setup that has them) is reported once, as "missing: data not found at
<path>", and written to results/data_missing.json, from which the tables show it the same way instead of as
failed runs. The command exits non-zero when any job of a sweep failed. Afterwards
`python -m xmc_repro.report records add` copies the finished runs into results/records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from xmc_repro.errors import ConfigError, DataError
from xmc_repro.report.atomic import write_text
from xmc_repro.report.grid import TABLES, conf_dir, job_overrides
from xmc_repro.report.records import tracking_uri

DATA_MISSING = Path("results") / "data_missing.json"


class SweepFailed(Exception):
    """Some job of a smoke sweep failed."""


class SweepInterrupted(Exception):
    """Ctrl+C while a smoke sweep ran; the sweep has closed its runs and said so."""


def run_sweep(command: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run one sweep to its end. Ctrl+C reaches the sweep too (the terminal's process group), which then marks its
    runs FAILED, seconds on a locked store: subprocess.run killed it 0.25 s after Ctrl+C, leaving them RUNNING."""
    process = subprocess.Popen(command, env=env)
    interrupted = False
    while True:
        try:
            code = process.wait()
            break
        except KeyboardInterrupt:  # again: the sweep stops closing its runs and names them
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    return subprocess.CompletedProcess(command, code)


def data_location(dataset_cfg) -> Path | None:
    """Where a file-backed dataset's data must be (None for generated data), and whether it is there."""
    from xmc_repro.data.sources import shared_data_root

    if dataset_cfg.get("kind") == "synthetic":
        return None
    if dataset_cfg.get("data_dir"):
        return Path(dataset_cfg["data_dir"]).expanduser().absolute()
    if dataset_cfg.get("shared_subdir"):
        return shared_data_root() / dataset_cfg["shared_subdir"]
    return Path(".").absolute()


def data_present(dataset_cfg, location: Path) -> bool:
    files = [dataset_cfg.get(key) for key in ("train_file", "test_file") if dataset_cfg.get(key)]
    return location.is_dir() and all((location / name).is_file() for name in files)


def dataset_choices(table: str, scale: str = "smoke") -> list[str]:
    """The `dataset=` choices of a preset's sweep, in sweep order."""
    choices = []
    for job in job_overrides(table, scale):
        for override in job:
            if override.startswith("dataset=") and override[8:] not in choices:
                choices.append(override[8:])
    return choices


def check_data(choices: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """({choice: dataset name} of those whose data is here, {dataset name: where its data was looked for} of the
    others)."""
    from hydra import compose

    present, missing = {}, {}
    with conf_dir():
        for choice in choices:
            dataset = compose("config", overrides=[f"dataset={choice}"]).dataset
            location = data_location(dataset)
            if location is None or data_present(dataset, location):
                present[choice] = str(dataset.name)
            else:
                missing[str(dataset.name)] = str(location)
    return present, missing


def sweep_command(table: str, datasets: list[str], scale: str = "smoke") -> list[str]:
    preset = [f"experiment={table}", f"scale={scale}", "trainer.progress_bar=false", f"dataset={','.join(datasets)}"]
    return [sys.executable, "-m", "xmc_repro", "-m", *preset]


STORE_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")  # MLflow's tracking stores


def check_store(uri: str) -> None:
    """A store the sweep's jobs can write to, or one line saying what to give instead."""
    from xmc_repro import tracking

    scheme = uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else ""
    if scheme not in STORE_SCHEMES:
        raise ConfigError(f"--tracking-uri {uri}: not an MLflow tracking store this can write runs to; give "
                          "sqlite:///mlruns.db or an http://host:port tracking server")
    tracking.check_store(uri, setting="--tracking-uri ")


def run_smoke(tables=TABLES, uri: str | None = None, data_missing: Path = DATA_MISSING, run=run_sweep) -> None:
    """Run the smoke sweeps of `tables`; raises SweepFailed naming the tables whose sweep had failed jobs."""
    uri = absolute(tracking_uri(uri))
    check_store(uri)  # before any job starts: a bad store would fail every job with the same long error
    failed, missing_now, found = [], {}, set()
    for i, table in enumerate(tables):
        choices = dataset_choices(table)
        present, missing = check_data(choices)
        for name, location in missing.items():
            if name not in missing_now:
                print(f"missing: data not found at {location} (dataset {name}; pass dataset.data_dir=DIR or set "
                      "$XMC_SHARED_DATA); its runs are skipped", flush=True)  # fmt: skip
        missing_now.update(missing)
        found.update(present.values())
        if not present:
            continue
        command = sweep_command(table, list(present))
        print(f"smoke: {' '.join(command[1:])} -> {uri}", flush=True)
        try:
            if run(command, env={**os.environ, "MLFLOW_TRACKING_URI": uri}).returncode != 0:
                failed.append(table)
        except KeyboardInterrupt:  # data_missing.json is left as it was: this call did not look at every table
            rest = " ".join(tables[i:])
            raise SweepInterrupted(f"interrupted (Ctrl+C) in the smoke sweep of {table} (its line above says what "
                                   f"became of its runs); to go on: python -m xmc_repro.report smoke --tables {rest}"
                                   ) from None
    # Datasets these tables did not look for keep what an earlier call found (`--tables table5` checks no real set)
    checked = found | set(missing_now)
    try:
        earlier = {name: where for name, where in read_data_missing(data_missing).items() if name not in checked}
    except DataError:  # damaged: rewritten from this call's findings (its own remedy is to run this command)
        earlier = {}
    write_data_missing(data_missing, {**earlier, **missing_now})
    if failed:
        raise SweepFailed(f"jobs of the smoke sweeps of {', '.join(failed)} failed (their errors are above); "
                          "fix them and rerun, e.g. `python -m xmc_repro.report smoke --tables " + failed[0] + "`")


def write_data_missing(path: Path, missing: dict[str, str]) -> None:
    write_text(path, json.dumps(missing, sort_keys=True, indent=1) + "\n", "`python -m xmc_repro.report smoke`")


def read_data_missing(path: Path) -> dict[str, str]:
    """{dataset name: where its data was looked for}; an absent file means nothing is known missing."""
    if not path.exists():
        return {}
    remedy = "write it again with `python -m xmc_repro.report smoke` or restore it with `git checkout`"
    try:
        missing = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: not valid JSON ({error}); {remedy}") from None
    except OSError as error:  # a folder, no permission: was a traceback
        raise DataError(f"{path}: cannot be read ({error.strerror or error}); {remedy}") from None
    if not isinstance(missing, dict) or not all(isinstance(v, str) for v in missing.values()):
        raise DataError(f"{path}: not an object of dataset names and the paths looked at; {remedy}")
    return missing


def absolute(uri: str) -> str:
    """A relative sqlite store made absolute: the line that starts each sweep names the file its jobs write."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri
