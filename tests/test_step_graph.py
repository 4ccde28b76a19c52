"""The CUDA-graph training step: what decides it (CPU), and that it trains as the eager step does (CUDA)."""

from __future__ import annotations

import os
import sys
import types

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY, generator, label_lists, quiet_trainer

from xmc_repro.data import build_datamodule
from xmc_repro.data.labels import flat_keys
from xmc_repro.losses import bce_loss, positive_positions, squared_hinge_loss
from xmc_repro.model import XMCClassifier
from xmc_repro.step_graph import StepGraph, capacity_for, loss_from_positions, padded_positions, unsupported_reason

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _buffer(idx: torch.Tensor, capacity: int) -> torch.Tensor:
    """The labels as the graph holds them: a fixed-size buffer, its tail left from an earlier batch."""
    out = torch.randint(0, 1000, (capacity,))
    out[:idx.numel()] = idx
    return out


@pytest.mark.parametrize("seed", range(6))
def test_positions_from_the_fixed_buffers_are_the_sorted_list_padded_with_its_last(seed):
    gen = generator(seed)
    rows, labels = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(5, 40, (1,), generator=gen))
    ptr, idx = label_lists(gen, rows, labels, most=4, least=0)  # rows without labels among them
    if idx.numel() == 0:
        ptr[-1], idx = 1, torch.tensor([labels - 1])
    idx[1:] = torch.where(torch.rand(idx.numel() - 1, generator=gen) < 0.2, idx[:-1], idx[1:])  # repeats
    want = positive_positions(ptr, idx, labels, "cpu")
    capacity = idx.numel() + int(torch.randint(0, 9, (1,), generator=gen))
    got = padded_positions(ptr[1:].clone(), _buffer(idx, capacity), labels)
    assert got.tolist() == want.tolist() + [want[-1].item()] * (capacity - idx.numel())
    in_order = flat_keys(ptr, idx, labels)  # the losses' form: list order, padded with -1
    got = padded_positions(ptr[1:].clone(), _buffer(idx, capacity), labels, sort=False)
    assert got.tolist() == in_order.tolist() + [-1] * (capacity - idx.numel())


@pytest.mark.parametrize("count,capacity", [(1, 256), (256, 256), (257, 512), (5000, 8192)])
def test_capacity_is_a_power_of_two_that_holds_the_count(count, capacity):
    assert capacity_for(count) == capacity


@pytest.mark.parametrize("loss", ["squared_hinge", "bce"])
def test_both_losses_have_a_positive_list_form_that_matches(loss):
    """The graph calls `from_positions` with a padded list: same value and gradient as the label-list form. Both
    take the list order padded with -1 (as the graph calls them), and still the sorted list padded with its last."""
    gen = generator(1)
    scores = torch.randn(5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    ptr, idx = label_lists(gen, 5, 11, most=3, least=1)
    fn = {"squared_hinge": squared_hinge_loss, "bce": bce_loss}[loss]
    want = fn(scores, ptr, idx)
    (want_grad,) = torch.autograd.grad(want, scores)
    form = loss_from_positions(fn)
    assert getattr(form, "any_order", False)  # the graph calls it with -1 padding, unsorted
    for sort in (False, True):
        padded = padded_positions(ptr[1:].clone(), _buffer(idx, capacity_for(idx.numel())), 11, sort=sort)
        got = form(scores, padded)
        (got_grad,) = torch.autograd.grad(got, scores)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)


def _fake_model(**overrides):
    """The attributes `unsupported_reason` reads, as a graph-capable CUDA model has them."""
    model = types.SimpleNamespace(device=torch.device("cuda"), head=torch.nn.Linear(2, 3),
                                  loss_fn=squared_hinge_loss, modules=lambda: [torch.nn.Linear(2, 3)])
    for key, value in overrides.items():
        setattr(model, key, value)
    return model


def test_reasons_for_an_eager_step():
    from xmc_repro.sparse.layers import UnstructuredSparseLinear

    assert unsupported_reason(_fake_model()) is None
    assert "CUDA" in unsupported_reason(_fake_model(device=torch.device("cpu")))
    assert "DDP" in unsupported_reason(_fake_model(), world_size=2)
    assert "precision" in unsupported_reason(_fake_model(), precision="16-mixed")
    assert unsupported_reason(_fake_model(), precision="bf16-mixed") is None
    assert "positive list" in unsupported_reason(_fake_model(loss_fn=lambda s, p, i: s.sum()))
    sparse = UnstructuredSparseLinear(8, 5, 2)
    assert "UnstructuredSparseLinear" in unsupported_reason(_fake_model(modules=lambda: [sparse]))
    mach = types.SimpleNamespace(meta_labels=lambda p, i: (p, i))
    assert "targets" in unsupported_reason(_fake_model(head=mach))


def test_a_cpu_run_keeps_the_eager_step(tmp_path):
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    trainer = quiet_trainer(tmp_path, max_steps=2, limit_val_batches=0, accelerator="cpu")
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert model._step_graph is None and "CUDA" in model._graph_off


# ------------------------------------------------------------------------------------------- on a GPU


def _uniform_model(dropout=0.0, loss="squared_hinge", head="uniform", device="cuda"):
    torch.manual_seed(0)
    return XMCClassifier(24, 50, head=head, connectivity=5, intermediate=40, dropout=dropout, loss=loss).to(device)


def _batches(count, batch=8, seed=3, device="cuda"):
    gen = generator(seed)
    out = []
    for i in range(count):
        big = i == 2  # more positives than the first capture's capacity (256)
        ptr, idx = label_lists(gen, batch, 50, most=50 if big else 3, least=40 if big else 1)
        out.append((torch.randn(batch, 24, generator=gen).to(device), ptr.to(device), idx.to(device)))
    return out


def _graph_vs_eager(loss, head, device="cuda"):
    """Five Adam steps with a rewiring in between, graphed and eager: (losses, parameters, captures) of each."""
    batches = _batches(5, device=device)
    results = []
    for graphed in (False, True):
        model = _uniform_model(loss=loss, head=head, device=device)
        optimizer = model.configure_optimizers()["optimizer"]
        graph = StepGraph(model, loss_from_positions(model.loss_fn), 50)
        losses = []
        for i, (x, ptr, idx) in enumerate(batches):
            if graphed:
                loss_value = graph.step(x, ptr, idx)
                graph.attach_grads()
            else:
                loss_value = model.loss_fn(model(x), ptr, idx)
                loss_value.backward()
            losses.append(float(loss_value))
            optimizer.step()
            model.zero_grad(set_to_none=True)
            if i == 1:
                for layer in model.sparse_layers():
                    layer.rewire(0.3, generator(7))
        results.append((losses, [p.detach().clone() for p in model.parameters()], graph.captures))
    return results


def _assert_same_training(results):
    (eager_losses, eager_params, _), (graph_losses, graph_params, captures) = results
    assert captures == 2  # the first batch, and the one with more positives than the capacity
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-5, atol=1e-7)
    for got, want in zip(graph_params, eager_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("loss", ["squared_hinge", "bce"])
@pytest.mark.parametrize("head", ["uniform", "dense"])
def test_graphed_steps_train_as_eager_steps_do(loss, head):
    """Five Adam steps with a rewiring in between: the same weights whether the step is graphed or eager."""
    _assert_same_training(_graph_vs_eager(loss, head))


class _ReplayedEagerly:
    """On a CPU, a stand-in for `torch.cuda.CUDAGraph`: replaying runs the captured step again and writes its loss
    and gradients into the captured ones, as a CUDA graph's replay does. It checks the step's own bookkeeping
    (buffers, positions, recaptures, gradients handed to the optimizer), not CUDA."""

    owner: StepGraph | None = None

    def replay(self):
        step = _ReplayedEagerly.owner  # (after a capture this runs the step a second time, to the same result)
        for p in step.params:
            p.grad = None
        loss = step._forward_backward()
        step.static_loss.copy_(loss)
        for static, p in zip(step.static_grads, step.params):
            static.copy_(p.grad)
            p.grad = static


@pytest.mark.parametrize("loss", ["squared_hinge", "bce"])
@pytest.mark.parametrize("head", ["uniform", "dense"])
def test_the_graph_steps_bookkeeping_trains_as_eager_steps_do_on_a_cpu(loss, head, monkeypatch):
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _ReplayedEagerly)
    init = StepGraph.__init__

    def remember(self, *args):
        init(self, *args)
        _ReplayedEagerly.owner = self

    monkeypatch.setattr(StepGraph, "__init__", remember)
    _assert_same_training(_graph_vs_eager(loss, head, device="cpu"))


@pytest.mark.cuda
@cuda
def test_a_replaced_parameter_makes_the_next_step_recapture():
    model = _uniform_model()
    graph = StepGraph(model, loss_from_positions(model.loss_fn), 50)
    (x, ptr, idx), = _batches(1)
    graph.step(x, ptr, idx)
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    graph.step(x, ptr, idx)
    assert graph.captures == 2


@pytest.mark.cuda
@cuda
def test_lightning_fit_with_the_graph_matches_the_eager_fit(tmp_path):
    """Same seed, same data, dropout on: the graphed run's validation P@k is the eager run's, within noise."""
    import lightning.pytorch as pl

    from xmc_repro.callbacks import Rewiring

    scores = {}
    for graphed in (False, True):
        pl.seed_everything(0, verbose=False)
        model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4,
                              intermediate=32, cuda_graph=graphed)
        trainer = quiet_trainer(tmp_path, max_epochs=3, accelerator="cuda", devices=1,
                                callbacks=[Rewiring(0.1, every_n_steps=8)])
        trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=20, seed=0, pin_memory=True))
        assert (model._step_graph is not None) == graphed
        scores[graphed] = float(trainer.callback_metrics["val/p_at_1"])
    # 3 epochs of 15 full batches. Released at each rewiring (after steps 1, 9, ..., 41) and validation (after 15
    # and 30: the last one is at the end), each time captured again at the next step; the first step captures.
    assert model._step_graph.captures == 1 + 6 + 2 and model._step_graph.graph is None
    assert all(p.grad is None for p in model.parameters())
    assert abs(scores[True] - scores[False]) < 5.0, scores


class _TensorReads(pl.Callback):
    """Counts Tensor.item() and float(tensor) calls from the second training batch to the start of the last, but
    those of torch's optimizers: on a CPU, Adam reads its step counter (fused CUDA Adam keeps it on the device)."""

    def __init__(self, monkeypatch):
        self.reads, self.counting = 0, False
        for name in ("item", "__float__"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original):
                caller = sys._getframe(1).f_code.co_filename
                self.reads += self.counting and f"torch{os.sep}optim" not in caller
                return _original(tensor, *args)
            monkeypatch.setattr(torch.Tensor, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counting = 1 <= batch_idx < trainer.num_training_batches - 1


@pytest.mark.parametrize("bar", ["progress", "epoch_line"])
def test_the_training_loop_reads_no_tensor_back_per_step(tmp_path, monkeypatch, bar):
    """A tensor read waits for the GPU to finish the step: the console and logging must not read one per step."""
    from xmc_repro.console import EpochLine, ProgressBar

    reads = _TensorReads(monkeypatch)
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    shown = ProgressBar() if bar == "progress" else EpochLine()
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_val_batches=1, accelerator="cpu", callbacks=[reads, shown],
                            enable_progress_bar=bar == "progress")
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert trainer.num_training_batches > 10 and reads.reads == 0


def test_a_failed_capture_leaves_the_run_training_eagerly(tmp_path):
    """A capture that fails (an op that syncs, say) costs speed, not the run: the step falls back, with a warning."""
    from xmc_repro.step_graph import CaptureError

    class FailingGraph:
        calls = 0

        def step(self, x, label_ptr, label_idx):
            FailingGraph.calls += 1
            raise CaptureError("RuntimeError: operation not permitted when stream is capturing")

    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4, intermediate=32)
    model._step_graph = FailingGraph()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(tmp_path, max_steps=4, limit_val_batches=0, accelerator="cpu")
    with pytest.warns(UserWarning, match="runs eagerly: its CUDA graph capture failed"):
        trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert FailingGraph.calls == 1 and model._step_graph is None and "not permitted" in model._graph_off
    assert trainer.global_step == 4 and all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


def test_the_graphed_step_frees_the_scores_before_backward_as_the_eager_step_does():
    """The squared hinge keeps only its gradient; if the step still held the scores, the capture would peak a whole
    (batch x labels) tensor higher than the eager step (82 MiB at 670k labels and batch 32)."""
    import weakref

    model = _uniform_model(device="cpu")
    alive_in_backward = []

    def loss(scores, positives):
        scores_ref = weakref.ref(scores)
        out = loss_from_positions(model.loss_fn)(scores, positives)
        out.register_hook(lambda grad: alive_in_backward.append(scores_ref() is not None))
        return out

    graph = StepGraph(model, loss, 50)
    (x, ptr, idx), = _batches(1, device="cpu")
    graph.static_x, graph.static_ends = x, ptr[1:].long()
    graph.static_labels = idx.long()
    graph._forward_backward()
    assert alive_in_backward == [False]


@pytest.mark.cuda
@cuda
def test_captures_releases_and_evaluations_leave_no_memory_behind():
    """Each capture's side-stream cuBLAS workspace and each evaluation's are dropped at release: memory after
    repeated capture / release / evaluation cycles is what it was after the first (which made one-time state)."""
    model = _uniform_model()
    graph = StepGraph(model, loss_from_positions(model.loss_fn), 50)
    batches = _batches(2)

    def cycle():
        graph.step(*batches[0])
        graph.release()
        with torch.no_grad():
            model(batches[1][0])  # a matmul on the current stream: its own cuBLAS workspace
        graph.release()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    first = cycle()
    assert [cycle() for _ in range(3)] == [first] * 3
