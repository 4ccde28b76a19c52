"""MACH (Medini et al. 2019; the paper's section 5): labels hashed into buckets, decoded through the uniform op.

`num_hashes` independent universal hash functions map each of the `num_labels` labels into `num_buckets`
buckets. One dense layer predicts all `num_hashes * num_buckets` meta-scores (the r meta-classifiers side by
side); training targets are the hashed labels. A label's score is the mean over the hash functions of its
buckets' probabilities (sigmoid of the meta-scores), the MACH estimator; `decode="score"` averages the raw
meta-scores instead. Either mean is exactly a uniformly sparse layer with connectivity `num_hashes`, fixed
connections `indices[r, j] = r * num_buckets + h_r(j)` and fixed weights `1 / num_hashes` — so decoding runs
through `xmc_repro.sparse.uniform_sparse_linear` and never materialises a (labels x buckets) matrix.
"""

from __future__ import annotations

import torch
from torch import nn

from xmc_repro.data.labels import flat_keys
from xmc_repro.errors import ConfigError
from xmc_repro.sparse import uniform_sparse_linear
from xmc_repro.validation import MACH_DECODINGS, choice

# A Mersenne prime above any label count: h(j) = ((a j + b) mod P) mod buckets is a universal family,
# and a * j < 2^62 stays exact in int64.
_PRIME = 2**31 - 1


def hash_labels(num_labels: int, num_hashes: int, num_buckets: int, seed: int = 0) -> torch.Tensor:
    """Bucket of every label under each hash function: (num_hashes, num_labels) int64 in [0, num_buckets)."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(1, _PRIME, (num_hashes, 1), generator=generator, dtype=torch.int64)
    b = torch.randint(0, _PRIME, (num_hashes, 1), generator=generator, dtype=torch.int64)
    labels = torch.arange(num_labels, dtype=torch.int64)
    return (a * labels + b) % _PRIME % num_buckets


class MachHead(nn.Module):
    """`num_hashes` meta-classifiers over `num_buckets` buckets each, as one dense layer.

    `forward(h)` gives the meta-scores (batch, num_hashes * num_buckets) that training compares with
    `meta_labels(...)`; `decode(meta_scores)` gives label scores (batch, num_labels) for evaluation.
    The decode connectivity and weights are buffers: they move with the module but are never trained.
    """

    def __init__(self, in_features: int, num_labels: int, num_hashes: int, num_buckets: int,
                 seed: int | None = None, decode: str = "probability"):
        super().__init__()
        choice(decode, "model.mach.decode", MACH_DECODINGS)
        self.decoding = decode
        for name, value in (("num_hashes", num_hashes), ("num_buckets", num_buckets)):
            if int(value) <= 0:
                raise ConfigError(f"model.mach.{name}={value!r} must be a positive integer, e.g. model.mach.{name}=8")
        if num_hashes * num_buckets >= 2**31:
            raise ConfigError(
                f"model.mach.num_hashes * num_buckets = {num_hashes * num_buckets} overflows the int32 indices; "
                "lower model.mach.num_buckets"
            )
        self.num_labels = num_labels
        self.num_hashes = num_hashes
        self.num_buckets = num_buckets
        self.meta = nn.Linear(in_features, num_hashes * num_buckets)
        if seed is None:  # drawn from torch's generator, so each run seed (seed_everything) hashes differently
            seed = int(torch.randint(0, 2**62, ()))
        offsets = torch.arange(num_hashes, dtype=torch.int64).unsqueeze(1) * num_buckets
        buckets = hash_labels(num_labels, num_hashes, num_buckets, seed) + offsets
        self.register_buffer("indices", buckets.to(torch.int32))
        self.register_buffer("weight", torch.full((num_hashes, num_labels), 1.0 / num_hashes))

    @classmethod
    def from_settings(cls, in_features: int, num_labels: int, mach: dict, seed: int | None = None) -> MachHead:
        """The head of a model config: its sizes and decoding in the `mach` section (conf/model/mach.yaml)."""
        return cls(in_features, num_labels, int(mach["num_hashes"]), int(mach["num_buckets"]), seed,
                   mach.get("decode", "probability"))

    @property
    def num_meta(self) -> int:
        return self.num_hashes * self.num_buckets

    def index_bounds(self) -> list[tuple[str, int]]:
        """What `indices` index (as the sparse layers say it): the buckets of all hash functions."""
        return [("num_meta", self.num_meta)]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.meta(h)

    def decode(self, meta_scores: torch.Tensor) -> torch.Tensor:
        """Label scores: the mean over the hash functions of each label's bucket probabilities (or scores)."""
        if self.decoding == "probability":
            meta_scores = torch.sigmoid(meta_scores)
        return uniform_sparse_linear(meta_scores, self.indices, self.weight)

    def meta_labels(self, label_ptr: torch.Tensor, label_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hashed targets in CSR form, sorted and deduplicated within each row, on the labels' device.

        Two labels of a row that share a bucket give that bucket once: a meta-label is positive or not.
        """
        device = label_idx.device
        rows = label_ptr.numel() - 1
        meta = self.indices.to(device).index_select(1, label_idx).t().to(torch.int64)  # (nnz, num_hashes)
        # One key per (row, meta-label): unique() then sorts by row first, by meta-label within a row.
        keys = torch.unique(flat_keys(label_ptr, meta, self.num_meta))
        meta_rows = torch.div(keys, self.num_meta, rounding_mode="floor")
        meta_ptr = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        meta_ptr[1:] = torch.cumsum(torch.bincount(meta_rows, minlength=rows), 0)
        return meta_ptr, keys % self.num_meta

    def extra_repr(self) -> str:
        return (f"num_labels={self.num_labels}, num_hashes={self.num_hashes}, num_buckets={self.num_buckets}, "
                f"decode={self.decoding}")
