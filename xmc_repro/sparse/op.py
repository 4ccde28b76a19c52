"""The uniform sparse op ``xmc_sparse::forward`` and its two backward ops, with autograd, and the fused
squared hinge loss ``xmc_sparse::squared_hinge`` (loss and gradient in one pass; autograd in xmc_repro.losses).

The schema is written once, in cuda_ext/schema.h: the compiled library defines the ops from it
(cuda_ext/ops.cpp), and without that library (no compiler, or ``XMC_SPARSE_BACKEND=reference``)
the same strings are read here and the ops defined from Python, backed by the pure-torch
reference. Callers, ``torch.compile`` and ``opcheck`` see one op either way. A device type without
compiled kernels (CUDA when nvcc is missing) also gets the reference. Fake kernels, autograd and
autocast are registered here for both backends.
"""
from __future__ import annotations

import os
import re
import threading
import warnings

import torch

from . import build, reference
from .checks import SparseInputError, check_op_inputs, check_tensor_types

NAMESPACE = "xmc_sparse"
_REFERENCE_KERNELS = {
    "forward": reference.forward,
    "backward_input": reference.backward_input,
    "backward_weight": reference.backward_weight,
    "squared_hinge": reference.squared_hinge,
}
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_BF16_INPUT_OPS = ("forward", "backward_weight")  # take bf16 x with float32 weights on compiled CUDA
_FLOATS = (torch.float32, torch.float64)

# The CUDA kernels' phases, in the order XMC_SPARSE_KERNELS and the backend name list them.
ROWS_PHASES = ("forward", "backward_input", "backward_weight")
# The kernel families a phase can hand over to (a phase not handed over runs a thread per label,
# cuda_ext/cuda/uniform_sparse_kernels.cuh): a warp per label (`rows`, uniform_sparse_rows_kernels.cuh) and 8 lanes
# per label with 4 batch rows per lane (`vec`, there too), each in every phase; each (family, phase) with its bit in
# xmc_bench::use_rows_kernels' mask (KernelChoice, uniform_sparse_common.cuh).
KERNEL_BITS = {("rows", "forward"): 1, ("rows", "backward_input"): 2, ("rows", "backward_weight"): 4,
               ("vec", "forward"): 8, ("vec", "backward_weight"): 16, ("vec", "backward_input"): 32}
FAMILIES = ("rows", "vec")
# The op's kernels by default: the fastest mix in an epoch at Amazon-670K's shape on an H200 (median step 1.77 ms
# against 2.27 ms on the thread-per-label kernels and 1.98 ms all on rows; README). The vec kernels are untimed.
DEFAULT_KERNELS = "rows:forward,backward_input"

_lock = threading.Lock()
_backends: dict[str, str] | None = None
_libraries: list[torch.library.Library] = []  # Python registrations live as long as these objects


def schemas() -> list[str]:
    """The ops' schemas as cuda_ext/schema.h writes them (one quoted string per op)."""
    text = (build.source_dir() / "schema.h").read_text()
    found = re.findall(r'^\s*"(\w+\(.*\) -> .*)",?\s*$', text, flags=re.MULTILINE)
    if not found:
        raise build.BuildError(f"no op schema found in {build.source_dir() / 'schema.h'}")
    return found


# ---------------------------------------------------------------- fake kernels (shapes only)
# They run under torch.compile and opcheck with no data: check what the C++ checks can check
# from metadata, so a traced graph fails where the real kernel would.


def _check_structure(indices, weight):
    torch._check(indices.dim() == 2, lambda: "indices must be 2-D (connectivity, out_features)")
    torch._check(indices.dtype == torch.int32, lambda: f"indices must be int32, got {indices.dtype}")
    torch._check(weight.shape == indices.shape, lambda: "weight shape must equal indices shape")
    torch._check(weight.dtype in _FLOATS, lambda: f"weight must be float32/float64, got {weight.dtype}")
    torch._check(weight.device == indices.device, lambda: "weight and indices must be on one device")


def _check_dense(t, like, name):
    torch._check(t.dim() == 2, lambda: f"{name} must be 2-D")
    torch._check(t.dtype == like.dtype, lambda: f"{name} dtype {t.dtype} must equal {like.dtype}")
    torch._check(t.device == like.device, lambda: f"{name} must be on the device of weight")


def _check_input(x, weight):
    """x like the weight, or bf16 with float32 weights (the CUDA kernels gather bf16 inputs)."""
    torch._check(x.dim() == 2, lambda: "x must be 2-D")
    torch._check(x.dtype == weight.dtype or (x.dtype == torch.bfloat16 and weight.dtype == torch.float32),
                 lambda: f"x dtype {x.dtype} must equal {weight.dtype} (or be bfloat16 with float32 weights)")
    torch._check(x.device == weight.device, lambda: "x must be on the device of weight")


def _fake_forward(x, indices, weight, bias):
    _check_structure(indices, weight)
    _check_input(x, weight)
    if bias is not None:
        torch._check(bias.shape == (indices.shape[1],), lambda: "bias must have shape (out_features,)")
        torch._check(bias.dtype == weight.dtype, lambda: "bias dtype must equal weight dtype")
    return weight.new_empty(x.shape[0], indices.shape[1])


def _fake_backward_input(grad_out, indices, weight, in_features):
    _check_structure(indices, weight)
    _check_dense(grad_out, weight, "grad_out")
    torch._check(grad_out.shape[1] == indices.shape[1], lambda: "grad_out must have out_features columns")
    return grad_out.new_empty(grad_out.shape[0], in_features)


def _fake_backward_weight(grad_out, x, indices):
    torch._check(indices.dim() == 2 and indices.dtype == torch.int32, lambda: "indices must be 2-D int32")
    torch._check(grad_out.dtype in _FLOATS, lambda: f"grad_out must be float32/float64, got {grad_out.dtype}")
    _check_input(x, grad_out)
    torch._check(grad_out.dim() == 2 and grad_out.shape[1] == indices.shape[1],
                 lambda: "grad_out must have out_features columns")
    torch._check(x.shape[0] == grad_out.shape[0], lambda: "x and grad_out must share the batch size")
    return grad_out.new_empty(indices.shape), grad_out.new_empty(indices.shape[1])


def _fake_squared_hinge(scores, positives):
    torch._check(scores.dim() == 2, lambda: "scores must be 2-D (batch, labels)")
    torch._check(scores.dtype in _FLOATS, lambda: f"scores must be float32/float64, got {scores.dtype}")
    torch._check(positives.dim() == 1 and positives.dtype == torch.int64, lambda: "positives must be 1-D int64")
    torch._check(positives.device == scores.device, lambda: "positives must be on the device of scores")
    return scores.new_empty(()), scores.new_empty(scores.shape)


# ---------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, indices, weight, bias = inputs
    needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    # grad_x needs the weights, grad_w needs the inputs: save only what a needed gradient reads.
    ctx.save_for_backward(x if needs_w else None, indices if needs_x or needs_w else None,
                          weight if needs_x else None)
    ctx.in_features, ctx.x_dtype = x.shape[1], x.dtype


def _backward(ctx, grad):
    x, indices, weight = ctx.saved_tensors
    grad = grad.contiguous()  # e.g. the expanded ones of out.sum().backward()
    needs_x, needs_w, needs_b = (ctx.needs_input_grad[i] for i in (0, 2, 3))
    ops = torch.ops.xmc_sparse
    grad_x = ops.backward_input(grad, indices, weight, ctx.in_features).to(ctx.x_dtype) if needs_x else None
    grad_w = grad_b = None
    if needs_w:  # the weight backward reads every gradient column, and sums them for the bias on the way
        grad_w, summed = ops.backward_weight(grad, x, indices)
        grad_b = summed if needs_b else None
    elif needs_b:
        grad_b = grad.sum(0)
    return grad_x, None, grad_w, grad_b


# Both backward ops are linear in each tensor argument, and their derivatives are the three ops again, so
# gradients of any order are exact (double backward, gradient penalties, Hessian-vector products):
#   grad_x = backward_input(g, w):            d/dg <- forward(gg_x, w)        d/dw <- backward_weight(g, gg_x)[0]
#   (grad_w, grad_b) = backward_weight(g, x): d/dg <- forward(x, gg_w, gg_b)  d/dx <- backward_input(g, gg_w)


def _setup_backward_input(ctx, inputs, output):
    grad_out, indices, weight, _ = inputs
    ctx.save_for_backward(grad_out if ctx.needs_input_grad[2] else None, indices,
                          weight if ctx.needs_input_grad[0] else None)


def _backward_of_backward_input(ctx, gg_x):
    grad_out, indices, weight = ctx.saved_tensors
    ops, gg_x = torch.ops.xmc_sparse, gg_x.contiguous()  # in the weights' dtype, as grad_x is
    d_grad = ops.forward(gg_x, indices, weight, None) if ctx.needs_input_grad[0] else None
    d_weight = ops.backward_weight(grad_out, gg_x, indices)[0] if ctx.needs_input_grad[2] else None
    return d_grad, None, d_weight, None


def _setup_backward_weight(ctx, inputs, output):
    grad_out, x, indices = inputs
    ctx.save_for_backward(grad_out if ctx.needs_input_grad[1] else None, x if ctx.needs_input_grad[0] else None,
                          indices)
    ctx.in_features, ctx.x_dtype, ctx.dtype = x.shape[1], x.dtype, grad_out.dtype


def _backward_of_backward_weight(ctx, gg_w, gg_b):
    grad_out, x, indices = ctx.saved_tensors
    if gg_w is None:
        gg_w = torch.zeros(indices.shape, dtype=ctx.dtype, device=indices.device)
    ops, gg_w = torch.ops.xmc_sparse, gg_w.contiguous()
    gg_b = None if gg_b is None else gg_b.contiguous()
    d_grad = ops.forward(x, indices, gg_w, gg_b) if ctx.needs_input_grad[0] else None
    d_x = None
    if ctx.needs_input_grad[1]:
        d_x = ops.backward_input(grad_out, indices, gg_w, ctx.in_features).to(ctx.x_dtype)
    return d_grad, d_x, None


# ---------------------------------------------------------------- registration


def kernel_families(setting: str | None) -> dict[str, str]:
    """{phase: family} for every phase in `ROWS_PHASES` order, from an `XMC_SPARSE_KERNELS` value: unset
    `DEFAULT_KERNELS`; `threads` a thread per label in every phase; `rows` a warp per label in every phase;
    otherwise groups `<family>:<phases>` joined by `+`, e.g. `rows:backward_input+vec:forward,backward_weight`
    (phases a comma list; a phase not named: `threads`). Raises SparseInputError with one line otherwise."""
    value = (setting or "").strip().lower() or DEFAULT_KERNELS
    families = dict.fromkeys(ROWS_PHASES, "threads")
    if value == "threads":
        return families
    if value == "rows":
        return dict.fromkeys(ROWS_PHASES, "rows")
    for group in value.split("+"):
        family, colon, names = (part.strip() for part in group.partition(":"))
        phases = [name.strip() for name in names.split(",")]
        if family not in FAMILIES or not colon or not all(phase in ROWS_PHASES for phase in phases):
            raise SparseInputError(
                f"XMC_SPARSE_KERNELS={setting!r} must be threads, rows, or rows:<phases> and/or vec:<phases> joined "
                f"by + (phases: a comma list of {', '.join(ROWS_PHASES)}), e.g. rows:backward_input+vec:forward")
        for phase in phases:
            if (family, phase) not in KERNEL_BITS:
                raise SparseInputError(f"XMC_SPARSE_KERNELS={setting!r}: {family} has no {phase} kernel (it has "
                                       f"{', '.join(p for f, p in KERNEL_BITS if f == family)})")
            if families[phase] not in ("threads", family):
                raise SparseInputError(f"XMC_SPARSE_KERNELS={setting!r} names {phase} for both {families[phase]} "
                                       f"and {family}: one family per phase")
            families[phase] = family
    return families


def kernels_mask(families: dict[str, str]) -> int:
    """The mask xmc_bench::use_rows_kernels takes for `families` ({phase: family}; a phase missing: threads)."""
    return sum(KERNEL_BITS.get((family, phase), 0) for phase, family in families.items())


def kernels_setting(families: dict[str, str]) -> str:
    """The shortest `XMC_SPARSE_KERNELS` value for `families` ({phase: family}; a phase missing: threads), phases
    in `ROWS_PHASES` order: `threads`, `rows`, or e.g. `rows:backward_input+vec:forward,backward_weight`."""
    groups = {family: [phase for phase in ROWS_PHASES if families.get(phase) == family] for family in FAMILIES}
    if len(groups["rows"]) == len(ROWS_PHASES):
        return "rows"
    return "+".join(f"{family}:{','.join(phases)}" for family, phases in groups.items() if phases) or "threads"


def cuda_backend(families: dict[str, str]) -> str:
    """The compiled CUDA backend's name, which names the kernels it runs in each phase (MLflow tag `sparse_backend`):
    `compiled-cuda` on the thread-per-label kernels, else e.g. `compiled-cuda-rows:forward,backward_input`."""
    return "compiled-cuda" if not kernels_mask(families) else "compiled-cuda-" + kernels_setting(families)


def _register() -> dict[str, str]:
    mode = os.environ.get("XMC_SPARSE_BACKEND", "auto").strip().lower() or "auto"
    if mode not in ("auto", "reference", "compiled"):
        raise SparseInputError(f"XMC_SPARSE_BACKEND={mode!r} must be one of auto, reference, compiled")
    # Which CUDA kernels the op runs in each phase (a bad setting refused before anything is built)
    families = kernel_families(os.environ.get("XMC_SPARSE_KERNELS"))
    compiled: set[str] = set()
    if mode != "reference":
        compiled, errors = build.load_compiled()
        if mode == "compiled" and not compiled:
            raise build.BuildError("XMC_SPARSE_BACKEND=compiled but the kernels did not build: " + "; ".join(errors))
        if errors:
            warnings.warn("xmc_repro.sparse: compiled kernels unavailable for some devices, using the pure-torch "
                          "reference there (slower): " + "; ".join(errors), RuntimeWarning, stacklevel=3)
    if compiled:  # the library defined the ops (TORCH_LIBRARY)
        lib = torch.library.Library(NAMESPACE, "IMPL")
    else:
        lib = torch.library.Library(NAMESPACE, "DEF")
        for schema in schemas():
            lib.define(schema)
    _libraries.append(lib)
    backends = {}
    for device, key in _DISPATCH_KEYS.items():
        if device in compiled:
            backends[device] = f"compiled-{device}"
            if device == "cuda":
                torch.ops.xmc_bench.use_rows_kernels(kernels_mask(families))
                backends[device] = cuda_backend(families)
            continue
        for name, fn in _REFERENCE_KERNELS.items():
            lib.impl(name, fn, key)
        backends[device] = "reference"
    fakes = {"forward": _fake_forward, "backward_input": _fake_backward_input,
             "backward_weight": _fake_backward_weight, "squared_hinge": _fake_squared_hinge}
    for name, fake in fakes.items():
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
        # Under autocast (bf16-mixed training) the activations (and a dense head's scores) arrive in
        # bf16/fp16; the kernels compute in float32, like the float32 weights of mixed precision.
        for device in _DISPATCH_KEYS:
            if name in _BF16_INPUT_OPS and backends[device].startswith("compiled-cuda"):
                continue  # these kernels take bf16 inputs as they come (uniform_sparse_linear casts the rest)
            torch.library.register_autocast(f"{NAMESPACE}::{name}", device, torch.float32, lib=lib)
    for name, backward, setup in (("forward", _backward, _setup_context),
                                  ("backward_input", _backward_of_backward_input, _setup_backward_input),
                                  ("backward_weight", _backward_of_backward_weight, _setup_backward_weight)):
        torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup, lib=lib)
    return backends


def ensure_registered() -> dict[str, str]:
    """Load or define the ops once per process; returns {device type: backend name}."""
    global _backends
    if _backends is None:
        with _lock:
            if _backends is None:
                _backends = _register()
    return _backends


def backend(device: str | torch.device | None = None) -> str:
    """Which implementation runs on ``device`` (default: cuda if available, else cpu):
    ``"compiled-cuda-rows:forward,backward_input"`` by default, ``"compiled-cuda"`` with ``XMC_SPARSE_KERNELS=threads``
    (``"compiled-cuda-rows"`` with ``rows``, ``"compiled-cuda-rows:forward"`` with ``rows:forward``,
    ``"compiled-cuda-rows:backward_input+vec:forward,backward_weight"`` with that setting: ``kernels_setting``),
    ``"compiled-cpu"`` or ``"reference"``; ``"unsupported"`` on other device types (on meta
    tensors the ops' fake kernels give the shapes)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ensure_registered().get(torch.device(device).type, "unsupported")


@torch.compiler.assume_constant_result
def registered_backend(device_type: str) -> str:
    """``backend`` for the op's wrapper: registers the ops on first use, also when that first use is being traced
    by torch.compile / torch.export (Dynamo cannot enter ``_lock``; it calls this function eagerly instead and
    takes its result as a constant, which it is for the life of the process)."""
    return ensure_registered().get(device_type, "unsupported")


def uniform_sparse_linear(x: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None, *, check_indices: bool | None = None) -> torch.Tensor:
    """``out[b, j] = sum_k weight[k, j] * x[b, indices[k, j]] + bias[j]``, differentiable in x, weight, bias.

    x (batch, in_features) float32; indices (connectivity, out_features) int32; weight like indices;
    bias (out_features,) or None. Under ``torch.autocast`` x may be bf16/fp16: the scores come out in the
    weight's dtype; bf16 x with float32 weights is gathered as bf16 by the compiled CUDA kernels (float32
    accumulation), and cast to the weight's dtype elsewhere. bf16 x is also taken outside autocast there.
    Every index must lie in [0, in_features): on the CPU both backends raise otherwise; in the CUDA kernels an
    index outside is undefined behaviour unless ``check_indices=True`` (or env ``XMC_SPARSE_CHECK_INDICES=1``) checks
    them first, which waits for the device. ``UniformSparseLinear`` keeps its indices in range.
    """
    check_tensor_types(x, indices, weight, bias)  # before x's dtype is looked at
    if check_indices is None:
        check_indices = os.environ.get("XMC_SPARSE_CHECK_INDICES", "0") not in ("", "0")
    if x.dtype != weight.dtype and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        # Compiled CUDA kernels gather bf16 inputs as they are (half the bytes, float32 sums); elsewhere they
        # are cast, differentiably: x's gradient comes back in its own dtype.
        gathers_bf16 = registered_backend(x.device.type).startswith("compiled-cuda")
        if not (x.dtype == torch.bfloat16 and weight.dtype == torch.float32 and gathers_bf16):
            x = x.to(weight.dtype)
    check_op_inputs(x, indices, weight, bias, check_indices)
    registered_backend(x.device.type)  # defines the ops on first use
    return torch.ops.xmc_sparse.forward(x.contiguous(), indices, weight, bias)
