"""The whole model's training step, dense beside uniform: ``python -m xmc_repro.bench --model [--scale 0.05]``.

Both models are the pipeline's ``XMCClassifier`` with its own loss and optimizer (``configure_optimizers``:
Adam, fused on CUDA), at the paper's Amazon-670K shapes: uniform = 768 -> 32,768 -> 32 per label -> 670,091
labels, dense = 768 -> 670,091; batch 32, 5 labels per point. ``--scale`` shrinks the labels and the
intermediate layer (a CPU runs 0.02 in about a minute). A step runs as Lightning runs it, without Lightning:
forward, loss, backward, optimizer step, gradients freed. Rewiring and evaluation are outside the step.

Reported per model:
* ``step ms``: wall time per step of a plain loop (one sync at the end);
* per phase (forward, loss, backward, optimizer): ``host ms`` = time to issue it, ``device ms`` = its span on
  the device (CUDA events; on a CPU both are the same synchronous time);
* ``host overhead ms`` = step ms minus the phases' device time: time the device is not working on the step
  (Python, the loop, launches the device waits for);
* memory: peak allocated during the steps (GPU); parameter + optimizer state bytes (CPU);
* on a GPU, ``syncs_per_step``: where a step makes the host wait for the device (should be empty).
"""
from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from xmc_repro.bench import GIB

PHASES = ("forward", "loss", "backward", "optimizer")


@dataclass(frozen=True)
class ModelShape:
    name: str
    features: int
    labels: int
    head: str
    intermediate: int | None = None
    connectivity: int = 32
    batch: int = 32
    labels_per_point: int = 5


def paper_models(scale: float = 1.0) -> list[ModelShape]:
    """Amazon-670K's uniform model (32k intermediate layer) and the dense one, both scaled by ``scale``."""
    labels = max(1, round(670_091 * scale))
    width = max(32, round(32_768 * scale))
    return [ModelShape("dense", 768, labels, "dense"),
            ModelShape("uniform", 768, labels, "uniform", intermediate=width)]


def _batch(shape: ModelShape, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.batch, shape.features, generator=g)
    label_idx = torch.randint(shape.labels, (shape.batch * shape.labels_per_point,), generator=g)
    label_ptr = torch.arange(0, shape.batch * shape.labels_per_point + 1, shape.labels_per_point)
    return x.to(device), label_ptr.to(device), label_idx.to(device)


class _Clock:
    """Marks phase boundaries on the host (perf_counter) and on the device (CUDA events)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.host: list[float] = []
        self.events: list = []

    def mark(self):
        self.host.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def spans(self) -> tuple[list[float], list[float]]:
        """(host ms, device ms) between consecutive marks."""
        host = [(b - a) * 1e3 for a, b in zip(self.host, self.host[1:])]
        if not self.cuda:
            return host, host
        self.events[-1].synchronize()
        return host, [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]


def device_syncs(step) -> list[str]:
    """Where one call of ``step`` makes the host wait for the GPU (torch's sync debug mode), as file:line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def _state_bytes(model, optimizer) -> int:
    tensors = list(model.parameters()) + [t for s in optimizer.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(shape: ModelShape, device, steps: int, warmup: int) -> dict:
    from xmc_repro.model import XMCClassifier

    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = XMCClassifier(shape.features, shape.labels, head=shape.head, connectivity=shape.connectivity,
                          intermediate=shape.intermediate).to(device)
    model.train()
    optimizer = model.configure_optimizers()["optimizer"]
    x, ptr, idx = _batch(shape, device)

    def step(clock: _Clock | None = None):
        mark = clock.mark if clock else (lambda: None)
        mark()
        scores = model(x)
        mark()
        loss = model.loss_fn(scores, ptr, idx)
        mark()
        loss.backward()
        mark()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        mark()

    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    host, dev = [[] for _ in PHASES], [[] for _ in PHASES]
    for _ in range(steps):
        clock = _Clock(device)
        step(clock)
        h, d = clock.spans()
        for i in range(len(PHASES)):
            host[i].append(h[i])
            dev[i].append(d[i])
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    row = {"model": shape.name, "head": shape.head, "features": shape.features, "labels": shape.labels,
           "intermediate": shape.intermediate, "connectivity": shape.connectivity if shape.head == "uniform" else None,
           "batch": shape.batch, "parameters": sum(p.numel() for p in model.parameters()), "step_ms": step_ms}
    for i, phase in enumerate(PHASES):
        row[f"{phase}_host_ms"], row[f"{phase}_device_ms"] = median(host[i]), median(dev[i])
    row["host_overhead_ms"] = max(0.0, step_ms - sum(row[f"{p}_device_ms"] for p in PHASES))
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["syncs_per_step"] = device_syncs(step)
    row["param_optimizer_gib"] = _state_bytes(model, optimizer) / GIB
    del model, optimizer
    return row


def markdown(info: dict, rows: list[dict], scale: float) -> str:
    where = info.get("card") or f"CPU: {info['host_cpu']} ({info['cpu_threads']} threads)"
    lines = [f"# Whole-model training step — {where}", "",
             f"torch {info['torch']} (CUDA {info['cuda']}), sparse backend `{info['sparse_backend']}`, {info['date']}"
             + (f", load average {info['load_average_1min']} during the run" if "load_average_1min" in info else "")
             + ". "
             f"Amazon-670K's shapes scaled by {scale:g}; batch 32. Medians in ms; `host` = time to issue a phase, "
             "`device` = its span on the device; `overhead` = step minus the phases' device time.", "",
             "| model | labels | intermediate | parameters | step ms | forward host/device | loss host/device | "
             "backward host/device | optimizer host/device | overhead ms | peak GiB | params+Adam GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        phases = " | ".join(f"{r[f'{p}_host_ms']:.3f} / {r[f'{p}_device_ms']:.3f}" for p in PHASES)
        peak = f"{r['peak_gib']:.3f}" if "peak_gib" in r else ""
        lines.append(f"| {r['model']} | {r['labels']:,} | {r['intermediate'] or ''} | {r['parameters'] / 1e6:.1f}M | "
                     f"{r['step_ms']:.3f} | {phases} | {r['host_overhead_ms']:.3f} | {peak} | "
                     f"{r['param_optimizer_gib']:.3f} |")
    for r in rows:
        if "syncs_per_step" in r:
            where = ", ".join(sorted(set(r["syncs_per_step"]))) or "none"
            lines.append(f"\n{r['model']}: {len(r['syncs_per_step'])} device-to-host syncs per step ({where}).")
    by = {r["model"]: r for r in rows}
    if "dense" in by and "uniform" in by:
        lines += ["", f"Uniform step {by['dense']['step_ms'] / by['uniform']['step_ms']:.2f}x faster than dense "
                      "(same run, same device)."]
    return "\n".join(lines) + "\n"


def run(device, scale: float, steps: int, warmup: int, out: Path) -> int:
    from xmc_repro.bench import copy_bandwidth, machine_info, slug

    info = machine_info(device, copy_bandwidth(device))
    if device.type == "cpu" and hasattr(os, "getloadavg"):  # a shared CPU's timings depend on its other work
        info["load_average_1min"] = round(os.getloadavg()[0], 2)
    print(f"model step on {info.get('card', info['host_cpu'])}, scale {scale:g}", flush=True)
    rows = []
    for shape in paper_models(scale):
        print(f"  {shape.name}: {shape.features} -> {shape.intermediate or '-'} -> {shape.labels} ...", flush=True)
        rows.append(measure(shape, device, steps, warmup))
    name = f"{slug(info)}-model" + ("" if scale == 1 else f"-scale{scale:g}")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"machine": info, "scale": scale, "results": rows}, indent=1) + "\n")
    text = markdown(info, rows, scale)
    (out / f"{name}.md").write_text(text)
    print(f"wrote {out / name}.json and .md\n")
    print(text)
    return 0
