"""runs.csv + the published numbers -> results/tables/table{1..5}.{md,tex,csv}.

Each table has a block per scale. A block lists the paper's rows in the paper's order, then the configurations
of our grid (or of our runs) that the paper's table does not have — with the authors' supplementary value where
they published one. Every configuration of the preset's grid that has no finished run is marked `missing`;
nothing is filled in that was not measured.

A difference to the paper (Δ) is only shown for runs on the paper's own datasets. A synthetic stand-in or a
small real dataset (Bibtex, Delicious) is other data: there, what carries over is how each model compares with
the dense model on the same data, so those rows give P@k ÷ the dense model's P@k (same data, scale, machine and
settings but the head's own) beside the paper's same ratio on the dataset stood in for (for Bibtex/Delicious: the
range over the paper's datasets of that ratio for the same kind of model).
"""

from __future__ import annotations

import csv
from pathlib import Path

from xmc_repro.report import paper
from xmc_repro.report.atomic import replacing, write_text
from xmc_repro.report.export import same_settings
from xmc_repro.report.grid import SCALES, TABLES
from xmc_repro.report.identity import PAPER_DATASETS, config_key, describe, paper_key

# Metrics set beside the published ones (with their difference), in the paper's column names.
COMPARED = ("test_p1", "test_p3", "test_p5", "train_p1", "train_p3", "train_p5", "memory_gib", "epochs",
            "time_per_epoch_s")  # fmt: skip
IDENTITY = ("dataset", "features", "setup", "connectivity", "intermediate", "loss")
MISSING = "missing"
RERUN = "the render stage (`dvc repro`)"
COLUMNS = (
    "table", "scale", *IDENTITY, "status", "published_source", "published_kind",
    *(f"{side}_{m}" for m in COMPARED for side in ("published", "ours")),
    *(f"ours_{m}_std" for m in COMPARED),
    *(f"diff_{m}" for m in COMPARED),
    "paper_data", *(f"{side}_p{k}_vs_dense" for k in (1, 3, 5) for side in ("ours", "published")), "dense_run_ids",
    "our_dataset", "our_setup", "seeds", "runs", "card", "sparse_backend", "git_commit", "run_ids",
)  # fmt: skip
RATIO_KS = (1, 3, 5)
SCALE_NOTES = {
    "paper": "the paper's datasets and sizes (GPU)",
    "smoke": "synthetic stand-ins for the paper's datasets plus Bibtex/Delicious, intermediate layers 128 times "
    "narrower, few epochs (CPU, minutes): the grid's shape, not the paper's numbers",
}


def table_rows(table: str, scale: str, runs: list[dict], expected: list[dict], published: list[dict],
               data_missing: dict[str, str] | None = None, settings: dict | None = None) -> list[dict]:  # fmt: skip
    """The rows of one table at one scale; `runs` are all of runs.csv (dense references may be in any table, at the
    row's settings: `settings`, export.shared_settings of the records; without them no ratio to dense). At a scale
    without a grid (runs tagged `table=` by hand, without `scale=`), the rows of its runs only."""
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

    context = {"runs": runs, "published": published, "paper_table": paper.PAPER_TABLES[table],
               "settings": settings or {}}
    rows = []
    for published_row in rows_here:
        if scale not in SCALES and not matched.get(paper.row_key(published_row)):  # no grid there: its runs only
            continue
        if published_row["setup"] == "literature":
            rows.append(_row(table, scale, published_row, "paper", None, None, context))
            continue
        for config in matched.get(paper.row_key(published_row), [None]):
            for run in ours.get(config_key(config), [None]) if config else [None]:
                rows.append(_row(table, scale, published_row, "paper", config, run, context))
    for config in extras:
        source_row = supplement.get(paper_key(config))
        source = "authors' README" if source_row else ""
        for run in ours.get(config_key(config), [None]):
            rows.append(_row(table, scale, source_row, source, config, run, context))
    return _collapse_missing_data(rows, data_missing or {})


def _collapse_missing_data(rows: list[dict], data_missing: dict[str, str]) -> list[dict]:
    """A dataset whose data was not found and that has no run here: one row saying so, not one per model."""
    out, reported = [], set()
    for row in rows:
        name = row["our_dataset"].rsplit(" ", 1)[0] if row["our_dataset"] else ""
        unmeasured = not any(r["status"] == "measured" and r["our_dataset"] == row["our_dataset"] for r in rows)
        if name in data_missing and unmeasured and not row["published_source"]:
            if name not in reported:
                reported.add(name)
                out.append({**row, "connectivity": "", "intermediate": "", "setup": "",
                            "our_setup": f"missing: data not found at {data_missing[name]}"})  # fmt: skip
            continue
        out.append(row)
    return out


def _row(table, scale, published_row, source, config, run, context) -> dict[str, str]:
    row = dict.fromkeys(COLUMNS, "")
    row.update(table=table, scale=scale)
    if published_row is not None:
        row.update({c: published_row[c] for c in IDENTITY})
        row.update(published_source=source, published_kind=published_row["kind"])
        row.update({f"published_{m}": published_row.get(m, "") for m in COMPARED})
    else:  # a configuration without a published value: named in the paper's terms where the dataset is the paper's
        key = paper_key(config)
        if key is None:
            connectivity = config["connectivity"] or config["bottleneck"]
            key = (config["dataset"], config["features"], config["setup"], connectivity, config["intermediate"],
                   config["loss"])  # fmt: skip
        row.update(zip(IDENTITY, key))
        if config["setup"] == "mach":  # its decoding connects each label to one bucket per hash function
            row["connectivity"] = config["mach_hashes"]
    if config is None:
        row["status"] = "literature" if published_row and published_row["setup"] == "literature" else MISSING
        return row
    row.update(our_dataset=f"{config['dataset']} {config['features']}".strip(), our_setup=describe(config))
    # the paper's own dataset (not a stand-in named after it): only there is a difference to the paper meaningful
    row["paper_data"] = "yes" if (config["dataset"], config["features"]) in PAPER_DATASETS else "no"
    if row["paper_data"] == "no" and config["setup"] != "dense":
        for k, value in _published_vs_dense(config, published_row, context).items():
            row[f"published_p{k}_vs_dense"] = value
    if run is None:
        row["status"] = MISSING
        return row
    row["status"] = "measured"
    for m in COMPARED:
        row[f"ours_{m}"], row[f"ours_{m}_std"] = run.get(m, ""), run.get(f"{m}_std", "")
        if row[f"ours_{m}"] and row[f"published_{m}"] and row["paper_data"] == "yes":
            row[f"diff_{m}"] = f"{float(row[f'ours_{m}']) - float(row[f'published_{m}']):.6g}"
    if row["paper_data"] == "no" and config["setup"] != "dense":
        dense = dense_reference(run, context["runs"], context["settings"])
        if dense is not None:
            row["dense_run_ids"] = dense["run_ids"]
            for k in RATIO_KS:
                if dense[f"test_p{k}"] and float(dense[f"test_p{k}"]) >= MIN_DENSE_PK:
                    row[f"ours_p{k}_vs_dense"] = _ratio(run[f"test_p{k}"], dense[f"test_p{k}"])
    row.update(seeds=run["seeds"], runs=run["runs"], card=run["device"], sparse_backend=run["sparse_backend"])
    row.update(git_commit=run["git_commit"], run_ids=run["run_ids"])
    return row


# Below this test P@k (points) our dense model has learned next to nothing (a paper-scale synthetic run of one
# epoch), and a ratio to it is noise: no ratio is shown.
MIN_DENSE_PK = 1.0


def _ratio(value: str, reference: str) -> str:
    if not value or not reference or float(reference) == 0:
        return ""
    return f"{float(value) / float(reference):.6g}"


def dense_reference(run: dict, runs: list[dict], settings: dict) -> dict | None:
    """Our dense model without intermediate layer on the same data, scale and machine, trained at the run's settings
    but the head's own (export.same_settings: precision, epochs, batch size, ...; same loss and table first)."""
    same = [r for r in runs if r["setup"] == "dense" and not r["intermediate"]
            and all(r[c] == run[c] for c in ("scale", "dataset", "features", "device"))
            and same_settings(r, run, settings)]  # fmt: skip
    same.sort(key=lambda r: (r["loss"] != run["loss"], r["table"] != run["table"], r["table"]))
    return same[0] if same else None


def _paper_dense(published: list[dict], dataset: str, features: str) -> dict | None:
    for row in published:
        if (row["dataset"], row["features"], row["setup"], row["intermediate"]) == (dataset, features, "dense", ""):
            if row["table"] == "table1_architecture" and row["loss"] == "squared_hinge":
                return row
    return None


def _published_vs_dense(config: dict, published_row: dict | None, context: dict) -> dict[int, str]:
    """The paper's P@k ÷ its dense P@k for the configuration this row stands for; a range where several fit."""
    published = context["published"]
    if published_row is not None:
        candidates = [published_row]
    elif paper_key(config) is None:  # Bibtex, Delicious: the same kind of model on each of the paper's datasets
        sparse = config["setup"] in ("uniform", "unstructured")
        candidates = [
            r for r in published
            if r["table"] == context["paper_table"] and r["setup"] == config["setup"] and r["loss"] == config["loss"]
            and (not sparse or r["connectivity"] == config["connectivity"])
            and bool(r["intermediate"]) == bool(config["intermediate"])
        ]  # fmt: skip
    else:
        candidates = []
    ratios: dict[int, list[float]] = {k: [] for k in RATIO_KS}
    for row in candidates:
        dense = _paper_dense(published, row["dataset"], row["features"])
        for k in RATIO_KS:
            value = _ratio(row.get(f"test_p{k}", ""), dense[f"test_p{k}"] if dense else "")
            if value:
                ratios[k].append(float(value))
    return {k: _span(values) for k, values in ratios.items() if values}


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.6g}" if round(low, 2) == round(high, 2) else f"{low:.6g}..{high:.6g}"


def scales_to_show(runs: list[dict], table: str) -> list[str]:
    """Both defined scales always (never run = all missing), then any other scale that runs were tagged with."""
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


def _vs_dense(row: dict, k: int) -> str:
    """`ours / paper` ratio to the dense model, for rows on data other than the paper's."""
    if row["paper_data"] != "no" or row["setup"] == "dense" or row["status"] != "measured":
        return ""

    def fmt(value: str) -> str:
        return "–".join(f"{float(v):.2f}" for v in value.split("..")) if value else "—"

    ours = fmt(row[f"ours_p{k}_vs_dense"]) if row["dense_run_ids"] else NO_DENSE
    return f"{ours} / {fmt(row[f'published_p{k}_vs_dense'])}"


# Our side of a ratio to dense without a dense run to divide by, and what it means (said where it is shown).
NO_DENSE = "—ᵇ"
NO_DENSE_NOTE = ("ᵇ: no dense run of ours on the same data, scale and card at the row's settings (but the head's "
                 "own: precision, epochs, batch size, learning rate, ...), so no ratio to it.")


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
    columns += [(f"P@{k} ÷ dense ours / paper", lambda r, k=k: _vs_dense(r, k)) for k in RATIO_KS]
    columns += [
        ("Mem. GiB paper", lambda r: _published(r, "memory_gib")),
        ("Mem. GiB ours", lambda r: _ours(r, "memory_gib")),
        ("Our run", _our_run),
        ("Card", lambda r: r["card"]),
    ]
    return columns


FOOTNOTES = [
    "P@k in percent on the test split. Δ = ours − published, only for runs on the paper's own datasets. "
    "`missing`: in the preset's grid (or published) but no run record (results/records). — : not published, or "
    "not measured (peak GPU memory on a CPU run).",
    "P@k ÷ dense, for runs on other data (synthetic stand-ins, Bibtex, Delicious): our P@k divided by our dense "
    "model's (no intermediate layer) on the same data, scale and card, beside the paper's P@k divided by its dense "
    "model's on the dataset stood in for; for Bibtex and Delicious the range of that ratio over the paper's "
    "datasets for the same kind of model; none (—) where our dense model's P@k is below 1 point, as after one "
    "epoch on paper-scale synthetic data, whose rows measure memory and time. Absolute P@k of other data is not "
    "comparable with the paper's.",
    "ᵃ: from the authors' supplementary tables (xmc-aalto/ecml23-sparse), not the paper's table.",
    "Mem. GiB: ours is `torch.cuda.max_memory_allocated` from the start of `fit`, evaluations included (the CUDA "
    "context and the allocator's cache not included), the paper's TensorFlow's peak since its process started; a "
    "smoke run's model is far smaller than the paper's (a stand-in's few labels and inputs, an intermediate layer "
    "128 times narrower), so its memory is not comparable with the published value.",
    "Conn.: connections per label (dense: the input size; bottleneck: its width). Inter.: the paper's size of the "
    "intermediate layer (for a stand-in; Bibtex and Delicious show their own); a smoke run's actual, 128 times "
    "narrower, width is in *Our run*.",
]


def markdown(table: str, blocks: list[tuple[str, list[dict]]]) -> str:
    lines = [f"# {paper.TITLES[table]}", ""]
    all_rows = [r for _, rows in blocks for r in rows]
    columns = display_columns(all_rows)
    for scale, rows in blocks:
        measured = sum(r["status"] == "measured" for r in rows)
        # a configuration run on several cards has a row per card (export.machine): count it once
        configs = len({(r["our_dataset"], r["our_setup"], r["loss"]) for r in rows if r["status"] == "measured"})
        missing = sum(r["status"] == MISSING for r in rows)
        note = SCALE_NOTES.get(scale, "runs tagged with this scale")
        count = f"{configs} configurations measured"
        if measured != configs:
            count += f" ({measured} rows, one per configuration and card)"
        lines += [f"## Scale `{scale}`: {note}", "", f"{count}, {missing} missing.", ""]
        lines.append("| " + " | ".join(h for h, _ in columns) + " |")
        lines.append("|" + "|".join("---" for _ in columns) + "|")
        for row in rows:
            lines.append("| " + " | ".join(cell(row).replace("|", "\\|") for _, cell in columns) + " |")
        lines.append("")
    if table in ("table2", "table3"):
        lines.append("The paper publishes tables 2 and 3 as differences to the dense row; the published values "
                     "here are those differences added back to the dense row.")  # fmt: skip
        lines.append("")
    notes = [*FOOTNOTES, NO_DENSE_NOTE] if any(NO_DENSE in line for line in lines) else FOOTNOTES
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


_TEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                "±": r"$\pm$", "Δ": r"$\Delta$", "—": "--", "ᵃ": r"\textsuperscript{a}",
                "ᵇ": r"\textsuperscript{b}", "−": "-",
                "÷": r"$\div$", "–": "--"}  # fmt: skip


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
    with replacing(path, RERUN, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def render_tables(runs: list[dict], published: list[dict], out_dir: Path, expected,
                  data_missing: dict[str, str] | None = None,
                  settings: dict | None = None) -> dict[str, list]:  # fmt: skip
    """Write table{1..5}.{md,tex,csv}; `expected(table, scale)` gives the preset's grid (grid.read_grid), `settings`
    the runs' (export.shared_settings), which a dense reference must share."""
    rendered = {}  # out_dir is made by the first write into it (atomic.replacing)
    for table in TABLES:
        blocks = []
        for scale in scales_to_show(runs, table):
            blocks.append((scale, table_rows(table, scale, runs, expected(table, scale), published, data_missing,
                                             settings)))
        rows = [r for _, block in blocks for r in block]
        write_text(out_dir / f"{table}.md", markdown(table, blocks), RERUN)
        write_text(out_dir / f"{table}.tex", latex(table, blocks), RERUN)
        write_csv(rows, out_dir / f"{table}.csv")
        rendered[table] = rows
    written = {out_dir / f"{table}.{ext}" for table in TABLES for ext in ("md", "tex", "csv")}
    for stale in {p for ext in ("md", "tex", "csv") for p in out_dir.glob(f"*.{ext}")} - written:  # a table dropped
        stale.unlink()
    return rendered

