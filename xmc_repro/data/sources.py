"""From a dataset config (``conf/dataset/*.yaml``) to train and test splits.

``kind`` says how to load:

* ``synthetic``: generated (``xmc_repro.data.synthetic``), nothing read;
* ``xc``: two XC bag-of-words files (``train_file``, ``test_file``), the features made dense per batch;
* ``npy``: dense embeddings from ``.npy`` files with labels from XC or sparse label files, in the layout
  of the authors' ``run.py`` (github.com/xmc-aalto/ecml23-sparse): ``<data_dir>/train-labels.txt``,
  ``test-labels.txt`` (read only for their labels) beside ``train-<features>.npy``, ``test-<features>.npy``
  (``features`` = slice | cascade), loaded there by ``data.load_mixed_dataset`` with ``np.load``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmc_repro.data.features import (inverse_document_frequency, load_npy_features,
                                     normalize_rows, tfidf_rows)
from xmc_repro.data.labels import LabelCSR
from xmc_repro.data.synthetic import SyntheticModel, SyntheticSpec
from xmc_repro.data.xc_format import read_labels, read_xc
from xmc_repro.errors import ConfigError, DataError, DataWarning
from xmc_repro.validation import DATASET_KINDS, NORMALIZATIONS


# Where the embeddings of the paper's datasets come from (named in the error for missing files).
FEATURE_SOURCES = {
    "slice": "float32 (points, 512) Slice fastText document embeddings (Jain et al., WSDM 2019)",
    "cascade": "float32 (points, 768) CascadeXML embeddings (Kharbanda et al., NeurIPS 2022; github.com/xmc-aalto/cascadexml)",
}
LABEL_SOURCE = (
    "the dataset's train.txt / test.txt from the Extreme Classification Repository "
    "(manikvarma.org/downloads/XC/XMLRepository.html), renamed; sparse label files like trn_X_Y.txt also work"
)


@dataclass
class Split:
    """Points of one split: features (dense array, memory map, or CSR) and their label lists."""

    features: np.ndarray | sp.csr_matrix
    labels: LabelCSR
    source: str  # file(s) it came from, for messages

    @property
    def num_points(self) -> int:
        return self.labels.num_points

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])


def shared_data_root() -> Path:
    """``../shared/data`` beside the project root, or ``$XMC_SHARED_DATA``."""
    env = os.environ.get("XMC_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def absolute(path) -> Path:
    """A path from the config, relative to where the command was started (Hydra may change the cwd)."""
    try:
        from hydra.utils import to_absolute_path

        return Path(to_absolute_path(str(Path(path).expanduser())))  # `~/data`, quoted for Hydra: the shell left it
    except Exception:  # hydra missing or not configured
        return Path(path).expanduser().absolute()


def load_splits(cfg: dict) -> tuple[Split, Split]:
    """(train, test) for a dataset config given as a plain dict."""
    train, test = _read_splits(cfg)
    if train.labels.nnz == 0:  # every score would be trained down: hours spent learning nothing
        raise DataError(f"{train.source}: no training point has a label; give the training set with its labels")
    if test.labels.nnz == 0:  # every test P@k 0 (with validate_on=test, the epochs chosen on them too): a mistake
        raise DataError(f"{test.source}: no test point has a label, so every test P@k would be 0; give the test set "
                        "with its labels")
    return train, test


def _read_splits(cfg: dict) -> tuple[Split, Split]:
    kind = cfg.get("kind")
    if kind == "synthetic":
        return _synthetic(cfg)
    if kind == "xc":
        return _xc(cfg)
    if kind == "npy":
        return _npy(cfg)
    raise ConfigError(f"dataset.kind={kind!r} is unknown; use one of {', '.join(DATASET_KINDS)} (or pick a "
                      "dataset=... preset)")


def _synthetic(cfg) -> tuple[Split, Split]:
    model = SyntheticModel(SyntheticSpec.from_config(cfg))
    name = f"synthetic data (seed {model.spec.seed})"
    return tuple(Split(*model.split(s), source=f"{name}, {s}") for s in ("train", "test"))


def _data_dir(cfg) -> Path:
    if cfg.get("data_dir"):
        return absolute(cfg["data_dir"])
    if cfg.get("shared_subdir"):
        return shared_data_root() / cfg["shared_subdir"]
    return absolute(".")


def _xc(cfg) -> tuple[Split, Split]:
    for key in ("train_file", "test_file"):
        if not cfg.get(key):
            raise ConfigError(f"dataset.{key} is not set; pass dataset.train_file=PATH dataset.test_file=PATH")
    normalize = cfg.get("normalize", "l2")
    if normalize not in NORMALIZATIONS:
        raise ConfigError(f"dataset.normalize={normalize!r} is unknown; choose one of {', '.join(NORMALIZATIONS)}")
    root = _data_dir(cfg)
    paths = [root / cfg["train_file"], root / cfg["test_file"]]
    _not_files(paths)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        given_in_full = all(Path(cfg[key]).is_absolute() for key in ("train_file", "test_file"))
        hint = ("check dataset.train_file and dataset.test_file" if given_in_full
                else "set dataset.data_dir=DIR (the folder with both files)")
        if cfg.get("shared_subdir") and not cfg.get("data_dir"):
            hint += f" or $XMC_SHARED_DATA (default ../shared/data beside the project, subfolder {cfg['shared_subdir']})"
        raise DataError(f"dataset {cfg.get('name', 'xc')}: missing {', '.join(missing)}; {hint}")
    train, test = (read_xc(p) for p in paths)
    for data in (train, test):
        _note_label_order(data.labels, data.path)
        _note_blank_points(data)
        _note_repeated_features(data)
    _check_pair(train.labels, test.labels, train.num_features, test.num_features, paths)
    if normalize == "tfidf":  # idf from the training split only: nothing is learnt from the test points
        idf = inverse_document_frequency(train.features)
        return tuple(Split(tfidf_rows(d.features, idf), d.labels, str(d.path)) for d in (train, test))
    return tuple(
        Split(normalize_rows(d.features, normalize), d.labels, str(d.path)) for d in (train, test)
    )


def _npy(cfg) -> tuple[Split, Split]:
    features = cfg.get("features")
    root = _data_dir(cfg)
    names = {}
    for split in ("train", "test"):
        names[f"{split}_labels"] = cfg.get(f"{split}_labels") or f"{split}-labels.txt"
        names[f"{split}_features"] = cfg.get(f"{split}_features") or f"{split}-{features}.npy"
    paths = {k: root / v for k, v in names.items()}
    _not_files(paths.values())
    missing = [v for k, v in names.items() if not paths[k].is_file()]
    if missing:
        what = FEATURE_SOURCES.get(features, "float32 (points, features) embeddings")
        raise DataError(
            f"dataset {cfg.get('name')} ({features} features): missing {', '.join(missing)} in {root}. "
            f"Expected {names['train_labels']}, {names['test_labels']} ({LABEL_SOURCE}) and "
            f"{names['train_features']}, {names['test_features']} ({what}, same points in the same order), "
            "the layout of the authors' run.py (github.com/xmc-aalto/ecml23-sparse); "
            "put them there or set dataset.data_dir=DIR"
        )
    dim = cfg.get("feature_dim")
    splits = []
    for split in ("train", "test"):
        labels = read_labels(paths[f"{split}_labels"])
        _note_label_order(labels, paths[f"{split}_labels"])
        if labels.num_points == 0:
            raise DataError(f"{paths[f'{split}_labels']}: no data points; the {split} split must not be empty")
        x = load_npy_features(paths[f"{split}_features"], rows=labels.num_points, dim=dim)
        splits.append(Split(x, labels, f"{paths[f'{split}_features']} + {paths[f'{split}_labels']}"))
    train, test = splits
    _check_pair(train.labels, test.labels, train.num_features, test.num_features,
                (paths["train_features"], paths["test_features"]), (paths["train_labels"], paths["test_labels"]))
    return train, test


def _not_files(paths) -> None:
    """A directory where a data file is expected is named as such (not as a missing file)."""
    for path in paths:
        if path.is_dir():
            raise DataError(f"{path}: is a directory, expected a data file; name the file inside it")


def _note_label_order(labels: LabelCSR, path) -> None:
    """Warn where a file lists some points' labels out of ascending order. Ours sorts them; the authors' P@k
    (``tf.sparse.add`` of the labels and the top k, which assumes sorted indices) can miss hits on those points,
    so their P@k on this file, and the epochs their schedule picks by it, may differ from ours."""
    if labels.unsorted_rows:
        _data_warning(f"{path}: {labels.unsorted_rows:,} of {labels.num_points:,} points list their labels out of "
                      "ascending order; the authors' P@k can miss hits on such points, ours does not")


def _note_blank_points(data) -> None:
    """Warn of blank lines read as points: a point without labels or features is a line with nothing on it, and
    where the header's count allows one, a stray blank line is read as such a point and shifts nothing else."""
    count = 0 if data.blank_lines is None else len(data.blank_lines)
    if count:
        plural = "s" if count > 1 else ""
        _data_warning(f"{data.path}:{data.blank_lines[0]}: {count:,} blank line{plural} read as point{plural} without "
                      "labels or features; if stray, remove them and fix the header's point count")


def _note_repeated_features(data) -> None:
    """Warn where a line lists a feature index twice: its values are summed (as scipy sums repeated entries, and
    as term counts add up), but such a file is often a faulty export, and the summed value is not what it lists."""
    lines = data.repeated_feature_lines
    if lines is not None and len(lines):
        lines_list = f"{len(lines):,} lines list" if len(lines) > 1 else "1 line lists"
        _data_warning(f"{data.path}:{lines[0]}: {lines_list} a feature index more than once; the values of a "
                      "repeated index are summed (to 0 where they cancel); if they should not add up, fix the export")


def _data_warning(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_warn  # every DDP rank reads the data; one says so

    rank_zero_warn(message, category=DataWarning)


def _check_pair(train: LabelCSR, test: LabelCSR, train_dim: int, test_dim: int, feature_paths, label_paths=None):
    """Train and test must describe the same feature and label spaces, and hold points. Paths: (train, test) of
    the files that give the features and (when they are other files) the labels, to name in errors."""
    train_labels, test_labels = label_paths or feature_paths
    for labels, path in ((train, train_labels), (test, test_labels)):
        if labels.num_points == 0:
            raise DataError(f"{path}: no data points (its header declares 0); the split must not be empty")
    if train_dim != test_dim:
        raise DataError(
            f"{feature_paths[1]}: {test_dim} features per point but {feature_paths[0]} has {train_dim}; train and "
            "test must come from the same feature extraction"
        )
    if train.num_labels != test.num_labels:
        raise DataError(
            f"{test_labels}: declares {test.num_labels} labels but {train_labels} declares {train.num_labels}; "
            "use the train/test pair of one dataset (fix the header if the label spaces are the same)"
        )
