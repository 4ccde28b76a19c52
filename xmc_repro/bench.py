"""Benchmark of the sparse last layer: ``python -m xmc_repro.bench [--full] [--device cuda] [--out results/bench]``.

``--model`` benchmarks the whole model's training step instead (``xmc_repro/bench_model.py``).

For each shape (labels, inputs, connectivity, batch) and output-gradient kind (``hinge``: about 1 %
nonzero, as squared hinge leaves them; ``bce``: dense) it times forward, backward-input,
backward-weight, forward+both backward, and a whole step with Adam (through autograd: our op, COO,
dense; the input's gradient too, as after an intermediate layer), for: our compiled op, the pure-torch
reference kernels, torch CSR (cuSPARSE forward, ``sampled_addmm`` weight gradient), torch COO with
autograd, and a dense ``nn.Linear``. Each time
is also given as a multiple of its bandwidth
floor: the bytes that must move (indices, weights, inputs and gradients read once, results written
once; for hinge gradients only the labels with a nonzero gradient need their indices/weights)
over the device's measured copy bandwidth. Peak memory is what a phase allocates beyond its inputs.

The uniform layer's gathers are served from L2, not DRAM: every (batch row, connection, label) product reads
its own input value. Its second floor, ``L2 floor``, is those gathered bytes (and the input gradient's atomic
adds) over the L2 read bandwidth measured by a purpose-built kernel (``l2_bandwidth``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import warnings

import torch

from xmc_repro.errors import ConfigError, StorageError
from xmc_repro.optim import adam
from xmc_repro.sparse import op as sparse_op
from xmc_repro.sparse import reference
from xmc_repro.sparse.checks import SparseInputError
from xmc_repro.sparse.rewire import redraw_sources

PHASES = ("forward", "backward_input", "backward_weight", "fwd+bwd", "step+adam")
GIB = 2**30


@dataclass(frozen=True)
class Case:
    labels: int
    inputs: int
    connectivity: int
    batch: int
    grad: str  # "hinge" (about 1 % nonzero) or "bce" (dense)
    methods: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"L={self.labels} in={self.inputs} c={self.connectivity} B={self.batch} grad={self.grad}"


ALL = ("uniform", "reference", "csr", "coo", "dense")
# Not in ALL (CUDA only, on request): our op with bf16 inputs, as bf16-mixed training hands them to it, and the
# warp-per-label kernels (xmc_bench::rows_*, cuda_ext/cuda/uniform_sparse_rows_cuda.cu) with float32 and bf16
# inputs, in every phase.
BF16, ROWS, ROWS_BF16 = "uniform-bf16", "uniform-rows", "uniform-rows-bf16"
# The warp-per-label forward with 2 or 4 connections' gathers issued before their sums (forward only): whether
# more gathers in flight speed it up (cuda_ext/README.md)
UNROLLED = ("uniform-rows-unroll2", "uniform-rows-unroll4")
# The warp-per-label kernels with 8 lanes per label and 4 batch values per lane: forward and weight gradient gather
# them in one vector load (float32 and bf16 inputs), fewer instructions per gathered value; the input gradient adds
# them with one vector atomic on sm_90+ (float32 method only: it reads no inputs, bf16 would time it again)
VEC = ("uniform-rows-vec", "uniform-rows-vec-bf16")
ON_REQUEST = (BF16, ROWS, ROWS_BF16, *UNROLLED, *VEC)


def paper_cases() -> list[Case]:
    """The paper's shapes, ordered so the headline case runs first."""
    cases = []
    for grad in ("hinge", "bce"):
        cases.append(Case(670091, 16384, 32, 32, grad, ALL))
    for grad in ("hinge", "bce"):
        cases.append(Case(670091, 16384, 32, 256, grad, ("uniform", "csr", "dense")))
    cases += [Case(670091, 65536, 64, 32, "hinge", ("uniform", "csr", "coo")),
              Case(670091, 65536, 64, 256, "hinge", ("uniform", "csr")),
              Case(501070, 32768, 32, 32, "hinge", ("uniform", "csr", "dense")),
              Case(501070, 32768, 64, 256, "bce", ("uniform", "csr")),
              Case(30938, 16384, 32, 32, "hinge", ALL),
              Case(30938, 16384, 32, 32, "bce", ("uniform", "csr"))]
    return cases


def cpu_cases() -> list[Case]:
    """A small set that runs in a few minutes on two CPU cores."""
    return [Case(30938, 4096, 32, 32, "hinge", ALL),
            Case(30938, 4096, 32, 32, "bce", ("uniform", "reference", "csr", "dense")),
            Case(100000, 16384, 32, 32, "hinge", ("uniform", "csr")),
            Case(30938, 16384, 64, 128, "hinge", ("uniform", "csr"))]


# ---------------------------------------------------------------- timing and bandwidth


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def extra_peak_gib(fn, device) -> float | None:
    """Memory a call allocates beyond what is already allocated (GiB); None off-GPU."""
    if device.type != "cuda":
        return None
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / GIB


def copy_bandwidth(device) -> float:
    """Measured device copy bandwidth in bytes/s (bytes read + bytes written)."""
    n = (256 << 20) // 4 if device.type == "cuda" else (64 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, repeats=10)
    return 2 * 4 * n / (ms / 1e3)


L2_PROBE_BYTES = 8 << 20  # well under the L2 of an H100/H200 (50 MB)


def l2_bandwidth(device) -> float | None:
    """Read bandwidth (bytes/s) of data that stays in L2, by the purpose-built kernel ``xmc_bench::l2_read``
    (cuda_ext/cuda/l2_read_probe.cu: every block reads one 8 MiB buffer through L2, bypassing L1, in one long
    launch). None on a CPU or without the compiled CUDA kernels. A buffer of ones checks that every load ran."""
    if device.type != "cuda" or not sparse_op.backend("cuda").startswith("compiled-cuda"):
        return None
    probe = torch.ops.xmc_bench.l2_read
    ones = torch.ones(L2_PROBE_BYTES // 4, device=device)
    out = probe(ones, 1)
    per_thread = ones.numel() / out.shape[1]
    if not torch.all(out == per_thread):
        raise RuntimeError(f"l2_read summed {out.min().item()}..{out.max().item()} per thread, not {per_thread}")
    return out.shape[0] * L2_PROBE_BYTES / (time_ms(lambda: probe(ones, 1), device, warmup=3, repeats=10) / 1e3)


def l2_bytes(case: Case, active: float, input_bytes: int = 4) -> dict[str, float]:
    """Bytes the uniform layer's kernels exchange with L2 beyond ``floor_bytes``: one input value per (batch row,
    connection, label) product gathered in the forward and the weight gradient (``input_bytes`` each), and one
    float32 atomically added in the input gradient (only labels with a nonzero gradient in the backward)."""
    products = case.batch * case.connectivity * case.labels
    fwd, bwd_in, bwd_w = products * input_bytes, active * products * 4, active * products * input_bytes
    return {"forward": fwd, "backward_input": bwd_in, "backward_weight": bwd_w, "fwd+bwd": fwd + bwd_in + bwd_w,
            "step+adam": fwd + bwd_in + bwd_w}


def floor_bytes(case: Case, active: float) -> dict[str, float]:
    """Bytes each phase of the uniform layer must move; ``active`` = fraction of labels with any
    nonzero gradient (only those need their indices and weights in the backward)."""
    f = 4.0
    c, L, B, n = case.connectivity, case.labels, case.batch, case.inputs
    slots = c * L * f  # one (connectivity, labels) array
    grads, x = B * L * f, B * n * f
    fwd = 2 * slots + x + B * L * f + L * f
    bwd_in = grads + active * 2 * slots + x
    bwd_w = grads + active * slots + x + slots + L * f  # and the bias gradient
    adam = 7 * slots
    return {"forward": fwd, "backward_input": bwd_in, "backward_weight": bwd_w,
            "fwd+bwd": fwd + bwd_in + bwd_w, "step+adam": fwd + bwd_in + bwd_w + adam}


# ---------------------------------------------------------------- the methods


def _adam(params, device):
    return adam(params, lr=1e-3, eps=1e-8, placement="torch", device=device)  # torch's Adam, fused as the model's


def _step(loss_fn, opt, grad, x):
    """One training step of the layer as it sits after an intermediate layer: ``x`` requires its gradient too
    (left in ``run.x.grad``)."""
    def run():
        opt.zero_grad(set_to_none=False)
        x.grad = None
        loss_fn().backward(grad)
        opt.step()
    run.x = x
    return run


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an input whose gradient autograd computes (an intermediate layer's output)."""
    return x.detach().clone().requires_grad_()


def _csr_pair(rows, cols, values, shape):
    """W and W^T as torch CSR tensors (through COO, which sorts the entries)."""
    coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), values, shape, check_invariants=False).coalesce()
    with warnings.catch_warnings():  # torch warns that CSR support is "beta" on first use
        warnings.simplefilter("ignore")
        return coo.to_sparse_csr(), coo.t().coalesce().to_sparse_csr()


def build_method(name: str, case: Case, p: dict, device) -> dict:
    """Callables per phase for one method, or {"skip": reason}."""
    sparse_op.ensure_registered()  # torch.ops.xmc_sparse / xmc_bench exist only from here on
    x, idx, w, b, g = p["x"], p["idx"], p["w"], p["b"], p["g"]
    wp, bp = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    if name in UNROLLED:
        unrolled = getattr(torch.ops.xmc_bench, "rows_forward_" + name.rsplit("-", 1)[1])
        return {"forward": lambda: unrolled(x, idx, w, b)}
    if name in VEC:
        xin = x.bfloat16() if name.endswith("bf16") else x
        phases = {"forward": lambda: torch.ops.xmc_bench.rows_forward_vec(xin, idx, w, b),
                  "backward_weight": lambda: torch.ops.xmc_bench.rows_backward_weight_vec(g, xin, idx)}
        if name == VEC[0]:
            phases["backward_input"] = lambda: torch.ops.xmc_bench.rows_backward_input_vec(g, idx, w, case.inputs)
        return phases
    if name in ON_REQUEST:
        xin = x.bfloat16() if name.endswith("bf16") else x
        ops, prefix = (torch.ops.xmc_sparse, "") if name == BF16 else (torch.ops.xmc_bench, "rows_")
        fwd_op, bwd_in_op, bwd_w_op = (getattr(ops, prefix + op) for op in
                                       ("forward", "backward_input", "backward_weight"))
        fwd = lambda: fwd_op(xin, idx, w, b)  # noqa: E731
        bwd_in = lambda: bwd_in_op(g, idx, w, case.inputs)  # noqa: E731
        bwd_w = lambda: bwd_w_op(g, xin, idx)  # noqa: E731
        phases = {"forward": fwd, "backward_input": bwd_in, "backward_weight": bwd_w,  # with the bias gradient
                  "fwd+bwd": lambda: (fwd(), bwd_in(), bwd_w())}
        if name == BF16:  # the candidates have no autograd path
            xg = _leaf(xin)
            layer = lambda: sparse_op.uniform_sparse_linear(xg, idx, wp, bp)  # noqa: E731
            phases["step+adam"] = _step(layer, _adam([wp, bp], device), g, xg)
        return phases
    if name in ("uniform", "reference"):
        # The same three kernels, compiled or pure torch; only the compiled op is timed through autograd
        # (the package's one backward), the reference's step being its fwd+bwd plus Adam.
        kernels = torch.ops.xmc_sparse if name == "uniform" else reference
        fwd = lambda: kernels.forward(x, idx, w, b)  # noqa: E731
        bwd_in = lambda: kernels.backward_input(g, idx, w, case.inputs)  # noqa: E731
        bwd_w = lambda: kernels.backward_weight(g, x, idx)  # noqa: E731
        phases = {"forward": fwd, "backward_input": bwd_in, "backward_weight": bwd_w,  # with the bias gradient
                  "fwd+bwd": lambda: (fwd(), bwd_in(), bwd_w())}
        if name == "uniform":
            xg = _leaf(x)
            layer = lambda: sparse_op.uniform_sparse_linear(xg, idx, wp, bp)  # noqa: E731
            phases["step+adam"] = _step(layer, _adam([wp, bp], device), g, xg)
        return phases
    rows = torch.arange(case.labels, device=device).repeat(case.connectivity)
    cols = idx.reshape(-1).long()
    if name == "csr":  # torch's own CSR kernels on the same connections (no autograd path: no step)
        mat, mat_t = _csr_pair(rows, cols, w.reshape(-1), (case.labels, case.inputs))
        gt = g.t().contiguous()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pattern = torch.sparse_csr_tensor(mat.crow_indices(), mat.col_indices(), torch.zeros_like(mat.values()),
                                              mat.shape)
        fwd = lambda: (mat @ x.t()).t() + b  # noqa: E731
        bwd_in = lambda: (mat_t @ gt).t()  # noqa: E731
        bwd_w = lambda: torch.sparse.sampled_addmm(pattern, gt, x, beta=0.0)  # noqa: E731
        return {"forward": fwd, "backward_input": bwd_in, "backward_weight": bwd_w,
                "fwd+bwd": lambda: (fwd(), bwd_in(), bwd_w(), g.sum(0))}
    if name == "coo":
        # autograd through torch.sparse.mm forms the dense (labels, inputs) weight gradient
        need = case.labels * case.inputs * 4 * 1.1
        if device.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(device)[0]:
            return {"skip": f"needs about {need / GIB:.0f} GiB (dense weight gradient)"}
        if device.type == "cpu" and need > 4 * GIB:
            return {"skip": f"needs about {need / GIB:.0f} GiB (dense weight gradient)"}
        flat = rows * case.inputs + cols
        order = torch.argsort(flat)
        coo_idx = torch.stack([rows[order], cols[order]])
        vp = torch.nn.Parameter(w.reshape(-1)[order].clone())
        xg = _leaf(x)

        def layer():
            mat = torch.sparse_coo_tensor(coo_idx, vp, (case.labels, case.inputs), is_coalesced=True,
                                          check_invariants=False)
            return torch.sparse.mm(mat, xg.t()).t() + bp

        def fwd_bwd():
            xg.grad = None
            layer().backward(g)

        return {"forward": lambda: layer().detach(), "fwd+bwd": fwd_bwd,
                "step+adam": _step(layer, _adam([vp, bp], device), g, xg)}
    if name == "dense":
        inputs = case.inputs
        if case.labels * inputs * 4 * 5 > (0.7 * torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
                                           else 2 * GIB):
            inputs = 768  # the paper's dense reference: a 768-d input
        lin = torch.nn.Linear(inputs, case.labels, device=device)
        xd = torch.randn(case.batch, inputs, device=device)
        xg = _leaf(xd)
        wd = lin.weight.detach()
        fwd = lambda: torch.nn.functional.linear(xd, wd, lin.bias.detach())  # noqa: E731
        bwd_in = lambda: g @ wd  # noqa: E731
        bwd_w = lambda: g.t() @ xd  # noqa: E731
        return {"forward": fwd, "backward_input": bwd_in, "backward_weight": bwd_w,
                "fwd+bwd": lambda: (fwd(), bwd_in(), bwd_w(), g.sum(0)),
                "step+adam": _step(lambda: lin(xg), _adam(list(lin.parameters()), device), g, xg),
                "label": f"dense nn.Linear({inputs}, {case.labels})", "dense_inputs": inputs}
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL + ON_REQUEST)}")


def make_problem(case: Case, device, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.zeros(case.connectivity, case.labels, dtype=torch.int64, device=device)
    idx = redraw_sources(idx, torch.ones_like(idx, dtype=torch.bool), case.inputs, gen).int().contiguous()
    dev_gen = torch.Generator(device).manual_seed(seed)  # draw the big tensors where they live
    x = torch.randn(case.batch, case.inputs, generator=dev_gen, device=device)
    w = torch.randn(case.connectivity, case.labels, generator=dev_gen, device=device) / case.connectivity ** 0.5
    b = torch.zeros(case.labels, device=device)
    g = torch.randn(case.batch, case.labels, generator=dev_gen, device=device)
    if case.grad == "hinge":
        g *= torch.rand(case.batch, case.labels, generator=dev_gen, device=device) < 0.01
    return {"x": x, "idx": idx, "w": w, "b": b, "g": g.contiguous()}


# ---------------------------------------------------------------- running and reporting


def run_case(case: Case, device, bandwidth: float, warmup: int, repeats: int, methods: set[str] | None,
             l2: float | None = None) -> list[dict]:
    p = make_problem(case, device)
    active = float((p["g"] != 0).any(0).float().mean())
    floors = floor_bytes(case, active)
    gathers = {name: l2_bytes(case, active, input_bytes=2 if name.endswith("bf16") else 4)
               for name in ("uniform",) + ON_REQUEST}
    rows = []
    extra = tuple(m for m in ON_REQUEST if methods and m in methods and device.type == "cuda")
    for name in case.methods + extra:
        if methods and name not in methods:
            continue
        base = {"case": case.name, **{k: getattr(case, k) for k in ("labels", "inputs", "connectivity", "batch", "grad")},
                "grad_nonzero": float((p["g"] != 0).float().mean()), "labels_active": active, "method": name}
        try:
            phases = build_method(name, case, p, device)
        except torch.OutOfMemoryError:
            phases = {"skip": "out of memory while building"}
        if "skip" in phases:
            rows.append({**base, "phase": "all", "note": phases["skip"]})
            continue
        label = phases.pop("label", name)
        dense_inputs = phases.pop("dense_inputs", None)
        for phase in PHASES:
            if phase not in phases:
                continue
            row = {**base, "method": label, "phase": phase}
            try:
                reps = repeats if name != "reference" else max(2, repeats // 4)
                row["ms"] = time_ms(phases[phase], device, warmup=min(warmup, 2 if name == "reference" else warmup),
                                    repeats=reps)
                row["extra_peak_gib"] = extra_peak_gib(phases[phase], device)
            except torch.OutOfMemoryError as exc:
                row["note"] = "out of memory: " + str(exc).split("\n")[0][:120]
                torch.cuda.empty_cache()
            if dense_inputs is None:
                row["floor_ms"] = floors[phase] / bandwidth * 1e3
                if l2 and name in gathers:
                    row["l2_floor_ms"] = gathers[name][phase] / l2 * 1e3
            else:  # the dense layer's own floor: its weight (and Adam state) once
                nbytes = 4 * case.labels * dense_inputs
                per = {"forward": 1, "backward_input": 1, "backward_weight": 1, "fwd+bwd": 3, "step+adam": 10}[phase]
                row["floor_ms"] = per * nbytes / bandwidth * 1e3
            if "ms" in row:
                row["x_floor"] = row["ms"] / row["floor_ms"]
                if "l2_floor_ms" in row:
                    row["x_l2_floor"] = row["ms"] / row["l2_floor_ms"]
            rows.append(row)
        del phases
    del p
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def machine_info(device, bandwidth: float, l2: float | None = None) -> dict:
    from xmc_repro.tracking import git_commit  # the code measured ("-dirty" with uncommitted changes)

    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "host_cpu": platform.processor() or
            platform.machine(), "cpu_threads": torch.get_num_threads(), "device": device.type,
            "copy_bandwidth_gb_s": bandwidth / 1e9, "l2_bandwidth_gb_s": l2 / 1e9 if l2 else None,
            "sparse_backend": sparse_op.backend(device)}
    if device.type == "cuda":
        info["card"] = torch.cuda.get_device_name(device)
    else:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    info["host_cpu"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        if hasattr(os, "getloadavg"):  # a shared CPU's timings depend on its other work
            info["load_average_1min"] = round(os.getloadavg()[0], 2)
    return info


def replaced(json_path: Path) -> str:
    """' (replacing the results of <date>, commit <c>)' when `json_path` holds earlier results, else ''."""
    try:
        earlier = json.loads(json_path.read_text(encoding="utf-8")).get("machine", {})
    except (OSError, ValueError, AttributeError):
        return " (replacing a file that is not readable results)" if json_path.exists() else ""
    return f" (replacing the results of {earlier.get('date', '?')}, commit {earlier.get('commit', '?')})"


def slug(info: dict) -> str:
    """File name stem of a machine's results: the card's name, or "cpu"."""
    return "".join(ch if ch.isalnum() else "-" for ch in info.get("card", "cpu").lower()).strip("-")


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def markdown(info: dict, rows: list[dict]) -> str:
    where = info.get("card") or f"CPU: {info['host_cpu']} ({info['cpu_threads']} threads)"
    lines = [f"# Sparse layer benchmark — {where}", "",
             f"commit `{info.get('commit', 'unknown')}`, torch {info['torch']} (CUDA {info['cuda']}), sparse backend "
             f"`{info['sparse_backend']}`, measured copy bandwidth {info['copy_bandwidth_gb_s']:.0f} GB/s"
             + (f", L2 read bandwidth {info['l2_bandwidth_gb_s']:.0f} GB/s" if info.get("l2_bandwidth_gb_s") else "")
             + f", {info['date']}"
             + (f", load average {info['load_average_1min']} before the run" if "load_average_1min" in info else "")
             + ".", "",
             "Times are medians in ms; `x floor` = time / (bytes that must move / copy bandwidth); `x L2` = time / "
             "(bytes gathered from L2 / L2 read bandwidth), for our op; "
             "`extra GiB` = peak memory allocated beyond the inputs (GPU only). "
             "`hinge` gradients: about 1 % nonzero; `bce`: dense.", ""]
    case = None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            lines += ["", f"## {case}  (labels with a nonzero gradient: {r['labels_active']:.1%})", "",
                      "| method | phase | ms | floor ms | x floor | L2 floor ms | x L2 | extra GiB | note |",
                      "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        lines.append(f"| {r['method']} | {r['phase']} | {_fmt(r.get('ms'), '.3f')} | {_fmt(r.get('floor_ms'), '.3f')} | "
                     f"{_fmt(r.get('x_floor'), '.1f')} | {_fmt(r.get('l2_floor_ms'), '.3f')} | "
                     f"{_fmt(r.get('x_l2_floor'), '.1f')} | {_fmt(r.get('extra_peak_gib'), '.2f')} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """The few numbers the targets are about, as a plain table."""
    out = [f"{'case':58s} {'method':28s} {'fwd+bwd ms':>10s} {'x floor':>8s} {'x L2':>6s} {'step ms':>9s}"]
    by = {}
    for r in rows:
        if "ms" in r and r["phase"] in ("fwd+bwd", "step+adam"):
            by.setdefault((r["case"], r["method"]), {})[r["phase"]] = r
    for (case, method), ph in by.items():
        fb, st = ph.get("fwd+bwd", {}), ph.get("step+adam", {})
        out.append(f"{case:58s} {method:28s} {_fmt(fb.get('ms'), '10.3f'):>10s} {_fmt(fb.get('x_floor'), '8.1f'):>8s} "
                   f"{_fmt(fb.get('x_l2_floor'), '6.1f'):>6s} {_fmt(st.get('ms'), '9.3f'):>9s}")
    return "\n".join(out)


# The methods that time each kernel family beside the op's thread-per-label kernels (`uniform`), float32 inputs
CANDIDATES = {ROWS: "rows", VEC[0]: "vec"}


def kernels_choice(rows: list[dict], op: str = "uniform") -> str | None:
    """The `XMC_SPARSE_KERNELS` value that runs each phase on whichever kernels took least time in `rows`: `op` (a
    thread per label) or a method of `CANDIDATES` (in each phase it timed), summed per phase over the cases that
    timed `op` and every candidate timed beside it; None when no case timed a candidate beside `op`. A tie keeps the
    thread-per-label kernels."""
    times = {(r["case"], r["method"], r["phase"]): r["ms"] for r in rows if "ms" in r}
    families, compared = {}, False
    for phase in sparse_op.ROWS_PHASES:
        cases = {case for case, method, p in times if method == op and p == phase}
        methods = [m for m in CANDIDATES if any((case, m, phase) in times for case in cases)]
        cases = {case for case in cases if all((case, m, phase) in times for m in methods)}
        if not methods or not cases:
            continue
        compared = True
        totals = {m: sum(times[case, m, phase] for case in cases) for m in (op, *methods)}
        families[phase] = CANDIDATES.get(min(totals, key=totals.get), "threads")  # min: the first of equals
    return sparse_op.kernels_setting(families) if compared else None


def _positive(kind, zero: bool = False, finite: bool = True):
    """argparse type: a finite number > 0 (0 would time nothing, or silently mean the default; infinity overflows
    the shapes), or >= 0 with ``zero``."""
    def parse(text: str):
        value = kind(text)
        if not (value >= 0 if zero else value > 0):
            raise argparse.ArgumentTypeError(f"{text} is not >= 0" if zero else f"{text} is not > 0")
        if finite and value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def usable_out(out: Path) -> str | None:
    """Why the results cannot be written to the folder ``out``, or None when they can: checked before anything is
    timed, so that a bad ``--out`` does not throw a whole run's measurements away. Folders made for the check are
    removed again (a run refused later, e.g. a model too big, leaves none); the results' writer makes them."""
    made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # never made (its parents may have been), or something else wrote there meanwhile
                continue
    return None


def write_results(files: dict[Path, str]) -> None:
    """Writes each text to its path so that an interruption (Ctrl+C, a kill, a full disk) never leaves a truncated
    file: every text goes to a temporary file in the same folder first, and only once all are written are they
    renamed over the results (a new .json beside an old .md only if the process dies between two renames)."""
    temps: dict[Path, Path] = {}
    path = next(iter(files))
    try:
        for path, text in files.items():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            temps[path] = tmp
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in temps.items():
            os.replace(tmp, path)
    except OSError as exc:
        raise StorageError(f"cannot write {path} ({exc.strerror or exc}); the results there are unchanged: free "
                           "some space or give another --out") from None
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """The command line; a failed write of the results or a Ctrl+C ends in one line, not a traceback."""
    try:
        return _main(argv)
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (SparseInputError, ConfigError) as exc:  # e.g. XMC_SPARSE_KERNELS, or a model too big for this machine
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl+C); no results file is left half-written", file=sys.stderr)
        return 130


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xmc_repro.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--full", action="store_true", help="the paper's shapes (default on a GPU)")
    ap.add_argument("--out", default="results/bench", help="folder for the JSON and markdown results, named after "
                    "the machine (default: results/bench, where they replace the committed files of this machine)")
    ap.add_argument("--methods", default=None,
                    help=f"comma list from {','.join(ALL)}, on a GPU also {','.join(ON_REQUEST)} (default: per case)")
    ap.add_argument("--max-cases", type=_positive(int), default=None, help="run only the first N cases")
    ap.add_argument("--budget-s", type=_positive(float, finite=False), default=None, help="start no new case after this many seconds")
    ap.add_argument("--warmup", type=int, default=None, help="default 3 on a GPU, 1 on CPU")
    ap.add_argument("--repeats", type=_positive(int), default=None, help="default 10 on a GPU, 5 on CPU")
    ap.add_argument("--model", action="store_true", help="time the whole model's training step, dense and uniform")
    ap.add_argument("--scale", type=_positive(float), default=None,
                    help="--model: shrink labels and intermediate layer by this factor (default 1 on a GPU, 0.02 on CPU)")
    ap.add_argument("--steps", type=_positive(int), default=None, help="--model: timed steps (default 50 on a GPU, 5 on CPU)")
    ap.add_argument("--profile", type=_positive(int, zero=True), default=0, metavar="STEPS",
                    help="--model: also profile the uniform model's steps (torch.profiler) over STEPS steps")
    ap.add_argument("--precision", default=None,
                    help="--model: comma list of 32-true, bf16-mixed (default both on a GPU, 32-true on CPU)")
    args = ap.parse_args(argv)
    for option, value in (("--out", args.out), ("--methods", args.methods), ("--precision", args.precision)):
        if value is not None and not all(value.split(",")):  # '' or 'a,,b' would mean the default or fail later
            what = "a folder" if option == "--out" else "a comma list without empty items"
            ap.error(f"{option} {value!r}: give {what}")
    # An option of the other benchmark was silently ignored (--steps 3 without --model timed the default repeats).
    model_only = {"--scale": args.scale, "--steps": args.steps, "--profile": args.profile or None,
                  "--precision": args.precision}
    layer_only = {"--full": args.full or None, "--methods": args.methods, "--max-cases": args.max_cases,
                  "--budget-s": args.budget_s, "--repeats": args.repeats}
    for option, value in (layer_only if args.model else model_only).items():
        if value is not None:
            ap.error(f"{option} applies to the layer benchmark only; drop it or --model" if args.model else
                     f"{option} applies to --model only; add --model or drop it")
    if args.warmup is not None and args.warmup < 0:
        ap.error(f"--warmup {args.warmup}: give 0 or more untimed runs")
    if args.device not in (None, "cpu", "cuda"):
        ap.error(f"--device {args.device}: choose cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible here (or this torch has no CUDA); use --device cpu")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    if args.methods and not args.model:
        methods = args.methods.split(",")
        known = ALL + (ON_REQUEST if on_gpu else ())
        unknown = [m for m in methods if m not in known]
        if unknown:  # a typo would write result files without results over the committed ones
            ap.error(f"--methods: {', '.join(unknown)} is not one of {', '.join(known)}"
                     + ("" if on_gpu else f" ({', '.join(ON_REQUEST)}: on a GPU only)"))
    unknown = set((args.precision or "").split(",")) - {"", "32-true", "bf16-mixed"}
    if unknown:  # before --out is created
        ap.error(f"--precision: {', '.join(sorted(unknown))} is not one of 32-true, bf16-mixed")
    sparse_op.kernel_families(os.environ.get("XMC_SPARSE_KERNELS"))  # a bad setting: refused before --out is made
    problem = usable_out(Path(args.out))
    if problem:
        ap.error(f"--out {args.out}: cannot write results there ({problem}); give a writable folder")
    sparse_op.ensure_registered()
    backend = sparse_op.backend(device)
    kernels = [m for m in (args.methods or "").split(",") if m in ON_REQUEST]
    if kernels and not backend.startswith("compiled-cuda"):  # they failed after the others ran
        ap.error(f"--methods {','.join(kernels)}: needs the compiled CUDA kernels, but the op runs {backend} here "
                 "(why is in the warning above); drop them or fix the build")
    if args.model:
        from xmc_repro import bench_model

        scale = args.scale if args.scale is not None else (1.0 if on_gpu else 0.02)
        steps = args.steps or (50 if on_gpu else 5)
        given = args.precision or ("32-true,bf16-mixed" if on_gpu else "32-true")
        precisions = tuple(dict.fromkeys(given.split(",")))  # a repeat would pair the ratios' rows wrongly
        return bench_model.run(device, scale, steps, args.warmup if args.warmup is not None else (5 if on_gpu else 1),
                               Path(args.out), args.profile, precisions)
    cases = paper_cases() if (args.full or device.type == "cuda") else cpu_cases()
    cases = cases[: args.max_cases] if args.max_cases else cases
    methods = set(args.methods.split(",")) if args.methods else None
    warmup = args.warmup if args.warmup is not None else (3 if on_gpu else 1)
    repeats = args.repeats if args.repeats is not None else (10 if on_gpu else 5)
    bandwidth, l2 = copy_bandwidth(device), l2_bandwidth(device)
    info = machine_info(device, bandwidth, l2)
    print(f"benchmarking on {info.get('card', info['host_cpu'])}: copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
          + (f"L2 read bandwidth {l2 / 1e9:.0f} GB/s, " if l2 else "")
          + f"backend {info['sparse_backend']}", flush=True)
    rows, t0 = [], time.time()
    for case in cases:
        if args.budget_s and time.time() - t0 > args.budget_s:
            print(f"time budget reached, skipping {case.name}", flush=True)
            continue
        print(f"  {case.name} ...", flush=True)
        rows += run_case(case, device, bandwidth, warmup, repeats, methods, l2)
    name = slug(info)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    note = replaced(out / f"{name}.json")
    write_results({out / f"{name}.json": json.dumps({"machine": info, "results": rows}, indent=1) + "\n",
                   out / f"{name}.md": markdown(info, rows)})
    print(f"wrote {out / name}.json and .md{note}")
    print(summary(rows))
    choice = kernels_choice(rows)
    if choice is not None and info["sparse_backend"] != "compiled-cuda":
        print(f"no choice of kernels per phase: the op ran {info['sparse_backend']}, not its thread-per-label kernels "
              "in every phase; compare with XMC_SPARSE_KERNELS=threads")
    elif choice is not None:  # a line scripts/gpu_all.sh reads
        print(f"fastest kernels per phase: XMC_SPARSE_KERNELS={choice}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
