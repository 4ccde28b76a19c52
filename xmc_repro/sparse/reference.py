"""Pure-torch uniform sparse layer: the fallback backend and the tests' oracle.

Every function walks the labels in chunks and the connections one at a time, so the largest
temporary is (batch, chunk) -- never a batch x connectivity x labels tensor.
"""
from __future__ import annotations

import torch

# Largest temporary, in elements (16 MiB of float32).
_CHUNK_ELEMENTS = 1 << 22


def _label_chunks(batch: int, out_features: int):
    step = max(1, _CHUNK_ELEMENTS // max(batch, 1))
    for start in range(0, out_features, step):
        yield slice(start, min(start + step, out_features))


def forward(x: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """out[b, j] = sum_k weight[k, j] * x[b, indices[k, j]] + bias[j]."""
    batch = x.shape[0]
    connectivity, out_features = indices.shape
    out = torch.empty(batch, out_features, dtype=x.dtype, device=x.device)
    for cols in _label_chunks(batch, out_features):
        acc = out[:, cols]
        if bias is None:
            acc.zero_()
        else:
            acc.copy_(bias[cols].expand_as(acc))
        for k in range(connectivity):
            acc.addcmul_(x.index_select(1, indices[k, cols].long()), weight[k, cols])
    return out


def backward_input(grad_out: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor,
                   in_features: int) -> torch.Tensor:
    """grad_x[b, i] = sum over (k, j) with indices[k, j] == i of weight[k, j] * grad_out[b, j]."""
    batch = grad_out.shape[0]
    connectivity, out_features = indices.shape
    grad_x = torch.zeros(batch, in_features, dtype=grad_out.dtype, device=grad_out.device)
    for cols in _label_chunks(batch, out_features):
        g = grad_out[:, cols]
        for k in range(connectivity):
            grad_x.index_add_(1, indices[k, cols].long(), g * weight[k, cols])
    return grad_x


def backward_weight(grad_out: torch.Tensor, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """grad_weight[k, j] = sum_b grad_out[b, j] * x[b, indices[k, j]]."""
    batch = grad_out.shape[0]
    connectivity, out_features = indices.shape
    grad_w = torch.empty(connectivity, out_features, dtype=grad_out.dtype, device=grad_out.device)
    for cols in _label_chunks(batch, out_features):
        g = grad_out[:, cols]
        for k in range(connectivity):
            torch.sum(g * x.index_select(1, indices[k, cols].long()), dim=0, out=grad_w[k, cols])
    return grad_w


def dense_weight(indices: torch.Tensor, weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """The (out_features, in_features) dense matrix the sparse weights stand for (tests, small sizes)."""
    connectivity, out_features = indices.shape
    dense = torch.zeros(out_features, in_features, dtype=weight.dtype, device=weight.device)
    rows = torch.arange(out_features, device=weight.device).expand(connectivity, -1)
    dense.index_put_((rows.reshape(-1), indices.reshape(-1).long()), weight.reshape(-1), accumulate=True)
    return dense
