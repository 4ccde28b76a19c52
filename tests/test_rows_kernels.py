"""The warp-per-label candidate kernels (``xmc_bench::rows_*``, cuda_ext/cuda/uniform_sparse_rows_cuda.cu) against
the pure-torch reference and the op's own kernels, forward and both backward, on fresh random inputs of odd shapes:
batch and connectivity below, at and above a warp (32), labels not a multiple of the 32-label tile, repeated
sources, all-zero and dense gradients, float32, float64 and bf16 inputs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from conftest import sparse_layer_problem

from xmc_repro.sparse import reference, uniform_sparse_linear
from xmc_repro.sparse.op import ROWS_PHASES, backend, ensure_registered, kernel_families, kernels_mask

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# (batch, inputs, labels, connectivity)
SHAPES = [(1, 1, 1, 1), (3, 40, 40, 37), (5, 300, 1001, 7), (17, 64, 33, 32), (32, 257, 129, 32),
          (33, 70, 95, 33), (70, 128, 200, 64), (4, 20000, 31, 3)]


@pytest.fixture(scope="module")
def ops():
    ensure_registered()
    if not backend("cuda").startswith("compiled-cuda"):
        pytest.skip("the candidate kernels need the compiled CUDA kernels")
    return torch.ops.xmc_bench


@contextlib.contextmanager
def _kernels(ops, setting: str):
    """The op on the kernels XMC_SPARSE_KERNELS=`setting` names, in this process, then back on the environment's."""
    ops.use_rows_kernels(kernels_mask(kernel_families(setting)))
    try:
        yield
    finally:
        ops.use_rows_kernels(kernels_mask(kernel_families(os.environ.get("XMC_SPARSE_KERNELS"))))


def _problem(*args, **kwargs):
    return [t.cuda() for t in sparse_layer_problem(*args, **kwargs)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("density", [1.0, 0.01, 0.0])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_rows_kernels_match_the_reference_and_the_op(ops, shape, density, dtype):
    batch, inputs, labels, connectivity = shape
    x, idx, w, b, g = _problem(*shape, density, dtype, seed=sum(shape))
    op = torch.ops.xmc_sparse
    for bias in (b, None):
        out = ops.rows_forward(x, idx, w, bias)
        torch.testing.assert_close(out, reference.forward(x, idx, w, bias))
        torch.testing.assert_close(out, op.forward(x, idx, w, bias))
        # the benchmark's variants: more gathers in flight, or 4 batch rows per lane; the same sums in the same order
        for variant in (ops.rows_forward_unroll2, ops.rows_forward_unroll4, ops.rows_forward_vec):
            assert torch.equal(variant(x, idx, w, bias), out)
    grad_x = ops.rows_backward_input(g, idx, w, inputs)
    torch.testing.assert_close(grad_x, reference.backward_input(g, idx, w, inputs))
    torch.testing.assert_close(grad_x, op.backward_input(g, idx, w, inputs))
    grad_x_vec = ops.rows_backward_input_vec(g, idx, w, inputs)  # 4 rows per vector atomic: another order of sums
    torch.testing.assert_close(grad_x_vec, reference.backward_input(g, idx, w, inputs))
    torch.testing.assert_close(grad_x_vec, grad_x)
    grad_wb = ops.rows_backward_weight(g, x, idx)  # weights and bias
    torch.testing.assert_close(grad_wb, reference.backward_weight(g, x, idx))
    torch.testing.assert_close(grad_wb, op.backward_weight(g, x, idx))
    grad_wb_vec = ops.rows_backward_weight_vec(g, x, idx)  # the benchmark's variant, its sums in another order
    torch.testing.assert_close(grad_wb_vec, reference.backward_weight(g, x, idx))
    torch.testing.assert_close(grad_wb_vec, grad_wb)
    if density == 0.0:  # every label skipped, nothing left unwritten
        assert not grad_x.any() and not grad_x_vec.any() and not grad_wb[0].any() and not grad_wb[1].any()
        assert not grad_wb_vec[0].any() and not grad_wb_vec[1].any()


@pytest.mark.parametrize("shape", [(1, 7, 5, 3), (5, 300, 1001, 7), (33, 64, 257, 32)])
def test_rows_kernels_with_bf16_inputs_equal_float32_on_the_rounded_inputs(ops, shape):
    x, idx, w, b, g = _problem(*shape, 0.3, torch.float32, seed=7)
    xb = x.bfloat16()
    out = ops.rows_forward(xb, idx, w, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference.forward(xb.float(), idx, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.rows_backward_weight(g, xb, idx), reference.backward_weight(g, xb.float(), idx),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.rows_forward_vec(xb, idx, w, b), out)
    torch.testing.assert_close(ops.rows_backward_weight_vec(g, xb, idx),
                               reference.backward_weight(g, xb.float(), idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("in_features", [1, 5])
def test_kernels_with_vector_loads_take_an_input_whose_storage_starts_unaligned(ops, batch, in_features, dtype):
    """A batch that needs no padding and an x whose transpose is contiguous (one input feature, or x itself a
    transposed tensor): the transposed input is then a view of x, here one that starts one value into its storage,
    so a 16-byte (8 for bf16) vector load from it would be misaligned; it is copied first. The op on its
    thread-per-label kernels (whose gathers are all vector loads) and the benchmark's vector kernels."""
    wdtype = torch.float32 if dtype == torch.bfloat16 else dtype
    _, idx, w, b, g = _problem(batch, in_features, 40, 3, 1.0, wdtype, seed=batch)
    storage = torch.randn(in_features * batch + 1, dtype=wdtype, device="cuda").to(dtype)
    x = storage[1:].view(in_features, batch).t()
    assert x.t().is_contiguous() and x.storage_offset() == 1
    xr = x.float() if dtype == torch.bfloat16 else x
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.bfloat16 else {}
    want_out, want_wb = reference.forward(xr, idx, w, b), reference.backward_weight(g, xr, idx)
    torch.testing.assert_close(ops.rows_forward_vec(x, idx, w, b), want_out, **tol)
    torch.testing.assert_close(ops.rows_backward_weight_vec(g, x, idx), want_wb, **tol)
    with _kernels(ops, "threads"):
        torch.testing.assert_close(torch.ops.xmc_sparse.forward(x, idx, w, b), want_out, **tol)
        torch.testing.assert_close(torch.ops.xmc_sparse.backward_weight(g, x, idx), want_wb, **tol)
        torch.cuda.synchronize()  # a misaligned load fails the launch, reported here


def test_rows_kernels_check_their_inputs_as_the_op_does(ops):
    x, idx, w, b, g = _problem(3, 10, 20, 4, 1.0, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="int32"):
        ops.rows_forward(x, idx.long(), w, b)
    with pytest.raises(RuntimeError, match="out_features columns"):
        ops.rows_backward_input(g[:, :5].contiguous(), idx, w, 10)
    with pytest.raises(RuntimeError, match="batch size"):
        ops.rows_backward_weight(g, x[:2], idx)


def _kernels_run(prof) -> dict[str, str]:
    """{phase: family} of the op's kernels the profiler saw, by their names (rows::forward_vec_kernel: vec)."""
    names = [e.name for e in prof.events()]
    found = {}
    for phase in ROWS_PHASES:
        for family, kernel in (("threads", f"threads::{phase}_kernel"), ("rows", f"rows::{phase}_kernel"),
                               ("vec", f"rows::{phase}_vec_kernel")):
            if any(kernel in name for name in names):
                found[phase] = found.get(phase, "") + family
    return found


@pytest.mark.parametrize("setting", ["vec:forward,backward_weight", "vec:forward,backward_input,backward_weight",
                                     "vec:backward_input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("shape", [(1, 7, 5, 3), (5, 300, 1001, 7), (33, 70, 95, 33), (70, 128, 200, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_op_on_the_vector_kernels_matches_the_reference_through_autograd(ops, shape, dtype, setting):
    """XMC_SPARSE_KERNELS=`setting`, set here in-process: the op's forward and both backward passes through autograd
    against the reference, on the vector kernels in the phases named (a thread per label in the others)."""
    batch, inputs, labels, connectivity = shape
    wdtype = torch.float32 if dtype == torch.bfloat16 else dtype
    x, idx, w, b, g = _problem(*shape, 0.3, wdtype, seed=sum(shape))
    x = x.to(dtype)
    xr = x.float() if dtype == torch.bfloat16 else x  # bf16 inputs are gathered as they are, summed in float32
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.bfloat16 else {}
    with _kernels(ops, setting):
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = uniform_sparse_linear(xg, idx, wg, bg)
            out.backward(g)
            torch.cuda.synchronize()
    assert _kernels_run(prof) == kernel_families(setting)
    torch.testing.assert_close(out, reference.forward(xr, idx, w, b), **tol)
    torch.testing.assert_close(xg.grad, reference.backward_input(g, idx, w, inputs).to(dtype))  # in x's dtype
    grad_w, grad_b = reference.backward_weight(g, xr, idx)
    torch.testing.assert_close(wg.grad, grad_w, **tol)
    torch.testing.assert_close(bg.grad, grad_b, **tol)


@pytest.mark.parametrize("setting, name, families", [
    ("", "compiled-cuda-rows:forward,backward_input", "rows rows threads"),
    ("threads", "compiled-cuda", "threads threads threads"),
    ("rows", "compiled-cuda-rows", "rows rows rows"),
    ("rows:backward_input", "compiled-cuda-rows:backward_input", "threads rows threads"),
    ("rows:backward_weight,forward", "compiled-cuda-rows:forward,backward_weight", "rows threads rows"),
    # the vector kernels (their in-process test above covers more settings)
    ("vec:backward_weight+rows:backward_input,forward", "compiled-cuda-rows:forward,backward_input+vec:backward_weight",
     "rows rows vec"),
    ("vec:backward_input", "compiled-cuda-vec:backward_input", "threads vec threads"),
    ("rows:forward+vec:backward_input", "compiled-cuda-rows:forward+vec:backward_input", "rows vec threads")])
def test_the_op_runs_the_kernels_asked_in_each_phase(ops, setting, name, families):
    """XMC_SPARSE_KERNELS: the op runs the kernels named in each phase (unset: the default's; a fresh process: the
    switch is set when the op registers), through autograd as in training; the backend says so, and the profiler
    sees each phase's kernel (threads::, rows::, or rows:: *_vec_kernel), families in forward, input and weight
    backward order."""
    script = f"""
import torch
from torch.profiler import ProfilerActivity, profile
from xmc_repro.sparse import backend, reference, uniform_sparse_linear
print(backend("cuda"))
g = torch.Generator().manual_seed(3)
x = torch.randn(33, 70, generator=g).cuda().requires_grad_()
idx = torch.randint(70, (33, 95), generator=g, dtype=torch.int32).cuda()
w = torch.randn(33, 95, generator=g).cuda().requires_grad_()
grad = torch.randn(33, 95, generator=g).cuda()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    out = uniform_sparse_linear(x, idx, w)
    out.backward(grad)
    torch.cuda.synchronize()
torch.testing.assert_close(out, reference.forward(x.detach(), idx, w.detach(), None))
torch.testing.assert_close(x.grad, reference.backward_input(grad, idx, w.detach(), 70))
torch.testing.assert_close(w.grad, reference.backward_weight(grad, x.detach(), idx)[0])
names = [e.name for e in prof.events()]
print("kernels", *(family for phase in {ROWS_PHASES!r} for family, kernel in
                   (("threads", f"threads::{{phase}}_kernel"), ("rows", f"rows::{{phase}}_kernel"),
                    ("vec", f"rows::{{phase}}_vec_kernel")) if any(kernel in n for n in names)))
"""
    env = {**os.environ, "XMC_SPARSE_KERNELS": setting}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("compiled-", "kernels "))]  # no build notes
    assert lines == [name, f"kernels {families}"]
