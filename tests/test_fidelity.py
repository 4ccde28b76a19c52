"""The authors' training behaviour as the defaults: initialisation, rewiring schedule and count, Keras's Adam, LR
halving, the best epoch and when it is restored, tf-idf."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from conftest import DEVICES
from torch import nn

from xmc_repro.callbacks import BestCheckpoint, Rewiring, early_stopping
from xmc_repro.data import build_datamodule
from xmc_repro.errors import ConfigError
from xmc_repro.data.features import inverse_document_frequency, tfidf_rows
from xmc_repro.model import XMCClassifier
from xmc_repro.optim import KerasAdam
from xmc_repro.train import restores_best

TINY = {"kind": "synthetic", "name": "Tiny", "num_train": 200, "num_test": 40, "num_features": 24,
        "num_labels": 60, "latent_dim": 8, "labels_per_point": 2.0, "data_seed": 0, "holdout_fraction": 0.1}


@pytest.mark.parametrize("schedule,steps", [("authors", [1, 5, 9, 13]), ("multiples", [4, 8, 12])])
def test_rewiring_schedule(schedule, steps):
    rewiring = Rewiring(0.1, every_n_steps=4, schedule=schedule)
    assert [s for s in range(0, 15) if rewiring.due(s)] == steps
    # the authors' `iterations % N == 1` for N >= 2; every step for N = 1 (their formula would never fire)
    assert all(Rewiring(0.1, every_n_steps=1).due(s) for s in range(1, 5))
    assert not any(Rewiring(0.1, every_n_steps=None).due(s) for s in range(1, 5))
    with pytest.raises(ValueError, match="'weekly'"):
        Rewiring(0.1, every_n_steps=4, schedule="weekly")


class _RecordRewirings(Rewiring):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []  # (step, slots below the threshold, the fraction's count, slots rewired)

    @torch.no_grad()
    def rewire(self, trainer, pl_module):
        layer = pl_module.head
        before = layer.weight.detach().abs().view(-1).clone()
        rewired = []  # the slots the layer's own rewire returned: what the callback had it rewire

        def recorded(*args, **kwargs):
            rewired.append(type(layer).rewire(layer, *args, **kwargs))
            return rewired[-1]

        layer.rewire = recorded
        try:
            super().rewire(trainer, pl_module)
        finally:
            del layer.rewire
        count = round(self.fraction * before.numel())
        threshold = before.sort().values[count - 1]
        self.events.append((trainer.global_step, int((before < threshold).sum()), count, rewired[0].numel()))


@pytest.mark.parametrize("schedule,exact,steps", [("authors", False, [1, 4, 7, 10]), ("multiples", True, [3, 6, 9])])
def test_rewiring_in_training_steps_and_slot_count(tmp_path, schedule, exact, steps):
    pl.seed_everything(0, verbose=False)
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="uniform", connectivity=4)
    rewiring = _RecordRewirings(0.25, every_n_steps=3, schedule=schedule, exact_count=exact)
    trainer = pl.Trainer(max_steps=10, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[rewiring], default_root_dir=tmp_path)
    trainer.fit(model, datamodule=build_datamodule(TINY, batch_size=16, seed=0))
    assert [step for step, *_ in rewiring.events] == steps
    assert rewiring.rewirings == len(steps)
    # the authors rewire the weights strictly below the threshold: one slot fewer than the fraction here;
    # exact_count (model.rewire_exact_count) rewires the fraction's count
    for _, below, count, rewired in rewiring.events:
        assert count == 60 and below == count - 1
        assert rewired == (count if exact else below)


def test_authors_init_of_dense_layers_is_glorot_uniform_with_zero_bias():
    pl.seed_everything(0, verbose=False)
    model = XMCClassifier(300, 5000, head="dense", intermediate=700)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2
    for layer in linears:
        fan_out, fan_in = layer.weight.shape
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        w = layer.weight.detach().double()
        assert bound * 0.99 < float(w.abs().max()) <= bound
        assert abs(float(w.var()) * 3 / bound**2 - 1) < 0.02
        assert torch.count_nonzero(layer.bias) == 0
    with pytest.raises(ConfigError, match="model.init='keras' is unknown"):
        XMCClassifier(300, 5000, head="dense", init="keras")
    torch_default = XMCClassifier(300, 5000, head="dense", intermediate=700, init="fan_in")
    assert torch.count_nonzero(torch_default.head.bias) > 0
    assert 0.99 / math.sqrt(300) < float(torch_default.encoder[1].weight.abs().max()) <= 1 / math.sqrt(300)


def test_bottleneck_follows_the_authors_dense_relu_dense():
    model = XMCClassifier(30, 50, head="bottleneck", bottleneck=8)
    kinds = [type(m) for m in model.head]
    assert kinds == [nn.Linear, nn.ReLU, nn.Linear] and model.head[0].bias is not None
    linear = XMCClassifier(30, 50, head="bottleneck", bottleneck=8, bottleneck_activation="linear")
    assert [type(m) for m in linear.head] == [nn.Linear, nn.Linear] and linear.head[0].bias is None


def test_adam_epsilon_is_keras_default():
    model = XMCClassifier(10, 20, head="dense")
    optimizer = model.configure_optimizers()["optimizer"]
    assert optimizer.defaults["eps"] == 1e-7 and isinstance(optimizer, KerasAdam)
    assert optimizer.defaults["fused"]  # on the CPU too: about 10x faster than the multi-tensor path
    torch_adam = XMCClassifier(10, 20, head="dense", adam_eps_placement="torch").configure_optimizers()["optimizer"]
    assert type(torch_adam) is torch.optim.Adam
    with pytest.raises(ConfigError, match="trainer.adam_eps_placement='tf' is unknown"):
        XMCClassifier(10, 20, head="dense", adam_eps_placement="tf")


def test_keras_adam_defaults_are_keras_defaults():
    optimizer = KerasAdam([nn.Parameter(torch.zeros(2))])
    assert optimizer.defaults["lr"] == 1e-3 and optimizer.defaults["eps"] == 1e-7


def _keras_adam_steps(p, grads, lr=1e-3, b1=0.9, b2=0.999, eps=1e-7):
    """Keras's Adam update (tf.raw_ops.ApplyAdam), written out in float64."""
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * math.sqrt(1 - b2**t) / (1 - b1**t) * m / (v.sqrt() + eps)
    return p


@pytest.mark.parametrize("fused", [True, None], ids=["fused", "foreach"])  # the model's (fused) and torch's default
@pytest.mark.parametrize("device", DEVICES)
def test_keras_adam_is_the_keras_update_and_resumes_where_it_stopped(device, fused):
    torch.manual_seed(0)
    start = torch.randn(7, 13, dtype=torch.float64) * 1e-3
    # gradients near epsilon's size, where its placement shows; one slot never gets a gradient
    grads = [torch.randn(7, 13, dtype=torch.float64) * 10.0 ** torch.randint(-8, -4, (7, 13)) for _ in range(6)]
    for g in grads:
        g[0, 0] = 0
    expected = _keras_adam_steps(start, grads)

    def run(optimizer_kind, steps, param=None, state=None):
        param = param if param is not None else nn.Parameter(start.clone().to(device))
        optimizer = optimizer_kind([param], lr=1e-3, eps=1e-7, fused=fused)
        if state is not None:
            optimizer.load_state_dict(state)
        for g in steps:
            param.grad = g.clone().to(device)
            optimizer.step()
        return param.detach().cpu(), optimizer

    got, _ = run(KerasAdam, grads)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
    torch_adam, _ = run(torch.optim.Adam, grads)  # eps after the bias correction: another update
    assert (torch_adam - expected).abs().max() > 0.1 * (expected - start).abs().max()
    # torch's step hooks run once a step (Adam's own step is wrapped with them too, once an Adam exists)
    hooked, calls = nn.Parameter(torch.zeros(2)), []
    optimizer = KerasAdam([hooked])
    optimizer.register_step_pre_hook(lambda *_: calls.append(1))
    hooked.grad = torch.ones(2)
    optimizer.step()
    assert calls == [1]
    # a resumed run: the step count comes back with the optimizer's state
    half, optimizer = run(KerasAdam, grads[:3])
    resumed, _ = run(KerasAdam, grads[3:], param=nn.Parameter(half.clone().to(device)), state=optimizer.state_dict())
    torch.testing.assert_close(resumed, expected, rtol=1e-10, atol=0)


def test_keras_adam_does_not_count_a_step_that_a_grad_scaler_skipped():
    """fp16 training: GradScaler hands a fused optimizer `found_inf` and the step skips itself, so torch's step count
    stays. Keras's epsilon counted the step anyway, and every later update used the epsilon of a later step."""
    torch.manual_seed(0)
    start = torch.randn(7, 13, dtype=torch.float64) * 1e-3
    grads = [torch.randn(7, 13, dtype=torch.float64) * 1e-7 for _ in range(3)]  # near epsilon, where it shows
    param = nn.Parameter(start.clone())
    optimizer, scaler = KerasAdam([param], fused=True), torch.amp.GradScaler("cpu", init_scale=4.0)
    for g in (grads[0], torch.full_like(start, math.inf), *grads[1:]):
        param.grad = None
        scaler.scale((param * g).sum()).backward()  # gradient g, scaled
        scaler.step(optimizer)
        scaler.update()
    assert optimizer.param_groups[0]["keras_steps"] == int(optimizer.state[param]["step"]) == 3
    torch.testing.assert_close(param.detach(), _keras_adam_steps(start, grads), rtol=1e-10, atol=0)


def test_keras_adam_goes_on_from_the_steps_of_a_torch_adam_state():
    """A torch Adam's state loaded into KerasAdam: Keras's step count restarted at 1 while torch's bias correction
    went on from its own, so epsilon and bias correction belonged to different steps."""
    param = nn.Parameter(torch.zeros(4))
    adam = torch.optim.Adam([param], eps=1e-7)
    for _ in range(3):
        param.grad = torch.ones(4)
        adam.step()
    keras = KerasAdam([param])
    keras.load_state_dict(adam.state_dict())
    param.grad = torch.ones(4)
    keras.step()
    group = keras.param_groups[0]
    assert group["keras_steps"] == int(keras.state[param]["step"]) == 4
    assert group["eps"] == pytest.approx(1e-7 / math.sqrt(1 - 0.999**4))


def test_tfidf_against_a_direct_computation():
    rng = np.random.default_rng(0)
    counts = (rng.random((30, 12)) < 0.3) * rng.integers(1, 5, (30, 12))
    counts[:, 11] = 0  # a feature never seen in training
    test_counts = (rng.random((7, 12)) < 0.4) * rng.integers(1, 3, (7, 12))
    idf = inverse_document_frequency(sp.csr_matrix(counts))
    df = (counts > 0).sum(0)
    expected_idf = np.log((1 + 30) / (1 + df)) + 1
    np.testing.assert_allclose(idf, expected_idf, rtol=1e-6)
    for x in (counts, test_counts):  # the test split uses the training idf
        got = tfidf_rows(sp.csr_matrix(x), idf).toarray()
        weighted = x * expected_idf
        norms = np.linalg.norm(weighted, axis=1, keepdims=True)
        expected = np.divide(weighted, norms, out=np.zeros_like(weighted, dtype=float), where=norms > 0)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
        assert got.dtype == np.float32


@pytest.mark.parametrize("stem,labels_per_point,points_per_label", [
    ("smoke_amazon670k_cascade", 5.45, 3.99), ("smoke_wiki10_31k", 18.64, 8.52),
    ("smoke_wikipedia500k_slice", 4.77, 24.75)])
def test_stand_ins_have_the_label_statistics_of_their_datasets(stem, labels_per_point, points_per_label):
    """Labels per point and training points per label as the XC repository lists them for the real dataset."""
    from omegaconf import OmegaConf

    from xmc_repro.data.synthetic import SyntheticModel, SyntheticSpec
    from xmc_repro.resources import resource_dir

    conf = resource_dir("conf") / "dataset"
    cfg = OmegaConf.merge(OmegaConf.load(conf / "synthetic.yaml"), OmegaConf.load(conf / f"{stem}.yaml"))
    spec = SyntheticSpec.from_config(cfg)
    _, labels = SyntheticModel(spec).split("train")
    pairs = len(labels.idx)
    assert abs(pairs / spec.num_train / labels_per_point - 1) < 0.05
    assert abs(pairs / spec.num_labels / points_per_label - 1) < 0.05


def test_lr_halves_after_lr_patience_epochs_without_improvement_as_keras_does():
    model = XMCClassifier(TINY["num_features"], TINY["num_labels"], head="dense", lr=1e-3, lr_patience=2,
                          lr_threshold=1e-3)
    scheduler = model.configure_optimizers()["lr_scheduler"]["scheduler"]
    # val P@3 (percent); an improvement must exceed the best by 0.1 points. Keras's ReduceLROnPlateau halves
    # when `patience` epochs in a row fail to improve (epochs 2-3, then 6-7), and counts afresh after halving.
    lrs = []
    for p3 in (10.0, 10.05, 10.05, 10.05, 10.2, 10.2, 10.2, 10.25):
        scheduler.step(p3)
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([1e-3, 1e-3, 5e-4, 5e-4, 5e-4, 5e-4, 2.5e-4, 2.5e-4])


def test_best_epoch_must_beat_the_best_by_min_delta(tmp_path):
    best = BestCheckpoint(dirpath=tmp_path, monitor="val/p_at_3", mode="max", min_delta=5e-5)  # 0.005 points
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert best.check_monitor_top_k(trainer, torch.tensor(10.0))  # the first epoch is the best so far
    best.best_k_models, best.kth_best_model_path = {"best.ckpt": torch.tensor(10.0)}, "best.ckpt"
    assert not best.check_monitor_top_k(trainer, torch.tensor(10.004))
    assert best.check_monitor_top_k(trainer, torch.tensor(10.006))


def test_the_best_weights_are_restored_only_when_early_stopping_ended_the_run():
    stopped, ran_out = early_stopping(4, 5e-5), early_stopping(4, 5e-5)
    stopped.stopped_epoch = 11  # Lightning sets it when patience runs out
    assert restores_best("early_stop", stopped) and not restores_best("early_stop", ran_out)
    assert not restores_best("early_stop", None)
    assert restores_best("always", ran_out) and restores_best("always", None)


def _tested_run(directory, settings, **_):
    from test_reliability_common import TINY as CLI_TINY
    from test_reliability_common import cli, copy_store, make_store

    copy_store(make_store(directory / "store"), directory)
    # seed 1 at this learning rate: val P@3 peaks before the third and last epoch
    return directory, cli(directory, [*CLI_TINY, "trainer.max_epochs=3", "trainer.lr=0.03", "seed=1", *settings])


@pytest.fixture(scope="module")
def tested_runs(request, tmp_path_factory):
    """The runs of the test below, side by side: (directory, finished command) per case id."""
    from test_reliability_common import together

    return together(request, tmp_path_factory,
                    {"test_a_run_is_tested_with_the_weights_the_authors_would_test": _tested_run})


@pytest.mark.parametrize("settings,tested", [
    ([], "last epoch"),  # max_epochs ends the run: tested as the last epoch leaves it
    (["trainer.early_stop_patience=1"], "best epoch"),  # early stopping ends it: the best epoch's weights
    (["trainer.restore_best=always"], "best epoch"),
])
def test_a_run_is_tested_with_the_weights_the_authors_would_test(tested_runs, request, settings, tested):
    from mlflow.tracking import MlflowClient
    from test_reliability_common import runs, tracking_uri

    tmp_path, result = tested_runs[request.node.name].result()
    assert result.returncode == 0, result.stderr[-2000:]
    (run,) = runs(tmp_path)
    history = [m.value for m in MlflowClient(tracking_uri(tmp_path)).get_metric_history(run.info.run_id, "val/p_at_3")]
    assert max(history) > history[-1], "this setup no longer peaks early; pick another seed or learning rate"
    assert run.data.tags["tested_weights"] == tested
    expected = history[-1] if tested == "last epoch" else max(history)
    assert run.data.metrics["test/p_at_3"] == pytest.approx(expected, abs=1e-3)  # validate_on=test
    assert 0 <= run.data.metrics["sparse/repeated_connections_pct"] < 50  # the uniform head's, drawn with replacement


def _authors_hits(top: list[list[int]], labels: list[list[int]]) -> int:
    """Hits as the authors' PrecisionAtK counts them: TensorFlow's SparseAdd walks the sorted top-k (row, label)
    pairs and the label pairs as the file lists them with two pointers, and a hit is a pair they reach together."""
    a = [(r, j) for r, row in enumerate(top) for j in sorted(row)]
    b = [(r, j) for r, row in enumerate(labels) for j in row]
    i = n = hits = 0
    while i < len(a) and n < len(b):
        if a[i] < b[n]:
            i += 1
        elif a[i] > b[n]:
            n += 1
        else:
            hits, i, n = hits + 1, i + 1, n + 1
    return hits


def test_our_p_at_k_counts_the_hits_the_authors_count_on_labels_listed_in_order_and_more_otherwise():
    from xmc_repro.data.labels import LabelCSR
    from xmc_repro.metrics import XMCMetrics

    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(64, 12, generator=gen)
    listed = [torch.randint(12, (int(n),), generator=gen).tolist() for n in torch.randint(0, 7, (64,), generator=gen)]
    csr = LabelCSR(np.cumsum([0] + [len(r) for r in listed]), [j for r in listed for j in r], 12).deduplicated()
    top = scores.topk(3, dim=1).indices.tolist()
    metrics = XMCMetrics(12, ks=(3,))
    metrics.update(scores, torch.from_numpy(csr.ptr), torch.from_numpy(csr.idx))
    ours = metrics.compute()["p_at_3"] * 64 * 3 / 100
    assert csr.unsorted_rows > 10
    assert ours == pytest.approx(_authors_hits(top, [sorted(r) for r in listed]))  # in order, repeats kept: equal
    assert ours > _authors_hits(top, listed)  # as listed: theirs misses some
