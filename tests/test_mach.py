"""MACH head: hashing, meta-labels, decoding through the uniform op, and that it learns."""

import pytest
import torch

from xmc_repro.errors import ConfigError
from xmc_repro.mach import MachHead, hash_labels


def random_csr(rows, num_labels, max_per_row, generator):
    """Random label lists (some empty, some with repeated labels) in the batch contract's CSR form."""
    counts = torch.randint(0, max_per_row + 1, (rows,), generator=generator)
    ptr = torch.zeros(rows + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(counts, 0)
    idx = torch.randint(0, num_labels, (int(ptr[-1]),), generator=generator)
    return ptr, idx


def test_indices_are_hashed_buckets_in_each_hash_functions_block():
    head = MachHead(16, num_labels=500, num_hashes=3, num_buckets=40, seed=7)
    assert head.indices.shape == (3, 500) and head.indices.dtype == torch.int32
    for r in range(3):
        block = head.indices[r].long()
        assert block.min() >= r * 40 and block.max() < (r + 1) * 40
        # a universal hash spreads 500 labels over 40 buckets: every bucket used, none badly overloaded
        load = torch.bincount(block - r * 40, minlength=40)
        assert load.min() > 0 and load.max() < 3 * 500 / 40
    assert torch.equal(head.weight, torch.full((3, 500), 1 / 3))


def test_hashing_is_seeded_and_the_hash_functions_differ():
    assert torch.equal(hash_labels(300, 4, 32, seed=1), hash_labels(300, 4, 32, seed=1))
    assert not torch.equal(hash_labels(300, 4, 32, seed=1), hash_labels(300, 4, 32, seed=2))
    h = hash_labels(300, 4, 32, seed=1)
    assert all(not torch.equal(h[r], h[s]) for r in range(4) for s in range(r + 1, 4))
    # with 4 hashes into 32 buckets, almost every label gets its own bucket signature (32^4 >> 300)
    assert len({tuple(col.tolist()) for col in h.t()}) >= 298


def test_a_models_hashing_follows_the_run_seed():
    """Seeds spread a sweep's runs over different hash functions (the model's seed_everything), and one seed
    gives the same hashing again, so runs repeat and a resumed run's hashing is the one it started with."""
    from xmc_repro.model import XMCClassifier

    def hashing(seed):
        torch.manual_seed(seed)
        return XMCClassifier(12, 200, head="mach", intermediate=None).head.indices

    assert torch.equal(hashing(3), hashing(3))
    assert not torch.equal(hashing(3), hashing(4))


def test_decode_buffers_are_not_trained():
    head = MachHead(8, num_labels=50, num_hashes=2, num_buckets=10)
    names = {name for name, _ in head.named_parameters()}
    assert names == {"meta.weight", "meta.bias"}
    assert {"indices", "weight"} <= set(dict(head.named_buffers()))


def test_forward_gives_one_score_per_meta_label():
    head = MachHead(12, num_labels=100, num_hashes=4, num_buckets=16)
    assert head(torch.randn(5, 12)).shape == (5, 64)


@pytest.mark.parametrize("decode", ["probability", "score"])
def test_decode_equals_mean_of_each_labels_bucket_probabilities_or_scores(decode):
    """The MACH estimator: a label's score is the mean over the R hash functions of its bucket's probability."""
    g = torch.Generator().manual_seed(0)
    head = MachHead(8, num_labels=230, num_hashes=5, num_buckets=17, seed=3, decode=decode)
    meta = torch.randn(6, 5 * 17, generator=g, requires_grad=True)
    decoded = head.decode(meta)
    bucket = meta.detach().double()
    if decode == "probability":
        bucket = 1.0 / (1.0 + torch.exp(-bucket))
    expected = torch.zeros(6, 230, dtype=torch.float64)
    for j in range(230):
        for r in range(5):
            expected[:, j] += bucket[:, (r * 17) + int(hash_labels(230, 5, 17, seed=3)[r, j])] / 5
    torch.testing.assert_close(decoded.double(), expected, rtol=1e-5, atol=1e-6)
    # the gradient reaches the meta-scores: each bucket collects 1/R (times the sigmoid's slope) per label
    decoded.sum().backward()
    per_bucket = torch.bincount(head.indices.flatten().long(), minlength=85).double() / 5
    slope = bucket * (1 - bucket) if decode == "probability" else torch.ones_like(bucket)
    torch.testing.assert_close(meta.grad.double(), per_bucket * slope, rtol=1e-5, atol=1e-6)


def test_unknown_decode_is_one_line():
    with pytest.raises(ConfigError, match="model.mach.decode='mean'"):
        MachHead(8, num_labels=10, num_hashes=2, num_buckets=4, decode="mean")


def test_meta_labels_equal_direct_hashing():
    g = torch.Generator().manual_seed(1)
    head = MachHead(4, num_labels=90, num_hashes=3, num_buckets=8, seed=5)  # few buckets: many collisions
    ptr, idx = random_csr(40, 90, 12, g)
    meta_ptr, meta_idx = head.meta_labels(ptr, idx)
    assert meta_ptr.dtype == meta_idx.dtype == torch.int64 and meta_ptr.shape == ptr.shape
    for i in range(40):
        labels = idx[ptr[i] : ptr[i + 1]].tolist()
        direct = sorted({int(head.indices[r, j]) for j in labels for r in range(3)})
        assert meta_idx[meta_ptr[i] : meta_ptr[i + 1]].tolist() == direct


def test_meta_labels_of_empty_rows_and_empty_batch():
    head = MachHead(4, num_labels=10, num_hashes=2, num_buckets=4)
    ptr, idx = head.meta_labels(torch.tensor([0, 0, 2, 2]), torch.tensor([3, 3]))
    assert ptr.tolist() == [0, 0, 2, 2] and idx.tolist() == sorted({int(head.indices[r, 3]) for r in range(2)})
    ptr, idx = head.meta_labels(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert ptr.tolist() == [0] and idx.numel() == 0


@pytest.mark.parametrize("setting", [dict(num_hashes=0, num_buckets=4), dict(num_hashes=2, num_buckets=-1)])
def test_invalid_sizes_name_the_setting(setting):
    with pytest.raises(ConfigError, match="model.mach"):
        MachHead(4, 10, **setting)


def synthetic_problem(num_points, num_labels, dim, generator, prototypes):
    """Each point is the sum of its labels' prototypes plus noise: learnable, far from chance."""
    ptr, idx = random_csr(num_points, num_labels, 3, generator)
    counts = ptr[1:] - ptr[:-1]
    keep = counts > 0
    x = torch.zeros(num_points, dim)
    x.index_add_(0, torch.repeat_interleave(torch.arange(num_points), counts), prototypes[idx])
    x += 0.3 * torch.randn(num_points, dim, generator=generator)
    rows = torch.nonzero(keep).squeeze(1)
    new_ptr = torch.zeros(len(rows) + 1, dtype=torch.int64)
    new_ptr[1:] = torch.cumsum(counts[rows], 0)
    new_idx = torch.cat([idx[ptr[i] : ptr[i + 1]] for i in rows.tolist()])
    return x[rows], new_ptr, new_idx


def dense_targets(ptr, idx, width):
    target = torch.zeros(len(ptr) - 1, width)
    target[torch.repeat_interleave(torch.arange(len(ptr) - 1), ptr[1:] - ptr[:-1]), idx] = 1.0
    return target


def test_mach_learns_a_synthetic_problem_far_above_chance():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    num_labels, dim = 300, 48
    prototypes = torch.randn(num_labels, dim, generator=g)
    x_train, ptr_train, idx_train = synthetic_problem(3000, num_labels, dim, g, prototypes)
    x_test, ptr_test, idx_test = synthetic_problem(500, num_labels, dim, g, prototypes)
    head = MachHead(dim, num_labels, num_hashes=4, num_buckets=48, seed=0)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for epoch in range(8):
        order = torch.randperm(len(x_train), generator=g)
        for start in range(0, len(order), 100):
            rows = order[start : start + 100]
            counts = ptr_train[rows + 1] - ptr_train[rows]
            ptr = torch.zeros(len(rows) + 1, dtype=torch.int64)
            ptr[1:] = torch.cumsum(counts, 0)
            idx = torch.cat([idx_train[ptr_train[i] : ptr_train[i + 1]] for i in rows.tolist()])
            meta_ptr, meta_idx = head.meta_labels(ptr, idx)
            loss = nn_bce(head(x_train[rows]), dense_targets(meta_ptr, meta_idx, head.num_meta))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        top1 = head.decode(head(x_test)).argmax(1)
    truth = dense_targets(ptr_test, idx_test, num_labels)
    p_at_1 = truth[torch.arange(len(top1)), top1].mean().item()
    chance = (ptr_test[-1] / (len(ptr_test) - 1) / num_labels).item()  # about 2/300
    assert p_at_1 > 0.6 > 50 * chance, (p_at_1, chance)


def nn_bce(scores, targets):
    return torch.nn.functional.binary_cross_entropy_with_logits(scores, targets)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_mach_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(2)
    head = MachHead(16, num_labels=1000, num_hashes=4, num_buckets=64, seed=1)
    ptr, idx = random_csr(32, 1000, 8, g)
    meta = torch.randn(32, head.num_meta, generator=g)
    cuda = head.to("cuda")
    meta_ptr, meta_idx = cuda.meta_labels(ptr.cuda(), idx.cuda())
    cpu = MachHead(16, num_labels=1000, num_hashes=4, num_buckets=64, seed=1)
    expected_ptr, expected_idx = cpu.meta_labels(ptr, idx)
    assert torch.equal(meta_ptr.cpu(), expected_ptr) and torch.equal(meta_idx.cpu(), expected_idx)
    torch.testing.assert_close(cuda.decode(meta.cuda()).cpu(), cpu.decode(meta))
