"""The uniform sparse op: compiled kernels vs the pure-torch reference vs a dense matmul."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from xmc_repro.errors import ConfigError
from xmc_repro.sparse import SparseInputError, UniformSparseLinear, backend, uniform_sparse_linear
from xmc_repro.sparse import reference as ref
from xmc_repro.sparse.op import ensure_registered

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]
ensure_registered()  # compiles on first use; defines torch.ops.xmc_sparse
OPS = torch.ops.xmc_sparse
# (batch, in_features, labels, connectivity): odd sizes on purpose
SHAPES = [(1, 1, 1, 1), (1, 7, 33, 1), (3, 50, 37, 5), (5, 300, 1000, 17), (32, 257, 129, 32),
          (37, 64, 70, 8), (70, 128, 200, 4), (7, 20000, 150, 3), (3, 70000, 40, 2)]


def _problem(batch, in_features, labels, connectivity, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_features, generator=g, dtype=dtype)
    idx = torch.randint(in_features, (connectivity, labels), generator=g, dtype=torch.int32)
    w = torch.randn(connectivity, labels, generator=g, dtype=dtype)
    b = torch.randn(labels, generator=g, dtype=dtype)
    return [t.to(device) for t in (x, idx, w, b)]


def _sparse_grad(batch, labels, density, device, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(batch, labels, generator=g, dtype=dtype)
    return (grad * (torch.rand(batch, labels, generator=g) < density)).to(device)


def test_compiled_backend_loads_when_a_compiler_exists():
    if os.environ.get("XMC_SPARSE_BACKEND", "auto") == "reference":
        pytest.skip("reference forced")
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no compiler")
    assert ensure_registered()["cpu"] == "compiled-cpu"
    assert backend("cpu") == "compiled-cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_reference_matches_dense(device):
    x, idx, w, b = _problem(6, 40, 300, 7, device)
    dense = ref.dense_weight(idx, w, 40)
    torch.testing.assert_close(ref.forward(x, idx, w, b), x @ dense.T + b)
    grad = torch.randn(6, 300, device=device)
    torch.testing.assert_close(ref.backward_input(grad, idx, w, 40), grad @ dense)
    # weight gradient = dense gradient sampled at each slot (duplicate slots get the same value)
    dense_gw = grad.T @ x
    expect = dense_gw[torch.arange(300, device=device).expand(7, -1), idx.long()]
    torch.testing.assert_close(ref.backward_weight(grad, x, idx), expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("density", [1.0, 0.01])
def test_kernels_match_reference(device, shape, density):
    batch, in_features, labels, conn = shape
    x, idx, w, b = _problem(*shape, device)
    torch.testing.assert_close(OPS.forward(x, idx, w, b), ref.forward(x, idx, w, b))
    torch.testing.assert_close(OPS.forward(x, idx, w, None), ref.forward(x, idx, w, None))
    grad = _sparse_grad(batch, labels, density, device)
    torch.testing.assert_close(OPS.backward_input(grad, idx, w, in_features),
                               ref.backward_input(grad, idx, w, in_features))
    torch.testing.assert_close(OPS.backward_weight(grad, x, idx), ref.backward_weight(grad, x, idx))


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_matches_dense_masked_weight(device):
    batch, in_features, labels, conn = 9, 60, 130, 6
    x, idx, w, b = _problem(batch, in_features, labels, conn, device)
    layer_in = [t.clone().requires_grad_() for t in (x, w, b)]
    out = uniform_sparse_linear(layer_in[0], idx, layer_in[1], layer_in[2])
    # Dense twin: a dense weight built from the slots, differentiable in the slot values.
    dense_in = [t.clone().requires_grad_() for t in (x, w, b)]
    dense = ref.dense_weight(idx, dense_in[1], in_features)
    expect = dense_in[0] @ dense.T + dense_in[2]
    torch.testing.assert_close(out, expect)
    grad = _sparse_grad(batch, labels, 0.3, device)
    out.backward(grad)
    expect.backward(grad)
    for got, want in zip(layer_in, dense_in):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_mostly_zero_gradients_equal_dense_path(device):
    """99 % exact zeros (squared hinge): the skipping kernels still give the dense-gradient result."""
    batch, in_features, labels, conn = 32, 500, 3000, 16
    x, idx, w, b = _problem(batch, in_features, labels, conn, device)
    grad = _sparse_grad(batch, labels, 0.01, device)
    assert (grad == 0).float().mean() > 0.985
    dense = ref.dense_weight(idx, w, in_features)
    torch.testing.assert_close(OPS.backward_input(grad, idx, w, in_features), grad @ dense)
    dense_gw = grad.T @ x
    expect = dense_gw[torch.arange(labels, device=device).expand(conn, -1), idx.long()]
    torch.testing.assert_close(OPS.backward_weight(grad, x, idx), expect)
    # labels with an all-zero gradient column get exactly zero weight gradient
    zero_cols = (grad == 0).all(0)
    assert zero_cols.any()
    assert (OPS.backward_weight(grad, x, idx)[:, zero_cols] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1, 3, 1), (3, 8, 11, 3), (4, 5, 20, 3)])
def test_gradcheck_float64(device, shape):
    x, idx, w, b = _problem(*shape, device, dtype=torch.float64)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: uniform_sparse_linear(x, idx, w, b), (x, w, b))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, idx, w, b = _problem(5, 20, 45, 3, device)
    grad = _sparse_grad(5, 45, 0.5, device)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    torch.library.opcheck(OPS.forward.default, (xg, idx, wg, bg))
    torch.library.opcheck(OPS.forward.default, (x, idx, w, None))
    torch.library.opcheck(OPS.backward_input.default, (grad, idx, w, 20))
    torch.library.opcheck(OPS.backward_weight.default, (grad, x, idx))


def test_torch_compile_traces_the_op():
    torch._dynamo.reset()
    x, idx, w, b = _problem(4, 30, 50, 3, "cpu")

    def f(x, w, b):
        return torch.relu(uniform_sparse_linear(x, idx, w, b)).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b), f(x, w, b))


@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_x_and_grad(device):
    x, idx, w, b = _problem(6, 40, 50, 4, device)
    xt = x.t().contiguous().t().requires_grad_()  # a transposed view, not contiguous
    assert not xt.is_contiguous()
    w = w.requires_grad_()
    out = uniform_sparse_linear(xt, idx, w, b)
    out.sum().backward()  # grad_out is an expanded (stride-0) tensor
    dense = ref.dense_weight(idx, w.detach(), 40)
    torch.testing.assert_close(xt.grad, torch.ones(6, 50, device=device) @ dense)


def _bad(x, idx, w, b=None, **kw):
    with pytest.raises(SparseInputError) as info:
        uniform_sparse_linear(x, idx, w, b, **kw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_bad_inputs_raise_clear_errors():
    x, idx, w, b = _problem(4, 10, 12, 3, "cpu")
    assert "2-D" in _bad(x[0], idx, w)
    assert "float32" in _bad(x.half(), idx, w)
    assert "int32" in _bad(x, idx.long(), w)
    assert "indices shape" in _bad(x, idx, w[:2])
    assert "dtype" in _bad(x, idx, w.double())
    assert "bias must have shape" in _bad(x, idx, w, b[:5])
    assert "contiguous" in _bad(x, idx.t().contiguous().t(), w.t().contiguous().t())
    assert "contiguous" in _bad(x, idx, w.t().contiguous().t())
    bad_idx = idx.clone()
    bad_idx[0, 0] = 10
    assert "[0, 10)" in _bad(x, bad_idx, w, check_indices=True)
    bad_idx[0, 0] = -1
    assert "[0, 10)" in _bad(x, bad_idx, w, check_indices=True)
    assert "2-D" in _bad(x, idx[0], w[0])
    if torch.device("meta") is not None:
        assert "device" in _bad(x, idx, w.to("meta"))


def test_index_limit_error():
    from xmc_repro.sparse.checks import check_op_inputs
    big = torch.empty(2**16, 2**15, dtype=torch.int32, device="meta")
    x = torch.empty(2, 5, device="meta")
    with pytest.raises(SparseInputError, match="2\\*\\*31"):
        check_op_inputs(x, big, torch.empty(big.shape, device="meta"), None)


def test_layer_config_errors_name_the_setting():
    with pytest.raises(ConfigError, match="model.connectivity=64 exceeds .* 32 input.*set model.connectivity <= 32"):
        UniformSparseLinear(32, 10, 64)
    with pytest.raises(ConfigError, match="model.connectivity"):
        UniformSparseLinear(32, 10, 0)
    with pytest.raises(ConfigError, match="2\\*\\*31"):
        UniformSparseLinear(2**16, 2**26, 2**5)


def test_forced_reference_backend_in_a_fresh_process():
    code = ("import torch; from xmc_repro.sparse import backend, uniform_sparse_linear as f;"
            "x=torch.randn(3,9); i=torch.randint(9,(2,5),dtype=torch.int32); w=torch.randn(2,5);"
            "y=f(x,i,w); print(backend('cpu'), tuple(y.shape))")
    env = dict(os.environ, XMC_SPARSE_BACKEND="reference")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "reference"
