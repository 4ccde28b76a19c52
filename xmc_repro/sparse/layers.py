"""Sparse last layers: uniform (fixed fan-in) on the custom op, unstructured on torch's sparse tensors."""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from xmc_repro.validation import INITS

from .checks import SparseInputError, check_generator, check_layer_input, check_layer_sizes
from .op import uniform_sparse_linear
from .rewire import (distinct_positions, lowest_magnitude, random_positions, redraw_sources_,
                     redraw_with_replacement_, sample_uniform_sources)


def _csr(crow, col, values, shape):
    with warnings.catch_warnings():  # torch warns that CSR support is "beta" on every first use
        warnings.simplefilter("ignore")
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _uniform_(tensor: torch.Tensor, bound: float, generator: torch.Generator | None) -> None:
    tensor.copy_(torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype) * 2 * bound - bound)


def check_init(init: str) -> None:
    if init not in INITS:
        raise ValueError(f"init={init!r} is unknown; choose one of {', '.join(INITS)}")


@torch.no_grad()
def init_sparse_(weight: torch.Tensor, bias: torch.Tensor | None, init: str, fan_in: int,
                 generator: torch.Generator | None = None) -> None:
    """Initial weights and bias of a sparse layer.

    ``authors``: Keras' ``glorot_uniform`` on the flat vector of all connection weights, as the authors'
    layer stores them (fan-in = fan-out = numel, bound sqrt(3 / numel): 3.7e-4 at 32 x 670,091), bias zero.
    ``fan_in``: U(+-1/sqrt(fan_in)) for weights and bias, the bound ``nn.Linear`` uses for this fan-in, which
    keeps the initial score variance independent of the number of labels.
    """
    check_init(init)
    if init == "authors":
        _uniform_(weight, math.sqrt(3.0 / weight.numel()), generator)
        if bias is not None:
            bias.zero_()
        return
    bound = 1.0 / math.sqrt(fan_in)
    _uniform_(weight, bound, generator)
    if bias is not None:
        _uniform_(bias, bound, generator)


def _indices_misfit(state_dict, prefix: str, layer: nn.Module, bounds) -> str | None:
    """Why a state dict's ``indices`` do not fit this layer, or None. Saved from a layer with more inputs (or
    labels), they have the same shape: the CUDA kernels would read past the inputs, the CSR structure would put
    weights at other labels. ``bounds``: for each row of the (2-D view of the) indices, (setting, its size)."""
    indices = state_dict.get(prefix + "indices")
    if not isinstance(indices, torch.Tensor) or indices.is_meta or indices.numel() == 0:
        return None
    if indices.shape != layer.indices.shape:
        return None  # load_state_dict reports the size mismatch itself
    if indices.dtype != layer.indices.dtype:  # loading would convert them: floats truncated, int64 kept by assign=True
        return f"{prefix}indices are {indices.dtype}, this {type(layer).__name__}'s are {layer.indices.dtype}"
    rows = [indices] if len(bounds) == 1 else list(indices)
    for values, (setting, size) in zip(rows, bounds):
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= size:
            return (f"{prefix}indices hold values in [{lo}, {hi}] but this {type(layer).__name__} has {setting}={size}, "
                    f"so they must lie in [0, {size}): the state dict was saved from a layer of other sizes; build the "
                    f"layer with the sizes it was saved with")
    return None


SIZES = ("in_features", "out_features", "connectivity")
SIZES_KEY = "_extra_state"  # where torch's state_dict puts what get_extra_state returns


def _sizes_misfit(saved, prefix: str, layer: nn.Module) -> str | None:
    """Why sizes saved with a state dict do not fit this layer, or None (also for state dicts without them)."""
    if saved is None:
        return None
    ours = [getattr(layer, name) for name in SIZES]
    if isinstance(saved, torch.Tensor) and saved.shape == (len(SIZES),) and saved.tolist() == ours:
        return None
    name = type(layer).__name__
    if not isinstance(saved, torch.Tensor) or saved.shape != (len(SIZES),):
        return f"{prefix}{SIZES_KEY} is not the sizes of a {name}: the state dict is not one of this layer"

    def shown(values) -> str:
        return ", ".join(f"{key}={value}" for key, value in zip(SIZES, values))

    return (f"{prefix.rstrip('.') or 'the layer'}: the state dict was saved from a {name} with "
            f"{shown(saved.tolist())}, this one has {shown(ours)}; build the layer with the sizes it was saved with")


class _SavesItsSizes(nn.Module):
    """A sparse layer whose sizes travel in its state dict (torch's extra state, as an int64 tensor, so the state
    dict stays all tensors): one saved from a layer of other sizes is refused by name, also where every tensor's
    shape agrees (fewer inputs; as many connections over other labels). A state dict saved before the sizes were
    still loads, checked by its indices' range alone (``index_bounds``)."""

    def index_bounds(self) -> list[tuple[str, int]]:
        """For each row of the (2-D view of the) indices: (the size setting it indexes, its size)."""
        raise NotImplementedError

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([getattr(self, name) for name in SIZES])

    def set_extra_state(self, state) -> None:
        pass  # compared with this layer's before anything loads

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        misfit = (_sizes_misfit(state_dict.get(prefix + SIZES_KEY), prefix, self)
                  or _indices_misfit(state_dict, prefix, self, self.index_bounds()))
        if misfit:  # nothing of this layer is loaded; load_state_dict raises with the line
            error_msgs.append(misfit)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs)
        if prefix + SIZES_KEY in missing:  # saved before the sizes were
            missing.remove(prefix + SIZES_KEY)


class UniformSparseLinear(_SavesItsSizes):
    """Each output (label) reads exactly ``connectivity`` inputs.

    Parameters: ``weight`` (connectivity, out_features), ``bias`` (out_features,); buffer
    ``indices`` (connectivity, out_features) int32 -- the layout of the paper's Algorithm 1,
    which makes one warp's loads of a connection slot coalesced over consecutive labels.

    Defaults follow the authors' layer: ``init="authors"`` (see ``init_sparse_``) and sources drawn
    independently per slot, initially and at every rewiring, so a label may read an input twice.
    ``distinct_sources=True`` keeps each label's sources distinct instead (without-replacement sampling:
    vectorised rejection of duplicates, exact sampling when connectivity > in_features / 2).
    """

    def __init__(self, in_features: int, out_features: int, connectivity: int, bias: bool = True,
                 generator: torch.Generator | None = None, init: str = "authors", distinct_sources: bool = False):
        super().__init__()
        in_features, out_features, connectivity = check_layer_sizes(in_features, out_features, connectivity)
        check_generator(generator)
        check_init(init)  # here, not only where the weights are drawn: on the meta device that is later, if ever
        self.in_features, self.out_features, self.connectivity = in_features, out_features, connectivity
        self.distinct_sources, self.init = distinct_sources, init
        self.register_buffer("indices", torch.empty(connectivity, out_features, dtype=torch.int32))
        self.weight = nn.Parameter(torch.empty(connectivity, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if not self.weight.is_meta:  # built under torch.device("meta"): to_empty(device=...), then reset_parameters
            self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """New random sources and initial weights, as at construction (what deferred initialisation calls)."""
        check_generator(generator)
        self.indices.copy_(sample_uniform_sources(self.in_features, self.out_features, self.connectivity, generator,
                                                  self.distinct_sources))
        init_sparse_(self.weight, self.bias, self.init, self.connectivity, generator)

    def index_bounds(self) -> list[tuple[str, int]]:
        return [("in_features", self.in_features)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layer_input(x, self.in_features)
        lead = x.shape[:-1]
        out = uniform_sparse_linear(x.reshape(-1, x.shape[-1]), self.indices, self.weight, self.bias)
        return out.reshape(*lead, self.out_features)

    @torch.no_grad()
    def rewire(self, fraction: float, generator: torch.Generator | None = None,
               exact_count: bool = False) -> torch.Tensor:
        """Give the globally lowest-|weight| ``fraction`` of slots new random sources (SET).

        Weight values are kept; each label keeps ``connectivity`` slots (distinct sources if
        ``distinct_sources``). ``exact_count``: see ``lowest_magnitude``. Returns the sorted flat positions
        into ``self.weight.view(-1)`` that were rewired, on the weight's device, so the caller can zero the
        optimizer's moments there.
        """
        check_generator(generator)
        positions = lowest_magnitude(self.weight, fraction, exact_count)
        if positions.numel():
            redraw = torch.zeros(self.indices.shape, dtype=torch.bool, device=self.indices.device)
            redraw.view(-1)[positions] = True
            if self.distinct_sources:
                redraw_sources_(self.indices, redraw, self.in_features, generator)
            else:
                redraw_with_replacement_(self.indices, redraw, self.in_features, generator)
        return positions

    def positions(self) -> torch.Tensor:
        """Where each connection is in the (label, input) matrix: label * in_features + input, int64."""
        labels = torch.arange(self.out_features, device=self.indices.device)
        return (self.indices.long() + labels * self.in_features).view(-1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"connectivity={self.connectivity}, bias={self.bias is not None}")


class _Structure:
    """CSR views of a connection list: rows sorted for W, columns sorted for W^T.

    Slots at the same (row, column) are one entry of the matrices, whose value is the sum of theirs: summed here
    in slot order (``values``), since torch's sparse kernels do not promise to sum repeated entries; each of
    them gets the entry's gradient (``slot_grads``).
    """

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor, out_features: int, in_features: int):
        self.shape = (out_features, in_features)
        flat, perm = torch.sort(rows * in_features + cols, stable=True)  # CSR order of W, slots in order
        starts = torch.ones_like(flat, dtype=torch.bool)
        starts[1:] = flat[1:] != flat[:-1]
        entry = starts.cumsum(0) - 1  # CSR position -> its entry
        first = starts.nonzero().squeeze(1)  # entry -> its first CSR position
        self.first_slot = perm[first]  # entry -> its first slot
        self.slot_entry = torch.empty_like(entry)
        self.slot_entry[perm] = entry  # slot -> its entry
        # The other slots of an entry, by their rank in it, as (entry, slot): each rank adds at most once to an entry
        rank = torch.arange(flat.numel(), device=flat.device) - first[entry]
        at_rank = [(rank == r).nonzero().squeeze(1) for r in range(1, int(rank.max()) + 1)] if len(rank) else []
        self.repeats = [(entry[at], perm[at]) for at in at_rank]
        flat = flat[first]
        rows, cols = flat // in_features, flat % in_features
        self.crow = torch.ops.aten._convert_indices_from_coo_to_csr(rows, out_features)
        self.col = cols.contiguous()
        self.perm_t = torch.argsort(cols * out_features + rows)  # entry -> CSR order of W^T
        self.crow_t = torch.ops.aten._convert_indices_from_coo_to_csr(cols[self.perm_t], in_features)
        self.col_t = rows[self.perm_t].contiguous()

    def values(self, slot_values: torch.Tensor) -> torch.Tensor:
        """The entries of W in CSR order: one gather, plus one add per repeat rank."""
        entries = slot_values[self.first_slot]
        for entry, slot in self.repeats:
            entries = entries.index_add(0, entry, slot_values[slot])
        return entries

    def slot_grads(self, entry_grads: torch.Tensor) -> torch.Tensor:
        return entry_grads[self.slot_entry]

    def matrix(self, entries: torch.Tensor) -> torch.Tensor:
        return _csr(self.crow, self.col, entries, self.shape)

    def matrix_t(self, entries: torch.Tensor) -> torch.Tensor:
        return _csr(self.crow_t, self.col_t, entries[self.perm_t], (self.shape[1], self.shape[0]))


class _FirstOrderOnly(torch.autograd.Function):
    """A first-order gradient of ``_CsrLinear``, in the graph of the tensors it was computed from (``sources``):
    differentiating it again raises rather than returning a second derivative without its terms."""

    @staticmethod
    def forward(ctx, grad, *sources):
        return grad.clone()

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError("UnstructuredSparseLinear is differentiable once (a gradient penalty or double backward "
                           "asks for more); use UniformSparseLinear, whose op has exact derivatives of any order")


class _CsrLinear(torch.autograd.Function):
    """out = x @ W^T with W in CSR; backward: W^T-CSR product for x, sampled_addmm for the values (first order
    only: torch's CSR products hold no graph here, so a second derivative would miss terms and is refused)."""

    @staticmethod
    def forward(ctx, x, values, structure: _Structure):
        entries = structure.values(values)
        ctx.save_for_backward(x, values, entries)
        ctx.structure = structure
        return (structure.matrix(entries) @ x.t()).t()

    @staticmethod
    def backward(ctx, grad):
        x, values, entries = ctx.saved_tensors
        s = ctx.structure
        grad_x = grad_values = None
        with torch.no_grad():
            if ctx.needs_input_grad[0]:
                grad_x = (s.matrix_t(entries) @ grad.t()).t()
            if ctx.needs_input_grad[1]:
                pattern = _csr(s.crow, s.col, torch.zeros_like(entries), s.shape)
                sampled = torch.sparse.sampled_addmm(pattern, grad.t().contiguous(), x.contiguous(), beta=0.0)
                grad_values = s.slot_grads(sampled.values())
        if torch.is_grad_enabled():  # create_graph=True
            grad_x, grad_values = (None if g is None else _FirstOrderOnly.apply(g, grad, x, values)
                                   for g in (grad_x, grad_values))
        return grad_x, grad_values, None


def csr_linear(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor,
               out_features: int, structure: _Structure | None = None) -> torch.Tensor:
    """``x @ W^T`` for W given as a connection list (rows=labels, cols=inputs, values) via torch CSR."""
    if structure is None:
        structure = _Structure(rows, cols, out_features, x.shape[1])
    return _CsrLinear.apply(x, values, structure)


class UnstructuredSparseLinear(_SavesItsSizes):
    """The unstructured baseline: ``connectivity * out_features`` connections placed uniformly at
    random over the whole (out_features, in_features) matrix -- ``connectivity`` per label on average.

    Parameters: ``weight`` (nnz,) values, ``bias``; buffer ``indices`` (2, nnz) int64 = (label, input)
    per slot. Runs on torch CSR tensors (cuSPARSE on GPU) with a hand-written backward that never
    forms a dense (out, in) gradient. Initialisation as ``UniformSparseLinear`` (for ``fan_in``: the
    average number of inputs per label).

    As in the authors' layer, positions are drawn with replacement, initially and at rewiring, so a label may
    read an input through several slots: their weights add up (``_Structure``). ``distinct_sources=True`` keeps every
    position distinct instead.
    """

    cuda_graph_safe = False  # rewiring rebuilds the CSR structure in new tensors, which a captured step would miss

    def __init__(self, in_features: int, out_features: int, connectivity: int, bias: bool = True,
                 generator: torch.Generator | None = None, init: str = "authors", distinct_sources: bool = False):
        super().__init__()
        in_features, out_features, connectivity = check_layer_sizes(in_features, out_features, connectivity)
        check_generator(generator)
        check_init(init)  # here, not only where the weights are drawn: on the meta device that is later, if ever
        self.in_features, self.out_features, self.connectivity = in_features, out_features, connectivity
        self.distinct_sources, self.init = distinct_sources, init
        nnz = connectivity * out_features
        self.register_buffer("indices", torch.empty(2, nnz, dtype=torch.int64))
        self.weight = nn.Parameter(torch.empty(nnz))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._structure: _Structure | None = None
        if not self.weight.is_meta:  # built under torch.device("meta"): to_empty(device=...), then reset_parameters
            self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """New random positions and initial weights, as at construction (what deferred initialisation calls)."""
        check_generator(generator)
        draw = distinct_positions if self.distinct_sources else random_positions
        flat = draw(self.weight.numel(), self.out_features * self.in_features, generator, device="cpu").sort().values
        self.indices.copy_(torch.stack([flat // self.in_features, flat % self.in_features]))
        init_sparse_(self.weight, self.bias, self.init, self.connectivity, generator)
        self._structure = None

    def _get_structure(self) -> _Structure:
        s = self._structure
        if s is None or s.crow.device != self.indices.device:
            s = self._structure = _Structure(self.indices[0], self.indices[1], self.out_features, self.in_features)
        return s

    def index_bounds(self) -> list[tuple[str, int]]:
        return [("out_features", self.out_features), ("in_features", self.in_features)]

    def _load_from_state_dict(self, *args):
        self._structure = None
        super()._load_from_state_dict(*args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layer_input(x, self.in_features)
        if x.device.type == "cpu" and self.weight.dtype not in (torch.float32, torch.float64):  # e.g. layer.half()
            raise SparseInputError(f"weight must be float32 or float64, got {self.weight.dtype}: torch's sparse CSR "
                                   "products have no 16-bit CPU kernels; keep the layer's parameters in float32 "
                                   "(layer.float()) and run 16-bit activations under torch.autocast")
        lead = x.shape[:-1]
        if x.device.type == "meta":  # shape inference on a layer built under torch.device("meta"): no CSR products
            return x.new_empty((*lead, self.out_features), dtype=self.weight.dtype)
        # In the weights' dtype, autocast or not (bf16-mixed hands over bf16 activations): torch's CSR products take
        # one dtype, and MKL's have no bf16 at all. So the layer computes as the uniform op does under autocast.
        x2 = x.reshape(-1, x.shape[-1]).to(self.weight.dtype)
        with torch.autocast(x.device.type, enabled=False):
            out = _CsrLinear.apply(x2, self.weight, self._get_structure())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    @torch.no_grad()
    def rewire(self, fraction: float, generator: torch.Generator | None = None,
               exact_count: bool = False) -> torch.Tensor:
        """Move the globally lowest-|weight| ``fraction`` of connections to new uniformly random (label, input)
        positions (SET), free ones if ``distinct_sources``; values are kept. Returns the rewired slots' sorted
        positions into ``self.weight.view(-1)``."""
        check_generator(generator)
        positions = lowest_magnitude(self.weight, fraction, exact_count)
        if positions.numel():
            total = self.out_features * self.in_features
            if self.distinct_sources:
                flat = self.indices[0] * self.in_features + self.indices[1]
                keep = torch.ones_like(flat, dtype=torch.bool)
                keep[positions] = False
                new = distinct_positions(positions.numel(), total, generator, taken=flat[keep].sort().values,
                                         device=flat.device)
            else:
                new = random_positions(positions.numel(), total, generator, self.indices.device)
            self.indices[0, positions] = new // self.in_features
            self.indices[1, positions] = new % self.in_features
            self._structure = None
        return positions

    def positions(self) -> torch.Tensor:
        """Where each connection is in the (label, input) matrix: label * in_features + input, int64."""
        return self.indices[0] * self.in_features + self.indices[1]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"connectivity={self.connectivity} (on average), bias={self.bias is not None}")


def repeated_connections_pct(layers) -> float:
    """Percent of the connections of `layers` that repeat another's position (the second and later connections of
    a label to one input), as drawing with replacement makes them."""
    positions = [layer.positions() for layer in layers]
    total = sum(p.numel() for p in positions)
    return 100.0 * sum(p.numel() - p.unique().numel() for p in positions) / max(total, 1)
