"""scripts/gpu_all.sh, the one call a lent GPU runs, checked on the CPU against the current code: every training
command's overrides compose and pass `validate`, every benchmark command's flags pass the benchmark's own checks,
the test selection exists, and the step names its header and the READMEs give are the steps it runs.

The commands are the ones the script itself builds: `DRY_RUN=1 bash scripts/gpu_all.sh` lists each step's argv."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_all.sh"
STEP = re.compile(r"\[([\w.-]+)\] (\d+)s: (.*)")


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict[str, str]:
    """Step name -> its command line (bash-quoted), every step included (BIBTEX=1 with a data folder)."""
    home = tmp_path_factory.mktemp("home")
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "DRY_RUN": "1", "BIBTEX": "1",
           "XMC_SHARED_DATA": str(home)}
    listed = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    found = [STEP.fullmatch(line) for line in listed.stdout.splitlines()]
    assert all(found), listed.stdout
    return {m.group(1): m.group(3) for m in found}


def _argv(command: str) -> tuple[dict[str, str], list[str]]:
    """(the `env` assignments, the rest) of a step's command line."""
    words = shlex.split(command)
    assigned = {}
    if words[0] == "env":
        words.pop(0)
        while "=" in words[0]:
            key, _, value = words.pop(0).partition("=")
            assigned[key] = value
    return assigned, words


def _commands(steps, module: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """The steps that run `python3 -m <module>`: name -> (env assignments, the module's arguments)."""
    chosen = {}
    for name, command in steps.items():
        if command.startswith(("bash -c", "env XMC_SPARSE_BACKEND=compiled python3 -c")):  # the inline programs
            continue
        assigned, words = _argv(command)
        if words[:3] == ["python3", "-m", module]:
            chosen[name] = (assigned, words[3:])
    return chosen


def test_the_header_lists_the_steps_in_their_order(steps):
    text = SCRIPT.read_text()
    listed = re.search(r"# Steps, in this order \([^)]*\): (.*?)\.\n", text, re.S).group(1)
    assert re.sub(r"\s*#\s*", " ", listed).split() == list(steps)
    for example in re.findall(r'SKIP="([^"]*)"', text):  # a comment's example may go on over lines
        assert set(re.sub(r"\s*#\s*", " ", example).replace("...", "").split()) <= set(steps), example


def test_the_readmes_name_steps_that_exist(steps):
    for doc in ("README.md", "cuda_ext/README.md", "results/bench/README.md"):
        for name in re.findall(r"`((?:memory|model|epoch|bibtex)-[a-z0-9-]+)`", (ROOT / doc).read_text()):
            assert name in steps, f"{doc} names the step {name}"


def test_every_training_command_composes_and_validates(steps):
    from hydra import compose, initialize_config_dir

    from xmc_repro.cli import added_setting
    from xmc_repro.resources import resource_dir
    from xmc_repro.sparse.op import kernel_families
    from xmc_repro.validation import validate

    runs = _commands(steps, "xmc_repro")
    assert {"memory-graph-true", "epoch-32-true", "epoch-dense-32-true", "bibtex-rows-32-true"} <= set(runs)
    with initialize_config_dir(str(resource_dir("conf")), version_base="1.3"):
        for name, (assigned, overrides) in runs.items():
            kernels = assigned.get("XMC_SPARSE_KERNELS", "threads").replace("PHASES", "forward")
            kernel_families(kernels)  # the op reads it at registration: a bad value fails there
            assert added_setting(overrides) is None, name
            cfg = compose("config", overrides=overrides)  # an unknown setting raises here
            validate(cfg)
            assert cfg.table == "gpu_check", name


class _Parsed(Exception):
    """Raised where the benchmark would start timing: every check of its flags has passed."""


def test_every_benchmark_command_passes_the_flag_checks(steps, monkeypatch):
    import torch

    from xmc_repro import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the flags as on the GPU (--device cuda)
    monkeypatch.setattr(bench, "usable_out", lambda out: None)  # no folder made here
    monkeypatch.setattr(bench.sparse_op, "ensure_registered", lambda: (_ for _ in ()).throw(_Parsed()))
    runs = _commands(steps, "xmc_repro.bench")
    assert set(runs) == {"layer", "model", "model-rows"}
    for name, (assigned, argv) in runs.items():
        bench.sparse_op.kernel_families(assigned.get("XMC_SPARSE_KERNELS"))
        with pytest.raises(_Parsed):
            bench.main(argv)


def _mixed_epoch_choice(tmp_path, layer_log: str) -> str:
    """The setting the mixed epoch step runs after a layer step that printed `layer_log`: the script's own lines
    (from reading the layer log to the comparison with the op's default), run here; empty when it runs none."""
    text = SCRIPT.read_text()
    lines = text[text.index("  mixed=$(grep"):text.index("  [ -n \"$mixed\" ] && KERNELS=$mixed epoch")]
    (tmp_path / "layer.log").write_text(layer_log)
    script = f'LOGS={tmp_path}; DRY_RUN=0\n{lines}printf %s "$mixed"\n'
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_layer_benchmarks_choice_is_what_the_mixed_epoch_reads(tmp_path):
    """The benchmark's last line names the faster kernels per phase; the script runs the mixed epoch on them unless
    they are the op's default (that epoch ran) or threads / rows in every phase (those epochs ran too)."""
    from xmc_repro import bench
    from xmc_repro.sparse.op import ROWS_PHASES, kernel_families

    assert "fastest kernels per phase: XMC_SPARSE_KERNELS={choice}" in Path(bench.__file__).read_text()
    faster = set(ROWS_PHASES[1:])
    rows = [{"case": "c", "method": method, "phase": phase, "ms": 1.0 if (method == bench.ROWS) == (phase in faster)
             else 2.0} for method in ("uniform", bench.ROWS) for phase in ROWS_PHASES]
    vec = [{"case": "c", "method": bench.VEC[0], "phase": phase, "ms": 0.5} for phase in ("forward", "backward_weight")]
    for timed, want in ((rows, "rows:backward_input,backward_weight"),
                        (rows + vec, "rows:backward_input+vec:forward,backward_weight"),
                        (rows + vec[:1], "rows:backward_input,backward_weight+vec:forward")):
        choice = bench.kernels_choice(timed)
        assert choice == want
        kernel_families(choice)
        log = f"case ...\nfastest kernels per phase: XMC_SPARSE_KERNELS={choice}\n"
        assert _mixed_epoch_choice(tmp_path, log) == choice
    for unrun in ("rows:forward,backward_input", "rows", "threads"):  # the default's epoch, and the others', ran
        assert _mixed_epoch_choice(tmp_path, f"fastest kernels per phase: XMC_SPARSE_KERNELS={unrun}\n") == ""
    assert _mixed_epoch_choice(tmp_path, "no choice of kernels per phase: the op ran compiled-cuda-rows\n") == ""


def test_the_test_selection_and_the_build_step_exist(steps):
    text = (ROOT / "pyproject.toml").read_text()
    words = shlex.split(steps["tests"])
    assert words[:3] == ["python3", "-m", "pytest"]
    options = {w: v for w, v in zip(words[3:], words[4:]) if w in ("-m", "-p")}  # the options that take a value
    marker = options["-m"]
    assert re.search(rf'"{marker}: ', text), f"marker {marker} is not registered"
    paths = [w for i, w in enumerate(words[3:], 3) if not w.startswith("-") and words[i - 1] not in options]
    paths += re.findall(r"tests/test_\w+\.py", SCRIPT.read_text())  # the header's TESTS example
    assert paths and all((ROOT / p).exists() for p in paths), paths
    from xmc_repro.sparse import build, op

    for module, attribute in re.findall(r"\b(build|op)\.(\w+)\(", steps["build"]):
        assert hasattr({"build": build, "op": op}[module], attribute), f"{module}.{attribute}"


def test_the_scripts_parse_and_the_collector_reads_the_packed_folder():
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
    text = SCRIPT.read_text()
    for called in re.findall(r"scripts/[\w.]+\.(?:py|sh)", text):
        assert (ROOT / called).is_file(), called
    packed = Path(re.search(r"^LOGS=(\S+)$", text, re.M).group(1)).name
    assert f"logs=$tmp/{packed}\n" in (ROOT / "scripts" / "gpu_collect.sh").read_text()


def test_the_collector_copies_the_benchmark_files_a_call_changed_or_added_and_no_others(tmp_path):
    """gpu_collect.sh in a scratch repository (dvc stubbed): of the call's copy of results/bench, a file equal to
    HEAD's is left alone (a later call's copy would undo an earlier call's results), a changed one is copied, and
    so is a new one, in a new folder too and even empty (`git show HEAD:<path>` fails for those); the folder's
    README.md, which no benchmark writes, never is (the call's copy would undo edits made since it was sent)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_collect.sh").write_bytes((ROOT / "scripts" / "gpu_collect.sh").read_bytes())
    bench = repo / "results" / "bench"
    (bench / "rows-kernels").mkdir(parents=True)
    for name, text in (("same.md", "same\n"), ("changed.md", "old\n"), ("rows-kernels/sub.md", "old\n"),
                       ("README.md", "notes\n")):
        (bench / name).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "init"]):
        subprocess.run(git + args, check=True, capture_output=True)
    (bench / "same.md").write_text("collected from an earlier call\n")  # not in HEAD: the call's copy must not undo it
    (bench / "README.md").write_text("notes, edited since the call was sent\n")
    packed = tmp_path / "packed" / "xmc_gpu_logs"
    (packed / "bench" / "rows-kernels").mkdir(parents=True)
    (packed / "bench" / "new-card").mkdir()
    for name, text in (("same.md", "same\n"), ("changed.md", "new\n"), ("rows-kernels/sub.md", "new\n"),
                       ("added.md", "added\n"), ("new-card/empty.md", ""),
                       ("README.md", "notes, as the tree sent had them\n")):  # hand-written: never the call's
        (packed / "bench" / name).write_text(text)
    (packed / "layer.log").write_text("log\n")
    subprocess.run(["tar", "czf", str(tmp_path / "gpu_all.tgz"), "-C", str(tmp_path / "packed"), "xmc_gpu_logs"],
                   check=True)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "dvc").write_text("#!/bin/sh\nexit 0\n")
    (stub / "dvc").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(repo / "scripts" / "gpu_collect.sh"), str(tmp_path), "call1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (bench / "same.md").read_text() == "collected from an earlier call\n"
    assert (bench / "changed.md").read_text() == "new\n" and (bench / "rows-kernels" / "sub.md").read_text() == "new\n"
    assert (bench / "added.md").read_text() == "added\n" and (bench / "new-card" / "empty.md").read_text() == ""
    assert (bench / "call1" / "layer.log").read_text() == "log\n"
    assert (bench / "README.md").read_text() == "notes, edited since the call was sent\n"


def test_the_counters_step_launches_the_benchmarks_kernels(steps, tmp_path):
    """scripts/gpu_kernel_counters.py runs the layer benchmark's methods; ncu keeps the kernels of xmc_sparse::."""
    import importlib.util

    from xmc_repro import bench

    spec = importlib.util.spec_from_file_location("counters", ROOT / "scripts" / "gpu_kernel_counters.py")
    counters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counters)
    for method, phase, grad in counters.RUNS:
        assert method in bench.ALL + bench.ON_REQUEST and grad in ("hinge", "bce"), method
        phases = (("forward",) if method in bench.UNROLLED else ("forward", "backward_weight") if method == bench.VEC[1]
                  else ("forward", "backward_input", "backward_weight") if method == bench.VEC[0] else bench.PHASES)
        assert phase in phases, (method, phase)
    # Under ncu where the machine has one (a CUDA toolkit in /usr/local/cuda* has, maybe here too): the exact command
    # from a stand-in ncu first on PATH.
    assert steps["counters"].endswith(" python3 scripts/gpu_kernel_counters.py")
    (tmp_path / "ncu").write_text("#!/bin/sh\n")
    (tmp_path / "ncu").chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "HOME": str(tmp_path), "DRY_RUN": "1"}
    listed = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60).stdout
    profiled = next(m.group(3) for m in map(STEP.fullmatch, listed.splitlines()) if m and m.group(1) == "counters")
    assert shlex.split(profiled) == ["env", "XMC_SPARSE_KERNELS=threads", str(tmp_path / "ncu"), "--kernel-name-base",
                                     "demangled", "--kernel-name", "regex:xmc_sparse::", "--clock-control", "none",
                                     *[w for s in ("SpeedOfLight", "MemoryWorkloadAnalysis",
                                                   "MemoryWorkloadAnalysis_Tables", "WarpStateStats", "Occupancy",
                                                   "LaunchStats") for w in ("--section", s)],
                                     "python3", "scripts/gpu_kernel_counters.py"]
    for header in ("uniform_sparse_kernels.cuh", "uniform_sparse_rows_kernels.cuh"):
        assert "namespace xmc_sparse {" in (ROOT / "cuda_ext" / "cuda" / header).read_text()


def test_the_summary_keeps_the_counters_kernel_names():
    """ncu heads each kernel's sections with its demangled name, `void ` first for a template; the summary dropped
    those lines, leaving 12 blocks of counters that named no kernel, and then the vector kernels' (*_vec_kernel)."""
    pattern = re.search(r'grep -E "([^"]+)" "\$LOGS/counters.log"', SCRIPT.read_text()).group(1)
    log = ("launched: uniform-rows backward_input hinge\n"
           "  void xmc_sparse::rows::backward_input_kernel<float, 2>(const T1 *, const int *, const T1 *, T1 *, int, "
           "int, int, int) (20941, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0\n"
           "    Section: GPU Speed Of Light Throughput\n"
           "    Duration                         us        51.23\n"
           "    DRAM Frequency                  Ghz         2.62\n"
           "launched: uniform-rows-vec backward_input bce\n"
           "  void xmc_sparse::rows::backward_input_vec_kernel<float, 2>(const T1 *, const int *, const T1 *, T1 *, "
           "int, int, int, int) (20941, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0\n")
    kept = subprocess.run(["grep", "-E", pattern], input=log, capture_output=True, text=True).stdout.splitlines()
    assert [line.split()[0] for line in kept] == ["launched:", "void", "Duration", "launched:", "void"]


def test_the_summary_keeps_the_name_of_every_kernel_of_the_op():
    """Every kernel the op's headers define (the vector ones, forward_vec_kernel and backward_weight_vec_kernel,
    included) keeps its ncu header line in the summary: their counters would otherwise be left unnamed."""
    pattern = re.search(r'grep -E "([^"]+)" "\$LOGS/counters.log"', SCRIPT.read_text()).group(1)
    names = set()
    for header, space in (("uniform_sparse_kernels.cuh", "threads"), ("uniform_sparse_rows_kernels.cuh", "rows")):
        text = (ROOT / "cuda_ext" / "cuda" / header).read_text()
        names |= {f"{space}::{name}" for name in re.findall(r"__global__ .*?(\w+_kernel)\($", text, re.M)}
    assert {"rows::forward_vec_kernel", "rows::backward_weight_vec_kernel", "threads::forward_kernel"} <= names
    log = "".join(f"  void xmc_sparse::{name}<float, float>(const T1 *, int) (5236, 1, 1)x(128, 1, 1), Context 1\n"
                  for name in sorted(names))
    kept = subprocess.run(["grep", "-E", pattern], input=log, capture_output=True, text=True).stdout
    assert kept == log
