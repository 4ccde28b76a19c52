"""Peak GPU memory vs test P@1, one figure per dataset: ours beside the paper's (PNG + `dvc plots` data).

Paper points come from the paper's tables; ours from every measured configuration with a peak GPU memory
(CPU runs have none). A paper dataset's figure holds the paper's points and our `paper`-scale runs on it;
every other dataset we measured (a stand-in, Bibtex, ...) gets a figure of its own.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

from xmc_repro.report import paper
from xmc_repro.report.identity import PAPER_DATASETS, describe

PLOT_COLUMNS = ("setup", "memory_gib", "test_p1", "scale", "card")


def paper_points(published: list[dict]) -> dict[str, list[dict]]:
    """Published (memory, P@1) per paper dataset (named as our config), each row once though tables repeat some."""
    points: dict[str, list[dict]] = {}
    seen = set()
    for row in published:
        if row["table"] not in paper.PAPER_TABLES.values() or not row["memory_gib"] or not row["test_p1"]:
            continue
        key = paper.row_key(row)
        if key in seen:
            continue
        seen.add(key)
        sparse = row["setup"] in ("uniform", "unstructured")  # the paper writes a bottleneck's width as connectivity
        label = describe({"setup": row["setup"], "connectivity": row["connectivity"] if sparse else "",
                          "bottleneck": row["connectivity"], "intermediate": "" if not sparse else row["intermediate"]})
        label += " (bce)" if row["loss"] == "bce" else ""
        points.setdefault(PAPER_DATASETS[row["dataset"], row["features"]], []).append(
            {"setup": label, "memory_gib": row["memory_gib"], "test_p1": row["test_p1"], "scale": "", "card": "V100"}
        )
    return points


def our_points(runs: list[dict]) -> dict[str, list[dict]]:
    """Our measured (memory, P@1) per dataset: paper-scale runs of a paper dataset join its figure."""
    points: dict[str, list[dict]] = {}
    seen = set()
    for run in runs:
        if not run["memory_gib"] or not run["test_p1"]:
            continue
        config = {k: run[k] for k in ("dataset", "features", "setup", "connectivity", "intermediate", "bottleneck",
                                      "mach_hashes", "mach_buckets", "loss", "scale")}  # fmt: skip
        key = tuple(config.values())
        if key in seen:  # the same configuration in two tables (e.g. table 2 and table 5)
            continue
        seen.add(key)
        # a paper dataset's figure holds only our paper-scale runs on it; any other dataset has its own
        paper_name = (run["dataset"], run["features"])
        if paper_name in PAPER_DATASETS and run["scale"] == "paper":
            name = PAPER_DATASETS[paper_name]
        else:
            parts = (*paper_name, run["scale"] if paper_name in PAPER_DATASETS else "")
            name = re.sub(r"[^a-z0-9_.]+", "_", "_".join(p for p in parts if p).lower())
        label = describe(config) + (" (bce)" if run["loss"] == "bce" else "")
        points.setdefault(name, []).append(
            {"setup": label, "memory_gib": run["memory_gib"], "test_p1": run["test_p1"], "scale": run["scale"],
             "card": run["device"], "title": f"{run['dataset']} ({run['features']} features), {run['scale']} scale"}
        )
    return points


def _write_points(points: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PLOT_COLUMNS, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(points)


def _title(name: str, ours: list[dict]) -> str:
    for (dataset, features), config_name in PAPER_DATASETS.items():
        if config_name == name:
            return f"{dataset} ({features} features)"
    return ours[0]["title"] if ours else name


def plot(name: str, published: list[dict], ours: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for points, style, label in ((published, dict(marker="o", color="tab:blue"), "paper (V100)"),
                                 (ours, dict(marker="x", color="tab:red"), "ours")):  # fmt: skip
        if not points:
            continue
        xs = [float(p["memory_gib"]) for p in points]
        ys = [float(p["test_p1"]) for p in points]
        ax.scatter(xs, ys, label=label, **style)
        for x, y, p in zip(xs, ys, points):
            ax.annotate(p["setup"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    cards = sorted({p["card"] for p in ours})
    ours_note = f"ours on {', '.join(cards)}" if cards else "no GPU-memory measurement of ours yet (CPU runs have none)"
    ax.set_title(f"{_title(name, ours)}\n{ours_note}", fontsize=9)
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel("test P@1 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_figures(runs: list[dict], published: list[dict], out_dir: Path) -> list[str]:
    """Write memory_vs_p1_<dataset>.png and data/<dataset>_{paper,ours}.csv; returns the dataset names."""
    data_dir = out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    theirs, ours = paper_points(published), our_points(runs)
    names = list(PAPER_DATASETS.values()) + sorted(set(ours) - set(PAPER_DATASETS.values()))
    for name in names:
        _write_points(theirs.get(name, []), data_dir / f"{name}_paper.csv")
        _write_points(ours.get(name, []), data_dir / f"{name}_ours.csv")
        plot(name, theirs.get(name, []), ours.get(name, []), out_dir / f"memory_vs_p1_{name}.png")
    return names
