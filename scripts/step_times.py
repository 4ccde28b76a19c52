"""The training step's wall time over each run of an MLflow store, from the curve `train/ms_per_step`
(`xmc_repro.callbacks.EpochTime`: the mean over each window of `callbacks.time.step_window` batches).

    python scripts/step_times.py [STORE]      (default sqlite:///mlruns.db)

One markdown row per run with such a curve: the median ms per step of each quarter of its windows, in order (early
steps, whose squared-hinge gradients are dense, are the slowest), and of all of them. Windows with a rewiring or
a checkpoint are slower; a quarter's median is not moved by a few of them.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def quarters(values: list[float]) -> list[float]:
    """Medians of the four consecutive quarters of `values` (some may be empty below 4 values: left out)."""
    n = len(values)
    parts = [values[n * i // 4: n * (i + 1) // 4] for i in range(4)]
    return [statistics.median(p) for p in parts if p]


def main(store: str = "sqlite:///mlruns.db") -> tuple[int, int]:
    """Prints the table (nothing without a row); returns (runs with a curve, runs in the store)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs, token = [], None
    while experiments:  # page by page: one call returns at most 1,000 runs, a sweep's store holds more
        page = client.search_runs(experiments, order_by=["attributes.start_time ASC"], page_token=token)
        runs += page
        token = page.token
        if not token:
            break
    rows = 0
    for run in runs:
        history = sorted(client.get_metric_history(run.info.run_id, "train/ms_per_step"), key=lambda m: m.step)
        values = [m.value for m in history]
        if not values:
            continue
        if not rows:
            print("| run | name | precision | kernels | windows | ms per step by quarter of the run | median |")
            print("|---|---|---|---|---:|---|---:|")
        rows += 1
        by_quarter = " / ".join(f"{v:.2f}" for v in quarters(values))
        precision = run.data.params.get("trainer/precision", "")
        print(f"| `{run.info.run_id[:8]}` | {run.info.run_name} | {precision} | {run.data.tags.get('sparse_backend', '')} "
              f"| {len(values)} | {by_quarter} | {statistics.median(values):.2f} |")
    return rows, len(runs)


def cli(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python scripts/step_times.py", description=__doc__.split("\n")[0])
    ap.add_argument("store", nargs="?", default="sqlite:///mlruns.db",
                    help="MLflow tracking URI of the runs (default sqlite:///mlruns.db)")
    args = ap.parse_args(argv)
    if "://" not in args.store and args.store.endswith(".db"):  # a path: MLflow would take it for a file store
        args.store = f"sqlite:///{Path(args.store).resolve()}"
    # MLflow creates a missing SQLite store (and its folder): a mistyped path printed an empty table, exit 0; and it
    # wrote its tables into another SQLite file (another project's database).
    from xmc_repro import tracking
    from xmc_repro.errors import ConfigError

    fix = "give the store the runs logged to (their MLFLOW_TRACKING_URI)"
    try:
        tracking.check_store(args.store, setting="")  # a folder, a server that does not answer: not minutes of retries
    except ConfigError as error:
        ap.error(str(error))
    database = tracking.sqlite_path(args.store)
    if database is not None and not database.is_file():
        ap.error(f"{args.store}: no such database; {fix}")
    problem = tracking.not_a_store(database) if database is not None else None
    if problem:
        ap.error(f"{args.store}: {problem}, not an MLflow store; {fix}")
    try:
        rows, runs = main(args.store)
    except Exception as error:  # a file store, an unknown scheme, an old schema: MLflow's long tracebacks
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        ap.error(f"{args.store}: cannot read runs from this MLflow store ({reason}); {fix}")
    if not rows:  # was a table's header alone, exit 0
        ap.error(f"{args.store}: none of its {runs} runs has a train/ms_per_step curve; {fix}")


if __name__ == "__main__":
    cli()
