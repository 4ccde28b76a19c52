"""Export (MLflow -> runs.csv) and rendering (runs.csv + published numbers -> tables, figures).

The store is a real sqlite MLflow store filled through the MLflow API with exactly the pipeline's keys
(params = the config flattened with `/`, metrics `test/p_at_k` ..., tags `table`, `scale`, `device`).
"""

from __future__ import annotations

import csv
import math
import shutil
import subprocess

import pytest

from xmc_repro.report import paper
from xmc_repro.report.export import export, read_runs_csv
from xmc_repro.report.figures import render_figures
from xmc_repro.report.identity import configuration, paper_key, paper_width
from xmc_repro.report.render import latex, markdown, render_tables, table_rows

CPU = "cpu (x86_64, 2 threads)"


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory):
    """An initialised sqlite store (creating its schema takes seconds), copied for every test."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("store") / "mlruns.db"
    MlflowClient(f"sqlite:///{path}").create_experiment("xmc_repro")
    return path


@pytest.fixture
def store(tmp_path, empty_store):
    from mlflow.tracking import MlflowClient

    shutil.copy(empty_store, tmp_path / "mlruns.db")
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)
    return uri, client, client.get_experiment_by_name("xmc_repro").experiment_id


# (dataset.name, dataset.features) of some dataset configs
SMOKE_AMAZON_SLICE = ("Smoke-Amazon-670K", "slice")
SMOKE_AMAZON_CASCADE = ("Smoke-Amazon-670K", "cascade")
SMOKE_WIKIPEDIA_CASCADE = ("Smoke-Wikipedia-500K", "cascade")
AMAZON_SLICE = ("Amazon-670K", "slice")
WIKIPEDIA_CASCADE = ("Wikipedia-500K", "cascade")
BIBTEX = ("Bibtex", "bow")


def params_of(dataset, head, connectivity=None, intermediate=None, loss="squared_hinge", seed=0, bottleneck=None):
    """A run's params as the pipeline logs them: the resolved config flattened with '/', str() of each value."""
    return {
        "dataset/name": dataset[0],
        "dataset/features": dataset[1],
        "model/head": head,
        "model/connectivity": str(connectivity),
        "model/intermediate": str(intermediate),
        "model/bottleneck": str(bottleneck),
        "model/rewire_fraction": "0.1",
        "loss/name": loss,
        "seed": str(seed),
        "trainer/lr": "0.001",
    }


def log_run(store, params, metrics, table="table1", scale="smoke", status="FINISHED", device=CPU, start=None):
    from mlflow.entities import Metric, Param, RunTag

    _, client, experiment = store
    run_id = client.create_run(experiment, start_time=start).info.run_id
    tags = {"table": table, "scale": scale, "device": device, "sparse_backend": "reference", "git_commit": "abc"}
    client.log_batch(
        run_id,
        metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()],
        params=[Param(k, v) for k, v in params.items()],
        tags=[RunTag(k, v) for k, v in tags.items() if v is not None],
    )
    if status != "RUNNING":
        client.set_terminated(run_id, status)
    return run_id


def metrics_of(p1, p3=None, p5=None, memory=None, epochs=3.0):
    metrics = {"test/p_at_1": p1, "test/p_at_3": p3 or p1 / 2, "test/p_at_5": p5 or p1 / 3, "train/p_at_1": p1 + 10,
               "val/p_at_3": p1 / 2, "epochs": epochs, "time_per_epoch_s": 1.5}  # fmt: skip
    if memory is not None:
        metrics["peak_gpu_memory_gib"] = memory
    return metrics


# ---------------------------------------------------------------------------------------------------- export


def test_export_ignores_failed_running_and_killed_runs(store, tmp_path):
    params = params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256)
    log_run(store, params, metrics_of(41.0))
    log_run(store, params, metrics_of(99.0), status="FAILED")
    log_run(store, params, metrics_of(98.0), status="RUNNING")
    log_run(store, params, metrics_of(97.0), status="KILLED")
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "dense"), metrics_of(12.0), status="FAILED")
    rows = export(tmp_path / "runs.csv", store[0])
    assert len(rows) == 1
    (row,) = read_runs_csv(tmp_path / "runs.csv")
    assert (row["dataset"], row["setup"], row["runs"]) == ("Smoke-Amazon-670K", "uniform", "1")
    assert float(row["test_p1"]) == 41.0


def test_export_takes_the_latest_run_per_seed_then_mean_and_spread_over_seeds(store, tmp_path):
    params = {seed: params_of(BIBTEX, "uniform", 32, 256, seed=seed) for seed in (0, 1, 2)}
    log_run(store, params[0], metrics_of(10.0), start=1_000)
    log_run(store, params[0], metrics_of(30.0), start=3_000)  # rerun of seed 0: replaces the first
    log_run(store, params[1], metrics_of(50.0), start=2_000)
    log_run(store, params[2], metrics_of(40.0, memory=1.25), start=2_500)
    (row,) = export(tmp_path / "runs.csv", store[0])
    values = [30.0, 50.0, 40.0]
    mean = sum(values) / 3
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    assert row["seeds"] == "0;1;2" and row["runs"] == "3"
    assert float(row["test_p1"]) == pytest.approx(mean) and float(row["test_p1_std"]) == pytest.approx(spread, rel=1e-5)
    assert float(row["memory_gib"]) == 1.25 and row["memory_gib_std"] == ""  # measured by one seed only
    assert row["device"] == CPU and len(row["run_ids"].split(";")) == 3


def test_export_keeps_configurations_tables_and_scales_apart_and_skips_untagged_runs(store, tmp_path):
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(40.0))
    log_run(store, params_of(BIBTEX, "uniform", 64, 256), metrics_of(42.0))
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(43.0), table="table4")
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(44.0), scale="paper")
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(45.0), table=None)  # an ad-hoc run
    # a dense run's leftover connectivity does not make it another configuration
    log_run(store, params_of(BIBTEX, "dense", 32), metrics_of(20.0), start=1_000)
    log_run(store, params_of(BIBTEX, "dense", None), metrics_of(21.0), start=2_000)
    rows = export(tmp_path / "runs.csv", store[0])
    found = {(r["table"], r["scale"], r["setup"], r["connectivity"]): float(r["test_p1"]) for r in rows}
    assert found == {
        ("table1", "smoke", "uniform", "32"): 40.0,
        ("table1", "smoke", "uniform", "64"): 42.0,
        ("table4", "smoke", "uniform", "32"): 43.0,
        ("table1", "paper", "uniform", "32"): 44.0,
        ("table1", "smoke", "dense", ""): 21.0,
    }


def test_one_configuration_on_two_machines_gives_two_rows_side_by_side(store, tmp_path, published):
    params = params_of(SMOKE_AMAZON_CASCADE, "uniform", 32, 256)
    log_run(store, params, metrics_of(40.0))
    log_run(store, params, metrics_of(41.0, memory=0.05), device="NVIDIA H100 80GB HBM3")
    runs = export(tmp_path / "runs.csv", store[0])
    assert {r["device"] for r in runs} == {CPU, "NVIDIA H100 80GB HBM3"}
    rows = table_rows("table1", "smoke", runs, [config_of(SMOKE_AMAZON_CASCADE, "uniform", 32, 256)], published)
    measured = [r for r in rows if r["status"] == "measured"]
    assert {(r["card"], r["ours_memory_gib"]) for r in measured} == {(CPU, ""), ("NVIDIA H100 80GB HBM3", "0.05")}
    assert {(r["dataset"], r["features"], r["setup"], r["intermediate"]) for r in measured} == {
        ("Amazon-670K", "cascade", "uniform", "32768")}  # fmt: skip


def test_merged_runs_from_another_store_export_like_local_ones_and_merge_once(store, tmp_path, empty_store):
    from mlflow.tracking import MlflowClient

    from xmc_repro.report.merge import merge_runs

    shutil.copy(empty_store, tmp_path / "gpu.db")
    gpu_uri = f"sqlite:///{tmp_path / 'gpu.db'}"
    gpu_client = MlflowClient(gpu_uri)
    gpu = (gpu_uri, gpu_client, gpu_client.get_experiment_by_name("xmc_repro").experiment_id)
    card = "NVIDIA H200"
    log_run(gpu, params_of(BIBTEX, "uniform", 32, 256), metrics_of(50.0, memory=0.01), device=card, start=5_000)
    log_run(gpu, params_of(BIBTEX, "dense"), metrics_of(55.0), device=card, status="FAILED")
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(49.0))
    assert merge_runs(gpu_uri, store[0]) == 1
    assert merge_runs(gpu_uri, store[0]) == 0
    rows = export(tmp_path / "runs.csv", store[0])
    found = {(r["device"], r["setup"]): (float(r["test_p1"]), r["memory_gib"]) for r in rows}
    assert found == {(CPU, "uniform"): (49.0, ""), (card, "uniform"): (50.0, "0.01")}


def test_smoke_stage_sweeps_only_tables_without_smoke_runs_and_fails_when_a_sweep_yields_nothing(store, tmp_path):
    import json

    from xmc_repro.report.smoke import SweepFailed, ensure_smoke_runs

    for table in ("table1", "table2", "table3", "table5"):
        log_run(store, params_of(BIBTEX, "uniform", 32, 128), metrics_of(40.0), table=table)
    log_run(store, params_of(BIBTEX, "uniform", 32, 128), metrics_of(40.0), table="table4", scale="paper")
    log_run(store, params_of(BIBTEX, "uniform", 32, 128), metrics_of(40.0), table="table4", status="FAILED")
    commands = []

    def sweep(command, **kwargs):  # stands in for the sweep's process: logs what the sweep would
        commands.append(command[1:])
        log_run(store, params_of(BIBTEX, "uniform", 32, 128, loss="bce"), metrics_of(41.0), table="table4")
        return subprocess.CompletedProcess(command, 1)  # one of its jobs failed

    counts = ensure_smoke_runs(tmp_path / "marker.json", store[0], run=sweep)
    assert commands == [["-m", "xmc_repro", "-m", "experiment=table4", "scale=smoke", "trainer.progress_bar=false"]]
    assert counts == {"table1": 1, "table2": 1, "table3": 1, "table4": 1, "table5": 1}
    marker = json.loads((tmp_path / "marker.json").read_text())
    assert marker == {"finished_smoke_runs": counts, "sweeps_with_failed_jobs": ["table4"]}
    assert ensure_smoke_runs(tmp_path / "marker.json", store[0], run=sweep) == counts and len(commands) == 1

    _, client, experiment = store
    client.delete_run(client.search_runs([experiment], "tags.table = 'table5'")[0].info.run_id)
    def broken(command, **kwargs):
        return subprocess.CompletedProcess(command, 1)

    with pytest.raises(SweepFailed, match="table5"):
        ensure_smoke_runs(tmp_path / "marker.json", store[0], run=broken)


def test_export_of_an_empty_store_writes_only_the_header(store, tmp_path):
    assert export(tmp_path / "runs.csv", store[0]) == []
    with open(tmp_path / "runs.csv") as f:
        assert next(csv.reader(f))[:3] == ["table", "scale", "dataset"]


# ---------------------------------------------------------------------------------------------------- identity


def test_smoke_widths_map_back_to_the_papers_widths():
    assert [paper_width(str(w), "smoke") for w in (64, 128, 256, 512, 781)] == [
        "8192", "16384", "32768", "65536", "100000"]  # fmt: skip
    assert paper_width("256", "paper") == "256" and paper_width("", "smoke") == ""


def test_paper_key_names_rows_as_the_paper_does():
    config = configuration(params_of(SMOKE_WIKIPEDIA_CASCADE, "dense", 32), {"table": "table1", "scale": "smoke"})
    assert paper_key(config) == ("Wikipedia-500K", "cascade", "dense", "768", "", "squared_hinge")
    config = configuration(params_of(AMAZON_SLICE, "bottleneck", bottleneck=64), {"table": "t", "scale": "paper"})
    assert paper_key(config) == ("Amazon-670K", "slice", "bottleneck", "64", "64", "squared_hinge")
    assert paper_key(configuration(params_of(BIBTEX, "uniform", 32), {"scale": "smoke"})) is None


# ---------------------------------------------------------------------------------------------------- rendering


def config_of(dataset, head, connectivity=None, intermediate=None, loss="squared_hinge", table="table1", scale="smoke"):
    return configuration(params_of(dataset, head, connectivity, intermediate, loss), {"table": table, "scale": scale})


@pytest.fixture
def published():
    return paper.load()


def published_row(published, table, *key):
    (row,) = [r for r in published if r["table"] == table and paper.row_key(r) == key]
    return row


def test_rows_put_ours_beside_the_published_value_and_mark_what_never_ran(store, tmp_path, published):
    measured = config_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256)
    never_run = config_of(SMOKE_AMAZON_SLICE, "dense")
    extra = config_of(BIBTEX, "uniform", 32, 256)
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), metrics_of(30.5, 25.0, 20.0))
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(60.0))
    runs = export(tmp_path / "runs.csv", store[0])
    rows = table_rows("table1", "smoke", runs, [measured, never_run, extra], published)

    by_name = {(r["dataset"], r["features"], r["setup"], r["connectivity"], r["intermediate"]): r for r in rows}
    ours = by_name[("Amazon-670K", "slice", "uniform", "32", "32768")]
    expected = published_row(published, "table1_architecture", *AMAZON_SLICE, "uniform", "32", "32768", "squared_hinge")
    assert ours["status"] == "measured" and ours["published_source"] == "paper"
    assert ours["published_test_p1"] == expected["test_p1"] == "32.8"
    assert float(ours["ours_test_p1"]) == 30.5 and float(ours["diff_test_p1"]) == pytest.approx(30.5 - 32.8)
    assert float(ours["diff_test_p5"]) == pytest.approx(20.0 - float(expected["test_p5"]))
    assert ours["our_dataset"] == "Smoke-Amazon-670K slice" and ours["card"] == CPU and ours["scale"] == "smoke"

    gap = by_name[("Amazon-670K", "slice", "dense", "512", "")]
    assert gap["status"] == "missing" and gap["ours_test_p1"] == "" and gap["published_test_p1"] == "33.8"
    assert gap["our_dataset"] == "Smoke-Amazon-670K slice"  # the grid has it; it never ran
    # every published row of the table is there, measured or not, in the paper's order
    table1 = [r for r in published if r["table"] == "table1_architecture"]
    assert [paper.row_key(r) for r in table1] == [
        tuple(r[c] for c in ("dataset", "features", "setup", "connectivity", "intermediate", "loss")) for r in rows[:22]
    ]
    assert sum(r["status"] == "measured" for r in rows) == 2
    bibtex = rows[-1]
    assert (bibtex["dataset"], bibtex["features"]) == BIBTEX and bibtex["published_source"] == ""
    assert float(bibtex["ours_test_p1"]) == 60


def test_a_run_outside_the_grid_still_shows_and_the_supplement_fills_published_gaps(store, tmp_path, published):
    # table 1 of the paper has no Wikipedia-500K cascade unstructured row; the authors' supplement has one
    log_run(store, params_of(WIKIPEDIA_CASCADE, "unstructured", 32), metrics_of(63.0, memory=4.5), scale="paper")
    runs = export(tmp_path / "runs.csv", store[0])
    rows = table_rows("table1", "paper", runs, [], published)
    (row,) = [r for r in rows if r["status"] == "measured"]
    assert row["published_source"] == "authors' README" and row["published_test_p1"] == "65.25"
    assert float(row["diff_memory_gib"]) == pytest.approx(4.5 - 4.79)
    assert sum(r["status"] == "missing" for r in rows) == 22  # the paper's rows, none run at paper scale


def test_table5_keeps_the_literature_rows(published):
    rows = table_rows("table5", "smoke", [], [], published)
    literature = [r for r in rows if r["setup"] == "literature"]
    assert len(literature) == 4 and all(r["status"] == "literature" for r in literature)
    assert {r["status"] for r in rows} == {"literature", "missing"}


def test_markdown_and_latex_show_gaps_values_and_provenance(store, tmp_path, published):
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256, seed=0), metrics_of(30.0))
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256, seed=1), metrics_of(31.0))
    runs = export(tmp_path / "runs.csv", store[0])
    blocks = [(s, table_rows("table1", s, runs, [], published)) for s in ("paper", "smoke")]
    text = markdown("table1", blocks)
    line = next(l for l in text.splitlines() if "30.5 ± 0.7" in l)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["Amazon-670K", "slice", "uniform", "32", "32768"]
    assert cells[5:8] == ["32.8", "30.5 ± 0.7", "-2.3"] and CPU in cells
    assert "Smoke-Amazon-670K slice: uniform 32 + 256 (seeds 0,1)" in cells
    assert text.count("| missing |") > 40 and "## Scale `smoke`" in text and "## Scale `paper`" in text
    tex = latex("table1", blocks)
    assert r"30.5 $\pm$ 0.7" in tex and "Smoke-Amazon-670K slice" in tex and tex.count(r"\\") > 44


def test_render_writes_every_table_and_figure(store, tmp_path, published):
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), metrics_of(30.0, memory=0.02))
    log_run(store, params_of(AMAZON_SLICE, "uniform", 32, 32768), metrics_of(33.0, memory=1.1), scale="paper")
    runs = export(tmp_path / "runs.csv", store[0])
    rendered = render_tables(runs, published, tmp_path / "tables", expected=lambda table, scale: [])
    for table in ("table1", "table2", "table3", "table4", "table5"):
        for ext in ("md", "tex", "csv"):
            assert (tmp_path / "tables" / f"{table}.{ext}").stat().st_size > 0
        with open(tmp_path / "tables" / f"{table}.csv") as f:
            assert len(list(csv.DictReader(f))) == len(rendered[table])
    names = render_figures(runs, published, tmp_path / "figures")
    assert names[:5] == ["wiki10_31k", "amazon670k_slice", "amazon670k_cascade", "wikipedia500k_slice",
                         "wikipedia500k_cascade"] and "smoke_amazon_670k_slice" in names  # fmt: skip
    with open(tmp_path / "figures" / "data" / "amazon670k_slice_ours.csv") as f:
        (point,) = list(csv.DictReader(f))
    assert point["memory_gib"] == "1.1" and point["test_p1"] == "33"
    assert (tmp_path / "figures" / "memory_vs_p1_amazon670k_slice.png").read_bytes()[:4] == b"\x89PNG"
