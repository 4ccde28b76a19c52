"""The runs the READMEs cite are the committed ones: a record each, and the run runs.csv holds for its
configuration, machine and seed. README.md quoted runs that a later run of the same configuration and seed had
replaced in runs.csv (`81b599ad`, `ad3bbd76`, `5f748d02`, `a0b28217`)."""

import csv
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "results/bench/README.md", "cuda_ext/README.md")
# Runs quoted as earlier results, beside the commit they ran at; runs.csv holds a later run of each.
EARLIER = {"f67a0253", "9f30c43e", "add998dc", "fd0cb40a", "11b0a2b2", "6e657728", "977a33b2", "6ccc7d9b",
           "05ddd53c", "f39e37c3", "39c73260", "91296715", "02d68d99"}


def _cited():
    """(doc, run id prefix, the text block around it and its section heading) for each `xxxxxxxx` a doc cites."""
    for doc in DOCS:
        heading = ""
        for block in re.split(r"\n\s*\n", (ROOT / doc).read_text(encoding="utf-8")):
            heading = next((line for line in reversed(block.splitlines()) if line.startswith("#")), heading)
            for prefix in re.findall(r"`([0-9a-f]{8})`", block):
                yield doc, prefix, block + "\n" + heading


def test_every_cited_run_is_a_record_and_current_in_runs_csv():
    records = {}
    for path in (ROOT / "results" / "records").glob("*.json"):
        record = json.loads(path.read_text())
        records[record["run_id"]] = record
    with open(ROOT / "results" / "runs.csv", newline="") as f:
        current = {run for row in csv.DictReader(f) for run in row["run_ids"].split(";")}
    cited = list(_cited())
    assert cited
    for doc, prefix, context in cited:
        matches = [run for run in records if run.startswith(prefix)]
        assert len(matches) == 1, f"{doc} cites run {prefix}: {len(matches)} records in results/records"
        run = matches[0]
        if prefix in EARLIER:
            commit = records[run]["tags"]["git_commit"][:7]
            assert f"`{commit}`" in context, f"{doc} quotes the earlier run {prefix} without its commit {commit}"
        else:
            assert run in current, (f"{doc} cites run {prefix}, which runs.csv no longer holds (a later run of its "
                                    "configuration replaced it): cite that run, or quote it as an earlier one")
    assert EARLIER <= {prefix for _, prefix, _ in cited}, "EARLIER lists runs no README cites"
