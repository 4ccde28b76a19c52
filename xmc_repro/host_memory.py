"""Whether the model can train in this machine's memory, asked before it is built.

A model that does not fit is otherwise found out by the kernel's OOM killer: a 670,091-label head over 135,909
bag-of-words inputs with an 8,192-unit intermediate layer (1.1 billion parameters) grew to 23 GiB on a 24 GiB
machine and was SIGKILLed at its first optimizer step (of torch's unfused CPU Adam, which added two temporaries the
size of the largest parameter), without a word and with its MLflow run left RUNNING. The
need is known from the shapes alone (`model_sizes`), so a model that cannot fit is refused in one line before
anything is allocated.

On the CPU a training step holds every float32 parameter four times (weights, gradients, Adam's two moments; the
pipeline's Adam is fused there, `optim.FUSED_ADAM_DEVICES`, and makes no parameter-sized temporaries); a GPU run
builds the model on the host first (weights and index buffers). Activations, the data (already loaded when this runs) and
the framework come on top: the estimate is a lower bound, so a refusal is never a false alarm.
"""

from __future__ import annotations

from xmc_repro.errors import ConfigError

GIB = 2**30


def model_sizes(model_cfg, num_features: int, num_labels: int) -> tuple[int, int] | None:
    """(float32 parameters, bytes of index buffers) of the model a config (or a
    mapping of its settings, as `report.state` makes from a run's params) builds; None for a head of one's own."""
    get = model_cfg.get
    width, tensors, buffers = num_features, [], 0
    if get("intermediate"):
        tensors += [width * int(get("intermediate")), int(get("intermediate"))]
        width = int(get("intermediate"))
    head = get("head")
    if head == "dense":
        tensors += [width * num_labels, num_labels]
    elif head == "bottleneck":
        size = int(get("bottleneck") or 0)
        tensors += [width * size, size if get("bottleneck_activation", "relu") == "relu" else 0, size * num_labels,
                    num_labels]
    elif head in ("uniform", "unstructured"):
        connections = int(get("connectivity") or 0) * num_labels
        tensors += [connections, num_labels]
        buffers += connections * (4 if head == "uniform" else 16)  # int32 sources | int64 (label, input) pairs
    elif head == "mach":
        mach = get("mach") or {}
        hashes, buckets = int(mach.get("num_hashes") or 0), int(mach.get("num_buckets") or 0)
        tensors += [width * hashes * buckets, hashes * buckets]
        buffers += hashes * num_labels * (4 + 4)
    else:
        return None
    return sum(tensors), buffers


def training_bytes(model_cfg, num_features: int, num_labels: int, on_cpu: bool,
                   value_bytes: int = 4) -> tuple[int, int] | None:
    """(bytes the host must hold at least, parameters) for training this model; None for an unknown head.
    `value_bytes`: 2 where the weights train in 16 bits (`bf16-true`), after they are built in float32."""
    sizes = model_sizes(model_cfg, num_features, num_labels)
    if sizes is None:
        return None
    weights, buffers = sizes
    if on_cpu:  # weights, gradients, Adam's two moments (its fused step adds no temporaries)
        return value_bytes * 4 * weights + buffers, weights
    return 4 * weights + buffers, weights  # built on the host, then moved to the GPU


def available_bytes() -> int:
    """Memory the OS can give this process now without swapping (Linux: MemAvailable)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(model_cfg, num_features: int, num_labels: int, on_cpu: bool, processes: int = 1,
               available: int | None = None, value_bytes: int = 4, fixes: list[str] | None = None,
               batch_rows: int = 0) -> None:
    """ConfigError (one line) when the model's training state and a dense input batch exceed the available memory
    (a head of one's own: the batch alone); `processes`: how
    many copies this machine will train at once (DDP ranks on the CPU); `value_bytes`: as `training_bytes`;
    `fixes`: what the message advises (default: the run's settings that shrink the model); `batch_rows`: the rows
    of the largest input batch, which is made dense (bag-of-words rows too)."""
    # A batch is made dense (bag-of-words rows too) before the model sees it: with a header declaring billions of
    # features, that alone was OOM-killed at the first batch, the run left RUNNING. One copy, as a lower bound (dropout
    # and the GPU's pinned copy add another; evaluation makes none).
    batch_bytes = 4 * int(batch_rows) * int(num_features)
    need = training_bytes(model_cfg, num_features, num_labels, on_cpu, value_bytes)
    state_bytes, weights = need if need is not None else (0, None)  # a head of one's own: its size unknown
    need_bytes = (state_bytes + batch_bytes) * max(int(processes), 1)
    available = available_bytes() if available is None else int(available)
    if need_bytes <= available:
        return
    batch = (f"a dense input batch of {batch_rows:,} x {num_features:,}",
             "lower trainer.batch_size and trainer.eval_batch_size (or check the data's feature count)")
    copies = f" x {processes} processes" if processes > 1 else ""
    if weights is None:
        raise ConfigError(f"{batch[0]} needs at least {need_bytes / GIB:.1f} GiB of memory{copies}, but "
                          f"{available / GIB:.1f} GiB is available; {batch[1]}")
    where = "to train on the CPU" if on_cpu else "on the host to build it"
    what = ("weights, gradients and Adam's two moments" if on_cpu
            else "its weights before they move to the GPU")
    if batch_bytes:
        what += f", and {batch[0]}"
    intermediate = model_cfg.get("intermediate")
    if fixes is None:
        head = model_cfg.get("head")
        fixes = ["lower model.intermediate"] if intermediate else []
        fixes += {"bottleneck": ["lower model.bottleneck"],
                  "mach": ["lower model.mach.num_buckets or model.mach.num_hashes"]}.get(head, [])
        if head in ("dense", "bottleneck", "mach"):
            fixes.append("use a sparse head (model=uniform)")
        if batch_bytes > state_bytes:
            fixes.insert(0, batch[1])
        fixes.append("run on a machine with more memory")
    raise ConfigError(
        f"model={model_cfg.get('head')}{f' with model.intermediate={intermediate}' if intermediate else ''} over "
        f"{num_features:,} inputs and {num_labels:,} labels has {weights:,} "
        f"parameters and needs at least {need_bytes / GIB:.1f} GiB of memory {where} ({what}{copies}), but "
        f"{available / GIB:.1f} GiB is available; {', '.join(fixes[:-1])}{', or ' if fixes[1:] else ''}{fixes[-1]}"
    )
