"""Bytes of a model's training state — parameters, Adam's two moments, index buffers — from its config.

A CPU run has no GPU memory to report, but this part of it is exact and follows from the shapes alone: float32
parameters (weights and biases of the intermediate layer and the head), as many bytes again for each of Adam's
two moment estimates, and the integer connection indices of the sparse heads (int32 for uniform and MACH, int64
label/input pairs for unstructured; MACH's fixed decode weights are a float32 buffer). Activations and the
data are not included. A run that logged `param_bytes` and `buffer_bytes` is taken at its word.
"""

from __future__ import annotations

from xmc_repro.host_memory import model_sizes

# Shapes of datasets whose config does not hold them (read from files): the published statistics.
KNOWN_SHAPES = {  # dataset name -> (input features, labels)
    "Bibtex": (1836, 159),
    "Delicious": (500, 983),
}
FEATURE_DIMS = {"slice": 512, "cascade": 768}  # the paper's embeddings
PAPER_LABELS = {"Wiki10-31K": 30938, "Amazon-670K": 670091, "Wikipedia-500K": 501070}


def param(params: dict, key: str) -> str | None:
    """A param by its Hydra key, logged as `model/head` or `model.head`; None for null/absent."""
    value = params.get(key, params.get(key.replace("/", ".")))
    return None if value is None or str(value) in ("None", "null", "") else str(value)


def shape(params: dict) -> tuple[int, int] | None:
    """(input features, labels) of the run's dataset, when known."""
    features, labels = param(params, "dataset/num_features"), param(params, "dataset/num_labels")
    if features and labels:
        return int(features), int(labels)
    name, kind = param(params, "dataset/name") or "", param(params, "dataset/features") or ""
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name]
    if name in PAPER_LABELS and kind in FEATURE_DIMS:
        return FEATURE_DIMS[kind], PAPER_LABELS[name]
    return None


def model_state_bytes(params: dict, metrics: dict | None = None) -> int | None:
    """Parameters + Adam moments + index buffers in bytes; None when the shapes are unknown."""
    metrics = metrics or {}
    if "param_bytes" in metrics and "buffer_bytes" in metrics:
        return int(3 * metrics["param_bytes"] + metrics["buffer_bytes"])
    dims = shape(params)
    if dims is None:
        return None
    model = {key: param(params, f"model/{key}") for key in ("head", "intermediate", "connectivity", "bottleneck",
                                                            "bottleneck_activation")}  # fmt: skip
    model["mach"] = {key: param(params, f"model/mach/{key}") for key in ("num_hashes", "num_buckets")}
    sizes = model_sizes(model, *dims)  # a bottleneck run without bottleneck_activation (older): no bias, linear
    if sizes is None:
        return None
    weights, buffers = sizes
    return 3 * 4 * weights + buffers
