"""One training step's forward, loss and backward, replayed as a CUDA graph.

At batch 32 the uniform model's step is a few dozen small kernels; issued one by one from Python, the host
is slower than the device. Captured once, a step is one graph launch. What stays outside the graph:

* nothing of the batch but its copy into fixed buffers: the inputs, the label lists' row ends and the labels, in
  a buffer of fixed capacity. The graph turns them into the positive positions, in list order and padded with -1
  (both losses take them so, and count a repeated position once). So a step costs the host four calls;
* the optimizer: fused Adam is one kernel per parameter group, and outside the graph its state can be
  replaced (a checkpoint load), reset (rewiring) and its learning rate changed as usual;
* rewiring: it writes the connection indices and weights in place, which the graph reads on its next replay.

The gradients live in the graph's memory; ``attach_grads`` points the parameters' ``.grad`` at them after a
replay (Lightning sets them to None between the training step and backward). A batch the graph cannot take
(another batch size, more listed labels than the capacity) is recaptured for, and a parameter replaced under the
graph (``model.to``) makes the next step recapture. ``release`` frees the graph's memory (the model calls it
before validation, so evaluation runs without the step's gradients held).

cuBLAS keeps a workspace for every thread and stream it has run on (a step: two per stream, the forward's and
autograd's; 65 MiB per stream on an H100 at torch's sizes, 18 MiB at ``trainer.cublas_workspace_mib=8``). The
capture runs on a side stream and evaluation on the current one, so both would keep theirs for the whole run,
above the eager step's peak. Capture and release therefore drop cuBLAS's workspaces (as torch.compile's CUDA
graphs do) when no graph is alive: the step holds the side stream's, evaluation the current stream's, never both.
"""
from __future__ import annotations

import torch

WARMUP_STEPS = 3  # eager steps on a side stream before capture (cuBLAS and the allocator settle)


def free_cublas_workspaces(device: torch.device) -> None:
    """Drop cuBLAS's per-stream workspaces once the device is idle (the next matmul on a stream makes a new one).
    Only while no captured graph that used them is alive: a graph reads its workspace by address."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private; absent from CPU builds
    if device.type == "cuda" and clear is not None:
        torch.cuda.synchronize(device)
        clear()


class CaptureError(RuntimeError):
    """The step could not be captured (an op that syncs or allocates outside the graph's pool, say)."""


def loss_from_positions(loss_fn):
    """The positive-list form of a loss (its `from_positions`), seen through a bare `functools.partial`, or None."""
    if getattr(loss_fn, "args", ()) == () and getattr(loss_fn, "keywords", {}) == {}:
        loss_fn = getattr(loss_fn, "func", loss_fn)
    return getattr(loss_fn, "from_positions", None)


def unsupported_reason(model, precision: str = "32-true", world_size: int = 1) -> str | None:
    """Why `model`'s training step cannot be a CUDA graph here, or None when it can."""
    if model.device.type != "cuda":
        return "not on a CUDA device"
    if world_size > 1:
        return "DDP reduces gradients during backward, outside any graph"
    if str(precision) not in ("32", "32-true", "bf16-mixed"):
        return f"precision {precision}: only 32-true and bf16-mixed steps are captured (16-mixed scales the loss)"
    if getattr(model.head, "meta_labels", None) is not None:
        return "the head trains on other targets than the labels"
    if loss_from_positions(model.loss_fn) is None:
        return "the loss takes no positive list"
    for module in model.modules():
        if getattr(module, "cuda_graph_safe", True) is False:
            return f"{type(module).__name__} reallocates its structure when it rewires"
    return None


def padded_positions(ends: torch.Tensor, labels: torch.Tensor, num_labels: int, sort: bool = True) -> torch.Tensor:
    """The flat positions ``row * num_labels + label`` of CSR label lists: sorted and padded with the last one, or
    with ``sort=False`` in list order and padded with -1 (for a loss that takes them so: no sort on the device).

    ``ends[i]`` is where row i's labels end (``label_ptr[1:]``); ``labels`` is a buffer whose first ``ends[-1]``
    entries are the listed labels (the rest is ignored). The result has ``labels``' length. Every shape is fixed
    and nothing is read back, so this runs inside a CUDA graph.
    """
    slots = torch.arange(labels.numel(), device=labels.device)
    listed = slots < ends[-1]
    rows = torch.searchsorted(ends, slots, right=True)  # the row whose labels hold each slot
    if not sort:
        return torch.where(listed, rows * num_labels + labels, -1)
    keys = torch.where(listed, rows * num_labels + labels, torch.iinfo(torch.long).max)
    keys = torch.sort(keys).values  # the listed positions first, sorted
    last = keys.gather(0, (ends[-1:] - 1).clamp(min=0))
    return torch.where(listed, keys, last)


def capacity_for(count: int) -> int:
    """Room for ``count`` positives: the next power of two, at least 256 (few recaptures as batches vary)."""
    return max(256, 1 << (count - 1).bit_length())


class StepGraph:
    """Forward, loss and backward of ``model`` on one batch, captured once and replayed per step.

    ``loss_from_positions(scores, positives)`` is the loss given sorted flat positive positions (repeats allowed),
    or, if it has ``any_order = True``, given them in any order with -1 as padding; if it has ``takes_root = True``
    it is called with ``root=True`` (backward starts at the loss it returns).
    """

    def __init__(self, model, loss_from_positions, num_labels: int):
        self.model = model
        self.loss_from_positions = loss_from_positions
        self.num_labels = num_labels
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        self._key = None
        # One side stream for every warm-up and capture: cuBLAS keeps a workspace per stream it ran on, so a new
        # stream per capture (at every rewiring) would leave 65 MiB behind each time.
        self._stream: torch.cuda.Stream | None = None
        self._autocast: torch.dtype | None = None

    def _tensors_key(self):
        """The storage of every parameter and buffer: the graph reads them by address."""
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def _forward_backward(self) -> torch.Tensor:
        # Under bf16-mixed the caller's autocast holds; its cache of cast weights must not outlive the capture,
        # so the step casts afresh inside the graph (cache off).
        with torch.autocast("cuda", dtype=self._autocast or torch.bfloat16, enabled=self._autocast is not None,
                            cache_enabled=False):
            form = self.loss_from_positions
            positives = padded_positions(self.static_ends, self.static_labels, self.num_labels,
                                         sort=not getattr(form, "any_order", False))
            root = {"root": True} if getattr(form, "takes_root", False) else {}  # backward starts at this loss
            # No name holds the scores (batch x labels, 82 MiB at 670k labels): a loss that does not save them for
            # its backward frees them before backward, as the eager step does, so capture peaks as low.
            loss = form(self.model.head(self.model.encoder(self.static_x)), positives, **root)
        loss.backward()
        return loss.detach()

    def _capture(self, x: torch.Tensor, label_ptr: torch.Tensor, label_idx: torch.Tensor) -> None:
        # The old graph's memory first: its gradients and buffers would otherwise stay allocated through the new
        # capture (a recapture for a smaller last batch, or for more labels than the buffer holds).
        self.release()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.static_x = x.detach().clone()
        self.static_ends = label_ptr[1:].to(x.device, torch.long, copy=True)
        self.static_labels = torch.zeros(capacity_for(label_idx.numel()), dtype=torch.long, device=x.device)
        self.static_labels[:label_idx.numel()].copy_(label_idx)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=x.device)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                for p in params:
                    p.grad = None
                self._forward_backward()
        torch.cuda.current_stream(x.device).wait_stream(side)
        for p in params:  # the graph allocates the gradients it writes at every replay
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            self.static_loss = self._forward_backward()
        self.params, self.static_grads = params, [p.grad for p in params]
        self.graph = graph
        self.captures += 1

    def step(self, x: torch.Tensor, label_ptr: torch.Tensor, label_idx: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward on ``x`` and its label lists (CSR, on x's device); returns the loss (its own
        tensor). The gradients are written into the graph's buffers: call ``attach_grads`` before the optimizer step.
        """
        listed = label_idx.numel()
        if listed == 0:
            raise ValueError("a graphed step needs at least one positive label in the batch")
        autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        key = (tuple(x.shape), x.dtype, autocast, self._tensors_key())
        if self.graph is not None and key == self._key and listed <= self.static_labels.numel():
            self.static_x.copy_(x)
            self.static_ends.copy_(label_ptr[1:])
            self.static_labels[:listed].copy_(label_idx)
            self.graph.replay()
        else:
            self._autocast = autocast
            try:
                self._capture(x, label_ptr, label_idx)
            except Exception as error:
                self.graph = None
                for p in self.model.parameters():
                    p.grad = None
                raise CaptureError(f"{type(error).__name__}: {error}") from error
            self._key = key
            self.graph.replay()  # the capture itself ran nothing
        return self.static_loss.clone()  # the logger may keep it past the next replay

    def release(self) -> None:
        """Free the graph and its memory (gradients and activations included) and cuBLAS's workspaces; the next
        step captures anew."""
        self.graph = self._key = None
        self.params = self.static_grads = []
        self.static_x = self.static_ends = self.static_labels = self.static_loss = None
        for p in self.model.parameters():  # the attached gradients live in the graph's memory
            p.grad = None
        free_cublas_workspaces(self.model.device)

    def attach_grads(self) -> None:
        for p, g in zip(self.params, self.static_grads):
            p.grad = g
