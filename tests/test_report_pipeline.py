"""End to end: `python -m xmc_repro -m` fills a real sqlite MLflow store, `records add` copies it into run
records, and the report exports and renders those."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from xmc_repro.report import paper, records
from xmc_repro.report.__main__ import main as report_main
from xmc_repro.report.export import export
from xmc_repro.report.grid import expected_configurations, write_grid
from xmc_repro.report.render import table_rows

ROOT = Path(__file__).resolve().parents[1]
PAPER_P1 = {"squared_hinge": "31.7", "bce": "30.9"}  # Table 4: Amazon-670K slice, uniform 32 + 16k


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Table 4's smoke sweep narrowed to one stand-in (both losses), one epoch: two real runs, plus a failed one."""
    tmp = tmp_path_factory.mktemp("pipeline")
    uri = f"sqlite:///{tmp / 'mlruns.db'}"
    command = [
        sys.executable, "-m", "xmc_repro", "-m", "experiment=table4", "scale=smoke",
        "dataset=smoke_amazon670k_slice", "trainer.max_epochs=1", "trainer.progress_bar=false",
        f"logger.tracking_uri={uri}", f"hydra.sweep.dir={tmp / 'multirun'}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("xmc_repro").experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    # a crashed rerun of one of them with a better score must not replace it
    crashed = client.create_run(runs[0].info.experiment_id).info.run_id
    for key, value in runs[0].data.params.items():
        client.log_param(crashed, key, value)
    for key, value in runs[0].data.tags.items():
        if not key.startswith("mlflow."):
            client.set_tag(crashed, key, value)
    client.log_metric(crashed, "test/p_at_1", 99.0)
    client.set_terminated(crashed, "FAILED")
    (tmp / "records").mkdir()
    assert report_main(["records", "add", uri, "--dir", str(tmp / "records")]) == 0
    return tmp, uri, runs


def test_records_hold_what_mlflow_holds_and_adding_again_changes_nothing(store):
    tmp, uri, runs = store
    found = {r["run_id"]: r for r in records.load(tmp / "records")}
    assert set(found) == {run.info.run_id for run in runs}  # the crashed run is not a record
    for run in runs:
        record = found[run.info.run_id]
        assert record["params"] == run.data.params and record["metrics"] == run.data.metrics
        assert record["tags"]["table"] == "table4" and record["tags"]["device"] == run.data.tags["device"]
        assert record["status"] == "FINISHED" and record["end_time"]
    counts = records.add_from_store(uri, tmp / "records")
    dirty = sum(run.data.tags["git_commit"].endswith("-dirty") for run in runs)  # run in a checkout with changes
    assert counts == {"new": 0, "updated": 0, "unchanged": 2, "skipped": {"FAILED": 1}, "uncommitted": dirty,
                      "unusable": []}


def test_export_of_pipeline_runs_matches_mlflow(store):
    tmp, uri, runs = store
    rows = export(tmp / "runs.csv", tmp / "records")
    assert len(rows) == 2
    logged = {r.data.params["loss/name"]: r for r in runs}
    for row in rows:
        run = logged[row["loss"]]
        assert (row["table"], row["scale"], row["dataset"], row["features"]) == ("table4", "smoke", "Smoke-Amazon-670K",
                                                                                 "slice")  # fmt: skip
        assert (row["setup"], row["connectivity"], row["intermediate"]) == ("uniform", "32", "128")
        assert float(row["test_p1"]) == pytest.approx(run.data.metrics["test/p_at_1"], rel=1e-5)
        assert float(row["test_p5"]) == pytest.approx(run.data.metrics["test/p_at_5"], rel=1e-5)
        assert row["run_ids"] == run.info.run_id and row["device"] == run.data.tags["device"]
        assert row["memory_gib"] == ("" if row["device"].startswith("cpu") else row["memory_gib"])


def test_rendered_table4_has_the_measured_rows_beside_the_paper_and_the_rest_missing(store):
    tmp, uri, runs = store
    export(tmp / "runs.csv", tmp / "records")
    from xmc_repro.report.export import read_runs_csv

    rows = table_rows("table4", "smoke", read_runs_csv(tmp / "runs.csv"), expected_configurations("table4", "smoke"),
                      paper.load())  # fmt: skip
    measured = [r for r in rows if r["status"] == "measured"]
    assert len(measured) == 2 and sum(r["status"] == "missing" for r in rows) == 10  # the grid has 12 jobs
    logged = {r.data.params["loss/name"]: r.data.metrics["test/p_at_1"] for r in runs}
    for row in measured:
        assert (row["dataset"], row["features"], row["setup"], row["intermediate"]) == (
            "Amazon-670K", "slice", "uniform", "16384")  # fmt: skip
        assert row["published_test_p1"] == PAPER_P1[row["loss"]] and row["published_source"] == "paper"
        assert float(row["ours_test_p1"]) == pytest.approx(logged[row["loss"]], rel=1e-5)
        # a stand-in: no difference to the paper; the paper's P@1 relative to its dense row (33.8) beside ours
        assert row["diff_test_p1"] == "" and row["ours_p1_vs_dense"] == ""  # no dense run in this store
        assert float(row["published_p1_vs_dense"]) == pytest.approx(float(PAPER_P1[row["loss"]]) / 33.8, abs=1e-5)


def test_the_report_command_line_renders_files(store):
    tmp, uri, _ = store
    out = tmp / "cli"
    assert report_main(["export", "--records", str(tmp / "records"), "--out", str(out / "runs.csv")]) == 0
    assert write_grid(out / "grid.csv", tables=("table4",), scales=("smoke",)) == 12
    paths = {"--runs": "runs.csv", "--grid": "grid.csv", "--tables": "tables", "--figures": "figures"}
    assert report_main(["render", *(part for flag, name in paths.items() for part in (flag, str(out / name)))]) == 0
    text = (out / "tables" / "table4.md").read_text()
    assert "Smoke-Amazon-670K slice: uniform 32 + 128" in text and "| missing |" in text
    assert report_main(["claims", "--runs", str(out / "runs.csv"), "--out", str(out / "claims.md")]) == 0
    assert (out / "claims.md").read_text().count("not measured here") >= 6  # smoke runs verdict nothing
    assert sorted(p.name for p in (out / "tables").iterdir()) == sorted(
        f"table{n}.{ext}" for n in range(1, 6) for ext in ("md", "tex", "csv"))  # fmt: skip
