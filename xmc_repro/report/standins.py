"""Do the synthetic stand-ins order the models as the real data does? A section of results/claims.md.

For each pair of models (dense; uniform and unstructured with 32 connections, with and without an intermediate
layer; squared hinge) the real datasets (Bibtex, Delicious: runs with the default settings) say which one has the
higher test P@1; each smoke-scale stand-in is checked against that order. A pair on which the two real datasets
disagree is left out: there is no real order to reproduce. Intermediate widths differ (1024 on the real data,
the presets' narrow width on a stand-in); only "with" or "without" counts.
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations

REAL = ("Bibtex", "Delicious")
KINDS = ("dense", "uniform", "unstructured", "uniform + intermediate", "unstructured + intermediate")


def kind(run: dict) -> str | None:
    """The model of a run as this comparison names it, or None for a model it leaves out."""
    if run["loss"] != "squared_hinge":
        return None
    if run["setup"] == "dense":
        return None if run["intermediate"] else "dense"
    if run["setup"] in ("uniform", "unstructured") and run["connectivity"] == "32":
        return run["setup"] + (" + intermediate" if run["intermediate"] else "")
    return None


def best_p1(runs: list[dict], dataset: tuple[str, str]) -> dict[str, float]:
    """Test P@1 of each model on `dataset` (name, features); the latest run of a model if there are several.

    Models with an intermediate layer are compared at one width: the one most of them have (on Bibtex 1024, which
    uniform and unstructured share, not the 2048 of a later uniform run), the narrower one on a tie."""
    here = [r for r in runs if kind(r) and (r["dataset"], r["features"]) == dataset and r["test_p1"]]
    # models, not runs: a model run again (seeds, reruns) at another width must not outvote the width they share
    widths = Counter(width for _, width in {(kind(r), r["intermediate"]) for r in here if r["intermediate"]})
    width = max(widths, key=lambda w: (widths[w], -int(w))) if widths else ""
    found: dict[str, tuple[str, float]] = {}
    for run in here:
        if run["intermediate"] and run["intermediate"] != width:
            continue
        name = kind(run)
        if name not in found or run["last_end_time"] > found[name][0]:
            found[name] = (run["last_end_time"], float(run["test_p1"]))
    return {name: p1 for name, (_, p1) in found.items()}


def markdown(real_runs: list[dict], smoke_runs: list[dict]) -> str:
    real = {d: best_p1(real_runs, (d, "bow")) for d in REAL}
    stand_ins = sorted({(r["dataset"], r["features"]) for r in smoke_runs if r["dataset"].startswith("Smoke-")})
    lines = ["## Stand-ins against real data: which model is ahead", "", __doc__.split("\n\n")[1].replace("\n", " "),
             ""]  # fmt: skip
    pairs = []
    for a, b in combinations(KINDS, 2):
        signs = {d: real[d][a] > real[d][b] for d in REAL if a in real[d] and b in real[d]}
        if len(signs) == len(REAL) and len(set(signs.values())) == 1:
            pairs.append((a, b) if next(iter(signs.values())) else (b, a))
    if not pairs or not stand_ins:
        return "\n".join(lines + ["Not measured here: no model pair ordered alike on both real datasets, or no "
                                  "smoke-scale stand-in runs.", ""])  # fmt: skip
    header = ["real order (test P@1)", *(f"{name} ({features})" for name, features in stand_ins)]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    agree = {s: [0, 0] for s in stand_ins}
    for ahead, behind in pairs:
        cells = []
        for s in stand_ins:
            p1 = best_p1(smoke_runs, s)
            if ahead in p1 and behind in p1:
                same = p1[ahead] > p1[behind]
                agree[s][0] += same
                agree[s][1] += 1
                cells.append(f"{'agrees' if same else 'reversed'} ({p1[ahead]:.1f} vs {p1[behind]:.1f})")
            else:
                cells.append("—")
        lines.append(f"| {ahead} > {behind} | " + " | ".join(cells) + " |")
    totals = [f"{n}/{total}" if total else "—" for n, total in agree.values()]
    lines += [f"| **pairs in the real order** | " + " | ".join(totals) + " |", ""]
    return "\n".join(lines)


def section(runs: list[dict]) -> str:
    """The section from runs.csv rows: real data with the default settings, stand-ins at smoke scale."""
    real = [r for r in runs if r["scale"] != "smoke" and r["table"] == "claims"]
    # the architecture table's preset (one intermediate width per stand-in), not the widths of tables 2-5
    smoke = [r for r in runs if r["scale"] == "smoke" and r["table"] == "table1"]
    return markdown(real, smoke)
