"""A built wheel carries conf/ and cuda_ext/: `pip install .` (not only `-e .`) runs the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_runs_the_cli_from_anywhere(tmp_path):
    pytest.importorskip("setuptools", reason="building a wheel without network needs setuptools installed")
    source = tmp_path / "src"  # a copy: setuptools writes build/ into the project it builds
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("xmc_repro", "conf", "cuda_ext"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("xmc_repro-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for source in ("conf/config.yaml", "conf/dataset/amazon670k_slice.yaml", "cuda_ext/cuda/uniform_sparse_cuda.cu"):
        assert f"xmc_repro/_resources/{source}" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    script = ("import xmc_repro.resources as r; from xmc_repro.sparse.build import source_dir; "
              "print(r.resource_dir('conf')); print(source_dir())")
    where = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.split()
    assert where == [str(site / "xmc_repro" / "_resources" / "conf"), str(site / "xmc_repro" / "_resources" / "cuda_ext")]
    job = subprocess.run([sys.executable, "-m", "xmc_repro", "--cfg", "job", "dataset=amazon670k_slice",
                          "model=uniform", "model.intermediate=32768"], env=env, cwd=tmp_path, capture_output=True,
                         text=True)
    assert job.returncode == 0, job.stderr[-2000:]
    assert "name: Amazon-670K" in job.stdout and "intermediate: 32768" in job.stdout
