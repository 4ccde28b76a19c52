"""Dense input features: ``.npy`` embeddings (memory-mapped) and bag-of-words rows made dense per batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmc_repro.errors import DataError

FINITE_CHECK_ROWS = 65536  # rows per pass of the NaN/Inf scan, so a memory map is never read whole


def load_npy_features(path: str | Path, rows: int | None = None, dim: int | None = None) -> np.ndarray:
    """A float32 (points, dim) ``.npy`` file, memory-mapped (read-only); checked for shape, dtype and NaN/Inf.

    ``rows``: the point count of the matching labels file; ``dim``: the expected embedding size.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found; check the path (or the dataset.data_dir setting)")
    try:
        x = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as error:  # not an .npy file, truncated header, object array
        raise DataError(f"{path}: not a readable .npy array ({error}); write it with numpy.save") from None
    if not isinstance(x, np.ndarray):  # np.load opens an .npz archive (numpy.savez) whatever the file's name
        names = x.files
        x.close()
        first = names[0] if names else "NAME"
        raise DataError(f"{path}: an .npz archive (arrays: {', '.join(names) or 'none'}), not an .npy array; save the "
                        f"features as one, e.g. numpy.save('features.npy', numpy.load('{path}')['{first}']), and give "
                        "that file")
    if x.dtype != np.float32:
        raise DataError(
            f"{path}: dtype {x.dtype}, expected float32; convert it with "
            f"numpy.save(path, numpy.load(path).astype(numpy.float32))"
        )
    if x.ndim != 2:
        raise DataError(f"{path}: shape {x.shape}, expected a 2-D (points, features) array")
    if x.shape[1] == 0:  # a model over no inputs would train its biases only, and report P@k as if it had learnt
        raise DataError(f"{path}: shape {x.shape}, no features per point; save the embeddings themselves, a "
                        "(points, features) array with features >= 1")
    if rows is not None and x.shape[0] != rows:
        raise DataError(
            f"{path}: {x.shape[0]} rows but its labels file has {rows} points; the features and labels must list "
            "the same points in the same order"
        )
    if dim is not None and x.shape[1] != dim:
        raise DataError(
            f"{path}: {x.shape[1]} features per point, expected {dim} (dataset.feature_dim); use the matching "
            "embedding file or set dataset.feature_dim"
        )
    check_finite(x, path)
    return x


def check_finite(x: np.ndarray, path) -> None:
    """DataError naming the first row (0-based) that holds NaN or Inf."""
    for lo in range(0, x.shape[0], FINITE_CHECK_ROWS):
        block = np.asarray(x[lo : lo + FINITE_CHECK_ROWS])
        finite = np.isfinite(block)
        if not finite.all():
            r, c = np.argwhere(~finite)[0]
            raise DataError(
                f"{path}: row {lo + r} (0-based), column {c} is {block[r, c]}; features must be finite: "
                "recompute the embedding of that point or replace the value"
            )


# Nonzeros normalised at a time: the float64 temporaries stay a few MB whatever the matrix's size.
NORMALIZE_BLOCK_NNZ = 1 << 20


def normalize_rows(x: sp.csr_matrix, how: str) -> sp.csr_matrix:
    """Bag-of-words rows scaled to unit L2 norm, as float32 (``l2``), or the matrix as given (``none``).

    Computed in float64 a block of rows at a time and rounded once to float32: the values of scipy's float64
    matrix products to the bit, without their copies of the whole matrix.
    """
    if how == "none":
        return x
    x = sp.csr_matrix(x)
    if not x.has_canonical_format:  # a column listed twice in a row counts as one entry, their sum
        x = x.copy()
        x.sum_duplicates()
    indptr = x.indptr
    unit = np.empty(indptr[-1], np.float32)
    for first, last in _row_blocks(indptr, NORMALIZE_BLOCK_NNZ):
        block = slice(indptr[first], indptr[last])
        unit[block] = _unit_rows(x.data[block].astype(np.float64), np.diff(indptr[first : last + 1]))
    return sp.csr_matrix((unit, x.indices[: indptr[-1]].copy(), indptr.copy()), shape=x.shape)


def _row_blocks(indptr: np.ndarray, nnz: int):
    """(first, last) row ranges of at most `nnz` nonzeros each, or of one longer row."""
    first, rows = 0, len(indptr) - 1
    while first < rows:
        last = int(np.searchsorted(indptr, indptr[first] + nnz, side="right")) - 1
        last = min(max(last, first + 1), rows)
        yield first, last
        first = last


def _unit_rows(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Consecutive rows' float64 values (`counts` per row), each row divided by its largest |value| (squaring
    values near float32's 3e38 would overflow to inf and zero the row), then by its norm; in place."""
    nonempty = counts > 0
    starts = (np.cumsum(counts) - counts)[nonempty]
    if not len(starts):
        return values
    for row_size in (lambda: np.maximum.reduceat(np.abs(values), starts),
                     lambda: np.sqrt(np.add.reduceat(values * values, starts))):
        size = np.ones(len(counts))
        size[nonempty] = row_size()
        size[size == 0] = 1  # a row of stored zeros
        values *= np.repeat(1 / size, counts)
    return values


def inverse_document_frequency(train: sp.csr_matrix) -> np.ndarray:
    """Smoothed idf of every feature over the training rows: ln((1 + N) / (1 + df)) + 1 (float32).

    A feature absent from training gets the largest weight, ln(1 + N) + 1, as an unseen word would.
    """
    df = np.bincount(train.indices[train.data != 0], minlength=train.shape[1])
    return (np.log((1.0 + train.shape[0]) / (1.0 + df)) + 1.0).astype(np.float32)


def tfidf_rows(x: sp.csr_matrix, idf: np.ndarray) -> sp.csr_matrix:
    """Term counts times idf, each row then scaled to unit L2 norm: how the Extreme Classification Repository
    builds its bag-of-words features."""
    weighted = sp.csr_matrix(x, dtype=np.float64) @ sp.diags(idf.astype(np.float64))  # float32 could overflow
    return normalize_rows(sp.csr_matrix(weighted), "l2")


def dense_rows(features, rows: np.ndarray) -> np.ndarray:
    """float32 (len(rows), dim) C-contiguous block: a gather from a dense (or memory-mapped) array or a CSR matrix."""
    if sp.issparse(features):
        return features[rows].toarray().astype(np.float32, copy=False)
    return np.ascontiguousarray(features[rows], dtype=np.float32)
