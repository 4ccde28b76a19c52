"""Seeded synthetic extreme multi-label data with learnable, heavy-tailed structure.

How a point is made:

1. its labels: ``1 + Poisson(labels_per_point - 1)`` draws from a Zipf-like popularity
   ``p(rank r) ~ (r + 1) ** -zipf_exponent`` over a random order of the label ids (repeats dropped);
2. a latent vector ``z = sum_l s_l u_l + noise``: every label l has a unit prototype u_l in a
   ``latent_dim`` space; s_l is +1, or -1 with probability ``sign_flip``;
3. its features ``x = tanh(W z) + feature_noise * eps`` through one fixed random map W (features x latent).

The sign flips are what a purely linear last layer cannot undo (a label's mean direction shrinks to
``1 - 2 sign_flip`` of its prototype) while a ReLU layer can (it sees |u_l . z|), so an intermediate
layer helps; the low-dimensional latent spread over all inputs is what a sparse layer without it
cannot collect from ``connectivity`` inputs. Test P@k sits far above the popularity baseline.

Generation runs in chunks of points with one generator per chunk (``[seed, split, chunk]``), so an
Amazon-670K-shaped set never holds a dense label matrix, and the result depends only on the spec.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import scipy.sparse as sp

from xmc_repro.data.labels import LabelCSR
from xmc_repro.errors import ConfigError

SPLITS = {"train": 1, "test": 2}


@dataclass(frozen=True)
class SyntheticSpec:
    num_train: int = 10_000
    num_test: int = 2_000
    num_features: int = 128
    num_labels: int = 1_000
    latent_dim: int = 32
    labels_per_point: float = 3.0
    zipf_exponent: float = 0.8
    sign_flip: float = 0.25
    latent_noise: float = 0.3
    feature_noise: float = 0.05
    seed: int = 0
    chunk_size: int = 8192

    def __post_init__(self):
        for key in ("num_train", "num_test", "num_features", "num_labels", "latent_dim", "chunk_size"):
            if int(getattr(self, key)) <= 0:
                raise ConfigError(f"dataset.{key}={getattr(self, key)} must be a positive integer")
        if float(self.labels_per_point) < 1:
            raise ConfigError(f"dataset.labels_per_point={self.labels_per_point} must be at least 1")
        if not 0 <= float(self.sign_flip) <= 0.5:
            raise ConfigError(f"dataset.sign_flip={self.sign_flip} must be in [0, 0.5]")
        for key in ("zipf_exponent", "latent_noise", "feature_noise"):
            if float(getattr(self, key)) < 0:
                raise ConfigError(f"dataset.{key}={getattr(self, key)} must be non-negative")

    @classmethod
    def from_config(cls, cfg) -> SyntheticSpec:
        fields = cls.__dataclass_fields__
        values = {k: cfg[k] for k in fields if k in cfg and cfg[k] is not None}
        if "data_seed" in cfg and cfg["data_seed"] is not None:
            values["seed"] = cfg["data_seed"]
        return cls(**values)


class SyntheticModel:
    """The fixed parts shared by train and test: label popularity, prototypes, feature map."""

    def __init__(self, spec: SyntheticSpec):
        self.spec = spec
        rng = np.random.default_rng([spec.seed, 0])
        ranks = rng.permutation(spec.num_labels)  # label id -> popularity rank
        weight = (ranks + 1.0) ** -float(spec.zipf_exponent)
        self.cdf = np.cumsum(weight / weight.sum())
        self.cdf[-1] = 1.0
        # Prototypes are drawn in blocks so the float64 temporaries stay small for 670k labels.
        self.prototypes = np.empty((spec.num_labels, spec.latent_dim), np.float32)
        for lo in range(0, spec.num_labels, 65536):
            block = rng.standard_normal((min(65536, spec.num_labels - lo), spec.latent_dim))
            block /= np.linalg.norm(block, axis=1, keepdims=True)
            self.prototypes[lo : lo + len(block)] = block
        # Scaled so that tanh works in its curved range for a typical z.
        scale = 1.0 / np.sqrt(spec.latent_dim * max(spec.labels_per_point, 1.0))
        self.projection = (rng.standard_normal((spec.latent_dim, spec.num_features)) * scale * 1.5).astype(np.float32)

    def split(self, name: str) -> tuple[np.ndarray, LabelCSR]:
        """Features (n, num_features) float32 and label lists of the ``train`` or ``test`` split."""
        s = self.spec
        n = s.num_train if name == "train" else s.num_test
        x = np.empty((n, s.num_features), np.float32)

        def chunk(i: int) -> tuple[np.ndarray, np.ndarray]:
            lo, hi = i * s.chunk_size, min((i + 1) * s.chunk_size, n)
            rng = np.random.default_rng([s.seed, SPLITS[name], i])
            ptr, idx = self._labels(rng, hi - lo)
            x[lo:hi] = self._features(rng, ptr, idx)
            return ptr, idx

        # Chunks are independent (own generator, own rows of x): threads give the same result in any order.
        n_chunks = -(-n // s.chunk_size)
        with ThreadPoolExecutor(max_workers=min(8, max(1, (os.cpu_count() or 2) // 2))) as pool:
            parts = list(pool.map(chunk, range(n_chunks)))
        lengths = np.concatenate([np.diff(ptr) for ptr, _ in parts]) if parts else np.zeros(0, np.int64)
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=ptr[1:])
        idx = np.concatenate([idx for _, idx in parts]) if parts else np.zeros(0, np.int64)
        return x, LabelCSR(ptr, idx, s.num_labels)

    def _labels(self, rng, n: int) -> tuple[np.ndarray, np.ndarray]:
        counts = 1 + rng.poisson(self.spec.labels_per_point - 1.0, n)
        draws = np.searchsorted(self.cdf, rng.random(counts.sum()), side="right")
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=ptr[1:])
        labels = LabelCSR(ptr, np.minimum(draws, self.spec.num_labels - 1), self.spec.num_labels).deduplicated()
        return labels.ptr, labels.idx

    def _features(self, rng, ptr: np.ndarray, idx: np.ndarray) -> np.ndarray:
        s = self.spec
        signs = np.where(rng.random(len(idx)) < s.sign_flip, -1.0, 1.0).astype(np.float32)
        mix = sp.csr_matrix((signs, idx, ptr), shape=(len(ptr) - 1, s.num_labels))
        z = np.asarray(mix @ self.prototypes, dtype=np.float32)
        z += rng.standard_normal(z.shape, np.float32) * np.float32(s.latent_noise)
        x = z @ self.projection
        np.tanh(x, out=x)
        if s.feature_noise:
            x += rng.standard_normal(x.shape, np.float32) * np.float32(s.feature_noise)
        return x


def generate(spec: SyntheticSpec) -> dict:
    """``{"train": (x, labels), "test": (x, labels), "spec": dict}`` for a spec."""
    model = SyntheticModel(spec)
    return {"train": model.split("train"), "test": model.split("test"), "spec": asdict(spec)}
