"""Sparse layers: initialisation, forward/backward against dense twins, rewiring."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import DEVICES
from conftest import generator as _gen

from xmc_repro.sparse import SparseInputError, UniformSparseLinear, UnstructuredSparseLinear, repeated_connections_pct
from xmc_repro.sparse import reference as ref
from xmc_repro.sparse import rewire
from xmc_repro.sparse.rewire import lowest_magnitude, redraw_sources, redraw_sources_, sample_uniform_sources



def _distinct_per_label(indices):
    s = indices.long().sort(0).values
    return bool((s[1:] != s[:-1]).all())


@pytest.mark.parametrize("in_features,out_features,conn", [(1, 5, 1), (8, 100, 8), (10, 333, 7),
                                                            (1000, 2000, 32), (64, 4097, 33)])
def test_uniform_fan_in_init_distinct_sources_in_range(in_features, out_features, conn):
    layer = UniformSparseLinear(in_features, out_features, conn, generator=_gen(0), init="fan_in",
                                distinct_sources=True)
    assert layer.indices.dtype == torch.int32 and layer.indices.shape == (conn, out_features)
    assert layer.weight.shape == (conn, out_features) and layer.bias.shape == (out_features,)
    assert 0 <= int(layer.indices.min()) and int(layer.indices.max()) < in_features
    assert _distinct_per_label(layer.indices)
    bound = 1 / math.sqrt(conn)
    assert float(layer.weight.detach().abs().max()) <= bound and float(layer.bias.detach().abs().max()) <= bound
    # fan-in = connectivity: the weights fill the bound, not 1/sqrt(in_features)
    if layer.weight.numel() > 1000:
        assert float(layer.weight.detach().abs().max()) > 0.9 * bound
    assert [n for n, _ in layer.named_buffers()] == ["indices"]
    assert sorted(n for n, _ in layer.named_parameters()) == ["bias", "weight"]


@pytest.mark.parametrize("layer_type,conn,labels", [(UniformSparseLinear, 32, 20011), (UnstructuredSparseLinear, 5, 3001)])
def test_authors_init_is_glorot_uniform_over_the_flat_weights_with_zero_bias(layer_type, conn, labels):
    """Keras glorot_uniform on a 1-D variable of n weights: fan_in = fan_out = n, bound sqrt(6 / 2n)."""
    layer = layer_type(64, labels, conn, generator=_gen(0))
    w = layer.weight.detach().double().view(-1)
    n = conn * labels
    bound = math.sqrt(3.0 / n)
    assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.99 * bound
    # U(-b, b): mean 0, variance b^2 / 3 = 1 / n, each within 4 standard errors
    assert abs(float(w.mean())) < 4 * bound / math.sqrt(3 * n)
    assert abs(float(w.var()) * n - 1.0) < 4 * math.sqrt(0.8 / n)
    assert torch.count_nonzero(layer.bias) == 0
    with pytest.raises(ValueError, match="init='keras'"):
        layer_type(64, labels, conn, init="keras")


def test_authors_sources_are_drawn_with_replacement():
    # 8 draws from 8 inputs: all distinct with probability 8!/8^8 = 0.2 %; over 1000 labels repeats must show,
    # and the share of labels without a repeat must be near that probability.
    idx = UniformSparseLinear(8, 1000, 8, generator=_gen(0)).indices
    assert 0 <= int(idx.min()) and int(idx.max()) < 8
    distinct_labels = sum(_distinct_per_label(idx[:, j:j + 1]) for j in range(1000))
    assert distinct_labels <= 10
    assert _distinct_per_label(UniformSparseLinear(8, 1000, 8, generator=_gen(0), distinct_sources=True).indices)


def test_uniform_init_is_uniform_over_sources_and_deterministic():
    a = sample_uniform_sources(50, 20000, 5, _gen(3))
    b = sample_uniform_sources(50, 20000, 5, _gen(3))
    assert torch.equal(a, b)
    counts = torch.bincount(a.view(-1).long(), minlength=50).float()
    expect = 20000 * 5 / 50
    assert float(((counts - expect) ** 2 / expect).sum()) < 120  # chi2, 49 dof: p ~ 1e-7
    assert not torch.equal(a, sample_uniform_sources(50, 20000, 5, _gen(4)))


def test_unstructured_positions_are_uniform_over_the_matrix_initially_and_when_regrown():
    """With replacement (the authors' default), every (label, input) position is equally likely, the last one too:
    the 20 connections of a 4 x 5 layer drawn 150 times at initialisation, then all regrown 150 times; the 3,000
    positions of each counted per position (chi2)."""

    def chi2(positions):
        counts = torch.bincount(torch.cat(positions), minlength=20).double()
        assert counts.numel() == 20 and int(counts.min()) > 0
        return float(((counts - 150) ** 2 / 150).sum())

    assert chi2([UnstructuredSparseLinear(5, 4, 5, generator=_gen(seed)).positions() for seed in range(150)]) < 60
    layer, g, regrown = UnstructuredSparseLinear(5, 4, 5, generator=_gen(0)), _gen(1), []
    for _ in range(150):
        assert layer.rewire(1.0, g, exact_count=True).numel() == 20
        regrown.append(layer.positions())
    assert chi2(regrown) < 60  # 19 dof: p ~ 3e-6


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_layer_forward_backward_match_dense(device):
    layer = UniformSparseLinear(40, 70, 6, generator=_gen(1)).to(device)
    x = torch.randn(3, 5, 40, device=device, requires_grad=True)  # extra leading dim
    out = layer(x)
    assert out.shape == (3, 5, 70)
    w = layer.weight.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    expect = x2 @ ref.dense_weight(layer.indices, w, 40).T + bias
    torch.testing.assert_close(out, expect)
    grad = torch.randn_like(out)
    out.backward(grad)
    expect.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(layer.weight.grad, w.grad)
    torch.testing.assert_close(layer.bias.grad, bias.grad)


@pytest.mark.parametrize("layer_type", [UniformSparseLinear, UnstructuredSparseLinear])
def test_layers_refuse_inputs_of_another_width_or_dtype(layer_type):
    """As nn.Linear: the last dimension must be in_features (a narrower input would be read past its end)."""
    layer = layer_type(1000, 50, 32, generator=_gen(0))
    for x in (torch.randn(4, 10), torch.randn(4, 1001), torch.randn(2, 3, 999), torch.tensor(1.0)):
        with pytest.raises(SparseInputError, match=r"inputs of shape \(\.\.\., 1000\) \(in_features=1000\), got"):
            layer(x)
    with pytest.raises(SparseInputError, match="floating-point inputs, got torch.int64; call x.float"):
        layer(torch.ones(4, 1000, dtype=torch.long))
    assert layer(torch.randn(2, 3, 1000)).shape == (2, 3, 50)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_unstructured_layer_is_told_to_stay_float32_on_the_cpu(dtype):
    """layer.half() on the CPU met MKL's 'addmm_out_sparse_csr_impl_mkl not implemented for Half', which names
    neither the layer nor the fix; now the same line as the uniform layer's."""
    layer = UnstructuredSparseLinear(16, 9, 3, generator=_gen(0)).to(dtype)
    with pytest.raises(SparseInputError, match=f"weight must be float32 or float64, got {dtype}.*layer.float"):
        layer(torch.randn(2, 16))


def test_uniform_layer_state_dict_roundtrip():
    a = UniformSparseLinear(30, 40, 4, generator=_gen(5))
    b = UniformSparseLinear(30, 40, 4, bias=True, generator=_gen(6))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 30)
    torch.testing.assert_close(a(x), b(x))
    nobias = UniformSparseLinear(30, 40, 4, bias=False)
    assert nobias.bias is None and nobias(x).shape == (2, 40)


@pytest.mark.parametrize("layer_type", [UniformSparseLinear, UnstructuredSparseLinear])
@pytest.mark.parametrize("distinct", [False, True])
def test_deferred_initialisation_on_the_meta_device(layer_type, distinct):
    """Built under torch.device("meta") (accelerate's init_empty_weights, FSDP), then to_empty and reset_parameters:
    the layer a direct construction with the same generator gives."""
    with torch.device("meta"):
        layer = layer_type(12, 7, 3, distinct_sources=distinct)
    assert layer.weight.is_meta and layer.indices.is_meta
    out = layer(torch.empty(2, 4, 12, device="meta"))  # shape inference before any value exists
    assert out.is_meta and out.shape == (2, 4, 7) and out.dtype == torch.float32
    layer = layer.to_empty(device="cpu")
    layer.reset_parameters(_gen(4))
    direct = layer_type(12, 7, 3, generator=_gen(4), distinct_sources=distinct)
    for key, value in direct.state_dict().items():
        assert torch.equal(layer.state_dict()[key], value), key
    x = torch.randn(5, 12)
    torch.testing.assert_close(layer(x), direct(x))


@pytest.mark.parametrize("layer_type", [UniformSparseLinear, UnstructuredSparseLinear])
def test_an_unknown_init_is_refused_at_construction_also_on_the_meta_device(layer_type):
    """Under torch.device("meta") no weights are drawn: the init must still be checked where it is given, not at a
    reset_parameters that a layer loaded with assign=True never calls."""
    with torch.device("meta"), pytest.raises(ValueError, match="init='glorot' is unknown; choose one of authors"):
        layer_type(12, 7, 3, init="glorot")


@pytest.mark.parametrize("layer_type", [UniformSparseLinear, UnstructuredSparseLinear])
def test_a_seed_in_place_of_a_generator_is_named_and_a_tensor_fraction_taken(layer_type):
    with pytest.raises(SparseInputError, match=r"generator must be a torch.Generator or None, got int \(for a seed: "
                                               r"torch.Generator\(\).manual_seed\(0\)\)"):
        layer_type(12, 7, 3, generator=0)
    layer = layer_type(12, 7, 3, generator=_gen(0))
    with pytest.raises(SparseInputError, match="generator must be a torch.Generator or None, got int"):
        layer.rewire(0.5, 3)
    expected = copy.deepcopy(layer).rewire(0.5, _gen(4))
    assert torch.equal(layer.rewire(torch.tensor(0.5), _gen(4)), expected)


@pytest.mark.parametrize("layer_type", [UniformSparseLinear, UnstructuredSparseLinear])
@pytest.mark.parametrize("sizes", [(11, 7, 3), (20, 7, 3), (13, 14, 3), (13, 21, 1)])
def test_a_state_dict_of_a_layer_of_other_sizes_is_refused_at_load(layer_type, sizes):
    """Fewer or more inputs give the same tensor shapes, and so (unstructured) do as many connections over other
    labels: the saved sizes refuse them by name, and nothing of the layer is loaded."""
    saved = layer_type(13, 7, 3, generator=_gen(0))
    if sizes[1:] == (21, 1) and layer_type is UniformSparseLinear:
        sizes = (13, 7, 4)  # the uniform weight's shape is (connectivity, labels): another fan-in
    target = layer_type(*sizes, generator=_gen(1))
    before = target.indices.clone()
    shown = ", ".join(f"{k}={v}" for k, v in zip(("in_features", "out_features", "connectivity"), sizes))
    with pytest.raises(RuntimeError, match=rf"saved from a {layer_type.__name__} with in_features=13, out_features=7, "
                                           rf"connectivity=3, this one has {shown}; build the layer with the sizes"):
        target.load_state_dict(saved.state_dict())
    assert torch.equal(target.indices, before)
    assert all(isinstance(value, torch.Tensor) for value in saved.state_dict().values())  # e.g. for safetensors


@pytest.mark.parametrize("layer_type", [UniformSparseLinear, UnstructuredSparseLinear])
def test_a_state_dict_saved_without_sizes_is_checked_by_its_indices(layer_type):
    """State dicts from before the sizes were saved still load; indices that do not fit the layer are refused, also
    a source just one past the layer's last input."""
    saved = layer_type(13, 7, 3, generator=_gen(0))
    saved.indices[-1, 0] = 12  # a source only the 13-input layer has (Unstructured: row 1 holds the inputs)
    old = {key: value for key, value in saved.state_dict().items() if key != "_extra_state"}
    target = layer_type(11, 7, 3, generator=_gen(1))
    before = target.indices.clone()
    with pytest.raises(RuntimeError, match=r"in_features=11.*\[0, 11\)"):
        target.load_state_dict(old)
    assert torch.equal(target.indices, before)
    one_input_fewer = layer_type(12, 7, 3, generator=_gen(1))  # source 12 is one past its last input
    with pytest.raises(RuntimeError, match=r"in_features=12.*\[0, 12\)"):
        one_input_fewer.load_state_dict(old)
    with pytest.raises(RuntimeError, match=r"indices are torch.float32, this .*'s are torch.int"):
        target.load_state_dict({**old, "indices": old["indices"].float()})
    same = layer_type(13, 7, 3, generator=_gen(1))
    same.load_state_dict(old)  # strict: the absent sizes are no missing key
    assert torch.equal(same.indices, saved.indices)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_features,conn", [(1000, 16), (12, 10), (7, 7)])
def test_uniform_rewire_authors(device, in_features, conn):
    """The authors' rewiring: slots strictly below the threshold, sources drawn with replacement."""
    labels = 500
    layer = UniformSparseLinear(in_features, labels, conn, generator=_gen(2)).to(device)
    before_idx, before_w = layer.indices.clone(), layer.weight.detach().clone()
    pos = layer.rewire(0.1, _gen(7))
    magnitudes = before_w.abs().view(-1)
    threshold = magnitudes.sort().values[round(0.1 * conn * labels) - 1]
    assert torch.equal(pos, (magnitudes < threshold).nonzero().squeeze(1))
    assert pos.numel() == round(0.1 * conn * labels) - 1  # the initial magnitudes are distinct
    assert torch.equal(layer.weight.detach(), before_w)
    changed = (layer.indices != before_idx).view(-1).nonzero().squeeze(1)
    assert bool(torch.isin(changed, pos).all())
    assert changed.numel() >= 0.7 * (1 - 1 / in_features) * pos.numel()
    assert 0 <= int(layer.indices.min()) and int(layer.indices.max()) < in_features
    again = UniformSparseLinear(in_features, labels, conn, generator=_gen(2)).to(device)
    assert torch.equal(again.rewire(0.1, _gen(7)), pos) and torch.equal(again.indices, layer.indices)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_features,conn", [(1000, 16), (12, 10), (7, 7)])
def test_uniform_rewire_exact_count_distinct(device, in_features, conn):
    labels = 500
    layer = UniformSparseLinear(in_features, labels, conn, generator=_gen(2), distinct_sources=True).to(device)
    before_idx, before_w = layer.indices.clone(), layer.weight.detach().clone()
    pos = layer.rewire(0.1, _gen(7), exact_count=True)
    assert pos.dtype == torch.int64 and pos.device == layer.weight.device
    assert pos.numel() == round(0.1 * conn * labels)
    # exactly the lowest-|w| slots were chosen
    threshold = before_w.abs().view(-1).sort().values[pos.numel() - 1]
    assert bool((before_w.abs().view(-1)[pos] <= threshold).all())
    assert int((before_w.abs().view(-1) < threshold).sum()) <= pos.numel()
    # weights kept, only selected slots may change, still uniform and distinct, in range
    assert torch.equal(layer.weight.detach(), before_w)
    changed = (layer.indices != before_idx).view(-1).nonzero().squeeze(1)
    assert bool(torch.isin(changed, pos).all())
    if in_features > 2 * conn:
        assert changed.numel() > 0.8 * pos.numel()
    assert layer.indices.shape == (conn, labels) and layer.indices.dtype == torch.int32
    assert _distinct_per_label(layer.indices)
    assert 0 <= int(layer.indices.min()) and int(layer.indices.max()) < in_features
    # same generator state => same result
    again = UniformSparseLinear(in_features, labels, conn, generator=_gen(2), distinct_sources=True).to(device)
    assert torch.equal(again.rewire(0.1, _gen(7), exact_count=True), pos)
    assert torch.equal(again.indices, layer.indices)
    assert layer.rewire(0.0, _gen(7)).numel() == 0
    with pytest.raises(ValueError, match="fraction"):
        layer.rewire(1.5, _gen(7))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_rewire_same_on_cpu_and_cuda():
    cpu = UniformSparseLinear(300, 2000, 16, generator=_gen(9))
    gpu = UniformSparseLinear(300, 2000, 16, generator=_gen(9)).cuda()
    p_cpu, p_gpu = cpu.rewire(0.2, _gen(1)), gpu.rewire(0.2, _gen(1))
    assert torch.equal(p_cpu, p_gpu.cpu())
    assert torch.equal(cpu.indices, gpu.indices.cpu())


def test_redraw_sources_exact_and_rejection_agree_on_invariants():
    g = _gen(11)
    idx = sample_uniform_sources(20, 3000, 12, g, distinct=True)  # 12 > 20/2: exact path
    assert _distinct_per_label(idx)
    redraw = torch.rand(idx.shape, generator=g) < 0.5
    new = redraw_sources(idx, redraw, 20, g)
    assert _distinct_per_label(new) and torch.equal(new[~redraw], idx[~redraw].long())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("numel,fraction", [(1, 1.0), (17, 0.3), (4099, 0.1), (10_001, 0.9)])
def test_lowest_magnitude_is_the_stable_sort_prefix(device, dtype, numel, fraction, monkeypatch):
    monkeypatch.setattr(rewire, "_MAGNITUDE_SLICE", 1000)  # several slices, one of them ragged
    g = _gen(numel)
    weight = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    pairs = 5 * (numel // 5)
    weight[1:pairs:5] = weight[0:pairs:5].neg()  # ties in magnitude, across signs
    weight[torch.randperm(numel, generator=g)[: numel // 7]] = 0.0
    weight = weight.to(device)
    magnitudes = weight.abs().cpu()
    count = round(fraction * numel)
    expected = magnitudes.sort(stable=True).indices[:count].sort().values
    shaped = weight.view(1, -1) if numel % 2 else weight
    got = lowest_magnitude(shaped, fraction, exact_count=True)
    assert got.dtype == torch.int64 and got.device == weight.device
    assert torch.equal(got.cpu(), expected)
    # the authors' selection: strictly below the count-th smallest magnitude
    strictly_below = (magnitudes < magnitudes.sort().values[count - 1]).nonzero().squeeze(1)
    assert torch.equal(lowest_magnitude(shaped, fraction).cpu(), strictly_below)


def test_grouped_redraw_matches_whole_tensor_and_keeps_invariants(monkeypatch):
    idx = sample_uniform_sources(40, 3001, 9, _gen(3), distinct=True)
    redraw = torch.rand(idx.shape, generator=_gen(4)) < 0.1
    redraw[:, 1000:1500] = False  # labels without a redraw slot are left alone
    whole = redraw_sources(idx, redraw, 40, _gen(5))
    grouped = redraw_sources_(idx.clone(), redraw, 40, _gen(5))
    assert grouped.dtype == torch.int32 and torch.equal(grouped.long(), whole)
    monkeypatch.setattr(rewire, "_LABELS_PER_GROUP", 128)  # many groups, the last one ragged
    small = redraw_sources_(idx.clone(), redraw, 40, _gen(5))
    assert _distinct_per_label(small) and torch.equal(small[~redraw], idx[~redraw])
    assert int(small.min()) >= 0 and int(small.max()) < 40
    assert (small != idx)[redraw].float().mean() > 0.7  # redrawn slots mostly got a new source


def _dense_unstructured(layer, weight):
    dense = torch.zeros(layer.out_features, layer.in_features, dtype=weight.dtype, device=weight.device)
    return dense.index_put((layer.indices[0], layer.indices[1]), weight, accumulate=True)  # repeats add up


def _repeats(layer) -> int:
    """How often the most repeated (label, input) position occurs."""
    return int(layer.positions().unique(return_counts=True)[1].max())


def test_repeated_connections_are_counted_beyond_the_first_at_each_position():
    uniform = UniformSparseLinear(5, 3, 4, generator=_gen(0))
    uniform.indices.copy_(torch.tensor([[0, 1, 2], [0, 1, 3], [0, 4, 4], [1, 4, 0]], dtype=torch.int32))
    # label 0 reads input 0 three times, label 1 inputs 1 and 4 twice each, label 2 four distinct inputs
    assert uniform.positions().tolist() == [0, 6, 12, 0, 6, 13, 0, 9, 14, 1, 9, 10]
    unstructured = UnstructuredSparseLinear(5, 3, 2, generator=_gen(0))
    unstructured.indices.copy_(torch.tensor([[0, 0, 0, 1, 2, 2], [1, 1, 1, 1, 3, 4]]))
    assert unstructured.positions().tolist() == [1, 1, 1, 6, 13, 14]
    assert repeated_connections_pct([uniform]) == pytest.approx(100 * 4 / 12)
    assert repeated_connections_pct([unstructured]) == pytest.approx(100 * 2 / 6)
    assert repeated_connections_pct([uniform, unstructured]) == pytest.approx(100 * 6 / 18)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("distinct_sources", [True, False])
def test_unstructured_layer(device, distinct_sources):
    # with replacement: 400 draws of 800 positions, so positions repeat, some three times or more
    in_features = 50 if distinct_sources else 10
    layer = UnstructuredSparseLinear(in_features, 80, 5, generator=_gen(4), distinct_sources=distinct_sources)
    layer = layer.to(device)
    assert layer.weight.shape == (400,) and layer.indices.shape == (2, 400)
    assert _repeats(layer) == 1 if distinct_sources else _repeats(layer) >= 3
    for step in range(2):  # before and after a rewire (the cached CSR structure must follow)
        x = torch.randn(6, in_features, device=device, requires_grad=True)
        out = layer(x)
        w = layer.weight.detach().clone().requires_grad_()
        b = layer.bias.detach().clone().requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        expect = x2 @ _dense_unstructured(layer, w).T + b
        torch.testing.assert_close(out, expect)
        grad = torch.randn_like(out) * (torch.rand(6, 80, device=device) < 0.2)
        layer.zero_grad()
        out.backward(grad)
        expect.backward(grad)
        torch.testing.assert_close(x.grad, x2.grad)
        torch.testing.assert_close(layer.weight.grad, w.grad)
        torch.testing.assert_close(layer.bias.grad, b.grad)
        before = layer.indices.clone()
        pos = layer.rewire(0.25, _gen(step), exact_count=True)
        assert pos.numel() == 100
        changed = (layer.indices != before).any(0).nonzero().squeeze(1)
        assert bool(torch.isin(changed, pos).all()) and changed.numel() > 0.7 * pos.numel()
        assert _repeats(layer) == 1 if distinct_sources else _repeats(layer) >= 3
        assert int(layer.indices[1].max()) < in_features and int(layer.indices[0].max()) < 80


def test_unstructured_layer_refuses_second_derivatives_instead_of_wrong_ones():
    """Its hand-written backward is first order only: a gradient penalty through it got silently wrong gradients
    (the weights' was missing the term through the CSR values), so differentiating it again must raise."""
    layer = UnstructuredSparseLinear(6, 5, 3, generator=_gen(0)).double()
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    grad_x, = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="UnstructuredSparseLinear is differentiable once.*use UniformSparseLinear"):
        grad_x.square().sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_unstructured_layer_under_bf16_autocast_computes_in_float32(device):
    """bf16-mixed hands the head the intermediate layer's bf16 output: the CSR products run in the weights' float32
    on the bf16 values (MKL's have no bf16), and x's gradient comes back in bf16."""
    layer = UnstructuredSparseLinear(50, 80, 5, generator=_gen(5)).to(device)
    hidden = torch.nn.Linear(20, 50).to(device)
    x = torch.randn(6, 20, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        h = hidden(x)
        h.retain_grad()
        out = layer(h)
    assert h.dtype == torch.bfloat16 and out.dtype == torch.float32
    w = layer.weight.detach().clone().requires_grad_()
    h32 = h.detach().float().requires_grad_()
    expect = h32 @ _dense_unstructured(layer, w).T + layer.bias.detach()
    torch.testing.assert_close(out, expect)
    grad = torch.randn_like(out)
    out.backward(grad)
    expect.backward(grad)
    assert h.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad, h32.grad.bfloat16())
    torch.testing.assert_close(layer.weight.grad, w.grad)


@pytest.mark.parametrize("distinct_sources", [True, False])
def test_unstructured_rewire_deterministic_and_dense_case(distinct_sources):
    # distinct: 50 of 60 positions, exact sampling
    a, b = (UnstructuredSparseLinear(6, 10, 5, generator=_gen(1), distinct_sources=distinct_sources) for _ in "ab")
    assert torch.equal(a.indices, b.indices)
    assert torch.equal(a.rewire(0.3, _gen(2), exact_count=True), b.rewire(0.3, _gen(2), exact_count=True))
    assert torch.equal(a.indices, b.indices)
    assert (a.indices[0] * 6 + a.indices[1]).unique().numel() == 50 if distinct_sources else _repeats(a) > 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer_type,make_optimizer", [
    (UniformSparseLinear, lambda p: torch.optim.Adam(p, amsgrad=True)),
    (UnstructuredSparseLinear, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
])
def test_a_users_loop_resets_the_optimizer_state_of_exactly_the_rewired_slots(device, layer_type, make_optimizer):
    from xmc_repro.sparse import reset_optimizer_state_

    layer = layer_type(37, 53, 5, generator=_gen(3)).to(device)
    optimizer = make_optimizer(layer.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        layer(torch.randn(7, 37, device=device)).square().mean().backward()
        optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[layer.weight].items()}
    slots = layer.rewire(0.2, _gen(4))
    reset_optimizer_state_(optimizer, layer.weight, slots)
    rewired = torch.zeros(layer.weight.numel(), dtype=torch.bool, device=device)
    rewired[slots] = True
    per_weight = [k for k, v in before.items() if v.shape == layer.weight.shape]
    assert len(per_weight) == (3 if layer_type is UniformSparseLinear else 1) and slots.numel() > 0
    for key, old in before.items():
        new = optimizer.state[layer.weight][key]
        if key in per_weight:
            assert (old.view(-1) != 0).all() and (new.view(-1)[rewired] == 0).all()
            assert torch.equal(new.view(-1)[~rewired], old.view(-1)[~rewired])
        else:
            assert torch.equal(new, old)  # Adam's step count: the whole tensor's
    with pytest.raises(SparseInputError, match="pass the weight of the layer whose rewire returned them"):
        reset_optimizer_state_(optimizer, layer.bias, slots)  # the bias: fewer entries than the slots reach
