"""GPU memory of the training step across rewirings and evaluation, at Amazon-670K's shape (uniform, 32k
intermediate), in the pipeline's order: a short evaluation first (Lightning's sanity check), then cycles of
training steps each ended by a rewiring, then an evaluation.

    python scripts/gpu_graph_memory.py [--cycles 6] [--steps 20] [--eager] [--snapshot]

Each cycle: `--steps` steps with fused Adam on fresh random batches (graphed, or eager with `--eager`, gradients
freed before each step), then one rewiring through the pipeline's `Rewiring` callback code
(which releases the graph; the next step captures it again). Prints the memory allocated and the peak after each
cycle: memory that grows from cycle to cycle is held by something that outlives a graph. `--snapshot` records the
allocator's history and prints what was alive at the peak, by allocation site (xmc_repro.memory_peak).
"""
from __future__ import annotations

import argparse
import contextlib
from types import SimpleNamespace

import torch

from xmc_repro.callbacks import Rewiring
from xmc_repro.memory_peak import peak_report, recording
from xmc_repro.model import XMCClassifier
from xmc_repro.step_graph import StepGraph, loss_from_positions

MIB = 2**20
LABELS, FEATURES, BATCH, PER_POINT, EVAL_BATCHES = 670_091, 768, 32, 5, 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="the eager step (no CUDA graph), for reference")
    ap.add_argument("--snapshot", action="store_true", help="print what was allocated at the peak")
    args = ap.parse_args()
    device = torch.device("cuda")
    with recording() if args.snapshot else contextlib.nullcontext():
        run(args, device)
        if args.snapshot:
            print(peak_report(device), flush=True)
    print(f"{'eager' if args.eager else 'graph'}: peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB", flush=True)


def run(args, device) -> None:
    torch.manual_seed(0)
    model = XMCClassifier(FEATURES, LABELS, head="uniform", connectivity=32, intermediate=32768).to(device)
    optimizer = model.configure_optimizers()["optimizer"]
    graph = None if args.eager else StepGraph(model, loss_from_positions(model.loss_fn), LABELS)
    model._step_graph = graph
    rewiring = Rewiring(0.1, every_n_steps=1, seed=0)
    trainer = SimpleNamespace(optimizers=[optimizer], world_size=1, global_step=0)
    gen = torch.Generator().manual_seed(0)
    ptr = torch.arange(0, BATCH * PER_POINT + 1, PER_POINT, device=device)

    def evaluate(name):
        model.release_step_graph()
        model.eval()
        with torch.no_grad():
            for _ in range(EVAL_BATCHES):
                model(torch.randn(BATCH, FEATURES, generator=gen).to(device)).topk(5)
        model.train()
        torch.cuda.synchronize()
        print(f"{name}: allocated {torch.cuda.memory_allocated() / MIB:.0f} MiB, "
              f"peak so far {torch.cuda.max_memory_allocated() / MIB:.0f} MiB", flush=True)

    print(f"model and buffers: {torch.cuda.memory_allocated() / MIB:.0f} MiB", flush=True)
    evaluate("sanity evaluation")
    for cycle in range(args.cycles):
        for _ in range(args.steps):
            model.zero_grad(set_to_none=True)
            x = torch.randn(BATCH, FEATURES, generator=gen).to(device)
            idx = torch.randint(LABELS, (BATCH * PER_POINT,), generator=gen).to(device)
            if graph is None:
                model.loss_fn(model.head(model.encoder(x)), ptr, idx).backward()
            else:
                graph.step(x, ptr, idx)
                graph.attach_grads()
            optimizer.step()
        torch.cuda.synchronize()
        stepping = torch.cuda.memory_allocated() / MIB
        rewiring.rewire(trainer, model)
        torch.cuda.synchronize()
        print(f"cycle {cycle}: allocated {stepping:.0f} MiB while stepping, {torch.cuda.memory_allocated() / MIB:.0f} "
              f"after the rewiring; peak so far {torch.cuda.max_memory_allocated() / MIB:.0f} MiB"
              + (f"; captures {graph.captures}" if graph else ""), flush=True)
    evaluate("evaluation")


if __name__ == "__main__":
    main()
