"""DataModule, dataset configs, .npy features: batches against a direct computation, resumable order, bad input."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import TINY
from omegaconf import OmegaConf

from xmc_repro.data import build_datamodule, load_npy_features, write_xc
from xmc_repro.data.datamodule import buffered_shuffle, share_bounds
from xmc_repro.data.labels import LabelCSR
from xmc_repro.data.sources import shared_data_root
from xmc_repro.errors import ConfigError, DataError
from xmc_repro.metrics import inverse_propensity

CONF = Path(__file__).resolve().parents[1] / "conf" / "dataset"


def setup_dm(cfg, **kw):
    dm = build_datamodule(cfg, **kw)
    dm.setup("fit")
    return dm


def random_labels(rng, n, L):
    lists = [sorted(rng.choice(L, rng.integers(0, 4), replace=False).tolist()) for _ in range(n)]
    return lists, LabelCSR(np.cumsum([0] + [len(r) for r in lists]), np.concatenate(lists + [[]]).astype(int), L)


def write_npy_dataset(root: Path, rng, n=(50, 20), d=6, L=9, features="slice"):
    lists = {}
    for split, rows in zip(("train", "test"), n):
        x = rng.normal(size=(rows, d)).astype(np.float32)
        lists[split], labels = random_labels(rng, rows, L)
        write_xc(root / f"{split}-labels.txt", np.ones((rows, 3), np.float32), labels)  # BoW part is ignored
        np.save(root / f"{split}-{features}.npy", x)
    return lists


def npy_cfg(root, **extra):
    return {"kind": "npy", "name": "Amazon-670K", "features": "slice", "data_dir": str(root), **extra}


# ------------------------------------------------------------------------------------------ batches


def test_batches_match_the_data(tmp_path):
    rng = np.random.default_rng(0)
    n, d, L = 37, 5, 11
    x = rng.normal(size=(n, d)).astype(np.float32)
    x[x < 0.3] = 0
    x[:, 0] = np.arange(1, n + 1)  # identifies the point
    lists, labels = random_labels(rng, n, L)
    write_xc(tmp_path / "tr.txt", x, labels)
    write_xc(tmp_path / "te.txt", x[:9], labels.take(np.arange(9)))
    cfg = {"kind": "xc", "name": "t", "data_dir": str(tmp_path), "train_file": "tr.txt", "test_file": "te.txt",
           "normalize": "none"}
    dm = setup_dm(cfg, batch_size=8, seed=3)
    assert (dm.num_features, dm.num_labels) == (d, L)
    seen = []
    for xb, ptr, idx in dm.train_dataloader():
        assert xb.dtype == torch.float32 and ptr.dtype == idx.dtype == torch.int64 and xb.shape[1] == d
        for r in range(len(xb)):
            i = int(xb[r, 0]) - 1
            np.testing.assert_array_equal(xb[r].numpy(), x[i])
            assert idx[ptr[r] : ptr[r + 1]].tolist() == lists[i]
            seen.append(i)
    assert sorted(seen) == list(range(n))
    batches = list(dm.test_dataloader())
    np.testing.assert_array_equal(torch.cat([b[0] for b in batches]).numpy(), x[:9])
    l2 = setup_dm({**cfg, "normalize": "l2"}, batch_size=8)
    xb = next(iter(l2.test_dataloader()))[0].numpy()
    norms = np.linalg.norm(x[:8], axis=1, keepdims=True)
    np.testing.assert_allclose(xb, np.divide(x[:8], norms, out=np.zeros_like(x[:8]), where=norms > 0), rtol=1e-6)


@pytest.mark.parametrize("world", [3, 16])
def test_ddp_ranks_get_the_global_batch_inputs_and_their_share_of_labels(world):
    """Each rank gets every global batch's inputs (the model draws dropout over them), the labels of its
    np.array_split part and the part's start; the parts cover every point once, the last batch (300 = 9 x 32 + 12)
    included, also where it has fewer points than ranks (16: the last four ranks' parts are empty)."""
    dm = setup_dm(TINY, batch_size=32, seed=5)
    x, labels = dm.train_split.features, dm.train_split.labels
    order = np.random.default_rng([5, 0]).permutation(300)
    ranks = []
    for rank in range(world):
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=world)
        loader = dm.train_dataloader()
        ranks.append(list(loader))
        assert len(ranks[-1]) == len(loader) == 10  # what Lightning counts on to validate after the last
    labelled = []
    for b, shares in enumerate(zip(*ranks)):
        positions = order[32 * b : 32 * (b + 1)]
        parts = np.array_split(positions, world)
        for rank, (xb, ptr, idx, start) in enumerate(shares):
            np.testing.assert_array_equal(xb.numpy(), x[positions])
            expected = labels.take(parts[rank])
            np.testing.assert_array_equal(ptr.numpy(), expected.ptr)
            np.testing.assert_array_equal(idx.numpy(), expected.idx)
            assert start == sum(map(len, parts[:rank]))
            assert share_bounds(len(positions), rank, world) == (start, start + len(parts[rank]))
            labelled.extend(parts[rank])
    assert sorted(labelled) == list(range(300))


def test_epoch_order_is_seeded_and_complete():
    dm = setup_dm(TINY, batch_size=32, seed=5)
    x = dm.train_split.features
    order = lambda epoch: np.random.default_rng([5, epoch]).permutation(300)
    loader = dm.train_dataloader()
    epoch0 = [b[0] for b in loader]
    assert len(epoch0) == len(loader) == 10  # 300 points, the last batch partial
    np.testing.assert_array_equal(torch.cat(epoch0).numpy(), x[order(0)])
    loader.sampler.set_epoch(1)
    np.testing.assert_array_equal(torch.cat([b[0] for b in loader]).numpy(), x[order(1)])
    # a fresh DataModule with the same seed gives the same first epoch; without set_epoch a pass moves on by itself
    again = setup_dm(TINY, batch_size=32, seed=5).train_dataloader()
    np.testing.assert_array_equal(torch.cat([b[0] for b in again]).numpy(), x[order(0)])
    np.testing.assert_array_equal(torch.cat([b[0] for b in again]).numpy(), x[order(1)])


def test_resume_mid_epoch_gives_the_remaining_batches():
    dm = setup_dm(TINY, batch_size=32, seed=1)
    full = dm.train_dataloader()
    full.sampler.set_epoch(2)
    reference = [b[0] for b in full]
    part = dm.train_dataloader()
    part.sampler.set_epoch(2)
    it = iter(part)
    for _ in range(4):
        next(it)
    state = part.state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 4
    resumed = dm.train_dataloader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)  # what Lightning calls after restoring: must not restart the epoch
    rest = [b[0] for b in resumed]
    assert len(rest) == len(reference) - 4
    assert all(torch.equal(a, b) for a, b in zip(rest, reference[4:]))
    # a state saved at the end of an epoch resumes at the start of the next one
    done = dm.train_dataloader()
    done.load_state_dict({**state, "consumed": len(reference)})
    assert done.sampler.epoch == 3 and done.sampler.start == 0
    with pytest.raises(ConfigError, match="same dataset and seed"):
        setup_dm(TINY, batch_size=32, seed=2).train_dataloader().load_state_dict(state)


def test_worker_processes_give_the_same_batches():
    a = [b[0] for b in setup_dm(TINY, batch_size=64, seed=0).train_dataloader()]
    b = [b[0] for b in setup_dm(TINY, batch_size=64, seed=0, num_workers=1).train_dataloader()]
    assert all(torch.equal(u, v) for u, v in zip(a, b)) and len(a) == len(b)


def test_holdout_split_and_label_counts():
    test_dm = setup_dm(TINY, seed=4)
    dm = setup_dm({**TINY, "holdout_fraction": 0.2}, seed=4, validate_on="holdout")
    train_rows, val_rows = dm.train_rows, dm.val_rows
    assert len(val_rows) == 60 and len(np.intersect1d(train_rows, val_rows)) == 0
    assert len(train_rows) + len(val_rows) == 300
    labels = dm.train_split.labels
    expected = np.bincount(np.concatenate([labels.row(i) for i in train_rows]), minlength=40)
    np.testing.assert_array_equal(dm.train_label_counts, expected)
    assert dm.train_label_counts.num_points == 240 == dm.num_train_points
    val_x = torch.cat([b[0] for b in dm.val_dataloader()]).numpy()
    np.testing.assert_array_equal(val_x, dm.train_split.features[val_rows])
    assert sum(len(b[0]) for b in dm.train_dataloader()) == 240
    assert sum(len(b[0]) for b in test_dm.val_dataloader()) == 70  # validate_on=test: the test split
    np.testing.assert_array_equal(test_dm.train_label_counts, labels.label_counts())
    # propensities straight from the DataModule's counts (N travels with them)
    ip = inverse_propensity(dm.train_label_counts, 0.55, 1.5)
    c = (np.log(240) - 1) * 2.5**0.55
    np.testing.assert_allclose(ip, 1 + c * (expected + 1.5) ** -0.55)


def test_train_eval_loader_is_a_fixed_random_prefix():
    dm = setup_dm(TINY, batch_size=16, seed=0)
    x = dm.train_split.features
    full = torch.cat([b[0] for b in dm.train_eval_dataloader()]).numpy()
    assert len(full) == 300 and not np.array_equal(full, x)
    part = torch.cat([b[0] for b in dm.train_eval_dataloader(max_points=50)]).numpy()
    np.testing.assert_array_equal(part, full[:50])
    np.testing.assert_array_equal(torch.cat([b[0] for b in dm.train_eval_dataloader()]).numpy(), full)


# ------------------------------------------------------------------------------------------ .npy features


def test_npy_dataset_loads_memory_mapped(tmp_path):
    rng = np.random.default_rng(2)
    lists = write_npy_dataset(tmp_path, rng)
    dm = setup_dm(npy_cfg(tmp_path, feature_dim=6), batch_size=7)
    assert isinstance(dm.train_split.features, np.memmap)
    assert (dm.num_features, dm.num_labels) == (6, 9)
    ptrs = [(b[1], b[2]) for b in dm.test_dataloader()]
    got = [idx[p[r] : p[r + 1]].tolist() for p, idx in ptrs for r in range(len(p) - 1)]
    assert got == lists["test"]
    np.testing.assert_array_equal(torch.cat([b[0] for b in dm.test_dataloader()]).numpy(), np.load(tmp_path / "test-slice.npy"))


@pytest.mark.parametrize(
    "array,message",
    [
        (np.zeros((50, 6), np.float64), "dtype float64, expected float32"),
        (np.zeros((50, 6), np.int32), "dtype int32"),
        (np.zeros((50, 6, 1), np.float32), "expected a 2-D"),
        (np.zeros((49, 6), np.float32), "49 rows but its labels file has 50 points"),
        (np.zeros((50, 5), np.float32), "5 features per point, expected 6"),
    ],
)
def test_npy_wrong_shape_or_dtype(tmp_path, array, message):
    write_npy_dataset(tmp_path, np.random.default_rng(0))
    np.save(tmp_path / "train-slice.npy", array)
    with pytest.raises(DataError, match=message) as info:
        setup_dm(npy_cfg(tmp_path, feature_dim=6))
    assert str(info.value).startswith(str(tmp_path / "train-slice.npy"))


def test_npy_without_features_is_refused(tmp_path):
    """A (points, 0) array trained a model over no inputs (its biases alone) and reported its P@k."""
    np.save(tmp_path / "x.npy", np.zeros((5, 0), np.float32))
    with pytest.raises(DataError, match=r"x\.npy: shape \(5, 0\), no features per point"):
        load_npy_features(tmp_path / "x.npy", rows=5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_npy_nonfinite(tmp_path, monkeypatch, bad):
    import xmc_repro.data.features as features

    monkeypatch.setattr(features, "FINITE_CHECK_ROWS", 8)  # the bad row lies in a later block
    write_npy_dataset(tmp_path, np.random.default_rng(0))
    x = np.load(tmp_path / "test-slice.npy")
    x[13, 4] = bad
    np.save(tmp_path / "test-slice.npy", x)
    with pytest.raises(DataError, match=r"test-slice.npy: row 13 \(0-based\), column 4"):
        setup_dm(npy_cfg(tmp_path))


def test_not_an_npy_file(tmp_path):
    (tmp_path / "f.npy").write_text("hello")
    with pytest.raises(DataError, match="not a readable .npy"):
        load_npy_features(tmp_path / "f.npy")
    with pytest.raises(DataError, match="file not found"):
        load_npy_features(tmp_path / "g.npy")


def test_an_npz_archive_is_named_as_one(tmp_path):
    """np.load opens a numpy.savez archive whatever the file is called: it has no dtype (was an AttributeError)."""
    np.savez(tmp_path / "train.npz", emb=np.zeros((3, 4), np.float32))
    (tmp_path / "train-slice.npy").write_bytes((tmp_path / "train.npz").read_bytes())
    for name in ("train.npz", "train-slice.npy"):
        with pytest.raises(DataError, match=rf"{name}: an \.npz archive \(arrays: emb\), not an \.npy array; save "
                                            r"the features as one, e\.g\. numpy\.save\('features\.npy', numpy\.load"):
            load_npy_features(tmp_path / name, rows=3)


def test_missing_files_are_listed_with_their_source(tmp_path):
    cfg = OmegaConf.load(CONF / "amazon670k_cascade.yaml")
    cfg.data_dir = str(tmp_path)
    (tmp_path / "train-labels.txt").write_text("0 1 1\n")
    with pytest.raises(DataError) as info:
        setup_dm(cfg)
    msg = str(info.value)
    for name in ("test-labels.txt", "train-cascade.npy", "test-cascade.npy"):
        assert name in msg.split("Expected")[0]
    assert "missing train-labels.txt" not in msg
    assert "CascadeXML" in msg and "Extreme Classification Repository" in msg and "dataset.data_dir" in msg
    assert "\n" not in msg


def test_train_test_dimension_mismatch(tmp_path):
    write_npy_dataset(tmp_path, np.random.default_rng(0))
    np.save(tmp_path / "test-slice.npy", np.zeros((20, 7), np.float32))
    with pytest.raises(DataError, match="test-slice.npy: 7 features per point but .*train-slice.npy has 6"):
        setup_dm(npy_cfg(tmp_path))
    np.save(tmp_path / "test-slice.npy", np.zeros((20, 6), np.float32))
    text = (tmp_path / "test-labels.txt").read_text().split("\n", 1)
    (tmp_path / "test-labels.txt").write_text("20 3 10\n" + text[1])  # the label files declare the labels
    with pytest.raises(DataError, match="test-labels.txt: declares 10 labels but .*train-labels.txt declares 9"):
        setup_dm(npy_cfg(tmp_path))
    rng = np.random.default_rng(1)
    _, labels = random_labels(rng, 5, 4)
    write_xc(tmp_path / "a.txt", np.ones((5, 3), np.float32), labels)
    write_xc(tmp_path / "b.txt", np.ones((5, 4), np.float32), labels)
    cfg = {"kind": "xc", "data_dir": str(tmp_path), "train_file": "a.txt", "test_file": "b.txt"}
    with pytest.raises(DataError, match="b.txt: 4 features per point but .*a.txt has 3"):
        setup_dm(cfg)
    write_xc(tmp_path / "c.txt", np.ones((5, 3), np.float32), LabelCSR(labels.ptr, labels.idx, 6))
    with pytest.raises(DataError, match="c.txt: declares 6 labels"):
        setup_dm({**cfg, "test_file": "c.txt"})


def test_a_missing_xc_file_gets_the_fix_that_fits_how_it_was_named(tmp_path):
    (tmp_path / "a.txt").write_text("1 3 2\n0 1:1\n")
    with pytest.raises(DataError, match=r"missing .*b.txt; set dataset.data_dir=DIR"):
        setup_dm({"kind": "xc", "data_dir": str(tmp_path), "train_file": "a.txt", "test_file": "b.txt"})
    given = {"train_file": str(tmp_path / "a.txt"), "test_file": str(tmp_path / "b.txt")}  # in full: no folder
    with pytest.raises(DataError, match=r"missing .*b.txt; check dataset.train_file and dataset.test_file$"):
        setup_dm({"kind": "xc", **given})


def test_empty_split(tmp_path):
    (tmp_path / "a.txt").write_text("0 3 2\n")
    (tmp_path / "b.txt").write_text("1 3 2\n0 1:1\n")
    with pytest.raises(DataError, match="a.txt: no data points"):
        setup_dm({"kind": "xc", "data_dir": str(tmp_path), "train_file": "a.txt", "test_file": "b.txt"})


def test_xc_bad_line_surfaces_through_the_datamodule(tmp_path):
    (tmp_path / "a.txt").write_text("2 3 2\n0 1:1\n1 5:1\n")
    (tmp_path / "b.txt").write_text("1 3 2\n0 1:1\n")
    with pytest.raises(DataError, match=r"a.txt:3: feature index 5 >= 3"):
        setup_dm({"kind": "xc", "data_dir": str(tmp_path), "train_file": "a.txt", "test_file": "b.txt"})


@pytest.mark.parametrize(
    "cfg,kw,message",
    [
        ({"kind": "csv"}, {}, "dataset.kind='csv' is unknown"),
        ({"kind": "xc", "train_file": None, "test_file": "x"}, {}, "dataset.train_file is not set"),
        ({**TINY, "num_labels": 0}, {}, "dataset.num_labels=0 must be a positive"),
        ({**TINY, "sign_flip": 0.9}, {}, "dataset.sign_flip=0.9"),
        (TINY, {"validate_on": "val"}, "validate_on='val'"),
        ({**TINY, "holdout_fraction": 1.5}, {"validate_on": "holdout"}, "holdout_fraction=1.5"),
    ],
)
def test_config_errors(cfg, kw, message):
    with pytest.raises(ConfigError, match=message):
        setup_dm(cfg, **kw)


def test_xc_normalize_setting(tmp_path):
    (tmp_path / "a.txt").write_text("1 3 2\n0 1:1\n")
    with pytest.raises(ConfigError, match="dataset.normalize='max'"):
        setup_dm({"kind": "xc", "data_dir": str(tmp_path), "train_file": "a.txt", "test_file": "a.txt",
                  "normalize": "max"})


# ------------------------------------------------------------------------------------------ configs

PAPER = {  # name, dropout, propensity A/B, max_epochs, rewiring (paper/README.md)
    "wiki10_31k": ("Wiki10-31K", "cascade", 0.2, (0.55, 1.5), 200, "epoch"),
    "amazon670k_slice": ("Amazon-670K", "slice", 0.1, (0.6, 2.6), 100, 1000),
    "amazon670k_cascade": ("Amazon-670K", "cascade", 0.1, (0.6, 2.6), 100, 1000),
    "wikipedia500k_slice": ("Wikipedia-500K", "slice", 0.1, (0.5, 0.4), 100, 1000),
    "wikipedia500k_cascade": ("Wikipedia-500K", "cascade", 0.2, (0.5, 0.4), 100, 1000),
}


def compose_dataset(stem: str):
    """cfg.dataset as the command line composes it (dataset configs may extend one another)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF.parent), version_base="1.3"):
        return compose("config", overrides=[f"dataset={stem}"]).dataset


def test_every_dataset_config_composes_with_the_common_keys():
    stems = sorted(f.stem for f in CONF.glob("*.yaml"))
    assert set(stems) >= {"synthetic", "synthetic_amazon670k", "bibtex", "delicious", "xc", *PAPER}
    for stem in stems:
        cfg = compose_dataset(stem)
        for key in ("name", "features", "kind", "propensity", "dropout", "max_epochs"):
            assert key in cfg, (stem, key)
        assert cfg.features in ("slice", "cascade", "bow", "synthetic") and cfg.kind in ("synthetic", "xc", "npy")
        assert cfg.rewire_every_epoch or int(cfg.rewire_every_n_steps) > 0, stem
        assert 0 <= cfg.dropout < 1 and cfg.propensity.A > 0 and cfg.propensity.B > 0
        if cfg.kind == "synthetic" and cfg.num_train * cfg.num_labels < 10**8:  # small ones: generate and check
            dm = setup_dm(cfg)
            assert (dm.num_train_points, dm.num_features, dm.num_labels) == (
                cfg.num_train, cfg.num_features, cfg.num_labels)


@pytest.mark.parametrize("stem", sorted(PAPER))
def test_paper_dataset_configs(stem, tmp_path):
    name, features, dropout, (a, b), epochs, rewire = PAPER[stem]
    cfg = compose_dataset(stem)
    assert (cfg.name, cfg.features, cfg.dropout, cfg.propensity.A, cfg.propensity.B, cfg.max_epochs) == (
        name, features, dropout, a, b, epochs)
    assert cfg.rewire_every_epoch if rewire == "epoch" else cfg.rewire_every_n_steps == rewire
    cfg.data_dir = str(tmp_path)
    write_npy_dataset(tmp_path, np.random.default_rng(0), d=cfg.feature_dim, features=features)
    dm = setup_dm(cfg)
    assert dm.num_features == cfg.feature_dim


def test_synthetic_configs():
    small = OmegaConf.load(CONF / "synthetic.yaml")
    dm = setup_dm(small)
    assert (dm.num_features, dm.num_labels, dm.num_train_points) == (128, 1000, 10000)
    amazon = OmegaConf.load(CONF / "synthetic_amazon670k.yaml")
    assert (amazon.num_labels, amazon.num_train, amazon.num_test, amazon.num_features) == (670091, 490449, 153025, 768)
    assert (amazon.propensity.A, amazon.propensity.B) == (0.6, 2.6)


@pytest.mark.skipif(not (shared_data_root() / "Bibtex").is_dir(), reason="shared data not available")
def test_real_dataset_configs(tmp_path):
    bib = setup_dm(OmegaConf.load(CONF / "bibtex.yaml"))
    assert (bib.num_features, bib.num_labels, bib.num_train_points, len(bib.test_split.labels.ptr) - 1) == (
        1836, 159, 4880, 2515)
    deli = setup_dm(OmegaConf.load(CONF / "delicious.yaml"))
    assert (deli.num_features, deli.num_labels, deli.num_train_points) == (500, 983, 12920)
    cfg = OmegaConf.load(CONF / "bibtex.yaml")
    cfg.data_dir = str(tmp_path)  # the override wins over the shared default
    with pytest.raises(DataError, match="bibtex_train_xc.txt.*dataset.data_dir"):
        setup_dm(cfg)
    generic = OmegaConf.load(CONF / "xc.yaml")
    generic.train_file = str(shared_data_root() / "Bibtex" / "bibtex_train_xc.txt")
    generic.test_file = str(shared_data_root() / "Bibtex" / "bibtex_test_xc.txt")
    assert setup_dm(generic).num_labels == 159


# ------------------------------------------------------------------------------------------ with Lightning


class _Recorder:
    """A LightningModule that records which points each training batch holds."""

    @staticmethod
    def make():
        import lightning.pytorch as pl

        class Recorder(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(1))
                self.seen = []

            def training_step(self, batch, batch_idx):
                x, ptr, idx = batch
                self.seen.append(x[:, 0].tolist())
                return (self.w * x.sum()).square()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.0)

        return Recorder()


def test_lightning_checkpoint_resumes_mid_epoch_with_the_same_batches(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    cfg = {**TINY, "num_train": 200}
    kw = dict(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path)
    full = _Recorder.make()
    pl.Trainer(**kw).fit(full, datamodule=build_datamodule(cfg, batch_size=16, seed=9))
    assert len(full.seen) == 26  # 13 batches x 2 epochs

    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    first = _Recorder.make()
    pl.Trainer(**{**kw, "max_epochs": 1}, callbacks=[every]).fit(first, datamodule=build_datamodule(cfg, batch_size=16, seed=9))
    resumed = _Recorder.make()
    pl.Trainer(**kw).fit(resumed, datamodule=build_datamodule(cfg, batch_size=16, seed=9),
                         ckpt_path=tmp_path / "ck" / "step=10.ckpt")
    assert resumed.seen == full.seen[10:]


def _window_shuffle_step_by_step(n: int, buffer: int, rng: np.random.Generator) -> np.ndarray:
    """tf.data's shuffle(buffer) written as it runs: the reference for the vectorised ``buffered_shuffle``."""
    out, pool = [], list(range(buffer))
    for i, slot in enumerate(rng.integers(0, buffer, size=n - buffer).tolist()):
        out.append(pool[slot])
        pool[slot] = buffer + i
    return np.array(out + rng.permutation(pool).tolist())


def test_buffered_shuffle_is_tf_datas_window_shuffle():
    rng = lambda: np.random.default_rng([3, 0])  # noqa: E731
    for n, buffer in ((1000, 64), (1000, 1), (257, 256), (2, 1), (5003, 17)):
        order = buffered_shuffle(n, buffer, rng())
        np.testing.assert_array_equal(order, _window_shuffle_step_by_step(n, buffer, rng()))
        assert sorted(order.tolist()) == list(range(n))
        # a point leaves the buffer only after it entered: position i holds one of the first i + buffer points
        assert (order < np.arange(n) + buffer).all()
    assert (buffered_shuffle(50, 1, rng()) == np.arange(50)).all()  # a buffer of one keeps the file order
    # the first draws come from the whole buffer, not from its start: about uniform over 64 slots
    firsts = [buffered_shuffle(1000, 64, np.random.default_rng([s, 0]))[0] for s in range(400)]
    assert max(firsts) >= 56 and min(firsts) <= 7 and 24 <= np.mean(firsts) <= 40
    # a set no larger than the buffer: exactly the uniform permutation (the order of runs before the setting)
    for buffer in (None, 1000, 5000):
        assert (buffered_shuffle(1000, buffer, rng()) == rng().permutation(1000)).all()


def test_the_training_order_follows_shuffle_buffer():
    n = TINY["num_train"]
    for buffer, expected in ((None, np.random.default_rng([5, 1]).permutation(n)),
                             (40, buffered_shuffle(n, 40, np.random.default_rng([5, 1])))):
        dm = build_datamodule(TINY, batch_size=32, seed=5, shuffle_buffer=buffer)
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(1)
        np.testing.assert_array_equal(torch.cat([b[0] for b in loader]).numpy(), dm.train_split.features[expected])
