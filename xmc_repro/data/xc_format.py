"""Extreme Classification Repository text files: reader and writer.

Two layouts share one parser:

* XC bag-of-words (``train.txt``): header ``points features labels``, then one line per point
  ``l1,l2,... f:v f:v ...``; a point without labels starts with a space.
* sparse matrix (``trn_X_Y.txt`` labels, ``trn_X_Xf.txt`` features): header ``rows columns``, then
  ``c:v c:v ...`` per row.

Files are read in chunks of whole lines and every chunk is parsed with vectorised numpy (no Python
object per token), so time and memory are linear in the file size. A chunk that fails a check is
re-read line by line to name the offending ``path:line`` (lines are 1-based; the header is line 1).
A UTF-8 byte-order mark and Windows line ends (CRLF) are read as if absent; UTF-16 and UTF-32 text and classic Mac line
ends (a bare CR) are refused, naming the conversion.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmc_repro.data.labels import LabelCSR
from xmc_repro.errors import DataError

CHUNK_BYTES = 8 << 20  # bytes of whole lines parsed at once; the parse peaks at ~30x this
_SP, _NL, _COMMA, _COLON = (ord(c) for c in " \n,:")
_DIGIT_LO, _DIGIT_HI = ord("0"), ord("9")
_BOM = b"\xef\xbb\xbf"
_GZIP = b"\x1f\x8b"
# UTF-32's byte-order marks first: little-endian UTF-32's begins with UTF-16's
_WIDE_TEXT = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))


@dataclass
class XCData:
    """One split as read from an XC file: sparse features and label lists."""

    features: sp.csr_matrix | None  # (points, features) float32; None when read with labels_only
    labels: LabelCSR
    num_features: int
    path: Path
    blank_lines: np.ndarray | None = None  # file lines (1-based) of points without labels or features
    repeated_feature_lines: np.ndarray | None = None  # file lines (1-based) listing a feature index twice (summed)


# --------------------------------------------------------------------------------------------- reading


def first_line(path: Path) -> bytes:
    """The file's first line (byte-order mark dropped); DataError when it is no readable text file."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a data file; name the file inside it")
    if not path.is_file():
        raise DataError(f"{path}: file not found; check the path (or the dataset.data_dir setting)")
    try:
        with path.open("rb") as fh:
            first = fh.readline()
    except OSError as error:  # PermissionError, an unreadable disk
        raise DataError(f"{path}: cannot be read ({error.strerror or error}); make it readable (e.g. chmod a+r)") from None
    if first.startswith(_GZIP):
        raise DataError(f"{path}: gzip-compressed; decompress it first (gunzip -k {path}) and use the .txt file")
    # NUL bytes between the characters: read as one malformed header of garbage
    encoding = next((name for mark, name in _WIDE_TEXT if first.startswith(mark)), None)
    if encoding is None and b"\x00" in first:
        encoding = "UTF-16 or UTF-32"  # without a byte-order mark
    if encoding:
        raise DataError(f"{path}: {encoding} text (NUL bytes in its first line); save it as UTF-8 or ASCII (iconv -f "
                        f"{encoding.split()[0]} -t UTF-8 {path} > NEW)")
    return first.removeprefix(_BOM)


INT32_MAX = 2**31 - 1


def read_header(path: Path, fields: int) -> tuple[int, ...]:
    """The header's ``fields`` non-negative integers; DataError for a missing, empty or malformed file."""
    path = Path(path)
    first = first_line(path)
    if not first.strip():
        raise DataError(f"{path}:1: empty file (or empty header line); expected a header of {fields} numbers")
    if b"\r" in first.rstrip(b"\r\n"):  # classic Mac line ends: the whole file reads as its first line
        raise DataError(f"{path}:1: lines end in a bare carriage return (CR), not a newline; convert them "
                        f"(tr '\\r' '\\n' < {path} > NEW)")
    parts = first.split()
    names = "points features labels" if fields == 3 else "rows columns"
    if len(parts) != fields or not all(p.isdigit() for p in parts):
        shown = first.decode("utf-8", "replace").strip()[:80]
        raise DataError(f"{path}:1: malformed header {shown!r}; expected {fields} non-negative integers '{names}'")
    counts = tuple(int(p) for p in parts)
    if max(counts) > INT32_MAX:  # indices are stored as int32 (as torch's and scipy's CSR take them)
        raise DataError(f"{path}:1: the header declares {max(counts)} {names.split()[counts.index(max(counts))]}, "
                        f"more than the {INT32_MAX} this reader indexes; fix the header")
    return counts


def read_xc(path: str | Path, labels_only: bool = False) -> XCData:
    """Read an XC bag-of-words file (header ``points features labels``).

    ``labels_only`` parses just the label field (for files whose features come from elsewhere, as
    the authors' ``train-labels.txt`` beside ``.npy`` embeddings); the feature part is then not checked.
    """
    path = Path(path)
    points, num_features, num_labels = read_header(path, 3)
    if num_labels == 0 or (num_features == 0 and not labels_only):
        what = "label" if num_labels == 0 else "feature"
        raise DataError(f"{path}:1: the header declares 0 {what}s; fix it to the dataset's {what} count "
                        "(header: 'points features labels')")
    rows = _read_rows(path, points, num_labels, num_features, has_labels=True, labels_only=labels_only)
    labels = LabelCSR(rows.label_ptr, rows.label_idx, num_labels).deduplicated()
    features = None if labels_only else rows.feature_matrix(num_features)
    blank_lines = None if labels_only else np.flatnonzero(rows.blank) + 2  # a labels-only blank: a point without labels
    # lines that listed a feature index twice: sum_duplicates left them fewer entries
    repeated = None if labels_only else np.flatnonzero(np.diff(features.indptr) < np.diff(rows.feat_ptr)) + 2
    return XCData(features, labels, num_features, path, blank_lines, repeated)


def _read_matrix_rows(path: Path) -> tuple[_Rows, int]:
    """The parsed rows of a sparse matrix file (header ``rows columns``, lines ``c:v ...``) and its column count."""
    n_rows, n_cols = read_header(path, 2)
    if n_cols == 0:
        raise DataError(f"{path}:1: the header declares 0 columns; it must give the column count (line 1: 'rows columns')")
    return _read_rows(path, n_rows, 0, n_cols, has_labels=False, labels_only=False), n_cols


def read_sparse_matrix(path: str | Path) -> sp.csr_matrix:
    """Read a sparse matrix file (header ``rows columns``, lines ``c:v ...``) as float32 CSR."""
    rows, n_cols = _read_matrix_rows(Path(path))
    return rows.feature_matrix(n_cols)


def read_sparse_labels(path: str | Path) -> LabelCSR:
    """Label lists from a sparse label file (``trn_X_Y.txt`` style); the values (weights) are ignored."""
    rows, n_cols = _read_matrix_rows(Path(path))
    return LabelCSR(rows.feat_ptr, rows.feat_idx_all, n_cols).deduplicated()  # in file order until deduplicated


def read_labels(path: str | Path) -> LabelCSR:
    """Label lists from either layout, told apart by the header: 3 numbers = XC file, 2 = sparse label file."""
    path = Path(path)
    fields = len(first_line(path).split())
    if fields == 2:
        return read_sparse_labels(path)
    return read_xc(path, labels_only=True).labels  # raises for a malformed header


class _Rows:
    """Parsed rows, accumulated over chunks."""

    def __init__(self):
        self.label_counts, self.labels, self.feat_counts, self.feat_idx, self.feat_val = [], [], [], [], []
        self.blanks = []

    def add(self, label_counts, labels, feat_counts, feat_idx, feat_val, blank):
        self.blanks.append(blank)
        self.label_counts.append(label_counts)
        self.labels.append(labels)
        self.feat_counts.append(feat_counts)
        self.feat_idx.append(feat_idx)
        self.feat_val.append(feat_val)

    def finish(self, n: int):
        cat = lambda parts, dtype: np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
        label_counts = cat(self.label_counts, np.int64)[:n]
        feat_counts = cat(self.feat_counts, np.int64)[:n]
        self.blank = cat(self.blanks, bool)[:n]  # lines holding nothing but white space
        self.label_ptr = _ptr(label_counts)
        self.label_idx = cat(self.labels, np.int64)[: self.label_ptr[-1]]
        self.feat_ptr = _ptr(feat_counts)
        self.feat_idx_all = cat(self.feat_idx, np.int32)[: self.feat_ptr[-1]]
        self.feat_val_all = cat(self.feat_val, np.float32)[: self.feat_ptr[-1]]
        return self

    def feature_matrix(self, num_cols: int) -> sp.csr_matrix:
        n = len(self.feat_ptr) - 1
        m = sp.csr_matrix((self.feat_val_all, self.feat_idx_all, self.feat_ptr), shape=(n, num_cols))
        m.sum_duplicates()  # also sorts the indices of each row
        return m


def _ptr(counts: np.ndarray) -> np.ndarray:
    ptr = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def _read_rows(path, n_rows, num_labels, num_cols, has_labels, labels_only) -> _Rows:
    rows = _Rows()
    line_no = 2  # file line of the first data row
    with path.open("rb") as fh:
        fh.readline()
        rest = b""
        while True:
            block = fh.read(CHUNK_BYTES)
            data = rest + block
            if not block:  # end of file: the last line may lack its newline
                if data:
                    rows.add(*_parse_chunk(path, data + b"\n", line_no, num_labels, num_cols, has_labels, labels_only))
                    line_no += 1
                break
            cut = data.rfind(b"\n") + 1
            data, rest = data[:cut], data[cut:]
            if data:
                rows.add(*_parse_chunk(path, data, line_no, num_labels, num_cols, has_labels, labels_only))
                line_no += data.count(b"\n")
    seen = line_no - 2
    if seen < n_rows:
        raise DataError(
            f"{path}:{line_no}: the file ends after {seen} data lines but its header (line 1) declares {n_rows}; "
            "restore the missing lines or fix the header"
        )
    rows.finish(seen)
    if seen > n_rows:
        # Blank lines after the last point are harmless; anything else means the header is wrong, or a blank
        # line inside the data (read as a point without labels or features) shifted the points after it.
        nonblank = np.flatnonzero(~rows.blank)
        data_lines = int(nonblank[-1]) + 1 if len(nonblank) else 0
        inner_blank = np.flatnonzero(rows.blank[:data_lines])
        if data_lines > n_rows and len(inner_blank):
            raise DataError(
                f"{path}:{int(inner_blank[0]) + 2}: blank line inside the data; the file has {data_lines} data lines "
                f"but its header (line 1) declares {n_rows} points: remove the blank line"
                f"{'s' if len(inner_blank) > 1 else ''} ({len(inner_blank)} in all)"
            )
        if data_lines > n_rows:
            raise DataError(
                f"{path}:{n_rows + 2}: more data lines than the {n_rows} points declared in the header (line 1); "
                "fix the header's point count or remove the extra lines"
            )
        rows.finish(n_rows)
    return rows


def _parse_chunk(path, data: bytes, first_line: int, num_labels, num_cols, has_labels, labels_only):
    """Parse whole lines; returns per-line label counts, labels, per-line feature counts, indices, values."""
    a = np.frombuffer(data, np.uint8).copy()
    a[(a == ord("\t")) | (a == ord("\r"))] = _SP
    is_nl = a == _NL
    line_end = np.flatnonzero(is_nl)
    n_lines = len(line_end)
    line_start = np.concatenate(([0], line_end[:-1] + 1))
    line_of = np.cumsum(is_nl, dtype=np.int32) - is_nl  # line index (within the chunk) of every byte
    is_sep = is_nl | (a == _SP)
    blank = np.bincount(line_of[~is_sep], minlength=n_lines) == 0
    is_digit = (a >= _DIGIT_LO) & (a <= _DIGIT_HI)
    bad = np.zeros(n_lines, bool)  # lines that fail a format check

    # The label field runs from the line start to the first space: digits and commas, each comma between digits.
    if has_labels:
        spaces = np.append(np.flatnonzero(a == _SP), len(a))  # with a sentinel past the end
        field_end = np.minimum(spaces[np.searchsorted(spaces, line_start)], line_end)
    else:
        field_end = line_start
    marks = np.zeros(len(a) + 1, np.int8)  # +1 where a label field opens, -1 where it closes
    marks[line_start] += 1
    marks[field_end] -= 1
    in_field = np.cumsum(marks[:-1], dtype=np.int8) > 0
    bad[line_of[in_field & ~is_digit & (a != _COMMA)]] = True
    commas = np.flatnonzero(in_field & (a == _COMMA))
    digit_padded = np.concatenate(([False], is_digit, [False]))
    bad[line_of[commas[~(digit_padded[commas] & digit_padded[commas + 2])]]] = True
    label_counts = np.where(field_end > line_start, np.bincount(line_of[commas], minlength=n_lines) + 1, 0)

    if labels_only:
        feat_counts = np.zeros(n_lines, np.int64)
        text = a[in_field | is_nl]
        text[(text == _COMMA) | (text == _NL)] = _SP
    else:
        # Feature tokens 'index:value': one colon, digits before it, something after it.
        feat = ~in_field & ~is_sep
        tok_start = np.flatnonzero(feat & np.concatenate(([True], ~feat[:-1])))
        colon = np.flatnonzero(feat & (a == _COLON))
        bad[line_of[feat & (a == _COMMA)]] = True
        feat_counts = np.bincount(line_of[tok_start], minlength=n_lines)
        colons_per_tok = np.bincount(np.searchsorted(tok_start, colon, side="right") - 1, minlength=len(tok_start))
        bad[line_of[tok_start[colons_per_tok != 1]]] = True
        if len(tok_start) and (colons_per_tok == 1).all():
            nondigit = np.concatenate(([0], np.cumsum(~is_digit, dtype=np.int32)))
            idx_ok = (colon > tok_start) & (nondigit[colon] == nondigit[tok_start])
            value_ok = ~is_sep[colon + 1]  # the chunk ends with a newline, so colon + 1 exists
            bad[line_of[tok_start[~(idx_ok & value_ok)]]] = True
        text = a
        text[(a == _COLON) | (a == _COMMA) | is_nl] = _SP
    if bad.any():
        _raise_first_bad(path, data, first_line, has_labels)

    # Every token is now one number, unless a value holds two ('1.5.3', '1-2'): the count tells.
    expected = label_counts + 2 * feat_counts
    numbers = _parse_numbers(text)
    if numbers is None or len(numbers) != expected.sum():
        _raise_first_bad(path, data, first_line, has_labels)

    # Split the number stream: per line, its labels, then (index, value) pairs.
    label_pos = np.repeat(_ptr(expected)[:-1] - _ptr(label_counts)[:-1], label_counts) + np.arange(label_counts.sum())
    is_label = np.zeros(len(numbers), bool)
    is_label[label_pos] = True
    labels = numbers[is_label]
    pairs = numbers[~is_label].reshape(-1, 2)
    feat_idx, feat_val = pairs[:, 0], pairs[:, 1]

    def line_at(counts, k):  # file line of the k-th entry of a per-line list
        return first_line + int(np.searchsorted(np.cumsum(counts), k, side="right"))

    over = np.flatnonzero(labels >= num_labels)
    if len(over):
        k = over[0]
        raise DataError(
            f"{path}:{line_at(label_counts, k)}: label id {int(labels[k])} >= {num_labels}, the label count "
            "declared in the header (line 1); fix the label id or the header"
        )
    what = "feature index" if has_labels else "column index"
    over = np.flatnonzero(feat_idx >= num_cols)
    if len(over):
        k = over[0]
        raise DataError(
            f"{path}:{line_at(feat_counts, k)}: {what} {int(feat_idx[k])} >= {num_cols}, the count declared in "
            "the header (line 1); fix the index or the header"
        )
    with np.errstate(over="ignore"):
        values = feat_val.astype(np.float32)
    nonfinite = np.flatnonzero(~np.isfinite(values))
    if len(nonfinite):
        k = nonfinite[0]
        raise DataError(
            f"{path}:{line_at(feat_counts, k)}: value {feat_val[k]} of {what} {int(feat_idx[k])} is not a finite "
            "float32 number; replace it (e.g. with 0) or drop the entry"
        )
    # Kept until the whole file is read: compact copies in the final dtypes, not float64 views that would hold the
    # chunk's whole float64 number stream (16 bytes per nonzero instead of 8).
    return (label_counts, labels.astype(np.int64), feat_counts, feat_idx.astype(np.int32), values, blank)


def _parse_numbers(text: np.ndarray) -> np.ndarray | None:
    """The space-separated numbers in ``text`` (uint8) as float64 (numpy's C text parser); None if it fails."""
    if not (text != _SP).any():  # numpy returns [-1.0] for blank text
        return np.zeros(0)
    try:
        return np.fromstring(text.tobytes(), dtype=np.float64, sep=" ")
    except ValueError:
        return None


def _raise_first_bad(path, data: bytes, first_line: int, has_labels: bool):
    """Find the first malformed line of a chunk, line by line, and raise a DataError naming it."""
    for offset, line in enumerate(data.split(b"\n")[:-1]):
        problem = _line_problem(line.replace(b"\t", b" ").replace(b"\r", b" "), has_labels)
        if problem:
            raise DataError(f"{path}:{first_line + offset}: {problem}")
    raise DataError(f"{path}:{first_line}: malformed data in the lines from here on; check the file's format")


def _line_problem(line: bytes, has_labels: bool) -> str | None:
    shape = "'l1,l2,... f:v f:v ...'" if has_labels else "'c:v c:v ...'"
    rest = line
    if has_labels:
        field, _, rest = line.partition(b" ")
        if field:
            for tok in field.split(b","):
                if not tok.isdigit():
                    return f"label {tok.decode('utf-8', 'replace')!r} is not a non-negative integer; expected {shape}"
    for tok in rest.split():
        parts = tok.split(b":")
        shown = tok.decode("utf-8", "replace")[:40]
        if len(parts) != 2 or not parts[0].isdigit() or not parts[1]:
            return f"entry {shown!r} is not 'index:value'; expected {shape}"
        if not _is_number(parts[1]):
            return f"value in {shown!r} is not a number; expected {shape}"
    return None


def _is_number(text: bytes) -> bool:
    """A number as the chunk parser (np.fromstring) reads one; float() also takes '1_0', which it refuses."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # older numpy warns and stops where newer raises
        try:
            return np.fromstring(text.decode("ascii"), sep=" ").size == 1
        except (ValueError, UnicodeDecodeError, DeprecationWarning):
            return False


# --------------------------------------------------------------------------------------------- writing


def write_xc(path: str | Path, features, labels: LabelCSR, num_features: int | None = None) -> None:
    """Write an XC bag-of-words file; ``features`` dense (n, d) or scipy sparse. Zeros are omitted.

    Values are written with 9 significant digits, enough for float32 to read back bit-exact.
    """
    x = sp.csr_matrix(features, dtype=np.float32)
    n = x.shape[0]
    if n != labels.num_points:
        raise ValueError(f"{n} feature rows but {labels.num_points} label rows")
    d = x.shape[1] if num_features is None else num_features
    with Path(path).open("w", encoding="ascii", newline="\n") as fh:
        fh.write(f"{n} {d} {labels.num_labels}\n")
        for i in range(n):
            lab = ",".join(map(str, labels.row(i)))
            lo, hi = x.indptr[i], x.indptr[i + 1]
            feats = " ".join(f"{j}:{v:.9g}" for j, v in zip(x.indices[lo:hi], x.data[lo:hi]))
            fh.write(f"{lab} {feats}\n" if feats else f"{lab}\n" if lab else " \n")


def write_sparse_labels(path: str | Path, labels: LabelCSR) -> None:
    """Write label lists as a sparse label file (``trn_X_Y.txt`` style: header ``rows labels``, ``l:1 ...``)."""
    with Path(path).open("w", encoding="ascii", newline="\n") as fh:
        fh.write(f"{labels.num_points} {labels.num_labels}\n")
        for i in range(labels.num_points):
            fh.write(" ".join(f"{j}:1" for j in labels.row(i)) + "\n")
