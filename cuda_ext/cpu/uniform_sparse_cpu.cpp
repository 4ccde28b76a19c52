// CPU kernels of the uniform (fixed fan-in) sparse op; the schema is defined in ../ops.cpp.
//   out[b, j] = sum_k weight[k, j] * x[b, indices[k, j]] + bias[j]
// indices/weight are (connectivity, out_features); see ../README.md for the layout reasoning.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <tuple>
#include <vector>

#include "../checks.h"

namespace xmc_sparse {
namespace {

constexpr int64_t kTile = 64;  // labels per task: the tile's indices/weights stay in L1/L2

// Every kernel checks each source index it reads (one compare outside the batch loops) and skips one outside
// [0, in_features): a bad index is an error, never a read or write past the inputs.
inline bool outside(int32_t src, int64_t in_features) {
  return static_cast<uint32_t>(src) >= static_cast<uint64_t>(in_features);
}

void check_index_range(bool in_range, const at::Tensor& indices, int64_t in_features) {
  if (in_range) return;
  TORCH_CHECK(false, "indices must lie in [0, ", in_features, "), found values in [", indices.min().item<int32_t>(),
              ", ", indices.max().item<int32_t>(), "]");
}

// The batch is split into chunks of bc rows and each chunk stored transposed, xc (chunks, in, bc):
// one connection's gather reads bc contiguous values, and a chunk (in * bc values) stays in the
// caches while all labels gather from it. A chunk beyond the batch is zero-padded.
// The forward's chunks hold up to 1M values (4 MiB): when it read all indices and weights once per chunk, 64K
// (8 chunks at 16,384 inputs, batch 32) took 2.3x as long; it now copies a tile's once for all its chunks.
// The weight backward's chunks hold up to 1M values too, rounded up to a multiple of kGroup rows: it skips a
// label's all-zero groups of kGroup rows within a chunk (squared hinge), so small chunks gain nothing there, and a
// dense gradient (BCE) reads whole rows of a chunk (with 64K chunks, rows of 4 values: a quarter cache line per
// gather; results/bench/cpu-full-uniform-*.md).
// The input backward's chunks size each task's accumulator: up to 1M values (4 MiB in float32).
constexpr int64_t kForwardChunkValues = 1024 * 1024, kWeightChunkValues = 1024 * 1024, kInputChunkValues = 1024 * 1024;
constexpr int64_t kGroup = 4;  // the weight backward's rows per group (see there); its chunks are a multiple of it

int64_t batch_chunk(int64_t batch, int64_t in_features, int64_t chunk_values) {
  return std::clamp<int64_t>(chunk_values / std::max<int64_t>(in_features, 1), 1, std::max<int64_t>(batch, 1));
}

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

at::Tensor chunked_transpose(const at::Tensor& x, int64_t bc) {
  const int64_t batch = x.size(0), in = x.size(1), chunks = (batch + bc - 1) / bc;
  at::Tensor rows = x;
  if (chunks * bc != batch) {
    rows = x.new_zeros({chunks * bc, in});
    rows.narrow(0, 0, batch).copy_(x);
  }
  return rows.view({chunks, bc, in}).transpose(1, 2).contiguous();
}

// Forward: per tile of labels and batch chunk, accumulate (tile, bc) sums from xc rows, then
// write out[b, tile] row-wise. The tile's indices and weights are copied first, a connection's row at a time, as
// in the backward kernels: loads one after another keep their cache misses in flight together, and the copy was
// faster than reading them in place between the gathers.
template <typename T>
bool forward_cpu_kernel(const T* xc, const int32_t* idx, const T* w, const T* bias, T* out, int64_t batch,
                        int64_t bc, int64_t in_features, int64_t conn, int64_t labels) {
  const int64_t tiles = (labels + kTile - 1) / kTile;
  std::atomic<bool> out_of_range{false};
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    bool bad = false;
    std::vector<T> acc(kTile * bc), wt(kTile * conn);
    std::vector<int32_t> it(kTile * conn);  // the tile's indices and weights, (conn, tile)
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * kTile, n = std::min(kTile, labels - j0);
      for (int64_t k = 0; k < conn; ++k) {
        std::copy_n(idx + k * labels + j0, n, &it[k * kTile]);
        std::copy_n(w + k * labels + j0, n, &wt[k * kTile]);
      }
      for (int64_t c0 = 0; c0 < batch; c0 += bc) {
        const T* xt = xc + (c0 / bc) * in_features * bc;
        for (int64_t jj = 0; jj < n; ++jj) std::fill_n(&acc[jj * bc], bc, bias ? bias[j0 + jj] : T(0));
        for (int64_t k = 0; k < conn; ++k) {
          const int32_t* ik = &it[k * kTile];
          const T* wk = &wt[k * kTile];
          for (int64_t jj = 0; jj < n; ++jj) {
            if (outside(ik[jj], in_features)) { bad = true; continue; }
            const T* xr = xt + static_cast<int64_t>(ik[jj]) * bc;
            const T wv = wk[jj];
            T* a = &acc[jj * bc];
            for (int64_t b = 0; b < bc; ++b) a[b] += wv * xr[b];
          }
        }
        const int64_t nb = std::min(bc, batch - c0);
        for (int64_t b = 0; b < nb; ++b)
          for (int64_t jj = 0; jj < n; ++jj) out[(c0 + b) * labels + j0 + jj] = acc[jj * bc + b];
      }
    }
    if (bad) out_of_range = true;
  });
  return !out_of_range;
}

// Backward to the inputs. A chunk of bc batch rows at a time, each task takes tiles of labels and adds into its own
// accumulators, which are then summed into grad_x's rows of the chunk. A tile with a nonzero gradient has its
// indices and weights copied first, a connection's row at a time, as in the weight backward: read in place label
// by label (a row apart), each was a cache miss waited for before its update; the mostly-zero tiles' rows were
// slower on them in place too. A tile whose gradient is mostly zero (squared hinge) then goes row by row over its
// nonzeros, into a row-major accumulator (bc, in). A denser tile (BCE, early training) is vectorised over the rows
// as the forward is: its gradient gathered transposed, (tile, bc), w * column added to the transposed
// accumulator's row acc[src, 0..bc) for each connection. Labels with a zero gradient skip the updates, an all-zero
// tile the copy too.
template <typename T>
bool backward_input_cpu_kernel(const T* g, const int32_t* idx, const T* w, T* gx, int64_t batch,
                               int64_t conn, int64_t labels, int64_t in_features) {
  const int64_t bc = batch_chunk(batch, in_features, kInputChunkValues);
  const int64_t tiles = (labels + kTile - 1) / kTile, threads = at::get_num_threads(), size = in_features * bc;
  std::unique_ptr<T[]> accs(new T[threads * 2 * size]);  // per thread: transposed, then row-major; zeroed on use
  std::vector<char> used(threads * 2);
  std::atomic<bool> out_of_range{false};
  for (int64_t c0 = 0; c0 < batch; c0 += bc) {
    const int64_t nb = std::min(bc, batch - c0);
    std::fill(used.begin(), used.end(), 0);
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const int64_t thread = at::get_thread_num();
      auto accumulator = [&](int64_t which) {  // 0: transposed (in, bc); 1: row-major (bc, in)
        T* acc = &accs[(2 * thread + which) * size];
        if (!used[2 * thread + which]) std::fill_n(acc, size, T(0));
        used[2 * thread + which] = 1;
        return acc;
      };
      bool bad = false;
      std::vector<T> gt(kTile * bc), nz_g(kTile), wt(kTile * conn);
      std::vector<int32_t> it(kTile * conn);  // the tile's indices and weights, (tile, conn)
      std::vector<int64_t> nz_j(kTile);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t j0 = t * kTile, n = std::min(kTile, labels - j0);
        int64_t nonzeros = 0;
        for (int64_t b = 0; b < nb; ++b)
          for (int64_t jj = 0; jj < n; ++jj) nonzeros += g[(c0 + b) * labels + j0 + jj] != T(0);
        if (nonzeros == 0) continue;
        for (int64_t k = 0; k < conn; ++k)
          for (int64_t jj = 0; jj < n; ++jj) {
            it[jj * conn + k] = idx[k * labels + j0 + jj];
            wt[jj * conn + k] = w[k * labels + j0 + jj];
          }
        if (4 * nonzeros <= n * nb) {
          T* acc = accumulator(1);
          for (int64_t b = 0; b < nb; ++b) {
            const T* gb = g + (c0 + b) * labels + j0;
            int64_t m = 0;
            for (int64_t jj = 0; jj < n; ++jj)
              if (gb[jj] != T(0)) { nz_j[m] = jj * conn; nz_g[m] = gb[jj]; ++m; }
            T* row = acc + b * in_features;
            for (int64_t k = 0; k < conn; ++k) {
              for (int64_t q = 0; q < m; ++q) {
                const int32_t src = it[nz_j[q] + k];
                if (outside(src, in_features)) { bad = true; continue; }
                row[src] += wt[nz_j[q] + k] * nz_g[q];
              }
            }
          }
          continue;
        }
        T* acc = accumulator(0);
        for (int64_t b = 0; b < nb; ++b)
          for (int64_t jj = 0; jj < n; ++jj) gt[jj * bc + b] = g[(c0 + b) * labels + j0 + jj];
        for (int64_t jj = 0; jj < n; ++jj) {
          const T* gj = &gt[jj * bc];
          bool any = false;
          for (int64_t b = 0; b < nb; ++b) any |= gj[b] != T(0);
          if (!any) continue;
          for (int64_t k = 0; k < conn; ++k) {
            const int32_t src = it[jj * conn + k];
            if (outside(src, in_features)) { bad = true; continue; }
            const T wv = wt[jj * conn + k];
            T* a = acc + static_cast<int64_t>(src) * bc;
            for (int64_t b = 0; b < nb; ++b) a[b] += wv * gj[b];
          }
        }
      }
      if (bad) out_of_range = true;
    });
    // grad_x's rows of the chunk: the sum of the tasks' accumulators, split over input features
    at::parallel_for(0, in_features, 256, [&](int64_t i0, int64_t i1) {
      for (int64_t thread = 0; thread < threads; ++thread) {
        const T* transposed = &accs[2 * thread * size];
        const T* row_major = transposed + size;
        for (int64_t b = 0; b < nb; ++b) {
          T* row = gx + (c0 + b) * in_features;
          if (used[2 * thread])
            for (int64_t i = i0; i < i1; ++i) row[i] += transposed[i * bc + b];
          if (used[2 * thread + 1])
            for (int64_t i = i0; i < i1; ++i) row[i] += row_major[b * in_features + i];
        }
      }
    });
  }
  return !out_of_range;
}

// Backward to the weights: per tile, gather the tile's gradient as (tile, padded batch); a label whose gradient
// column is all zero gets zeros without loading any index or input, and a tile whose gradient is all zero loads
// none of its indices. Otherwise the tile's indices are copied first, a connection's row at a time: they miss the
// caches (each is read once), and loads one after another keep many misses in flight, where a label's connections
// one by one (a row of indices apart) were each a miss waited for before its gather.
// A chunk's rows go in groups of kGroup (chunks are a multiple of kGroup rows, zero-padded): a label's all-zero
// groups are skipped (squared hinge), the others summed in kGroup lanes, one vector register, so a dense gradient
// (BCE) is one multiply-add per group over a contiguous row of xc; the lanes are added pairwise at the end of the
// chunk. Every sum's order depends on the shape and the gradient's zeros, not on the threads. The bias gradient
// gb[j] (the column's sum) comes from the gathered columns.
template <typename T>
bool backward_weight_cpu_kernel(const T* g, const T* xc, const int32_t* idx, T* gw, T* gb, int64_t batch, int64_t bc,
                                int64_t in_features, int64_t conn, int64_t labels) {
  static_assert(kGroup == 4, "the lanes' sum below adds four");
  const int64_t tiles = (labels + kTile - 1) / kTile;
  const int64_t chunks = (batch + bc - 1) / bc, bpad = chunks * bc, groups = bc / kGroup;
  std::atomic<bool> out_of_range{false};
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    bool bad = false;
    std::vector<T> gt(kTile * bpad, T(0));
    std::vector<T> acc(kTile * conn);
    std::vector<int32_t> it(kTile * conn);  // the tile's indices, (tile, conn)
    std::vector<int64_t> nz(groups);        // the first rows of a label's nonzero groups in a chunk
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * kTile, n = std::min(kTile, labels - j0);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t jj = 0; jj < n; ++jj) gt[jj * bpad + b] = g[b * labels + j0 + jj];
      bool tile_nonzero = false;
      for (int64_t jj = 0; jj < n; ++jj) {
        T sum = 0;
        for (int64_t b = 0; b < batch; ++b) {
          sum += gt[jj * bpad + b];
          tile_nonzero |= gt[jj * bpad + b] != T(0);
        }
        gb[j0 + jj] = sum;
      }
      std::fill_n(acc.begin(), n * conn, T(0));
      if (tile_nonzero)
        for (int64_t k = 0; k < conn; ++k)
          for (int64_t jj = 0; jj < n; ++jj) it[jj * conn + k] = idx[k * labels + j0 + jj];
      for (int64_t c = 0; c < chunks && tile_nonzero; ++c) {
        const T* xt = xc + c * in_features * bc;
        for (int64_t jj = 0; jj < n; ++jj) {
          const T* gj = &gt[jj * bpad + c * bc];
          int64_t m = 0;
          for (int64_t o = 0; o < bc; o += kGroup) {
            bool any = false;
            for (int64_t l = 0; l < kGroup; ++l) any |= gj[o + l] != T(0);
            if (any) nz[m++] = o;
          }
          if (m == 0) continue;
          T* aj = &acc[jj * conn];
          for (int64_t k = 0; k < conn; ++k) {
            const int32_t src = it[jj * conn + k];
            if (outside(src, in_features)) { bad = true; continue; }
            const T* xr = xt + static_cast<int64_t>(src) * bc;
            T lane[kGroup] = {};
            if (m == groups) {  // every group: the whole row, in order
              for (int64_t o = 0; o < bc; o += kGroup)
                for (int64_t l = 0; l < kGroup; ++l) lane[l] += gj[o + l] * xr[o + l];
            } else {
              for (int64_t q = 0; q < m; ++q)
                for (int64_t l = 0; l < kGroup; ++l) lane[l] += gj[nz[q] + l] * xr[nz[q] + l];
            }
            aj[k] += (lane[0] + lane[1]) + (lane[2] + lane[3]);
          }
        }
      }
      for (int64_t k = 0; k < conn; ++k)
        for (int64_t jj = 0; jj < n; ++jj) gw[k * labels + j0 + jj] = acc[jj * conn + k];
    }
    if (bad) out_of_range = true;
  });
  return !out_of_range;
}

at::Tensor forward_cpu(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  check_forward(x, indices, weight, bias);
  TORCH_CHECK(x.scalar_type() != at::kBFloat16, "bf16 inputs are gathered by the CUDA kernels only; call x.float()");
  const int64_t batch = x.size(0), conn = indices.size(0), labels = indices.size(1);
  auto out = x.new_empty({batch, labels});
  if (batch == 0) return out;
  const int64_t bc = batch_chunk(batch, x.size(1), kForwardChunkValues);
  const auto xc = chunked_transpose(x, bc);
  bool in_range = true;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "uniform_sparse_forward_cpu", [&] {
    in_range = forward_cpu_kernel<scalar_t>(xc.const_data_ptr<scalar_t>(), indices.const_data_ptr<int32_t>(),
                                 weight.const_data_ptr<scalar_t>(),
                                 bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr,
                                 out.mutable_data_ptr<scalar_t>(), batch, bc, x.size(1), conn, labels);
  });
  check_index_range(in_range, indices, x.size(1));
  return out;
}

at::Tensor backward_input_cpu(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& weight,
                              int64_t in_features) {
  check_backward_input(grad_out, indices, weight);
  const int64_t batch = grad_out.size(0), conn = indices.size(0), labels = indices.size(1);
  auto grad_x = grad_out.new_zeros({batch, in_features});
  if (batch == 0) return grad_x;
  bool in_range = true;
  AT_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "uniform_sparse_backward_input_cpu", [&] {
    in_range = backward_input_cpu_kernel<scalar_t>(grad_out.const_data_ptr<scalar_t>(), indices.const_data_ptr<int32_t>(),
                                        weight.const_data_ptr<scalar_t>(), grad_x.mutable_data_ptr<scalar_t>(),
                                        batch, conn, labels, in_features);
  });
  check_index_range(in_range, indices, in_features);
  return grad_x;
}

std::tuple<at::Tensor, at::Tensor> backward_weight_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                       const at::Tensor& indices) {
  check_backward_weight(grad_out, x, indices);
  TORCH_CHECK(x.scalar_type() != at::kBFloat16, "bf16 inputs are gathered by the CUDA kernels only; call x.float()");
  const int64_t batch = grad_out.size(0), conn = indices.size(0), labels = indices.size(1);
  auto grad_w = grad_out.new_empty({conn, labels});
  auto grad_b = grad_out.new_empty({labels});
  if (batch == 0) return {grad_w.zero_(), grad_b.zero_()};
  const int64_t bc = round_up(batch_chunk(batch, x.size(1), kWeightChunkValues), kGroup);
  const auto xc = chunked_transpose(x, bc);
  bool in_range = true;
  AT_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "uniform_sparse_backward_weight_cpu", [&] {
    in_range = backward_weight_cpu_kernel<scalar_t>(grad_out.const_data_ptr<scalar_t>(), xc.const_data_ptr<scalar_t>(),
                                         indices.const_data_ptr<int32_t>(), grad_w.mutable_data_ptr<scalar_t>(),
                                         grad_b.mutable_data_ptr<scalar_t>(), batch, bc, x.size(1), conn, labels);
  });
  check_index_range(in_range, indices, x.size(1));
  return {grad_w, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(xmc_sparse, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("backward_input", &backward_input_cpu);
  m.impl("backward_weight", &backward_weight_cpu);
}

}  // namespace xmc_sparse
