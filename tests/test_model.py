"""The LightningModule's training step as Lightning drives it, and the checkpoint's finiteness check."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY, generator, quiet_trainer

from xmc_repro.checkpoints import all_finite
from xmc_repro.data import build_datamodule
from xmc_repro.model import XMCClassifier


class _GradientsAfterStep(pl.Callback):
    def __init__(self):
        self.live_gradients = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.live_gradients.append(sum(p.grad is not None for p in pl_module.parameters()))


def test_gradients_are_freed_after_each_optimizer_step(tmp_path):
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    before = [p.detach().clone() for p in model.parameters()]
    seen = _GradientsAfterStep()
    trainer = quiet_trainer(tmp_path, max_steps=5, limit_val_batches=0, callbacks=[seen])
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert seen.live_gradients == [0] * 5
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))  # every step applied


@pytest.mark.parametrize("head", ["uniform", "dense"])
def test_bf16_mixed_precision_trains_with_an_intermediate_layer(tmp_path, head):
    """Autocast hands the last layer bf16 activations: the sparse op computes them in float32 (its weights')."""
    torch.manual_seed(0)
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head=head, connectivity=4, intermediate=32)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(tmp_path, max_steps=4, limit_val_batches=1, precision="bf16-mixed")
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    assert torch.isfinite(trainer.callback_metrics["train/loss_epoch"])


@pytest.mark.parametrize("precision, head, head_input", [
    ("bf16-mixed", "uniform", torch.bfloat16),  # autocast, as in validation
    ("64-true", "uniform", torch.float64),      # inputs converted to the parameters' dtype (a crash before)
    ("bf16-true", "dense", torch.bfloat16),
])
def test_the_final_evaluation_computes_as_validation_does(tmp_path, precision, head, head_input):
    """The test and train P@k after fit run through the trainer's precision, as its validation does; the scores of
    the validation loop and of `evaluate` then agree."""
    torch.manual_seed(0)
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head=head, connectivity=4, intermediate=32)
    dm = build_datamodule(TINY, batch_size=16, seed=0)
    trainer = quiet_trainer(tmp_path, max_steps=4, limit_val_batches=0, precision=precision)
    trainer.fit(model, datamodule=dm)
    seen = []
    model.head.register_forward_hook(lambda module, args, out: seen.append(args[0].dtype))
    metrics = model.evaluate(dm.test_dataloader(), precision=trainer.precision_plugin)
    assert set(seen) == {head_input} and 0 <= metrics["p_at_3"] <= 100
    [validated] = quiet_trainer(tmp_path, precision=precision).validate(model, datamodule=dm, verbose=False)
    assert metrics["p_at_3"] == pytest.approx(validated["val/p_at_3"], abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_all_finite_agrees_with_isfinite(dtype, bad):
    values = torch.randn(1001, generator=generator(0)).to(dtype)
    if bad is not None:
        values[500] = bad
    assert all_finite(values) == bool(torch.isfinite(values).all()) == (bad is None)
    assert all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.arange(3))


def test_summary_keeps_the_mlflow_ui_command_on_one_line(capsys):
    from omegaconf import OmegaConf

    from xmc_repro.entry import print_summary

    ui = "mlflow ui --backend-store-uri sqlite:////a/rather/long/path/to/some/experiment/folder/mlruns.db"
    results = {f"{s}/p_at_{k}": 1.0 for s in ("test", "train") for k in (1, 3, 5)}
    results.update(peak_gpu_memory_gib=0.853, epochs=1, time_per_epoch_s=86.7, device="NVIDIA H200 [0]",
                   run_id="0" * 32, ui=ui)
    print_summary(OmegaConf.create({"dataset": {"name": "Tiny"}, "model": {"head": "uniform"}}), results)
    lines = capsys.readouterr().out.splitlines()
    assert f"MLflow run {'0' * 32}; browse with: {ui}" in lines
    assert any(line.endswith("| device: NVIDIA H200 [0]") and line.startswith("peak GPU memory: 0.853 GiB")
               for line in lines)


def test_the_loss_reaches_the_logger_as_lightning_would_write_it(tmp_path):
    """`train/loss_step` at every log_every_n_steps-th step with that step's loss; `train/loss_epoch` = the epoch's
    mean of the step losses weighted by batch size (the model logs neither at other steps: self.log is slow)."""
    from lightning.pytorch.loggers import Logger

    class Recorder(Logger):
        name, version = "recorder", "0"
        metrics: list = []

        @property
        def experiment(self):
            return None

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.metrics.append((step, dict(metrics)))

    class Losses(pl.Callback):
        seen: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append((float(outputs["loss"]), batch[0].shape[0]))

    torch.manual_seed(0)
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    recorder, losses = Recorder(), Losses()
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_val_batches=1, logger=recorder, log_every_n_steps=4,
                            callbacks=[losses])
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    steps = {step: m["train/loss_step"] for step, m in recorder.metrics if "train/loss_step" in m}
    assert sorted(steps) == [3, 7, 11, 15]
    assert all(abs(steps[s] - losses.seen[s][0]) < 1e-6 for s in steps)
    (epoch_loss,) = [m["train/loss_epoch"] for _, m in recorder.metrics if "train/loss_epoch" in m]
    want = sum(loss * n for loss, n in losses.seen) / sum(n for _, n in losses.seen)
    assert abs(epoch_loss - want) < 1e-6


class _TwoEqualRanks:
    """A DDP strategy's sum over two ranks that hold the same values."""

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "sum"
        return tensor * 2


@pytest.mark.parametrize("world, all_ranks, want", [
    (2, True, (3.0, 6.0)),  # each rank of two takes its half of the file's all-rank sums
    (1, True, (6.0, 12.0)),  # one process resumes a DDP run's checkpoint with all of them
    (2, False, (6.0, 12.0)),  # a checkpoint from before holds rank 0's sums: every rank takes them whole
])  # fmt: skip
def test_mid_epoch_checkpoint_keeps_the_epoch_loss_of_all_ranks(world, all_ranks, want):
    from types import SimpleNamespace

    saver = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4)
    saver._losses.load_totals(3.0, 6)  # this rank's; the other holds the same
    saver._trainer = SimpleNamespace(world_size=2, strategy=_TwoEqualRanks())
    checkpoint = {}
    saver.on_save_checkpoint(checkpoint)
    assert checkpoint["epoch_loss"] == {"sum": 6.0, "points": 12.0, "all_ranks": True}
    if not all_ranks:
        del checkpoint["epoch_loss"]["all_ranks"]

    loader = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4)
    loader._trainer = SimpleNamespace(world_size=world, strategy=_TwoEqualRanks())
    loader.on_load_checkpoint(checkpoint)
    assert loader._losses.totals() == want
    assert loader.epoch_loss() == pytest.approx(0.5)
