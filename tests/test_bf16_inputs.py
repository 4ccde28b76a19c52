"""bf16 inputs to the uniform op (bf16-mixed training): gathered as bf16 on CUDA, accumulated in float32.

The result must equal the float32 op on the same inputs rounded to bf16: the kernels only read fewer bytes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import generator

from xmc_repro.sparse import reference, uniform_sparse_linear
from xmc_repro.sparse.op import backend, ensure_registered
from xmc_repro.sparse.rewire import sample_uniform_sources

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _problem(batch, inputs, labels, connectivity, seed):
    gen = generator(seed)
    x = torch.randn(batch, inputs, generator=gen).bfloat16()
    idx = sample_uniform_sources(inputs, labels, connectivity, gen)
    w = torch.randn(connectivity, labels, generator=gen)
    b = torch.randn(labels, generator=gen)
    g = torch.randn(batch, labels, generator=gen) * (torch.rand(batch, labels, generator=gen) < 0.3)
    return x, idx, w, b, g


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("batch,inputs,labels,connectivity", [(1, 7, 5, 3), (5, 300, 1001, 7), (33, 64, 257, 32)])
def test_bf16_inputs_equal_float32_on_the_rounded_inputs(batch, inputs, labels, connectivity):
    ensure_registered()
    if not backend("cuda").startswith("compiled-cuda"):
        pytest.skip("bf16 inputs need the compiled CUDA kernels")
    x, idx, w, b, g = (t.cuda() for t in _problem(batch, inputs, labels, connectivity, seed=batch))
    ops = torch.ops.xmc_sparse
    out = ops.forward(x, idx, w, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference.forward(x.float(), idx, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.backward_weight(g, x, idx), reference.backward_weight(g, x.float(), idx),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@cuda
def test_autocast_keeps_bf16_inputs_and_gradients_flow():
    """Under autocast the layer gets the intermediate layer's bf16 output; x's gradient comes back in bf16."""
    ensure_registered()
    x, idx, w, b, g = (t.cuda() for t in _problem(6, 40, 101, 5, seed=4))
    hidden = torch.nn.Linear(40, 40).cuda()
    wp, bp = torch.nn.Parameter(w), torch.nn.Parameter(b)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = hidden(x.float())
        assert h.dtype == torch.bfloat16
        out = uniform_sparse_linear(h, idx, wp, bp)
    assert out.dtype == torch.float32
    out.backward(g)
    assert hidden.weight.grad is not None and torch.isfinite(hidden.weight.grad).all()
    h32 = h.detach().float().requires_grad_()
    want = reference.forward(h32, idx, w, b)
    torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-5)
    grad_w, grad_b = reference.backward_weight(g, h32.detach(), idx)
    torch.testing.assert_close(wp.grad, grad_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bp.grad, grad_b)
