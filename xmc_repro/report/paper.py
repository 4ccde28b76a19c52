"""The published numbers: results/paper_results.csv (the project's copy of the paper's tables)."""

from __future__ import annotations

from pathlib import Path

from xmc_repro.report.csv_file import read_rows

PAPER_CSV = Path(__file__).resolve().parents[2] / "results" / "paper_results.csv"

# Our table tag -> the paper's table in paper_results.csv.
PAPER_TABLES = {
    "table1": "table1_architecture",
    "table2": "table2_size_amazon",
    "table3": "table3_size_wikipedia",
    "table4": "table4_loss",
    "table5": "table5_sota",
}
# The authors' supplementary tables: published values for rows that the paper's tables leave out.
SUPPLEMENT = "authors_readme"
TITLES = {
    "table1": "Table 1: architectures (dense, unstructured and uniform sparse, with and without intermediate layer)",
    "table2": "Table 2: size of the intermediate layer and connectivity, Amazon-670K",
    "table3": "Table 3: size of the intermediate layer and connectivity, Wikipedia-500K",
    "table4": "Table 4: squared hinge vs binary cross-entropy (uniform 32, 16k intermediate layer)",
    "table5": "Table 5: uniform 64 with a 65k intermediate layer beside the literature",
}


COLUMNS = ("table", "dataset", "features", "setup", "connectivity", "intermediate", "loss", "kind")
NUMERIC = ("test_p1", "test_p3", "test_p5", "train_p1", "train_p3", "train_p5", "memory_gib", "epochs",
           "time_per_epoch_s", "runs")  # fmt: skip


def load(path: Path = PAPER_CSV) -> list[dict[str, str]]:
    remedy = f"fix it or restore the project's copy, `git checkout -- {path}`"
    return read_rows(path, COLUMNS + NUMERIC, NUMERIC, remedy)


def row_key(row: dict) -> tuple[str, ...]:
    """A published row's name, comparable with identity.paper_key."""
    return tuple(row[c] for c in ("dataset", "features", "setup", "connectivity", "intermediate", "loss"))
