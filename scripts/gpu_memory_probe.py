"""Where the GPU memory of one training step goes, phase by phase, at Amazon-670K's shape.

    python scripts/gpu_memory_probe.py [--labels 670091] [--features 768] [--steps 50]

Builds the pipeline's model (`XMCClassifier`, its `configure_optimizers`, the `Rewiring` callback's
code) for the uniform head with a 32k intermediate layer and for the dense head, and runs steps in
Lightning's order: forward and loss, backward, Adam step, gradients freed. For each phase it prints
the memory allocated before it and the peak during it (MiB), then the milliseconds per step of a
plain loop (no Lightning, no evaluation), the floor under the pipeline's seconds per epoch.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from xmc_repro.callbacks import Rewiring
from xmc_repro.model import XMCClassifier

MIB = 2**20
DEVICE = torch.device("cuda")


def random_batch(batch: int, features: int, labels: int, per_point: int, generator):
    x = torch.randn(batch, features, generator=generator)
    label_idx = torch.randint(labels, (batch * per_point,), generator=generator)
    label_ptr = torch.arange(0, batch * per_point + 1, per_point)
    return x.to(DEVICE), label_ptr.to(DEVICE), label_idx.to(DEVICE)


def measure(rows: list, label: str, fn):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    rows.append((label, before / MIB, torch.cuda.max_memory_allocated() / MIB))
    return out


def probe(name: str, args, **model_kw) -> None:
    torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(0)
    model = XMCClassifier(args.features, args.labels, **model_kw).to(DEVICE)
    optimizer = model.configure_optimizers()["optimizer"]
    x, ptr, idx = random_batch(32, args.features, args.labels, 5, gen)
    rows = [("model on the GPU", 0.0, torch.cuda.memory_allocated() / MIB)]

    def step(tag: str):
        loss = measure(rows, f"forward + loss{tag}", lambda: model.loss_fn(model(x), ptr, idx))
        measure(rows, f"backward{tag}", loss.backward)
        measure(rows, f"Adam step{tag}", optimizer.step)
        model.zero_grad(set_to_none=True)

    for i in range(2):
        step(f" ({i + 1})")
    if model.sparse_layers():
        trainer = SimpleNamespace(optimizers=[optimizer], world_size=1, global_step=1000)
        measure(rows, "rewire 10 %", lambda: Rewiring(0.1, every_n_steps=1000).rewire(trainer, model))
    with torch.no_grad():
        model.eval()
        measure(rows, "evaluation batch", lambda: model.val_metrics.update(model(x), ptr, idx))
        model.train()

    print(f"\n== {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    print(f"{'phase':<24}{'before MiB':>12}{'peak MiB':>12}")
    for label, before, peak in rows:
        print(f"{label:<24}{before:>12.1f}{peak:>12.1f}")
    print(f"{'largest peak':<24}{'':>12}{max(r[2] for r in rows):>12.1f}  "
          f"({max(r[2] for r in rows) / 1024:.3f} GiB)")

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        model.loss_fn(model(x), ptr, idx).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"plain loop: {(time.perf_counter() - start) * 1e3 / args.steps:.2f} ms per step (batch 32)")
    del model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labels", type=int, default=670_091)
    parser.add_argument("--features", type=int, default=768)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_memory_probe needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    probe("uniform, 32 per label, 32,768 intermediate", args, head="uniform", connectivity=32, intermediate=32768)
    probe("dense", args, head="dense")


if __name__ == "__main__":
    main()
