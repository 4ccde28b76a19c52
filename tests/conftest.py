"""Scaffolding shared by the tests: devices, seeded generators, random label lists, a tiny dataset, a quiet
Trainer. Test files import these names (``from conftest import DEVICES, generator``)."""

from __future__ import annotations

import pytest
import torch

# Every device-parameterised test runs on the CPU; the CUDA copy runs with `-m cuda` on a GPU machine.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]

# A synthetic dataset small enough for a whole fit in a second or two.
TINY = {"kind": "synthetic", "name": "Tiny", "num_train": 300, "num_test": 70, "num_features": 16,
        "num_labels": 40, "latent_dim": 8, "labels_per_point": 2.0, "propensity": {"A": 0.55, "B": 1.5}}


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (draw on the CPU, then move: same values on every device)."""
    return torch.Generator().manual_seed(seed)


def sparse_layer_problem(batch, inputs, labels, connectivity, density, dtype, seed):
    """Random (x, indices, weight, bias, grad_out) of the uniform op on the CPU; ``density``: the fraction of
    nonzero output gradients."""
    gen = generator(seed)
    x = torch.randn(batch, inputs, generator=gen, dtype=dtype)
    idx = torch.randint(inputs, (connectivity, labels), generator=gen, dtype=torch.int32)
    w = torch.randn(connectivity, labels, generator=gen, dtype=dtype)
    b = torch.randn(labels, generator=gen, dtype=dtype)
    g = torch.randn(batch, labels, generator=gen, dtype=dtype) * (torch.rand(batch, labels, generator=gen) < density)
    return x, idx, w, b, g


def label_lists(gen: torch.Generator, rows: int, num_labels: int, most: int = 4, least: int = 0):
    """CSR label lists (label_ptr, label_idx): ``least``..``most`` distinct labels per row."""
    counts = torch.randint(least, most + 1, (rows,), generator=gen)
    label_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    parts = [torch.randperm(num_labels, generator=gen)[:c] for c in counts.tolist()]
    return label_ptr, torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def quiet_trainer(tmp_path, **kwargs):
    """A Lightning Trainer without logger, progress bar, summary, checkpoints or sanity validation."""
    import lightning.pytorch as pl

    settings = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    num_sanity_val_steps=0, default_root_dir=tmp_path)
    return pl.Trainer(**{**settings, **kwargs})


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """(directory, run id, the command's CompletedProcess) of one tiny real run through the command line
    (test_reliability_common.TINY, one epoch), made once: the tests that read its output, its store or its
    checkpoint, or copy its folder to change it, share it (each run costs an interpreter start, ~10 s)."""
    from test_reliability_common import TINY, cli, copy_store, make_store, runs

    directory = tmp_path_factory.mktemp("finished")
    copy_store(make_store(tmp_path_factory.mktemp("store")), directory)
    result = cli(directory, [*TINY, "trainer.max_epochs=1"])
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(directory)
    return directory, run.info.run_id, result
