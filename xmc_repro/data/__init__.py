"""Data: XC text files, ``.npy`` embeddings, synthetic data, and the DataModule that batches them."""

from xmc_repro.data.datamodule import (
    BatchDataset,
    EpochBatchSampler,
    LabelCounts,
    ResumableLoader,
    XMCDataModule,
    build_datamodule,
)
from xmc_repro.data.features import load_npy_features, normalize_rows
from xmc_repro.data.labels import LabelCSR
from xmc_repro.data.sources import Split, load_splits, shared_data_root
from xmc_repro.data.synthetic import SyntheticModel, SyntheticSpec, generate
from xmc_repro.data.xc_format import (
    read_labels,
    read_sparse_labels,
    read_sparse_matrix,
    read_xc,
    write_sparse_labels,
    write_xc,
)

__all__ = [
    "BatchDataset",
    "EpochBatchSampler",
    "LabelCSR",
    "LabelCounts",
    "ResumableLoader",
    "Split",
    "SyntheticModel",
    "SyntheticSpec",
    "XMCDataModule",
    "build_datamodule",
    "generate",
    "load_npy_features",
    "load_splits",
    "normalize_rows",
    "read_labels",
    "read_sparse_labels",
    "read_sparse_matrix",
    "read_xc",
    "shared_data_root",
    "write_sparse_labels",
    "write_xc",
]
