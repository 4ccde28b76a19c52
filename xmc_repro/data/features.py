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


def normalize_rows(x: sp.csr_matrix, how: str) -> sp.csr_matrix:
    """Bag-of-words rows scaled to unit L2 norm, as float32 (``l2``), or the matrix as given (``none``)."""
    if how == "none":
        return x
    x = sp.csr_matrix(x)
    if not x.has_canonical_format:  # a column listed twice in a row counts as one entry, their sum
        x = x.copy()
        x.sum_duplicates()
    nnz = x.indptr[-1]
    counts = np.diff(x.indptr)
    # Each row is divided by its largest |value| first, in the input's precision: squaring float32 values near 3e38
    # would overflow to inf and zero the row (a float64 input, tf-idf products, may exceed float32's range). Done on
    # the values array, in float32 after that division: scipy's products made several float64 copies of the matrix.
    values = x.data[:nnz] if x.data.dtype == np.float64 else x.data[:nnz].astype(np.float32, copy=False)
    peak = np.zeros(x.shape[0], values.dtype)
    rows = np.flatnonzero(counts)
    if nnz:
        peak[rows] = np.maximum.reduceat(np.abs(values), x.indptr[rows])
    peak[peak == 0] = 1
    unit = (values / np.repeat(peak, counts)).astype(np.float32, copy=False)
    norm = np.ones(x.shape[0], np.float32)
    if nnz:
        norm[rows] = np.sqrt(np.add.reduceat(unit * unit, x.indptr[rows], dtype=np.float64))
    norm[norm == 0] = 1
    unit /= np.repeat(norm, counts)
    return sp.csr_matrix((unit, x.indices[:nnz].copy(), x.indptr.copy()), shape=x.shape)


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
