"""The peak-memory breakdown replays allocator events: the right moment, the right blocks, grouped by site."""
from xmc_repro.memory_peak import allocation_site, live_at_peak

MODEL = [{"name": "forward", "filename": "/x/xmc_repro/model.py", "line": 10}]
WORKSPACE = [{"name": "at::cuda::getCUDABlasLtWorkspace()", "filename": "??", "line": 0}] + MODEL


def alloc(addr, size, frames=MODEL):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr, action="free_requested"):
    return {"action": action, "addr": addr, "size": 0}


def test_the_peak_is_the_highest_total_and_lists_what_was_alive_then():
    events = [
        alloc(1, 100), alloc(2, 300, WORKSPACE), free(1),
        alloc(3, 50), alloc(4, 200),          # peak here: 300 + 50 + 200 = 550
        free(3), free(3, "free_completed"),   # a free's two events count once
        free(4), alloc(5, 240),               # 540: below the peak
        free(99),                             # a block from before the recording: ignored
    ]
    peak, ranked = live_at_peak(events)
    assert peak == 550
    assert ranked[0] == (allocation_site(WORKSPACE), 300, 1)
    assert ranked[1] == (allocation_site(MODEL), 250, 2)


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
