"""GPU memory of the graphed training step across rewirings, at Amazon-670K's shape (uniform, 32k intermediate).

    python scripts/gpu_graph_memory.py [--cycles 6] [--steps 20]

Each cycle: `--steps` graphed steps with fused Adam on fresh random batches, then one rewiring through the
pipeline's `Rewiring` callback code (which releases the graph; the next step captures it again). Prints the memory
allocated and the peak after each cycle: memory that grows from cycle to cycle is held by something that
outlives a graph.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from xmc_repro.callbacks import Rewiring
from xmc_repro.model import XMCClassifier
from xmc_repro.step_graph import StepGraph, loss_from_positions

MIB = 2**20
LABELS, FEATURES, BATCH, PER_POINT = 670_091, 768, 32, 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--clear-workspaces", action="store_true", help="free cuBLAS's workspaces after each rewiring")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = XMCClassifier(FEATURES, LABELS, head="uniform", connectivity=32, intermediate=32768).to(device)
    model.train()
    optimizer = model.configure_optimizers()["optimizer"]
    model._step_graph = graph = StepGraph(model, loss_from_positions(model.loss_fn), LABELS)
    rewiring = Rewiring(0.1, every_n_steps=1, seed=0)
    trainer = SimpleNamespace(optimizers=[optimizer], world_size=1, global_step=0)
    gen = torch.Generator().manual_seed(0)
    ptr = torch.arange(0, BATCH * PER_POINT + 1, PER_POINT, device=device)
    print(f"model and buffers: {torch.cuda.memory_allocated() / MIB:.0f} MiB", flush=True)
    for cycle in range(args.cycles):
        for _ in range(args.steps):
            x = torch.randn(BATCH, FEATURES, generator=gen).to(device)
            idx = torch.randint(LABELS, (BATCH * PER_POINT,), generator=gen).to(device)
            graph.step(x, ptr, idx)
            graph.attach_grads()
            optimizer.step()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        stepping = torch.cuda.memory_allocated() / MIB
        rewiring.rewire(trainer, model)
        if args.clear_workspaces:
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.synchronize()
        print(f"cycle {cycle}: allocated {stepping:.0f} MiB while stepping, {torch.cuda.memory_allocated() / MIB:.0f} "
              f"after the rewiring; peak so far {torch.cuda.max_memory_allocated() / MIB:.0f} MiB; "
              f"captures {graph.captures}", flush=True)


if __name__ == "__main__":
    main()
