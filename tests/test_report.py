"""Run records -> runs.csv -> tables, figures and claims; records from a real MLflow store.

Records are written as `records add` writes them: params = the config flattened under its Hydra keys, metrics
`test/p_at_k` ..., tags `table`, `scale`, `device`. The store tests use a real sqlite MLflow store.
"""

from __future__ import annotations

import csv
import json
import re
import math
import shutil
import stat
import uuid
from pathlib import Path

import pytest

from xmc_repro.report import paper, records
from xmc_repro.report.export import export, read_runs_csv, shared_settings, summarize, write_runs_csv
from xmc_repro.report.figures import relative_points, render_figures
from xmc_repro.report.identity import configuration, paper_key, paper_width
from xmc_repro.report.render import latex, markdown, render_tables, table_rows

CPU = "cpu (x86_64, 2 threads)"
H200 = "NVIDIA H200"

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
        "dataset/num_features": "64",
        "dataset/num_labels": "670",
        "model/head": head,
        "model/connectivity": str(connectivity),
        "model/intermediate": str(intermediate),
        "model/bottleneck": str(bottleneck),
        "model/rewire_fraction": "0.1",
        "loss/name": loss,
        "seed": str(seed),
        "trainer/lr": "0.001",
    }


def metrics_of(p1, p3=None, p5=None, memory=None, epochs=3.0, train_p1=None, seconds=1.5):
    metrics = {"test/p_at_1": p1, "test/p_at_3": p3 or p1 / 2, "test/p_at_5": p5 or p1 / 3,
               "train/p_at_1": p1 + 10 if train_p1 is None else train_p1, "val/p_at_3": p1 / 2, "epochs": epochs,
               "time_per_epoch_s": seconds}  # fmt: skip
    if memory is not None:
        metrics["peak_gpu_memory_gib"] = memory
    return metrics


def logged_scores(p1):
    """The test P@k a finished table run logs, as MLflow metrics."""
    from mlflow.entities import Metric

    return [Metric("test/p_at_1", p1, 0, 0), Metric("test/p_at_3", 30.0, 0, 0), Metric("test/p_at_5", 20.0, 0, 0)]


def finished_table_run(client, metrics, seed: int = 0) -> str:
    """A FINISHED Bibtex dense run of table1 with `metrics` (MLflow Metrics), logged through `client`; its id."""
    from mlflow.entities import Param, RunTag

    experiment = client.get_experiment_by_name("xmc_repro").experiment_id
    run_id = client.create_run(experiment).info.run_id
    params = [Param(k, v) for k, v in params_of(BIBTEX, "dense", seed=seed).items()]
    client.log_batch(run_id, metrics=metrics, params=params, tags=[RunTag("table", "table1")])
    client.set_terminated(run_id, "FINISHED")
    return run_id


@pytest.fixture
def store(tmp_path):
    """A records directory."""
    return tmp_path / "records"


def log_run(directory, params, metrics, table="table1", scale="smoke", status="FINISHED", device=CPU, start=None,
            world_size=None):
    """Write a record as `records add` would; returns its run id."""
    run_id = uuid.uuid4().hex
    tags = {"table": table, "scale": scale, "device": device, "sparse_backend": "reference", "git_commit": "abc",
            "world_size": world_size}
    records.save({
        "run_id": run_id, "run_name": "", "status": status, "start_time": f"2026-01-01T00:00:{(start or 0) % 60:02d}",
        "end_time": "", "params": params, "metrics": metrics, "tags": {k: v for k, v in tags.items() if v},
        "source": "mlflow",
    }, directory)  # fmt: skip
    return run_id


# ---------------------------------------------------------------------------------------------------- export


def test_export_ignores_failed_running_and_killed_runs(store, tmp_path):
    params = params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256)
    log_run(store, params, metrics_of(41.0))
    log_run(store, params, metrics_of(99.0), status="FAILED")
    log_run(store, params, metrics_of(98.0), status="RUNNING")
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "dense"), metrics_of(12.0), status="KILLED")
    rows = export(tmp_path / "runs.csv", store)
    assert len(rows) == 1
    (row,) = read_runs_csv(tmp_path / "runs.csv")
    assert (row["dataset"], row["setup"], row["runs"]) == ("Smoke-Amazon-670K", "uniform", "1")
    assert float(row["test_p1"]) == 41.0


def test_export_takes_the_latest_run_per_seed_then_mean_and_spread_over_seeds(store, tmp_path):
    params = {seed: params_of(BIBTEX, "uniform", 32, 256, seed=seed) for seed in (0, 1, 2)}
    log_run(store, params[0], metrics_of(10.0), start=10)
    log_run(store, params[0], metrics_of(30.0), start=30)  # rerun of seed 0: replaces the first
    log_run(store, params[1], metrics_of(50.0), start=20)
    log_run(store, params[2], metrics_of(40.0, memory=1.25), start=25)
    (row,) = export(tmp_path / "runs.csv", store)
    values = [30.0, 50.0, 40.0]
    mean = sum(values) / 3
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    assert row["seeds"] == "0;1;2" and row["runs"] == "3"
    assert float(row["test_p1"]) == pytest.approx(mean) and float(row["test_p1_std"]) == pytest.approx(spread, rel=1e-5)
    assert float(row["memory_gib"]) == 1.25 and row["memory_gib_std"] == ""  # measured by one seed only
    assert row["device"] == CPU and len(row["run_ids"].split(";")) == 3


def test_a_head_of_ones_own_is_a_configuration_per_setting_of_its_own(store, tmp_path):
    """README's LowRankHead at rank 16 and 32 were one configuration: seeds of one model, or one's rerun replacing
    the other's."""
    def lowrank(rank, seed):
        return {**params_of(BIBTEX, "lowrank", 32, 128, seed=seed), "model/rank": str(rank), "model/init": "authors"}

    log_run(store, lowrank(16, 0), metrics_of(10.0), table="table4")
    log_run(store, lowrank(32, 1), metrics_of(30.0), table="table4")
    log_run(store, lowrank(32, 0), metrics_of(20.0), table="table4", start=5)
    rows = export(tmp_path / "runs.csv", store)
    assert {(r["setup"], r["connectivity"], r["seeds"], r["test_p1"]) for r in rows} == {
        ("lowrank rank=16", "", "0", "10"), ("lowrank rank=32", "", "0;1", "25")}
    assert "Bibtex bow: lowrank rank=32 + 128 (seeds 0,1)" in markdown("table4", [(
        "smoke", table_rows("table4", "smoke", read_runs_csv(tmp_path / "runs.csv"), [], paper.load()))])


def test_heads_of_ones_own_of_one_name_with_other_classes_are_other_configurations(store, tmp_path):
    """Two head files of one's own named `lowrank` (--config-dir) building other classes: their runs were averaged as
    seeds of one configuration (the class was no param). Records without it (committed ones) group as before, and
    this project's heads, whose names fix their classes, are named as before."""
    from omegaconf import OmegaConf

    from xmc_repro.tracking import run_params

    head = {"head": "lowrank", "_target_": "mypackage.heads.LowRankHead", "rank": 16}
    params = run_params(OmegaConf.create({"model": head, "loss": {"_target_": "f", "_partial_": True, "name": "x"}}))
    assert params["model/_target_"] == "mypackage.heads.LowRankHead" and params["model/rank"] == "16"

    def run(head, target, seed, p1):
        extra = {"model/_target_": target} if target else {}
        log_run(store, {**params_of(BIBTEX, head, 32, 128, seed=seed), "model/rank": "16", **extra}, metrics_of(p1))

    run("lowrank", None, 0, 10.0)  # records from before the param
    run("lowrank", None, 1, 20.0)
    run("lowrank", "mypackage.heads.LowRankHead", 0, 30.0)
    run("lowrank", "theirs.heads.LowRankHead", 0, 40.0)
    run("uniform", None, 0, 50.0)
    run("uniform", "xmc_repro.sparse.UniformSparseLinear", 1, 60.0)
    rows = export(tmp_path / "runs.csv", store)
    assert {(r["setup"], r["seeds"], r["test_p1"]) for r in rows} == {
        ("lowrank rank=16", "0;1", "15"), ("lowrank _target_=mypackage.heads.LowRankHead rank=16", "0", "30"),
        ("lowrank _target_=theirs.heads.LowRankHead rank=16", "0", "40"), ("uniform", "0;1", "55")}


def test_a_loss_of_ones_own_is_a_configuration_per_setting_of_its_own(store, tmp_path):
    """A sweep `loss=margin_hinge loss.margin=1.0,2.0` was one configuration: the later run replaced the other as its
    rerun. The built-in losses have no settings of their own (old records also carry loss/_target_, _partial_)."""
    def margin(value, seed=0):
        return {**params_of(BIBTEX, "uniform", 32, 128, loss="margin_hinge", seed=seed), "loss/margin": value}

    log_run(store, margin("1.0"), metrics_of(10.0), table="mine", start=1)
    log_run(store, margin("2.0"), metrics_of(30.0), table="mine", start=2)
    log_run(store, {**params_of(BIBTEX, "uniform", 32, 128), "loss/_target_": "xmc_repro.losses.squared_hinge_loss",
                    "loss/_partial_": "True"}, metrics_of(20.0), table="mine")
    rows = export(tmp_path / "runs.csv", store)
    assert {(r["loss"], r["test_p1"]) for r in rows} == {
        ("margin_hinge margin=1.0", "10"), ("margin_hinge margin=2.0", "30"), ("squared_hinge", "20")}


def test_losses_of_one_name_with_other_functions_are_other_configurations(store, tmp_path):
    """A loss file of one's own (--config-dir) named `squared_hinge`, or two named `hinge`, with other `_target_`s:
    their runs were averaged as seeds of one configuration (the function was no param). Records without it (committed
    ones) and those of the project's own function group as before."""
    from omegaconf import OmegaConf

    from xmc_repro.tracking import run_params

    loss = {"_target_": "mypackage.losses.hinge", "_partial_": True, "name": "hinge"}
    params = run_params(OmegaConf.create({"model": {"head": "dense", "_target_": "torch.nn.Linear"}, "loss": loss}))
    assert params["loss/_target_"] == "mypackage.losses.hinge"
    assert "loss/_partial_" not in params

    def run(name, target, seed, p1):
        extra = {"loss/_target_": target} if target else {}
        log_run(store, {**params_of(BIBTEX, "uniform", 32, 128, loss=name, seed=seed), **extra}, metrics_of(p1))

    run("squared_hinge", None, 0, 10.0)  # a record from before the param
    run("squared_hinge", "xmc_repro.losses.squared_hinge_loss", 1, 20.0)
    run("squared_hinge", "mypackage.losses.other_hinge", 0, 30.0)
    run("hinge", "mypackage.losses.hinge", 0, 40.0)
    run("hinge", "theirs.losses.hinge", 0, 50.0)
    run("hinge", None, 0, 60.0)
    rows = export(tmp_path / "runs.csv", store)
    assert {(r["loss"], r["seeds"], r["test_p1"]) for r in rows} == {
        ("squared_hinge", "0;1", "15"), ("squared_hinge _target_=mypackage.losses.other_hinge", "0", "30"),
        ("hinge _target_=mypackage.losses.hinge", "0", "40"), ("hinge _target_=theirs.losses.hinge", "0", "50"),
        ("hinge", "0", "60")}


def test_a_loss_file_of_ones_own_in_conf_loss_is_not_taken_for_one_of_the_projects(tmp_path):
    """The project's losses were every file in conf/loss, where the README puts a loss of one's own: its runs lost
    their function in the `loss` column, a second file of an existing name made the mark depend on which file was
    read last, and a file without `name` failed every report command as it imported. Only bce and squared_hinge are
    the project's, as conf/loss/bce.yaml and squared_hinge.yaml say."""
    import subprocess
    import sys

    import yaml

    from xmc_repro.report.identity import PROJECT_LOSSES
    from xmc_repro.resources import resource_dir

    loss_dir = resource_dir("conf") / "loss"
    assert PROJECT_LOSSES == {name: yaml.safe_load((loss_dir / f"{name}.yaml").read_text())["_target_"]
                              for name in ("bce", "squared_hinge")}
    conf = tmp_path / "conf"
    shutil.copytree(resource_dir("conf"), conf)
    (conf / "loss" / "margin_hinge.yaml").write_text(
        "_target_: mypackage.losses.margin_hinge\n_partial_: true\nname: margin_hinge\nmargin: 2.0\n")
    (conf / "loss" / "draft.yaml").write_text("_target_: mypackage.losses.draft\n")  # no name yet
    code = (f"import xmc_repro.resources as r; r.resource_dir = lambda name: r.Path({str(conf)!r}); "
            "from xmc_repro.report.identity import configuration; "
            "print(configuration({'model/head': 'uniform', 'loss/name': 'margin_hinge', "
            "'loss/_target_': 'mypackage.losses.margin_hinge', 'loss/margin': '2.0'}, {})['loss'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "margin_hinge _target_=mypackage.losses.margin_hinge margin=2.0"


def test_export_keeps_configurations_tables_and_scales_apart_and_skips_untagged_runs(store, tmp_path):
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(40.0))
    log_run(store, params_of(BIBTEX, "uniform", 64, 256), metrics_of(42.0))
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(43.0), table="table4")
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(44.0), scale="paper")
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(45.0), table=None)  # an ad-hoc run
    # a dense run's leftover connectivity does not make it another configuration
    log_run(store, params_of(BIBTEX, "dense", 32), metrics_of(20.0), start=10)
    log_run(store, params_of(BIBTEX, "dense", None), metrics_of(21.0), start=20)
    rows = export(tmp_path / "runs.csv", store)
    found = {(r["table"], r["scale"], r["setup"], r["connectivity"]): float(r["test_p1"]) for r in rows}
    assert found == {
        ("table1", "smoke", "uniform", "32"): 40.0,
        ("table1", "smoke", "uniform", "64"): 42.0,
        ("table4", "smoke", "uniform", "32"): 43.0,
        ("table1", "paper", "uniform", "32"): 44.0,
        ("table1", "smoke", "dense", ""): 21.0,
    }


def test_runs_that_change_a_training_setting_are_their_own_rows_not_seeds_or_reruns(store, tmp_path):
    base = {**params_of(BIBTEX, "uniform", 32), "model/init": "authors"}
    log_run(store, base, metrics_of(20.0), table="differences", start=10)
    log_run(store, {**base, "seed": "1"}, metrics_of(18.0), table="differences", start=11)
    log_run(store, {**base, "model/init": "fan_in"}, metrics_of(17.0), table="differences", start=12)
    log_run(store, {**base, "trainer/lr": "0.002", "seed": "1"}, metrics_of(15.0), table="differences", start=13)
    # a paper table runs the defaults: a run with another setting is a rerun after the defaults changed
    log_run(store, params_of(BIBTEX, "uniform", 32), metrics_of(40.0), start=20)
    log_run(store, {**base, "dataset/num_labels": "700", "trainer/lr": "0.002"}, metrics_of(41.0), start=21)
    rows = export(tmp_path / "runs.csv", store)
    found = {(r["table"], r["settings"]): (r["seeds"], float(r["test_p1"])) for r in rows}
    assert found == {
        ("differences", "init=authors; lr=0.001"): ("0;1", 19.0),
        ("differences", "init=fan_in; lr=0.001"): ("0", 17.0),
        ("differences", "init=authors; lr=0.002"): ("1", 15.0),
        ("table1", ""): ("0", 41.0),
    }
    assert read_runs_csv(tmp_path / "runs.csv")[0]["settings"] == "init=authors; lr=0.001"


def test_a_paper_table_rerun_at_other_settings_replaces_the_seeds_of_the_older_settings_too(store, tmp_path):
    """`experiment=table5 scale=smoke trainer.max_epochs=1` after the preset's seeds 1 and 2: the row read
    "seeds 0,1,2", mean ± spread over a 1-epoch run and 2-epoch runs. Runs that predate a setting differ from none."""
    preset = {**params_of(BIBTEX, "uniform", 32), "trainer/max_epochs": "2"}
    log_run(store, preset, metrics_of(20.0), start=10)
    log_run(store, {**preset, "seed": "1"}, metrics_of(22.0), start=11)
    log_run(store, {**preset, "seed": "2"}, metrics_of(24.0), start=12)
    log_run(store, {**preset, "trainer/max_epochs": "1"}, metrics_of(1.0), start=13)  # replaces seed 0, and 1, 2
    other = params_of(BIBTEX, "uniform", 64)  # seed 0 predates trainer.max_epochs: a seed of the later runs
    log_run(store, other, metrics_of(30.0), start=20)
    log_run(store, {**other, "trainer/max_epochs": "2", "seed": "1"}, metrics_of(32.0), start=21)
    rows = export(tmp_path / "runs.csv", store)
    assert {(r["connectivity"], r["settings"]): (r["seeds"], float(r["test_p1"])) for r in rows} == {
        ("32", ""): ("0", 1.0), ("64", ""): ("0;1", 31.0)}


def test_a_seed_rerun_back_at_the_older_settings_keeps_the_other_seeds_runs_at_those_settings(store, tmp_path):
    """Seeds 0-2 at 2 epochs, all rerun at 1 epoch, then seed 0 again at 2: the 2-epoch settings are the latest and
    win, with every seed's 2-epoch run. Seeds 1 and 2 vanished (their latest run, at 1 epoch, hid the older one)."""
    preset = {**params_of(BIBTEX, "uniform", 32), "trainer/max_epochs": "2"}
    for seed, start in ((0, 10), (1, 11), (2, 12)):
        log_run(store, {**preset, "seed": str(seed)}, metrics_of(20.0 + 2 * seed), start=start)
    for seed, start in ((0, 13), (1, 14), (2, 15)):
        log_run(store, {**preset, "trainer/max_epochs": "1", "seed": str(seed)}, metrics_of(1.0), start=start)
    log_run(store, preset, metrics_of(26.0), start=16)  # seed 0 back at 2 epochs
    (row,) = export(tmp_path / "runs.csv", store)
    assert (row["seeds"], float(row["test_p1"])) == ("0;1;2", 24.0)  # 26, 22, 24


def test_a_run_that_predates_a_setting_shows_the_value_it_trained_with_or_unknown(store, tmp_path):
    base = {**params_of(BIBTEX, "uniform", 32), "model/init": "authors", "trainer/adam_eps_placement": "keras"}
    older = {k: v for k, v in base.items() if k != "trainer/adam_eps_placement"}  # it trained with torch's Adam
    log_run(store, older, metrics_of(10.0), table="differences", start=10)
    log_run(store, {**base, "seed": "1"}, metrics_of(20.0), table="differences", start=11)
    log_run(store, {**base, "trainer/adam_eps_placement": "torch", "seed": "1"}, metrics_of(30.0),
            table="differences", start=12)
    # no value is known for a run before `model.init` existed
    other = params_of(BIBTEX, "uniform", 64)
    for start, init in ((13, None), (14, "authors"), (15, "fan_in")):
        log_run(store, {**other, "model/init": init} if init else other, metrics_of(start), table="differences",
                start=start)
    rows = export(tmp_path / "runs.csv", store)
    assert {(r["connectivity"], r["settings"]): (r["seeds"], float(r["test_p1"])) for r in rows} == {
        ("32", "adam_eps_placement=torch"): ("0;1", 20.0),
        ("32", "adam_eps_placement=keras"): ("1", 20.0),
        ("64", "init=?"): ("0", 13.0),
        ("64", "init=authors"): ("0", 14.0),
        ("64", "init=fan_in"): ("0", 15.0),
    }


def test_a_run_without_early_stopping_is_not_a_seed_of_runs_with_it(store, tmp_path):
    """~callbacks.early_stop trains every epoch: such a run was averaged with the default runs of its configuration
    (the callbacks were no params). Runs from before they were differ from none."""
    older = {**params_of(BIBTEX, "uniform", 32), "model/init": "authors"}
    default = {**older, "callbacks": "rewiring,memory,time,early_stop,best,last", "callbacks/best/monitor": "val/p_at_3"}
    log_run(store, older, metrics_of(10.0), table="differences", start=10)
    log_run(store, {**default, "seed": "1"}, metrics_of(20.0), table="differences", start=11)
    log_run(store, {**default, "callbacks": "rewiring,memory,time,best,last", "seed": "2"}, metrics_of(30.0),
            table="differences", start=12)
    rows = export(tmp_path / "runs.csv", store)
    assert {r["settings"]: (r["seeds"], float(r["test_p1"])) for r in rows} == {
        "callbacks=?": ("0", 10.0),
        "callbacks=rewiring,memory,time,early_stop,best,last": ("1", 20.0),
        "callbacks=rewiring,memory,time,best,last": ("2", 30.0),
    }


def test_a_setting_logged_as_null_is_a_value_not_an_unknown(store, tmp_path):
    """`trainer.shuffle_buffer=null` (a row of the README's differences) and `trainer.limit_train_batches=2` beside
    its default null: the logged "None" counted as "not known" and the runs as one configuration, the later
    replacing the other as its rerun."""
    base = {**params_of(BIBTEX, "uniform", 32), "trainer/shuffle_buffer": "50000",
            "trainer/limit_train_batches": "None"}
    log_run(store, base, metrics_of(10.0), table="differences", start=10)
    log_run(store, {**base, "trainer/shuffle_buffer": "None"}, metrics_of(20.0), table="differences", start=11)
    log_run(store, {**base, "trainer/limit_train_batches": "2"}, metrics_of(30.0), table="differences", start=12)
    rows = export(tmp_path / "runs.csv", store)
    assert {r["settings"]: (r["seeds"], float(r["test_p1"])) for r in rows} == {
        "shuffle_buffer=50000; limit_train_batches=null": ("0", 10.0),
        "shuffle_buffer=null; limit_train_batches=null": ("0", 20.0),
        "shuffle_buffer=50000; limit_train_batches=2": ("0", 30.0),
    }


def test_runs_from_before_a_setting_are_not_seeds_or_reruns_of_later_runs_with_its_default(store, tmp_path):
    # After an upgrade: runs from before trainer.adam_eps_placement (torch's Adam) and the unstructured head's
    # distinct_sources (distinct positions), then the same configurations with the new defaults (keras, False)
    old = {**params_of(BIBTEX, "uniform", 32), "model/init": "authors"}
    new = {**old, "trainer/adam_eps_placement": "keras"}
    log_run(store, old, metrics_of(10.0), table="differences", start=10)
    log_run(store, {**old, "seed": "1"}, metrics_of(12.0), table="differences", start=11)
    log_run(store, new, metrics_of(30.0), table="differences", start=12)
    old_un = params_of(BIBTEX, "unstructured", 32)
    log_run(store, old_un, metrics_of(20.0), table="differences", start=13)
    log_run(store, {**old_un, "model/distinct_sources": "False", "seed": "1"}, metrics_of(40.0), table="differences",
            start=14)
    rows = export(tmp_path / "runs.csv", store)
    assert {(r["setup"], r["settings"]): (r["seeds"], float(r["test_p1"])) for r in rows} == {
        ("uniform", "adam_eps_placement=torch"): ("0;1", 11.0),  # not replaced by the keras seed 0, nor averaged
        ("uniform", "adam_eps_placement=keras"): ("0", 30.0),
        ("unstructured", "distinct_sources=True"): ("0", 20.0),
        ("unstructured", "distinct_sources=False"): ("1", 40.0),
    }


def test_a_row_at_todays_defaults_beside_older_runs_is_its_architectures_point_in_the_figures():
    """Beside runs from before a setting a row names that setting at its default now: still a default run."""
    from omegaconf import OmegaConf

    from xmc_repro.report.identity import at_defaults
    from xmc_repro.resources import resource_dir
    from xmc_repro.validation import DEFAULT_SINCE_THE_SETTING

    trainer = OmegaConf.load(resource_dir("conf") / "trainer" / "default.yaml")
    assert {key: trainer[key] for key in DEFAULT_SINCE_THE_SETTING} == DEFAULT_SINCE_THE_SETTING
    assert at_defaults("") and at_defaults("adam_eps_placement=keras; restore_best=early_stop")
    assert not at_defaults("adam_eps_placement=torch") and not at_defaults("adam_eps_placement=keras; init=fan_in")


def test_params_logged_under_dotted_hydra_keys_read_the_same(store, tmp_path):
    dotted = {key.replace("/", "."): value for key, value in params_of(BIBTEX, "uniform", 32, 256).items()}
    log_run(store, dotted, metrics_of(40.0))
    (row,) = export(tmp_path / "runs.csv", store)
    assert (row["dataset"], row["setup"], row["connectivity"], row["intermediate"]) == ("Bibtex", "uniform", "32", "256")


def test_one_configuration_on_two_machines_gives_two_rows_side_by_side(store, tmp_path, published):
    params = params_of(SMOKE_AMAZON_CASCADE, "uniform", 32, 256)
    log_run(store, params, metrics_of(40.0))
    log_run(store, params, metrics_of(41.0, memory=0.05), device="NVIDIA H100 80GB HBM3")
    runs = export(tmp_path / "runs.csv", store)
    assert {r["device"] for r in runs} == {CPU, "NVIDIA H100 80GB HBM3"}
    rows = table_rows("table1", "smoke", runs, [config_of(SMOKE_AMAZON_CASCADE, "uniform", 32, 256)], published)
    measured = [r for r in rows if r["status"] == "measured"]
    assert {(r["card"], r["ours_memory_gib"]) for r in measured} == {(CPU, ""), ("NVIDIA H100 80GB HBM3", "0.05")}
    assert {(r["dataset"], r["features"], r["setup"], r["intermediate"]) for r in measured} == {
        ("Amazon-670K", "cascade", "uniform", "32768")}  # fmt: skip


def test_broken_record_files_are_refused_with_the_file_named(store, tmp_path):
    log_run(store, params_of(BIBTEX, "dense"), metrics_of(40.0))
    (store / "0123.json").write_text("{not json")
    with pytest.raises(records.DataError, match=r"0123.json: not valid JSON"):
        records.load(store)
    (store / "0123.json").write_text(json.dumps({"run_id": "0123"}))
    with pytest.raises(records.DataError, match=r"0123.json: not a run record"):
        records.load(store)


# ---------------------------------------------------------------------------------------------------- MLflow store


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory):
    """An initialised sqlite store (creating its schema takes seconds), copied for every test."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("store") / "mlruns.db"
    MlflowClient(f"sqlite:///{path}").create_experiment("xmc_repro")
    return path


def copied_store(empty_store, tmp_path):
    """A copy of `empty_store` at tmp_path/gpu.db: (its URI, an MLflow client of it)."""
    from mlflow.tracking import MlflowClient

    shutil.copy(empty_store, tmp_path / "gpu.db")
    uri = f"sqlite:///{tmp_path / 'gpu.db'}"
    return uri, MlflowClient(uri)


def test_records_add_copies_finished_table_runs_of_a_store_once_and_round_trips(tmp_path, empty_store, capsys):
    from mlflow.entities import Metric, Param, RunTag

    uri, client = copied_store(empty_store, tmp_path)
    experiment = client.get_experiment_by_name("xmc_repro").experiment_id
    ids = {}
    for name, status, table in (("ok", "FINISHED", "table1"), ("failed", "FAILED", "table1"),
                                ("untagged", "FINISHED", None)):  # fmt: skip
        run_id = client.create_run(experiment, run_name=name).info.run_id
        tags = {"table": table, "scale": "smoke", "device": H200, "mlflow.user": "someone",
                "git_commit": "0123456789ab-dirty"}  # run with uncommitted changes: counted and named
        client.log_batch(run_id, metrics=[*logged_scores(50.5), Metric("peak_gpu_memory_gib", 0.01, 0, 0)],
                         params=[Param(k, v) for k, v in params_of(BIBTEX, "uniform", 32, 256).items()],
                         tags=[RunTag(k, v) for k, v in tags.items() if v])  # fmt: skip
        client.set_terminated(run_id, status)
        ids[name] = run_id
    directory = tmp_path / "records"
    left_out = {"FAILED": 1, "untagged": 1}
    assert records.add_from_store(uri, directory) == {"new": 1, "updated": 0, "unchanged": 0, "skipped": left_out,
                                                      "uncommitted": 1, "unusable": []}
    assert records.add_from_store(uri, directory) == {"new": 0, "updated": 0, "unchanged": 1, "skipped": left_out,
                                                      "uncommitted": 1, "unusable": []}
    from xmc_repro.report.__main__ import main as report_main

    assert report_main(["records", "add", uri, "--dir", str(directory)]) == 0
    assert capsys.readouterr().out.strip().endswith(
        "left out 2 runs: 1 FAILED, 1 without a `table` tag; 1 copied run(s) ran uncommitted code (git_commit ends "
        "in -dirty): no commit reproduces them; rerun them from a clean checkout before citing their numbers")
    (record,) = records.load(directory)
    run = client.get_run(ids["ok"])
    assert record["run_id"] == ids["ok"] and record["run_name"] == "ok" and record["status"] == "FINISHED"
    assert record["params"] == run.data.params and record["metrics"] == run.data.metrics
    assert record["tags"] == {"table": "table1", "scale": "smoke", "device": H200,  # MLflow's own tags left out
                              "git_commit": "0123456789ab-dirty"}
    assert record["end_time"] == records.iso_time(run.info.end_time) != ""
    text = (directory / f"{ids['ok']}.json").read_text()
    assert text == records.dump(json.loads(text)) and text.index('"metrics"') < text.index('"params"')  # sorted keys
    with pytest.raises(records.DataError, match="no such MLflow store"):
        records.add_from_store(f"sqlite:///{tmp_path / 'typo.db'}", directory)


def test_a_runs_csv_migrates_into_records_that_export_it_back_unchanged(store, tmp_path):
    from xmc_repro.report.migrate import migrate

    for seed, p1 in ((0, 30.0), (1, 32.0)):
        log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256, seed=seed), metrics_of(p1, memory=0.5),
                device=H200)  # fmt: skip
    log_run(store, params_of(BIBTEX, "dense"), metrics_of(60.0))
    export(tmp_path / "old.csv", store)
    counts = migrate(tmp_path / "old.csv", records.PROJECT_ROOT / "conf", tmp_path / "migrated", origin="old.csv")
    assert counts == {"new": 2, "updated": 0, "unchanged": 0}
    export(tmp_path / "new.csv", tmp_path / "migrated")
    old, new = read_runs_csv(tmp_path / "old.csv"), read_runs_csv(tmp_path / "new.csv")
    keep = [c for c in old[0] if c not in ("sources", "state_mib")]  # columns an older runs.csv did not have
    assert [[r[c] for c in keep] for r in new] == [[r[c] for c in keep] for r in old]
    averaged = next(r for r in records.load(tmp_path / "migrated") if "aggregate" in r)
    assert averaged["aggregate"]["seeds"] == ["0", "1"] and "not one run's values" in averaged["aggregate"]["note"]
    assert averaged["source"] == "migrated from old.csv"


@pytest.mark.parametrize("column, value, problem", [
    ("test_p1", "", "metric test/p_at_1 is missing: a finished table run has its test scores"),
    ("test_p3", "nan", "metric test/p_at_3 is nan, not a finite number"),
    ("dataset", "", "param dataset/name is null: it names the run's configuration"),
    ("run_ids", "", "no run id in column run_ids: a record is its run's"),
])  # fmt: skip
def test_a_malformed_runs_csv_row_stops_the_migration_before_any_record(store, tmp_path, column, value, problem):
    """Migrated records were saved unchecked: a row without its test P@1 became a record that `records add` would
    have refused, and the export then failed on it (or a NaN went into runs.csv)."""
    from xmc_repro.report.migrate import migrate

    log_run(store, params_of(BIBTEX, "dense"), metrics_of(60.0))
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), metrics_of(30.0))
    rows = export(tmp_path / "old.csv", store)
    rows[1][column] = value
    write_runs_csv(rows, tmp_path / "old.csv")
    with pytest.raises(records.DataError, match=re.escape(
            f"{tmp_path / 'old.csv'}:3: {problem}; fix or remove that row, then migrate again")):  # fmt: skip
        migrate(tmp_path / "old.csv", records.PROJECT_ROOT / "conf", tmp_path / "migrated")
    assert not (tmp_path / "migrated").exists()  # not even the sound first row


def test_a_runs_csv_without_a_column_or_with_a_short_row_is_refused_in_one_line(store, tmp_path):
    from xmc_repro.report.migrate import migrate

    log_run(store, params_of(BIBTEX, "dense"), metrics_of(60.0))
    export(tmp_path / "old.csv", store)
    lines = (tmp_path / "old.csv").read_text().splitlines()
    header = lines[0].split(",")
    short = tmp_path / "short.csv"
    short.write_text("\n".join([lines[0], ",".join(lines[1].split(",")[:5])]) + "\n")
    with pytest.raises(records.DataError, match=re.escape(
            f"{short}:2: 5 fields against the header's {len(header)}; fix or remove that row")):  # fmt: skip
        migrate(short, records.PROJECT_ROOT / "conf", tmp_path / "migrated")
    narrow = tmp_path / "narrow.csv"
    keep = [i for i, name in enumerate(header) if name != "seeds"]
    narrow.write_text("".join(",".join(line.split(",")[i] for i in keep) + "\n" for line in lines[:2]))
    with pytest.raises(records.DataError, match=re.escape(f"{narrow}: no column seeds; give a runs.csv written by")):
        migrate(narrow, records.PROJECT_ROOT / "conf", tmp_path / "migrated")
    assert not (tmp_path / "migrated").exists()


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


def test_lightnings_short_precision_names_are_the_same_configuration():
    """`trainer.precision=bf16` trains as bf16-mixed (Lightning's short names), but was a configuration of its own:
    a row `bf16` beside `bf16-mixed`, never averaged with it as seeds; `32` was already read as float32."""
    def precision(value):
        return configuration({**params_of(BIBTEX, "uniform", 32), "trainer/precision": value}, {})["precision"]

    assert [precision(v) for v in ("bf16", "16", "64", "32")] == ["bf16-mixed", "16-mixed", "64-true", ""]
    assert precision("bf16-mixed") == "bf16-mixed"

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
    runs = export(tmp_path / "runs.csv", store)
    rows = table_rows("table1", "smoke", runs, [measured, never_run, extra], published)

    by_name = {(r["dataset"], r["features"], r["setup"], r["connectivity"], r["intermediate"]): r for r in rows}
    ours = by_name[("Amazon-670K", "slice", "uniform", "32", "32768")]
    expected = published_row(published, "table1_architecture", *AMAZON_SLICE, "uniform", "32", "32768", "squared_hinge")
    assert ours["status"] == "measured" and ours["published_source"] == "paper"
    assert ours["published_test_p1"] == expected["test_p1"] == "32.8"
    assert float(ours["ours_test_p1"]) == 30.5 and ours["diff_test_p1"] == ""  # a stand-in: no Δ to the paper
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
    assert (bibtex["dataset"], bibtex["features"], bibtex["intermediate"]) == (*BIBTEX, "256")  # its own width
    assert bibtex["published_source"] == "" and float(bibtex["ours_test_p1"]) == 60


def test_differences_to_the_paper_only_on_its_datasets_ratios_to_dense_elsewhere(store, tmp_path, published):
    log_run(store, params_of(AMAZON_SLICE, "uniform", 32, 32768), metrics_of(30.5, 25.0, 20.0), scale="paper")
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), metrics_of(15.0, 9.0, 6.0))
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "dense"), metrics_of(20.0, 10.0, 8.0), table="table4")
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "dense"), metrics_of(40.0), device=H200)  # another machine
    log_run(store, params_of(BIBTEX, "uniform", 32, 256), metrics_of(55.0))
    log_run(store, params_of(BIBTEX, "dense"), metrics_of(50.0))
    runs = export(tmp_path / "runs.csv", store)

    (real,) = [r for r in table_rows("table1", "paper", runs, [], published) if r["status"] == "measured"]
    assert real["paper_data"] == "yes" and float(real["diff_test_p1"]) == pytest.approx(30.5 - 32.8)
    assert real["ours_p1_vs_dense"] == real["published_p1_vs_dense"] == ""

    settings = shared_settings(records.load(store))
    rows = {r["our_dataset"]: r for r in table_rows("table1", "smoke", runs, [], published, settings=settings)
            if r["setup"] == "uniform"}  # fmt: skip
    stand_in, bibtex = rows["Smoke-Amazon-670K slice"], rows["Bibtex bow"]
    assert stand_in["paper_data"] == "no" and stand_in["diff_test_p1"] == ""
    # ours: P@k ÷ our dense on the same data and machine (found in table 4); paper: 32.8 / 33.8 (Amazon-670K slice)
    assert [float(stand_in[f"ours_p{k}_vs_dense"]) for k in (1, 3, 5)] == [0.75, 0.9, 0.75]
    assert float(stand_in["published_p1_vs_dense"]) == pytest.approx(32.8 / 33.8, abs=1e-5)
    assert float(bibtex["ours_p1_vs_dense"]) == pytest.approx(1.1)
    # Bibtex is none of the paper's datasets: the range over them for uniform 32 with an intermediate layer
    paper_ratios = [32.8 / 33.8, 42.6 / 47.5, 86.6 / 87.3, 58.9 / 58.2, 73.6 / 77.1]
    low, high = bibtex["published_p1_vs_dense"].split("..")
    assert (float(low), float(high)) == pytest.approx((min(paper_ratios), max(paper_ratios)), abs=1e-5)
    text = markdown("table1", [("smoke", list(rows.values()))])
    assert "| 0.75 / 0.97 | 0.90 / 0.97 |" in text and "| 1.10 / 0.90–1.01 |" in text


def test_the_ratio_to_dense_takes_only_a_dense_run_at_the_rows_settings(store, tmp_path, published):
    """The dense reference came from any table's dense run on the same data and card, whatever it trained with: a
    1-epoch or bf16-mixed dense run divided a 2-epoch float32 row. Settings of the head's own (rewiring) aside."""
    two_epochs = {"trainer/max_epochs": "2", "trainer/batch_size": "256"}
    log_run(store, {**params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), **two_epochs}, metrics_of(15.0))
    log_run(store, {**params_of(SMOKE_AMAZON_SLICE, "dense"), **two_epochs, "trainer/max_epochs": "1",
                    "model/rewire_fraction": "0.0"}, metrics_of(20.0), table="table4")  # fmt: skip
    log_run(store, {**params_of(SMOKE_AMAZON_SLICE, "dense"), **two_epochs, "trainer/precision": "bf16-mixed"},
            metrics_of(30.0), table="table2")
    log_run(store, {**params_of(BIBTEX, "uniform", 32, 256), **two_epochs}, metrics_of(55.0))
    log_run(store, {**params_of(BIBTEX, "dense"), **two_epochs, "model/rewire_fraction": "0.0"}, metrics_of(20.0),
            table="table4")  # another table, the same settings but the head's own
    log_run(store, {**params_of(BIBTEX, "dense"), "trainer/batch_size": "64"}, metrics_of(50.0))
    runs = export(tmp_path / "runs.csv", store)
    settings = shared_settings(records.load(store))
    rows = {r["our_dataset"]: r for r in table_rows("table1", "smoke", runs, [], published, settings=settings)
            if r["status"] == "measured"}  # fmt: skip
    stand_in, bibtex = rows["Smoke-Amazon-670K slice"], rows["Bibtex bow"]
    assert stand_in["ours_p1_vs_dense"] == stand_in["dense_run_ids"] == ""  # no dense run at 2 epochs in float32
    assert float(bibtex["ours_p1_vs_dense"]) == 2.75  # the table 4 dense run, not table 1's at batch size 64
    text = markdown("table1", [("smoke", list(rows.values()))])
    assert "| —ᵇ / 0.97 |" in text and "| 2.75 / 0.90–1.01 |" in text
    assert "- ᵇ: no dense run of ours on the same data, scale and card at the row's settings" in text
    assert "ᵇ" not in markdown("table1", [("smoke", [bibtex])])  # said only where it is shown
    # the figures' relative points take the same reference: the stand-in has none
    assert relative_points(runs, settings) == {}


def test_a_dataset_whose_data_was_not_found_is_one_row_saying_so(store, tmp_path, published):
    grid = [config_of(BIBTEX, h, c) for h, c in (("dense", None), ("uniform", 32), ("unstructured", 32))]
    missing = {"Bibtex": "/nowhere/Bibtex"}
    rows = table_rows("table1", "smoke", [], grid, published, missing)
    (row,) = [r for r in rows if r["our_dataset"] == "Bibtex bow"]
    assert row["status"] == "missing" and row["our_setup"] == "missing: data not found at /nowhere/Bibtex"
    log_run(store, params_of(BIBTEX, "dense"), metrics_of(50.0))  # runs recorded elsewhere: shown as usual
    rows = table_rows("table1", "smoke", export(tmp_path / "runs.csv", store), grid, published, missing)
    assert len([r for r in rows if r["our_dataset"] == "Bibtex bow"]) == 3


def test_a_run_outside_the_grid_still_shows_and_the_supplement_fills_published_gaps(store, tmp_path, published):
    # table 1 of the paper has no Wikipedia-500K cascade unstructured row; the authors' supplement has one
    log_run(store, params_of(WIKIPEDIA_CASCADE, "unstructured", 32), metrics_of(63.0, memory=4.5), scale="paper")
    runs = export(tmp_path / "runs.csv", store)
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
    log_run(store, params_of(AMAZON_SLICE, "uniform", 32, 32768, seed=0), metrics_of(30.0), scale="paper")
    log_run(store, params_of(AMAZON_SLICE, "uniform", 32, 32768, seed=1), metrics_of(31.0), scale="paper")
    runs = export(tmp_path / "runs.csv", store)
    blocks = [(s, table_rows("table1", s, runs, [], published)) for s in ("paper", "smoke")]
    text = markdown("table1", blocks)
    line = next(l for l in text.splitlines() if "30.5 ± 0.7" in l)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["Amazon-670K", "slice", "uniform", "32", "32768"]
    assert cells[5:8] == ["32.8", "30.5 ± 0.7", "-2.3"] and CPU in cells
    assert "Amazon-670K slice: uniform 32 + 32768 (seeds 0,1)" in cells
    assert text.count("| missing |") > 40 and "## Scale `smoke`" in text and "## Scale `paper`" in text
    tex = latex("table1", blocks)
    assert r"30.5 $\pm$ 0.7" in tex and "Amazon-670K slice" in tex and tex.count(r"\\") > 44


def test_markdown_counts_a_configuration_run_on_two_cards_once(store, tmp_path, published):
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), metrics_of(30.0))
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), metrics_of(31.0), device=H200)
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "dense"), metrics_of(40.0))
    runs = export(tmp_path / "runs.csv", store)
    rows = table_rows("table1", "smoke", runs, [], published)
    assert sum(r["status"] == "measured" for r in rows) == 3  # one row per configuration and card
    text = markdown("table1", [("smoke", rows)])
    assert "2 configurations measured (3 rows, one per configuration and card)" in text


def test_render_writes_every_table_and_figure_with_our_points(store, tmp_path, published):
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), metrics_of(30.0))
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "dense"), metrics_of(40.0))
    log_run(store, params_of(AMAZON_SLICE, "uniform", 32, 32768), metrics_of(33.0, memory=1.1), scale="paper")
    runs = export(tmp_path / "runs.csv", store)
    rendered = render_tables(runs, published, tmp_path / "tables", expected=lambda table, scale: [])
    for table in ("table1", "table2", "table3", "table4", "table5"):
        for ext in ("md", "tex", "csv"):
            assert (tmp_path / "tables" / f"{table}.{ext}").stat().st_size > 0
        with open(tmp_path / "tables" / f"{table}.csv") as f:
            assert len(list(csv.DictReader(f))) == len(rendered[table])
    names = render_figures(runs, published, tmp_path / "figures", shared_settings(records.load(store)))
    assert names[:5] == [f"relative_{n}.png" for n in ("wiki10_31k", "amazon670k_slice", "amazon670k_cascade",
                                                        "wikipedia500k_slice", "wikipedia500k_cascade")]  # fmt: skip
    assert "state_vs_p1_smoke_amazon_670k_slice_smoke.png" in names
    with open(tmp_path / "figures" / "data" / "amazon670k_slice_ours.csv") as f:
        (point,) = list(csv.DictReader(f))  # the CPU stand-in run, relative to its dense run
    assert float(point["p1_vs_dense"]) == 0.75 and point["card"] == CPU
    # training state at 64 inputs, 670 labels: uniform 32 + 256 against dense, as state.py counts it
    uniform = 12 * (64 * 256 + 256 + 32 * 670 + 670) + 4 * 32 * 670
    assert float(point["memory_vs_dense"]) == pytest.approx(uniform / (12 * (64 * 670 + 670)), rel=1e-3)
    assert (tmp_path / "figures" / "relative_amazon670k_slice.png").read_bytes()[:4] == b"\x89PNG"
    index = (tmp_path / "figures" / "README.md").read_text()
    assert all(f"]({name})" in index for name in names)


def test_a_run_tagged_with_a_table_but_no_scale_shows_alone_in_its_section(store, tmp_path, published):
    """`table=table1` by hand: a section of its own run, not also every paper row as missing (there is no grid)."""
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 256), metrics_of(30.0), scale=None)
    runs = export(tmp_path / "runs.csv", store)
    rendered = render_tables(runs, published, tmp_path / "tables", expected=lambda table, scale: [])
    by_scale = {scale: [r for r in rendered["table1"] if r["scale"] == scale] for scale in ("none", "paper")}
    assert [r["status"] for r in by_scale["none"]] == ["measured"]
    assert len(by_scale["paper"]) > 10 and {r["status"] for r in by_scale["paper"]} <= {"missing", "literature"}


@pytest.mark.parametrize("head,extra", [("dense", {}), ("uniform", {"connectivity": 8}),
                                        ("unstructured", {"connectivity": 8}), ("bottleneck", {"bottleneck": 16}),
                                        ("bottleneck", {"bottleneck": 16, "bottleneck_activation": "linear"}),
                                        ("mach", {"mach": {"num_hashes": 2, "num_buckets": 32}})])  # fmt: skip
@pytest.mark.parametrize("intermediate", [None, 48])
def test_training_state_bytes_match_the_model(head, extra, intermediate):
    import torch

    from xmc_repro.model import XMCClassifier
    from xmc_repro.report.state import model_state_bytes

    model = XMCClassifier(40, 300, head=head, intermediate=intermediate, **extra)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.startswith("head."))
    params = {"dataset/num_features": "40", "dataset/num_labels": "300", "model/head": head,
              "model/intermediate": str(intermediate), "model/connectivity": str(extra.get("connectivity")),
              "model/bottleneck": str(extra.get("bottleneck")),
              "model/bottleneck_activation": extra.get("bottleneck_activation", "relu"),
              **{f"model/mach/{k}": str(v) for k, v in extra.get("mach", {}).items()}}  # fmt: skip
    assert model_state_bytes(params) == 3 * weights + buffers
    assert torch.float32 == next(model.parameters()).dtype


# ---------------------------------------------------------------------------------------------------- claims


def claim_runs(store, out_dir, gpu_bce=True, gpu_gib=1.2, gpu_seconds=None, **changes):
    """Bibtex runs (not smoke scale) for which every claim holds, with `changes` {name: test P@1} applied."""
    gpu_seconds = gpu_seconds or {}
    p1 = {"dense": 60.0, "uniform32": 20.0, "unstructured32": 21.0, "uniform32+1024": 60.5, "unstructured32+1024": 60.0,
          "uniform64+1024": 63.0, "uniform32+2048": 63.0, "uniform32+1024 bce": 59.0, **changes}  # fmt: skip
    for name, value in p1.items():
        model, _, loss = name.partition(" ")
        head = "dense" if model == "dense" else ("uniform" if model.startswith("uniform") else "unstructured")
        connectivity, _, width = model[len(head):].partition("+")
        log_run(store, params_of(BIBTEX, head, connectivity or None, width or None, loss or "squared_hinge"),
                metrics_of(value, train_p1=value + 30, seconds=2.0 if loss else 1.0), table="claims",
                scale="paper")  # fmt: skip
    # memory and time at a full shape on a GPU
    log_run(store, params_of(("Synthetic-Amazon-670K", "synthetic"), "dense"),
            metrics_of(0.1, memory=9.7, seconds=gpu_seconds.get("dense", 6.0)), device=H200, scale="paper")
    log_run(store, params_of(("Synthetic-Amazon-670K", "synthetic"), "uniform", 32, 32768),
            metrics_of(0.1, memory=gpu_gib, seconds=gpu_seconds.get("uniform", 1.5)), device=H200, scale="paper")
    if gpu_bce:  # squared hinge's epoch (1.5 s) shorter than BCE's, on the same GPU
        log_run(store, params_of(("Synthetic-Amazon-670K", "synthetic"), "uniform", 32, 32768, "bce"),
                metrics_of(0.1, memory=1.2, seconds=3.0), device=H200, scale="paper")  # fmt: skip
    return export(out_dir / "runs.csv", store)


def evaluated(runs, store) -> dict:
    """The claims on runs.csv's `runs`, by key, with the settings of the records in `store`."""
    from xmc_repro.report.claims import evaluate

    return {c.key: c for c in evaluate(runs, shared_settings(records.load(store)))}


def test_claims_hold_on_runs_that_show_them(store, tmp_path):
    from xmc_repro.report.claims import write_claims

    verdicts = write_claims(claim_runs(store, tmp_path), tmp_path / "claims.md", shared_settings(records.load(store)))
    assert verdicts == {f"C{i}": "holds" for i in range(1, 9)}
    text = (tmp_path / "claims.md").read_text()
    assert "dense 9.70 GiB, uniform 32 + 32768 intermediate 1.20 GiB: 8.1x less" in text
    assert "uniform 32 + 32768 intermediate 1.5 s, dense 6.0 s per epoch: 4.0x" in text
    assert "run " in text and text.count("## C") == 8


def test_a_ddp_run_is_its_own_row_and_no_one_gpu_run(store, tmp_path):
    """Its time per epoch is that of several GPUs and its memory one rank's: never averaged with a one-GPU run's
    seeds, and not the paper's "one GPU" (C7)."""
    params = params_of(("Synthetic-Amazon-670K", "synthetic"), "uniform", 32, 32768)
    log_run(store, params, metrics_of(0.1, memory=1.2, seconds=3.0), device=H200, scale="paper", world_size="1")
    log_run(store, params, metrics_of(0.1, memory=1.3, seconds=1.6), device=H200, scale="paper", world_size="2")
    runs = export(tmp_path / "runs.csv", store)
    assert sorted((r["device"], r["time_per_epoch_s"]) for r in runs) == [(f"2 x {H200}", "1.6"), (H200, "3")]
    claims = evaluated(runs, store)
    assert claims["C7"].verdict == "holds" and f"2 x {H200}" not in claims["C7"].markdown()
    (store / f"{[r for r in runs if r['device'] == H200][0]['run_ids']}.json").unlink()  # the DDP run alone
    claims = evaluated(export(tmp_path / "runs.csv", store), store)
    assert claims["C7"].verdict != "holds" and "no one-GPU run" in claims["C7"].markdown()


def test_memory_and_epoch_time_claims_pair_runs_at_one_scale_and_the_same_settings(store, tmp_path):
    """C4 and C8 compared a uniform run with every dense run on the same data, card and loss, whatever its scale or
    settings (a dense run at another batch size, or launched without scale=paper). Now only with the dense run the
    tables divide it by (render.dense_reference), and a uniform run without one is said to be not compared."""
    shape, batch = ("Synthetic-Amazon-670K", "synthetic"), {"trainer/batch_size": "256"}
    uniform = log_run(store, {**params_of(shape, "uniform", 32, 32768), **batch},
                      metrics_of(0.1, memory=1.2, seconds=1.5), device=H200, scale="paper")
    log_run(store, {**params_of(shape, "dense"), "trainer/batch_size": "64"}, metrics_of(0.1, memory=9.7, seconds=6.0),
            device=H200, scale="paper")
    log_run(store, {**params_of(shape, "dense"), **batch}, metrics_of(0.1, memory=2.0, seconds=1.0), device=H200,
            scale=None)
    claims = evaluated(export(tmp_path / "runs.csv", store), store)
    assert claims["C4"].verdict == claims["C8"].verdict == "not measured here"
    for key in ("C4", "C8"):
        assert (f"Synthetic-Amazon-670K on {H200}: uniform 32 + 32768 intermediate (run {uniform}), no dense run at "
                "its scale and settings (dense: run ") in claims[key].markdown()
    # a dense run at its scale and settings (in another table, with the dense head's own rewiring) is compared
    log_run(store, {**params_of(shape, "dense"), **batch, "model/rewire_fraction": "0.0"},
            metrics_of(0.1, memory=9.0, seconds=6.0), device=H200, scale="paper", table="table4")
    claims = evaluated(export(tmp_path / "runs.csv", store), store)
    assert claims["C4"].verdict == claims["C8"].verdict == "holds"
    assert claims["C4"].outcomes == claims["C8"].outcomes == [True]
    assert "dense 9.00 GiB, uniform 32 + 32768 intermediate 1.20 GiB: 7.5x less" in claims["C4"].markdown()
    assert "uniform 32 + 32768 intermediate 1.5 s, dense 6.0 s per epoch: 4.0x" in claims["C8"].markdown()


def test_the_papers_4_gb_and_faster_epoch_claims_fail_on_runs_that_contradict_them(store, tmp_path):
    claims = evaluated(claim_runs(store, tmp_path, gpu_gib=4.2, gpu_seconds={"uniform": 7.0}), store)
    assert claims["C7"].verdict == claims["C8"].verdict == "does not hold here"
    assert "uniform 32 + 32768 intermediate 4.20 GiB" in claims["C7"].markdown()


def test_the_loss_claims_epoch_times_pair_runs_at_one_scale_and_the_same_settings(store, tmp_path):
    """C5 compared BCE's epoch with squared hinge's on the same data, model and card, whatever their scale or
    settings: a BCE run at ten times the learning rate decided it."""
    claim_runs(store, tmp_path, gpu_bce=False)
    log_run(store, {**params_of(("Synthetic-Amazon-670K", "synthetic"), "uniform", 32, 32768, "bce"),
                    "trainer/lr": "0.01"}, metrics_of(0.1, memory=1.2, seconds=1.0), device=H200, scale="paper")
    claims = evaluated(export(tmp_path / "runs.csv", store), store)
    assert "time: no GPU runs of both losses" in claims["C5"].markdown()
    log_run(store, params_of(("Synthetic-Amazon-670K", "synthetic"), "uniform", 32, 32768, "bce"),
            metrics_of(0.1, memory=1.2, seconds=3.0), device=H200, scale="paper", table="table4")
    claims = evaluated(export(tmp_path / "runs.csv", store), store)
    assert "1.5 s vs 3.0 s per epoch" in claims["C5"].markdown() and "1.0 s" not in claims["C5"].markdown()


def test_a_stand_in_run_without_the_smoke_scale_tag_is_no_670k_label_run(store, tmp_path):
    """A smoke stand-in (Smoke-Amazon-670K: 3,278 labels) launched without scale=smoke is tagged scale "none"; C7
    and C8 took it for a run at Amazon-670K's shape."""
    from xmc_repro.report.export import export

    runs = claim_runs(store, tmp_path)
    runs = [r for r in runs if not (r["dataset"].startswith("Synthetic") and r["setup"] == "uniform")]
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "uniform", 32, 128), metrics_of(5.0, memory=0.06, seconds=0.1),
            device=H200, scale=None)
    log_run(store, params_of(SMOKE_AMAZON_SLICE, "dense"), metrics_of(20.0, memory=0.07, seconds=0.2), device=H200,
            scale=None)
    stand_in = [r for r in export(tmp_path / "more.csv", store) if r["dataset"].startswith("Smoke")]
    assert {r["scale"] for r in stand_in} == {"none"}
    claims = evaluated(runs + stand_in, store)
    assert claims["C7"].verdict == claims["C8"].verdict == "not measured here"


def test_epoch_times_of_cpu_runs_do_not_decide_a_claim(store, tmp_path):
    """CPU seconds depend on what else shared the cores: without GPU runs of both losses C5 is only half measured."""
    claims = evaluated(claim_runs(store, tmp_path, gpu_bce=False), store)
    assert claims["C5"].verdict == "holds where measured; the rest is not measured here"
    assert "time: no GPU runs of both losses" in claims["C5"].markdown()


def test_uniform_ahead_of_unstructured_does_not_fail_c3(store, tmp_path):
    """C3 says uniform is as good as unstructured: uniform more than a point ahead supports it, as in C2 and C5."""
    claims = evaluated(claim_runs(store, tmp_path, uniform32=25.0), store)  # 4 points above unstructured
    assert claims["C3"].verdict == "holds"


def test_c3_counts_only_models_after_the_same_intermediate_layer(store, tmp_path):
    """The paper claims parity with the intermediate layer; without it its own Table 1 goes both ways (Amazon-670K
    slice: uniform 7.8 P@1 below unstructured), so that pair is shown beside the verdict, not counted in it."""
    runs = claim_runs(store, tmp_path, uniform32=15.0)  # 6 points below unstructured 32
    c3 = evaluated(runs, store)["C3"]
    assert c3.verdict == "holds"
    assert "- (not counted) Bibtex: test P@1/3/5 uniform 32 15.00" in c3.markdown()
    assert "- ✓ Bibtex: test P@1/3/5 uniform 32 + 1024 intermediate" in c3.markdown()
    # without unstructured runs after an intermediate layer there is nothing to verdict
    runs = [r for r in runs if not (r["setup"] == "unstructured" and r["intermediate"])]
    assert evaluated(runs, store)["C3"].verdict == "not measured here"


def test_a_gain_within_the_level_band_is_no_raise_for_c6(store, tmp_path):
    """C6 (more capacity raises P@k): 0.2 points more is level by the claims' 1-point rule, not a raise."""

    claims = evaluated(claim_runs(store, tmp_path, **{"uniform64+1024": 60.7}), store)
    assert claims["C6"].verdict == "does not hold here"


def test_a_bf16_mixed_run_does_not_stand_in_for_the_float32_one(store, tmp_path):
    from xmc_repro.report.claims import evaluate

    runs, settings = claim_runs(store, tmp_path), shared_settings(records.load(store))
    bf16 = [dict(r, precision="bf16-mixed", test_p1="1.0", last_end_time="2099-01-01T00:00:00+00:00") for r in runs]
    assert [c.verdict for c in evaluate(runs + bf16, settings)] == [c.verdict for c in evaluate(runs, settings)]


def test_runs_that_change_a_default_setting_on_purpose_are_not_used(store, tmp_path):
    runs = claim_runs(store, tmp_path)
    runs = [dict(r, table="differences") if r["dataset"] == "Bibtex" else r for r in runs]
    claims = evaluated(runs, store)
    assert claims["C1"].verdict == claims["C2"].verdict == "not measured here"


def test_claims_that_fail_or_lack_runs_say_so(store, tmp_path):
    from xmc_repro.report.claims import evaluate

    runs = claim_runs(store, tmp_path, **{"uniform32+1024": 55.0, "uniform32+2048": 50.0})
    claims = evaluated(runs, store)
    assert claims["C2"].verdict == "does not hold here"  # 55.0 is more than a point below dense's 60.0
    assert claims["C3"].verdict == "does not hold here"  # unstructured 32 + 1024 is 5 points above
    assert claims["C6"].verdict == "does not hold here"  # 2048 (50.0) below 1024 (55.0)
    assert claims["C5"].verdict == "does not hold here"  # squared hinge 55.0 below BCE's 59.0
    assert claims["C1"].verdict == claims["C4"].verdict == "holds"
    assert "✗" in claims["C2"].markdown() and "✓" in claims["C6"].markdown()  # 64 connections did raise P@k
    smoke_only = [dict(r, scale="smoke") for r in runs]
    assert {c.verdict for c in evaluate(smoke_only, shared_settings(records.load(store)))} == {"not measured here"}
    assert "Not measured here: no trained" in evaluate([], {})[0].markdown()


# ---------------------------------------------------------------------------------------------------- committed files


def test_the_committed_results_regenerate_byte_for_byte_from_the_committed_records(tmp_path):
    """What `dvc repro` does on a fresh clone: records -> runs.csv -> tables, figures, claims, all unchanged."""
    from xmc_repro.report.__main__ import main

    results = records.PROJECT_ROOT / "results"
    out = tmp_path / "results"
    assert main(["export", "--records", str(results / "records"), "--out", str(out / "runs.csv")]) == 0
    assert main(["render", "--runs", str(out / "runs.csv"), "--grid", str(results / "grid.csv"), "--data-missing",
                 str(results / "data_missing.json"), "--tables", str(out / "tables"), "--figures",
                 str(out / "figures")]) == 0  # fmt: skip
    assert main(["claims", "--runs", str(out / "runs.csv"), "--out", str(out / "claims.md")]) == 0
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(results) for sub in ("tables", "figures") for p in (results / sub).rglob("*")
                       if p.is_file())  # fmt: skip
    assert files == sorted([*committed, *map(type(files[0]), ("runs.csv", "claims.md"))])
    for name in files:
        assert (out / name).read_bytes() == (results / name).read_bytes(), f"{name} differs from the committed file"
    h200 = [r for r in read_runs_csv(out / "runs.csv") if r["device"] == H200]
    # 38 configurations migrated from the old runs.csv, 8 `gpu_check` configurations recorded since (float32 and
    # bf16-mixed Bibtex under the torch and the Keras Adam defaults: four, as precision and settings are part of one;
    # Synthetic-Amazon-670K's uniform model under both, at bf16-mixed under the Keras one, and its dense model)
    assert len(h200) == 46 and all(r["run_ids"] for r in h200)
    assert {r["precision"] for r in h200 if r["table"] == "gpu_check" and r["dataset"] == "Bibtex"} == {"", "bf16-mixed"}


def test_dvc_lock_is_in_step_with_the_code_and_records():
    """A change to a stage's code or inputs without `dvc repro` leaves dvc.lock stale: a fresh clone's `dvc repro`
    would then rerun stages (and rewrite dvc.lock) although the committed results are current."""
    import shutil
    import subprocess

    root = records.PROJECT_ROOT
    if not (root / ".dvc").is_dir() or shutil.which("dvc") is None:
        pytest.skip("not a DVC checkout")
    result = subprocess.run(["dvc", "status", "--json"], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "{}", f"run `dvc repro` and commit dvc.lock: {result.stdout.strip()[:500]}"


def test_a_failing_stage_exits_non_zero_with_one_error_line(tmp_path, capsys):
    from xmc_repro.report.__main__ import main

    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "abc.json").write_text("{")
    assert main(["export", "--records", str(tmp_path / "records"), "--out", str(tmp_path / "runs.csv")]) == 2
    runs_csv = records.PROJECT_ROOT / "results" / "runs.csv"
    assert main(["render", "--runs", str(runs_csv), "--grid", str(tmp_path / "none.csv")]) == 2
    assert main(["claims", "--runs", str(tmp_path / "none.csv"), "--out", str(tmp_path / "c.md")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith("error: ") for line in errors)
    assert "abc.json: not valid JSON" in errors[0] and "report grid" in errors[1] and "report export" in errors[2]


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(tags=[]), '"tags" must be an object of names and values'),
    (lambda r: r.update(metrics=None), '"metrics" must be an object of names and values'),
    (lambda r: r["metrics"].update({"test/p_at_1": "abc"}), "metric test/p_at_1 is 'abc', not a number"),
])
def test_a_record_with_malformed_fields_is_named_in_one_line(tmp_path, edit, message):
    record = {"run_id": "r1", "status": "FINISHED", "params": {}, "metrics": {"test/p_at_1": 1.0}, "tags": {}}
    edit(record)
    path = tmp_path / "r1.json"
    path.write_text(json.dumps(record))
    with pytest.raises(records.DataError, match=rf"^{re.escape(f'{path}: {message}; rerun `records add`')}"):
        records.load(tmp_path)


def test_a_missing_records_folder_or_an_unreadable_store_is_one_line(tmp_path, capsys, monkeypatch):
    """A typo in --records wrote an empty runs.csv over the committed one; a folder, file:// or an unknown scheme
    given to `records add` ended in MLflow's tracebacks; `records add` run outside the project started a records
    folder there."""
    from xmc_repro.report.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(["records", "add", "sqlite:///elsewhere.db"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'results' / 'records'}: no records folder here; run "
                                              "from the project's root or give --dir")
    assert not (tmp_path / "results").exists()

    assert main(["export", "--records", str(tmp_path / "typo"), "--out", str(tmp_path / "runs.csv")]) == 2
    assert not (tmp_path / "runs.csv").exists()
    (tmp_path / "folder").mkdir()
    (tmp_path / "records").mkdir()
    for store in (str(tmp_path / "folder"), "bogus://x"):
        assert main(["records", "add", store, "--dir", str(tmp_path / "records")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and errors[0] == f"error: {tmp_path / 'typo'}: no such folder of run records; give " \
        "--records results/records"
    assert all(line.startswith("error: ") and "cannot read runs from this MLflow store" in line for line in errors[1:])


def test_records_add_of_a_database_file_without_its_scheme_says_how_to_name_it(tmp_path, capsys, monkeypatch):
    """`records add gpu.db` (as `mlflow ui --backend-store-uri` users type a path): MLflow read it as a file store and
    the line quoted its "maintenance mode" notice, cut off mid-sentence."""
    from xmc_repro.report.__main__ import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "records").mkdir()
    (tmp_path / "gpu.db").write_bytes(b"")
    for given, uri in (("gpu.db", "sqlite:///gpu.db"), (str(tmp_path / "gpu.db"), f"sqlite:///{tmp_path}/gpu.db")):
        assert main(["records", "add", given, "--dir", "records"]) == 2
        assert capsys.readouterr().err == f"error: {given}: a database file, not a store's URI; pass {uri}\n"


def test_records_add_leaves_another_programs_database_untouched(tmp_path, capsys):
    """MLflow wrote its whole schema into any SQLite file given as the store (another project's database, an empty
    file) and `records add` reported 0 records from it."""
    import sqlite3

    from xmc_repro.report.__main__ import main

    (tmp_path / "records").mkdir()
    other, empty = tmp_path / "other.db", tmp_path / "empty.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    empty.touch()
    for path in (other, empty):
        before = path.read_bytes()
        assert main(["records", "add", f"sqlite:///{path}", "--dir", str(tmp_path / "records")]) == 2
        assert capsys.readouterr().err == (f"error: sqlite:///{path}: an SQLite database without MLflow's tables "
                                           "(another program's, or empty), not an MLflow store; pass the store that "
                                           "holds the runs, e.g. sqlite:///gpu.db\n")
        assert path.read_bytes() == before
    assert not list((tmp_path / "records").iterdir())


def test_records_add_into_a_folder_that_does_not_exist_is_refused_in_one_line(tmp_path, empty_store, capsys):
    """A mistyped --dir started a new folder and wrote the store's records there, where no export reads them."""
    from mlflow.entities import Param, RunTag

    from xmc_repro.report.__main__ import main

    uri, client = copied_store(empty_store, tmp_path)
    run_id = client.create_run(client.get_experiment_by_name("xmc_repro").experiment_id).info.run_id
    client.log_batch(run_id, metrics=logged_scores(50.5), tags=[RunTag("table", "table1")],
                     params=[Param(k, v) for k, v in params_of(BIBTEX, "dense").items()])  # fmt: skip
    client.set_terminated(run_id, "FINISHED")
    (tmp_path / "results" / "records").mkdir(parents=True)
    typo = tmp_path / "results" / "recods"
    assert main(["records", "add", uri, "--dir", str(typo)]) == 2
    assert capsys.readouterr().err == (f"error: {typo}: no such folder of run records; give the existing one (e.g. "
                                       f"--dir results/records) or, for a new one, create it first (mkdir -p {typo})\n")
    assert not typo.exists()
    typo.mkdir()  # made on purpose: a folder of records like any other
    assert main(["records", "add", uri, "--dir", str(typo)]) == 0
    assert [r["run_id"] for r in records.load(typo)] == [run_id]


def test_smoke_refuses_a_store_its_jobs_cannot_write_before_any_job_starts(tmp_path):
    from xmc_repro.errors import ConfigError
    from xmc_repro.report import smoke

    started = []
    with pytest.raises(ConfigError, match=r"^--tracking-uri bogus://x: not an MLflow tracking store"):
        smoke.run_smoke(("table4",), "bogus://x", tmp_path / "missing.json", run=lambda *a, **k: started.append(a))
    assert started == []


def test_smoke_skips_datasets_without_data_once_and_fails_when_a_job_failed(tmp_path, monkeypatch, capsys):
    import subprocess

    from xmc_repro.report import smoke

    monkeypatch.setenv("XMC_SHARED_DATA", str(tmp_path / "no-data"))
    commands = []

    def sweep(command, **kwargs):
        assert "cwd" not in kwargs  # in the current folder, as any sweep (the package's may be site-packages)
        commands.append(command[command.index("-m", 2) + 1 :])
        return subprocess.CompletedProcess(command, 1 if "experiment=table4" in command else 0)

    with pytest.raises(smoke.SweepFailed, match="table4"):
        smoke.run_smoke(("table1", "table4"), f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "missing.json", run=sweep)
    datasets = [next(a for a in c if a.startswith("dataset=")) for c in commands]
    assert all("bibtex" not in d and "delicious" not in d and "smoke_" in d for d in datasets)
    printed = capsys.readouterr().out
    assert printed.count("missing: data not found at") == 2  # Bibtex and Delicious, once each
    assert json.loads((tmp_path / "missing.json").read_text()) == {
        "Bibtex": str(tmp_path / "no-data" / "Bibtex"), "Delicious": str(tmp_path / "no-data" / "Delicious")}


def test_smoke_interrupted_waits_for_its_sweep_to_close_its_runs_and_says_so_in_one_line(tmp_path):
    """Ctrl+C (to the terminal's process group): subprocess.run killed the sweep 0.25 s later, while it was still
    marking its runs FAILED (seconds on a locked store), and `report smoke` ended in a KeyboardInterrupt traceback."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    mark = tmp_path / "closed"
    sweep = tmp_path / "sweep.py"  # stands in for `python -m xmc_repro -m experiment=...`: slow to close its runs
    sweep.write_text(textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def close_runs(*_):
            time.sleep(1.5)
            pathlib.Path({str(mark)!r}).write_text("closed")
            sys.exit(130)
        signal.signal(signal.SIGINT, close_runs)
        pathlib.Path({str(mark)!r} + ".started").write_text("")
        time.sleep(60)
    """))
    smoke_cli = textwrap.dedent(f"""
        import sys
        from xmc_repro.report import smoke
        from xmc_repro.report.__main__ import main
        smoke.check_data = lambda choices: ({{c: c for c in choices}}, {{}})
        smoke.sweep_command = lambda table, datasets, scale="smoke": [sys.executable, {str(sweep)!r}]
        sys.exit(main(["smoke", "--tables", "table5", "table4", "--tracking-uri", "sqlite:///m.db",
                       "--data-missing", "missing.json"]))
    """)
    process = subprocess.Popen([sys.executable, "-c", smoke_cli], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "closed.started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert mark.read_text() == "closed"  # the sweep was not killed while it closed its runs
    assert process.returncode == 130 and err == (
        "error: interrupted (Ctrl+C) in the smoke sweep of table5 (its line above says what became of its runs); "
        "to go on: python -m xmc_repro.report smoke --tables table5 table4\n")
    assert not (tmp_path / "missing.json").exists()


def test_smoke_keeps_what_it_did_not_check_in_data_missing(tmp_path, monkeypatch):
    """Datasets a call did not look for keep their entries (was: the file held only this call's, so `--tables
    table5`, which looks for no real set, emptied it); those it looked for are updated."""
    import subprocess

    from xmc_repro.report import smoke

    shared = tmp_path / "shared"
    (shared / "Bibtex").mkdir(parents=True)
    for name in ("bibtex_train_xc.txt", "bibtex_test_xc.txt"):
        (shared / "Bibtex" / name).write_text("")
    monkeypatch.setenv("XMC_SHARED_DATA", str(shared))
    missing = tmp_path / "missing.json"
    earlier = {"Bibtex": "/old/Bibtex", "Delicious": "/old/Delicious"}
    missing.write_text(json.dumps(earlier))
    sweep = lambda command, **kwargs: subprocess.CompletedProcess(command, 0)  # noqa: E731
    smoke.run_smoke(("table5",), f"sqlite:///{tmp_path / 'm.db'}", missing, run=sweep)
    assert json.loads(missing.read_text()) == earlier
    smoke.run_smoke(("table4",), f"sqlite:///{tmp_path / 'm.db'}", missing, run=sweep)  # Bibtex found, Delicious not
    assert json.loads(missing.read_text()) == {"Delicious": str(shared / "Delicious")}


def test_stand_ins_are_checked_against_the_real_order_of_models():
    from xmc_repro.report.standins import markdown

    def run(dataset, setup, p1, intermediate="", features="bow", connectivity="32"):
        return {"dataset": dataset, "features": features, "setup": setup, "loss": "squared_hinge", "test_p1": str(p1),
                "connectivity": "" if setup == "dense" else connectivity, "intermediate": intermediate,
                "last_end_time": "2026-01-01"}  # fmt: skip

    real = [run("Bibtex", "dense", 60), run("Bibtex", "uniform", 20), run("Bibtex", "unstructured", 25),
            run("Delicious", "dense", 66), run("Delicious", "uniform", 50), run("Delicious", "unstructured", 45)]
    smoke = [run("Smoke-X", "dense", 10, features="slice"), run("Smoke-X", "uniform", 12, features="slice"),
             run("Smoke-X", "unstructured", 3, features="slice"),
             run("Smoke-X", "uniform", 30, connectivity="64", features="slice")]  # not a compared model
    text = markdown(real, smoke)
    assert "| dense > uniform | reversed (10.0 vs 12.0) |" in text
    assert "| dense > unstructured | agrees (10.0 vs 3.0) |" in text
    assert "uniform > unstructured" not in text and "unstructured > uniform" not in text  # the real sets disagree
    assert "| **pairs in the real order** | 1/2 |" in text
    assert "Not measured here" in markdown(real, [])


def test_stand_ins_compare_models_with_an_intermediate_layer_at_one_width():
    """A later uniform run with a wider layer (2048) does not stand in for the 1024 one unstructured is compared at."""
    from xmc_repro.report.standins import best_p1

    def run(setup, p1, intermediate, end):
        return {"dataset": "Bibtex", "features": "bow", "setup": setup, "loss": "squared_hinge", "test_p1": str(p1),
                "connectivity": "32", "intermediate": intermediate, "last_end_time": end}  # fmt: skip

    runs = [run("uniform", 62.6, "1024", "2026-01-01"), run("unstructured", 62.4, "1024", "2026-01-02"),
            run("uniform", 62.0, "2048", "2026-01-03")]
    assert best_p1(runs, ("Bibtex", "bow")) == {"uniform + intermediate": 62.6, "unstructured + intermediate": 62.4}
    reruns = [run("uniform", 62.0, "2048", f"2026-01-0{day}") for day in (3, 4, 5)]  # one model, run again
    assert best_p1(runs[:2] + reruns, ("Bibtex", "bow")) == {"uniform + intermediate": 62.6,
                                                             "unstructured + intermediate": 62.4}


def _damage(text: str, how: str) -> str:
    lines = text.splitlines(keepends=True)
    if how == "column":  # the first column dropped from the header only
        lines[0] = lines[0].split(",", 1)[1]
    elif how == "row":  # the second line cut short
        lines[1] = lines[1].rsplit(",", 3)[0] + "\n"
    elif how == "word":  # a word for the last field of the second line: a number in each file that has one there
        lines[1] = lines[1].rstrip("\n").rsplit(",", 1)[0] + ",n/a\n"
    return "".join(lines)


@pytest.mark.parametrize(
    "name, how, message",
    [
        ("runs.csv", "column", r"runs\.csv:1: the header lacks the column table; write it again .*report export`"),
        ("runs.csv", "row", r"runs\.csv:2: \d+ fields where the header has \d+;"),
        ("runs.csv", "missing", r"runs\.csv: not found; write it again"),
        ("grid.csv", "column", r"grid\.csv:1: the header lacks the column table; write it again .*report grid`"),
        ("grid.csv", "row", r"grid\.csv:2: 10 fields where the header has 13;"),
        ("paper_results.csv", "word", r"paper_results\.csv:2: runs is 'n/a', not a number; .*git checkout -- "),
        ("data_missing.json", "word", r"data_missing\.json: not valid JSON"),
        ("data_missing.json", "list", r"data_missing\.json: not an object of dataset names"),
        ("data_missing.json", "folder", r"data_missing\.json: cannot be read \(Is a directory\); write it again"),
    ],
)  # fmt: skip
def test_a_damaged_report_input_is_one_line_naming_the_file_and_line(tmp_path, capsys, name, how, message):
    from xmc_repro.report.__main__ import main as report_main

    results = records.PROJECT_ROOT / "results"
    inputs = {"runs.csv": "--runs", "grid.csv": "--grid", "paper_results.csv": "--paper",
              "data_missing.json": "--data-missing"}  # fmt: skip
    for file_name in inputs:
        shutil.copy(results / file_name, tmp_path / file_name)
    target = tmp_path / name
    if how == "missing":
        target.unlink()
    elif how == "list":
        target.write_text("[]\n")
    elif how == "folder":  # IsADirectoryError's traceback
        target.unlink()
        target.mkdir()
    elif name.endswith(".json"):
        target.write_text('{"Bibtex": \n')
    else:
        target.write_text(_damage(target.read_text(), how))
    command = ["render", "--tables", str(tmp_path / "t"), "--figures", str(tmp_path / "f")]
    command += [argument for file_name, option in inputs.items() for argument in (option, str(tmp_path / file_name))]
    assert report_main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


def test_smoke_rewrites_a_damaged_data_missing_after_its_sweeps(tmp_path):
    """The earlier file is read only to keep entries this call did not check: damaged, it made `report smoke` fail
    after all its sweeps had run, naming `report smoke` itself as the remedy, and stay damaged."""
    import subprocess

    from xmc_repro.report import smoke

    missing = tmp_path / "missing.json"
    missing.write_text("{broken")
    sweeps = []
    sweep = lambda command, **kwargs: sweeps.append(command) or subprocess.CompletedProcess(command, 0)  # noqa: E731
    smoke.run_smoke(("table5",), f"sqlite:///{tmp_path / 'm.db'}", missing, run=sweep)
    assert len(sweeps) == 1 and json.loads(missing.read_text()) == {}


def test_the_readmes_table_1_is_the_rendered_one():
    """The README shows Table 1's smoke section as `dvc repro` renders it: every line, in order, from the file."""
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8").splitlines()
    start = readme.index("<details><summary>Table 1, smoke scale (click)</summary>")
    shown = [line for line in readme[start + 1 : readme.index("</details>", start)] if line.strip()]
    rendered = [line for line in (root / "results" / "tables" / "table1.md").read_text(encoding="utf-8").splitlines()
                if line.strip()]
    first = rendered.index(shown[0])
    assert shown == rendered[first : first + len(shown)]


# ---------------------------------------------------------------------------------------------------- writing records


def _limited_to(size: int):
    """A `preexec_fn` that lets the child write no file past `size` bytes (EFBIG, as a full disk gives ENOSPC)."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def _report(args, cwd, size=None):
    import subprocess
    import sys

    env = {**__import__("os").environ, "PYTHONPATH": str(records.PROJECT_ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "xmc_repro.report", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=_limited_to(size) if size else None)  # fmt: skip


def test_records_add_on_a_full_disk_leaves_no_half_record_and_says_so_in_one_line(tmp_path, empty_store):
    """A write that failed left a 0-byte <id>.json (export then told to `git checkout` a file never committed), and
    an updated record truncated in place."""
    from mlflow.entities import Param, RunTag

    uri, client = copied_store(empty_store, tmp_path)
    experiment = client.get_experiment_by_name("xmc_repro").experiment_id
    ids = []
    for p1 in (50.5, 40.5):
        run_id = client.create_run(experiment, run_name="ok").info.run_id
        client.log_batch(run_id, metrics=logged_scores(p1),
                         params=[Param(k, v) for k, v in params_of(BIBTEX, "uniform", 32, 256).items()],
                         tags=[RunTag("table", "table1"), RunTag("scale", "smoke")])  # fmt: skip
        client.set_terminated(run_id, "FINISHED")
        ids.append(run_id)
    directory = tmp_path / "records"
    directory.mkdir()
    current = directory / f"{ids[1]}.json"  # unchanged: not written again
    current.write_text(records.dump(records.record_of_run(client.get_run(ids[1]))))
    older = directory / f"{ids[0]}.json"  # an earlier copy, to be updated
    old_text = records.dump({**records.record_of_run(client.get_run(ids[0])), "run_name": "renamed since"})
    older.write_text(old_text)
    limit = len(old_text) // 2
    for kept in ("the old file is kept", "no file was left there"):  # an update, then (the old record gone) a new one
        files = {path: path.read_text() for path in directory.iterdir()}
        result = _report(["records", "add", uri, "--dir", str(directory)], tmp_path, size=limit)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.splitlines() == [f"error: {older}: could not be written (File too large); fix that and "
                                              f"rerun `records add` ({kept})"]
        # no empty record, no temporary file, the old record not truncated
        assert {path: path.read_text() for path in directory.iterdir()} == files
        older.unlink(missing_ok=True)
    counts = records.add_from_store(uri, directory)  # with space: the rerun completes what was left
    assert (counts["new"], counts["unchanged"]) == (1, 1) and len(records.load(directory)) == 2


def test_a_failed_write_keeps_the_old_file_and_names_the_cause_and_the_fix(tmp_path):
    import errno

    from xmc_repro.errors import StorageError
    from xmc_repro.report import atomic

    path = tmp_path / "runs.csv"
    path.write_text("old\n")
    with pytest.raises(StorageError) as raised:
        with atomic.replacing(path, "`records add`") as f:
            f.write("new, half of it")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(raised.value) == (f"{path}: could not be written (No space left on device); free space and rerun "
                                 "`records add` (the old file is kept)")
    # a failure that is no OSError (a bug mid-file, Ctrl+C) leaves the old file as well
    with pytest.raises(ValueError, match="fields not in fieldnames"):
        write_runs_csv([{"not a column": 1}], path)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["runs.csv"]
    atomic.write_text(tmp_path / "new" / "claims.md", "✓\n", "x")
    assert (tmp_path / "new" / "claims.md").read_bytes() == "✓\n".encode()


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    from xmc_repro.report import atomic

    path = tmp_path / "runs.csv"
    path.write_text("old\n")
    for mode in (0o640, 0o664):  # e.g. a group's shared results; the temporary file is made with the umask's
        path.chmod(mode)
        atomic.write_text(path, "new\n", "x")
        assert path.read_text() == "new\n" and stat.S_IMODE(path.stat().st_mode) == mode


def test_the_claims_stage_on_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path):
    runs_csv = records.PROJECT_ROOT / "results" / "runs.csv"
    out = tmp_path / "claims.md"
    out.write_text("old claims\n")
    result = _report(["claims", "--runs", str(runs_csv), "--records", str(runs_csv.parent / "records"), "--out",
                      str(out)], tmp_path, size=1000)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (f"error: {out}: could not be written (File too large); fix that and rerun the "
                                     "claims stage (`dvc repro`) (the old file is kept)")
    assert out.read_text() == "old claims\n" and [p.name for p in tmp_path.iterdir()] == ["claims.md"]


# ---------------------------------------------------------------------------------------------------- checking records


def _table_record(**changes) -> dict:
    record = {"run_id": "r1", "run_name": "", "status": "FINISHED", "start_time": "", "end_time": "",
              "params": params_of(BIBTEX, "dense"), "metrics": metrics_of(40.0),
              "tags": {"table": "table1", "scale": "smoke", "device": CPU}, "source": "mlflow"}  # fmt: skip
    return {**record, **changes}


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(params={}), "no params: a finished table run has its config's settings"),
    (lambda r: r["params"].pop("model/head"), "param model/head is missing: it names the run's configuration"),
    (lambda r: r["params"].update({"dataset/name": None}), "param dataset/name is null: it names the run's "
                                                           "configuration"),
    (lambda r: r["tags"].update(table=4), 'tag table is 4, not a string (write it as "4")'),
    (lambda r: r["metrics"].update({"test/p_at_3": math.nan}), "metric test/p_at_3 is nan, not a finite number"),
    (lambda r: r["metrics"].update({"time_per_epoch_s": 1.7976931348623157e308}), "metric time_per_epoch_s is "
     "1.7976931348623157e+308 (infinite, as MLflow stores it), not a finite number"),
    (lambda r: r.update(metrics={}), "no metrics: a finished table run has its test scores"),
    (lambda r: r["metrics"].pop("test/p_at_5"), "metric test/p_at_5 is missing: a finished table run has its "
                                                "test scores"),
    (lambda r: r.update(start_time=20260102), '"start_time" is 20260102, not a string'),
    (lambda r: r.update(status="finished"), "status is 'finished', not one of RUNNING, SCHEDULED, FINISHED, FAILED, "
                                            "KILLED"),
])  # fmt: skip
def test_a_table_record_that_would_export_blank_or_wrong_is_refused_in_one_line(tmp_path, capsys, edit, message):
    """Each of these exported with exit status 0: blank configuration columns, a table named "4", "nan" in runs.csv,
    or an empty row that replaced the good run as the latest."""
    from xmc_repro.report.__main__ import main

    store = tmp_path / "records"
    records.save(_table_record(run_id="good", start_time="2026-01-01T00:00:00"), store)
    record = _table_record(start_time="2026-01-02T00:00:00")
    edit(record)
    store.joinpath("r1.json").write_text(json.dumps(record))
    assert main(["export", "--records", str(store), "--out", str(tmp_path / "runs.csv")]) == 2
    assert capsys.readouterr().err == (f"error: {store / 'r1.json'}: {message}; rerun `records add` with the store "
                                       f"that holds the run, or `git checkout -- {store / 'r1.json'}`\n")
    assert not (tmp_path / "runs.csv").exists()


def test_records_the_export_does_not_count_need_no_scores_and_dotted_keys_still_read(tmp_path):
    store = tmp_path / "records"
    records.save(_table_record(run_id="failed", status="FAILED", params={}, metrics={}), store)
    records.save(_table_record(run_id="untagged", params={}, metrics={}, tags={}), store)
    dotted = {key.replace("/", "."): value for key, value in params_of(BIBTEX, "dense").items()}
    records.save(_table_record(run_id="dotted", params=dotted), store)
    assert [r["run_id"] for r in records.load(store)] == ["dotted", "failed", "untagged"]
    (row,) = summarize(records.load(store))
    assert (row["dataset"], row["setup"], row["run_ids"]) == ("Bibtex", "dense", "dotted")


def test_records_add_leaves_a_run_with_a_nan_metric_in_its_store_and_names_it(tmp_path, empty_store, capsys):
    from mlflow.entities import Metric

    from xmc_repro.report.__main__ import main

    uri, client = copied_store(empty_store, tmp_path)
    for p1 in (50.5, math.nan):
        run_id = finished_table_run(client, logged_scores(p1))
    directory = tmp_path / "records"
    directory.mkdir()
    assert main(["records", "add", uri, "--dir", str(directory)]) == 0
    assert capsys.readouterr().out.strip().endswith(
        f"1 new, 0 updated, 0 unchanged records from {uri}; left out 1 runs: 1 unusable as records (run {run_id}: "
        "metric test/p_at_1 is nan, not a finite number)")
    client.set_terminated(run_id, "FAILED")
    # MLflow's sqlite store keeps inf as the largest float
    infinite = finished_table_run(client, [Metric("time_per_epoch_s", math.inf, 0, 0)], seed=1)
    assert records.add_from_store(uri, directory)["unusable"] == [
        f"run {infinite}: metric time_per_epoch_s is 1.7976931348623157e+308 (infinite, as MLflow stores it), not a "
        "finite number"]  # fmt: skip
    assert len(records.load(directory)) == 1


def test_records_add_leaves_a_finished_run_without_a_test_score_in_its_store(tmp_path, empty_store, capsys):
    """A run with train metrics but no test/p_at_1 was copied: its seed was listed in the row, whose test P@1 was the
    mean of the other seeds only."""
    from mlflow.entities import Metric

    from xmc_repro.report.__main__ import main

    uri, client = copied_store(empty_store, tmp_path)
    for seed in (0, 1):
        scores = logged_scores(50.5)[seed:]  # seed 1: P@3 and P@5 only
        run_id = finished_table_run(client, [*scores, Metric("train/p_at_1", 60.0, 0, 0)], seed=seed)
    directory = tmp_path / "records"
    directory.mkdir()
    assert main(["records", "add", uri, "--dir", str(directory)]) == 0
    assert capsys.readouterr().out.strip().endswith(
        f"1 new, 0 updated, 0 unchanged records from {uri}; left out 1 runs: 1 unusable as records (run {run_id}: "
        "metric test/p_at_1 is missing: a finished table run has its test scores)")
    (row,) = export(tmp_path / "runs.csv", directory)
    assert (row["seeds"], row["test_p1"]) == ("0", "50.5")


def test_hidden_files_are_no_records_and_a_duplicate_is_told_to_go(tmp_path):
    """An editor's lock `.#<id>.json` (a dangling symlink) ended in a FileNotFoundError traceback; a copy
    `<id> (copy).json` was told to be renamed to the name its original has."""
    store = tmp_path / "records"
    records.save(_table_record(), store)
    (store / ".#r1.json").symlink_to("user@host.1234:1700000000")
    (store / ".r1.json.99.tmp").write_text("{")
    assert [r["run_id"] for r in records.load(store)] == ["r1"]
    shutil.copy(store / "r1.json", store / "r1 (copy).json")
    with pytest.raises(records.DataError, match=re.escape(
            f"{store / 'r1 (copy).json'}: a second copy of run r1, whose record is {store / 'r1.json'}; remove this "
            "copy")):  # fmt: skip
        records.load(store)
    (store / "r1.json").unlink()
    with pytest.raises(records.DataError, match=re.escape(f"{store / 'r1 (copy).json'}: holds run r1; rename it to "
                                                          "r1.json")):  # fmt: skip
        records.load(store)


def _dvc_project(tmp_path):
    """A DVC project of the stages, the committed results and the report's code; returns (folder, environment)."""
    import subprocess

    root = records.PROJECT_ROOT
    if shutil.which("dvc") is None:
        pytest.skip("no dvc")
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("dvc.yaml", "dvc.lock", ".dvcignore"):
        shutil.copy(root / name, copy / name)
    shutil.copytree(root / "results", copy / "results")
    shutil.copytree(root / "xmc_repro", copy / "xmc_repro", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "conf").symlink_to(root / "conf")  # read by the report's grid module, no dependency of the stage
    env = {**__import__("os").environ, "PYTHONPATH": str(copy), "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=copy, env=env, check=True, timeout=120)
    return copy, env


def test_dvc_repro_with_a_broken_record_keeps_runs_csv(tmp_path):
    """DVC deletes a stage's outputs before running it: a broken record cost the committed runs.csv."""
    import subprocess

    root = records.PROJECT_ROOT
    copy, env = _dvc_project(tmp_path)
    broken = sorted((copy / "results" / "records").glob("*.json"))[0]
    broken.write_text(broken.read_text()[:100])
    result = subprocess.run(["dvc", "repro", "export"], cwd=copy, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode != 0 and f"{broken.relative_to(copy)}: not valid JSON" in result.stdout + result.stderr
    assert (copy / "results" / "runs.csv").read_bytes() == (root / "results" / "runs.csv").read_bytes()


def test_dvc_repro_with_a_damaged_grid_keeps_the_tables_and_figures(tmp_path):
    """The render stage's folders were not persisted: DVC emptied them before a render that then refused grid.csv."""
    import subprocess

    root = records.PROJECT_ROOT
    copy, env = _dvc_project(tmp_path)
    grid = copy / "results" / "grid.csv"
    grid.write_text(grid.read_text().replace(",", ";", 20))
    result = subprocess.run(["dvc", "repro", "render"], cwd=copy, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode != 0 and "error: results/grid.csv:" in result.stdout + result.stderr
    for folder in ("tables", "figures"):
        kept = sorted(p.relative_to(copy) for p in (copy / "results" / folder).rglob("*") if p.is_file())
        assert kept == sorted(p.relative_to(root) for p in (root / "results" / folder).rglob("*") if p.is_file())
        assert all((copy / p).read_bytes() == (root / p).read_bytes() for p in kept)
