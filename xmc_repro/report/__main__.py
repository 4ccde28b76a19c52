"""`python -m xmc_repro.report {smoke,export,grid,render}`: the stages of dvc.yaml, runnable by hand;
`merge` copies runs made elsewhere (e.g. on a GPU machine) into the local store before `export`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from xmc_repro.errors import UserError

RESULTS = Path("results")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmc_repro.report", description=__doc__)
    parser.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlruns.db)")
    commands = parser.add_subparsers(dest="command", required=True)
    smoke = commands.add_parser("smoke", help="run the smoke sweep of every table that has no smoke runs yet")
    smoke.add_argument("--marker", type=Path, default=RESULTS / "smoke_runs.json")
    export = commands.add_parser("export", help="finished runs of the paper's tables -> runs.csv")
    export.add_argument("--out", type=Path, default=RESULTS / "runs.csv")
    merge = commands.add_parser("merge", help="copy finished table runs from another store into this one")
    merge.add_argument("source", help="the other store's tracking URI, e.g. sqlite:///gpu-mlruns.db")
    grid = commands.add_parser("grid", help="every configuration of the sweep presets (conf/experiment) -> grid.csv")
    grid.add_argument("--out", type=Path, default=RESULTS / "grid.csv")
    render = commands.add_parser("render", help="runs.csv + grid.csv -> tables (md, tex, csv) and figures")
    render.add_argument("--runs", type=Path, default=RESULTS / "runs.csv")
    render.add_argument("--grid", type=Path, default=RESULTS / "grid.csv")
    render.add_argument("--paper", type=Path, help="published numbers (default: results/paper_results.csv)")
    render.add_argument("--tables", type=Path, default=RESULTS / "tables")
    render.add_argument("--figures", type=Path, default=RESULTS / "figures")
    args = parser.parse_args(argv)

    from xmc_repro.report.smoke import SweepFailed

    try:
        if args.command == "smoke":
            from xmc_repro.report.smoke import ensure_smoke_runs

            counts = ensure_smoke_runs(args.marker, args.tracking_uri)
            print(f"smoke runs per table: {counts}")
        elif args.command == "export":
            from xmc_repro.report.export import export as export_runs

            rows = export_runs(args.out, args.tracking_uri)
            print(f"{args.out}: {len(rows)} configurations")
        elif args.command == "merge":
            from xmc_repro.report.merge import merge_runs

            print(f"{merge_runs(args.source, args.tracking_uri)} runs copied from {args.source}")
        elif args.command == "grid":
            from xmc_repro.report.grid import write_grid

            print(f"{args.out}: {write_grid(args.out)} configurations in the presets' grids")
        else:
            render_all(args.runs, args.grid, args.paper, args.tables, args.figures)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SweepFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def render_all(runs_csv: Path, grid_csv: Path, paper_csv: Path | None, tables_dir: Path, figures_dir: Path) -> None:
    from xmc_repro.errors import DataError
    from xmc_repro.report import paper
    from xmc_repro.report.export import read_runs_csv
    from xmc_repro.report.figures import render_figures
    from xmc_repro.report.grid import read_grid
    from xmc_repro.report.render import render_tables

    for path, command in ((runs_csv, "export"), (grid_csv, "grid")):
        if not path.exists():
            raise DataError(f"{path}: not found; write it first with `python -m xmc_repro.report {command}`")
    runs = read_runs_csv(runs_csv)
    published = paper.load(paper_csv or paper.PAPER_CSV)
    rendered = render_tables(runs, published, tables_dir, read_grid(grid_csv))
    for table, rows in rendered.items():
        measured = sum(r["status"] == "measured" for r in rows)
        missing = sum(r["status"] == "missing" for r in rows)
        print(f"{tables_dir / table}.{{md,tex,csv}}: {measured} measured, {missing} missing")
    names = render_figures(runs, published, figures_dir)
    print(f"{figures_dir}: memory vs P@1 for {', '.join(names)}")


if __name__ == "__main__":
    sys.exit(main())
