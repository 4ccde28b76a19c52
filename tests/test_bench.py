"""The benchmarks run end to end on a tiny shape, and their baselines compute what the op computes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from xmc_repro import bench, trace_gaps
from xmc_repro.sparse import reference

ROOT = Path(__file__).resolve().parents[1]


def test_model_step_benchmark_writes_both_models(tmp_path):
    assert bench.main(["--model", "--device", "cpu", "--scale", "0.0005", "--steps", "2", "--warmup", "0",
                       "--profile", "2", "--precision", "32-true,bf16-mixed", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("cpu-model-scale*.json")
    rows = {(r["model"], r["way"], r["precision"]): r for r in json.loads(result.read_text())["results"]}
    assert set(rows) == {(m, w, p) for m in ("dense", "uniform") for w in ("eager", "lightning")  # no graph on a CPU
                         for p in ("32-true", "bf16-mixed")}
    assert rows["uniform", "eager", "32-true"]["intermediate"] == 32 and rows["dense", "eager", "32-true"]["labels"] == 335
    for (model, way, _), r in rows.items():
        assert r["step_ms"] > 0
        if way == "eager":
            assert len(r["step_ms_windows"]) == 2 and min(r["step_ms_windows"]) <= r["step_ms"]
            assert list(r["phases"]) == ["forward", "loss", "backward", "optimizer"]
            assert all(device_ms > 0 for _, device_ms in r["phases"].values()) and r["param_optimizer_gib"] > 0
        else:
            assert r["cuda_graph"] is False
    assert json.loads(result.read_text())["settings"] == {"steps": 2, "warmup": 0,
                                                          "precisions": ["32-true", "bf16-mixed"]}
    text = result.with_suffix(".md").read_text()
    assert "eager, bf16-mixed: uniform step" in text and "lightning, 32-true: uniform step" in text
    (profile,) = tmp_path.glob("cpu-model-scale*-profile.txt")
    assert "== uniform, eager, bf16-mixed, 2 steps" in profile.read_text() and "xmc_sparse::forward" in profile.read_text()
    for way, phase in (("eager", "forward"), ("lightning", "training_step")):  # the 2 profiled steps, annotated
        (trace,) = tmp_path.glob(f"cpu-model-scale*-trace-{way}-32-true.json.gz")
        phases = [e["name"] for e in trace_gaps.load(trace) if e.get("cat") == "user_annotation"]
        assert phases.count(phase) == 2, (way, phases)


def test_the_model_benchmark_shows_progress_while_it_profiles(tmp_path, capsys, monkeypatch):
    """--profile ran its profiles (minutes on a GPU) without a word until the end."""
    from xmc_repro import bench_model

    def timed(shape, device, steps, warmup, *rest, **kw):
        return {"model": shape.name, "way": "eager", "precision": "32-true", "labels": shape.labels,
                "intermediate": shape.intermediate, "parameters": 1, "step_ms": 1.0}

    def profiled(shape, device, way, precision, *a):
        print(f"PROFILE {way} {precision}")
        return "", ""

    monkeypatch.setattr(bench_model, "measure", timed)
    monkeypatch.setattr(bench_model, "measure_lightning", timed)
    monkeypatch.setattr(bench_model, "profile", profiled)
    assert bench.main(["--model", "--device", "cpu", "--scale", "0.0005", "--profile", "3",
                       "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for way in ("eager", "lightning"):
        assert f"  profiling uniform, {way}, 32-true: 3 steps ...\nPROFILE {way} 32-true" in out


def test_an_earlier_runs_profile_files_do_not_stay_beside_new_results(tmp_path, capsys, monkeypatch):
    """--model without --profile left the previous run's profile and traces beside the new results, as if theirs."""
    from xmc_repro import bench_model

    def timed(shape, device, steps, warmup, *rest, **kw):
        return {"model": shape.name, "way": "eager", "precision": "32-true", "labels": shape.labels,
                "intermediate": shape.intermediate, "parameters": 1, "step_ms": 1.0}

    monkeypatch.setattr(bench_model, "measure", timed)
    monkeypatch.setattr(bench_model, "measure_lightning", timed)
    monkeypatch.setattr(bench_model, "profile", lambda shape, device, way, *a: (f"{way}\n", ""))
    name = "cpu-model-scale0.0005"
    other = tmp_path / "cpu-model-scale0.001-profile.txt"  # another scale's: kept
    for path in (tmp_path / f"{name}-profile.txt", tmp_path / f"{name}-trace-graph-bf16-mixed.json.gz", other):
        path.write_text("earlier")
    assert bench.main(["--model", "--device", "cpu", "--scale", "0.0005", "--out", str(tmp_path)]) == 0
    assert "removed the earlier run's profile files (cpu-model-scale0.0005-profile.txt, " \
        "cpu-model-scale0.0005-trace-graph-bf16-mixed.json.gz)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{name}.json", f"{name}.md", other.name])
    assert bench.main(["--model", "--device", "cpu", "--scale", "0.0005", "--profile", "2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / f"{name}-profile.txt").read_text() == "eager\nlightning\n"


def test_a_uniform_step_slower_than_dense_reads_as_slower():
    from xmc_repro.bench_model import markdown

    info = {"host_cpu": "x", "cpu_threads": 1, "torch": "t", "cuda": None, "sparse_backend": "b", "date": "d"}
    rows = [{"model": name, "way": "eager", "precision": "32-true", "labels": 10, "intermediate": None,
             "parameters": 1, "step_ms": ms} for name, ms in (("dense", 1.0), ("uniform", 2.0))]
    assert "- eager, 32-true: uniform step 2.00x slower than dense" in markdown(info, rows, 1.0)  # was "0.50x faster"
    rows[1]["step_ms"] = 0.25
    assert "- eager, 32-true: uniform step 4.00x faster than dense" in markdown(info, rows, 1.0)


def test_a_rerun_says_which_results_it_replaces(tmp_path, capsys):
    args = ["--model", "--device", "cpu", "--scale", "0.0005", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    assert "and .md\n" in capsys.readouterr().out  # nothing there before
    (result,) = tmp_path.glob("*.json")
    first = json.loads(result.read_text())["machine"]
    assert bench.main(args) == 0
    assert f"and .md (replacing the results of {first['date']}, commit {first['commit']})" in capsys.readouterr().out


def test_model_step_benchmark_refuses_an_unknown_precision(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--model", "--device", "cpu", "--precision", "16-mixed"])
    assert "--precision: 16-mixed is not one of 32-true, bf16-mixed" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--methods", "uniform,bogus"], "--methods: bogus is not one of uniform, reference"),
    (["--repeats", "0"], "argument --repeats: 0 is not > 0"),
    (["--max-cases", "-3"], "argument --max-cases: -3 is not > 0"),
    (["--warmup", "-2"], "--warmup -2: give 0 or more untimed runs"),
    (["--model", "--scale", "0"], "argument --scale: 0 is not > 0"),
    (["--device", "foo"], "--device foo: choose cpu or cuda"),
    (["--model", "--profile", "-2"], "argument --profile: -2 is not >= 0"),  # crashed after the timed run
    (["--model", "--scale", "inf"], "argument --scale: inf is not a finite number"),  # OverflowError
    (["--steps", "3"], "--steps applies to --model only; add --model or drop it"),  # silently ignored
    (["--precision", "bf16-mixed"], "--precision applies to --model only"),
    (["--profile", "2"], "--profile applies to --model only"),
    (["--model", "--repeats", "3"], "--repeats applies to the layer benchmark only; drop it or --model"),
    (["--model", "--methods", "uniform"], "--methods applies to the layer benchmark only"),
    (["--model", "--max-cases", "1"], "--max-cases applies to the layer benchmark only"),
    (["--methods", ""], "--methods '': give a comma list without empty items"),  # ran every method on every case
    (["--model", "--precision", "32-true,,bf16-mixed"], "give a comma list without empty items"),
    (["--model", "--precision", "16-mixed"], "--precision: 16-mixed is not one of 32-true, bf16-mixed"),  # made --out
])
def test_bad_arguments_are_refused_before_anything_is_written(args, message, tmp_path, capsys, monkeypatch):
    """A typo in --methods wrote result files without results over the committed ones; 0 or negative sizes failed
    deep inside, or silently meant the default."""
    monkeypatch.setattr(bench, "copy_bandwidth", lambda *a, **k: pytest.fail("ran before refusing the arguments"))
    with pytest.raises(SystemExit) as info:
        bench.main([*args, "--out", str(tmp_path / "out")])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_bad_kernels_setting_is_refused_before_out_is_made(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XMC_SPARSE_KERNELS", "bogus")
    assert bench.main(["--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert "XMC_SPARSE_KERNELS='bogus' must be threads, rows, or rows:<phases>" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_layer_baselines_agree_with_the_reference():
    case = bench.Case(300, 64, 5, 7, "bce", bench.ALL)
    p = bench.make_problem(case, torch.device("cpu"))
    want_fwd = reference.forward(p["x"], p["idx"], p["w"], p["b"])
    want_gx = reference.backward_input(p["g"], p["idx"], p["w"], case.inputs)
    for name in ("uniform", "reference", "csr"):
        phases = bench.build_method(name, case, p, torch.device("cpu"))
        torch.testing.assert_close(phases["forward"](), want_fwd, msg=name)
        torch.testing.assert_close(phases["backward_input"](), want_gx, msg=name)


@pytest.mark.parametrize("method", ["uniform", "coo", "dense"])
def test_a_step_with_adam_computes_the_input_gradient_too_as_after_an_intermediate_layer(method):
    case = bench.Case(300, 64, 5, 7, "hinge", bench.ALL)
    p = bench.make_problem(case, torch.device("cpu"))
    step = bench.build_method(method, case, p, torch.device("cpu"))["step+adam"]
    step()
    if method == "dense":  # its own weights and inputs
        assert step.x.grad is not None and step.x.grad.shape == step.x.shape and step.x.grad.abs().sum() > 0
    else:  # computed before Adam's update
        torch.testing.assert_close(step.x.grad, reference.backward_input(p["g"], p["idx"], p["w"], case.inputs))


def test_benchmark_uses_only_public_names_of_the_sparse_package():
    for source in ("bench.py", "bench_model.py"):
        text = (ROOT / "xmc_repro" / source).read_text()
        assert not re.search(r"from xmc_repro\.sparse\.\w+ import .*\b_\w+", text), source
        assert "autograd.Function" not in text, source  # the op's backward lives in sparse/op.py only


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_l2_read_probe_reads_every_value_and_reports_a_bandwidth_above_dram_copy():
    from xmc_repro.sparse import op

    if not op.backend("cuda").startswith("compiled-cuda"):
        pytest.skip("no compiled CUDA kernels")
    values = torch.rand(4 * 1000, device="cuda")  # not a multiple of the blocks: each block still reads it all
    out = torch.ops.xmc_bench.l2_read(values, 3)
    assert torch.allclose(out.sum(dim=1), 3 * values.sum().expand(out.shape[0]), rtol=1e-4)
    device = torch.device("cuda")
    assert bench.l2_bandwidth(device) > bench.copy_bandwidth(device)  # L2 serves reads faster than DRAM copies
    with pytest.raises(RuntimeError, match="multiple of 4"):
        torch.ops.xmc_bench.l2_read(values[:6], 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_candidate_kernels_are_benchmarked_beside_the_op_and_compute_what_it_computes():
    from xmc_repro.sparse import op

    if not op.backend("cuda").startswith("compiled-cuda"):
        pytest.skip("no compiled CUDA kernels")
    device = torch.device("cuda")
    case = bench.Case(300, 64, 5, 7, "bce", ("uniform",))
    p = bench.make_problem(case, device)
    phases = bench.build_method(bench.ROWS, case, p, device)
    torch.testing.assert_close(phases["forward"](), reference.forward(p["x"], p["idx"], p["w"], p["b"]))
    torch.testing.assert_close(phases["backward_input"](), reference.backward_input(p["g"], p["idx"], p["w"], 64))
    torch.testing.assert_close(phases["backward_weight"](), reference.backward_weight(p["g"], p["x"], p["idx"]))
    rows = bench.run_case(case, device, 1e12, warmup=1, repeats=2, methods={"uniform", bench.ROWS, bench.ROWS_BF16},
                          l2=5e12)
    timed = {(r["method"], r["phase"]) for r in rows if "ms" in r}
    assert {(m, "fwd+bwd") for m in ("uniform", bench.ROWS, bench.ROWS_BF16)} <= timed
    assert all("x_l2_floor" in r for r in rows if "ms" in r)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_vector_kernels_are_timed_in_their_phases_and_compute_what_the_reference_does():
    from xmc_repro.sparse import op

    if not op.backend("cuda").startswith("compiled-cuda"):
        pytest.skip("no compiled CUDA kernels")
    device = torch.device("cuda")
    case = bench.Case(300, 64, 5, 37, "bce", ("uniform",))
    p = bench.make_problem(case, device)
    want = {bench.VEC[0]: {"forward", "backward_input", "backward_weight"},
            bench.VEC[1]: {"forward", "backward_weight"}}  # the input gradient reads no inputs: float32 only
    for name in bench.VEC:
        phases = bench.build_method(name, case, p, device)
        assert set(phases) == want[name], name
        if "backward_input" in phases:
            torch.testing.assert_close(phases["backward_input"](),
                                       reference.backward_input(p["g"], p["idx"], p["w"], case.inputs))
        x = p["x"].bfloat16().float() if name.endswith("bf16") else p["x"]
        torch.testing.assert_close(phases["forward"](), reference.forward(x, p["idx"], p["w"], p["b"]),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(phases["backward_weight"](), reference.backward_weight(p["g"], x, p["idx"]),
                                   rtol=1e-5, atol=1e-5)
    rows = bench.run_case(case, device, 1e12, warmup=1, repeats=2, methods=set(bench.VEC), l2=5e12)
    assert {(r["method"], r["phase"]) for r in rows if "ms" in r} == {
        (m, phase) for m in bench.VEC for phase in want[m]}


def timed(case, method, **ms):
    """The benchmark's result rows of one method on one case: ms per phase."""
    return [{"case": case, "method": method, "phase": phase, "ms": v} for phase, v in ms.items()]


def test_kernels_choice_picks_each_phases_faster_kernels_over_the_cases_that_timed_both():
    from xmc_repro.bench import ROWS, kernels_choice

    rows = (timed("hinge", "uniform", forward=0.73, backward_input=0.33, backward_weight=0.30, **{"fwd+bwd": 1.4})
            + timed("hinge", ROWS, forward=0.50, backward_input=0.40, backward_weight=0.20, **{"fwd+bwd": 9.0})
            + timed("bce", "uniform", forward=0.73, backward_input=2.06, backward_weight=0.74)
            + timed("bce", ROWS, forward=0.50, backward_input=1.00, backward_weight=0.90)
            + timed("other", "uniform", forward=9.0, backward_weight=9.0)  # no candidate timed: not counted
            + [{"case": "bce", "method": "csr", "phase": "forward", "ms": 0.01},
               {"case": "hinge", "method": ROWS, "phase": "all", "note": "out of memory while building"}])
    # sums: forward 1.46 vs 1.00, backward_input 2.39 vs 1.40, backward_weight 1.04 vs 1.10
    assert kernels_choice(rows) == "rows:forward,backward_input"
    assert kernels_choice([r for r in rows if r["phase"] == "backward_weight"]) == "threads"
    assert kernels_choice([r for r in rows if r["phase"] != "backward_weight"]) == "rows:forward,backward_input"
    slower = [{**r, "ms": r["ms"] * 10} if r["method"] == "uniform" and "ms" in r else r for r in rows]
    assert kernels_choice(slower) == "rows"
    assert kernels_choice([r for r in rows if r["method"] != ROWS]) is None


def test_kernels_choice_weighs_the_vector_kernels_in_the_phases_they_timed():
    """uniform-rows-vec (float32) is a third candidate in the phases it timed; its bf16 method is not (the op's own
    method, `uniform`, takes float32 inputs). The choice is an XMC_SPARSE_KERNELS value the op takes."""
    from xmc_repro.bench import ROWS, VEC, kernels_choice
    from xmc_repro.sparse.op import kernel_families

    base = (timed("hinge", "uniform", forward=0.73, backward_input=0.33, backward_weight=0.30)
            + timed("hinge", ROWS, forward=0.50, backward_input=0.20, backward_weight=0.90)
            + timed("bce", "uniform", forward=0.73, backward_input=2.06, backward_weight=0.74)
            + timed("bce", ROWS, forward=0.50, backward_input=1.00, backward_weight=0.90))
    choices = {
        # vec faster than rows in forward, than threads in weight backward
        (0.40, 0.20, 0.40, 0.50): "rows:backward_input+vec:forward,backward_weight",
        (0.70, 0.60, 0.40, 0.50): "rows:forward,backward_input",  # vec slower than both
        (0.40, 0.20, 0.40, 0.90): "rows:backward_input+vec:forward",
        (0.60, 0.20, 0.60, 0.50): "rows:forward,backward_input+vec:backward_weight",
        # ties keep the kernels listed first: threads, then rows
        (0.50, 0.30, 0.50, 0.74): "rows:forward,backward_input",
    }
    for (fwd_h, bw_h, fwd_b, bw_b), want in choices.items():
        vec = (timed("hinge", VEC[0], forward=fwd_h, backward_weight=bw_h)
               + timed("bce", VEC[0], forward=fwd_b, backward_weight=bw_b)
               + timed("hinge", VEC[1], forward=0.01, backward_weight=0.01))  # bf16 inputs: not a candidate
        got = kernels_choice(base + vec)
        assert got == want, (fwd_h, bw_h, fwd_b, bw_b)
        kernel_families(got)  # the op takes it
    only_vec = [r for r in base if r["method"] == "uniform"] + timed("bce", VEC[0], forward=0.1, backward_weight=9.0)
    assert kernels_choice(only_vec) == "vec:forward"  # backward_input: no candidate timed, threads
    # a case that timed vec but not rows is left out of the phase's sums (they would compare different cases)
    assert kernels_choice(base + timed("bce", VEC[0], forward=0.1)
                          + timed("extra", "uniform", forward=1.0) + timed("extra", VEC[0], forward=0.0)) == (
        "rows:backward_input+vec:forward")
    # the input backward (sums: threads 2.39, rows 1.20): vec where it is faster than both, a tie keeps rows
    for (bi_h, bi_b), want in {(0.15, 0.90): "rows:forward+vec:backward_input",
                               (0.25, 1.00): "rows:forward,backward_input",
                               (0.20, 1.00): "rows:forward,backward_input"}.items():
        vec = (timed("hinge", VEC[0], backward_input=bi_h) + timed("bce", VEC[0], backward_input=bi_b)
               + timed("hinge", VEC[1], backward_input=0.01))
        got = kernels_choice(base + vec)
        assert got == want, (bi_h, bi_b)
        kernel_families(got)
    assert kernels_choice(base + timed("hinge", VEC[0], forward=0.1, backward_input=0.1, backward_weight=0.1)
                          + timed("bce", VEC[0], forward=0.1, backward_input=0.1, backward_weight=0.1)) == (
        "vec:forward,backward_input,backward_weight")


@pytest.mark.parametrize("model", [False, True])
def test_an_unusable_out_folder_is_refused_in_one_line_before_anything_is_timed(model, tmp_path, capsys, monkeypatch):
    """--out naming a file (or a folder that cannot be created) ended in a traceback after the whole run."""
    monkeypatch.setattr(bench, "run_case", lambda *a, **k: pytest.fail("timed before checking --out"))
    monkeypatch.setattr(bench, "copy_bandwidth", lambda *a, **k: pytest.fail("timed before checking --out"))
    taken = tmp_path / "a-file"
    taken.write_text("")
    for out in (taken, taken / "sub"):
        with pytest.raises(SystemExit) as info:
            bench.main(["--device", "cpu", *(["--model"] if model else []), "--out", str(out)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"--out {out}: cannot write results there" in err and "Traceback" not in err


def test_a_refused_out_leaves_none_of_the_folders_its_check_made(tmp_path):
    """--out new/<a name too long>: `new` was made before the name failed, and stayed."""
    assert bench.usable_out(tmp_path / "new" / ("x" * 300)) and not list(tmp_path.iterdir())


def test_candidate_kernels_are_refused_before_anything_is_timed_without_compiled_cuda(tmp_path, capsys, monkeypatch):
    """On a GPU whose CUDA kernels did not build (the op falls back to the reference), --methods uniform-rows ended
    in a traceback (no xmc_bench ops) after the other methods had been timed, and nothing was written."""
    from xmc_repro.sparse import op

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(op, "backend", lambda device=None: "reference")
    monkeypatch.setattr(bench, "copy_bandwidth", lambda *a, **k: pytest.fail("timed before refusing --methods"))
    with pytest.raises(SystemExit) as info:
        bench.main(["--device", "cuda", "--methods", "uniform,uniform-rows,csr", "--out", str(tmp_path)])
    assert info.value.code == 2 and "--methods uniform-rows: needs the compiled CUDA kernels, but the op runs " \
        "reference here" in capsys.readouterr().err


def _fake_layer_run(monkeypatch):
    """The layer benchmark's main without timing anything: one canned row per call."""
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e10)
    monkeypatch.setattr(bench, "run_case", lambda case, *a, **k: [
        {"case": case.name, "method": "uniform", "phase": "fwd+bwd", "ms": 2.0, "floor_ms": 1.0, "x_floor": 2.0,
         "labels_active": 0.5}])


def test_an_interrupted_write_leaves_the_previous_results_whole(tmp_path, capsys, monkeypatch):
    """The .json and .md were written in place: a full disk (or a Ctrl+C) mid-write left a truncated file, or a
    new .json beside the old .md; the error was a traceback."""
    import builtins
    import errno
    import io

    _fake_layer_run(monkeypatch)
    old = {tmp_path / "cpu.json": '{"old": 1}\n', tmp_path / "cpu.md": "# old\n"}
    for path, text in old.items():
        path.write_text(text)
    real_open = io.open

    class HalfWriter:  # writes half of what it is given, then finds the disk full
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    writes = []

    def failing_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and str(file).startswith(str(tmp_path)):
            writes.append(file)
            if len(writes) == 2:  # the second file of the pair
                return HalfWriter(f)
        return f

    monkeypatch.setattr(io, "open", failing_open)
    monkeypatch.setattr(builtins, "open", failing_open)
    try:
        code = bench.main(["--device", "cpu", "--max-cases", "1", "--out", str(tmp_path)])
    except OSError:
        code = "traceback"
    monkeypatch.undo()
    assert {path: path.read_text() for path in old} == old
    assert code == 1 and "error: cannot write" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.json", "cpu.md"]  # no temporary file left


def test_ctrl_c_during_the_run_ends_in_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    _fake_layer_run(monkeypatch)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_case", interrupted)
    try:
        code = bench.main(["--device", "cpu", "--out", str(tmp_path)])
    except KeyboardInterrupt:
        code = "traceback"
    assert code == 130
    assert "error: interrupted (Ctrl+C)" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_a_model_too_big_for_the_machine_is_refused_before_it_is_built(tmp_path, capsys):
    """--scale 1000 raised a traceback from a 2 TB allocation; a smaller excess would meet the OOM killer."""
    for out in (tmp_path, tmp_path / "new" / "folder"):  # a folder made for the run was left behind, empty
        assert bench.main(["--model", "--device", "cpu", "--scale", "1000", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --scale 1000: model=dense over 768 inputs and 670,091,000 labels") and \
            err.strip().endswith("GiB is available; lower --scale") and not list(tmp_path.iterdir())


def test_ctrl_c_inside_lightnings_fit_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """Lightning turns a Ctrl+C inside fit into a silent exit(1), and ignores SIGINT from then on."""
    import signal

    from xmc_repro.model import XMCClassifier

    def interrupted(self, batch, batch_idx):
        raise KeyboardInterrupt

    monkeypatch.setattr(XMCClassifier, "training_step", interrupted)
    code = bench.main(["--model", "--device", "cpu", "--scale", "0.0005", "--steps", "1", "--out", str(tmp_path)])
    assert code == 130 and "error: interrupted (Ctrl+C)" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_results_are_written_whole_as_a_pair(tmp_path, monkeypatch):
    _fake_layer_run(monkeypatch)
    assert bench.main(["--device", "cpu", "--max-cases", "1", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "cpu.json").read_text())["results"][0]["ms"] == 2.0
    assert "| uniform | fwd+bwd | 2.000 |" in (tmp_path / "cpu.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.json", "cpu.md"]


def test_results_record_the_commit_they_measured(tmp_path, monkeypatch):
    """The files named machine, torch and date but not the code: the READMEs quoted commits by hand."""
    from xmc_repro import bench_model
    from xmc_repro.tracking import git_commit

    info = bench.machine_info(torch.device("cpu"), 1e10)
    assert info["commit"] == git_commit() and info["commit"] != ""
    monkeypatch.setenv("XMC_GIT_COMMIT", "0123abcd")  # scripts/gpu_all.sh on a lent machine
    info = bench.machine_info(torch.device("cpu"), 1e10)
    assert info["commit"] == "0123abcd"
    assert "commit `0123abcd`" in bench.markdown(info, [])
    assert "commit `0123abcd`" in bench_model.markdown(info, [], 0.02)


def test_the_h200_section_quotes_the_copy_bandwidth_its_file_measured():
    """results/bench/README.md said 4.0 TB/s (the later headline run's) for the first H200 file's 3,834 GB/s."""
    text = (ROOT / "results" / "bench" / "README.md").read_text()
    quoted = float(re.search(r"`nvidia-h200-first\.\*`.*?copy bandwidth measured ([\d.]+) TB/s", text, re.S).group(1))
    measured = json.loads((ROOT / "results" / "bench" / "nvidia-h200-first.json").read_text())["machine"]
    assert quoted == round(measured["copy_bandwidth_gb_s"] / 1e3, 1)
