"""Random sources for sparse layers: initial sampling and prune-and-regrow rewiring (SET).

All randomness is drawn from a CPU ``torch.Generator`` in an order fixed by slot position, and
every device-side step is a deterministic function of integer data (stable sorts), so the same
generator state gives the same connections on any device.
"""
from __future__ import annotations

import torch

from xmc_repro.sparse.checks import SparseInputError

# Fall back from rejection sampling to exact sampling after this many rounds.
_MAX_REJECTION_ROUNDS = 8
# Temporary budget (elements) of the exact sampler: columns x in_features keys per chunk.
_EXACT_ELEMENTS = 1 << 24
# Labels rewired together, and weights scanned together when finding the lowest magnitudes: both keep
# rewiring's temporaries to a few MB at 670k labels.
_LABELS_PER_GROUP = 1 << 15
_MAGNITUDE_SLICE = 1 << 22
# Integer views with the same width as a float: for |w| >= 0 their order is the order of the magnitudes.
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _draw(n: int, high: int, generator: torch.Generator | None, device) -> torch.Tensor:
    return torch.randint(high, (n,), generator=generator, dtype=torch.int64).to(device)


def _later_duplicates(values: torch.Tensor, redraw: torch.Tensor) -> torch.Tensor:
    """Per column of ``values`` (rows = slots), mark slots in ``redraw`` that repeat another slot's value.

    Within a run of equal values the kept slot is the one not being redrawn if there is one (those are
    distinct by invariant), else the lowest slot; every other slot of the run is marked.
    """
    connectivity = values.shape[0]
    # Unique sort keys (value, redrawn?, slot): any sort gives one order, so the result is the same on
    # every device; int32 keys and a contiguous last dimension make the sort fast.
    small = (int(values.max()) + 1) * 2 * connectivity < 2**31
    dtype = torch.int32 if small else torch.int64
    key = values.t().to(dtype).contiguous()
    key.mul_(2).add_(redraw.t().to(dtype)).mul_(connectivity)
    key.add_(torch.arange(connectivity, device=values.device, dtype=dtype))
    sorted_key, order = torch.sort(key, dim=1)
    sorted_val = sorted_key // (2 * connectivity)
    dup = torch.zeros(sorted_key.shape, dtype=torch.bool, device=values.device)
    dup[:, 1:] = sorted_val[:, 1:] == sorted_val[:, :-1]
    return torch.zeros_like(dup).scatter_(1, order, dup).t()


def _exact_fill(block: torch.Tensor, redraw: torch.Tensor, in_features: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """Give the redraw slots of each column distinct sources not used by the column's kept slots.

    Per column: random keys over all inputs, kept sources pushed last, argsort; the r-th redraw slot
    (in slot order) takes the r-th source. Exact and duplicate-free whatever the density. CPU only.
    """
    connectivity, cols = block.shape
    step = max(1, _EXACT_ELEMENTS // in_features)
    out = block.clone()
    for start in range(0, cols, step):
        sub, red = block[:, start:start + step], redraw[:, start:start + step]
        n = sub.shape[1]
        keys = torch.rand(n, in_features, generator=generator)
        col_of_slot = torch.arange(n).expand(connectivity, n)
        kept = ~red
        keys[col_of_slot[kept], sub[kept]] = 2.0  # beyond any key in [0, 1)
        order = torch.argsort(keys, dim=1, stable=True)
        rank = torch.cumsum(red.long(), dim=0) - 1  # r-th redraw slot within its column
        new = sub.clone()
        new[red] = order[col_of_slot[red], rank[red]]
        out[:, start:start + step] = new
    return out


def redraw_sources(indices: torch.Tensor, redraw: torch.Tensor, in_features: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """New uniformly random sources for the ``redraw`` slots of ``indices`` (connectivity, labels).

    Each label's sources stay distinct (needs connectivity <= in_features, and the kept sources of
    each label distinct). Returns an int64 tensor on ``indices``' device; ``indices`` is not modified.
    """
    idx = indices.long().clone()
    connectivity = idx.shape[0]
    pending = redraw.to(device=idx.device, dtype=torch.bool).clone()
    rounds = 0
    # Dense-ish labels (connectivity > in/2) make rejection slow: sample them exactly at once.
    exact = 2 * connectivity > in_features
    while True:
        cols = pending.any(0).nonzero().squeeze(1)
        if cols.numel() == 0:
            return idx
        if exact or rounds >= _MAX_REJECTION_ROUNDS:
            block = idx[:, cols].cpu()
            filled = _exact_fill(block, pending[:, cols].cpu(), in_features, generator)
            idx[:, cols] = filled.to(idx.device)
            return idx
        flat = pending.view(-1).nonzero().squeeze(1)  # ascending slot order => device independent
        idx.view(-1)[flat] = _draw(flat.numel(), in_features, generator, idx.device)
        # Only labels that got a new draw can hold a duplicate.
        block = idx[:, cols]
        was_redrawn = redraw.to(idx.device)[:, cols]
        pending = torch.zeros_like(pending)
        pending[:, cols] = _later_duplicates(block, was_redrawn)
        rounds += 1


def redraw_sources_(indices: torch.Tensor, redraw: torch.Tensor, in_features: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``redraw_sources`` written into ``indices`` (any integer dtype), a group of labels at a time.

    Only labels with a slot to redraw are touched, so the int64 copies and sort keys of
    ``redraw_sources`` stay group-sized. Up to ``_LABELS_PER_GROUP`` such labels the draws are
    exactly those of ``redraw_sources`` on the whole tensor.
    """
    labels = redraw.any(0).nonzero().squeeze(1)
    for group in labels.split(_LABELS_PER_GROUP):
        new = redraw_sources(indices[:, group], redraw[:, group], in_features, generator)
        indices[:, group] = new.to(indices.dtype)
    return indices


def redraw_with_replacement_(indices: torch.Tensor, redraw: torch.Tensor, in_features: int,
                             generator: torch.Generator | None = None) -> torch.Tensor:
    """The authors' regrowth: each ``redraw`` slot gets a uniformly random source, drawn independently.

    A label may then read one input through two slots (its fan-in is still ``connectivity`` slots). Draws go to
    the slots in ascending position, so the same generator state gives the same sources on any device.
    """
    flat = redraw.reshape(-1).nonzero().squeeze(1)
    indices.view(-1)[flat] = _draw(flat.numel(), in_features, generator, indices.device).to(indices.dtype)
    return indices


def sample_uniform_sources(in_features: int, out_features: int, connectivity: int,
                           generator: torch.Generator | None = None, distinct: bool = False) -> torch.Tensor:
    """(connectivity, out_features) int32: ``connectivity`` random inputs per label.

    ``distinct=False`` draws every slot independently, as the authors' layer does; ``distinct=True`` samples
    each label's inputs without replacement.
    """
    start = torch.zeros(connectivity, out_features, dtype=torch.int64)
    everything = torch.ones(connectivity, out_features, dtype=torch.bool)
    if distinct:
        start = redraw_sources(start, everything, in_features, generator)
    else:
        redraw_with_replacement_(start, everything, in_features, generator)
    return start.to(torch.int32).contiguous()


def lowest_magnitude(weight: torch.Tensor, fraction: float, exact_count: bool = False) -> torch.Tensor:
    """Sorted flat positions of the smallest-|weight| entries (global).

    The threshold t is the ``round(fraction * numel)``-th smallest magnitude. ``exact_count=False`` selects the
    entries strictly below t, as the authors' selector does (one fewer than the count when magnitudes are
    distinct, fewer still at ties); ``exact_count=True`` selects exactly the count, ties at t going to the
    lowest positions. The threshold is found by bisection on the bit
    pattern of |w| (ordered like the magnitudes), a slice of the weights at a time: no weight-sized
    temporary. A top-k over all 21M weights of an Amazon-670K layer would hold |w| plus its outputs
    (~110 MB) next to the parameters, gradients and Adam moments at the moment rewiring runs.
    """
    fraction = float(fraction)  # a 0-d tensor or numpy number too
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"rewire fraction={fraction} must lie in [0, 1]")
    flat = weight.detach().reshape(-1)
    count = int(round(fraction * flat.numel()))
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=weight.device)
    bits_dtype = _BITS[flat.element_size()]
    slices = [(lo, flat[lo:lo + _MAGNITUDE_SLICE]) for lo in range(0, flat.numel(), _MAGNITUDE_SLICE)]

    def magnitude_bits(part):
        return part.abs().view(bits_dtype)

    def at_most(threshold: int) -> int:
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        for _, part in slices:
            total += (magnitude_bits(part) <= threshold).sum()
        return int(total)

    lo, hi = 0, torch.iinfo(bits_dtype).max
    while lo < hi:  # smallest threshold with at least `count` magnitudes at or below it
        mid = (lo + hi) // 2
        if at_most(mid) >= count:
            hi = mid
        else:
            lo = mid + 1
    below, ties = [], []
    for start, part in slices:
        bits = magnitude_bits(part)
        below.append((bits < lo).nonzero().squeeze(1) + start)
        ties.append((bits == lo).nonzero().squeeze(1) + start)
    below = torch.cat(below)
    if not exact_count:
        return below
    return torch.cat([below, torch.cat(ties)[:count - below.numel()]]).sort().values


def random_positions(count: int, total: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """``count`` random integers in [0, total), drawn independently (a value may repeat), int64."""
    return _draw(count, total, generator, device)


def distinct_positions(count: int, total: int, generator: torch.Generator | None = None,
                       taken: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """``count`` distinct random integers in [0, total) that avoid the sorted ``taken`` ones (int64)."""
    free = total - (0 if taken is None else taken.numel())
    if count > free:
        raise ValueError(f"cannot place {count} connections in {free} free positions")
    if taken is None and 2 * count > total:
        # Dense: an exact permutation costs memory proportional to count anyway.
        return torch.randperm(total, generator=generator)[:count].to(device)
    taken = torch.empty(0, dtype=torch.int64, device=device) if taken is None else taken.to(device)
    out = _draw(count, total, generator, device)
    pending = torch.ones(count, dtype=torch.bool, device=device)
    while True:
        # Conflicts: equal to a taken position, or a repeat of an earlier draw.
        pos = torch.searchsorted(taken, out).clamp_max(max(taken.numel() - 1, 0))
        clash = taken[pos] == out if taken.numel() else torch.zeros_like(pending)
        sorted_out, order = torch.sort(out, stable=True)
        repeat = torch.zeros_like(pending)
        repeat[1:] = sorted_out[1:] == sorted_out[:-1]
        clash |= torch.zeros_like(pending).scatter_(0, order, repeat)
        pending = clash
        where = pending.nonzero().squeeze(1)
        if where.numel() == 0:
            return out
        out[where] = _draw(where.numel(), total, generator, device)


@torch.no_grad()
def reset_optimizer_state_(optimizer: torch.optim.Optimizer, weight: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero ``optimizer``'s per-weight state of ``weight`` (Adam's moments, SGD's momentum: every state tensor of
    the weight's shape) at the flat positions ``slots`` that a layer's ``rewire`` returned, so that a regrown
    connection starts without its predecessor's history, as in the authors' code. Scalar state (Adam's step
    count) is the whole tensor's and stays."""
    if slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < weight.numel():
        raise SparseInputError(f"slots lie in [{int(slots.min())}, {int(slots.max())}], outside the {weight.numel()} "
                               "entries of the tensor given: pass the weight of the layer whose rewire returned them")
    for value in optimizer.state.get(weight, {}).values():
        if torch.is_tensor(value) and value.shape == weight.shape:
            value.view(-1)[slots.to(value.device)] = 0
