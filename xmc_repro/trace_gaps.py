"""Where a profiled loop leaves the GPU idle, read from a torch.profiler (Kineto) Chrome trace.

A gap is an interval in which no kernel, copy or memset runs on any stream. Two questions decide what to fix:

* what the host was doing during the gap: each moment of it is charged to the innermost ``record_function``
  range and the innermost torch op or CUDA call open on the launching thread (``-`` = Python outside any torch
  op: a training loop's own code);
* whether the launch that ends the gap was issued late (the device waited for the host) or in time (it waited
  for something else: a dependency, launch latency).

Blocking CUDA calls (synchronize, non-async copies, cudaMalloc/cudaFree) are counted separately: they stall the
host whether or not torch's sync debug mode reports them.
"""
from __future__ import annotations

import bisect
import gzip
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver"}
HOST_CATEGORIES = {"cpu_op", "user_annotation"} | RUNTIME_CATEGORIES
BLOCKING_CALLS = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaMalloc", "cuMemAlloc", "cudaFree", "cuMemFree",
                  "cudaHostAlloc", "cudaMallocHost")


def load(path: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]


@dataclass(frozen=True)
class Gap:
    start: float  # microseconds, trace clock
    end: float
    late_launch: bool  # the work after the gap was launched by the host after the gap began
    host: dict[str, float]  # "annotation: op" -> microseconds of the gap the host spent there

    @property
    def us(self) -> float:
        return self.end - self.start


def _busy(events: list[dict]) -> list[tuple[float, float, dict]]:
    """Merged busy intervals of the device, each with the device event that opens it."""
    spans = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e) for e in events if e.get("cat") in DEVICE_CATEGORIES),
                   key=lambda span: span[:2])
    merged: list[list] = []
    for start, end, event in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, event])
    return [tuple(m) for m in merged]


def _label(open_ranges: list[dict]) -> str:
    """The label `annotation: op` of the innermost range of each kind (ranges in start order, outermost first)."""
    annotation = next((e["name"] for e in reversed(open_ranges) if e.get("cat") == "user_annotation"), "")
    op = next((e["name"] for e in reversed(open_ranges) if e.get("cat") != "user_annotation"), "-")
    return f"{annotation}: {op}" if annotation else op


def _host_time(ranges: list[dict], starts: list[float], lo: float, hi: float) -> dict[str, float]:
    """How the host's time in [lo, hi] splits over the innermost ranges open (``ranges`` sorted by start)."""
    end = lambda e: e["ts"] + e.get("dur", 0)  # noqa: E731
    around = [e for e in ranges[: bisect.bisect_right(starts, hi)] if end(e) > lo]
    points = sorted({lo, hi, *(p for e in around for p in (e["ts"], end(e)) if lo < p < hi)})
    spent: dict[str, float] = defaultdict(float)
    for a, b in zip(points, points[1:]):
        mid = (a + b) / 2
        spent[_label([e for e in around if e["ts"] <= mid < end(e)])] += b - a
    return dict(spent)


def gaps(events: list[dict], min_us: float = 2.0) -> list[Gap]:
    """The device's idle intervals of at least ``min_us`` between its first and last activity."""
    runtime = {e.get("args", {}).get("correlation"): e for e in events if e.get("cat") in RUNTIME_CATEGORIES}
    busy = _busy(events)
    launches = [runtime.get(event.get("args", {}).get("correlation")) for _, _, event in busy]
    threads = Counter((e["pid"], e["tid"]) for e in launches if e)
    thread = threads.most_common(1)[0][0] if threads else None  # the thread that launches the device's work
    ranges = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES and (e.get("pid"), e.get("tid")) == thread),
                    key=lambda e: (e["ts"], -e.get("dur", 0)))
    starts = [e["ts"] for e in ranges]
    found = []
    for (_, prev_end, _), (start, _, _), launch in zip(busy, busy[1:], launches[1:]):
        if start - prev_end >= min_us:
            found.append(Gap(prev_end, start, launch is not None and launch["ts"] >= prev_end,
                             _host_time(ranges, starts, prev_end, start)))
    return found


def blocking_calls(events: list[dict]) -> dict[str, tuple[int, float]]:
    """Blocking CUDA calls by name: (count, total microseconds)."""
    calls: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        name = e.get("name", "")
        if e.get("cat") in RUNTIME_CATEGORIES and any(b in name for b in BLOCKING_CALLS) and "Async" not in name:
            calls[name][0] += 1
            calls[name][1] += e.get("dur", 0)
    return {name: (n, us) for name, (n, us) in calls.items()}


def report(events: list[dict], steps: int, min_us: float = 2.0, top: int = 12) -> str:
    """Idle time per step, what the host was doing meanwhile, and the blocking calls, as text."""
    busy = _busy(events)
    if not busy:
        return "no device activity in the trace\n"
    found = gaps(events, min_us)
    span = busy[-1][1] - busy[0][0]
    idle = sum(g.us for g in found)
    late = sum(g.us for g in found if g.late_launch)
    lines = [f"device span {span / steps / 1e3:.3f} ms per step; idle {idle / steps / 1e3:.3f} ms per step in "
             f"{len(found) / steps:.1f} gaps of >= {min_us:g} us; of it {late / steps / 1e3:.3f} ms waiting for a "
             "late launch (host-bound)"]
    spent: dict[str, float] = defaultdict(float)
    for g in found:
        for label, us in g.host.items():
            spent[label] += us
    if spent:
        lines.append("host during the gaps (ms per step, innermost annotation: op; '-' = Python outside torch ops):")
        for label, us in sorted(spent.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {us / steps / 1e3:8.3f}  {label}")
    calls = blocking_calls(events)
    lines.append("blocking CUDA calls: " + (", ".join(f"{name} x{n / steps:g} per step ({us / steps / 1e3:.3f} ms)"
                                                      for name, (n, us) in sorted(calls.items())) or "none"))
    return "\n".join(lines) + "\n"


def profile_report(profiler, trace: Path, steps: int, cuda: bool) -> tuple[str, str]:
    """For a stopped torch.profiler over ``steps`` steps: writes its Chrome trace to ``trace`` and returns (on a GPU
    the idle-gap report, else "", the top ops)."""
    trace = Path(trace)
    # torch writes (gzips) the trace in place: a Ctrl+C or a full disk meanwhile left a truncated one over the
    # earlier run's. A temporary file beside it, with the same ending (torch gzips by it), is renamed once whole.
    tmp = trace.with_name(f".{trace.stem}.{os.getpid()}.tmp{trace.suffix}")
    try:
        profiler.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
    finally:
        tmp.unlink(missing_ok=True)
    gaps = report(load(trace), max(steps, 1)) if cuda else ""
    table = profiler.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=25, max_name_column_width=60)
    return gaps, table + "\n"
