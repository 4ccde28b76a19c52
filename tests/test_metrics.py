"""P@k, nDCG@k, PSP@k: streamed metrics against a direct per-row computation and against napkinxc."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from xmc_repro.data.labels import LabelCSR
from xmc_repro.data.sources import shared_data_root
from xmc_repro.metrics import XMCMetrics, inverse_propensity


def direct(scores: np.ndarray, lists, invp, ks=(1, 3, 5)) -> dict:
    """Textbook definitions, one row at a time (percent)."""
    n = len(lists)
    out = {}
    for k in ks:
        p = ndcg = psp = best = 0.0
        for i in range(n):
            truth = set(lists[i])
            ranked = sorted(range(scores.shape[1]), key=lambda j: -scores[i, j])[:k]
            p += sum(j in truth for j in ranked) / k
            if truth:
                dcg = sum(1 / math.log2(r + 2) for r, j in enumerate(ranked) if j in truth)
                ndcg += dcg / sum(1 / math.log2(r + 2) for r in range(min(k, len(truth))))
            psp += sum(invp[j] for j in ranked if j in truth) / k
            best += sum(sorted((invp[j] for j in truth), reverse=True)[:k]) / k
        out[f"p_at_{k}"] = 100 * p / n
        out[f"ndcg_at_{k}"] = 100 * ndcg / n
        out[f"psp_at_{k}"] = 100 * psp / best
    return out


def to_csr(lists, L):
    return LabelCSR(np.cumsum([0] + [len(r) for r in lists]), np.array([j for r in lists for j in r], int), L)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_metrics_match_direct_computation(seed):
    rng = np.random.default_rng(seed)
    n, L = 90, 23
    lists = [rng.choice(L, rng.integers(0, 8), replace=False).tolist() for _ in range(n)]
    # scores correlated with the truth, so metrics are far from 0 and from 100
    scores = rng.normal(size=(n, L))
    for i, r in enumerate(lists):
        scores[i, r] += rng.normal(1.0, 1.0, len(r))
    counts = np.bincount([j for r in lists for j in r], minlength=L)
    invp = inverse_propensity(counts, 0.55, 1.5, num_points=n)
    m = XMCMetrics(L, inv_propensity=invp)
    for lo in range(0, n, 17):  # uneven batches
        labels = to_csr(lists[lo : lo + 17], L)
        m.update(torch.tensor(scores[lo : lo + 17], dtype=torch.float32), torch.from_numpy(labels.ptr),
                 torch.from_numpy(labels.idx))
    got, want = m.compute(), direct(scores.astype(np.float32), lists, invp)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-9), key
    assert 5 < got["p_at_1"] < 95
    m.reset()
    m.update(torch.tensor(scores[:5]), *(torch.from_numpy(a) for a in (to_csr(lists[:5], L).ptr, to_csr(lists[:5], L).idx)))
    assert m.count == 5


def test_edge_cases():
    # fewer labels than k, a row without labels, perfect and worst rankings
    scores = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [0.5, 0.1, 0.2]])
    ptr, idx = torch.tensor([0, 2, 3, 3]), torch.tensor([0, 1, 0])
    m = XMCMetrics(3, ks=(1, 3, 5))
    m.update(scores, ptr, idx)
    r = m.compute()
    assert r["p_at_1"] == pytest.approx(100 / 3)
    assert r["p_at_5"] == pytest.approx(100 * (2 / 5 + 1 / 5) / 3)
    assert r["ndcg_at_1"] == pytest.approx(100 / 3)
    assert "psp_at_1" not in r
    empty = XMCMetrics(4)
    assert empty.compute()["p_at_1"] == 0.0


def test_scores_of_another_width_and_rank_0_are_refused():
    # Row 0's label 7 of 10 would be row 1's label 2 among 5 columns: a phantom hit (P@1 50 instead of 0).
    scores = torch.tensor([[1.0, 0, 0, 0, 0], [0, 0, 1.0, 0, 0]])
    ptr, idx = torch.tensor([0, 1, 2]), torch.tensor([7, 0])
    with pytest.raises(ValueError, match="scores have 5 columns but the metrics count 10 labels"):
        XMCMetrics(10).update(scores, ptr, idx)
    with pytest.raises(ValueError, match="every k must be a rank >= 1"):
        XMCMetrics(10, ks=(0, 1))


def test_inverse_propensity_formula():
    counts = np.array([0, 1, 10, 1000])
    got = inverse_propensity(counts, A=0.6, B=2.6, num_points=5000)
    c = (math.log(5000) - 1) * 3.6**0.6
    np.testing.assert_allclose(got, [1 + c * (n + 2.6) ** -0.6 for n in counts])
    assert got[0] > got[-1] > 1  # rare labels weigh more
    with pytest.raises(ValueError, match="num_points"):
        inverse_propensity(counts)


SHARED = shared_data_root()


@pytest.mark.skipif(not (SHARED / "Bibtex").is_dir(), reason="shared data not available")
@pytest.mark.parametrize("name", ["Bibtex", "Delicious"])
def test_against_napkinxc_on_real_data(name):
    napkin = pytest.importorskip("napkinxc.metrics")
    from xmc_repro.data.xc_format import read_xc

    train = read_xc(SHARED / name / f"{name.lower()}_train_xc.txt")
    test = read_xc(SHARED / name / f"{name.lower()}_test_xc.txt")
    # scores of a least-squares linear model: a realistic ranking, not a random one
    x_tr, x_te = train.features.toarray(), test.features.toarray()
    y = np.zeros((train.labels.num_points, train.labels.num_labels))
    y[np.repeat(np.arange(train.labels.num_points), train.labels.lengths()), train.labels.idx] = 1
    w = np.linalg.solve(x_tr.T @ x_tr + 10 * np.eye(x_tr.shape[1]), x_tr.T @ y)
    scores = (x_te @ w).astype(np.float32)

    invp = inverse_propensity(train.labels.label_counts(), 0.55, 1.5, num_points=train.labels.num_points)
    np.testing.assert_allclose(invp, napkin.Jain_et_al_inverse_propensity(sp.csr_matrix(y), 0.55, 1.5))

    m = XMCMetrics(train.labels.num_labels, inv_propensity=invp)
    for lo in range(0, len(scores), 256):
        part = test.labels.take(np.arange(lo, min(lo + 256, len(scores))))
        m.update(torch.from_numpy(scores[lo : lo + 256]), torch.from_numpy(part.ptr), torch.from_numpy(part.idx))
    got = m.compute()
    truth = test.labels.to_lists()
    ranking = np.argsort(-scores, axis=1, kind="stable")[:, :5].tolist()
    ref = {
        "p_at": napkin.precision_at_k(truth, ranking, k=5),
        "ndcg_at": napkin.ndcg_at_k(truth, ranking, k=5),
        "psp_at": napkin.psprecision_at_k(truth, ranking, invp, k=5),
    }
    for metric, values in ref.items():
        for k in (1, 3, 5):
            assert got[f"{metric}_{k}"] == pytest.approx(100 * values[k - 1], abs=1e-6), (metric, k)
    assert got["p_at_1"] > 30  # the model is a real one


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_with_labels_left_on_the_host():
    rng = np.random.default_rng(7)
    n, L = 64, 3000
    lists = [rng.choice(L, rng.integers(0, 9), replace=False).tolist() for _ in range(n)]
    labels = to_csr(lists, L)
    scores = torch.randn(n, L)
    invp = inverse_propensity(np.bincount(labels.idx, minlength=L), num_points=n)
    results = []
    for device in ("cpu", "cuda"):
        m = XMCMetrics(L, inv_propensity=invp)
        m.update(scores.to(device), torch.from_numpy(labels.ptr), torch.from_numpy(labels.idx))
        results.append(m.compute())
    assert results[0] == pytest.approx(results[1])
