"""Ranking metrics of extreme classification, streamed over batches: P@k, nDCG@k, PSP@k (in percent).

Only the top-k label ids of each row and running sums are kept, never the scores. Definitions follow
the Extreme Classification Repository (and napkinxc): a row without labels counts 0 in P@k and nDCG@k;
PSP@k is normalised by the best PSP@k the true labels allow (sum over points / sum of the best).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from xmc_repro.data.labels import flat_keys


def inverse_propensity(label_counts, A: float = 0.55, B: float = 1.5, num_points: int | None = None) -> np.ndarray:
    """Jain et al. (2016) inverse propensities ``1 + C (N_l + B)^-A``, ``C = (ln N - 1)(B + 1)^A``.

    ``label_counts``: training points per label; ``num_points`` (N): training points, taken from
    ``label_counts.num_points`` when the counts come from the DataModule. Constants: Wikipedia A=0.5 B=0.4,
    Amazon A=0.6 B=2.6, otherwise A=0.55 B=1.5.
    """
    if num_points is None:
        num_points = getattr(label_counts, "num_points", None)
    if num_points is None:
        raise ValueError("inverse_propensity needs num_points (the number of training points)")
    counts = np.asarray(label_counts, dtype=np.float64)
    c = (math.log(num_points) - 1.0) * (B + 1.0) ** A
    return 1.0 + c * (counts + B) ** -A


class XMCMetrics:
    """``update(scores, label_ptr, label_idx)`` per batch, then ``compute()`` -> {"p_at_1": ..., ...} in percent.

    Works on the device of ``scores``; the accumulators are float64 tensors there (no sync per batch).
    """

    def __init__(self, num_labels: int, ks=(1, 3, 5), inv_propensity=None):
        self.num_labels = int(num_labels)
        self.ks = tuple(int(k) for k in ks)
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks={ks}: every k must be a rank >= 1")
        self.kmax = max(self.ks)
        self.inv_propensity = inv_propensity
        self._invp = None  # inv_propensity as a float64 tensor on the scores' device
        self.reset()

    def reset(self) -> None:
        self._sums = None  # (metric, k) running sums on the device
        self.count = 0

    def update(self, scores: torch.Tensor, label_ptr: torch.Tensor, label_idx: torch.Tensor) -> None:
        device = scores.device
        b, num_labels = scores.shape
        if num_labels != self.num_labels:  # a label id would then be read as another row's label: phantom hits
            raise ValueError(f"scores have {num_labels} columns but the metrics count {self.num_labels} labels")
        if b == 0:
            return
        label_ptr = label_ptr.to(device=device, dtype=torch.long)
        label_idx = label_idx.to(device=device, dtype=torch.long)
        k = min(self.kmax, num_labels)
        top = scores.detach().topk(k, dim=1).indices  # (b, k), best first

        # hits[i, r] = is the r-th ranked label of row i a true label? Via sorted row*L + label keys.
        lengths = label_ptr[1:] - label_ptr[:-1]
        flat = flat_keys(label_ptr, label_idx, num_labels)
        rows = torch.div(flat, num_labels, rounding_mode="floor")
        keys = torch.sort(flat).values
        query = torch.arange(b, device=device)[:, None] * num_labels + top
        if keys.numel():
            pos = torch.searchsorted(keys, query).clamp_(max=keys.numel() - 1)
            hits = (keys[pos] == query).double()
        else:
            hits = torch.zeros(query.shape, dtype=torch.float64, device=device)
        if k < self.kmax:  # fewer labels than k: the missing ranks are misses
            hits = torch.nn.functional.pad(hits, (0, self.kmax - k))

        discount = 1.0 / torch.log2(torch.arange(self.kmax, device=device, dtype=torch.float64) + 2.0)
        cum_hits = hits.cumsum(1)
        dcg = (hits * discount).cumsum(1)
        ideal = discount.cumsum(0)  # ideal DCG for 1..kmax true labels
        sums = [cum_hits.sum(0) / torch.arange(1, self.kmax + 1, device=device)]
        n_true = lengths.clamp(max=self.kmax)
        ranks = torch.arange(self.kmax, device=device)
        # nDCG@k divides by the ideal DCG of min(k, n_true) labels; rows without labels add 0.
        norm = ideal[(torch.minimum(ranks[None, :], n_true[:, None] - 1)).clamp(min=0)]
        sums.append(torch.where(n_true[:, None] > 0, dcg / norm, torch.zeros_like(dcg)).sum(0))
        if self.inv_propensity is not None:
            sums += self._psp(top, hits, rows, label_idx, b)
        sums = torch.stack(sums)
        self._sums = sums if self._sums is None else self._sums + sums
        self.count += b

    def _psp(self, top, hits, rows, label_idx, b) -> list[torch.Tensor]:
        device = top.device
        if self._invp is None or self._invp.device != device:
            self._invp = torch.as_tensor(np.asarray(self.inv_propensity), dtype=torch.float64, device=device)
        invp = self._invp
        k = top.shape[1]
        gained = torch.zeros_like(hits)
        gained[:, :k] = hits[:, :k] * invp[top]
        ranks = torch.arange(1, self.kmax + 1, device=device)
        psp = gained.cumsum(1).sum(0) / ranks
        # Best achievable: each row's true labels by decreasing propensity weight.
        w = invp[label_idx]
        order = torch.sort(w, descending=True, stable=True).indices
        order = order[torch.sort(rows[order], stable=True).indices]
        w_sorted, r_sorted = w[order], rows[order]
        first = torch.searchsorted(r_sorted, torch.arange(b, device=device))
        rank_in_row = torch.arange(len(r_sorted), device=device) - first[r_sorted]
        best = torch.zeros(self.kmax, dtype=torch.float64, device=device)
        keep = rank_in_row < self.kmax
        best.index_add_(0, rank_in_row[keep], w_sorted[keep])
        return [psp, best.cumsum(0) / ranks]

    def compute(self) -> dict[str, float]:
        if self._sums is None:
            names = ["p_at", "ndcg_at"] + (["psp_at"] if self.inv_propensity is not None else [])
            return {f"{n}_{k}": 0.0 for n in names for k in self.ks}
        sums = self._sums.cpu().numpy()
        out = {}
        for k in self.ks:
            out[f"p_at_{k}"] = float(100.0 * sums[0, k - 1] / self.count)
        for k in self.ks:
            out[f"ndcg_at_{k}"] = float(100.0 * sums[1, k - 1] / self.count)
        if self.inv_propensity is not None:
            for k in self.ks:
                best = sums[3, k - 1]
                out[f"psp_at_{k}"] = float(100.0 * sums[2, k - 1] / best) if best > 0 else 0.0
        return out
