"""The LightningDataModule: splits -> batches ``(x float32 (B, D), label_ptr int64 (B+1,), label_idx int64 (nnz,))``.

A batch is gathered in one step from a whole list of row indices (a batch sampler, no per-item
``__getitem__`` + collate), so a 490k-point epoch is not dominated by Python overhead. Labels stay
CSR; the dense target exists only on the device, inside the loss.

Under DDP a rank's training batch holds the inputs of the whole global batch, the labels of its share and the
share's first row, ``(x (G, D), label_ptr, label_idx, start)`` (``RankShare``): the model draws dropout over the
global batch, as one process would, keeps its share's rows and weights its loss by the share's size.

The training loader is resumable: its ``state_dict`` (saved by Lightning into checkpoints) holds the
epoch and the batches already consumed, and each epoch's order is a permutation seeded by
``(seed, epoch)`` alone, so a run resumed mid-epoch sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from xmc_repro.data.features import dense_rows
from xmc_repro.data.sources import Split, load_splits
from xmc_repro.errors import ConfigError


class LabelCounts(np.ndarray):
    """Training points per label, (num_labels,) int64, that also knows the number of training points."""

    num_points: int

    def __new__(cls, counts: np.ndarray, num_points: int):
        obj = np.asarray(counts, np.int64).view(cls)
        obj.num_points = int(num_points)
        return obj

    def __array_finalize__(self, obj):
        self.num_points = getattr(obj, "num_points", None)


def share_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of a global batch of `size` that `rank` trains on: ``np.array_split``'s parts."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class RankShare(NamedTuple):
    """A DDP rank's training batch: the global batch's positions, of which rows [start, stop) are its share (empty
    for the later ranks of a global batch smaller than the number of ranks)."""

    positions: np.ndarray
    start: int
    stop: int


class BatchDataset(Dataset):
    """Indexed by a whole batch of positions; returns the batch tuple."""

    def __init__(self, split: Split, rows: np.ndarray | None = None):
        self.split = split
        self.rows = rows  # positions -> rows of the split (a subset, e.g. without the holdout part)

    def __len__(self) -> int:
        return self.split.num_points if self.rows is None else len(self.rows)

    def __getitem__(self, positions) -> tuple:
        """The batch at `positions`; for a `RankShare`, every position's inputs, the share's labels and its start."""
        share = positions if isinstance(positions, RankShare) else RankShare(positions, 0, len(positions))
        rows = np.asarray(share.positions, np.int64)
        if self.rows is not None:
            rows = self.rows[rows]
        labels = self.split.labels.take(rows[share.start : share.stop])
        x = dense_rows(self.split.features, rows)
        batch = torch.from_numpy(x), torch.from_numpy(labels.ptr), torch.from_numpy(labels.idx)
        return (*batch, share.start) if share is positions else batch


def _keep(batch):
    """collate_fn: the dataset already made the batch (the default would turn the tuple into a list)."""
    return batch


def buffered_shuffle(n: int, buffer: int | None, rng: np.random.Generator) -> np.ndarray:
    """0..n-1 in the order tf.data's ``shuffle(buffer)`` gives the file order (the authors' loader): each point
    comes out of a buffer of the next `buffer` points at random, so it moves at most about `buffer` positions
    early. With `buffer` None or >= n: ``rng.permutation(n)``, a uniform permutation."""
    if buffer is None or buffer >= n:
        return rng.permutation(n)
    # While the input lasts, step i takes the point in a random slot and refills the slot with point buffer + i.
    # So step i yields what the last earlier step with the same slot put there, or the slot's first point:
    # found for all steps at once by grouping the steps by slot (stable, so in step order within a slot).
    slots = rng.integers(0, buffer, size=n - buffer)
    by_slot = np.argsort(slots, kind="stable")
    slot = slots[by_slot]
    first = np.ones(len(slot), bool)
    first[1:] = slot[1:] != slot[:-1]
    out = np.empty(n, np.int64)
    out[by_slot] = np.where(first, slot, buffer + np.roll(by_slot, 1))
    pool = np.arange(buffer)  # what the buffer holds when the input is spent
    last = np.roll(first, -1)
    pool[slot[last]] = buffer + by_slot[last]
    out[n - buffer:] = rng.permutation(pool)  # then the buffer drains in random order
    return out


class EpochBatchSampler:
    """Batches of positions: a shuffle from ``(seed, epoch)`` (``buffered_shuffle``) when shuffling, else in order.

    ``start`` batches of the epoch are skipped (set when resuming); a completed pass moves to the next
    epoch by itself, and Lightning's ``set_epoch`` keeps the count in step.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool, seed: int = 0, order: np.ndarray | None = None,
                 rank: int = 0, world_size: int = 1, shuffle_buffer: int | None = None):
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.shuffle_buffer = shuffle_buffer
        self.fixed_order = order
        # Under DDP every rank walks the same global batches and trains on its 1/world_size share of each
        # (`RankShare`), so `batch_size` stays the global batch and a step sees the same points as one process's.
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    def order(self, epoch: int) -> np.ndarray:
        if self.fixed_order is not None:
            return self.fixed_order
        if self.shuffle:
            return buffered_shuffle(self.n, self.shuffle_buffer, np.random.default_rng([self.seed, epoch]))
        return np.arange(self.n)

    def __iter__(self):
        order, bs = self.order(self.epoch), self.batch_size
        for b in range(self.start, len(self)):
            batch = order[b * bs : (b + 1) * bs]
            if self.world_size > 1:
                batch = RankShare(batch, *share_bounds(len(batch), self.rank, self.world_size))
            yield batch
        self.epoch, self.start = self.epoch + 1, 0


class ResumableLoader(DataLoader):
    """A DataLoader over an EpochBatchSampler that counts the batches it has handed out."""

    def __init__(self, dataset: BatchDataset, sampler: EpochBatchSampler, **kwargs):
        super().__init__(dataset, batch_size=None, sampler=sampler, collate_fn=_keep, **kwargs)
        self._epoch, self._consumed = sampler.epoch, sampler.start

    def __iter__(self):
        self._epoch, self._consumed = self.sampler.epoch, self.sampler.start
        for batch in super().__iter__():
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "consumed": self._consumed, "seed": self.sampler.seed, "n": self.sampler.n}

    def load_state_dict(self, state: dict) -> None:
        s = self.sampler
        if state.get("n", s.n) != s.n or state.get("seed", s.seed) != s.seed:
            raise ConfigError(
                f"the checkpoint's training data ({state.get('n')} points, seed {state.get('seed')}) differs from "
                f"this run's ({s.n} points, seed {s.seed}); resume with the same dataset and seed"
            )
        if state["consumed"] >= len(s):
            s.epoch, s.start = state["epoch"] + 1, 0
        else:
            s.epoch, s.start = state["epoch"], state["consumed"]
        self._epoch, self._consumed = s.epoch, s.start


class XMCDataModule(pl.LightningDataModule):
    """Train / validation / test loaders for one dataset config; ``setup`` loads (or generates) once."""

    def __init__(
        self,
        dataset_cfg,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        validate_on: str | None = None,
        pin_memory: bool = False,
        shuffle_buffer: int | None = None,
    ):
        """`shuffle_buffer`: see ``buffered_shuffle`` (None: each epoch a uniform permutation)."""
        super().__init__()
        self.cfg = _plain(dataset_cfg)
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or batch_size)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.validate_on = validate_on or self.cfg.get("validate_on") or "test"
        self.pin_memory = pin_memory
        self.shuffle_buffer = None if shuffle_buffer is None else int(shuffle_buffer)
        fraction = self.cfg.get("holdout_fraction")
        self.holdout_fraction = 0.1 if fraction is None else float(fraction)
        if self.validate_on not in ("test", "holdout"):
            raise ConfigError(f"validate_on={self.validate_on!r} must be 'test' (the authors' protocol) or 'holdout'")
        if not 0 < self.holdout_fraction < 1:
            raise ConfigError(f"dataset.holdout_fraction={self.holdout_fraction} must be between 0 and 1")
        if self.batch_size <= 0 or self.eval_batch_size <= 0:
            raise ConfigError(f"batch sizes must be positive (got {self.batch_size}, {self.eval_batch_size})")
        self._loaded = False

    # ------------------------------------------------------------------ loading

    def setup(self, stage: str | None = None) -> None:
        if self._loaded:
            return
        train, test = load_splits(self.cfg)
        self.train_split, self.test_split = train, test
        self.train_rows = self.val_rows = None
        if self.validate_on == "holdout":
            n = train.num_points
            held = max(1, int(round(n * self.holdout_fraction)))
            if held >= n:
                raise ConfigError(f"dataset.holdout_fraction={self.holdout_fraction} leaves no training points of {n}")
            perm = np.random.default_rng([self.seed, 3]).permutation(n)
            self.val_rows, self.train_rows = np.sort(perm[:held]), np.sort(perm[held:])
        labels = train.labels if self.train_rows is None else train.labels.take(self.train_rows)
        self.train_label_counts = LabelCounts(labels.label_counts(), labels.num_points)
        self.num_features = train.num_features
        self.num_labels = train.labels.num_labels
        self._loaded = True

    @property
    def num_train_points(self) -> int:
        return self.train_label_counts.num_points

    # ------------------------------------------------------------------ loaders

    def train_dataloader(self) -> ResumableLoader:
        data = BatchDataset(self.train_split, self.train_rows)
        trainer = self.trainer  # set when Lightning runs this DataModule; None when used on its own
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = EpochBatchSampler(len(data), self.batch_size, shuffle=True, seed=self.seed, rank=rank, world_size=world,
                                    shuffle_buffer=self.shuffle_buffer)
        return ResumableLoader(data, sampler, **self._loader_kwargs())

    def val_dataloader(self) -> DataLoader:
        if self.validate_on == "holdout":
            return self._eval_loader(BatchDataset(self.train_split, self.val_rows))
        return self.test_dataloader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(BatchDataset(self.test_split))

    def train_eval_dataloader(self, max_points: int | None = None) -> DataLoader:
        """Training points for train P@k, in a fixed seeded random order: any prefix is a uniform sample.

        ``max_points`` keeps only that many (trainer.train_eval_max_points), for huge train sets.
        """
        data = BatchDataset(self.train_split, self.train_rows)
        order = np.random.default_rng([self.seed, 7]).permutation(len(data))
        if max_points is not None:
            order = order[: int(max_points)]
        return self._eval_loader(data, order)

    def _eval_loader(self, data: BatchDataset, order: np.ndarray | None = None) -> DataLoader:
        n = len(data) if order is None else len(order)
        sampler = EpochBatchSampler(n, self.eval_batch_size, shuffle=False, order=order)
        return DataLoader(data, batch_size=None, sampler=sampler, collate_fn=_keep, **self._loader_kwargs())

    def _loader_kwargs(self) -> dict:
        # Not persistent_workers: every new iterator draws its workers' base seed from the global RNG (dropout's),
        # with or without workers; persistent ones draw once per loader, so trainer.num_workers would change the
        # dropout masks, and a resumed run (a new loader) would draw where the uninterrupted run did not.
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory}


def _plain(cfg) -> dict:
    """A DictConfig (resolved) or a mapping as a plain dict."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:
        pass
    return dict(cfg)


def build_datamodule(
    dataset_cfg,
    batch_size: int = 32,
    num_workers: int = 0,
    seed: int = 0,
    validate_on: str | None = None,
    eval_batch_size: int | None = None,
    pin_memory: bool = False,
    shuffle_buffer: int | None = None,
) -> XMCDataModule:
    """The DataModule for ``cfg.dataset`` (DictConfig or dict); call ``setup("fit")`` to load."""
    return XMCDataModule(dataset_cfg, batch_size, eval_batch_size, num_workers, seed, validate_on, pin_memory,
                         shuffle_buffer)
