"""Runs at the paper's label counts on a machine that may be too small: a model that cannot fit in memory is refused in
one line before it is built (not OOM-killed without a word), and the long phases show what they are doing (loading
the data, the final test and train evaluations, minutes at 670k labels on a CPU). Small shapes only."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from xmc_repro.console import EvaluationProgress
from xmc_repro.errors import ConfigError
from xmc_repro.host_memory import check_fits, training_bytes

from test_reliability_common import TINY, cli, runs, stderr_lines
from test_reliability_common import no_run_left_running  # noqa: F401  (autouse)

GIB = 2**30
AMAZON_BOW = (135_909, 670_091)  # Amazon-670K's bag-of-words inputs and labels


def _model(head="uniform", **settings):
    return OmegaConf.create({"head": head, "intermediate": None, "connectivity": 32 if head == "uniform" else None,
                             **settings})


def test_a_model_whose_training_state_exceeds_the_memory_is_refused_naming_the_need_and_the_fix():
    # 1.1e9 parameters: 17 GiB for weights, gradients and moments (with the unfused CPU Adam's 8.3 GiB of
    # temporaries, OOM-killed at its first optimizer step on a 24 GiB machine before the check)
    with pytest.raises(ConfigError, match=r"^model=uniform with model.intermediate=8192 over 135,909 inputs .* needs "
                                          r"at least 17\.0 GiB of memory to train on the CPU \(weights, gradients "
                                          r"and Adam's two moments\), but 16\.0 GiB is available; lower "
                                          r"model.intermediate"):
        check_fits(_model(intermediate=8192), *AMAZON_BOW, on_cpu=True, available=16 * GIB)
    with pytest.raises(ConfigError, match=r"model=dense over .* 91,072,067,810 parameters .* use a sparse head"):
        check_fits(_model("dense"), *AMAZON_BOW, on_cpu=True, available=22 * GIB)
    # what fits is not refused: the uniform head alone (0.4 GiB), the dense head over 768-d embeddings (7.7 GiB)
    check_fits(_model(), *AMAZON_BOW, on_cpu=True, available=22 * GIB)
    check_fits(_model("dense"), 768, 670_091, on_cpu=True, available=22 * GIB)
    # a GPU run holds only the weights on the host; two CPU DDP ranks hold two copies
    check_fits(_model(intermediate=8192), *AMAZON_BOW, on_cpu=False, available=22 * GIB)
    with pytest.raises(ConfigError, match=r"x 2 processes"):
        check_fits(_model("dense"), 768, 670_091, on_cpu=True, processes=2, available=12 * GIB)
    # the head's own size settings are named
    with pytest.raises(ConfigError, match=r"available; lower model.mach.num_buckets or model.mach.num_hashes, use a "
                                          r"sparse head \(model=uniform\), or run on a machine with more memory$"):
        check_fits(_model("mach", mach={"num_hashes": 8, "num_buckets": 10**8}), 768, 670_091, on_cpu=True,
                   available=22 * GIB)
    with pytest.raises(ConfigError, match=r"available; lower model.bottleneck, use a sparse head"):
        check_fits(_model("bottleneck", bottleneck=3 * 10**8), 768, 670_091, on_cpu=True, available=22 * GIB)
    # a head of one's own: sizes unknown, nothing refused
    assert training_bytes(_model("lowrank"), *AMAZON_BOW, on_cpu=True) is None


def test_the_dense_input_batch_counts_toward_the_need(monkeypatch):
    """Bag-of-words batches are made dense: a header declaring 2e9 features passed the check with a uniform head (a
    few parameters) and was OOM-killed at its first batch of 32 x 2e9 float32, its MLflow run left RUNNING."""
    with pytest.raises(ConfigError, match=r"needs at least 238\.4 GiB .* and a dense input batch of 32 x "
                                          r"2,000,000,000\), but 16\.0 GiB is available; lower trainer\.batch_size "
                                          r"and trainer\.eval_batch_size \(or check the data's feature count\)"):
        check_fits(_model(), 2_000_000_000, 3, on_cpu=True, available=16 * GIB, batch_rows=32)
    # a head of one's own (its size unknown) was let through whatever the batch
    with pytest.raises(ConfigError, match=r"^a dense input batch of 32 x 2,000,000,000 needs at least 238\.4 GiB of "
                                          r"memory, but 16\.0 GiB is available; lower trainer\.batch_size"):
        check_fits(_model("lowrank"), 2_000_000_000, 3, on_cpu=True, available=16 * GIB, batch_rows=32)
    check_fits(_model(), *AMAZON_BOW, on_cpu=True, available=GIB, batch_rows=32)  # 35 MB of batch: fits
    # train.check_memory takes the larger of the training and evaluation batches, at most a split's points
    with pytest.raises(ConfigError, match=r"dense input batch of 100 x 768"):
        _check_memory(monkeypatch, int(7.67 * GIB), ["trainer.eval_batch_size=100"])


def test_the_estimate_is_the_parameters_four_times():
    """The pipeline's CPU Adam is fused: its step adds the two moments and no parameter-sized temporaries, which the
    estimate counted for the unfused step (8.3 GiB of 25.3 at 1.1e9 parameters: models that fit were refused). A
    dense 768 -> 200,000 run now peaks at 2.9 GiB RSS; the estimate was 3.4 GiB for its parameters alone."""
    from xmc_repro.optim import adam

    need, weights = training_bytes(_model("dense"), 768, 670_091, on_cpu=True)
    assert weights == 768 * 670_091 + 670_091
    assert need == 4 * 4 * weights
    need, _ = training_bytes(_model(), 768, 670_091, on_cpu=True)
    assert need == 4 * 4 * (32 * 670_091 + 670_091) + 4 * 32 * 670_091  # + int32 indices
    assert adam([torch.nn.Parameter(torch.zeros(3))], 1e-3, 1e-7, "keras", torch.device("cpu")).defaults["fused"]


@pytest.mark.parametrize("head", ["dense", "uniform", "unstructured", "bottleneck", "mach"])
@pytest.mark.parametrize("intermediate", ["null", "16"])
def test_the_sizes_are_those_of_the_model_the_config_builds(head, intermediate):
    from xmc_repro.host_memory import model_sizes
    from xmc_repro.model import XMCClassifier

    from test_config_instantiate import _compose

    cfg = _compose([f"model={head}", f"model.intermediate={intermediate}", "model.connectivity=4"]).model
    model = XMCClassifier(20, 50, **OmegaConf.to_container(cfg, resolve=True))
    params = [p.numel() for p in model.parameters()]
    buffers = sum(b.numel() * b.element_size() for b in model.head.buffers())
    assert model_sizes(cfg, 20, 50) == (sum(params), buffers)


def test_the_run_checks_memory_after_loading_the_data_and_before_building_the_model(tmp_path, monkeypatch):
    from xmc_repro import host_memory, train

    from test_config_instantiate import _compose

    cfg = _compose(["dataset=synthetic", "dataset.num_train=64", "dataset.num_test=16", "dataset.num_features=8",
                    "dataset.num_labels=12", "model.connectivity=4", "trainer.accelerator=cpu"])
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1000)

    def built(*args, **kwargs):
        raise AssertionError("the model was built before its memory was checked")

    monkeypatch.setattr(train, "build_model", built)
    with pytest.raises(ConfigError, match=r"needs at least .* GiB of memory to train on the CPU"):
        train._fit_and_test(cfg, None, tmp_path, None, {})


def test_through_the_command_line_a_model_too_large_is_one_line_and_a_failed_run(tmp_path):
    result = cli(tmp_path, [*TINY, "dataset.num_features=135909", "dataset.num_labels=670091", "model=dense",
                            "trainer.max_epochs=1"], timeout=240)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = stderr_lines(result.stderr)
    assert line.startswith("error: model=dense over 135,909 inputs and 670,091 labels has 91,072,067,810 parameters")
    [run] = runs(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["error"] == line.removeprefix("error: ")


def test_the_final_evaluations_and_the_data_loading_say_what_they_are_doing(finished_run):
    *_, result = finished_run  # TINY, one epoch
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "data: Synthetic, loading ..."
    assert lines[1].startswith("data: 320 training and 96 test points, 24 features, 40 labels (")
    # batches of 16 (trainer.batch_size): 96 test points, 96 of the training points (train_eval_max_points)
    assert "Test: 6 batches" in lines and "Train P@k: 6 batches" in lines
    assert lines.index("Test: 6 batches") < lines.index("Train P@k: 6 batches") < next(
        i for i, line in enumerate(lines) if "MLflow run" in line)


@pytest.mark.parametrize("bar", [False, True])
def test_evaluation_progress_passes_every_batch_through_and_reports_while_it_runs(bar, capsys):
    batches = [object() for _ in range(5)]
    shown = EvaluationProgress(bar, every_s=0.0)
    assert list(shown.track(batches, "Test")) == batches
    out = capsys.readouterr().out
    if bar:
        assert "Test" in out and "5/5" in out
    else:
        assert out.splitlines() == ["Test: 5 batches", *(f"Test: {i}/5 batches, 0 s" for i in range(1, 5))]


def _check_memory(monkeypatch, available, overrides=(), rank=None):
    """train.check_memory for a dense head over Amazon-670K's labels and 768 inputs (7.7 GiB float32 on a CPU)."""
    from types import SimpleNamespace

    from xmc_repro import host_memory, train

    from test_config_instantiate import _compose

    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    if rank is not None:
        monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setattr(host_memory, "available_bytes", lambda: available)
    cfg = _compose(["model=dense", "trainer.accelerator=cpu", *overrides])
    train.check_memory(cfg, SimpleNamespace(num_features=768, num_labels=670_091, num_train_points=490_449,
                                            test_split=SimpleNamespace(num_points=153_025)))


def test_only_rank_0_checks_the_memory_for_every_rank(monkeypatch):
    """A later rank checks when rank 0 already holds its data and model: it refused alone a model that fits, and
    rank 0, killed by Lightning's observer, left its MLflow run RUNNING."""
    with pytest.raises(ConfigError, match=r"x 2 processes"):
        _check_memory(monkeypatch, 12 * GIB, ["trainer=ddp", "trainer.devices=2"])
    _check_memory(monkeypatch, 12 * GIB, ["trainer=ddp", "trainer.devices=2"], rank=1)


def test_16_bit_weights_need_half_the_memory_on_a_cpu(monkeypatch):
    """bf16-true trains 16-bit weights, gradients and moments (measured: 0.67 GiB peak for a 50M-parameter dense
    layer whose float32 estimate is 0.75 GiB): the float32 estimate refused models that fit."""
    need32, weights = training_bytes(_model("dense"), 768, 670_091, on_cpu=True)
    need16, _ = training_bytes(_model("dense"), 768, 670_091, on_cpu=True, value_bytes=2)
    assert need16 == need32 // 2 and need16 >= 4 * weights  # never below the float32 model it is built as
    with pytest.raises(ConfigError, match=r"needs at least 7\.7 GiB"):
        _check_memory(monkeypatch, 6 * GIB)
    _check_memory(monkeypatch, 6 * GIB, ["trainer.precision=bf16-true"])
