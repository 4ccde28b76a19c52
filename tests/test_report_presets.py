"""The sweep presets (conf/experiment, conf/scale) compose, and their grids are the paper's tables."""

from __future__ import annotations

import pytest

from xmc_repro.report import grid, paper
from xmc_repro.report.identity import PAPER_WIDTHS, paper_key, paper_width

JOBS = {  # (table, scale) -> jobs in the sweep
    ("table1", "paper"): 5 * 7,  # datasets x rows (5 of the paper's + bottleneck + MACH)
    ("table1", "smoke"): 7 * 7,  # 5 stand-ins + Bibtex + Delicious
    ("table2", "paper"): 2 * 2 * 4,  # feature sets x connectivity x intermediate
    ("table2", "smoke"): 2 * 2 * 4,
    ("table3", "paper"): 2 * 2 * 4,
    ("table3", "smoke"): 2 * 2 * 4,
    ("table4", "paper"): 4 * 2,  # datasets x losses
    ("table4", "smoke"): 6 * 2,
    ("table5", "paper"): 4,
    ("table5", "smoke"): 4,
}


def compose(overrides):
    from hydra import compose as hydra_compose

    with grid.conf_dir():
        return hydra_compose("config", overrides=overrides)


@pytest.mark.parametrize("table,scale", sorted(JOBS))
def test_each_preset_sweeps_its_grid_with_its_tags(table, scale):
    jobs = grid.job_overrides(table, scale)
    assert len(jobs) == JOBS[table, scale]
    assert len({tuple(job) for job in jobs}) == len(jobs)
    cfg = compose(jobs[-1])
    assert (cfg.table, cfg.scale) == (table, scale)


def test_scale_defaults_to_paper_and_the_command_line_overrides_a_sweep_key():
    assert compose(["experiment=table2"]).scale == "paper"
    jobs = grid.job_overrides("table5", "smoke")
    assert {job[0] for job in jobs} == {
        "dataset=smoke_wikipedia500k_slice", "dataset=smoke_wikipedia500k_cascade",
        "dataset=smoke_amazon670k_slice", "dataset=smoke_amazon670k_cascade"}  # fmt: skip
    # the user narrows a sweep from the command line, as `python -m xmc_repro -m experiment=table5 dataset=x`
    assert grid.sweep_jobs({"dataset": "a,b", "loss": "bce"}, ["dataset=c"]) == [["dataset=c", "loss=bce"]]


@pytest.mark.parametrize(
    "overrides,intermediate",
    [
        (["dataset=wiki10_31k", "experiment=table1"], 8192),
        (["dataset=amazon670k_cascade", "experiment=table1"], 32768),
        (["dataset=smoke_wiki10_31k", "experiment=table1", "scale=smoke"], 64),
        (["dataset=bibtex", "experiment=table1", "scale=smoke"], 256),
    ],
)
def test_table1_intermediate_layer_depends_on_the_dataset(overrides, intermediate):
    cfg = compose(["+experiment/row=uniform_wide", *overrides])
    assert (cfg.model.head, cfg.model.connectivity, cfg.model.intermediate) == ("uniform", 32, intermediate)
    assert compose(["+experiment/row=uniform", *overrides]).model.intermediate is None


def test_mach_and_bottleneck_rows():
    cfg = compose(["dataset=bibtex", "+experiment/row=mach", "experiment=table1", "scale=smoke"])
    sizes = ("num_hashes", "num_buckets")
    assert cfg.model.head == "mach" and [cfg.model.mach[k] for k in sizes] == [4, 16]
    cfg = compose(["dataset=amazon670k_slice", "+experiment/row=mach", "experiment=table1"])
    assert [cfg.model.mach[k] for k in sizes] == [8, 16384]
    cfg = compose(["dataset=amazon670k_slice", "+experiment/row=bottleneck", "experiment=table1"])
    assert (cfg.model.head, cfg.model.bottleneck) == ("bottleneck", 64)


def test_smoke_scale_is_small_and_every_smoke_width_stands_for_a_paper_width():
    for table in grid.TABLES:
        for job in grid.job_overrides(table, "smoke"):
            for override in job:
                if override.startswith("model.intermediate="):
                    assert paper_width(override.split("=")[1], "smoke") in map(str, PAPER_WIDTHS)
    cfg = compose(["experiment=table4", "scale=smoke", "dataset=smoke_amazon670k_slice"])
    assert cfg.trainer.max_epochs <= 3 and cfg.trainer.limit_train_batches <= 50
    assert paper_width(str(cfg.model.intermediate), "smoke") == "16384"


@pytest.mark.slow
@pytest.mark.parametrize("scale", grid.SCALES)
@pytest.mark.parametrize("table", grid.TABLES)
def test_every_published_row_is_in_the_presets_grid(table, scale):
    """Each of the paper's rows (but the literature's) is some job of the preset, at both scales."""
    covered = {paper_key(config) for config in grid.expected_configurations(table, scale)}
    published = [r for r in paper.load() if r["table"] == paper.PAPER_TABLES[table] and r["setup"] != "literature"]
    assert published and {paper.row_key(r) for r in published} <= covered
