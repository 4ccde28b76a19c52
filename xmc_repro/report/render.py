"""runs.csv + the published numbers -> results/tables/table{1..5}.{md,tex,csv}.

Each table has a block per scale. A block lists the paper's rows in the paper's order, then the configurations
of our grid (or of our runs) that the paper's table does not have — with the authors' supplementary value where
they published one. Every configuration of the preset's grid that has no finished run is marked `missing`;
nothing is filled in that was not measured.
"""

from __future__ import annotations

import csv
from pathlib import Path

from xmc_repro.report import paper
from xmc_repro.report.identity import config_key, describe, paper_key, paper_width

# Metrics set beside the published ones (with their difference), in the paper's column names.
COMPARED = ("test_p1", "test_p3", "test_p5", "train_p1", "train_p3", "train_p5", "memory_gib", "epochs",
            "time_per_epoch_s")  # fmt: skip
IDENTITY = ("dataset", "features", "setup", "connectivity", "intermediate", "loss")
MISSING = "missing"
COLUMNS = (
    "table", "scale", *IDENTITY, "status", "published_source", "published_kind",
    *(f"{side}_{m}" for m in COMPARED for side in ("published", "ours")),
    *(f"ours_{m}_std" for m in COMPARED),
    *(f"diff_{m}" for m in COMPARED),
    "our_dataset", "our_setup", "seeds", "runs", "card", "sparse_backend", "git_commit", "run_ids",
)  # fmt: skip
SCALE_NOTES = {
    "paper": "the paper's datasets and sizes (GPU)",
    "smoke": "synthetic stand-ins for the paper's datasets plus Bibtex/Delicious, intermediate layers 128 times "
    "narrower, few epochs (CPU, minutes): the grid's shape, not the paper's numbers",
}


def table_rows(table: str, scale: str, runs: list[dict], expected: list[dict], published: list[dict]) -> list[dict]:
    """The rows of one table at one scale."""
    ours: dict[tuple, list[dict]] = {}  # a configuration may have run on several machines
    for run in runs:
        if run["table"] == table and run["scale"] == scale:
            ours.setdefault(config_key(run), []).append(run)
    configs = {config_key(c): c for c in expected}
    configs.update({key: found[0] for key, found in ours.items() if key not in configs})
    rows_here = [r for r in published if r["table"] == paper.PAPER_TABLES[table]]
    supplement = {paper.row_key(r): r for r in published if r["table"] == paper.SUPPLEMENT}

    matched: dict[tuple, list[dict]] = {}
    extras = []
    published_keys = {paper.row_key(r) for r in rows_here}
    for config in configs.values():
        key = paper_key(config)
        (matched.setdefault(key, []) if key in published_keys else extras).append(config)

    rows = []
    for published_row in rows_here:
        if published_row["setup"] == "literature":
            rows.append(_row(table, scale, published_row, "paper", None, None))
            continue
        for config in matched.get(paper.row_key(published_row), [None]):
            for run in ours.get(config_key(config), [None]) if config else [None]:
                rows.append(_row(table, scale, published_row, "paper", config, run))
    for config in extras:
        source_row = supplement.get(paper_key(config))
        source = "authors' README" if source_row else ""
        for run in ours.get(config_key(config), [None]):
            rows.append(_row(table, scale, source_row, source, config, run))
    return rows


def _row(table, scale, published_row, source, config, run) -> dict[str, str]:
    row = dict.fromkeys(COLUMNS, "")
    row.update(table=table, scale=scale)
    if published_row is not None:
        row.update({c: published_row[c] for c in IDENTITY})
        row.update(published_source=source, published_kind=published_row["kind"])
        row.update({f"published_{m}": published_row.get(m, "") for m in COMPARED})
    else:  # a configuration without a published value: named in the paper's terms where the dataset is the paper's
        key = paper_key(config)
        if key is None:
            width = paper_width(config["intermediate"], config["scale"])
            connectivity = config["connectivity"] or config["bottleneck"]
            key = (config["dataset"], config["features"], config["setup"], connectivity, width, config["loss"])
        row.update(zip(IDENTITY, key))
        if config["setup"] == "mach":  # its decoding connects each label to one bucket per hash function
            row["connectivity"] = config["mach_hashes"]
    if config is None:
        row["status"] = "literature" if published_row and published_row["setup"] == "literature" else MISSING
        return row
    row.update(our_dataset=f"{config['dataset']} {config['features']}".strip(), our_setup=describe(config))
    if run is None:
        row["status"] = MISSING
        return row
    row["status"] = "measured"
    for m in COMPARED:
        row[f"ours_{m}"], row[f"ours_{m}_std"] = run.get(m, ""), run.get(f"{m}_std", "")
        if row[f"ours_{m}"] and row[f"published_{m}"]:
            row[f"diff_{m}"] = f"{float(row[f'ours_{m}']) - float(row[f'published_{m}']):.6g}"
    row.update(seeds=run["seeds"], runs=run["runs"], card=run["device"], sparse_backend=run["sparse_backend"])
    row.update(git_commit=run["git_commit"], run_ids=run["run_ids"])
    return row


def scales_to_show(runs: list[dict], table: str) -> list[str]:
    """Both defined scales always (never run = all missing), then any other scale that runs were tagged with."""
    from xmc_repro.report.grid import SCALES

    others = sorted({r["scale"] for r in runs if r["table"] == table} - set(SCALES))
    return [*SCALES, *others]


# ---------------------------------------------------------------- formatting


def _fmt(value: str, digits: int) -> str:
    return f"{float(value):.{digits}f}" if value not in ("", None) else ""


def _digits(metric: str) -> int:
    return {"memory_gib": 2, "epochs": 1, "time_per_epoch_s": 0}.get(metric, 1)


def _ours(row: dict, metric: str) -> str:
    if row["status"] == MISSING:
        return MISSING
    value = _fmt(row[f"ours_{metric}"], _digits(metric))
    if value and row[f"ours_{metric}_std"]:
        value += f" ± {_fmt(row[f'ours_{metric}_std'], _digits(metric))}"
    return value or "—"


def _published(row: dict, metric: str) -> str:
    value = _fmt(row[f"published_{metric}"], _digits(metric))
    if value and row["published_source"] == "authors' README":
        value += "ᵃ"
    return value or "—"


def _diff(row: dict, metric: str) -> str:
    return f"{float(row[f'diff_{metric}']):+.1f}" if row[f"diff_{metric}"] else ""


def _our_run(row: dict) -> str:
    if not row["our_dataset"]:
        return ""
    text = f"{row['our_dataset']}: {row['our_setup']}"
    seeds = row["seeds"].split(";") if row["seeds"] else []
    if seeds:
        text += f" (seed{'s' if len(seeds) > 1 else ''} {','.join(seeds)})"
    return text


def display_columns(rows: list[dict]) -> list[tuple[str, callable]]:
    """(header, cell function) of the human-readable tables (md and tex); the csv has every column."""
    columns = [
        ("Dataset", lambda r: r["dataset"]),
        ("Features", lambda r: r["features"]),
        ("Setup", lambda r: r["setup"]),
        ("Conn.", lambda r: r["connectivity"]),
        ("Inter.", lambda r: r["intermediate"]),
    ]
    if len({r["loss"] for r in rows if r["loss"]}) > 1:
        columns.append(("Loss", lambda r: r["loss"]))
    for k in (1, 3, 5):
        m = f"test_p{k}"
        columns += [
            (f"P@{k} paper", lambda r, m=m: _published(r, m)),
            (f"P@{k} ours", lambda r, m=m: _ours(r, m)),
            ("Δ", lambda r, m=m: _diff(r, m)),
        ]
    columns += [
        ("Mem. GiB paper", lambda r: _published(r, "memory_gib")),
        ("Mem. GiB ours", lambda r: _ours(r, "memory_gib")),
        ("Our run", _our_run),
        ("Card", lambda r: r["card"]),
    ]
    return columns


FOOTNOTES = [
    "P@k in percent on the test split. Δ = ours − published. `missing`: in the preset's grid (or published) "
    "but no finished run in MLflow. — : not published, or not measured (peak GPU memory on a CPU run).",
    "ᵃ: from the authors' supplementary tables (xmc-aalto/ecml23-sparse), not the paper's table.",
    "Conn.: connections per label (dense: the input size; bottleneck: its width). Inter.: the paper's size of the "
    "intermediate layer; a smoke run's actual, 128 times narrower, width is in *Our run*.",
]


def markdown(table: str, blocks: list[tuple[str, list[dict]]]) -> str:
    lines = [f"# {paper.TITLES[table]}", ""]
    all_rows = [r for _, rows in blocks for r in rows]
    columns = display_columns(all_rows)
    for scale, rows in blocks:
        measured = sum(r["status"] == "measured" for r in rows)
        missing = sum(r["status"] == MISSING for r in rows)
        note = SCALE_NOTES.get(scale, "runs tagged with this scale")
        lines += [f"## Scale `{scale}`: {note}", "", f"{measured} configurations measured, {missing} missing.", ""]
        lines.append("| " + " | ".join(h for h, _ in columns) + " |")
        lines.append("|" + "|".join("---" for _ in columns) + "|")
        for row in rows:
            lines.append("| " + " | ".join(cell(row).replace("|", "\\|") for _, cell in columns) + " |")
        lines.append("")
    if table in ("table2", "table3"):
        lines.append("The paper publishes tables 2 and 3 as differences to the dense row; the published values "
                     "here are those differences added back to the dense row.")  # fmt: skip
        lines.append("")
    lines += [f"- {note}" for note in FOOTNOTES]
    return "\n".join(lines) + "\n"


_TEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                "±": r"$\pm$", "Δ": r"$\Delta$", "—": "--", "ᵃ": r"\textsuperscript{a}", "−": "-"}  # fmt: skip


def tex_escape(text: str) -> str:
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in text)


def latex(table: str, blocks: list[tuple[str, list[dict]]]) -> str:
    all_rows = [r for _, rows in blocks for r in rows]
    columns = display_columns(all_rows)
    spec = "l" * 3 + "r" * (len(columns) - 5) + "ll"
    lines = [
        f"% {paper.TITLES[table]} -- rendered by `python -m xmc_repro.report render`; needs booktabs.",
        r"\begin{tabular}{" + spec + "}",
        r"\toprule",
        " & ".join(tex_escape(h) for h, _ in columns) + r" \\",
    ]
    for scale, rows in blocks:
        lines += [r"\midrule", rf"\multicolumn{{{len(columns)}}}{{l}}{{\emph{{scale: {tex_escape(scale)}}}}} \\"]
        lines += [" & ".join(tex_escape(cell(r)) for _, cell in columns) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def render_tables(runs: list[dict], published: list[dict], out_dir: Path, expected) -> dict[str, list]:
    """Write table{1..5}.{md,tex,csv}; `expected(table, scale)` gives the preset's grid (grid.read_grid)."""
    from xmc_repro.report.grid import TABLES

    out_dir.mkdir(parents=True, exist_ok=True)
    rendered = {}
    for table in TABLES:
        blocks = []
        for scale in scales_to_show(runs, table):
            blocks.append((scale, table_rows(table, scale, runs, expected(table, scale), published)))
        rows = [r for _, block in blocks for r in block]
        (out_dir / f"{table}.md").write_text(markdown(table, blocks))
        (out_dir / f"{table}.tex").write_text(latex(table, blocks))
        write_csv(rows, out_dir / f"{table}.csv")
        rendered[table] = rows
    return rendered

