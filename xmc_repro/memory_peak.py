"""What was allocated at the moment of peak GPU memory, from torch's allocator history.

``torch.cuda.max_memory_allocated`` says how high memory went, not what held it. With the allocator's history
recorded (``recording()``, or ``start_recording`` and ``stop_recording``), ``live_at_peak`` replays its alloc and
free events, finds the moment the allocated total was highest and groups the blocks alive then by where they were
allocated: the innermost Python frame, which names the torch function (a cuBLAS workspace shows as the matmul that
first needed it on its stream), and the innermost frame of this project (or of the calling script) that led there.
Blocks allocated where Python has no stack (autograd's backward thread) show as '?'.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

MIB = 2**20
PROJECT_MARKERS = ("xmc_repro/", "scripts/")
BEFORE_RECORDING = "freed, allocated before the recording started"


def start_recording(max_entries: int = 2_000_000) -> None:
    """Record the CUDA allocator's alloc/free events, with the Python stack of each alloc."""
    import torch

    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=max_entries)


def stop_recording() -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def recording(max_entries: int = 2_000_000):
    """``start_recording`` until the block ends."""
    start_recording(max_entries)
    try:
        yield
    finally:
        stop_recording()


def _frame(frame: dict) -> str:
    name = frame.get("name", "?")
    filename = frame.get("filename", "")
    if not filename or filename == "??":
        return name
    return f"{name} ({filename.rsplit('/', 1)[-1]}:{frame.get('line', '?')})"


def allocation_site(frames: list[dict]) -> str:
    """'innermost frame <- innermost project frame' (frames innermost first, as torch records them)."""
    inner = _frame(frames[0]) if frames else "?"
    project = next((f for f in frames if any(m in f.get("filename", "") for m in PROJECT_MARKERS)), None)
    return inner if project is None or project is frames[0] else f"{inner} <- {_frame(project)}"


def live_at_peak(events: list[dict], top: int = 12) -> tuple[int, list[tuple[str, int, int]]]:
    """The highest allocated total over ``events`` (one device's trace) and the blocks alive then, grouped by
    allocation site: ``(peak_bytes, [(site, bytes, blocks), ...])`` largest first, at most ``top`` groups (the
    rest summed as 'other'). The total is relative to the memory allocated when the recording started: blocks
    allocated before then are not in the trace, but their frees are (a graph capture frees the cuBLAS
    workspaces), so those count against the total, as `BEFORE_RECORDING` (a negative size) when any were freed
    by the peak. The peak is then what ``torch.cuda.max_memory_allocated`` would say above the start.

    A block counts as freed at its first free event (``free_requested``, or ``free_completed`` when the
    request was not recorded), as the allocator's own statistics do.
    """
    live: dict[int, tuple[int, list[dict]]] = {}
    requested: set[int] = set()  # blocks whose free was requested and has not completed yet
    total = peak = 0
    freed_before = freed_before_at_peak = (0, 0)  # bytes, blocks
    at_peak: dict[int, tuple[int, list[dict]]] = {}
    for event in events:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            live[addr] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak, freed_before_at_peak = total, dict(live), freed_before
        elif action in ("free_requested", "free_completed"):
            if action == "free_completed" and addr in requested:
                requested.discard(addr)  # counted at its request
                continue
            if action == "free_requested":
                requested.add(addr)
            if addr in live:
                total -= live.pop(addr)[0]
            else:  # allocated before the recording started
                total -= event.get("size", 0)
                freed_before = (freed_before[0] + event.get("size", 0), freed_before[1] + 1)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in at_peak.values():
        group = groups[allocation_site(frames)]
        group[0] += size
        group[1] += 1
    ranked = sorted(((site, b, n) for site, (b, n) in groups.items()), key=lambda g: -g[1])
    if len(ranked) > top:
        rest = ranked[top:]
        ranked = ranked[:top] + [("other", sum(g[1] for g in rest), sum(g[2] for g in rest))]
    if freed_before_at_peak[1]:
        ranked.append((BEFORE_RECORDING, -freed_before_at_peak[0], freed_before_at_peak[1]))
    return peak, ranked


def peak_report(device=None, top: int = 12) -> str:
    """``live_at_peak`` of the recorded history of ``device`` (the current CUDA device by default), as text."""
    import torch

    index = torch.device(device).index if device is not None else None
    if index is None:  # "cuda" without an index is the current device
        index = torch.cuda.current_device()
    traces = torch.cuda.memory._snapshot().get("device_traces", [])
    events = traces[index] if index < len(traces) else []
    peak, ranked = live_at_peak(events, top)
    lines = [f"allocated at the peak, above the start of the recording: {peak / MIB:.1f} MiB, by allocation site:"]
    lines += [f"  {size / MIB:9.1f} MiB  {count:5d} blocks  {site}" for site, size, count in ranked]
    return "\n".join(lines)
