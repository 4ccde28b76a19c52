"""`python -m xmc_repro.report`: the paper's tables from the run records in results/records/.

By hand: `smoke` trains the smoke sweeps into an MLflow store, `records add [URI]` copies a store's finished runs
into records, `grid` lists the presets' configurations. The stages of dvc.yaml (no training, only records in):
`export` (records -> runs.csv), `render` (tables, figures), `claims` (results/claims.md).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from xmc_repro.errors import UserError

RESULTS = Path("results")


def parser() -> argparse.ArgumentParser:
    from xmc_repro.report.grid import TABLES

    main = argparse.ArgumentParser(prog="python -m xmc_repro.report", description=__doc__)
    commands = main.add_subparsers(dest="command", required=True)
    smoke = commands.add_parser("smoke", help="train the smoke sweeps (CPU, minutes per table) into an MLflow store")
    smoke.add_argument("--tables", nargs="+", default=None, choices=TABLES, help="e.g. table1 table4 (default: all)")
    smoke.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlruns.db)")
    smoke.add_argument("--data-missing", type=Path, default=RESULTS / "data_missing.json")
    records = commands.add_parser("records", help="run records (results/records/*.json)")
    records_commands = records.add_subparsers(dest="action", required=True)
    add = records_commands.add_parser("add", help="copy the finished table runs of an MLflow store into records")
    add.add_argument("tracking_uri", nargs="?", help="default: $MLFLOW_TRACKING_URI or sqlite:///mlruns.db")
    add.add_argument("--dir", type=Path, default=RESULTS / "records",
                     help="an existing folder of records (default: results/records); create a new one first "
                          "(mkdir), so that a mistyped path writes nothing")  # fmt: skip
    export = commands.add_parser("export", help="records -> runs.csv (one row per configuration and machine)")
    export.add_argument("--records", type=Path, default=RESULTS / "records")
    export.add_argument("--out", type=Path, default=RESULTS / "runs.csv")
    grid = commands.add_parser("grid", help="every configuration of the sweep presets (conf/experiment) -> grid.csv")
    grid.add_argument("--out", type=Path, default=RESULTS / "grid.csv")
    render = commands.add_parser("render", help="runs.csv + grid.csv -> tables (md, tex, csv) and figures")
    render.add_argument("--runs", type=Path, default=RESULTS / "runs.csv")
    render.add_argument("--records", type=Path, default=RESULTS / "records",
                        help="the records runs.csv came from: the settings a ratio's dense run must share")
    render.add_argument("--grid", type=Path, default=RESULTS / "grid.csv")
    render.add_argument("--paper", type=Path, help="published numbers (default: results/paper_results.csv)")
    render.add_argument("--data-missing", type=Path, default=RESULTS / "data_missing.json")
    render.add_argument("--tables", type=Path, default=RESULTS / "tables")
    render.add_argument("--figures", type=Path, default=RESULTS / "figures")
    claims = commands.add_parser("claims", help="runs.csv -> the paper's claims, verdicted (claims.md)")
    claims.add_argument("--runs", type=Path, default=RESULTS / "runs.csv")
    claims.add_argument("--records", type=Path, default=RESULTS / "records",
                        help="the records runs.csv came from: the settings a uniform and a dense run must share")
    claims.add_argument("--out", type=Path, default=RESULTS / "claims.md")
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from xmc_repro.report.smoke import SweepFailed, SweepInterrupted

    try:
        run(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SweepFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except SweepInterrupted as error:
        print(f"error: {error}", file=sys.stderr)
        return 130
    return 0


def run(args) -> None:
    if args.command == "smoke":
        from xmc_repro.report.grid import TABLES
        from xmc_repro.report.smoke import run_smoke

        run_smoke(args.tables or TABLES, args.tracking_uri, args.data_missing)
        print("smoke: done; copy the runs into results/records with `python -m xmc_repro.report records add`")
    elif args.command == "records":
        from xmc_repro.errors import DataError
        from xmc_repro.report.records import add_from_store, skipped_line, tracking_uri, uncommitted_line

        _check_records_dir(args.dir)
        counts = add_from_store(args.tracking_uri, args.dir)
        print(f"{args.dir}: {counts['new']} new, {counts['updated']} updated, {counts['unchanged']} unchanged "
              f"records from {tracking_uri(args.tracking_uri)}{skipped_line(counts['skipped'], counts['unusable'])}"
              f"{uncommitted_line(counts['uncommitted'])}")  # fmt: skip
    elif args.command == "export":
        from xmc_repro.errors import DataError
        from xmc_repro.report.export import export

        if not args.records.is_dir():  # a typo would write an empty runs.csv over the committed one
            raise DataError(f"{args.records}: no such folder of run records; give --records results/records")
        rows = export(args.out, args.records)
        print(f"{args.out}: {len(rows)} configurations from {args.records}")
    elif args.command == "grid":
        from xmc_repro.report.grid import write_grid

        print(f"{args.out}: {write_grid(args.out)} configurations in the presets' grids")
    elif args.command == "render":
        render_all(args.runs, args.grid, args.paper, args.data_missing, args.tables, args.figures, args.records)
    else:
        from xmc_repro.report.claims import write_claims
        from xmc_repro.report.export import read_runs_csv

        runs = read_runs_csv(args.runs)
        verdicts = write_claims(runs, args.out, _shared_settings(args.records))
        print(f"{args.out}: " + ", ".join(f"{claim} {verdict}" for claim, verdict in verdicts.items()))


def _check_records_dir(directory: Path) -> None:
    """`records add` writes into an existing folder only: the default one outside the project's root, or a mistyped
    --dir, would otherwise start a folder of records that no export reads."""
    from xmc_repro.errors import DataError

    if directory.is_dir():
        return
    if directory == RESULTS / "records":
        raise DataError(f"{directory.resolve()}: no records folder here; run from the project's root or give "
                        "--dir PATH/results/records")
    raise DataError(f"{directory}: no such folder of run records; give the existing one (e.g. --dir results/records) "
                    f"or, for a new one, create it first (mkdir -p {shlex.quote(str(directory))})")


def _published(path: Path | None) -> list[dict]:
    from xmc_repro.report import paper

    return paper.load(path or paper.PAPER_CSV)


def _shared_settings(records_dir: Path) -> dict[str, dict[str, str]]:
    """export.shared_settings of the records in `records_dir`, which runs.csv does not carry."""
    from xmc_repro.errors import DataError
    from xmc_repro.report.export import shared_settings
    from xmc_repro.report.records import load

    if not records_dir.is_dir():  # without them no dense run would be found at a run's settings
        raise DataError(f"{records_dir}: no such folder of run records; give --records results/records")
    return shared_settings(load(records_dir))


def render_all(runs_csv: Path, grid_csv: Path, paper_csv: Path | None, data_missing: Path, tables_dir: Path,
               figures_dir: Path, records_dir: Path = RESULTS / "records") -> None:  # fmt: skip
    from xmc_repro.report.export import read_runs_csv
    from xmc_repro.report.figures import render_figures
    from xmc_repro.report.grid import read_grid
    from xmc_repro.report.render import render_tables
    from xmc_repro.report.smoke import read_data_missing

    runs, published = read_runs_csv(runs_csv), _published(paper_csv)
    settings = _shared_settings(records_dir)
    rendered = render_tables(runs, published, tables_dir, read_grid(grid_csv), read_data_missing(data_missing),
                             settings)
    for table, rows in rendered.items():
        measured = sum(r["status"] == "measured" for r in rows)
        missing = sum(r["status"] == "missing" for r in rows)
        print(f"{tables_dir / table}.{{md,tex,csv}}: {measured} measured, {missing} missing")
    names = render_figures(runs, published, figures_dir, settings)
    print(f"{figures_dir}: {len(names)} figures, index in {figures_dir / 'README.md'}")


if __name__ == "__main__":
    sys.exit(main())
