"""Building the compiled op: fallback without a compiler, concurrent first use sharing one build, the CUDA
sources compiling where nvcc exists but no GPU does."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xmc_repro.sparse import build

PROBE = ("import torch, warnings; warnings.simplefilter('always');"
         "from xmc_repro.sparse import backend, uniform_sparse_linear as f;"
         "x=torch.randn(3,9); i=torch.randint(9,(2,5),dtype=torch.int32); w=torch.randn(2,5);"
         "ref=(x[:, i.long()]*w).sum(1); assert torch.allclose(f(x,i,w), ref, atol=1e-6);"
         "print(backend('cpu'))")


def _probe(tmp_path, **env):
    full = dict(os.environ, XMC_SPARSE_CACHE=str(tmp_path / "cache"), **env)
    full.pop("XMC_SPARSE_BACKEND", None)
    return subprocess.Popen([sys.executable, "-c", PROBE], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_no_compiler_falls_back_to_reference_with_one_warning(tmp_path):
    proc = _probe(tmp_path, CXX="/nonexistent/c++")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split()[-1] == "reference"
    assert err.count("compiled kernels unavailable") == 1


@pytest.mark.parametrize("variable", ["XMC_SPARSE_BACKEND", "XMC_SPARSE_KERNELS"])
def test_unknown_backend_setting_is_rejected(tmp_path, variable):
    full = dict(os.environ, **{variable: "fast"})
    proc = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"{variable}='fast'" in proc.stderr


T, R, V = "threads", "rows", "vec"
MIXED = "rows:backward_input+vec:forward,backward_weight"


@pytest.mark.parametrize("setting, families, mask, name", [
    (None, (R, R, T), 3, "rows:forward,backward_input"),  # unset: the default
    (" ", (R, R, T), 3, "rows:forward,backward_input"),
    ("Threads", (T, T, T), 0, "threads"),
    ("rows", (R, R, R), 7, "rows"),
    ("rows:backward_weight,forward, backward_input", (R, R, R), 7, "rows"),
    ("rows:backward_weight,forward", (R, T, R), 5, "rows:forward,backward_weight"),  # listed in the kernels' order
    ("rows:backward_input", (T, R, T), 2, "rows:backward_input"),
    ("rows:forward,forward", (R, T, T), 1, "rows:forward"),
    ("vec:forward", (V, T, T), 8, "vec:forward"),
    ("vec:backward_weight,forward", (V, T, V), 24, "vec:forward,backward_weight"),
    ("rows:backward_input+vec:forward,backward_weight", (V, R, V), 26, MIXED),
    ("vec:forward+rows:backward_input+vec:backward_weight", (V, R, V), 26, MIXED),
    (" VEC:forward + rows:backward_input,backward_weight ", (V, R, R), 14,
     "rows:backward_input,backward_weight+vec:forward"),
    ("vec:backward_input", (T, V, T), 32, "vec:backward_input"),
    ("vec:forward,backward_input,backward_weight", (V, V, V), 56, "vec:forward,backward_input,backward_weight"),
    ("rows:forward+vec:backward_input,backward_weight", (R, V, V), 49,
     "rows:forward+vec:backward_input,backward_weight"),
])
def test_kernels_setting_names_each_phases_kernels(setting, families, mask, name):
    """XMC_SPARSE_KERNELS -> {phase: family}, the mask the CUDA library's switch takes (1, 2, 4: rows in forward,
    input and weight backward; 8, 16, 32: vec in forward, weight and input backward), and the backend's name, which
    spells the setting out in one way."""
    from xmc_repro.sparse.op import ROWS_PHASES, cuda_backend, kernel_families, kernels_mask, kernels_setting

    got = kernel_families(setting)
    assert list(got.items()) == list(zip(ROWS_PHASES, families))
    assert kernels_mask(got) == mask
    assert kernels_setting(got) == name and kernel_families(name) == got
    assert cuda_backend(got) == ("compiled-cuda" if name == "threads" else f"compiled-cuda-{name}")


def test_the_default_kernels_and_the_backend_names_of_the_settings_before_vec():
    """The op's default is unchanged (the vector kernels are not yet timed), and so are the names runs recorded."""
    from xmc_repro.sparse.op import DEFAULT_KERNELS, cuda_backend, kernel_families

    assert kernel_families(None) == kernel_families(DEFAULT_KERNELS) == kernel_families("rows:forward,backward_input")
    for setting, name in ((None, "compiled-cuda-rows:forward,backward_input"), ("threads", "compiled-cuda"),
                          ("rows", "compiled-cuda-rows"), ("rows:forward", "compiled-cuda-rows:forward")):
        assert cuda_backend(kernel_families(setting)) == name


FORMS = (r"must be threads, rows, or rows:<phases> and/or vec:<phases> joined by \+ \(phases: a comma list of "
         r"forward, backward_input, backward_weight\), e.g. rows:backward_input\+vec:forward$")


@pytest.mark.parametrize("bad, message", [
    ("rows:", FORMS), ("rows:fwd", FORMS), ("forward", FORMS), ("rows:forward,,backward_input", FORMS),
    ("vec", FORMS), ("threads:forward", FORMS), ("rows+vec:forward", FORMS), ("rows:forward+", FORMS),
    ("fast", FORMS), ("vec:forward;rows:backward_input", FORMS),
    ("rows:backward_input+vec:backward_input,forward", r" names backward_input for both rows and vec: one family"),
    ("rows:forward+vec:forward", r" names forward for both rows and vec: one family per phase$"),
    ("vec:backward_weight+rows:backward_weight", r" names backward_weight for both vec and rows: one family"),
])
def test_a_bad_kernels_setting_is_refused_in_one_line(bad, message):
    from xmc_repro.sparse.checks import SparseInputError
    from xmc_repro.sparse.op import kernel_families

    with pytest.raises(SparseInputError) as info:
        kernel_families(bad)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"XMC_SPARSE_KERNELS={bad!r}")
    assert re.search(message, text), text


def test_a_family_without_a_phases_kernel_is_refused(monkeypatch):
    """Both families have a kernel in every phase; a family that lacks one (as vec once lacked the input backward)
    is refused by name, with the phases it has."""
    from xmc_repro.sparse import op
    from xmc_repro.sparse.checks import SparseInputError

    assert {phase for family, phase in op.KERNEL_BITS if family == "vec"} == set(op.ROWS_PHASES)
    monkeypatch.delitem(op.KERNEL_BITS, ("vec", "backward_input"))
    with pytest.raises(SparseInputError, match=r"^XMC_SPARSE_KERNELS='rows:forward\+vec:backward_input': vec has no "
                       r"backward_input kernel \(it has forward, backward_weight\)$"):
        op.kernel_families("rows:forward+vec:backward_input")


@pytest.mark.slow
def test_concurrent_first_use_shares_one_build(tmp_path):
    procs = [_probe(tmp_path) for _ in range(3)]
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out.split()[-1] == "compiled-cpu"
    builds = list((tmp_path / "cache").glob("xmc_sparse_cpu-*"))
    assert len(builds) == 1 and (builds[0] / "ok").exists()


def test_cache_key_names_the_gpu_architecture(monkeypatch):
    """A home directory shared by machines with different GPUs keeps one CUDA library per architecture."""
    src = build.source_dir()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    keys = {}
    for cap in ((8, 0), (9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0, cap=cap: cap)
        keys[cap] = (build._key("cuda", src), build._key("cpu", src))
        assert build.cuda_archs() == f"{cap[0]}.{cap[1]}"
    assert keys[(8, 0)][0] != keys[(9, 0)][0]  # CUDA variant: one build per GPU model
    assert keys[(8, 0)][1] == keys[(9, 0)][1]  # the CPU variant does not depend on the GPU
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")  # an explicit list is what gets compiled
    assert build.cuda_archs() == "8.0;9.0" and build._key("cuda", src) not in (keys[(8, 0)][0], keys[(9, 0)][0])


def test_a_cpu_build_after_a_failed_cuda_build_links_no_cuda_library(tmp_path, monkeypatch):
    """torch's `load` appends the CUDA libraries to the flag lists it is given: a CPU build that followed a failed
    CUDA one on the same lists failed to link (-lcudart) on a machine with a CUDA torch and nvcc but no GPU."""
    calls = []

    def fake_load(name, extra_ldflags, **kwargs):
        calls.append((name, list(extra_ldflags)))
        extra_ldflags += ["-lc10_cuda", "-lcudart"]  # what torch does to the list
        if name == "xmc_sparse_cuda":
            raise RuntimeError("nvcc failed")

    import torch.utils.cpp_extension
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    monkeypatch.setenv("XMC_SPARSE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(build, "cuda_buildable", lambda: True)
    compiled, errors = build.load_compiled()
    assert compiled == {"cpu"} and errors == ["cuda: building xmc_sparse_cuda failed: nvcc failed"]
    assert calls == [("xmc_sparse_cuda", build.LDFLAGS), ("xmc_sparse_cpu", build.LDFLAGS)]
    assert build.LDFLAGS == ["-fopenmp"]


def test_no_cuda_build_without_a_gpu_or_an_architecture_list(monkeypatch):
    """Nothing to compile the CUDA kernels for: the CPU library is built straight away (torch's own arch detection
    failed with 'list index out of range')."""
    built = []
    monkeypatch.setattr(build, "_build_variant", lambda variant, verbose: built.append(variant))
    monkeypatch.setattr(build, "cuda_buildable", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert build.load_compiled() == ({"cpu"}, []) and built == ["cpu"]


def test_cache_key_covers_headers(tmp_path, monkeypatch):
    copy = tmp_path / "cuda_ext"
    shutil.copytree(build.source_dir(), copy)
    before = build._key("cpu", copy)
    (copy / "checks.h").write_text((copy / "checks.h").read_text() + "\n// changed\n")
    assert build._key("cpu", copy) != before


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_the_cuda_sources_compile_without_a_gpu():
    script = Path(__file__).resolve().parents[1] / "scripts" / "cuda_compile_check.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for source in build.SOURCES_CUDA:
        assert f"{Path(source).name}: compiled" in result.stdout
    for kernel in ("rows::forward_kernel<float, Bf16, 1>", "rows::forward_vec_kernel<float, Bf16>",
                   "rows::backward_weight_vec_kernel<float, Bf16>", "rows::backward_input_vec_kernel<float, 2>"):
        assert kernel in result.stdout, kernel
