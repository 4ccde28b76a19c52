"""Figures (PNG, viewable offline) and their data: memory against test P@1, ours beside the paper's.

relative_<dataset>.png, one per dataset of the paper: both axes relative to the dense model on the same data, the
only form in which runs on a stand-in (or at smoke scale) can stand beside the paper's points. The paper's points
are its peak GPU memory and P@1 divided by its dense row's; ours are every run on that dataset or a stand-in for
it, with the model's training state (parameters, Adam moments, index buffers: exact, from the config; see
state.py) and P@1 divided by those of our dense model on the same data, scale and machine.

state_vs_p1_<data>.png, one per dataset of ours: absolute values — training state (MiB) for every run, and beside
it the peak GPU memory (GiB) of the runs made on a GPU (a CPU run has none).

figures/README.md embeds them all; data/*.csv holds the plotted points.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

from xmc_repro.report import paper
from xmc_repro.report.atomic import replacing, write_text
from xmc_repro.report.identity import PAPER_DATASETS, at_defaults, describe, paper_dataset
from xmc_repro.report.render import RERUN, dense_reference

RELATIVE_COLUMNS = ("setup", "memory_vs_dense", "p1_vs_dense", "data", "card", "memory_basis")
PAPER_BASIS = "peak GPU memory (V100)"
OUR_BASIS = "parameters + Adam moments + index buffers"
CONFIG = ("dataset", "features", "setup", "connectivity", "intermediate", "bottleneck", "mach_hashes", "mach_buckets",
          "loss")  # fmt: skip


def _label(config: dict) -> str:
    return describe(config) + (" (bce)" if config.get("loss") == "bce" else "")


def paper_points(published: list[dict]) -> dict[str, list[dict]]:
    """The paper's (memory, P@1) ÷ its dense row's, per dataset (named as our config), each row once."""
    dense = {(r["dataset"], r["features"]): r for r in published
             if r["table"] == "table1_architecture" and r["setup"] == "dense" and not r["intermediate"]}  # fmt: skip
    points: dict[str, list[dict]] = {}
    seen = set()
    for row in published:
        reference = dense.get((row["dataset"], row["features"]))
        if row["table"] not in paper.PAPER_TABLES.values() or reference is None or row is reference:
            continue
        if not (row["memory_gib"] and row["test_p1"]) or paper.row_key(row) in seen:
            continue
        seen.add(paper.row_key(row))
        sparse = row["setup"] in ("uniform", "unstructured")  # the paper writes a bottleneck's width as connectivity
        label = _label({"setup": row["setup"], "connectivity": row["connectivity"] if sparse else "",
                        "bottleneck": row["connectivity"], "intermediate": row["intermediate"] if sparse else "",
                        "loss": row["loss"]})  # fmt: skip
        points.setdefault(PAPER_DATASETS[row["dataset"], row["features"]], []).append({
            "setup": label,
            "memory_vs_dense": _fmt(float(row["memory_gib"]) / float(reference["memory_gib"])),
            "p1_vs_dense": _fmt(float(row["test_p1"]) / float(reference["test_p1"])),
            "data": f"{row['dataset']} {row['features']}", "card": "V100", "memory_basis": PAPER_BASIS,
        })  # fmt: skip
    return points


def _unique(runs: list[dict]) -> list[dict]:
    """Runs with P@1 at the default settings and float32, each configuration and machine once (table 2 and table 5
    share some). A run that changes a setting (`settings`, e.g. in the `differences` table) or trains in bf16 is
    not its architecture's point; one beside older runs that predate a setting is (`identity.at_defaults`)."""
    seen, out = set(), []
    for run in runs:
        key = (run["scale"], run["device"], *(run[c] for c in CONFIG))
        if run["test_p1"] and at_defaults(run.get("settings", "")) and not run.get("precision") and key not in seen:
            seen.add(key)
            out.append(run)
    return out


def relative_points(runs: list[dict], settings: dict | None = None) -> dict[str, list[dict]]:
    """Ours relative to our dense model on the same data and at the same settings (render.dense_reference; none
    without `settings`, export.shared_settings), per paper dataset that the data is or stands in for."""
    points: dict[str, list[dict]] = {}
    for run in _unique(runs):
        stands_for = paper_dataset(run["dataset"], run["features"])
        dense = dense_reference(run, runs, settings or {})
        if stands_for is None or run["setup"] == "dense" or dense is None:
            continue
        if not (run["state_mib"] and dense["state_mib"] and dense["test_p1"] and float(dense["test_p1"])):
            continue
        points.setdefault(PAPER_DATASETS[stands_for], []).append({
            "setup": _label(run),
            "memory_vs_dense": _fmt(float(run["state_mib"]) / float(dense["state_mib"])),
            "p1_vs_dense": _fmt(float(run["test_p1"]) / float(dense["test_p1"])),
            "data": f"{run['dataset']} {run['features']} ({run['scale']} scale)", "card": run["device"],
            "memory_basis": OUR_BASIS,
        })  # fmt: skip
    return points


def absolute_groups(runs: list[dict]) -> dict[str, list[dict]]:
    """Our runs per dataset and scale, for the absolute figures."""
    groups: dict[str, list[dict]] = {}
    for run in _unique(runs):
        name = re.sub(r"[^a-z0-9_.]+", "_", f"{run['dataset']}_{run['features']}_{run['scale']}".lower())
        groups.setdefault(name, []).append(run)
    return groups


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _write(points: list[dict], path: Path) -> None:
    with replacing(path, RERUN, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RELATIVE_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(points)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    with replacing(path, RERUN, binary=True) as f:  # no version string: same bytes on every clone
        fig.savefig(f, format=path.suffix.lstrip("."), dpi=110, metadata={"Software": None})


def _scatter(ax, points: list[dict], x: str, y: str, **style) -> None:
    xs, ys = [float(p[x]) for p in points], [float(p[y]) for p in points]
    ax.scatter(xs, ys, **style)
    for xv, yv, p in zip(xs, ys, points):
        ax.annotate(p["setup"], (xv, yv), fontsize=6, xytext=(3, 2), textcoords="offset points")


def plot_relative(title: str, theirs: list[dict], ours: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    if theirs:
        _scatter(ax, theirs, "memory_vs_dense", "p1_vs_dense", marker="o", color="tab:blue",
                 label=f"paper: {PAPER_BASIS}")  # fmt: skip
    markers = ("x", "+", "^", "s", "v", "D")
    for i, source in enumerate(sorted({(p["data"], p["card"]) for p in ours})):
        group = [p for p in ours if (p["data"], p["card"]) == source]
        _scatter(ax, group, "memory_vs_dense", "p1_vs_dense", marker=markers[i % len(markers)],
                 label=f"ours: {source[0]}, {source[1]}")  # fmt: skip
    ax.set_xscale("log")
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.axvline(1.0, color="grey", lw=0.6)
    note = "" if ours else "\nno run of ours on this dataset or a stand-in for it yet"
    ax.set_title(f"{title}: each model relative to the dense model on the same data{note}", fontsize=9)
    ax.set_xlabel(f"memory ÷ dense model's (log)   paper: {PAPER_BASIS}; ours: {OUR_BASIS}", fontsize=8)
    ax.set_ylabel("test P@1 ÷ dense model's test P@1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="lower right")
    _save(fig, path)
    plt.close(fig)


def plot_absolute(runs: list[dict], path: Path) -> None:
    plt = _pyplot()
    gpu = [r for r in runs if r["memory_gib"]]
    fig, axes = plt.subplots(1, 2 if gpu else 1, figsize=(11 if gpu else 6.5, 4.5), squeeze=False)
    panels = [("state_mib", f"training state: {OUR_BASIS} (MiB, exact)", runs)]
    if gpu:
        panels.append(("memory_gib", "peak GPU memory (GiB; GPU runs only)", gpu))
    for ax, (x, xlabel, panel) in zip(axes[0], panels):
        for card in sorted({r["device"] for r in panel}):
            points = [{**r, "setup": _label(r)} for r in panel if r["device"] == card and r[x]]
            if points:
                _scatter(ax, points, x, "test_p1", marker="x" if card.startswith("cpu") else "o", label=card)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("test P@1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    first = runs[0]
    fig.suptitle(f"{first['dataset']} ({first['features']} features), {first['scale']} scale: our runs", fontsize=9)
    _save(fig, path)
    plt.close(fig)


def _title(name: str) -> str:
    (dataset, features), = [key for key, value in PAPER_DATASETS.items() if value == name]
    return f"{dataset} ({features} features)"


def render_figures(runs: list[dict], published: list[dict], out_dir: Path, settings: dict | None = None) -> list[str]:
    """Write the figures, their data and figures/README.md; returns the figures' file names. `settings`: as for
    `relative_points`."""
    data_dir = out_dir / "data"  # made by the first write into it (atomic.replacing)
    theirs, ours = paper_points(published), relative_points(runs, settings)
    names, sections = [], []
    for name in PAPER_DATASETS.values():
        _write(theirs.get(name, []), data_dir / f"{name}_paper.csv")
        _write(ours.get(name, []), data_dir / f"{name}_ours.csv")
        plot_relative(_title(name), theirs.get(name, []), ours.get(name, []), out_dir / f"relative_{name}.png")
        names.append(f"relative_{name}.png")
        sections.append((f"{_title(name)}: relative to the dense model, ours beside the paper's", names[-1]))
    for name, group in sorted(absolute_groups(runs).items()):
        plot_absolute(group, out_dir / f"state_vs_p1_{name}.png")
        names.append(f"state_vs_p1_{name}.png")
        first = group[0]
        sections.append((f"{first['dataset']} ({first['features']}), {first['scale']} scale: ours", names[-1]))
    lines = ["# Figures", "", "Rendered by `dvc repro` from results/records (see `xmc_repro/report/figures.py`). "
             "Memory on the x axes: the paper's is peak GPU memory; ours is the model's training state "
             f"({OUR_BASIS}, exact from the config), or peak GPU memory where a panel says so.", ""]  # fmt: skip
    for heading, file in sections:
        lines += [f"## {heading}", "", f"![{heading}]({file})", ""]
    write_text(out_dir / "README.md", "\n".join(lines), RERUN)
    written = {out_dir / name for name in names} | {data_dir / f"{name}_{side}.csv" for name in PAPER_DATASETS.values()
                                                     for side in ("paper", "ours")}  # fmt: skip
    for stale in {*out_dir.glob("*.png"), *data_dir.glob("*.csv")} - written:  # figures of data no longer recorded
        stale.unlink()
    return names
