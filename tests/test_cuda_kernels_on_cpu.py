"""The uniform sparse op's CUDA kernels, their own source, run on the CPU (tests/cuda_on_cpu: one std::thread per
CUDA thread, barriers for __syncthreads and the warp intrinsics; address and undefined-behaviour sanitizers on),
against the pure-torch reference: the op's thread-per-label kernels and the warp-per-label candidates, so their
indexing, batch and connection chunks, zero-gradient skips, shared-memory staging and reductions are checked on
every machine, not only where a GPU is. Small shapes: every shuffle is a barrier of 32 threads."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from conftest import generator, sparse_layer_problem
from torch.utils.cpp_extension import include_paths

from xmc_repro.sparse import build, reference

HERE = build.source_dir().parent / "tests" / "cuda_on_cpu"
X_KINDS = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or not HERE.exists():
        pytest.skip("no C++ compiler, or no tests/cuda_on_cpu in this checkout")
    path = tmp_path_factory.mktemp("simt") / "kernels"
    includes = [HERE, build.source_dir() / "cuda", *include_paths()]
    # Address and undefined-behaviour sanitizers: a read or write outside an array fails the run, even where
    # the value read would be discarded, and so does undefined behaviour (a vector load from an address not
    # aligned to its size, an overflow: -fno-sanitize-recover, else it is only printed). -O0: compiles in under half
    # the time of -O1 (about 9 s instead of 22 s on two cores, the runs take as long) and keeps every read, so none
    # is optimised away before the sanitizer sees it
    built = subprocess.run([compiler, "-std=c++20", "-O0", "-pthread", "-fsanitize=address,undefined",
                            "-fno-sanitize-recover=all",
                            *(f"-I{p}" for p in includes), str(HERE / "kernels.cpp"), "-o", str(path)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    return path


def _run(binary, mode, parts, dtype, tmp_path) -> tuple[torch.Tensor, str]:
    """Writes the problem, runs the kernels (``mode``: threads, rows or hinge), returns the results, flat, and what
    the run printed to stderr (the count of vector atomics)."""
    (tmp_path / "problem").write_bytes(b"".join(p.tobytes() for p in parts))
    done = subprocess.run([str(binary), mode, str(tmp_path / "problem"), str(tmp_path / "result")],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.from_numpy(np.fromfile(tmp_path / "result", dtype=torch.empty(0, dtype=dtype).numpy().dtype)), \
        done.stderr


@pytest.fixture
def emulated(binary, tmp_path):
    """The uniform op's three kernels of one family on one problem: (scores, grad_x, (grad_w, grad_b)); the run's
    count of sm_90 vector atomics (atomicAdd(float4*), emulated) is left in ``run.vector_atomics``."""
    def run(family, x, idx, w, b, g):
        batch, inputs = x.shape
        conn, labels = idx.shape
        header = np.array([X_KINDS[x.dtype], batch, inputs, labels, conn, b is not None], dtype=np.int64)
        raw_x = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        parts = [header, raw_x.numpy(), idx.numpy(), w.numpy(), *([b.numpy()] if b is not None else []), g.numpy()]
        result, stderr = _run(binary, family, parts, w.dtype, tmp_path)
        run.vector_atomics = int(re.search(r"^vector atomics: (\d+)$", stderr, re.M).group(1))
        scores, grad_x, grad_w, grad_b = result.split([batch * labels, batch * inputs, conn * labels, labels])
        return scores.view(batch, labels), grad_x.view(batch, inputs), (grad_w.view(conn, labels), grad_b)

    return run


# (batch, inputs, labels, connectivity): a partial last tile of labels, batch and connections below and above
# the warp (two chunks of each), repeated sources (connectivity near inputs).
@pytest.mark.parametrize("shape, density, dtype", [
    ((1, 1, 1, 1), 1.0, torch.float32),
    ((3, 40, 40, 37), 1.0, torch.float32),
    ((33, 70, 45, 5), 0.05, torch.float32),
    ((17, 64, 33, 32), 0.0, torch.float32),
    ((5, 9, 70, 3), 0.3, torch.float64),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("family", ["threads", "rows", "rows-unroll2", "rows-unroll4", "rows-vec", "rows-dense",
                                    "rows-sparse"])
def test_kernel_source_matches_the_reference(emulated, family, shape, density, dtype):
    x, idx, w, b, g = sparse_layer_problem(*shape, density, dtype, seed=sum(shape))
    scores, grad_x, grad_wb = emulated(family, x, idx, w, b, g)
    torch.testing.assert_close(scores, reference.forward(x, idx, w, b))
    torch.testing.assert_close(grad_x, reference.backward_input(g, idx, w, shape[1]))
    torch.testing.assert_close(grad_wb, reference.backward_weight(g, x, idx))  # weights and bias


def test_the_unrolled_forwards_sum_in_the_same_order(emulated):
    """The benchmark's forward variants issue more gathers before summing, but add the connections in the same
    order: the same bits as the op's warp-per-label forward."""
    x, idx, w, b, g = sparse_layer_problem(7, 90, 70, 37, 1.0, torch.float32, seed=11)
    scores = emulated("rows", x, idx, w, b, g)[0]
    for family in ("rows-unroll2", "rows-unroll4", "rows-vec"):
        assert torch.equal(emulated(family, x, idx, w, b, g)[0], scores), family


# (batch, inputs, labels, connectivity): batch 1, 5, 33 (a second chunk of one row), 37 (a second chunk whose last
# 4-row group is partial), 64 (two whole chunks); labels below, not a multiple of, and above the 32-label tile;
# connectivity 1, 3, 33 (a second tile of one) and 40, not a multiple of the 8 connections reduced together.
VEC_SHAPES = [(1, 7, 5, 1), (5, 40, 70, 3), (33, 70, 45, 33), (37, 50, 33, 40), (64, 20, 40, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("shape", VEC_SHAPES, ids=["x".join(map(str, s)) for s in VEC_SHAPES])
def test_the_vector_kernels_match_the_warp_per_label_ones(emulated, shape, dtype):
    """rows-vec (8 lanes per label, 4 batch rows per lane, xmc_bench::rows_forward_vec / rows_backward_input_vec /
    rows_backward_weight_vec): the forward in the same bits as the op's warp-per-label forward (the same sums in the
    same order; bf16 inputs widened to the same float32), the input, weight and bias gradients as the reference's
    (their sums are ordered otherwise), on gradients with zeros (skipped) and without."""
    x, idx, w, b, g = sparse_layer_problem(*shape, 0.3 if shape[0] % 2 else 1.0,
                                           torch.float32 if dtype == torch.bfloat16 else dtype, seed=sum(shape))
    x = x.to(dtype)
    xr = x.float() if dtype == torch.bfloat16 else x  # the values the kernels gather
    scores, grad_x, grad_wb = emulated("rows-vec", x, idx, w, b, g)
    assert torch.equal(scores, emulated("rows", x, idx, w, b, g)[0])
    torch.testing.assert_close(scores, reference.forward(xr, idx, w, b))
    torch.testing.assert_close(grad_x, reference.backward_input(g, idx, w, shape[1]))
    torch.testing.assert_close(grad_wb, reference.backward_weight(g, xr, idx))


def test_the_warp_per_label_input_backward_takes_each_tiles_way_by_its_density(emulated):
    """Tiles of 32 labels whose gradient is dense, hinge-sparse (one row per label) or zero, side by side and over two
    batch chunks: each tile's way (rows, rows-vec) gives what forcing either way on every tile gives, and the
    reference."""
    x, idx, w, b, g = sparse_layer_problem(40, 300, 130, 37, 1.0, torch.float32, seed=3)
    g[:, 32:64] = 0
    g[5, 32:64] = torch.randn(32)  # one nonzero per label: sparse
    g[:, 64:96] = 0  # a zero tile; the last (partial) tile stays dense in the first chunk
    g[::3, 96:] = 0
    g[32:, 96:] = 0
    g[33, 100] = 1.5  # the second chunk: one nonzero in the last tile
    expected = reference.backward_input(g, idx, w, 300)
    for family in ("rows", "rows-dense", "rows-sparse", "rows-vec", "rows-vec-dense", "rows-vec-sparse"):
        torch.testing.assert_close(emulated(family, x, idx, w, b, g)[1], expected, msg=family)


# (batch, inputs, labels, connectivity) for the vector input backward: batch 1, 5 (lanes past bpad = 8), 33 and 37
# (a second chunk, its last 4-row group partial); labels below and not a multiple of the 32-label tile; connectivity
# 1, 3, 33 (a second tile of one connection).
VEC_INPUT_SHAPES = [(1, 9, 5, 1), (5, 40, 70, 3), (33, 70, 45, 33), (37, 50, 33, 3)]


@pytest.mark.parametrize("family", ["rows-vec", "rows-vec-dense", "rows-vec-sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("density", [1.0, 0.01, 0.0])
@pytest.mark.parametrize("shape", VEC_INPUT_SHAPES, ids=["x".join(map(str, s)) for s in VEC_INPUT_SHAPES])
def test_the_vector_input_backward_matches_the_reference(emulated, shape, density, dtype, family):
    """backward_input_vec_kernel (xmc_bench::rows_backward_input_vec), each tile's own way (rows-vec) and each way
    forced on every tile: the dense one with 4 rows per lane and one atomic_add4 (float32: the sm_90 vector atomic,
    emulated; float64: 4 scalar atomics), the sparse one a lane per label."""
    x, idx, w, b, g = sparse_layer_problem(*shape, density, dtype, seed=sum(shape))
    grad_x = emulated(family, x, idx, w, b, g)[1]
    torch.testing.assert_close(grad_x, reference.backward_input(g, idx, w, shape[1]))
    if density == 0.0:
        assert not grad_x.any() and emulated.vector_atomics == 0


@pytest.mark.parametrize("batch", [5, 37])
def test_the_vector_input_backward_adds_4_rows_per_vector_atomic(emulated, batch):
    """The emulator compiles atomic_add4's sm_90 path (simt.h defines XMC_SIMT_VECTOR_ATOMICS), so float32's vector
    atomics are what ran: on a dense gradient, per (label, connection) one for each lane with 2 or more of its 4 rows
    within the batch (a lane with 1 adds it alone, one with none adds nothing), 8 per whole chunk of 32 rows. float64
    and the warp-wide dense way (rows-dense: one value per lane) issue none."""
    labels, conn = 45, 3
    x, idx, w, b, g = sparse_layer_problem(batch, 40, labels, conn, 1.0, torch.float32, seed=batch)
    lanes = 8 * (batch // 32) + sum(min(4, batch % 32 - 4 * s) >= 2 for s in range(8))
    emulated("rows-vec-dense", x, idx, w, b, g)
    assert emulated.vector_atomics == labels * conn * lanes
    emulated("rows-dense", x, idx, w, b, g)
    assert emulated.vector_atomics == 0
    emulated("rows-vec-dense", x.double(), idx, w.double(), b.double(), g.double())
    assert emulated.vector_atomics == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("batch", [5, 37])
def test_the_vector_input_backward_writes_no_column_past_its_padded_batch(emulated, batch, dtype):
    """An infinite weight makes its label's products at the zero gradients past the batch NaN: a lane whose 4 rows
    are all past the batch must not add them, for they would land beyond the row's bpad (8, 40) columns, in the
    next inputs' rows (the chunk's lanes reach 32 rows). Only the infinite weight's input is infinite."""
    x, idx, w, b, g = sparse_layer_problem(batch, 40, 45, 3, 1.0, dtype, seed=batch)
    w[1, 7] = float("inf")
    expected = reference.backward_input(g, idx, w, 40)
    assert expected.isinf().any() and not expected.isnan().any()
    for family in ("rows-vec", "rows-vec-dense"):
        torch.testing.assert_close(emulated(family, x, idx, w, b, g)[1], expected, msg=family)


@pytest.mark.parametrize("family", ["threads", "rows", "rows-unroll4", "rows-vec"])
def test_kernel_source_gathers_bf16_inputs_as_their_float32_values(emulated, family):
    x, idx, w, b, g = sparse_layer_problem(9, 50, 40, 6, 0.3, torch.float32, seed=5)
    xb = x.bfloat16()
    scores, _, grad_wb = emulated(family, xb, idx, w, None, g)
    torch.testing.assert_close(scores, reference.forward(xb.float(), idx, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_wb, reference.backward_weight(g, xb.float(), idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("entries, blocks", [(7, 4), (4 * 256 * 3 + 5, 2)], ids=["below-a-pack", "grid-stride"])
def test_squared_hinge_kernel_source_matches_the_reference(binary, tmp_path, dtype, entries, blocks):
    """Both paths of the negatives kernel (16-byte packs, one value at a time; a trailing partial pack; two blocks
    striding over several packs each), and the positives kernel with repeats, padding and scores at the hinge
    points -1 and 1 (in the grid-stride case more positives than the negatives' blocks have threads)."""
    gen = generator(entries)
    scores = torch.randn(entries, generator=gen, dtype=dtype) * 2
    scores[:4] = torch.tensor([-1.0, 1.0, 0.0, -3.0], dtype=dtype)[: min(4, entries)]
    positives = torch.randint(entries, (max(9, entries // 3),), generator=gen)
    positives = torch.cat([positives, positives[:3], torch.tensor([-1, 1, 0])])  # repeats, padding
    header = np.array([0 if dtype == torch.float32 else 1, entries, positives.numel(), blocks], dtype=np.int64)
    result = _run(binary, "hinge", [header, scores.numpy(), positives.numpy()], dtype, tmp_path)[0]
    want_loss, want_grad = reference.squared_hinge(scores, positives)
    for loss, grad in (result[: entries + 1].split([1, entries]), result[entries + 1 :].split([1, entries])):
        torch.testing.assert_close(loss[0], want_loss)
        torch.testing.assert_close(grad, want_grad)
