"""The fused squared hinge op ``xmc_sparse::squared_hinge``: loss and gradient against a dense computation,
compiled kernel vs reference, opcheck, and the autograd wrapper in xmc_repro.losses."""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, generator

from xmc_repro.losses import squared_hinge_from_positions, squared_hinge_loss
from xmc_repro.sparse import backend
from xmc_repro.sparse import reference as ref
from xmc_repro.sparse.op import ensure_registered

ensure_registered()
OPS = torch.ops.xmc_sparse
FLOATS = [torch.float32, torch.float64]


def dense(scores, positives):
    """Loss and gradient from the (B, L) target built densely."""
    y = torch.zeros(scores.numel(), dtype=scores.dtype, device=scores.device)
    y[positives[positives >= 0]] = 1
    s = scores.detach().clone().requires_grad_()
    loss = ((1 - (2 * y.view_as(s) - 1) * s).clamp(min=0) ** 2).mean()
    (grad,) = torch.autograd.grad(loss, s)
    return loss.detach(), grad


def case(b, labels, dtype=torch.float32, device="cpu", seed=0):
    """Scores with entries exactly at s = -1 and s = 1; unsorted positions with repeats and padding (-1),
    some of them at the hinge points."""
    g = generator(seed)
    n = b * labels
    scores = torch.randn(n, generator=g, dtype=dtype) * 1.5
    hinge = torch.randperm(n, generator=g)[: max(2, n // 4)] if n >= 2 else torch.arange(n)
    scores[hinge[0::2]] = -1.0
    scores[hinge[1::2]] = 1.0
    positives = torch.randint(n, (n // 3 + 1,), generator=g) if n else torch.zeros(0, dtype=torch.long)
    positives = torch.cat([positives, positives[:2], hinge[:2], torch.full((3,), -1)])  # repeats, padding
    positives = positives[torch.randperm(len(positives), generator=g)]
    return scores.view(b, labels).to(device), positives.to(device)


def check(got, want, **tol):
    torch.testing.assert_close(got[0], want[0], equal_nan=True, **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    assert got[0].dtype == got[1].dtype == want[1].dtype and got[0].shape == () and got[1].shape == want[1].shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("b", [1, 3, 7])
@pytest.mark.parametrize("labels", [1, 5, 1001])
def test_op_and_reference_match_dense(device, dtype, b, labels):
    scores, positives = case(b, labels, dtype, device, seed=b * labels)
    want = dense(scores, positives)
    check(OPS.squared_hinge(scores, positives), want)
    check(ref.squared_hinge(scores, positives), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_empty_positives_all_padding_and_empty_batch(device, dtype):
    scores, _ = case(3, 11, dtype, device)
    for positives in (torch.zeros(0, dtype=torch.long), torch.full((4,), -1)):
        positives = positives.to(device)
        check(OPS.squared_hinge(scores, positives), dense(scores, positives))
        check(ref.squared_hinge(scores, positives), dense(scores, positives))
    empty = torch.zeros(0, 11, dtype=dtype, device=device)
    no_pos = torch.zeros(0, dtype=torch.long, device=device)
    for fn in (OPS.squared_hinge, ref.squared_hinge):
        loss, grad = fn(empty, no_pos)
        assert torch.isnan(loss) and grad.shape == (0, 11)  # a mean over nothing, as torch's .mean()


@pytest.mark.parametrize("device", DEVICES)
def test_every_entry_positive_and_each_repeated(device):
    scores, _ = case(4, 9, torch.float64, device)
    positives = torch.arange(36, device=device).repeat(3).flip(0)
    check(OPS.squared_hinge(scores, positives), dense(scores, positives))


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_scores_and_a_length_that_is_no_multiple_of_four(device):
    """A contiguous view at an odd storage offset (no 16-byte vectors) and N % 4 != 0 (a scalar tail)."""
    g = generator(3)
    buf = torch.randn(1 + 5 * 4099, generator=g).to(device)
    scores = buf[1:].view(5, 4099)
    positives = torch.randint(scores.numel(), (40,), generator=g).to(device)
    check(OPS.squared_hinge(scores, positives), dense(scores, positives))
    check(OPS.squared_hinge(buf[:-1].view(5, 4099), positives), dense(buf[:-1].view(5, 4099), positives))


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_score_gives_a_nan_loss(device):
    """The non-finite loss watch relies on it: relu must not turn NaN into 0."""
    scores, positives = case(3, 50, torch.float32, device)
    for at in (7, int(positives[positives >= 0][0])):  # at a negative and at a positive entry
        bad = scores.clone()
        bad.view(-1)[at] = float("nan")
        for fn in (OPS.squared_hinge, ref.squared_hinge):
            assert torch.isnan(fn(bad, positives)[0])


def test_compiled_cpu_kernel_matches_the_chunked_reference(monkeypatch):
    monkeypatch.setattr(ref, "_CHUNK_ELEMENTS", 1000)  # many chunks
    for dtype in FLOATS:
        scores, positives = case(32, 3001, dtype, seed=5)
        check(OPS.squared_hinge(scores, positives), ref.squared_hinge(scores, positives))


def test_out_of_range_position_is_an_error():
    with pytest.raises((RuntimeError, IndexError)):
        OPS.squared_hinge(torch.zeros(2, 3), torch.tensor([6]))


@pytest.mark.parametrize("call, message", [
    (lambda s, p: OPS.squared_hinge(s[0], p), "2-D"),
    (lambda s, p: OPS.squared_hinge(s.int(), p), "float32/float64"),
    (lambda s, p: OPS.squared_hinge(s, p.int()), "int64"),
])
def test_bad_inputs(call, message):
    """The compiled kernel's checks (checks.h) and the fake kernel's; the reference does not check."""
    scores, positives = case(3, 5)
    for device in ("meta", *(["cpu"] if backend("cpu") != "reference" else [])):
        with pytest.raises(RuntimeError, match=message):
            call(scores.to(device), positives.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 1001)])
def test_opcheck(device, shape):
    """Schema, fake kernel and dynamic-shape tracing agree with the kernel. The op has no autograd of its own
    (xmc_repro.losses wraps it), so the inputs do not require grad. (B = 0 is left out: its NaN loss never
    compares equal.)"""
    for dtype in FLOATS:
        scores, positives = case(*shape, dtype, device)
        torch.library.opcheck(OPS.squared_hinge.default, (scores, positives))


# ---------------------------------------------------------------- the autograd wrapper


def csr(b, labels, seed):
    g = generator(seed)
    counts = torch.randint(0, 5, (b,), generator=g)
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    idx = torch.randint(labels, (int(counts.sum()),), generator=g)  # may repeat a label within a row
    positives = torch.repeat_interleave(torch.arange(b), counts) * labels + idx
    return ptr, idx, positives


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_public_losses_give_the_dense_gradient(device, dtype):
    scores, _ = case(6, 37, dtype, device, seed=11)
    ptr, idx, positives = csr(6, 37, seed=12)
    want = dense(scores, positives.to(device))
    leaf = scores.clone().requires_grad_()
    loss = squared_hinge_loss(leaf, ptr, idx)  # labels on the host, scores maybe on the GPU
    loss.backward()
    check((loss.detach(), leaf.grad), want)
    padded = torch.cat([positives.flip(0), torch.full((9,), -1)]).to(device)  # a fixed-capacity list
    leaf.grad = None
    loss = squared_hinge_from_positions(leaf, padded)
    (loss * 3).backward()
    check((loss.detach(), leaf.grad / 3), want)


def test_backward_keeps_only_the_gradient_and_scales_it_by_grad_out():
    scores, _ = case(4, 10, torch.float64)
    _, _, positives = csr(4, 10, seed=2)
    leaf = scores.clone().requires_grad_()
    loss = squared_hinge_from_positions(leaf, positives)
    (saved,) = loss.grad_fn.saved_tensors
    assert saved.shape == leaf.shape and saved.data_ptr() != leaf.data_ptr()
    (got,) = torch.autograd.grad(loss, leaf, torch.tensor(-2.5, dtype=torch.float64))
    torch.testing.assert_close(got, -2.5 * dense(scores, positives)[1])


def test_as_the_root_of_backward_the_gradient_is_used_as_computed_without_a_scaling_pass():
    """root=True (the graph step): loss.backward() gets the same gradient, with no multiply by the incoming 1; so a
    scaled upstream gradient is ignored, which is the promise the caller makes."""
    scores, _ = case(4, 10, torch.float64)
    _, _, positives = csr(4, 10, seed=3)
    want = dense(scores, positives)[1]
    leaf = scores.clone().requires_grad_()
    squared_hinge_from_positions(leaf, positives, root=True).backward()
    torch.testing.assert_close(leaf.grad, want)
    leaf.grad = None
    (2 * squared_hinge_from_positions(leaf, positives, root=True)).backward()  # the promise broken: not scaled
    torch.testing.assert_close(leaf.grad, want)


def test_second_backward_through_a_retained_graph_fails_instead_of_scaling_twice():
    leaf = torch.randn(3, 4, requires_grad=True)
    loss = squared_hinge_from_positions(leaf, torch.tensor([1, 5]))
    (loss * 3).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="keeps its gradient for one backward .*compute the loss again"):
        loss.backward()


def test_a_gradient_of_the_gradient_is_refused_by_name():
    """create_graph=True (a gradient penalty): the kernel's gradient has no graph, which autograd would otherwise
    report as 'element 0 of tensors does not require grad'."""
    leaf = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="differentiable once .*dense_targets"):
        torch.autograd.grad(squared_hinge_from_positions(leaf, torch.tensor([1, 5])), leaf, create_graph=True)


def test_finite_differences_float64():
    """The gradient is the derivative of the loss (central differences; the loss is piecewise quadratic)."""
    scores, positives = case(3, 7, torch.float64, seed=4)
    scores = scores + 0.01  # off the hinge points, where the derivative is one-sided
    leaf = scores.clone().requires_grad_()
    (grad,) = torch.autograd.grad(squared_hinge_from_positions(leaf, positives), leaf)
    eps, numeric = 1e-6, torch.empty_like(scores)
    for i in range(scores.numel()):
        step = torch.zeros(scores.numel(), dtype=torch.float64)
        step[i] = eps
        step = step.view_as(scores)
        up, down = (squared_hinge_from_positions(scores + d, positives) for d in (step, -step))
        numeric.view(-1)[i] = (up - down) / (2 * eps)
    torch.testing.assert_close(grad, numeric, atol=1e-7, rtol=1e-6)


def test_torch_compile_traces_the_loss_and_its_backward():
    torch._dynamo.reset()
    scores, positives = case(4, 9, seed=8)
    compiled = torch.compile(lambda s: squared_hinge_from_positions(s, positives) * 2, backend="aot_eager",
                             fullgraph=True)
    leaf = scores.clone().requires_grad_()
    compiled(leaf).backward()
    want = dense(scores, positives)
    torch.testing.assert_close(compiled(scores), 2 * want[0])
    torch.testing.assert_close(leaf.grad, 2 * want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_scores_under_autocast(device):
    """A dense head under bf16 autocast: computed in float32, float32 loss, gradient in bf16."""
    scores, positives = case(5, 300, torch.float32, device, seed=6)
    leaf = scores.bfloat16().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = squared_hinge_from_positions(leaf, positives)
        direct = OPS.squared_hinge(leaf.detach(), positives)  # the registered autocast rule
    loss.backward()
    want = dense(leaf.detach().float(), positives)
    assert loss.dtype == direct[0].dtype == direct[1].dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.detach(), want[0])
    torch.testing.assert_close(direct[1], want[1])
    torch.testing.assert_close(leaf.grad.float(), want[1], rtol=1e-2, atol=1e-6)


# ---------------------------------------------------------------- CUDA only

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_cuda_large_batch_matches_the_cpu(dtype):
    scores, positives = case(32, 70001, dtype, seed=9)
    want = OPS.squared_hinge(scores, positives)
    got = OPS.squared_hinge(scores.cuda(), positives.cuda())
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    check(tuple(t.cpu() for t in got), want, **tol)


@pytest.mark.cuda
@needs_cuda
def test_cuda_loss_never_waits_for_the_device():
    scores, positives = case(32, 5000, torch.float32, "cuda", seed=10)
    leaf = scores.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        squared_hinge_from_positions(leaf, positives).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check((squared_hinge_from_positions(leaf.detach(), positives), leaf.grad), dense(leaf, positives))


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_replays_with_new_scores_and_positions():
    scores, positives = (t.clone() for t in case(8, 999, torch.float32, "cuda", seed=13))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        OPS.squared_hinge(scores, positives)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, grad = OPS.squared_hinge(scores, positives)
    for seed in (14, 15):
        new_scores, new_positives = case(8, 999, torch.float32, "cuda", seed=seed)
        scores.copy_(new_scores)
        positives.copy_(new_positives[: len(positives)])
        graph.replay()
        check((loss.clone(), grad.clone()), dense(scores, positives))


@pytest.mark.parametrize("device", DEVICES)
def test_a_loss_beyond_float_range_is_non_finite_not_an_error(device):
    """Weights blown up by a huge learning rate: the loss must come out inf or NaN for the run's NaN watch."""
    scores = torch.full((2, 3), 1e30, device=device)
    loss, grad = OPS.squared_hinge(scores, torch.tensor([0, 4], device=device))
    assert loss.dtype == torch.float32 and not torch.isfinite(loss)
