"""The peak-memory breakdown replays allocator events: the right moment, the right blocks, grouped by site. The
cuBLAS workspace setting (trainer.cublas_workspace_mib) sizes what torch allocates for cuBLAS."""
import os
import subprocess
import sys

import pytest
import torch

from xmc_repro import train
from xmc_repro.memory_peak import BEFORE_RECORDING, allocation_site, live_at_peak

MODEL = [{"name": "forward", "filename": "/x/xmc_repro/model.py", "line": 10}]
WORKSPACE = [{"name": "at::cuda::getCUDABlasLtWorkspace()", "filename": "??", "line": 0}] + MODEL


def alloc(addr, size, frames=MODEL):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr, action="free_requested", size=0):
    return {"action": action, "addr": addr, "size": size}


def test_the_peak_is_the_highest_total_and_lists_what_was_alive_then():
    events = [
        alloc(1, 100), alloc(2, 300, WORKSPACE), free(1),
        alloc(3, 50), alloc(4, 200),          # peak here: 300 + 50 + 200 = 550
        free(3), free(3, "free_completed"),   # a free's two events count once
        free(4), alloc(5, 240),               # 540: below the peak
        free(99),                             # a block from before the recording, after the peak
    ]
    peak, ranked = live_at_peak(events)
    assert peak == 550
    assert ranked[0] == (allocation_site(WORKSPACE), 300, 1)
    assert ranked[1] == (allocation_site(MODEL), 250, 2)


def test_blocks_allocated_before_the_recording_count_against_the_peak_once_freed():
    """A graph capture frees the cuBLAS workspaces, which may predate the recording: the new ones it allocates
    must not read as a rise. The peak is the rise above the start, as max_memory_allocated would show it."""
    events = [
        alloc(1, 100),
        free(90, size=64), free(90, "free_completed", size=64),  # the old workspace: one free
        alloc(2, 64, WORKSPACE),              # its replacement: 100 + 64 - 64
        alloc(3, 20),                         # peak: 120
        free(91, "free_completed", size=8),   # a completed free whose request was not recorded
        free(3), alloc(4, 10),                # 102
    ]
    peak, ranked = live_at_peak(events)
    assert peak == 120
    assert ranked == [(allocation_site(MODEL), 120, 2), (allocation_site(WORKSPACE), 64, 1),
                      (BEFORE_RECORDING, -64, 1)]
    assert sum(size for _, size, _ in ranked) == peak


def test_a_completed_free_without_its_request_still_frees():
    peak, _ = live_at_peak([alloc(1, 10), free(1, "free_completed"), alloc(2, 7), alloc(3, 2)])
    assert peak == 10


def test_groups_beyond_top_are_summed_as_other():
    events = [alloc(i, 10 + i, [{"name": f"op{i}", "filename": "??"}]) for i in range(5)]
    _, ranked = live_at_peak(events, top=2)
    assert [site for site, _, _ in ranked] == ["op4", "op3", "other"]
    assert ranked[-1][1:] == (10 + 11 + 12, 3)


def test_site_names_the_innermost_frame_and_the_project_frame_that_led_there():
    assert allocation_site(WORKSPACE) == "at::cuda::getCUDABlasLtWorkspace() <- forward (model.py:10)"
    assert allocation_site(MODEL) == "forward (model.py:10)"
    assert allocation_site([]) == "?"


def test_the_workspace_setting_writes_cublas_config_and_leaves_the_users_alone(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(train, "_written_workspace", None)
    train.limit_cublas_workspace(8)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":8192:1"  # KiB, one buffer
    train.limit_cublas_workspace(0.5)  # the next run of a sweep
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":512:1"
    train.limit_cublas_workspace(None)  # torch's default again
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the user's, e.g. for deterministic cuBLAS
    for mib in (8, None):
        train.limit_cublas_workspace(mib)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


WORKSPACE_PROBE = """
import sys, torch
from xmc_repro import train
train.limit_cublas_workspace(None if sys.argv[1] == "null" else float(sys.argv[1]))
a, b = torch.randn(32, 768, device="cuda"), torch.randn(768, 4096, device="cuda")
before = torch.cuda.memory_allocated()
out = a @ b
print((torch.cuda.memory_allocated() - before - out.nbytes) / 2**20)  # what the matmul kept: its workspaces
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_workspace_setting_sizes_what_cublas_keeps_allocated():
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}

    def kept(setting):
        out = subprocess.run([sys.executable, "-c", WORKSPACE_PROBE, setting], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    default, small = kept("null"), kept("2")
    assert 2 <= small <= 2 + 1.5  # the cuBLAS workspace, and cuBLASLt's own (1 MiB by default) where it has one
    assert default >= 8 and default - small >= 6  # torch's: 32 MiB on Hopper, 8 MiB elsewhere
