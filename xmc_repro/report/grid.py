"""The configurations a table's sweep preset runs, read from conf/ exactly as `python -m xmc_repro -m` would.

`expected_configurations("table1", "smoke")` composes `experiment=table1 scale=smoke`, expands its
`hydra.sweeper.params` into jobs the way Hydra's basic sweeper does (a cartesian product, later overrides of a key
replacing earlier ones), composes every job and returns its configuration. `write_grid` stores them all in
results/grid.csv (the `grid` stage), from which rendering marks every configuration that never ran as missing.
"""

from __future__ import annotations

import csv
import functools
import itertools
from pathlib import Path

from xmc_repro.report.atomic import replacing
from xmc_repro.report.csv_file import read_rows
from xmc_repro.report.identity import CONFIG_COLUMNS, config_key, configuration
from xmc_repro.resources import resource_dir

CONF_DIR = resource_dir("conf")
TABLES = ("table1", "table2", "table3", "table4", "table5")
SCALES = ("paper", "smoke")


def sweep_jobs(params: dict[str, str], arguments: list[str] = ()) -> list[list[str]]:
    """The override list of every job of a sweep over `params` (+ command-line `arguments`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [f"{key}={value}" for key, value in params.items()] + list(arguments)
    choices: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.get_key_element()
        if override.is_sweep_override():
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*choices.values())]


def conf_dir():
    """Hydra reads conf/ (the same files as `python -m xmc_repro`) inside this context."""
    from hydra import initialize_config_dir

    return initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")


def job_overrides(table: str, scale: str) -> list[list[str]]:
    """Every job of `python -m xmc_repro -m experiment=<table> scale=<scale>`, as override lists."""
    from hydra import compose
    from omegaconf import OmegaConf

    preset = [f"experiment={table}", f"scale={scale}"]
    with conf_dir():
        cfg = compose("config", overrides=preset, return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True) or {}
    return sweep_jobs({k: str(v) for k, v in params.items()}, preset)


@functools.lru_cache(maxsize=None)
def expected_configurations(table: str, scale: str) -> tuple[dict[str, str], ...]:
    """Configurations of the preset's grid, in sweep order, without repeats (seeds are not configurations).

    Composing is slow (a few tenths of a second a job), so the result is kept for the process.
    """
    from hydra import compose

    from xmc_repro.tracking import flatten

    seen, configs = set(), []
    jobs = job_overrides(table, scale)
    with conf_dir():
        for overrides in jobs:
            cfg = compose("config", overrides=overrides)
            config = configuration(flatten(cfg), {"table": cfg.table, "scale": cfg.scale})
            key = config_key(config)
            if key not in seen:
                seen.add(key)
                configs.append(config)
    return tuple(configs)


def write_grid(path: Path, tables=TABLES, scales=SCALES) -> int:
    """Every preset's configurations, in sweep order, as CSV; returns their number."""
    rows = [config for table in tables for scale in scales for config in expected_configurations(table, scale)]
    with replacing(path, "`python -m xmc_repro.report grid`", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CONFIG_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def read_grid(path: Path):
    """`expected(table, scale)` from a file written by `write_grid`."""
    rows = read_rows(path, CONFIG_COLUMNS, (), "write it again with `python -m xmc_repro.report grid`")

    def expected(table: str, scale: str) -> list[dict[str, str]]:
        return [row for row in rows if row["table"] == table and row["scale"] == scale]

    return expected
