"""The idle-gap analysis of profiler traces, on a hand-built trace in Kineto's Chrome format."""

from __future__ import annotations

import gzip
import json

import pytest

from xmc_repro import trace_gaps

HOST, DEVICE = {"pid": 1, "tid": 1}, {"pid": 0, "tid": 7}


def _x(cat, name, ts, dur, where, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **where, "args": args}


def _trace():
    """Step: a sort launches a kernel in time; Python code delays the next launch; a graph launch is queued early
    but its kernels start after a gap; a stream synchronize blocks the host at the end."""
    return [
        _x("user_annotation", "positives", 0, 50, HOST),
        _x("cpu_op", "aten::sort", 10, 30, HOST),
        _x("cuda_runtime", "cudaLaunchKernel", 20, 5, HOST, correlation=1),
        _x("kernel", "sort_kernel", 30, 10, DEVICE, correlation=1),
        _x("user_annotation", "optimizer", 50, 150, HOST),
        _x("cuda_runtime", "cudaLaunchKernel", 180, 5, HOST, correlation=2),
        _x("kernel", "adam_kernel", 190, 110, DEVICE, correlation=2),
        _x("user_annotation", "forward+loss+backward", 205, 25, HOST),
        _x("cuda_runtime", "cudaGraphLaunch", 210, 5, HOST, correlation=3),
        _x("kernel", "graph_kernel", 320, 80, DEVICE, correlation=3),
        _x("gpu_memset", "Memset", 330, 10, DEVICE, correlation=3),  # overlaps: one busy interval
        _x("kernel", "graph_kernel_2", 330, 10, {"pid": 0, "tid": 8}, correlation=3),  # same span, another stream
        _x("cuda_runtime", "cudaStreamSynchronize", 400, 10, HOST, correlation=4),
        _x("cuda_runtime", "cudaMemcpyAsync", 420, 3, HOST, correlation=5),  # not blocking
    ]


def test_gaps_are_found_and_charged_to_what_the_host_was_doing():
    late, early = trace_gaps.gaps(_trace())
    assert (late.start, late.end, late.late_launch) == (40, 190, True)
    assert late.host == pytest.approx({"positives: -": 10, "optimizer: -": 135, "optimizer: cudaLaunchKernel": 5})
    assert (early.start, early.end, early.late_launch) == (300, 320, False)
    assert early.host == {"-": 20}
    assert trace_gaps.gaps(_trace(), min_us=25) == [late]


def test_blocking_calls_exclude_async_ones():
    assert trace_gaps.blocking_calls(_trace()) == {"cudaStreamSynchronize": (1, 10)}


def test_report_per_step(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace() + [{"ph": "i", "name": "marker", "ts": 0}]}, f)
    text = trace_gaps.report(trace_gaps.load(path), steps=2)
    assert "idle 0.085 ms per step in 1.0 gaps" in text  # (150 + 20) us over 2 steps
    assert "0.075 ms waiting for a late launch" in text
    assert text.index("optimizer: -") < text.index("positives: -")  # largest first
    assert "cudaStreamSynchronize x0.5 per step (0.005 ms)" in text
    assert trace_gaps.report([_x("cpu_op", "aten::add", 0, 1, HOST)], steps=1) == "no device activity in the trace\n"


def test_an_interrupted_trace_export_leaves_the_earlier_trace_whole(tmp_path):
    """torch.profiler gzips the trace in place: a Ctrl+C during the export left a truncated file over the last run's
    trace (bench --model --profile, trainer.profile_steps)."""
    class Profiler:  # writes half a trace, then is interrupted
        def export_chrome_trace(self, path):
            with gzip.open(path, "wt") as f:
                f.write('{"traceEvents": [')
            raise KeyboardInterrupt

    trace = tmp_path / "profile-trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": []}, f)
    before = trace.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        trace_gaps.profile_report(Profiler(), trace, 1, cuda=False)
    assert trace.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [trace.name]
