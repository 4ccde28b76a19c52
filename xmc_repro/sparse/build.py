"""Compile the C++/CUDA kernels in cuda_ext/ on first use and cache the shared library.

Why compile on first use: a pip build would run in an isolated environment with its own torch,
and the extension must match the torch that imports it. The cache directory is keyed by the
torch/CUDA/Python versions, the GPU architectures compiled for (CUDA variant) and a hash of every
source and header, so a changed kernel, a new torch or another GPU model builds afresh -- a home
directory shared by machines with different GPUs must not load a library built for another card.
Several processes (a sweep's jobs) may start together: an exclusive file lock makes one of them
compile while the others wait and then load the finished library. A failed build is
remembered (``failed.log``) so later processes do not retry it, and the caller falls back.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from xmc_repro.resources import resource_dir

SOURCES_CPU = ("ops.cpp", "cpu/uniform_sparse_cpu.cpp", "cpu/squared_hinge_cpu.cpp")
SOURCES_CUDA = ("cuda/uniform_sparse_cuda.cu", "cuda/uniform_sparse_rows_cuda.cu", "cuda/squared_hinge_cuda.cu",
                "cuda/l2_read_probe.cu")
HEADERS = ("schema.h", "checks.h", "cuda/uniform_sparse_common.cuh", "cuda/uniform_sparse_kernels.cuh",
           "cuda/uniform_sparse_rows_kernels.cuh", "cuda/squared_hinge_kernels.cuh")
NO_GPU_ARCHS = "none visible"
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
CUDA_CFLAGS = ["-O3"]


class BuildError(RuntimeError):
    """The sparse kernels could not be compiled or loaded."""


def source_dir() -> Path:
    """The kernel sources, cuda_ext/ (env XMC_CUDA_EXT_DIR overrides)."""
    env = os.environ.get("XMC_CUDA_EXT_DIR")
    return Path(env) if env else resource_dir("cuda_ext")


def cache_root() -> Path:
    env = os.environ.get("XMC_SPARSE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xmc_repro" / "sparse_ops"


def cuda_buildable() -> bool:
    """True when torch was built with CUDA and nvcc is found."""
    if torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME
    return CUDA_HOME is not None and Path(CUDA_HOME, "bin", "nvcc").exists()


def cuda_archs() -> str:
    """The GPU architectures a CUDA build targets: TORCH_CUDA_ARCH_LIST, else those of the visible GPUs
    (what torch.utils.cpp_extension compiles for when the variable is unset)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return env
    if not torch.cuda.is_available():
        return NO_GPU_ARCHS
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))


def _key(variant: str, src: Path) -> str:
    h = hashlib.sha256()
    archs = cuda_archs() if variant == "cuda" else ""  # the CPU library does not depend on the GPU
    for part in (variant, torch.__version__, str(torch.version.cuda), sys.version.split()[0],
                 " ".join(CFLAGS + LDFLAGS + CUDA_CFLAGS), archs):
        h.update(part.encode())
    for name in SOURCES_CPU + SOURCES_CUDA + HEADERS:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An OS file lock: released by the kernel even if the holder dies mid-build."""
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): builds are not serialised
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_variant(variant: str, verbose: bool) -> Path:
    src = source_dir()
    files = [src / f for f in SOURCES_CPU + (SOURCES_CUDA if variant == "cuda" else ())]
    missing = [str(src / f) for f in SOURCES_CPU + SOURCES_CUDA + HEADERS if not (src / f).exists()]
    if missing:
        raise BuildError(f"kernel sources not found: {', '.join(missing)} (set XMC_CUDA_EXT_DIR to cuda_ext/)")
    name = f"xmc_sparse_{variant}"
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        root = Path(tempfile.gettempdir()) / "xmc_repro_sparse_ops"
        root.mkdir(parents=True, exist_ok=True)
    build_dir = root / f"{name}-{_key(variant, src)}"
    build_dir.mkdir(exist_ok=True)
    library = build_dir / f"{name}.so"
    done, failed = build_dir / "ok", build_dir / "failed.log"
    if not (done.exists() or failed.exists()):  # the first use pauses ~20 s: say why
        print(f"compiling the sparse kernels ({variant}), once for this torch: ~20 s ...", file=sys.stderr, flush=True)
    with _exclusive(build_dir / ".xmc_lock"):
        if done.exists():
            torch.ops.load_library(str(library))
            return library
        if failed.exists():
            raise BuildError(f"an earlier build failed, see {failed} (delete it to retry)")
        # A build killed midway may have left torch's own lock file; we hold the real lock.
        with contextlib.suppress(FileNotFoundError):
            (build_dir / "lock").unlink()
        from torch.utils.cpp_extension import load
        try:
            # Copies: torch appends its own flags to these lists (the CUDA libraries, for a CUDA build), and a
            # CPU build after a failed CUDA one must not link them.
            load(name=name, sources=[str(f) for f in files], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                 extra_cuda_cflags=list(CUDA_CFLAGS), build_directory=str(build_dir), is_python_module=False,
                 verbose=verbose)
        except Exception as exc:  # compiler missing, compile error, ...
            failed.write_text(f"{type(exc).__name__}: {exc}\n")
            raise BuildError(f"building {name} failed: {(str(exc).splitlines() or [repr(exc)])[0]}") from exc
        done.write_text("built\n")
        return library


def load_compiled(verbose: bool = False) -> tuple[set[str], list[str]]:
    """Build (or load from the cache) the best variant that works.

    Returns the device types that have compiled kernels ({"cpu", "cuda"}, {"cpu"} or set()) and
    the errors met on the way (empty when the first choice worked).
    """
    errors: list[str] = []
    # Without a visible GPU or TORCH_CUDA_ARCH_LIST there is no architecture to compile the CUDA kernels for.
    variants = (["cuda"] if cuda_buildable() and cuda_archs() != NO_GPU_ARCHS else []) + ["cpu"]
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return set(), [f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH"]
    for variant in variants:
        try:
            _build_variant(variant, verbose)
            return ({"cpu", "cuda"} if variant == "cuda" else {"cpu"}), errors
        except Exception as exc:
            errors.append(f"{variant}: {exc}")
    return set(), errors
