"""Building the compiled op: fallback without a compiler, concurrent first use sharing one build."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def test_unknown_backend_setting_is_rejected(tmp_path):
    full = dict(os.environ, XMC_SPARSE_BACKEND="fast")
    proc = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "XMC_SPARSE_BACKEND='fast'" in proc.stderr


@pytest.mark.slow
def test_concurrent_first_use_shares_one_build(tmp_path):
    procs = [_probe(tmp_path) for _ in range(3)]
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out.split()[-1] == "compiled-cpu"
    builds = list((tmp_path / "cache").glob("xmc_sparse_cpu-*"))
    assert len(builds) == 1 and (builds[0] / "ok").exists()
