"""Losses from label lists against their formulas on a dense target: values and gradients."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import generator, label_lists

from xmc_repro.errors import ConfigError
from xmc_repro.losses import TrainingLossLog, bce_loss, dense_targets, squared_hinge_loss
from xmc_repro.model import build_loss


def random_batch(seed, b=7, L=13, dtype=torch.float32):
    g = generator(seed)
    scores = (torch.randn(b, L, generator=g, dtype=dtype) * 1.5).requires_grad_()
    lengths = torch.randint(0, 5, (b,), generator=g)
    lengths[0] = 0  # a point without labels
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    idx = torch.cat([torch.randperm(L, generator=g)[:n] for n in lengths.tolist()])
    return scores, ptr, idx


def formula(name, scores, y):
    if name == "squared_hinge":
        return torch.relu(1 - (2 * y - 1) * scores).pow(2).mean()
    return F.binary_cross_entropy_with_logits(scores, y)


@pytest.mark.parametrize("name", ["squared_hinge", "bce"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_the_formula(name, seed):
    scores, ptr, idx = random_batch(seed)
    y = torch.zeros(scores.shape)
    for i in range(len(ptr) - 1):  # independent target construction
        y[i, idx[ptr[i] : ptr[i + 1]]] = 1
    torch.testing.assert_close(dense_targets(ptr, idx, scores.shape[1]), y)
    loss = build_loss(name)(scores, ptr, idx)
    (grad,) = torch.autograd.grad(loss, scores)
    ref_scores = scores.detach().clone().requires_grad_()
    ref = formula(name, ref_scores, y)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_scores.grad)


def test_squared_hinge_gradient_is_exactly_zero_beyond_the_margin():
    scores = torch.tensor([[-3.0, -1.0, -0.5, 2.0, 0.5]], requires_grad=True)
    loss = squared_hinge_loss(scores, torch.tensor([0, 2]), torch.tensor([3, 4]))
    loss.backward()
    # negatives at s <= -1 and positives at s >= 1 contribute nothing
    assert scores.grad[0, 0] == 0 and scores.grad[0, 1] == 0 and scores.grad[0, 3] == 0
    assert scores.grad[0, 2] > 0 and scores.grad[0, 4] < 0
    assert loss.item() == pytest.approx((0.5**2 + 0.5**2) / 5)


def test_repeated_labels_count_once():
    scores = torch.randn(3, 6, dtype=torch.float64, generator=generator(0)).requires_grad_()
    ptr, idx = torch.tensor([0, 4, 5, 7]), torch.tensor([2, 2, 5, 2, 0, 1, 1])
    y = torch.zeros(3, 6, dtype=torch.float64)
    y[0, [2, 5]] = y[1, 0] = y[2, 1] = 1
    torch.testing.assert_close(dense_targets(ptr, idx, 6, dtype=torch.float64), y)
    for name in ("squared_hinge", "bce"):
        loss, want = build_loss(name)(scores, ptr, idx), formula(name, scores, y)
        torch.testing.assert_close(loss, want)
        torch.testing.assert_close(*(torch.autograd.grad(v, scores)[0] for v in (loss, want)))


@pytest.mark.parametrize("name", ["squared_hinge", "bce"])
@pytest.mark.parametrize("label", [6, 7, -1])
def test_labels_outside_the_scores_are_refused(name, label):
    """A label >= L would mark an entry of the next row, a negative one of the row before (or none)."""
    scores = torch.zeros(3, 6, requires_grad=True)
    ptr, idx = torch.tensor([0, 1, 2, 3]), torch.tensor([2, label, 5])
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, 6\) .*found values in \[{min(label, 2)}, {max(label, 5)}\]"):
        build_loss(name)(scores, ptr, idx)


@pytest.mark.parametrize("name", ["squared_hinge", "bce"])
def test_a_compiled_loss_asserts_the_labels_range(name):
    """Traced, the check cannot read the labels: the compiled graph asserts their range when it runs."""
    torch._dynamo.reset()
    loss = build_loss(name)
    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    scores, ptr = torch.randn(3, 6), torch.tensor([0, 1, 2, 3])
    labels = torch.tensor([2, 4, 5])
    torch.testing.assert_close(compiled(scores, ptr, labels), loss(scores, ptr, labels))
    with pytest.raises(RuntimeError, match=r"labels must lie in \[0, labels\)"):
        compiled(scores, ptr, torch.tensor([2, 6, 5]))  # would mark label 0 of the third row


def test_bce_has_second_derivatives():
    """A gradient penalty through BCE (create_graph=True) against the formula's."""
    scores, ptr, idx = random_batch(5, dtype=torch.float64)
    y = dense_targets(ptr, idx, scores.shape[1], dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda s: bce_loss(s, ptr, idx), (scores,))
    penalties = []
    for loss in (bce_loss(scores, ptr, idx), formula("bce", scores, y)):
        (grad,) = torch.autograd.grad(loss, scores, create_graph=True)
        penalties.append(torch.autograd.grad(grad.square().sum(), scores)[0])
    torch.testing.assert_close(*penalties)


def test_scores_that_are_not_2d_are_named():
    with pytest.raises(ValueError, match=r"scores must be 2-D \(batch, labels\), got shape \(6,\)"):
        squared_hinge_loss(torch.zeros(6), torch.tensor([0, 1]), torch.tensor([2]))


def test_the_loss_compiles_as_the_first_use_of_the_ops():
    """Before anything has registered the ops (here: a dense head), the loss registers them inside the trace."""
    code = ("import torch; from xmc_repro.losses import squared_hinge_loss; head = torch.nn.Linear(8, 5); "
            "f = torch.compile(lambda x, p, i: squared_hinge_loss(head(x), p, i), fullgraph=True, backend='eager'); "
            "x, p, i = torch.randn(3, 8), torch.tensor([0, 1, 2, 3]), torch.tensor([4, 1, 2]); "
            "print(float(f(x, p, i) - squared_hinge_loss(head(x), p, i)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) == 0.0


@pytest.mark.parametrize("name", ["squared_hinge", "bce"])
@pytest.mark.parametrize("ptr, message", [
    ([0, 1, 2], "label_ptr must hold 4 offsets"),  # a row short: it was read as a row without labels
    ([0, 1, 2, 4], "to len\\(label_idx\\)=3"),  # past the end: torch's "allocated size does not match"
    ([0, 2, 1, 3], "label_ptr must not decrease"),
])  # fmt: skip
def test_label_lists_that_do_not_describe_the_scores_rows_are_refused(name, ptr, message):
    with pytest.raises(ValueError, match=message):
        build_loss(name)(torch.zeros(3, 6), torch.tensor(ptr), torch.tensor([2, 3, 5]))


@pytest.mark.parametrize("name", ["squared_hinge", "bce", "squared_hinge_reference"])
def test_loss_values_of_large_scores_do_not_cancel_away(name):
    """Every entry is summed as a negative and the positives corrected after: in float32 sums, positives at +300
    (squared hinge: (s + 1)^2 taken off again) or +1e4 (BCE: softplus(s) ~ s) drowned the loss's other terms."""
    from xmc_repro.losses import flat_keys
    from xmc_repro.sparse import reference

    big = 1e4 if name == "bce" else 300.3
    scores = torch.full((64, 16), -big)
    scores[:, :4] = big
    scores[:, 4] = 0.5  # the entries with a loss
    ptr, idx = torch.arange(0, 257, 4), torch.arange(4).repeat(64)
    want = formula(name.removesuffix("_reference"), scores.double(), dense_targets(ptr, idx, 16, dtype=torch.float64))
    if name == "squared_hinge_reference":  # the pure-torch backend, as XMC_SPARSE_BACKEND=reference runs it
        loss = reference.squared_hinge(scores, flat_keys(ptr, idx, 16))[0]
    else:
        loss = build_loss(name)(scores, ptr, idx)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=0)


def test_float16_hinge_gradients_survive_until_scaled():
    """Under 16-mixed a GradScaler multiplies the loss by 65536; the fused op stored its float16 gradient, about 1e-7
    an entry at 670k labels, before that factor reached it: most entries flushed to float16's subnormals or zero."""
    scores = (torch.randn(4, 200_000, generator=generator(1)) * 0.5).half().requires_grad_()
    ptr, idx = torch.tensor([0, 2, 3, 5, 6]), torch.tensor([1, 7, 3, 0, 9, 4])
    (build_loss("squared_hinge")(scores, ptr, idx) * 65536.0).backward()
    y = dense_targets(ptr, idx, 200_000, dtype=torch.float64)
    s64 = scores.detach().double().requires_grad_()
    (formula("squared_hinge", s64, y) * 65536.0).backward()
    got, want = scores.grad.double(), s64.grad
    assert scores.grad.dtype == torch.float16
    assert (got - want).abs().sum() / want.abs().sum() < 1e-3  # float16 rounding of the scaled values only


def test_loss_log_on_the_cpu_reports_at_once_and_keeps_the_epochs_weighted_mean():
    log = TrainingLossLog(every=10)
    assert log.epoch_mean is None
    assert log.add(torch.tensor(0.5), step=0, batch_size=32) is None
    assert log.add(torch.tensor(0.2), step=1, batch_size=8) is None
    assert log.epoch_mean == pytest.approx((0.5 * 32 + 0.2 * 8) / 40)
    assert log.add(torch.tensor(float("nan")), step=2, batch_size=32) == (pytest.approx(float("nan"), nan_ok=True), 2)
    assert log.add(torch.tensor(float("inf")), step=3, batch_size=32) == (float("inf"), 3)
    log.new_epoch()
    assert log.epoch_mean is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loss_log_on_a_gpu_reads_every_n_steps_and_names_the_first_bad_step():
    log = TrainingLossLog(every=4)
    losses = [torch.tensor(v, device="cuda") for v in (0.5, 0.4, float("inf"), float("nan"))]  # (a copy: syncs)
    torch.cuda.set_sync_debug_mode("error")  # a read of the loss between the checks would raise
    try:
        found = [log.add(loss, step=i, batch_size=4) for i, loss in enumerate(losses[:3])]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert found == [None, None, None] and log.epoch_mean is None
    assert log.add(losses[3], step=3, batch_size=4) == (float("inf"), 2)
    clean = TrainingLossLog(every=100)
    assert clean.add(torch.tensor(0.5, device="cuda"), step=0, batch_size=4) is None and clean.epoch_mean is None
    assert clean.add(torch.tensor(0.25, device="cuda"), step=1, batch_size=12, flush=True) is None
    assert clean.epoch_mean == pytest.approx((0.5 * 4 + 0.25 * 12) / 16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["squared_hinge", "bce"])
def test_loss_on_the_gpu_never_waits_for_the_device(name):
    scores, ptr, idx = random_batch(7, b=32, L=5000)
    scores = scores.detach().cuda().requires_grad_()
    ptr, idx = ptr.cuda(), idx.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_loss(name)(scores, ptr, idx).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scores.grad.shape == scores.shape


def test_float64_gradcheck():
    # The squared hinge's backward scales its saved gradient in place, so it runs once per graph and
    # gradcheck (two backward passes over one graph) cannot check it: tests/test_fused_loss.py compares
    # it with finite differences instead.
    scores, ptr, idx = random_batch(3, b=4, L=6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda s: bce_loss(s, ptr, idx), (scores,))


def test_large_batch_is_summed_in_slices(monkeypatch):
    import xmc_repro.losses as losses

    monkeypatch.setattr(losses, "_CHUNK", 50)  # several slices of rows
    scores, ptr, idx = random_batch(4, b=20, L=31)
    y = dense_targets(ptr, idx, 31)
    for name in ("squared_hinge", "bce"):
        torch.testing.assert_close(build_loss(name)(scores, ptr, idx), formula(name, scores, y))


def test_labels_on_another_device_or_dtype_and_half_scores():
    scores, ptr, idx = random_batch(5)
    y = dense_targets(ptr, idx, scores.shape[1])
    got = squared_hinge_loss(scores.detach().half(), ptr.int(), idx.int())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, formula("squared_hinge", scores.detach().half().float(), y), rtol=1e-3, atol=1e-3)


def test_unknown_loss_name():
    with pytest.raises(ConfigError, match="loss='hinge' is unknown; choose one of bce, squared_hinge"):
        build_loss("hinge")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["squared_hinge", "bce"])
def test_cuda_matches_cpu_with_labels_left_on_the_host(name):
    scores, ptr, idx = random_batch(6, b=32, L=5000)
    cpu = build_loss(name)(scores, ptr, idx)
    (g_cpu,) = torch.autograd.grad(cpu, scores)
    s_gpu = scores.detach().cuda().requires_grad_()
    gpu = build_loss(name)(s_gpu, ptr, idx)
    (g_gpu,) = torch.autograd.grad(gpu, s_gpu)
    torch.testing.assert_close(gpu.cpu(), cpu)
    torch.testing.assert_close(g_gpu.cpu(), g_cpu)


def test_losses_accept_non_contiguous_scores():
    # The unstructured head returns a transposed product; its gradient must match the contiguous case.
    torch.manual_seed(3)
    scores_t = torch.randn(7, 5, requires_grad=True)
    label_ptr = torch.tensor([0, 2, 3, 3, 5, 6])
    label_idx = torch.tensor([1, 4, 0, 6, 2, 3])
    for fn in (squared_hinge_loss, bce_loss):
        fn(scores_t.t(), label_ptr, label_idx).backward()
        expected_grad = scores_t.grad.clone()
        scores_t.grad = None
        contiguous = scores_t.detach().t().contiguous().requires_grad_()
        fn(contiguous, label_ptr, label_idx).backward()
        torch.testing.assert_close(expected_grad, contiguous.grad.t())
        scores_t.grad = None


def bce64(scores, y):
    """Float64 BCE with logits written per class, so that +-inf scores have their limits (torch's formula takes
    (1 - y) s, which is 0 * inf = NaN at a positive of score +inf)."""
    s = scores.double()
    return torch.where(y > 0, F.softplus(-s), F.softplus(s)).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("chunk", [1 << 22, 40], ids=["one-slice", "slices"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bce_of_infinite_and_huge_scores_matches_float64(monkeypatch, seed, chunk, dtype):
    """A positive at +inf has a loss of 0 (softplus(inf) - inf gave NaN); positives at |s| up to float32's largest
    are not summed as negatives and taken off again (which cancelled the other terms away); a positive's gradient
    -sigmoid(-s) keeps its digits where sigmoid(s) - 1 rounds to 0."""
    import xmc_repro.losses as losses

    monkeypatch.setattr(losses, "_CHUNK", chunk)
    g = generator(100 + seed)
    b, L = 7 + 2 * seed, 13 + 6 * seed  # odd shapes
    scores = torch.randn(b, L, generator=g, dtype=torch.float64) * 4
    ptr, idx = label_lists(g, b, L, most=5)
    y = dense_targets(ptr, idx, L, dtype=torch.float64)
    pos, neg = y.view(-1).nonzero().squeeze(1), (y.view(-1) == 0).nonzero().squeeze(1)
    pos, neg = pos[torch.randperm(len(pos), generator=g)], neg[torch.randperm(len(neg), generator=g)]
    scores.view(-1)[pos[:6]] = torch.tensor([float("inf"), 1e30, 1e12, 3e8, 25.0, 12.0], dtype=torch.float64)
    scores.view(-1)[neg[:3]] = torch.tensor([-float("inf"), -1e30, -3e8], dtype=torch.float64)
    scores = scores.to(dtype).requires_grad_()
    loss = bce_loss(scores, ptr, idx)
    (grad,) = torch.autograd.grad(loss, scores)
    ref_scores = scores.detach().double().requires_grad_()
    want = bce64(ref_scores, y)
    (want_grad,) = torch.autograd.grad(want, ref_scores)
    assert loss.dtype == dtype and torch.isfinite(want)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(loss.double(), want, rtol=tol, atol=0)
    torch.testing.assert_close(grad.double(), want_grad, rtol=10 * tol, atol=0)
    for at in (pos[0], neg[0]):  # a NaN score still gives a NaN loss (the non-finite loss watch)
        bad = scores.detach().clone()
        bad.view(-1)[at] = float("nan")
        assert bce_loss(bad, ptr, idx).isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_positive_list_forms_take_any_order_repeats_and_padding_alike(seed, dtype):
    """Both losses' `from_positions` take the flat positions in any order, a repeat counted once and entries < 0 as
    padding (a CUDA graph's fixed-capacity list), against the float64 formula on the dense target."""
    from xmc_repro.losses import bce_from_positions, flat_keys, squared_hinge_from_positions

    g = generator(200 + seed)
    b, L = 5 + 2 * seed, 11 + 4 * seed
    scores = torch.randn(b, L, generator=g, dtype=dtype) * 3
    ptr, idx = label_lists(g, b, L, most=4, least=1)
    keys = flat_keys(ptr, idx, L)
    listed = torch.cat([keys, keys[: 1 + seed], torch.full((3 + seed,), -1)])  # repeats and padding
    listed = listed[torch.randperm(len(listed), generator=g)]
    if listed[-1] >= 0:  # padding last too: it must not read or write the last entry
        listed = torch.cat([listed, torch.tensor([-1])])
    y = dense_targets(ptr, idx, L, dtype=torch.float64)
    for form, name in ((bce_from_positions, "bce"), (squared_hinge_from_positions, "squared_hinge")):
        assert getattr(form, "any_order", False)
        leaf = scores.clone().requires_grad_()
        loss = form(leaf, listed)
        (grad,) = torch.autograd.grad(loss, leaf)
        ref = scores.double().requires_grad_()
        want = formula(name, ref, y)
        (want_grad,) = torch.autograd.grad(want, ref)
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(loss.double(), want, **tol)
        torch.testing.assert_close(grad.double(), want_grad, **tol)
        empty = torch.zeros(0, L, dtype=dtype, requires_grad=True)  # no rows, padding only: the mean of nothing
        assert form(empty, torch.tensor([-1])).isnan()
