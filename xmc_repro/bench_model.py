"""The whole model's training step, dense beside uniform: ``python -m xmc_repro.bench --model [--scale 0.05]``.

Both models are the pipeline's ``XMCClassifier`` with its own loss and optimizer (``configure_optimizers``:
Adam, fused on CUDA), at the paper's Amazon-670K shapes: uniform = 768 -> 32,768 -> 32 per label -> 670,091
labels, dense = 768 -> 670,091; batch 32, 5 random labels per point, a different batch each step (eager and graph
cycle through 16). ``--scale`` shrinks the labels and the intermediate layer (a CPU runs 0.02 in about a minute).
Rewiring and evaluation are outside the step.

Each model is timed three ways, in one run on one device:
* ``eager``: a plain loop, as Lightning runs a step but without Lightning: forward, loss, backward, optimizer
  step, gradients freed;
* ``graph`` (CUDA only): the pipeline's CUDA-graph step (``xmc_repro.step_graph``): the batch copied into the
  graph's buffers, positive positions + forward + loss + backward replayed as one graph, then fused Adam;
* ``lightning``: the pipeline's own loop, ``Trainer.fit`` over pinned in-memory batches (no logger, checkpoint,
  validation or progress bar), with the model's default step (the graph on CUDA).

Reported per model and way:
* ``step ms``: wall time per step, timed in 5 consecutive windows (one sync each; the slowest and fastest window
  are reported too, so a stall shows);
* per phase, from steps that each end with a sync: ``host ms`` = time to issue it, ``device ms`` = its span on
  the device (CUDA events; it includes waits for the host's launches; on a CPU both are the same synchronous
  time); ``host overhead ms`` = step ms minus the phases' device time;
* memory: peak allocated during the steps (GPU); parameter + optimizer state bytes (CPU);
* on a GPU, ``syncs_per_step``: where a step makes the host wait for the device (should be empty).

``--profile N`` adds a torch.profiler run of the uniform model's steps for each way: the top ops, the Chrome
trace, and on a GPU the device's idle time per step with what the host did meanwhile (``xmc_repro.trace_gaps``).
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from xmc_repro.bench import GIB


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


BATCHES = 16  # distinct batches an eager or graph step cycles through


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
    """Marks phase boundaries on the host (perf_counter) and on the device (CUDA events): ``with clock(name):``."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.host: list[float] = []
        self.events: list = []

    def _mark(self):
        self.host.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if not self.host:
            self._mark()
        yield
        self._mark()

    def spans(self) -> tuple[list[float], list[float]]:
        """(host ms, device ms) of the phases, in order."""
        host = [(b - a) * 1e3 for a, b in zip(self.host, self.host[1:])]
        if not self.cuda:
            return host, host
        self.events[-1].synchronize()
        return host, [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]


def _no_phase(name: str):
    return contextlib.nullcontext()


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


def _model(shape: ModelShape, device, **settings):
    from xmc_repro.model import XMCClassifier

    if device.type == "cuda":
        gc.collect()  # the previous model (a graph holds it in a cycle)
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = XMCClassifier(shape.features, shape.labels, head=shape.head, connectivity=shape.connectivity,
                          intermediate=shape.intermediate, **settings).to(device)
    model.train()
    return model


def _autocast(device, precision: str):
    """The autocast Lightning's ``precision`` runs a training step under (none at 32-true)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


def _eager_step(model, optimizer, batches, precision):
    def step(phase=_no_phase):
        x, ptr, idx = next(batches)
        with phase("forward"), _autocast(x.device, precision):
            scores = model(x)
        with phase("loss"), _autocast(x.device, precision):
            loss = model.loss_fn(scores, ptr, idx)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
            model.zero_grad(set_to_none=True)
    return step, ("forward", "loss", "backward", "optimizer")


def _graph_step(model, optimizer, batches, precision):
    from xmc_repro.step_graph import StepGraph, loss_from_positions

    graph = StepGraph(model, loss_from_positions(model.loss_fn), model.hparams.num_labels)

    def step(phase=_no_phase):
        x, ptr, idx = next(batches)
        with phase("forward+loss+backward"):
            with _autocast(x.device, precision):  # the graph is captured under it (backward runs outside)
                graph.step(x, ptr, idx)
            graph.attach_grads()
        with phase("optimizer"):
            optimizer.step()
            model.zero_grad(set_to_none=True)
    return step, ("forward+loss+backward", "optimizer")


def _stepper(shape: ModelShape, device, way: str, precision: str):
    """(model, optimizer, step, phase names) of one model's ``eager`` or ``graph`` step. The steps cycle through
    `BATCHES` distinct batches: on one batch repeated, the model would fit it and its loss gradient would grow
    sparser than training's, which the backward kernels' zero skipping turns into a faster step."""
    model = _model(shape, device)
    optimizer = model.configure_optimizers()["optimizer"]
    batches = itertools.cycle([_batch(shape, device, seed=i) for i in range(BATCHES)])
    step, phases = (_graph_step if way == "graph" else _eager_step)(model, optimizer, batches, precision)
    return model, optimizer, step, phases


def measure(shape: ModelShape, device, steps: int, warmup: int, way: str = "eager", precision: str = "32-true") -> dict:
    """One model's step, timed the ``eager`` or the ``graph`` way."""
    model, optimizer, step, phases = _stepper(shape, device, way, precision)
    if device.type == "cuda":  # the peak includes the warm-up: the graph's capture is its first step
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup + (1 if way == "graph" else 0)):
        step()
    windows, sizes = _timed_windows(step, steps, device)
    step_ms = sum(ms * n for ms, n in zip(windows, sizes)) / steps  # the mean over all timed steps
    host, dev = [[] for _ in phases], [[] for _ in phases]
    for _ in range(steps):
        clock = _Clock(device)
        step(clock)
        h, d = clock.spans()
        for i in range(len(phases)):
            host[i].append(h[i])
            dev[i].append(d[i])
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    row = _row(shape, model, way, precision, step_ms)
    row["step_ms_windows"] = windows
    row["phases"] = {phase: [median(host[i]), median(dev[i])] for i, phase in enumerate(phases)}
    row["host_overhead_ms"] = max(0.0, step_ms - sum(d for _, d in row["phases"].values()))
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["syncs_per_step"] = device_syncs(step)
    row["param_optimizer_gib"] = _state_bytes(model, optimizer) / GIB
    return row


def _timed_windows(step, steps: int, device, windows: int = 5) -> tuple[list[float], list[int]]:
    """Milliseconds per step in consecutive windows of the ``steps`` steps (one sync per window), and each window's
    steps: a stall, such as a garbage collection, shows as one slow window instead of raising every step's time
    unseen."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sizes = [steps // windows + (i < steps % windows) for i in range(min(windows, steps))]
    out = []
    for size in sizes:
        sync()
        start = time.perf_counter()
        for _ in range(size):
            step()
        sync()
        out.append((time.perf_counter() - start) * 1e3 / size)
    return out, sizes


def _row(shape: ModelShape, model, way: str, precision: str, step_ms: float) -> dict:
    return {"model": shape.name, "way": way, "precision": precision, "head": shape.head, "features": shape.features,
            "labels": shape.labels, "intermediate": shape.intermediate,
            "connectivity": shape.connectivity if shape.head == "uniform" else None, "batch": shape.batch,
            "parameters": sum(p.numel() for p in model.parameters()), "step_ms": step_ms}


def measure_lightning(shape: ModelShape, device, steps: int, warmup: int, precision: str = "32-true",
                      profiler=None) -> dict:
    """Wall time per step of ``Trainer.fit`` with the pipeline's module (its default step), and its syncs.

    A torch ``profiler`` given here records the timed steps, with the training step and the optimizer step
    (which runs the training step and backward in its closure) annotated."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from xmc_repro.model import XMCClassifier

    phase = torch.profiler.record_function if profiler is not None else _no_phase

    class Module(XMCClassifier):
        def configure_optimizers(self):  # no validation here, so no plateau scheduler
            return super().configure_optimizers()["optimizer"]

        def training_step(self, batch, batch_idx):
            with phase("training_step"):
                return super().training_step(batch, batch_idx)

        def optimizer_step(self, *args, **kwargs):
            with phase("optimizer_step"):
                return super().optimizer_step(*args, **kwargs)

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Clock(pl.Callback):
        syncs: list[str] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == warmup - 1:
                sync()
                self.start = time.perf_counter()
                if profiler is not None:
                    profiler.start()
                if cuda:  # from here to the next batch's end: the data transfer, every hook and the step
                    self.watch = warnings.catch_warnings(record=True)
                    self.caught = self.watch.__enter__()
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
            elif batch_idx == warmup and cuda:
                torch.cuda.set_sync_debug_mode("default")
                self.watch.__exit__(None, None, None)
                self.syncs = [f"{w.filename}:{w.lineno}" for w in self.caught if "synchroniz" in str(w.message)]

        def on_train_end(self, trainer, pl_module):
            sync()
            self.end = time.perf_counter()
            if profiler is not None:
                profiler.stop()

    torch.manual_seed(0)
    model = Module(shape.features, shape.labels, head=shape.head, connectivity=shape.connectivity,
                   intermediate=shape.intermediate)
    batches = [_batch(shape, torch.device("cpu"), seed=i) for i in range(warmup + steps)]
    loader = DataLoader(batches, batch_size=None, pin_memory=cuda)
    clock = Clock()
    # Lightning's lines (devices found, tips, why fit stopped) between the benchmark's own: not shown
    lightning_lines = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = lightning_lines.level
    lightning_lines.setLevel(logging.WARNING)
    trainer = None
    try:
        trainer = pl.Trainer(accelerator=device.type, devices=1, precision=precision, max_steps=warmup + steps,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False,
                             limit_val_batches=0, num_sanity_val_steps=0, callbacks=[clock])
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
            trainer.fit(model, train_dataloaders=loader)
    except SystemExit:  # Lightning turns Ctrl+C into exit(1), and ignores SIGINT from then on
        if trainer is not None and trainer.interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt from None
        raise
    finally:
        lightning_lines.setLevel(level)
    row = _row(shape, model, "lightning", precision, (clock.end - clock.start) * 1e3 / steps)
    row["cuda_graph"] = model._step_graph is not None
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["syncs_per_step"] = clock.syncs
    return row


def markdown(info: dict, rows: list[dict], scale: float) -> str:
    where = info.get("card") or f"CPU: {info['host_cpu']} ({info['cpu_threads']} threads)"
    lines = [f"# Whole-model training step — {where}", "",
             f"commit `{info.get('commit', 'unknown')}`, torch {info['torch']} (CUDA {info['cuda']}), sparse backend "
             f"`{info['sparse_backend']}`, {info['date']}"
             + (f", load average {info['load_average_1min']} before the run" if "load_average_1min" in info else "")
             + ". "
             f"Amazon-670K's shapes scaled by {scale:g}; batch 32. Times in ms; `step ms` = mean over all timed "
             "steps, `windows` = the fastest and slowest of 5 consecutive windows of them; per phase (medians) "
             "`host / device` = time to issue it / its span on the device; `overhead` = step minus the phases' device "
             "time.", "",
             "| model | way | precision | labels | intermediate | parameters | step ms | windows ms "
             "| phases: host / device ms | overhead ms | peak GiB | params+Adam GiB |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        phases = "; ".join(f"{p} {h:.3f} / {d:.3f}" for p, (h, d) in r.get("phases", {}).items())
        if r["way"] == "lightning":
            phases = "Trainer.fit" + (", CUDA graph" if r.get("cuda_graph") else ", eager")
        fmt = lambda key: f"{r[key]:.3f}" if key in r else ""  # noqa: E731
        windows = f"{min(r['step_ms_windows']):.3f}–{max(r['step_ms_windows']):.3f}" if "step_ms_windows" in r else ""
        lines.append(f"| {r['model']} | {r['way']} | {r['precision']} | {r['labels']:,} | {r['intermediate'] or ''} | "
                     f"{r['parameters'] / 1e6:.1f}M | {r['step_ms']:.3f} | {windows} | {phases} | "
                     f"{fmt('host_overhead_ms')} | {fmt('peak_gib')} | {fmt('param_optimizer_gib')} |")
    for r in rows:
        if "syncs_per_step" in r:
            where = ", ".join(sorted(set(r["syncs_per_step"]))) or "none"
            lines.append(f"\n{r['model']} ({r['way']}, {r['precision']}): {len(r['syncs_per_step'])} device-to-host "
                         f"syncs per step ({where}).")
    by = {(r["model"], r["way"], r["precision"]): r["step_ms"] for r in rows}
    lines.append("")
    for r in rows:
        dense = by.get(("dense", r["way"], r["precision"]))
        if r["model"] == "uniform" and dense:
            ratio = dense / r["step_ms"]
            than = f"{ratio:.2f}x faster than" if ratio >= 1 else f"{1 / ratio:.2f}x slower than"
            lines.append(f"- {r['way']}, {r['precision']}: uniform step {than} dense (same run, same device).")
    return "\n".join(lines) + "\n"


def profile(shape: ModelShape, device, way: str, precision: str, steps: int, warmup: int,
            trace: Path) -> tuple[str, str]:
    """torch.profiler over ``steps`` steps of one model and way: the top ops and, on a GPU, where and why the device
    idles (``xmc_repro.trace_gaps``), as (summary, table). The Chrome trace is kept in ``trace`` (Perfetto opens
    it)."""
    from torch.profiler import ProfilerActivity, record_function

    from xmc_repro import trace_gaps

    cuda = device.type == "cuda"
    prof = torch.profiler.profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    if way == "lightning":
        measure_lightning(shape, device, steps, max(warmup, 2), precision, profiler=prof)
    else:
        _, _, step, _ = _stepper(shape, device, way, precision)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for _ in range(warmup + 1):
            step()
        sync()
        with prof:
            for _ in range(steps):
                step(record_function)
            sync()
    gaps, table = trace_gaps.profile_report(prof, trace, steps, cuda)
    return f"== {shape.name}, {way}, {precision}, {steps} steps (trace: {trace.name})\n{gaps}", table


def run(device, scale: float, steps: int, warmup: int, out: Path, profile_steps: int = 0,
        precisions: tuple[str, ...] = ("32-true",)) -> int:
    from omegaconf import OmegaConf

    from xmc_repro.bench import copy_bandwidth, machine_info, replaced, slug, write_results
    from xmc_repro.errors import ConfigError
    from xmc_repro.host_memory import check_fits
    from xmc_repro.resources import resource_dir
    from xmc_repro.train import limit_cublas_workspace

    # The pipeline's cuBLAS workspace, so that the peaks compare with its runs'.
    limit_cublas_workspace(OmegaConf.load(resource_dir("conf") / "trainer" / "default.yaml").cublas_workspace_mib)
    info = machine_info(device, copy_bandwidth(device))
    info["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "torch's default")
    for shape in paper_models(scale):  # one that cannot fit is refused in one line, not OOM-killed (host_memory)
        try:
            check_fits({"head": shape.head, "intermediate": shape.intermediate, "connectivity": shape.connectivity},
                       shape.features, shape.labels, on_cpu=device.type == "cpu", fixes=["lower --scale"])
        except ConfigError as error:
            raise ConfigError(f"--scale {scale:g}: {error}") from None
    print(f"model step on {info.get('card', info['host_cpu'])}, scale {scale:g}", flush=True)
    rows = []
    ways = ("eager", "graph", "lightning") if device.type == "cuda" else ("eager", "lightning")
    if "lightning" in ways:  # a process's first fit pays a one-off cost (tens of ms a step): not the dense model's
        measure_lightning(paper_models(1e-4)[0], device, 2, 2, precisions[0])
    for precision in precisions:
        for shape in paper_models(scale):
            for way in ways:
                print(f"  {shape.name}, {way}, {precision}: {shape.features} -> {shape.intermediate or '-'} -> "
                      f"{shape.labels} ...", flush=True)
                if way == "lightning":
                    rows.append(measure_lightning(shape, device, steps, max(warmup, 2), precision))
                else:
                    rows.append(measure(shape, device, steps, warmup, way, precision))
    name = f"{slug(info)}-model" + ("" if scale == 1 else f"-scale{scale:g}")
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(info, rows, scale)
    settings = {"steps": steps, "warmup": warmup, "precisions": list(precisions)}
    note = replaced(out / f"{name}.json")
    write_results({out / f"{name}.json": json.dumps({"machine": info, "scale": scale, "settings": settings,
                                                     "results": rows}, indent=1) + "\n",
                   out / f"{name}.md": text})
    print(f"wrote {out / name}.json and .md{note}\n")
    # An earlier run's profile beside these results would read as theirs (its steps, its commit).
    stale = sorted([*out.glob(f"{name}-profile.txt"), *out.glob(f"{name}-trace-*.json.gz")])
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        print(f"removed the earlier run's profile files ({', '.join(p.name for p in stale)})\n")
    print(text)
    if profile_steps:
        uniform = paper_models(scale)[1]
        reports = []
        for precision in precisions:
            for way in ways:  # minutes on a GPU, silent until the end before
                print(f"  profiling {uniform.name}, {way}, {precision}: {profile_steps} steps ...", flush=True)
                reports.append(profile(uniform, device, way, precision, profile_steps, warmup,
                                       out / f"{name}-trace-{way}-{precision}.json.gz"))
        write_results({out / f"{name}-profile.txt": "".join(summary + table for summary, table in reports)})
        print("".join(summary for summary, _ in reports) + f"(tables in {out / name}-profile.txt)")
    return 0
