"""Pure-torch uniform sparse layer: the fallback backend and the tests' oracle.

Every function walks the labels in chunks and the connections one at a time, so the largest
temporary is (batch, chunk) -- never a batch x connectivity x labels tensor.
"""
from __future__ import annotations

import torch

from .checks import check_index_range

# Largest temporary, in elements (16 MiB of float32).
_CHUNK_ELEMENTS = 1 << 22


def _slots(indices: torch.Tensor, batch: int, in_features: int):
    """(k, label slice, int64 sources) for every connection slot: labels in chunks, connections one at a time."""
    if indices.device.type == "cpu":  # as the compiled CPU kernels; on a GPU the check would wait for the device
        check_index_range(indices, in_features)
    connectivity, out_features = indices.shape
    step = max(1, _CHUNK_ELEMENTS // max(batch, 1))
    for start in range(0, out_features, step):
        cols = slice(start, min(start + step, out_features))
        for k in range(connectivity):
            yield k, cols, indices[k, cols].long()


def forward(x: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """out[b, j] = sum_k weight[k, j] * x[b, indices[k, j]] + bias[j]."""
    batch, out_features = x.shape[0], indices.shape[1]
    out = x.new_zeros(batch, out_features) if bias is None else bias.repeat(batch, 1)  # a copy, never a view
    for k, cols, src in _slots(indices, batch, x.shape[1]):
        out[:, cols].addcmul_(x.index_select(1, src), weight[k, cols])
    return out


def backward_input(grad_out: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor,
                   in_features: int) -> torch.Tensor:
    """grad_x[b, i] = sum over (k, j) with indices[k, j] == i of weight[k, j] * grad_out[b, j]."""
    grad_x = grad_out.new_zeros(grad_out.shape[0], in_features)
    for k, cols, src in _slots(indices, grad_out.shape[0], in_features):
        grad_x.index_add_(1, src, grad_out[:, cols] * weight[k, cols])
    return grad_x


def backward_weight(grad_out: torch.Tensor, x: torch.Tensor,
                    indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_weight, grad_bias): grad_weight[k, j] = sum_b grad_out[b, j] * x[b, indices[k, j]] and
    grad_bias[j] = sum_b grad_out[b, j] (the kernels sum it from the gradient columns they read anyway)."""
    grad_w = grad_out.new_empty(indices.shape)
    for k, cols, src in _slots(indices, grad_out.shape[0], x.shape[1]):
        torch.sum(grad_out[:, cols] * x.index_select(1, src), dim=0, out=grad_w[k, cols])
    return grad_w, grad_out.sum(0)


def dense_weight(indices: torch.Tensor, weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """The (out_features, in_features) dense matrix the sparse weights stand for (tests, small sizes)."""
    connectivity, out_features = indices.shape
    dense = torch.zeros(out_features, in_features, dtype=weight.dtype, device=weight.device)
    rows = torch.arange(out_features, device=weight.device).expand(connectivity, -1)
    dense.index_put_((rows.reshape(-1), indices.reshape(-1).long()), weight.reshape(-1), accumulate=True)
    return dense


def squared_hinge(scores: torch.Tensor, positives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, grad): loss = mean of relu(1 - (2y - 1) s)^2 with y = 1 at the flat positions ``positives``
    (repeats count once, entries < 0 are padding), grad = d loss / d scores. Every entry is summed as a
    negative, chunk by chunk, then corrected at the positives; nothing here waits for the device."""
    n = scores.numel()
    grad = torch.empty_like(scores)
    if n == 0:
        return torch.full((), float("nan"), dtype=scores.dtype, device=scores.device), grad
    flat, gflat = scores.reshape(-1), grad.view(-1)
    # Summed in float64, as the CPU kernel does: every positive is first summed as a negative, (s + 1)^2, and
    # taken off again, which in float32 cancels away the loss of large scores.
    total = torch.zeros((), dtype=torch.float64, device=scores.device)
    for lo in range(0, n, _CHUNK_ELEMENTS):
        h = (flat[lo : lo + _CHUNK_ELEMENTS] + 1).clamp_(min=0)
        total += h.double().square().sum()
        torch.mul(h, 2.0 / n, out=gflat[lo : lo + _CHUNK_ELEMENTS])
    p = torch.sort(positives).values  # padding first; a repeat follows its first occurrence
    keep = p >= 0
    keep[1:] &= p[1:] != p[:-1]
    q = p.clamp(min=0)  # padding reads entry 0 and writes nothing there (below)
    s = flat[q]
    hinge, neg = (1 - s).clamp(min=0), (1 + s).clamp(min=0)
    total += (hinge.double().square() - neg.double().square()).where(keep, 0).sum()
    # The positive gradient is <= 0 <= the negative one already written, so a minimum puts it in place,
    # whatever the order of repeated writes; padding offers +inf, which leaves its entry as it is.
    value = (hinge * (-2.0 / n)).where(p >= 0, float("inf"))
    gflat.scatter_reduce_(0, q, value, "amin")
    return (total / n).to(scores.dtype), grad
