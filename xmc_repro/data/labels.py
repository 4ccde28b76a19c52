"""Label lists in CSR form: the labels of point i are ``idx[ptr[i]:ptr[i + 1]]``.

Labels never become a dense points x labels matrix on the host; batches are gathered straight from
these two arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def flat_keys(ptr, idx, width: int):
    """One int64 key ``row * width + label`` per listed label (NumPy arrays, or torch tensors on their device).

    Sorting the keys sorts by row, then by label within a row; ``divmod(key, width)`` gives (row, label) back.
    ``idx`` may carry trailing dimensions (several labels per listed one, as MACH's buckets): each gets its row.
    All sizes are known on the host, so torch tensors on a GPU are not read back.
    """
    if isinstance(idx, np.ndarray):
        rows = np.repeat(np.arange(len(ptr) - 1, dtype=np.int64), np.diff(ptr))
        return rows.reshape((-1,) + (1,) * (idx.ndim - 1)) * width + idx.astype(np.int64)
    import torch

    ptr, idx = ptr.to(device=idx.device, dtype=torch.long), idx.long()
    rows = torch.repeat_interleave(torch.arange(len(ptr) - 1, device=idx.device), ptr[1:] - ptr[:-1],
                                   output_size=idx.shape[0])
    return rows.view((-1,) + (1,) * (idx.dim() - 1)) * width + idx


@dataclass
class LabelCSR:
    ptr: np.ndarray  # int64 (points + 1,)
    idx: np.ndarray  # int64 (nnz,)
    num_labels: int
    # Points whose source listed their labels out of ascending order (counted by `deduplicated`, which sorts them).
    unsorted_rows: int = 0

    def __post_init__(self):
        self.ptr = np.asarray(self.ptr, np.int64)
        self.idx = np.asarray(self.idx, np.int64)
        self.num_labels = int(self.num_labels)

    @property
    def num_points(self) -> int:
        return len(self.ptr) - 1

    @property
    def nnz(self) -> int:
        return int(self.ptr[-1])

    def row(self, i: int) -> np.ndarray:
        return self.idx[self.ptr[i] : self.ptr[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.ptr)

    def take(self, rows: np.ndarray) -> LabelCSR:
        """The label lists of ``rows``, in that order (vectorised gather, no per-row Python work)."""
        rows = np.asarray(rows, np.int64)
        starts = self.ptr[rows]
        lengths = self.ptr[rows + 1] - starts
        ptr = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=ptr[1:])
        gather = np.repeat(starts - ptr[:-1], lengths) + np.arange(ptr[-1])
        return LabelCSR(ptr, self.idx[gather], self.num_labels)

    def label_counts(self) -> np.ndarray:
        """Points per label, (num_labels,) int64."""
        return np.bincount(self.idx, minlength=self.num_labels).astype(np.int64, copy=False)

    def deduplicated(self) -> LabelCSR:
        """Labels sorted within each row, repeats dropped (a label listed twice is still one positive)."""
        width = max(self.num_labels, 1)
        key = flat_keys(self.ptr, self.idx, width)
        if len(key) < 2 or (key[1:] > key[:-1]).all():  # already sorted and unique: the usual case
            return self
        # Keys rise across rows, so a fall is a row listed out of order (a repeat is no fall).
        unsorted_rows = len(np.unique(key[1:][key[1:] < key[:-1]] // width))
        key = np.sort(key)
        key = key[np.concatenate(([True], key[1:] != key[:-1]))]
        rows, idx = np.divmod(key, width)
        ptr = np.zeros(self.num_points + 1, np.int64)
        np.cumsum(np.bincount(rows, minlength=self.num_points), out=ptr[1:])
        return LabelCSR(ptr, idx, self.num_labels, unsorted_rows)

    def to_lists(self) -> list[list[int]]:
        """Python lists (small data, tests and napkinxc only)."""
        return [self.row(i).tolist() for i in range(self.num_points)]
