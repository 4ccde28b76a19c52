"""The uniform sparse op ``xmc_sparse::forward`` and its two backward ops, with autograd.

The schema lives in cuda_ext/uniform_sparse.cpp (TORCH_LIBRARY). When the compiled library is
unavailable (no compiler, or ``XMC_SPARSE_BACKEND=reference``) the same schema is defined here and
backed by the pure-torch reference, so callers, ``torch.compile`` and ``opcheck`` see one op either
way. A device type without compiled kernels (CUDA when nvcc is missing) also gets the reference.
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

from . import build, reference
from .checks import SparseInputError, check_op_inputs

NAMESPACE = "xmc_sparse"
SCHEMAS = (
    "forward(Tensor x, Tensor indices, Tensor weight, Tensor? bias) -> Tensor",
    "backward_input(Tensor grad_out, Tensor indices, Tensor weight, SymInt in_features) -> Tensor",
    "backward_weight(Tensor grad_out, Tensor x, Tensor indices) -> Tensor",
)
_REFERENCE_KERNELS = {
    "forward": reference.forward,
    "backward_input": reference.backward_input,
    "backward_weight": reference.backward_weight,
}
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

_lock = threading.Lock()
_backends: dict[str, str] | None = None
_libraries: list[torch.library.Library] = []  # Python registrations live as long as these objects


def _fake_forward(x, indices, weight, bias):
    return x.new_empty(x.shape[0], indices.shape[1])


def _fake_backward_input(grad_out, indices, weight, in_features):
    return grad_out.new_empty(grad_out.shape[0], in_features)


def _fake_backward_weight(grad_out, x, indices):
    return grad_out.new_empty(indices.shape)


def _setup_context(ctx, inputs, output):
    x, indices, weight, bias = inputs
    ctx.save_for_backward(x, indices, weight)
    ctx.in_features = x.shape[1]
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, indices, weight = ctx.saved_tensors
    grad = grad.contiguous()  # e.g. the expanded ones of out.sum().backward()
    ops = torch.ops.xmc_sparse
    grad_x = ops.backward_input(grad, indices, weight, ctx.in_features) if ctx.needs_input_grad[0] else None
    grad_w = ops.backward_weight(grad, x, indices) if ctx.needs_input_grad[2] else None
    grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
    return grad_x, None, grad_w, grad_b


def _register() -> dict[str, str]:
    mode = os.environ.get("XMC_SPARSE_BACKEND", "auto").strip().lower() or "auto"
    if mode not in ("auto", "reference", "compiled"):
        raise SparseInputError(f"XMC_SPARSE_BACKEND={mode!r} must be one of auto, reference, compiled")
    compiled: set[str] = set()
    if mode != "reference":
        compiled, errors = build.load_compiled()
        if mode == "compiled" and not compiled:
            raise build.BuildError("XMC_SPARSE_BACKEND=compiled but the kernels did not build: " + "; ".join(errors))
        if errors:
            warnings.warn("xmc_repro.sparse: compiled kernels unavailable for some devices, using the pure-torch "
                          "reference there (slower): " + "; ".join(errors), RuntimeWarning, stacklevel=3)
    if compiled:
        lib = torch.library.Library(NAMESPACE, "IMPL")
    else:
        lib = torch.library.Library(NAMESPACE, "DEF")
        for schema in SCHEMAS:
            lib.define(schema)
    _libraries.append(lib)
    backends = {}
    for device, key in _DISPATCH_KEYS.items():
        if device in compiled:
            backends[device] = f"compiled-{device}"
            continue
        for name, fn in _REFERENCE_KERNELS.items():
            lib.impl(name, fn, key)
        backends[device] = "reference"
    torch.library.register_fake(f"{NAMESPACE}::forward", _fake_forward)
    torch.library.register_fake(f"{NAMESPACE}::backward_input", _fake_backward_input)
    torch.library.register_fake(f"{NAMESPACE}::backward_weight", _fake_backward_weight)
    torch.library.register_autograd(f"{NAMESPACE}::forward", _backward, setup_context=_setup_context)
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
    ``"compiled-cuda"``, ``"compiled-cpu"`` or ``"reference"``."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ensure_registered().get(torch.device(device).type, "reference")


def uniform_sparse_linear(x: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None, *, check_indices: bool | None = None) -> torch.Tensor:
    """``out[b, j] = sum_k weight[k, j] * x[b, indices[k, j]] + bias[j]``, differentiable in x, weight, bias.

    x (batch, in_features) float32; indices (connectivity, out_features) int32; weight like indices;
    bias (out_features,) or None. ``check_indices=True`` (or env ``XMC_SPARSE_CHECK_INDICES=1``)
    verifies that every index lies in [0, in_features) -- out-of-range indices are undefined behaviour
    in the compiled kernels.
    """
    if check_indices is None:
        check_indices = os.environ.get("XMC_SPARSE_CHECK_INDICES", "0") not in ("", "0")
    check_op_inputs(x, indices, weight, bias, check_indices)
    ensure_registered()
    return torch.ops.xmc_sparse.forward(x.contiguous(), indices, weight, bias)
