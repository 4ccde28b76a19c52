"""Compile the CUDA kernel sources with nvcc on a machine without a GPU (or without a CUDA build of torch), and
print each kernel's registers, stack and spills: a CUDA change is checked before a GPU call builds it.

    python scripts/cuda_compile_check.py [--arch 90] [--jobs 2]

The objects are not linked or kept, but the project's symbols one of them uses must be defined by another. A CPU
build of torch ships the CUDA headers except one generated file (c10/cuda/impl/cuda_cmake_macros.h), which is
written to a temporary folder here. Exit status 1 when a file fails or a symbol is missing.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.utils.cpp_extension as cpp_extension

from xmc_repro.sparse import build


def nvcc_command(source: Path, obj: Path, arch: str, includes: list[str]) -> list[str]:
    # C++17, the older of the standards torch builds extensions with (this torch: C++20): what compiles here
    # compiles under either
    flags = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "--resource-usage", "-D_GLIBCXX_USE_CXX11_ABI=1",
             f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    return ["nvcc", "-c", str(source), "-o", str(obj), *flags, *(f"-I{p}" for p in includes)]


def unresolved(objects: list[Path]) -> set[str]:
    """The project's symbols (xmc_sparse::, xmc_bench::) that an object uses and no object defines."""
    def symbols(option: str) -> set[str]:
        out = subprocess.run(["nm", "-C", option, *map(str, objects)], capture_output=True, text=True).stdout
        return {m.group(1) for line in out.splitlines()
                if (m := re.match(r"^\s*(?:[0-9a-f]+\s+)?[A-Za-z]\s+(xmc_(?:sparse|bench)::.*)$", line))}
    return symbols("--undefined-only") - symbols("--defined-only")


def kernel_usage(ptxas_output: str) -> list[str]:
    """One line per kernel: its name with template arguments, registers, stack and spill bytes."""
    lines, name = [], None
    for line in ptxas_output.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = demangle(m.group(1))
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line):
            stack, spills = m.groups()
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            lines.append(f"  {name:58s} {m.group(1):>3s} registers, stack {stack} B, spills {spills} B")
            name = None
    return lines


def demangle(symbol: str) -> str:
    """``[namespace::]kernel<args>`` from a mangled kernel symbol (the symbol itself without c++filt)."""
    if shutil.which("c++filt") is None:
        return symbol
    full = subprocess.run(["c++filt", symbol], capture_output=True, text=True).stdout.strip()
    m = re.search(r"((?:\w+::)*\w+(?:<[^()]*>)?)\(", full)
    return (m.group(1) if m else full).replace("xmc_sparse::", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90", help="compute capability without the dot (default 90: H100/H200)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("nvcc is not on PATH: install the CUDA toolkit (or run on the GPU machine)", file=sys.stderr)
        return 1
    src = build.source_dir()
    with tempfile.TemporaryDirectory() as work:
        includes = cpp_extension.include_paths()
        macros = Path(includes[0], "c10/cuda/impl/cuda_cmake_macros.h")
        if not macros.exists():
            (Path(work) / "c10/cuda/impl").mkdir(parents=True)
            (Path(work) / "c10/cuda/impl/cuda_cmake_macros.h").write_text("#pragma once\n")
            includes = [work, *includes]
        sources = [src / name for name in build.SOURCES_CUDA]
        objects = [Path(work) / f"{s.stem}.o" for s in sources]
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda so: subprocess.run(nvcc_command(*so, args.arch, includes),
                                                              capture_output=True, text=True), zip(sources, objects)))
        missing = unresolved([o for o in objects if o.exists()]) if shutil.which("nm") else set()
    failed = len(missing)
    for symbol in sorted(missing):
        print(f"used but defined by no CUDA source: {symbol}")
    for source, result in zip(sources, results):
        if result.returncode:
            failed += 1
            errors = [line for line in result.stderr.splitlines() if "error" in line]
            print(f"{source.name}: FAILED\n" + "\n".join(errors or result.stderr.splitlines()[-20:]))
        else:
            print(f"{source.name}: compiled for sm_{args.arch}\n" + "\n".join(kernel_usage(result.stderr)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
