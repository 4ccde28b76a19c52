"""Input checks for the uniform sparse op: one-line messages that say what is wrong and how to fix it."""
from __future__ import annotations

import torch

from xmc_repro.validation import check_layer_sizes  # noqa: F401  (the sizes a layer is built with)

INT32_LIMIT = 2**31


class SparseInputError(ValueError):
    """A tensor handed to the sparse op has the wrong shape, dtype, device or layout."""


def check_tensor_types(x, indices, weight, bias) -> None:
    """x, indices, weight (and bias, when given) are torch tensors: a numpy array or a list is named, not met with
    an AttributeError further on."""
    given = {"x": x, "indices": indices, "weight": weight, **({"bias": bias} if bias is not None else {})}
    wrong = [f"{name} is a {type(v).__name__}" for name, v in given.items() if not isinstance(v, torch.Tensor)]
    if wrong:
        raise SparseInputError(f"x, indices, weight and bias must be torch.Tensors ({', '.join(wrong)}); convert with "
                               "torch.as_tensor")


def check_op_inputs(x: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, check_indices: bool = False) -> None:
    """Validate the arguments of ``uniform_sparse_linear``; raise SparseInputError on the first problem."""
    check_tensor_types(x, indices, weight, bias)
    if x.dim() != 2:
        raise SparseInputError(f"x must be 2-D (batch, in_features), got shape {tuple(x.shape)}")
    if weight.dtype not in (torch.float32, torch.float64):  # e.g. a layer after .half() / .bfloat16()
        raise SparseInputError(f"weight must be float32 or float64, got {weight.dtype}: the sparse op computes in "
                               "float32/float64; keep the layer's parameters in float32 (layer.float()) and run "
                               "16-bit activations under torch.autocast")
    bf16_inputs = x.dtype == torch.bfloat16 and x.is_cuda and weight.dtype == torch.float32
    if x.dtype not in (torch.float32, torch.float64) and not bf16_inputs:
        raise SparseInputError(f"x must be float32 (or float64; bfloat16 on CUDA with float32 weights), got {x.dtype}; "
                               "call x.float()")
    if indices.dim() != 2:
        raise SparseInputError(
            f"indices must be 2-D (connectivity, out_features), got shape {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise SparseInputError(f"indices must be int32, got {indices.dtype}; call indices.int()")
    if weight.shape != indices.shape:
        raise SparseInputError(
            f"weight shape {tuple(weight.shape)} must equal indices shape {tuple(indices.shape)} "
            "(connectivity, out_features)")
    if weight.dtype != x.dtype and not bf16_inputs:
        raise SparseInputError(f"weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    connectivity, out_features = indices.shape
    if connectivity < 1 or out_features < 1:
        raise SparseInputError(f"indices shape {tuple(indices.shape)} must have connectivity >= 1 and "
                               "out_features >= 1")
    if connectivity * out_features >= INT32_LIMIT:
        raise SparseInputError(f"connectivity * out_features = {connectivity * out_features} must be < 2**31")
    if x.shape[1] < 1:
        raise SparseInputError("x must have at least one input feature")
    tensors = [("x", x), ("indices", indices), ("weight", weight)]
    if bias is not None:
        if bias.shape != (out_features,):
            raise SparseInputError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise SparseInputError(f"bias dtype {bias.dtype} must equal the weight dtype {weight.dtype}")
        tensors.append(("bias", bias))
    check_device(x, "x")
    for name, t in tensors[1:]:
        if t.device != x.device:
            raise SparseInputError(f"{name} is on {t.device} but x is on {x.device}; move both to one device")
    for name, t in tensors[1:]:
        if not t.is_contiguous():
            raise SparseInputError(f"{name} must be contiguous; call {name}.contiguous()")
    if check_indices:
        check_index_range(indices, x.shape[1])


def check_generator(generator) -> None:
    """None or a torch.Generator: a seed given in its place would meet torch's overload error deep in sampling."""
    if generator is not None and not isinstance(generator, torch.Generator):
        hint = f" (for a seed: torch.Generator().manual_seed({generator}))" if isinstance(generator, int) else ""
        raise SparseInputError(f"generator must be a torch.Generator or None, got {type(generator).__name__}{hint}")


# Where the ops have kernels (meta: shapes only, from the fake kernels).
DEVICE_TYPES = ("cpu", "cuda", "meta")


def check_device(tensor: torch.Tensor, name: str) -> None:
    """The ops run on CPU and CUDA tensors only; elsewhere (mps, xpu) the dispatcher's error names no fix."""
    if tensor.device.type not in DEVICE_TYPES:
        raise SparseInputError(f"{name} is on {tensor.device}, but the sparse ops run on CPU and CUDA devices only; "
                               "move the model and its inputs to one of them (.cpu() or .cuda())")


def check_layer_input(x: torch.Tensor, in_features: int) -> None:
    """A layer's input: a floating tensor of shape (..., in_features), as ``nn.Linear`` takes."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != in_features:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise SparseInputError(f"the layer takes inputs of shape (..., {in_features}) (in_features={in_features}), "
                               f"got {shape}")
    if not x.is_floating_point():
        raise SparseInputError(f"the layer takes floating-point inputs, got {x.dtype}; call x.float()")


def check_index_range(indices: torch.Tensor, in_features: int) -> None:
    """Every source index must lie in [0, in_features) (costs a device sync; opt-in)."""
    if torch.compiler.is_compiling():  # traced: no Python branch on tensor data; an assert op in the graph instead
        in_range = ((indices >= 0) & (indices < in_features)).all()
        torch._assert_async(in_range, "indices must lie in [0, in_features) (x.shape[1]); check_indices=True found "
                                      "one outside")
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= in_features:
        raise SparseInputError(
            f"indices must lie in [0, {in_features}), found values in [{lo}, {hi}]")
