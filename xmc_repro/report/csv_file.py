"""Reading the report's CSV inputs (runs.csv, grid.csv, paper_results.csv) so that a damaged file is one line.

These files are written by the report's stages or committed as data; a hand edit that drops a column, breaks a row
or puts a word where a number belongs is named by file, line and column, with how to get the file back, instead of
surfacing later as a KeyError or ValueError deep in the rendering.
"""

from __future__ import annotations

import csv
from pathlib import Path

from xmc_repro.errors import DataError


def read_rows(path: Path, columns: tuple[str, ...], numeric: tuple[str, ...], remedy: str) -> list[dict[str, str]]:
    """The rows of `path` as dicts, after checking that the header has `columns`, that every row has as many fields
    as the header, and that each `numeric` column holds a number or nothing. `remedy` ends each error line."""
    if not path.is_file():
        raise DataError(f"{path}: not found; {remedy}")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            lines = [(reader.line_num, fields) for fields in reader]
    except (UnicodeDecodeError, csv.Error) as error:
        raise DataError(f"{path}: not a readable CSV file ({error}); {remedy}") from None
    missing = [c for c in columns if c not in header]
    if missing:
        raise DataError(f"{path}:1: the header lacks the column{'s' * (len(missing) > 1)} {', '.join(missing)}; "
                        f"{remedy}")  # fmt: skip
    rows = []
    for line, fields in lines:
        if not fields:  # a blank line, as csv.DictReader skips it
            continue
        if len(fields) != len(header):
            raise DataError(f"{path}:{line}: {len(fields)} fields where the header has {len(header)}; {remedy}")
        row = dict(zip(header, fields))
        for column in numeric:
            if not _number_or_empty(row[column]):
                raise DataError(f"{path}:{line}: {column} is {row[column]!r}, not a number; {remedy}")
        rows.append(row)
    return rows


def _number_or_empty(value: str) -> bool:
    if value == "":
        return True
    try:
        float(value)
    except ValueError:
        return False
    return True
