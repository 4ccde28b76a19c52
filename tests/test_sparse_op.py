"""The uniform sparse op: compiled kernels vs the pure-torch reference vs a dense matmul; its registration."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import DEVICES, generator

from xmc_repro.errors import ConfigError
from xmc_repro.sparse import SparseInputError, UniformSparseLinear, backend, uniform_sparse_linear
from xmc_repro.sparse import op as sparse_op
from xmc_repro.sparse import reference as ref
from xmc_repro.sparse.op import ensure_registered

ensure_registered()  # compiles on first use; defines torch.ops.xmc_sparse
OPS = torch.ops.xmc_sparse
ROOT = Path(__file__).resolve().parents[1]
# (batch, in_features, labels, connectivity): odd sizes on purpose
SHAPES = [(1, 1, 1, 1), (1, 7, 33, 1), (3, 50, 37, 5), (5, 300, 1000, 17), (32, 257, 129, 32),
          (37, 64, 70, 8), (70, 128, 200, 4), (7, 20000, 150, 3), (3, 70000, 40, 2)]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]


def _problem(batch, in_features, labels, connectivity, device, dtype=torch.float32, seed=0):
    g = generator(seed)
    x = torch.randn(batch, in_features, generator=g, dtype=dtype)
    idx = torch.randint(in_features, (connectivity, labels), generator=g, dtype=torch.int32)
    w = torch.randn(connectivity, labels, generator=g, dtype=dtype)
    b = torch.randn(labels, generator=g, dtype=dtype)
    return [t.to(device) for t in (x, idx, w, b)]


def _sparse_grad(batch, labels, density, device, dtype=torch.float32, seed=1):
    g = generator(seed)
    grad = torch.randn(batch, labels, generator=g, dtype=dtype)
    return (grad * (torch.rand(batch, labels, generator=g) < density)).to(device)


def sample_inputs(shape, device):
    """(op, args) pairs covering one shape: forward with and without bias, with and without gradients
    wanted (each subset of x / weight / bias), and both backward ops on a mostly zero gradient."""
    batch, in_features, labels, _ = shape
    x, idx, w, b = _problem(*shape, device)
    grad = _sparse_grad(batch, labels, 0.3, device)
    samples = [(OPS.forward, (x, idx, w, None)), (OPS.forward, (x, idx, w, b))]
    for wants in ((True, True, True), (True, False, False), (False, True, False), (False, False, True)):
        args = [t.clone().requires_grad_(want) for t, want in zip((x, w, b), wants)]
        samples.append((OPS.forward, (args[0], idx, args[1], args[2])))
    samples += [(OPS.backward_input, (grad, idx, w, in_features)), (OPS.backward_weight, (grad, x, idx))]
    # the backward ops' own autograd (double backward)
    samples += [(OPS.backward_input, (grad.clone().requires_grad_(), idx, w.clone().requires_grad_(), in_features)),
                (OPS.backward_weight, (grad.clone().requires_grad_(), x.clone().requires_grad_(), idx))]
    return samples


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
    torch.testing.assert_close(ref.backward_weight(grad, x, idx), (expect, grad.sum(0)))


def test_hand_computed_example():
    # 2 labels over 3 inputs: label 0 = 2*x0 - x2, label 1 = 0.5*x1 + 3*x1 (a repeated source) + bias
    x = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.0, 4.0]])
    idx = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
    w = torch.tensor([[2.0, 0.5], [-1.0, 3.0]])
    b = torch.tensor([0.0, 1.0])
    torch.testing.assert_close(OPS.forward(x, idx, w, b), torch.tensor([[-1.0, 8.0], [-6.0, 1.0]]))
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    torch.testing.assert_close(OPS.backward_input(g, idx, w, 3), torch.tensor([[2.0, 0.0, -1.0], [0.0, 7.0, 0.0]]))
    grad_w, grad_b = OPS.backward_weight(g, x, idx)
    torch.testing.assert_close(grad_w, torch.tensor([[1.0, 0.0], [3.0, 0.0]]))
    torch.testing.assert_close(grad_b, torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
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


@contextmanager
def cpu_threads(threads: int):
    """torch's CPU threads set to `threads` meanwhile."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_kernels_over_batch_chunks_tiles_of_both_kinds_and_threads(threads):
    """The CPU kernels take a wide input's batch a chunk of rows at a time (60,000 features: chunks of 17 rows);
    the input backward takes a tile of dense gradient another way than a mostly-zero one (both in one call: dense
    first labels, 1 % beyond, an all-zero tile) and sums the accumulators of several threads."""
    batch, in_features, labels, conn = 40, 60_000, 300, 5
    x, idx, w, b = _problem(batch, in_features, labels, conn, "cpu")
    grad = _sparse_grad(batch, labels, 0.01, "cpu")
    grad[:, :100] = torch.randn(batch, 100, generator=generator(2))
    grad[:, 192:256] = 0
    with cpu_threads(threads):
        got = OPS.backward_input(grad, idx, w, in_features)
        out, (grad_w, grad_b) = OPS.forward(x, idx, w, b), OPS.backward_weight(grad, x, idx)
    torch.testing.assert_close(got, ref.backward_input(grad, idx, w, in_features))
    torch.testing.assert_close(got, grad @ ref.dense_weight(idx, w, in_features))
    torch.testing.assert_close(out, ref.forward(x, idx, w, b))
    torch.testing.assert_close(grad_w, ref.backward_weight(grad, x, idx)[0])
    torch.testing.assert_close(grad_b, grad.sum(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("in_features", [70_000, 257])
def test_cpu_forward_over_chunks_same_bits_for_any_threads(dtype, in_features):
    """The CPU forward copies a tile's indices and weights once and uses the copy for every batch chunk: 70,000
    features and batch 45 make chunks of 14 rows, the last one 3; 257 features one chunk. 333 labels over 7
    connections (a partial last tile), a label whose connections all share one source, with and without bias.
    Against the reference; each label's sum goes in one order: the same bits for 1, 2 and 3 threads."""
    batch, labels, conn = 45, 333, 7
    x, idx, w, b = _problem(batch, in_features, labels, conn, "cpu", dtype=dtype, seed=21)
    idx[:, 5] = in_features - 1
    results = []
    for threads in (1, 2, 3):
        with cpu_threads(threads):
            results.append((OPS.forward(x, idx, w, b), OPS.forward(x, idx, w, None)))
    torch.testing.assert_close(results[0][0], ref.forward(x, idx, w, b))
    torch.testing.assert_close(results[0][1], ref.forward(x, idx, w, None))
    for with_bias, without in results[1:]:
        assert torch.equal(with_bias, results[0][0]) and torch.equal(without, results[0][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("in_features", [70_000, 257])
def test_cpu_input_backward_tiles_of_both_kinds_over_chunks_and_threads(dtype, in_features):
    """The CPU input backward copies a tile's indices and weights before its updates, then goes over a dense tile
    label by label and a mostly-zero one row by row. 70,000 features and batch 45 make chunks of 14 rows, the last
    one 3; 257 features one chunk. In one call, 333 labels over 7 connections: dense tiles, tiles dense in the first
    chunk only (mostly zero in the others; with one chunk, one dense and one mostly zero), mostly-zero tiles, an
    all-zero tile, a partial last tile, a label whose connections all share one source. Against the reference and
    a dense matmul for 1, 2 and 3 threads; the same bits on a rerun."""
    batch, labels, conn = 45, 333, 7
    x, idx, w, _ = _problem(batch, in_features, labels, conn, "cpu", dtype=dtype, seed=11)
    idx[:, 5] = in_features - 1
    grad = _sparse_grad(batch, labels, 0.02, "cpu", dtype=dtype, seed=12)
    grad[:, :100] = torch.randn(batch, 100, generator=generator(13), dtype=dtype)
    grad[:14, 128:192] = torch.randn(14, 64, generator=generator(14), dtype=dtype)
    grad[:, 192:256] = 0
    grad[:9, 300:] = torch.randn(9, labels - 300, generator=generator(15), dtype=dtype)
    expect = ref.backward_input(grad, idx, w, in_features)
    for threads in (1, 2, 3):
        with cpu_threads(threads):
            got = OPS.backward_input(grad, idx, w, in_features)
            assert torch.equal(got, OPS.backward_input(grad, idx, w, in_features))
        torch.testing.assert_close(got, expect)
        torch.testing.assert_close(got, grad @ ref.dense_weight(idx, w, in_features))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("in_features", [70_000, 257])
def test_cpu_weight_backward_over_groups_and_chunks_same_bits_for_any_threads(dtype, in_features):
    """The CPU weight backward sums a chunk's rows in groups of four, skipping a label's all-zero groups, and the
    chunks (up to 1M input values, a multiple of four rows, zero-padded) one after another: 70,000 features and
    batch 45 make chunks of 16 rows, the last one padded; 257 features one chunk of 48. In one call: dense labels,
    labels with a few nonzero rows (in the last, padded group too), an all-zero tile, a partial last tile. The
    order of its sums depends on the shape only: the same bits for 1, 2 and 3 threads."""
    batch, labels, conn = 45, 300, 5
    x, idx, _, _ = _problem(batch, in_features, labels, conn, "cpu", dtype=dtype)
    grad = _sparse_grad(batch, labels, 0.02, "cpu", dtype=dtype)
    grad[:, :100] = torch.randn(batch, 100, generator=generator(2), dtype=dtype)
    grad[:, 150:160] = 0
    grad[44, 150:155] = 1.5  # only the last row, alone in its group
    grad[[3, 17, 30], 155:160] = -0.5  # one row in each of three groups
    grad[:, 192:256] = 0
    results = []
    for threads in (1, 2, 3):
        with cpu_threads(threads):
            results.append(OPS.backward_weight(grad, x, idx))
    expect_w, expect_b = ref.backward_weight(grad, x, idx)
    torch.testing.assert_close(results[0][0], expect_w)
    torch.testing.assert_close(results[0][1], expect_b)
    assert (results[0][0][:, 192:256] == 0).all()
    for grad_w, grad_b in results[1:]:
        assert torch.equal(grad_w, results[0][0]) and torch.equal(grad_b, results[0][1])


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
@pytest.mark.parametrize("wants", [(True, False, False), (False, True, False), (False, False, True),
                                   (True, False, True), (False, True, True)], ids=["x", "w", "b", "xb", "wb"])
def test_each_subset_of_wanted_gradients_matches_dense_masked_weight(device, wants):
    """Backward computes only the gradients asked for (x, weight, bias: e.g. a frozen weight with a trained bias),
    and each of them equals the dense twin's: the bias gradient of a frozen weight is the gradient summed over the
    batch, as with every gradient wanted."""
    x, idx, w, b = _problem(5, 40, 70, 4, device)
    grad = _sparse_grad(5, 70, 0.5, device)
    sparse_in = [t.clone().requires_grad_(want) for t, want in zip((x, w, b), wants)]
    uniform_sparse_linear(sparse_in[0], idx, sparse_in[1], sparse_in[2]).backward(grad)
    dense_in = [t.clone().requires_grad_() for t in (x, w, b)]
    (dense_in[0] @ ref.dense_weight(idx, dense_in[1], 40).T + dense_in[2]).backward(grad)
    for got, want, wanted in zip(sparse_in, dense_in, wants):
        if wanted:
            torch.testing.assert_close(got.grad, want.grad)
        else:
            assert got.grad is None


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
    grad_w, grad_b = OPS.backward_weight(grad, x, idx)
    torch.testing.assert_close(grad_w, expect)
    torch.testing.assert_close(grad_b, grad.sum(0))
    # labels with an all-zero gradient column get exactly zero weight and bias gradients
    zero_cols = (grad == 0).all(0)
    assert zero_cols.any()
    assert (grad_w[:, zero_cols] == 0).all() and (grad_b[zero_cols] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1, 3, 1), (3, 8, 11, 3), (4, 5, 20, 3), (5, 4, 9, 4)])
@pytest.mark.parametrize("check", [torch.autograd.gradcheck, torch.autograd.gradgradcheck])
def test_gradcheck_float64(device, shape, check):
    """First and second derivatives (the backward ops are differentiated by the ops themselves); small inputs, so
    that indices repeat sources. On a GPU the input gradient sums a repeated source's terms with atomic adds from
    several warps, in an order that varies between calls: gradcheck's second backward may differ in the last bits."""
    x, idx, w, b = _problem(*shape, device, dtype=torch.float64)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    nondet_tol = 1e-12 if device == "cuda" else 0.0
    assert check(lambda x, w, b: uniform_sparse_linear(x, idx, w, b), (x, w, b), nondet_tol=nondet_tol)


@pytest.mark.parametrize("device", DEVICES)
def test_second_derivatives_match_dense(device):
    """A gradient penalty through the layer: d/d(x, w, b) of |d loss / dx|^2 and |d loss / dw|^2 against the same
    model with the dense weight matrix the sparse weights stand for."""
    x, idx, w, b = _problem(6, 13, 40, 5, device, dtype=torch.float64)
    x, w, b = (t.requires_grad_() for t in (x, w, b))

    def penalties(scores):
        loss = torch.tanh(scores).pow(2).sum()
        gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
        return [torch.autograd.grad(g.pow(2).sum(), (x, w, b), allow_unused=True, retain_graph=True) for g in (gx, gw)]

    sparse = penalties(uniform_sparse_linear(x, idx, w, b))
    dense = penalties(x @ ref.dense_weight(idx, w, 13).T + b)
    for got, want in zip(sparse, dense):
        for g, d in zip(got, want):
            assert (g is None) == (d is None)
            if d is not None:
                torch.testing.assert_close(g, d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_opcheck(device, shape):
    """Schema, fake kernel, autograd registration and dynamic-shape tracing agree with the kernels."""
    for op, args in sample_inputs(shape, device):
        torch.library.opcheck(op.default, args)


def test_backward_saves_only_what_the_wanted_gradients_read():
    x, idx, w, b = _problem(4, 10, 12, 3, "cpu")
    for wants, saved in (((True, False), {"indices", "weight"}), ((False, True), {"x", "indices"}),
                         ((True, True), {"x", "indices", "weight"})):
        xs, ws = (t.clone().requires_grad_(want) for t, want in zip((x, w), wants))
        out = OPS.forward(xs, idx, ws, b)
        names = {"x": xs, "indices": idx, "weight": ws}
        kept = {n for n, t in names.items() for s in out.grad_fn.saved_tensors if s is not None and s is t}
        assert kept == saved, wants
    out = OPS.forward(x, idx, w, b.clone().requires_grad_())  # bias only: nothing to keep
    assert all(s is None for s in out.grad_fn.saved_tensors)


@pytest.mark.parametrize("call, message", [
    (lambda x, i, w, b: OPS.forward(x, i, w.double(), b), "x dtype"),
    (lambda x, i, w, b: OPS.forward(x, i.long(), w, b), "int32"),
    (lambda x, i, w, b: OPS.forward(x, i, w[:, :5], b), "weight shape"),
    (lambda x, i, w, b: OPS.forward(x, i, w, b[:5]), "bias must have shape"),
    (lambda x, i, w, b: OPS.backward_input(x[:, :5], i, w, 10), "out_features columns"),
    (lambda x, i, w, b: OPS.backward_weight(torch.empty(3, 12, device="meta"), x, i), "batch size"),
])
def test_fake_kernels_check_their_inputs(call, message):
    x, idx, w, b = (t.to("meta") for t in _problem(4, 10, 12, 3, "cpu"))
    assert OPS.forward(x, idx, w, b).shape == (4, 12)  # meta tensors run the fake kernels
    with pytest.raises(RuntimeError, match=message):
        call(x, idx, w, b)


def test_schema_is_written_once():
    """cuda_ext/schema.h is the one definition: TORCH_LIBRARY reads it, Python parses it, nobody repeats it."""
    schemas = sparse_op.schemas()
    assert [s.split("(")[0] for s in schemas] == ["forward", "backward_input", "backward_weight", "squared_hinge"]
    for s in schemas:  # the text is already the canonical form, so comparing strings compares schemas
        assert str(torch._C.parse_schema(f"xmc_sparse::{s}")) == f"xmc_sparse::{s}"
    sources = [p for p in (ROOT / "cuda_ext").rglob("*") if p.suffix in (".cpp", ".cu", ".h")]
    libraries = {p.name: re.findall(r"TORCH_LIBRARY\((\w+)", p.read_text()) for p in sources}
    assert [name for name, libs in libraries.items() if "xmc_sparse" in libs] == ["ops.cpp"]
    assert {lib for libs in libraries.values() for lib in libs} == {"xmc_sparse", "xmc_bench"}  # the L2 probe's
    for p in [*sources, *(ROOT / "xmc_repro").rglob("*.py")]:
        if p.name != "schema.h":
            assert not any(s in p.read_text() for s in schemas), p


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bf16_activations_match_float32(device):
    """bf16-mixed training: an intermediate Linear yields bf16 activations; the op computes in float32
    (the weight's dtype). Forward and all gradients agree with a float32 run to bf16 precision."""
    x, idx, w, b = _problem(9, 48, 130, 6, device)
    g = generator(2)
    lin_w = (torch.randn(48, 20, generator=g) / 20**0.5).to(device)
    inp = torch.randn(9, 20, generator=g).to(device)
    grad = _sparse_grad(9, 130, 0.3, device)
    results = []
    for autocast in (False, True):
        leaves = [t.clone().requires_grad_() for t in (inp, lin_w, w, b)]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            hidden = torch.nn.functional.linear(leaves[0], leaves[1])
            assert hidden.dtype == (torch.bfloat16 if autocast else torch.float32)
            out = uniform_sparse_linear(hidden, idx, leaves[2], leaves[3])
            direct = OPS.forward(hidden, idx, leaves[2], leaves[3])  # the registered autocast rule
        assert out.dtype == direct.dtype == torch.float32
        torch.testing.assert_close(direct, out)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for want, got in zip(*results):
        assert got.dtype == want.dtype
        scale = want.abs().max()
        torch.testing.assert_close(got / scale, want / scale, atol=2e-2, rtol=0)


def test_torch_compile_traces_the_op():
    torch._dynamo.reset()
    x, idx, w, b = _problem(4, 30, 50, 3, "cpu")

    def f(x, w, b):
        return torch.relu(uniform_sparse_linear(x, idx, w, b)).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b), f(x, w, b))


def test_torch_compile_of_a_model_is_the_ops_first_use():
    """A fresh process whose first call of the layer is traced by torch.compile(fullgraph=True): Dynamo cannot enter
    the registration's lock, so the registration must run outside the traced code."""
    code = ("import torch; from xmc_repro.sparse import UniformSparseLinear;"
            "m=torch.nn.Sequential(torch.nn.Linear(8,16), UniformSparseLinear(16,33,4));"
            "x=torch.randn(5,8); c=torch.compile(m, backend='aot_eager', fullgraph=True)(x);"
            "print(float((c-m(x)).abs().max()))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == 0.0


def test_an_exported_program_loads_in_a_fresh_process_once_the_ops_are_registered(tmp_path):
    """torch.export.load resolves torch.ops.xmc_sparse.* by name; the ops exist once `backend()` (or any first use)
    has registered them, as the README says."""
    from xmc_repro.sparse import UniformSparseLinear

    layer = UniformSparseLinear(16, 33, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    torch.export.save(torch.export.export(layer, (x,)), tmp_path / "layer.pt2")
    torch.save({"x": x, "out": layer(x).detach()}, tmp_path / "io.pt")
    code = ("import sys, torch, xmc_repro.sparse; xmc_repro.sparse.backend('cpu');"
            "p=torch.export.load(sys.argv[1]); io=torch.load(sys.argv[2]);"
            "print(float((p.module()(io['x'])-io['out']).abs().max()))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "layer.pt2"), str(tmp_path / "io.pt")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == 0.0


def test_check_indices_under_torch_compile():
    """check_indices=True (as XMC_SPARSE_CHECK_INDICES=1) traces: an in-range call runs, an index outside raises."""
    torch._dynamo.reset()
    x, idx, w, b = _problem(4, 30, 50, 3, "cpu")

    def f(x, idx):
        return uniform_sparse_linear(x, idx, w, b, check_indices=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, idx), f(x, idx))
    idx[1, 7] = 30
    with pytest.raises(RuntimeError, match=re.escape("indices must lie in [0, in_features)")):
        compiled(x, idx)


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


def test_a_device_without_kernels_is_named(monkeypatch):
    """On mps or xpu the dispatcher would fail without a fix to offer; the check's list stands in for one here."""
    from xmc_repro.losses import squared_hinge_loss
    from xmc_repro.sparse import checks

    monkeypatch.setattr(checks, "DEVICE_TYPES", ("cuda", "meta"))
    layer = UniformSparseLinear(6, 5, 3)
    with pytest.raises(SparseInputError, match=r"x is on cpu, but the sparse ops run on CPU and CUDA devices only"):
        layer(torch.randn(2, 6))
    with pytest.raises(SparseInputError, match=r"scores is on cpu, .*\(\.cpu\(\) or \.cuda\(\)\)"):
        squared_hinge_loss(torch.randn(2, 5), torch.tensor([0, 1, 2]), torch.tensor([1, 3]))
    assert backend("mps") == "unsupported"


def test_a_numpy_array_or_a_list_is_named_not_an_attribute_error():
    x, idx, w, b = _problem(3, 20, 9, 4, "cpu")
    for args, named in [((x.numpy(), idx, w, b), "x is a ndarray"), ((x, idx, w, b.tolist()), "bias is a list"),
                        ((x, idx.numpy(), w, None), "indices is a ndarray")]:
        with pytest.raises(SparseInputError, match=re.escape(named) + ".*torch.as_tensor"):
            uniform_sparse_linear(*args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_layer_is_told_to_stay_float32(dtype):
    """layer.half(): the error names the weight and the fix, whatever dtype x has (not 'call x.float()', which
    fails next on the weight)."""
    layer = UniformSparseLinear(16, 9, 3).to(dtype)
    for x in (torch.randn(2, 16, dtype=dtype), torch.randn(2, 16)):
        with pytest.raises(SparseInputError, match=re.escape(f"weight must be float32 or float64, got {dtype}") +
                           ".*layer.float\\(\\).*autocast"):
            layer(x)


@pytest.mark.parametrize("bad", [10, -1, 2_000_000_000])
def test_out_of_range_indices_raise_on_the_cpu(bad):
    """Without check_indices, the CPU kernels and the reference refuse an index outside [0, in_features) in every op,
    before reading or writing past an array (a gradient of all ones reaches every label)."""
    x, idx, w, b = _problem(4, 10, 70, 3, "cpu")
    idx[2, 65] = bad
    grad = torch.ones(4, 70)
    calls = [lambda: OPS.forward(x, idx, w, b), lambda: OPS.backward_input(grad, idx, w, 10),
             lambda: OPS.backward_weight(grad, x, idx), lambda: ref.forward(x, idx, w, b),
             lambda: ref.backward_input(grad, idx, w, 10), lambda: ref.backward_weight(grad, x, idx)]
    for call in calls:
        with pytest.raises((RuntimeError, SparseInputError), match=re.escape("indices must lie in [0, 10), found values in [")):
            call()


def test_index_limit_error():
    from xmc_repro.sparse.checks import check_op_inputs
    big = torch.empty(2**16, 2**15, dtype=torch.int32, device="meta")
    x = torch.empty(2, 5, device="meta")
    with pytest.raises(SparseInputError, match="2\\*\\*31"):
        check_op_inputs(x, big, torch.empty(big.shape, device="meta"), None)


def test_layer_size_errors_name_the_argument_and_the_run_setting():
    with pytest.raises(ConfigError, match=r"^connectivity=64 exceeds .* 32 input.*set connectivity \(model.connectivity "
                                          r"in a run\) <= 32"):
        UniformSparseLinear(32, 10, 64)
    with pytest.raises(ConfigError, match="^connectivity=0 must be a positive integer"):
        UniformSparseLinear(32, 10, 0)
    with pytest.raises(ConfigError, match="2\\*\\*31"):
        UniformSparseLinear(2**16, 2**26, 2**5)


def test_layer_sizes_may_be_numpy_integers():
    """Sizes computed with numpy (labels.max() + 1) are integers, as nn.Linear takes them; floats stay refused."""
    np = pytest.importorskip("numpy")
    layer = UniformSparseLinear(np.int64(16), np.int32(9), np.int64(3))
    assert (layer.in_features, layer.out_features, layer.connectivity) == (16, 9, 3)
    assert all(type(v) is int for v in (layer.in_features, layer.out_features, layer.connectivity))
    assert layer(torch.randn(2, 16)).shape == (2, 9)
    with pytest.raises(ConfigError, match="must be a positive integer"):
        UniformSparseLinear(16, 9, np.float64(3))
    with pytest.raises(ConfigError, match="must be a positive integer"):
        UniformSparseLinear(16, 9, True)


def test_forced_reference_backend_registers_the_schemas_the_library_does():
    """A fresh process on the reference backend (ops defined from Python) runs the op, differentiates it twice, and
    registers exactly the schemas that the compiled library's TORCH_LIBRARY registers in this process."""
    code = ("import torch; from xmc_repro.sparse import backend, uniform_sparse_linear as f;"
            "x=torch.randn(3,9); i=torch.randint(9,(2,5),dtype=torch.int32); w=torch.randn(2,5);"
            "y=f(x,i,w); d=[t.double().requires_grad_() for t in (x, w)];"
            "second=torch.autograd.gradgradcheck(lambda x, w: f(x, i, w), d);"
            "print(backend('cpu'), tuple(y.shape), second);"
            "print(*sorted(s for s in map(str, torch._C._jit_get_all_schemas()) if s.startswith('xmc_sparse::')),"
            "sep='\\n')")
    env = dict(os.environ, XMC_SPARSE_BACKEND="reference")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, *python_side = out.stdout.splitlines()
    assert first.split()[0] == "reference" and first.split()[-1] == "True"
    assert python_side == sorted(f"xmc_sparse::{s}" for s in sparse_op.schemas())
    if backend("cpu") == "compiled-cpu":  # this process: the ops as the C++ side defined them
        cpp_side = sorted(s for s in map(str, torch._C._jit_get_all_schemas()) if s.startswith("xmc_sparse::"))
        assert cpp_side == python_side
