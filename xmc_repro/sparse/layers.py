"""Sparse last layers: uniform (fixed fan-in) on the custom op, unstructured on torch's sparse tensors."""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from .checks import check_layer_sizes
from .op import uniform_sparse_linear
from .rewire import distinct_positions, lowest_magnitude, redraw_sources_, sample_uniform_sources



def _csr(crow, col, values, shape):
    with warnings.catch_warnings():  # torch warns that CSR support is "beta" on every first use
        warnings.simplefilter("ignore")
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _init_fan_in(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int,
                 generator: torch.Generator | None) -> None:
    # The bound nn.Linear's default init gives for this fan-in: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        weight.copy_(torch.rand(weight.shape, generator=generator, dtype=weight.dtype) * 2 * bound - bound)
        if bias is not None:
            bias.copy_(torch.rand(bias.shape, generator=generator, dtype=bias.dtype) * 2 * bound - bound)


class UniformSparseLinear(nn.Module):
    """Each output (label) reads exactly ``connectivity`` distinct inputs.

    Parameters: ``weight`` (connectivity, out_features), ``bias`` (out_features,); buffer
    ``indices`` (connectivity, out_features) int32 -- the layout of the paper's Algorithm 1,
    which makes one warp's loads of a connection slot coalesced over consecutive labels.

    Initialisation: weights and bias ~ U(-1/sqrt(c), 1/sqrt(c)) with c = connectivity, i.e. the
    bound ``nn.Linear`` uses with fan-in = connectivity. Each output sums c inputs, so scaling by
    the true fan-in keeps the initial score variance equal to that of a dense layer; scaling by
    in_features instead would shrink the initial scores by sqrt(in_features / c).
    Initial sources are distinct per label, sampled without replacement (vectorised rejection of
    duplicates, exact sampling when connectivity > in_features / 2).
    """

    def __init__(self, in_features: int, out_features: int, connectivity: int, bias: bool = True,
                 generator: torch.Generator | None = None):
        super().__init__()
        check_layer_sizes(in_features, out_features, connectivity)
        self.in_features, self.out_features, self.connectivity = in_features, out_features, connectivity
        self.register_buffer("indices", sample_uniform_sources(in_features, out_features, connectivity, generator))
        self.weight = nn.Parameter(torch.empty(connectivity, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _init_fan_in(self.weight, self.bias, connectivity, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = uniform_sparse_linear(x.reshape(-1, x.shape[-1]), self.indices, self.weight, self.bias)
        return out.reshape(*lead, self.out_features)

    @torch.no_grad()
    def rewire(self, fraction: float, generator: torch.Generator | None = None) -> torch.Tensor:
        """Give the globally lowest-|weight| ``fraction`` of slots new random sources (SET).

        Weight values are kept; each label keeps ``connectivity`` distinct sources. Returns the
        sorted flat positions into ``self.weight.view(-1)`` that were rewired, on the weight's
        device, so the caller can zero the optimizer's moments there.
        """
        positions = lowest_magnitude(self.weight, fraction)
        if positions.numel():
            redraw = torch.zeros(self.indices.shape, dtype=torch.bool, device=self.indices.device)
            redraw.view(-1)[positions] = True
            redraw_sources_(self.indices, redraw, self.in_features, generator)
        return positions

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"connectivity={self.connectivity}, bias={self.bias is not None}")


class _Structure:
    """CSR views of a connection list: rows sorted for W, columns sorted for W^T."""

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor, out_features: int, in_features: int):
        self.shape = (out_features, in_features)
        flat = rows * in_features + cols
        self.perm = torch.argsort(flat)  # slot order -> CSR order of W
        self.crow = torch.ops.aten._convert_indices_from_coo_to_csr(rows[self.perm], out_features)
        self.col = cols[self.perm].contiguous()
        flat_t = cols * out_features + rows
        self.perm_t = torch.argsort(flat_t)  # slot order -> CSR order of W^T
        self.crow_t = torch.ops.aten._convert_indices_from_coo_to_csr(cols[self.perm_t], in_features)
        self.col_t = rows[self.perm_t].contiguous()

    def matrix(self, values: torch.Tensor) -> torch.Tensor:
        return _csr(self.crow, self.col, values[self.perm], self.shape)

    def matrix_t(self, values: torch.Tensor) -> torch.Tensor:
        return _csr(self.crow_t, self.col_t, values[self.perm_t], (self.shape[1], self.shape[0]))


class _CsrLinear(torch.autograd.Function):
    """out = x @ W^T with W in CSR; backward: W^T-CSR product for x, sampled_addmm for the values."""

    @staticmethod
    def forward(ctx, x, values, structure: _Structure):
        ctx.save_for_backward(x, values)
        ctx.structure = structure
        return (structure.matrix(values) @ x.t()).t()

    @staticmethod
    def backward(ctx, grad):
        x, values = ctx.saved_tensors
        s = ctx.structure
        grad_x = grad_values = None
        if ctx.needs_input_grad[0]:
            grad_x = (s.matrix_t(values) @ grad.t()).t()
        if ctx.needs_input_grad[1]:
            pattern = _csr(s.crow, s.col, torch.zeros_like(values), s.shape)
            sampled = torch.sparse.sampled_addmm(pattern, grad.t().contiguous(), x.contiguous(), beta=0.0)
            grad_values = torch.empty_like(values)
            grad_values[s.perm] = sampled.values()
        return grad_x, grad_values, None


def csr_linear(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor,
               out_features: int, structure: _Structure | None = None) -> torch.Tensor:
    """``x @ W^T`` for W given as a connection list (rows=labels, cols=inputs, values) via torch CSR."""
    if structure is None:
        structure = _Structure(rows, cols, out_features, x.shape[1])
    return _CsrLinear.apply(x, values, structure)


class UnstructuredSparseLinear(nn.Module):
    """The unstructured baseline: ``connectivity * out_features`` connections placed uniformly at
    random over the whole (out_features, in_features) matrix -- ``connectivity`` per label on average.

    Parameters: ``weight`` (nnz,) values, ``bias``; buffer ``indices`` (2, nnz) int64 = (label, input)
    per slot. Runs on torch CSR tensors (cuSPARSE on GPU) with a hand-written backward that never
    forms a dense (out, in) gradient. Same initialisation as ``UniformSparseLinear`` (fan-in =
    connectivity, the average number of inputs per label).
    """

    def __init__(self, in_features: int, out_features: int, connectivity: int, bias: bool = True,
                 generator: torch.Generator | None = None):
        super().__init__()
        check_layer_sizes(in_features, out_features, connectivity)
        self.in_features, self.out_features, self.connectivity = in_features, out_features, connectivity
        nnz = connectivity * out_features
        flat = distinct_positions(nnz, out_features * in_features, generator, device="cpu").sort().values
        self.register_buffer("indices", torch.stack([flat // in_features, flat % in_features]))
        self.weight = nn.Parameter(torch.empty(nnz))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _init_fan_in(self.weight, self.bias, connectivity, generator)
        self._structure: _Structure | None = None

    def _get_structure(self) -> _Structure:
        s = self._structure
        if s is None or s.crow.device != self.indices.device:
            s = self._structure = _Structure(self.indices[0], self.indices[1], self.out_features, self.in_features)
        return s

    def _load_from_state_dict(self, *args, **kwargs):
        self._structure = None
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        out = _CsrLinear.apply(x2, self.weight, self._get_structure())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    @torch.no_grad()
    def rewire(self, fraction: float, generator: torch.Generator | None = None) -> torch.Tensor:
        """Move the globally lowest-|weight| ``fraction`` of connections to new uniformly random free
        (label, input) positions (SET); values are kept. Returns the rewired slots' sorted positions
        into ``self.weight.view(-1)``."""
        positions = lowest_magnitude(self.weight, fraction)
        if positions.numel():
            flat = self.indices[0] * self.in_features + self.indices[1]
            keep = torch.ones_like(flat, dtype=torch.bool)
            keep[positions] = False
            new = distinct_positions(positions.numel(), self.out_features * self.in_features, generator,
                                     taken=flat[keep].sort().values, device=flat.device)
            self.indices[0, positions] = new // self.in_features
            self.indices[1, positions] = new % self.in_features
            self._structure = None
        return positions

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"connectivity={self.connectivity} (on average), bias={self.bias is not None}")
