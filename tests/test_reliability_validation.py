"""Settings refused up front, in one line naming the setting and the fix, before any run is opened.

Most cases are checked on the composed config (`xmc_repro.validation.validate`, what the command line runs
first); two go through the real command line: exit status 2, one `error:` line, no MLflow run.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_reliability_common import ROOT, TINY, cli, cli_env, copy_store, make_store, runs, stderr_lines
from test_reliability_common import no_run_left_running  # noqa: F401  (autouse)
from xmc_repro import validation
from xmc_repro.errors import ConfigError


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


# (overrides, what the one line must say)
REFUSED = {
    "seed_negative": (["seed=-1"], "seed=-1 must be an integer in [0, 4294967295]"),
    "seed_too_large": ([f"seed={2**32}"], "seed=4294967296 must be an integer in [0, 4294967295]"),
    "lr_nan": (["trainer.lr=nan"], "trainer.lr=nan must be a finite number in (0, 1e+37]"),
    "lr_inf": (["trainer.lr=inf"], "trainer.lr=inf must be a finite number in (0, 1e+37]"),
    "lr_overflowing_adam": (["trainer.lr=1e38"], "trainer.lr=1e+38 must be a finite number in (0, 1e+37]"),
    "lr_factor_2": (["trainer.lr_factor=2"], "trainer.lr_factor=2 must be a finite number in (0, 1)"),
    "lr_factor_1": (["trainer.lr_factor=1"], "trainer.lr_factor=1 must be a finite number in (0, 1)"),
    "lr_factor_0": (["trainer.lr_factor=0"], "trainer.lr_factor=0 must be a finite number in (0, 1)"),
    "min_lr_negative": (["trainer.min_lr=-1"], "trainer.min_lr=-1 must be a finite number >= 0"),
    "early_stop_patience_negative": (["trainer.early_stop_patience=-1"], "trainer.early_stop_patience=-1 must be"),
    "dropout_1.5": (["dataset.dropout=1.5"], "dataset.dropout=1.5 must be a finite number in [0, 1)"),
    "dropout_1": (["dataset.dropout=1"], "dataset.dropout=1 must be a finite number in [0, 1)"),
    "limit_train_batches_0": (["trainer.limit_train_batches=0"], "trainer.limit_train_batches=0 must be an integer >= 1"),
    "limit_train_batches_0.0": (["trainer.limit_train_batches=0.0"], "trainer.limit_train_batches=0.0 must be"),
    "mach_num_buckets_0": (["model=mach", "model.mach.num_buckets=0"], "model.mach.num_buckets=0 must be a positive"),
    "mach_num_hashes_0": (["model=mach", "model.mach.num_hashes=0"], "model.mach.num_hashes=0 must be a positive"),
    "connectivity_0": (["model.connectivity=0"], "model.connectivity=0 must be a positive integer"),
    "connectivity_2.5": (["model.connectivity=2.5"], "model.connectivity=2.5 must be a positive integer"),
    "bottleneck_0": (["model=bottleneck", "model.bottleneck=0"], "model.bottleneck=0 must be a positive integer"),
    "rewire_every_n_steps_negative": (["dataset.rewire_every_n_steps=-1"], "dataset.rewire_every_n_steps=-1 must be"),
    "checkpoint_every_0": (["trainer.checkpoint_every_n_steps=0"], "trainer.checkpoint_every_n_steps=0 must be"),
    "profile_steps_0": (["trainer.profile_steps=0"], "trainer.profile_steps=0 must be"),
    "cublas_workspace_0": (["trainer.cublas_workspace_mib=0"], "trainer.cublas_workspace_mib=0 must be a finite number > 0"),
    "step_window_0": (["callbacks.time.step_window=0"], "callbacks.time.step_window=0 must be a positive integer"),
    # trained with, while MLflow recorded the setting the callback reads (trainer.early_stop_patience=4)
    "callback_wiring_overridden": (["callbacks.early_stop.patience=1"], "callbacks.early_stop.patience=1 would not be "
                                   "recorded: it is trainer.early_stop_patience; set trainer.early_stop_patience=1"),
    "callback_wiring_of_oc_select": (["callbacks.rewiring.every_n_steps=5"], "set dataset.rewire_every_n_steps=5"),
    # the run read them at its end: a KeyError after the whole training
    "callback_time_removed": (["~callbacks.time"], "~callbacks.time: the run needs this callback for its epoch and "
                              "step times; keep it (only ~callbacks.rewiring and ~callbacks.early_stop may be removed)"),
    "callback_best_removed": (["~callbacks.best"], "~callbacks.best: the run needs this callback for testing the best"),
    # a TypeError from the wiring check
    "callback_set_to_null": (["callbacks.early_stop=null"], "callbacks.early_stop=null: remove a callback with "
                             "~callbacks.early_stop"),
    # Lightning found the name missing only after the first epoch had trained: a traceback, the epoch lost
    "best_monitor_not_logged": (["callbacks.best.monitor=val/p@1"], "callbacks.best.monitor='val/p@1' is not a metric "
                                "the run logs every epoch; choose one of val/p_at_1, val/p_at_3, val/p_at_5"),
    # it overwrote last.ckpt: a resume continued from the best epoch
    "best_filename_last": (["callbacks.best.filename=last"], "callbacks.best.filename='last' must name a file of its "
                           "own in the run's checkpoint folder (not last, the checkpoint resume= continues from"),
    "best_filename_folder": (["callbacks.best.filename=../best"], "callbacks.best.filename='../best' must name a file"),
    "best_mode_unknown": (["callbacks.best.mode=maximum"], "callbacks.best.mode='maximum' is unknown; choose one of max"),
    # a dataset or loss file of one's own without a name: the run named "None", or failed as it opened, blaming the
    # MLflow store; the report refused its record after training
    "dataset_without_name": (["~dataset.name"], "dataset.name=None must be a name (run names and the report name the "
                             "run by it); add `name: MyData` to the dataset's file"),
    "dataset_without_features": (["~dataset.features"], "dataset.features=None must be a name"),
    "loss_without_name": (["~loss.name"], "loss.name=None must be a name"),
    # a dataset file's key that no reader takes was ignored (trained with l2), yet recorded as a param
    "dataset_key_no_reader_takes": (["+dataset.normalise=tfidf"], "dataset.normalise is not a setting any dataset "
                                    "reader takes (did you mean dataset.normalize?), so it would be ignored"),
    # without it the rewiring callback read null: a sparse head trained without a single rewiring
    "dataset_without_rewiring_interval": (["~dataset.rewire_every_n_steps"], "dataset.rewire_every_n_steps is not "
                                          "set, so model.head=uniform would never be rewired; add"),
    "memory_report_not_bool": (["trainer.memory_report=yes please"],
                               "trainer.memory_report='yes please' must be true or false"),
    "bf16_true": (["trainer.precision=bf16-true"], "trainer.precision=bf16-true: the sparse op of model.head=uniform "
                  "would get bfloat16 weights"),
    "fp16_true_mach": (["model=mach", "trainer.precision=16-true"], "the sparse op of model.head=mach would get float16"),
    "batch_size_0": (["trainer.batch_size=0"], "trainer.batch_size=0 must be a positive integer"),
    "intermediate_0": (["model.intermediate=0"], "model.intermediate=0 must be a positive layer size"),
    # 16.0 built the layer but was recorded as another configuration than 16
    "intermediate_16.0": (["model.intermediate=16.0"],
                          "model.intermediate=16.0 must be a positive layer size (an integer)"),
    # refused only after the data had loaded and the MLflow run had opened
    "mach_decode_unknown": (["model=mach", "model.mach.decode=bogus"],
                            "model.mach.decode='bogus' is unknown; choose one of probability, score"),
    # A dense model reads model.init only to compare it with "authors": a typo would train with torch's init.
    "init_unknown": (["model=dense", "model.init=keras"], "model.init='keras' is unknown; choose one of authors, fan_in"),
    "rewire_schedule_unknown": (["model.rewire_schedule=weekly"], "model.rewire_schedule='weekly' is unknown"),
    # anything but relu built the linear bottleneck
    "bottleneck_activation_unknown": (["model=bottleneck", "model.bottleneck_activation=tanh"],
                                      "model.bottleneck_activation='tanh' is unknown; choose one of relu, linear"),
    "cuda_graph_word": (["trainer.cuda_graph=maybe"], "trainer.cuda_graph='maybe' must be true or false"),
    "restore_best_unknown": (["trainer.restore_best=never"], "trainer.restore_best='never' is unknown; choose one of "
                             "early_stop, always"),
    "adam_eps_placement_unknown": (["trainer.adam_eps_placement=tf"], "trainer.adam_eps_placement='tf' is unknown; "
                                   "choose one of keras, torch"),
    "shuffle_buffer_0": (["trainer.shuffle_buffer=0"], "trainer.shuffle_buffer=0 must be an integer >= 1"),
    "progress_bar_number": (["trainer.progress_bar=2"], "trainer.progress_bar=2 must be true or false"),
    "train_eval_max_points_0": (["trainer.train_eval_max_points=0"], "trainer.train_eval_max_points=0 must be an "
                                "integer >= 1; or null for every training point"),
    "holdout_fraction_0": (["dataset.holdout_fraction=0"], "dataset.holdout_fraction=0 must be a finite number in (0, 1)"),
    "experiment_name_empty": (["logger.experiment_name="], "logger.experiment_name='' must be a non-empty name"),
    # model.head names what model=<head> builds; changing it alone trained the uniform head, recorded as dense
    "head_without_its_model": (["model.head=dense"], "this config builds xmc_repro.sparse.UniformSparseLinear; pick the "
                               "head with model=dense"),
    "connectivity_float": (["model.connectivity=8.0"], "model.connectivity=8.0 must be a positive integer"),
    # refused by the data sources only once the run had opened
    "num_train_negative": (["dataset.num_train=-5"], "dataset.num_train=-5 must be an integer >= 1"),
    "labels_per_point_0": (["dataset.labels_per_point=0"], "dataset.labels_per_point=0 must be a finite number >= 1"),
    "kind_unknown": (["dataset.kind=foo"], "dataset.kind='foo' is unknown; choose one of synthetic, xc, npy"),
    "xc_without_test_file": (["dataset=xc", "dataset.train_file=a.txt"], "dataset.test_file is not set"),
    "normalize_unknown": (["dataset=bibtex", "dataset.normalize=foo"], "dataset.normalize='foo' is unknown"),
    # PSP@k would come out negative, or infinite for a label without training points
    "propensity_A_negative": (["dataset.propensity.A=-1"], "dataset.propensity.A=-1 must be a finite number > 0; "
                              "Jain et al.'s constants"),
    "propensity_B_0": (["dataset.propensity.B=0"], "dataset.propensity.B=0 must be a finite number > 0"),
    # Lightning refuses these too, but with a traceback
    "num_workers_negative": (["trainer.num_workers=-1"], "trainer.num_workers=-1 must be an integer >= 0"),
    "num_workers_word": (["trainer.num_workers=abc"], "trainer.num_workers='abc' must be an integer >= 0"),
    "devices_0": (["trainer.devices=0"], "trainer.devices=0 must be a number of devices (-1 or auto: all), or device"),
    "devices_word": (["trainer.devices=abc"], "trainer.devices='abc' must be a number of devices"),
    "devices_bad_id": (["trainer.devices=[0,-2]"], "must be a number of devices"),
    "strategy_unknown": (["trainer.strategy=foo"], "trainer.strategy='foo' is not one this pipeline runs; use "
                         "trainer=ddp for several devices"),
    "strategy_spawn": (["trainer.strategy=ddp_spawn"], "trainer.strategy='ddp_spawn' is not one this pipeline runs"),
    "precision_unknown": (["trainer.precision=fp32"], "trainer.precision='fp32' is unknown; choose one of 32-true,"),
    "accelerator_unknown": (["trainer.accelerator=gpuu"], "trainer.accelerator='gpuu' is unknown; choose one of auto,"),
    # numpy refused these once the run had opened, with a traceback
    "data_seed_word": (["dataset.data_seed=abc"], "dataset.data_seed='abc' must be an integer in [0, 4294967295]"),
    "data_seed_negative": (["dataset.data_seed=-1"], "dataset.data_seed=-1 must be an integer in [0, 4294967295]"),
    # read as true where they are used: `no` trained distinct sources, exact counts, rewiring every epoch
    "distinct_sources_word": (["model=unstructured", "model.distinct_sources=no"],
                              "model.distinct_sources='no' must be true or false"),
    "rewire_exact_count_word": (["model.rewire_exact_count=off"], "model.rewire_exact_count='off' must be true or false"),
    "rewire_every_epoch_word": (["dataset.rewire_every_epoch=no"], "dataset.rewire_every_epoch='no' must be true or false"),
    # "'False' must be true or false": the quotes or ${oc.env:...} made it a string
    "flag_quoted": (["trainer.progress_bar='false'"], "trainer.progress_bar='false' is a string, not true or false: "
                    "write it unquoted"),
    "flag_from_a_variable": (["dataset.rewire_every_epoch=${oc.env:XMC_TEST_UNSET_VARIABLE,false}"],
                             "dataset.rewire_every_epoch='False' is a string, not true or false"),
    # an empty MLFLOW_TRACKING_URI: MLflow opened its own default store, then Lightning's logger failed on ./mlruns
    "tracking_uri_empty": (["logger.tracking_uri="], "logger.tracking_uri='' names no store (an empty MLFLOW_TRACKING_URI?)"),
    # OmegaConf's traceback where the setting was first read
    "interpolation_of_a_missing_key": (["trainer.max_epochs=${dataset.max_epoch}"], "trainer.max_epochs cannot be "
                                       "resolved (Interpolation key 'dataset.max_epoch' not found); fix its ${...}"),
    "group_of_settings_set_to_null": (["model=mach", "model.mach=null"], "model.mach=null, but model.label reads its "
                                      "settings; drop model.mach=null (or give model.mach.<setting>=... for the ones "
                                      "to change)"),
    "interpolation_of_an_unset_variable": (["logger.tracking_uri=${oc.env:XMC_TEST_UNSET_VARIABLE}"],
                                           "logger.tracking_uri cannot be resolved (KeyError raised while resolving "
                                           "interpolation: \"Environment variable 'XMC_TEST_UNSET_VARIABLE' not found\")"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_setting_is_refused_in_one_line(case):
    overrides, expected = REFUSED[case]
    with pytest.raises(ConfigError) as info:
        validation.validate(compose(overrides))
    message = str(info.value)
    assert expected in message and "\n" not in message, message


ACCEPTED = [
    [],
    ["seed=0"], [f"seed={2**32 - 1}"],
    ["trainer.limit_train_batches=2"], ["trainer.limit_train_batches=0.5"], ["trainer.limit_train_batches=1.0"],
    ["dataset.rewire_every_n_steps=null"], ["dataset.dropout=0"], ["trainer.min_lr=0"],
    ["trainer.precision=bf16-mixed"],
    # the op computes 16-bit activations in float32 under autocast
    ["trainer.precision=bf16-mixed", "model.intermediate=16"], ["model=mach", "trainer.precision=16-mixed"],
    ["trainer.precision=bf16-true", "model=dense"],
    ["trainer.precision=bf16-mixed", "model=dense", "model.intermediate=16"],  # no sparse op
    ["model=mach"], ["model=bottleneck"], ["model=bottleneck", "model.bottleneck_activation=linear"],
    ["model=unstructured"],
    ["trainer.restore_best=always"], ["trainer.shuffle_buffer=null"], ["trainer.shuffle_buffer=1"],
    ["trainer.adam_eps_placement=torch"],
    ["trainer.devices=2"], ["trainer.devices=-1"], ["trainer.devices=auto"], ["trainer.devices=[0,1]"],
    ["trainer.devices='0,1'"], ["trainer=ddp"], ["trainer.strategy=ddp"], ["trainer.num_workers=2"],
    ["trainer.train_eval_max_points=null"], ["validate_on=holdout", "dataset.holdout_fraction=0.2"],
    ["model=dense", "model.head=dense"], ["dataset.propensity.A=0.5", "dataset.propensity.B=0.4"],
    ["model=unstructured", "model.distinct_sources=true"], ["dataset.data_seed=7"],
    ["~callbacks.early_stop", "~callbacks.rewiring"],  # every epoch trained; a static sparse layer
    ["~dataset.rewire_every_n_steps", "model=dense"], ["~dataset.rewire_every_n_steps", "~callbacks.rewiring"],
    ["callbacks.best.monitor=val/p_at_5"], ["callbacks.best.monitor=val/p_at_1", "callbacks.best.mode=max"],
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(o) or "defaults" for o in ACCEPTED])
def test_good_settings_pass(overrides):
    validation.validate(compose(overrides))


def test_a_gpu_asked_for_where_there_is_none_is_refused_before_the_run(monkeypatch):
    import torch

    from xmc_repro import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^trainer.accelerator=gpu but no CUDA device is visible here; use "):
        train.validate(compose(["trainer.accelerator=gpu"]))
    train.validate(compose(["trainer.accelerator=cpu"]))


def test_gpu_ids_on_the_cpu_are_refused_before_the_run(monkeypatch):
    import torch

    from xmc_repro import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^trainer.devices=\[0\] names GPU ids, and this run is on the CPU; give a"):
        train.validate(compose(["trainer.devices=[0]"]))


def test_a_grid_without_multirun_is_refused(tmp_path):
    """experiment=table1 without -m trained the default configuration once, tagged table1."""
    result = subprocess.run([sys.executable, "-m", "xmc_repro", "experiment=table1", "scale=smoke"], env=cli_env(),
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert stderr_lines(result.stderr) == ["error: experiment=table1 is a grid of runs (dataset, +experiment/row); run "
                                           "it with -m: python -m xmc_repro -m experiment=table1 scale=smoke"]


def test_positive_int_is_the_one_check_of_sizes():
    from xmc_repro import model
    from xmc_repro.sparse import checks

    assert model.positive_int is validation.positive_int
    assert checks.check_layer_sizes is validation.check_layer_sizes
    assert validation.positive_int(8, "x") == 8 and validation.positive_int(8.0, "x") == 8
    for bad in (0, -1, 2.5, True, None, "8", float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"^model.connectivity=.* must be a positive integer; set e.g."):
            validation.positive_int(bad, "model.connectivity", example=32)


def test_op_dtypes_match_the_op():
    """validation.SPARSE_OP_DTYPES and SPARSE_OP_AUTOCAST must say what the op takes: update them with the op."""
    import torch

    from xmc_repro.sparse import uniform_sparse_linear

    indices = torch.zeros(2, 3, dtype=torch.int32)
    accepted = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        try:
            uniform_sparse_linear(torch.ones(2, 4, dtype=dtype), indices, torch.ones(2, 3, dtype=dtype))
        except Exception:  # SparseInputError, or no kernel for the dtype
            continue
        accepted.append(str(dtype).removeprefix("torch."))
    assert tuple(accepted) == validation.SPARSE_OP_DTYPES
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = torch.nn.Linear(4, 4)(torch.ones(2, 4))
        assert hidden.dtype == torch.bfloat16
        try:
            autocasts = uniform_sparse_linear(hidden, indices, torch.ones(2, 3)).dtype == torch.float32
        except Exception:
            autocasts = False
    assert autocasts == validation.SPARSE_OP_AUTOCAST


def test_validation_imports_nothing_heavy():
    code = ("import sys, xmc_repro.validation; "
            "print(sorted(m for m in ('torch', 'lightning', 'mlflow', 'numpy', 'hydra') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_bad_value_on_the_command_line_is_refused_before_torch_loads(tmp_path):
    """What the command line imports before `validate` must stay light: a bad value is reported in about a second."""
    code = ("import runpy, sys; sys.argv = ['xmc_repro', 'seed=-1']\n"
            "try:\n    runpy.run_module('xmc_repro', run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
            "print(code, sorted(m for m in ('torch', 'lightning', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr[-2000:]


CLI_CASES = {
    "seed=-1": "error: seed=-1 must be an integer in [0, 4294967295]",
    "trainer.lr=nan": "error: trainer.lr=nan must be a finite number in (0, 1e+37]",
    # Hydra keeps the overrides in its config: reading them resolved this one, with a traceback, before validate
    "trainer.max_epochs=${dataset.max_epoch}": "error: trainer.max_epochs cannot be resolved (Interpolation key "
                                               "'dataset.max_epoch' not found)",
}


def test_through_the_command_line(tmp_path_factory):
    store = make_store(tmp_path_factory.mktemp("store"))

    def one(setting):
        directory = tmp_path_factory.mktemp("cli")
        copy_store(store, directory)
        return directory, cli(directory, [*TINY, setting])

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(CLI_CASES, pool.map(one, CLI_CASES)))
    for setting, (directory, result) in results.items():
        assert result.returncode == 2, result.stderr[-2000:]
        assert stderr_lines(result.stderr) == [CLI_CASES[setting]] or (
            len(stderr_lines(result.stderr)) == 1 and stderr_lines(result.stderr)[0].startswith(CLI_CASES[setting])
        ), result.stderr[-2000:]
        assert runs(directory) == []


# Files of one's own, as the README's "A new last layer" has a user write them: a loss (its function beside them) and
# a dataset, in a config folder of their own (--config-dir). Each mistake below failed the run after its data had
# loaded (a traceback), or as its MLflow run opened with a line blaming the store.
OWN_FILES = {
    "mylosses.py": "def margin_hinge(scores, label_ptr, label_idx, margin=1.0):\n    return scores.sum() * 0\n",
    "myconf/loss/margin_hinge.yaml": "_target_: mylosses.margin_hinge\n_partial_: true\nname: margin_hinge\nmargn: 2.0\n",
    "myconf/dataset/mine.yaml": "features: synthetic\nkind: synthetic\nnum_train: 64\nnum_test: 32\nnum_features: 16\n"
                                "num_labels: 24\nlatent_dim: 4\npropensity: {A: 0.55, B: 1.5}\ndropout: 0.1\n"
                                "max_epochs: 1\nrewire_every_n_steps: 7\n",
}
OWN_CASES = {
    "loss=margin_hinge": "error: loss.margn is not a setting of mylosses.margin_hinge (it takes margin), so it would be "
                         "ignored; fix or remove it in loss/margin_hinge.yaml in your --config-dir folder",
    "dataset=mine": "error: dataset.name=None must be a name (run names and the report name the run by it); add "
                    "`name: MyData` to the dataset's file (conf/dataset/<file>.yaml)",
}


def test_files_of_ones_own_are_checked_before_any_run(tmp_path_factory):
    store = make_store(tmp_path_factory.mktemp("store"))

    def one(choice):
        directory = tmp_path_factory.mktemp("own")
        for name, text in OWN_FILES.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text(text)
        copy_store(store, directory)
        return directory, cli(directory, ["--config-dir", "myconf", *TINY, choice])

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(OWN_CASES, pool.map(one, OWN_CASES)))
    for choice, (directory, result) in results.items():
        assert result.returncode == 2, result.stderr[-2000:]
        assert stderr_lines(result.stderr) == [OWN_CASES[choice]], result.stderr[-2000:]
        assert runs(directory) == []
