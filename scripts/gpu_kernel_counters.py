"""Each CUDA kernel of the uniform layer once at the headline shape (670,091 labels, 16,384 inputs, 32 per label,
batch 32), for a hardware-counter profiler to say what bounds it (L2 bytes or requests, latency, issue slots):

    XMC_SPARSE_KERNELS=threads ncu --kernel-name-base demangled --kernel-name regex:xmc_sparse:: \\
        --section SpeedOfLight ... python3 scripts/gpu_kernel_counters.py

(`scripts/gpu_all.sh`, step `counters`). The kernels and inputs are the layer benchmark's (`xmc_repro.bench`):
`uniform` with XMC_SPARSE_KERNELS=threads is the thread-per-label kernels, `uniform-rows*` the warp-per-label ones;
`hinge` gradients are 1 % nonzero, `bce` dense.
"""

from __future__ import annotations

import os

import torch

from xmc_repro import bench
from xmc_repro.sparse import op

# (method, phase, gradient): launched in this order, the hinge ones first (the profiler lists them so)
RUNS = (
    ("uniform", "forward", "hinge"),
    ("uniform-bf16", "forward", "hinge"),
    ("uniform", "backward_input", "hinge"),
    ("uniform", "backward_input", "bce"),
    ("uniform", "backward_weight", "hinge"),
    ("uniform-rows", "forward", "hinge"),
    ("uniform-rows-bf16", "forward", "hinge"),
    ("uniform-rows-unroll2", "forward", "hinge"),
    ("uniform-rows-unroll4", "forward", "hinge"),
    ("uniform-rows-vec", "forward", "hinge"),
    ("uniform-rows-vec-bf16", "forward", "hinge"),
    ("uniform-rows", "backward_input", "hinge"),
    ("uniform-rows", "backward_input", "bce"),
    ("uniform-rows-vec", "backward_input", "hinge"),
    ("uniform-rows-vec", "backward_input", "bce"),
    ("uniform-rows", "backward_weight", "hinge"),
    ("uniform-rows-vec", "backward_weight", "hinge"),
)


def main() -> int:
    device = torch.device("cuda")
    backend = op.backend(device)
    if backend != "compiled-cuda":
        raise SystemExit(f"the op runs {backend}, not its thread-per-label kernels: set XMC_SPARSE_KERNELS=threads")
    print(f"{torch.cuda.get_device_name(device)}, XMC_SPARSE_KERNELS={os.environ.get('XMC_SPARSE_KERNELS')}")
    for grad in ("hinge", "bce"):
        case = bench.Case(670091, 16384, 32, 32, grad, ())
        problem = bench.make_problem(case, device)
        for method, phase, wanted in RUNS:
            if wanted == grad:
                launch = bench.build_method(method, case, problem, device)[phase]
                torch.cuda.synchronize(device)
                launch()
                torch.cuda.synchronize(device)
                print(f"launched: {method} {phase} {grad}", flush=True)
        del problem
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
