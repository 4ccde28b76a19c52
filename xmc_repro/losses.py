"""Losses from label lists, averaged over batch and labels (as the authors' ``SparseLossBase``).

* squared hinge ``relu(1 - (2y - 1) s)^2``: negatives with ``s <= -1`` get an exactly zero gradient;
* BCE with logits ``softplus(s) - y s``.

Both are written as "every label negative" plus a correction at the few positive entries, inside a
custom autograd function, so the (batch, labels) target never exists. That matters at 670k labels,
where each such tensor is ~86 MB per 32 points. The squared hinge is one fused op
(``xmc_sparse::squared_hinge``) that writes the gradient while it sums the loss and keeps only the
gradient; BCE keeps the scores and allocates its gradient, one (batch, labels) tensor, in backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from xmc_repro.data.labels import flat_keys
from xmc_repro.sparse.checks import check_device

_CHUNK = 1 << 22  # elements per slice when summing the all-negative part (caps the temporary)


def check_labels(label_ptr: torch.Tensor, label_idx: torch.Tensor, scores_shape) -> None:
    """The CSR lists must describe the scores' rows, and every label lie in [0, labels): one outside would mark an
    entry of a neighbouring row. Checked where the lists are on the host; on a GPU the check would make the step
    wait for the device (the pipeline's readers check their files). A compiled graph asserts the labels' range."""
    if len(scores_shape) != 2:
        raise ValueError(f"scores must be 2-D (batch, labels), got shape {tuple(scores_shape)}")
    rows, num_labels = scores_shape
    if torch.compiler.is_compiling():  # a traced check cannot read values: the graph checks them when it runs
        torch._assert_async(((label_idx >= 0) & (label_idx < num_labels)).all(),
                            "labels must lie in [0, labels) (the scores' columns)")
        return
    if label_idx.device.type != "cpu" or label_ptr.device.type != "cpu":
        return
    if label_ptr.dim() != 1 or len(label_ptr) != rows + 1 or label_ptr[0] != 0 or label_ptr[-1] != len(label_idx):
        raise ValueError(f"label_ptr must hold {rows + 1} offsets (one per row of the scores, and one past the end) "
                         f"from 0 to len(label_idx)={len(label_idx)}; got {len(label_ptr)} from "
                         f"{label_ptr[0].item() if len(label_ptr) else '-'} to "
                         f"{label_ptr[-1].item() if len(label_ptr) else '-'}")  # fmt: skip
    if (label_ptr[1:] < label_ptr[:-1]).any():
        raise ValueError("label_ptr must not decrease: row i's labels are label_idx[label_ptr[i]:label_ptr[i + 1]]")
    if not label_idx.numel():
        return
    lo, hi = int(label_idx.min()), int(label_idx.max())
    if lo < 0 or hi >= num_labels:
        raise ValueError(f"labels must lie in [0, {num_labels}) (the scores' columns), found values in [{lo}, {hi}]")


def positive_positions(label_ptr: torch.Tensor, label_idx: torch.Tensor, num_labels: int, device) -> torch.Tensor:
    """Sorted flat positions ``row * num_labels + label`` of the positive entries, one per listed label.

    A label listed twice for one row appears twice (``first_occurrences`` marks one of them). Every size here
    is known on the host, so nothing waits for the device (``torch.unique`` would: its length is data).
    """
    return torch.sort(flat_keys(label_ptr, label_idx.to(device), num_labels)).values


def first_occurrences(positions: torch.Tensor) -> torch.Tensor:
    """For sorted positions: True at the first of each run of equal values (a repeated label counts once)."""
    first = torch.ones_like(positions, dtype=torch.bool)
    first[1:] = positions[1:] != positions[:-1]
    return first


def dense_targets(label_ptr, label_idx, num_labels: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The (batch, labels) 0/1 target on ``device``, built from the CSR lists (for reference and small cases)."""
    device = label_idx.device if device is None else device
    b = len(label_ptr) - 1
    check_labels(label_ptr, label_idx, (b, num_labels))
    y = torch.zeros(b * num_labels, dtype=dtype, device=device)
    y[positive_positions(label_ptr, label_idx, num_labels, device)] = 1
    return y.view(b, num_labels)


def _acc(scores: torch.Tensor) -> torch.dtype:
    """Sums run in float32 at least (float64 stays float64)."""
    return torch.promote_types(scores.dtype, torch.float32)


def _bce_sum(scores: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """The float64 sum of softplus(s) over the negatives and softplus(-s) over the distinct positives (flat
    positions in any order; entries < 0 are padding).

    The positives' entries are set to 0 in each slice's softplus before it is summed, rather than summed and taken
    off again: softplus(s) ~ s at a positive of score s beyond ~1e8 would cancel the other terms away, and at
    s = +inf give inf - inf (NaN) where the loss is 0. Slices of rows cap the (slice, labels) temporary."""
    b, n = scores.shape
    flat, acc = scores.reshape(-1), _acc(scores)
    if not flat.numel():  # the mean of nothing is NaN; padding would index an empty tensor
        return torch.zeros((), dtype=torch.float64, device=scores.device)
    p = torch.sort(positives).values  # padding first, a repeat next to its first occurrence
    own = F.softplus(-flat[p.clamp(min=0)].to(torch.float64))  # a positive's exact term: 0 at s = +inf
    total = own.where(first_occurrences(p) & (p >= 0), 0).sum()
    step = max(1, _CHUNK // max(n, 1))
    # Each positive's slice and place in it, for all slices at once (a few small ops, not a few per slice).
    slices = torch.arange(-(-b // step), device=scores.device).unsqueeze(1)
    inside = positives.div(step * n, rounding_mode="floor") == slices  # padding lies in no slice
    local = torch.where(inside, positives - slices * (step * n), 0)
    # softplus >= 0, so a minimum with 0 clears a positive's entry; +inf (another slice's positive) leaves it.
    clear = torch.zeros((), dtype=acc, device=scores.device).where(inside, float("inf"))
    for i, lo in enumerate(range(0, b, step)):
        terms = F.softplus(scores[lo : lo + step].to(acc)).view(-1)
        terms.scatter_reduce_(0, local[i], clear[i], "amin")
        total = total + terms.sum(dtype=torch.float64)
    return total


class _SquaredHinge(torch.autograd.Function):
    """The fused op computes the loss and its gradient in one pass; only the gradient is kept, so the
    scores can be freed as soon as the loss is taken."""

    @staticmethod
    def forward(ctx, scores, positives, root):
        from xmc_repro.sparse.op import registered_backend

        registered_backend(scores.device.type)  # defines the ops on first use, also inside torch.compile
        # bf16/fp16 scores (a dense head under autocast) are computed in float32.
        work = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
        loss, grad = torch.ops.xmc_sparse.squared_hinge(work, positives)
        # float16 gradients stay float32 until scaled: entries of 2/(B*L) relu(.), ~1e-7 at 670k labels, would
        # round to float16's subnormals before a GradScaler's factor (the incoming gradient) reached them.
        ctx.save_for_backward(grad if scores.dtype == torch.float16 else grad.to(scores.dtype))
        ctx.root, ctx.dtype = root, scores.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradient has no graph of its own
            raise RuntimeError("the fused squared hinge loss is differentiable once (create_graph=True asks for the "
                               "gradient's gradient); compute that loss from dense_targets for higher derivatives")
        if getattr(ctx, "spent", False):
            raise RuntimeError("the fused squared hinge loss keeps its gradient for one backward (retain_graph=True "
                               "asked for another); compute the loss again for a second backward")
        (grad,) = ctx.saved_tensors
        if ctx.root:  # the caller backpropagates the loss itself: the incoming gradient is 1
            return grad.to(ctx.dtype), None, None
        # Scaled in place: the saved gradient has no other reader, so no second (B, L) tensor is allocated.
        ctx.spent = True
        return grad.mul_(grad_out).to(ctx.dtype), None, None


class _BCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, positives):
        ctx.save_for_backward(scores, positives)
        return (_bce_sum(scores, positives) / scores.numel()).to(_acc(scores))

    @staticmethod
    def backward(ctx, grad_out):
        scores, positives = ctx.saved_tensors
        scale = (grad_out / scores.numel()).to(scores.dtype)
        if not scores.numel():
            return torch.zeros_like(scores), None
        # A positive's term softplus(-s) has the derivative -sigmoid(-s), exact where sigmoid(s) - 1 rounds to 0
        # (s beyond ~17 in float32). It is <= 0 <= sigmoid(s), so a minimum writes it, whatever the repeats;
        # padding offers +inf, which leaves entry 0 as it is.
        at = positives.clamp(min=0)
        own = (-torch.sigmoid(-scores.reshape(-1)[at])).where(positives >= 0, float("inf"))
        grad = torch.sigmoid(scores)
        if torch.is_grad_enabled():  # create_graph=True: out of place (sigmoid's own backward reads its output)
            return grad.reshape(-1).scatter_reduce(0, at, own, "amin").view_as(scores) * scale, None
        grad.view(-1).scatter_reduce_(0, at, own, "amin")
        return grad.mul_(scale), None


def squared_hinge_from_positions(scores: torch.Tensor, positives: torch.Tensor, root: bool = False) -> torch.Tensor:
    """mean over batch and labels of ``relu(1 - (2y - 1) s)^2`` with y = 1 at the flat positions
    ``row * L + label`` in ``positives`` (any order; a repeat counts once; entries < 0 are padding, so a
    fixed-capacity list works, e.g. in a CUDA graph). Scores (B, L); bf16/fp16 scores give a float32 loss.

    ``root=True`` promises that backward starts at this loss (``loss.backward()``, nothing scaled after it), as in
    the graph step: the gradient is then used as computed, without a pass over the (B, L) gradient that multiplies
    it by the incoming 1 (0.07 ms a step at Amazon-670K's size). Anything else would get an unscaled gradient."""
    check_device(scores, "scores")
    # The flat positions index a row-major layout (a transposed sparse product is not one).
    return _SquaredHinge.apply(scores.contiguous(), positives.to(scores.device, torch.long), root)


def squared_hinge_loss(scores: torch.Tensor, label_ptr: torch.Tensor, label_idx: torch.Tensor) -> torch.Tensor:
    """mean over batch and labels of ``relu(1 - (2y - 1) s)^2``; scores (B, L), labels as CSR lists."""
    check_labels(label_ptr, label_idx, scores.shape)
    # The fused op needs neither sorted nor distinct positions: the unsorted keys spare a sort.
    positives = flat_keys(label_ptr, label_idx.to(scores.device), scores.shape[1])
    return squared_hinge_from_positions(scores, positives)


def bce_from_positions(scores: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """``bce_loss`` given the flat positive positions ``row * L + label``, as ``squared_hinge_from_positions`` takes
    them: any order, a repeat counts once, entries < 0 are padding (a fixed-capacity list in a CUDA graph)."""
    return _BCE.apply(scores.contiguous(), positives.to(scores.device, torch.long))


def bce_loss(scores: torch.Tensor, label_ptr: torch.Tensor, label_idx: torch.Tensor) -> torch.Tensor:
    """mean over batch and labels of binary cross-entropy with logits; scores (B, L), labels as CSR lists."""
    check_labels(label_ptr, label_idx, scores.shape)
    return bce_from_positions(scores, flat_keys(label_ptr, label_idx.to(scores.device), scores.shape[1]))


# The form a CUDA-graph step calls with a fixed-size list (xmc_repro.step_graph): both in any order, padded with
# -1, so the step sorts nothing for the squared hinge (BCE sorts its list itself, to count a repeat once); the
# squared hinge's as the root of backward.
squared_hinge_loss.from_positions = squared_hinge_from_positions
squared_hinge_from_positions.any_order = squared_hinge_from_positions.takes_root = True
bce_loss.from_positions = bce_from_positions
bce_from_positions.any_order = True


class TrainingLossLog:
    """Every training step's loss, kept where it was computed: the first NaN or Inf loss is found, and the epoch's
    mean summed, without making the host wait for the device at every step.

    On a GPU each loss is copied into a device buffer of ``every`` slots (one copy per step); the buffer is read back
    (one sync) when full, and whenever ``flush`` is asked for. On a CPU each loss is read at once. A read reports the
    first non-finite loss with its step, and adds the others to the epoch's sum weighted by batch size. So a run
    stops up to ``every - 1`` steps after a bad loss, and the report names the step where it first appeared.
    """

    def __init__(self, every: int = 50):
        self.every = every
        self._buffer: torch.Tensor | None = None
        self._pending: list[tuple[int, int]] = []  # (step, batch size) of each buffered loss
        self._sum, self._points = 0.0, 0

    def new_epoch(self) -> tuple[float, int] | None:
        """Start the epoch's mean afresh; returns what `flush` finds among losses still unread."""
        bad = self.flush()
        self._sum, self._points = 0.0, 0
        return bad

    def add(self, loss: torch.Tensor, step: int, batch_size: int, flush: bool = False) -> tuple[float, int] | None:
        """Record this step's loss; returns (loss value, step) of the first non-finite loss once it is read."""
        loss = loss.detach()
        if self._buffer is None or self._buffer.device != loss.device:
            bad = self.flush()  # the losses held on the previous device
            if bad is not None:
                return bad
            self._buffer = torch.empty(self.every, dtype=torch.float64, device=loss.device)
        self._buffer[len(self._pending)].copy_(loss)
        self._pending.append((step, batch_size))
        if len(self._pending) < self.every and not flush and loss.device.type != "cpu":
            return None
        return self.flush()

    def flush(self) -> tuple[float, int] | None:
        """Read the buffered losses back: (value, step) of the first non-finite one, else None."""
        if not self._pending:
            return None
        values = self._buffer[: len(self._pending)].tolist()  # the one sync
        pending, self._pending = self._pending, []
        for value, (step, batch_size) in zip(values, pending):
            if not math.isfinite(value):
                return value, step
            self._sum += value * batch_size
            self._points += batch_size
        return None

    def totals(self) -> tuple[float, float]:
        """The epoch's loss sum (weighted by batch size) and points so far, of the read steps (`flush` first)."""
        return self._sum, self._points

    def load_totals(self, loss_sum: float, points: float) -> None:
        """Go on from these totals: a run resumed mid-epoch keeps the epoch's mean of the steps before."""
        self._sum, self._points = float(loss_sum), float(points)

    @property
    def unread(self) -> int:
        """Losses recorded and not read back yet (0 right after a read)."""
        return len(self._pending)

    @property
    def epoch_mean(self) -> float | None:
        """Mean loss of the epoch's read steps, weighted by batch size (None before any)."""
        return self._sum / self._points if self._points else None
