"""Every config builds: each job of every `experiment=table1..5` preset at both scales instantiates its model, loss
and callbacks (tiny data sizes); a head is one class and one config; config errors stay one line."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from xmc_repro.data.datamodule import LabelCounts
from xmc_repro.errors import ConfigError
from xmc_repro.model import XMCClassifier, build_loss, check_targets
from xmc_repro.report import grid
from xmc_repro.train import build_callbacks, build_model
from xmc_repro.validation import validate

FEATURES, LABELS = 128, 48  # inputs >= every preset's connectivity (64); MACH's sizes do not depend on the labels


def _compose(overrides):
    from hydra import compose

    with grid.conf_dir():
        return compose("config", overrides=list(overrides))


@functools.lru_cache(maxsize=None)
def _dataset(choice: str):
    return _compose([f"dataset={choice}"]).dataset


def _is_setting(override: str) -> bool:
    """`model.connectivity=64` (a value) rather than `dataset=x` or `+experiment/row=y` (a config choice)."""
    key = override.split("=", 1)[0]
    return "." in key and not key.startswith(("+", "~", "hydra."))


def preset_configs(table: str, scale: str, jobs=None):
    """(job, composed config) for every job of the preset's sweep.

    Composing costs a few tenths of a second, so each job shape (its config choices but the dataset) is composed
    once; the job's dataset and values are then put in as Hydra would. `test_the_shortcut_composes_as_hydra_does`
    holds this to a full compose.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    shapes = {}
    for job in jobs or grid.job_overrides(table, scale):
        dataset = next(o.split("=", 1)[1] for o in job if o.startswith("dataset="))
        choices = tuple(o for o in job if not _is_setting(o) and not o.startswith("dataset="))
        if choices not in shapes:
            shapes[choices] = _compose(choices)
        cfg = shapes[choices].copy()
        cfg.dataset = _dataset(dataset)
        for override in filter(_is_setting, job):
            parsed = parser.parse_override(override)
            OmegaConf.update(cfg, parsed.key_or_group, parsed.value(), merge=False)
        yield job, cfg


def _fake_data():
    return SimpleNamespace(num_features=FEATURES, num_labels=LABELS,
                           train_label_counts=LabelCounts(np.arange(LABELS) % 5, num_points=200))


@pytest.mark.parametrize("scale", grid.SCALES)
@pytest.mark.parametrize("table", grid.TABLES)
def test_every_job_of_every_preset_builds_its_model_loss_and_callbacks(table, scale, tmp_path):
    x = torch.rand(2, FEATURES)
    ptr, idx = torch.tensor([0, 2, 3]), torch.tensor([1, 7, 40])
    heads = set()
    for job, cfg in preset_configs(table, scale):
        validate(cfg)
        check_targets(cfg)
        model = build_model(cfg, _fake_data())
        heads.add(cfg.model.head)
        assert model.hparams.intermediate == cfg.model.intermediate, job
        assert float(model.loss_fn(model(x), ptr, idx)) >= 0, job
        callbacks = build_callbacks(cfg, tmp_path, {})
        assert {"rewiring", "early_stop", "best", "last", "progress"} <= set(callbacks), job
        assert callbacks["rewiring"].fraction == cfg.model.rewire_fraction
        assert callbacks["rewiring"].every_epoch == bool(cfg.dataset.rewire_every_epoch), job
        assert callbacks["best"].dirpath == str(tmp_path) and callbacks["last"].dirpath == tmp_path
    if table == "table1":
        assert heads == {"dense", "uniform", "unstructured", "bottleneck", "mach"}


@pytest.mark.parametrize("table", grid.TABLES)
def test_the_shortcut_composes_as_hydra_does(table):
    for scale in grid.SCALES:
        [(job, quick)] = preset_configs(table, scale, grid.job_overrides(table, scale)[-1:])
        full = _compose(job)
        assert OmegaConf.to_container(quick, resolve=True) == OmegaConf.to_container(full, resolve=True), job


def test_the_interval_is_the_datasets_and_the_fraction_the_models(tmp_path):
    cfg = _compose(["dataset=wiki10_31k", "model.rewire_fraction=0.3", "model.rewire_schedule=multiples",
                    "model.rewire_exact_count=true"])
    rewiring = build_callbacks(cfg, tmp_path)["rewiring"]
    settings = (rewiring.every_epoch, rewiring.every_n_steps, rewiring.fraction, rewiring.schedule, rewiring.exact_count)
    assert settings == (True, None, 0.3, "multiples", True)
    cfg = _compose(["dataset=synthetic", "dataset.rewire_every_n_steps=7", "model=dense"])
    rewiring = build_callbacks(cfg, tmp_path)["rewiring"]
    assert (rewiring.every_epoch, rewiring.every_n_steps, rewiring.fraction) == (False, 7, 0.0)
    rewiring = build_callbacks(_compose(["dataset=synthetic"]), tmp_path)["rewiring"]
    assert (rewiring.schedule, rewiring.exact_count) == ("authors", False)  # the authors' settings by default


def test_the_best_checkpoint_and_early_stopping_watch_val_p3_as_the_config_says(tmp_path):
    callbacks = build_callbacks(_compose([]), tmp_path)
    best, stop = callbacks["best"], callbacks["early_stop"]
    assert (best.dirpath, best.filename, best.monitor, best.mode) == (str(tmp_path), "best", "val/p_at_3", "max")
    assert best.min_delta == stop.min_delta == pytest.approx(5e-3)  # 5e-5 as a P@3 fraction, in percent
    assert (stop.monitor, stop.patience) == ("val/p_at_3", 4)


def test_the_configured_optimizer_is_keras_adam_and_an_older_runs_config_keeps_torchs():
    from xmc_repro.optim import KerasAdam

    cfg = _compose([])
    optimizer = build_model(cfg, _fake_data()).configure_optimizers()["optimizer"]
    assert isinstance(optimizer, KerasAdam)
    assert optimizer.param_groups[0]["eps"] == 1e-7  # Keras's epsilon, not torch's 1e-8
    OmegaConf.set_struct(cfg, False)
    del cfg.trainer["adam_eps_placement"]  # a run's stored config from before the setting
    validate(cfg)
    assert type(build_model(cfg, _fake_data()).configure_optimizers()["optimizer"]) is torch.optim.Adam


def test_the_sparse_heads_draw_with_replacement_and_an_older_runs_config_keeps_distinct_positions():
    assert build_model(_compose(["model=uniform"]), _fake_data()).head.distinct_sources is False  # the authors' draws
    cfg = _compose(["model=unstructured"])
    assert build_model(cfg, _fake_data()).head.distinct_sources is False
    OmegaConf.set_struct(cfg, False)
    del cfg.model["distinct_sources"]  # a config without the setting: the layer's default, the authors' draws
    validate(cfg)
    assert build_model(cfg, _fake_data()).head.distinct_sources is False
    cfg.resume = "0123abcd"  # a run's stored config from before the setting, resumed
    assert build_model(cfg, _fake_data()).head.distinct_sources is True


class LowRankHead(nn.Sequential):
    """The README's example of a new head: its settings are the constructor's keyword arguments."""

    def __init__(self, in_features: int, num_labels: int, rank: int = 16):
        super().__init__(nn.Linear(in_features, rank, bias=False), nn.Linear(rank, num_labels))


def test_a_new_head_is_a_class_and_a_config(tmp_path):
    cfg = _compose(["model=dense", "trainer.max_epochs=1"])
    new_head = OmegaConf.create({"_target_": f"{__name__}.LowRankHead", "head": "lowrank", "rank": 4,
                                 "label": "lowrank-${.rank}"})
    OmegaConf.set_struct(cfg, False)
    cfg.model = OmegaConf.merge(cfg.model, new_head)  # as conf/model/lowrank.yaml over conf/model_common.yaml
    model = build_model(cfg, _fake_data())
    assert isinstance(model.head, LowRankHead) and model.head[0].out_features == 4
    from xmc_repro.describe import run_name

    assert " lowrank-4 " in run_name(cfg)


def test_a_head_by_name_takes_its_config_file_defaults_and_the_settings_it_names():
    model = XMCClassifier(FEATURES, LABELS, head="uniform", distinct_sources=True, bottleneck=3)
    assert model.head.connectivity == 32 and model.head.distinct_sources  # conf/model/uniform.yaml, then the call
    assert type(XMCClassifier(10, 20, head="mach").head).__name__ == "MachHead"


def test_errors_raised_while_building_stay_one_line():
    with pytest.raises(ConfigError, match=r"^connectivity=9 exceeds the layer's 8 input features; set "
                                        r"connectivity \(model.connectivity in a run\) <= 8"):
        XMCClassifier(8, 10, head="uniform", connectivity=9)
    with pytest.raises(ConfigError, match=r"^model=.nope. is unknown; choose one of bottleneck, dense, mach"):
        XMCClassifier(8, 10, head="nope")
    with pytest.raises(ConfigError, match=r"^model.mach.decode='max' is unknown"):
        XMCClassifier(8, 10, head="mach", mach={"num_hashes": 2, "num_buckets": 4, "decode": "max"})
    with pytest.raises(ConfigError, match=r"^xmc_repro.callbacks.Rewiring: rewiring schedule 'weekly' is unknown"):
        from xmc_repro.model import instantiate_with

        instantiate_with({"_target_": "xmc_repro.callbacks.Rewiring", "fraction": 0.1, "schedule": "weekly"})
    assert callable(build_loss("bce"))


def test_the_unstructured_head_rewires_the_authors_fraction_with_and_without_an_intermediate_layer():
    fraction = lambda *overrides: _compose(["model=unstructured", *overrides]).callbacks.rewiring.fraction  # noqa: E731
    assert fraction() == 0.01  # their "sparse" architecture: RewireLayer's default selector
    assert fraction("model.intermediate=1024") == 0.1  # "dense-sparse": the task's fraction, the paper's
    assert fraction("model.rewire_fraction=0.1") == 0.1
    assert _compose(["model=uniform"]).callbacks.rewiring.fraction == 0.1


def test_the_summary_says_why_the_last_epochs_weights_were_tested():
    from xmc_repro.describe import selection

    assert selection(_compose([]), "last epoch").endswith("max_epochs ended the run before early stopping")
    assert selection(_compose(["~callbacks.early_stop"]), "last epoch").endswith("no early stopping "
                                                                              "(~callbacks.early_stop)")
    assert selection(_compose([]), "best epoch").startswith("epoch chosen on test P@3")

def margin_hinge(scores, label_ptr, label_idx, margin: float = 1.0):
    """A loss of one's own (README: a function of (scores, label_ptr, label_idx) with settings of its own)."""
    from xmc_repro.losses import dense_targets

    y = dense_targets(label_ptr, label_idx, scores.shape[1], scores.device, scores.dtype)
    return torch.relu(margin - (2 * y - 1) * scores).pow(2).mean()


def _with(**groups):
    """The default config with `groups` (loss=..., callbacks=...) replaced, as a file of one's own would give them."""
    cfg = _compose(["model=dense"])
    OmegaConf.set_struct(cfg, False)
    for group, value in groups.items():
        cfg[group] = OmegaConf.merge(cfg[group], value) if group == "callbacks" else OmegaConf.create(value)
    return cfg


OWN_LOSS = {"_target_": f"{__name__}.margin_hinge", "_partial_": True, "name": "margin_hinge", "margin": 2.0}


@pytest.mark.parametrize("groups, line", [
    # each failed the run after its data had loaded and its MLflow run had opened, with a traceback
    ({"loss": {**OWN_LOSS, "_target_": f"{__name__}.margin_hinj"}},
     rf"^loss._target_={__name__}.margin_hinj cannot be imported \(ModuleNotFoundError: No module named "),
    ({"loss": {**OWN_LOSS, "_partial_": False}},
     r"^loss._partial_ is not true: the loss is the function itself, called every step with \(scores, label_ptr, "
     r"label_idx\); add `_partial_: true`"),
    ({"loss": {"_target_": "builtins.max", "_partial_": True, "name": "max"}}, None),  # no signature to read: passes
    ({"loss": {"_target_": "xmc_repro.losses.first_occurrences", "_partial_": True, "name": "first"}},
     r"^loss._target_=xmc_repro.losses.first_occurrences cannot be called as loss\(scores, label_ptr, label_idx\)"),
    ({"model": {"_target_": "nowhere.Head", "head": "mine"}}, r"^model._target_=nowhere.Head cannot be imported"),
    ({"callbacks": {"hello": {"word": "hi"}}}, r"^callbacks.hello has no _target_; add `_target_: package.module.Name`"),
    # trained without it, while MLflow recorded loss/margn (and callbacks/lr/logging_intervl) as params
    ({"loss": {**OWN_LOSS, "margn": 3.0}},
     rf"^loss.margn is not a setting of {__name__}.margin_hinge \(it takes margin\), so it would be ignored; fix or "
     r"remove it in"),
    # the README's head with a typo: trained at rank 16, named lowrank-8 and reported as `lowrank rnak=8`
    ({"model": {"_target_": f"{__name__}.LowRankHead", "head": "lowrank", "rnak": 8, "connectivity": 4}},
     rf"^model.rnak is not a setting of {__name__}.LowRankHead \(it takes rank\), so it would be ignored"),
    ({"callbacks": {"lr": {"_target_": "lightning.pytorch.callbacks.LearningRateMonitor", "logging_intervl": "step"}}},
     r"^callbacks.lr.logging_intervl is not a setting of lightning.pytorch.callbacks.LearningRateMonitor \(it takes "
     r"logging_interval, "),
])
def test_what_a_run_builds_is_checked_before_its_data_loads(groups, line):
    cfg = _with(**groups)
    if line is None:
        check_targets(cfg)
        return
    with pytest.raises(ConfigError, match=line) as info:
        check_targets(cfg)
    assert "\n" not in str(info.value)


def test_a_loss_and_a_callback_of_ones_own_pass_and_are_built(tmp_path):
    cfg = _with(loss=OWN_LOSS, callbacks={"lr": {"_target_": "lightning.pytorch.callbacks.LearningRateMonitor",
                                                 "logging_interval": "epoch"}})
    check_targets(cfg)
    for preset in ("bce", "squared_hinge"):
        check_targets(_compose([f"loss={preset}"]))
    model = build_model(cfg, _fake_data())
    assert model.loss_fn.keywords == {"margin": 2.0}
    assert build_callbacks(cfg, tmp_path)["lr"].logging_interval == "epoch"


def test_a_message_names_the_file_to_fix_in_the_package_or_in_ones_own_folder():
    with pytest.raises(ConfigError, match=r"to callbacks/hello.yaml in your --config-dir folder \(or the "
                                          r"\+callbacks.hello override\)$"):
        check_targets(_with(callbacks={"hello": {"word": "hi"}}))
    with pytest.raises(ConfigError, match=r"remove it in conf/callbacks/time.yaml \(or the \+callbacks.time "
                                          r"override\)$"):
        check_targets(_with(callbacks={"time": {"step_windw": 5}}))


def test_a_run_started_before_the_checks_with_a_key_they_refuse_can_still_be_resumed():
    """A resumed run is its stored config (resume.resume_config), which no file can fix: a key its class, function
    or reader does not take, ignored when code from before these checks started it, is ignored again as it goes on;
    refused, the run could never be continued. Imports and the loss's call are still checked."""
    stored = _with(loss={**OWN_LOSS, "margn": 3.0},
                   callbacks={"lr": {"_target_": "lightning.pytorch.callbacks.LearningRateMonitor",
                                     "logging_intervl": "step"}})
    stored.model.merge_with({"_target_": f"{__name__}.LowRankHead", "head": "lowrank", "rnak": 8})
    stored.dataset.normalise = "tfidf"
    with pytest.raises(ConfigError, match=r"^model.rnak is not a setting"):
        check_targets(stored)
    with pytest.raises(ConfigError, match=r"^dataset.normalise is not a setting any dataset reader takes"):
        validate(stored)
    stored.dataset.name = None  # named "None" by code from before the names were required
    with pytest.raises(ConfigError, match=r"^dataset.name=None must be a name"):
        validate(stored)
    stored.resume = "0123456789abcdef"
    validate(stored)
    check_targets(stored)
    stored.loss._target_ = f"{__name__}.margin_hinj"
    with pytest.raises(ConfigError, match=r"^loss._target_=.*margin_hinj cannot be imported"):
        check_targets(stored)


@pytest.mark.parametrize("overrides, line", [
    # an npy dataset's embeddings were left as they were, while MLflow recorded dataset/normalize=l2
    (["dataset=amazon670k_slice", "+dataset.normalize=l2"],
     r"^dataset.normalize is read only for dataset.kind=xc, and this dataset is kind=npy, so it would be ignored"),
    (["dataset=bibtex", "+dataset.feature_dim=512"], r"^dataset.feature_dim is read only for dataset.kind=npy"),
    (["+dataset.train_file=x.txt"], r"^dataset.train_file is read only for dataset.kind=xc, and this dataset is "
                                    r"kind=synthetic"),
])
def test_a_dataset_setting_of_another_kind_is_refused(overrides, line):
    with pytest.raises(ConfigError, match=line):
        validate(_compose(overrides))


def test_a_run_started_with_its_best_checkpoint_named_last_can_still_be_resumed():
    """callbacks.best.filename=last is refused for a new run; a run started with it before that check, refused on
    resume too (its stored config cannot change the setting), could never be continued."""
    stored = _compose(["callbacks.best.filename=last"])
    with pytest.raises(ConfigError, match=r"^callbacks.best.filename='last' must name a file of its own"):
        validate(stored)
    stored.resume = "0123456789abcdef"
    validate(stored)
