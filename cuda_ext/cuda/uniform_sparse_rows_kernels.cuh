// The warp-per-label kernels of the uniform sparse op (device code only; the host side is
// uniform_sparse_rows_cuda.cu, and tests/cuda_on_cpu/ runs these same kernels on a CPU).
//
// Why: in the op's own kernels a thread takes a label, and every connection reads (or atomically adds)
// the 32 batch values of one input row with eight 16-byte accesses, so one warp instruction touches
// 32 different rows: 32 L1 wavefronts (or 32 L2 atomic requests) for 512 bytes. Here a warp takes a
// label and a lane a batch row: a connection's 32 values are one 128-byte row, one coalesced access.
// Indices, weights, gradients and outputs pass through shared memory in tiles of 32 labels x 32
// connections / batch rows, so their global accesses stay coalesced over labels. More in ../README.md,
// "Warp-per-label candidates".
#pragma once
#include <cstdint>

#include "uniform_sparse_common.cuh"

namespace xmc_sparse {
namespace rows {

constexpr int kWarp = 32;
constexpr int kWarps = 4;                        // per block
constexpr int kThreads = kWarp * kWarps;
constexpr int kTile = 32;                        // labels per block
constexpr int kLabelsPerWarp = kTile / kWarps;  // 8
constexpr unsigned kAll = 0xffffffffu;

__device__ __forceinline__ float load_value(const float* p) { return __ldg(p); }
__device__ __forceinline__ double load_value(const double* p) { return __ldg(p); }
__device__ __forceinline__ float load_value(const Bf16* p) {
  return __uint_as_float(static_cast<uint32_t>(__ldg(&p->bits)) << 16);
}

// A (kWarp x kTile) tile of a (rows, labels) array: tile[r][l] = a[r0 + r, j0 + l], zero outside the
// array. Each warp reads whole 128-byte rows. `Stride` pads rows that are later read by column.
template <typename T, int Stride>
__device__ __forceinline__ void stage_tile(const T* __restrict__ a, int num_rows, int labels, int r0, int j0,
                                           T (&tile)[kWarp][Stride]) {
  const int lane = threadIdx.x % kWarp, j = j0 + lane;
  for (int r = threadIdx.x / kWarp; r < kWarp; r += kWarps) {
    const bool ok = r0 + r < num_rows && j < labels;
    tile[r][lane] = ok ? __ldg(a + static_cast<int64_t>(r0 + r) * labels + j) : T(0);
  }
}

// out[b, j] = sum_k weight[k, j] * xt[indices[k, j], b] + bias[j]; lane = batch row. `Unroll` connections
// at a time: kLabelsPerWarp x Unroll independent gathers in flight per lane (the op uses 1; the benchmark
// times 2 and 4, xmc_bench::rows_forward_unroll<U>: a forward bound by L2 latency gains, one bound by
// L2 requests does not).
template <typename T, typename TX, int Unroll = 1>
__global__ void __launch_bounds__(kThreads) forward_kernel(
    const TX* __restrict__ xt, const int32_t* __restrict__ idx, const T* __restrict__ w,
    const T* __restrict__ bias, T* __restrict__ out, int batch, int bpad, int conn, int labels) {
  __shared__ int32_t s_idx[kWarp][kTile];
  __shared__ T s_w[kWarp][kTile];
  __shared__ T s_out[kWarp][kTile + 1];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, j0 = blockIdx.x * kTile;
  for (int c0 = 0; c0 < batch; c0 += kWarp) {
    const bool row = c0 + lane < batch;
    T acc[kLabelsPerWarp] = {};
    for (int k0 = 0; k0 < conn; k0 += kWarp) {
      __syncthreads();  // the previous chunk's tiles are read
      stage_tile(idx, conn, labels, k0, j0, s_idx);
      stage_tile(w, conn, labels, k0, j0, s_w);
      __syncthreads();
      const int kn = min(kWarp, conn - k0);
      int k = 0;
      if constexpr (Unroll > 1) {
        for (; k + Unroll <= kn; k += Unroll) {  // all Unroll x kLabelsPerWarp loads issued before the sums
          T v[Unroll][kLabelsPerWarp];
#pragma unroll
          for (int u = 0; u < Unroll; ++u)
#pragma unroll
            for (int i = 0; i < kLabelsPerWarp; ++i)
              v[u][i] = row ? load_value(xt + static_cast<int64_t>(s_idx[k + u][warp * kLabelsPerWarp + i]) * bpad +
                                         c0 + lane)
                            : T(0);
#pragma unroll
          for (int u = 0; u < Unroll; ++u)
#pragma unroll
            for (int i = 0; i < kLabelsPerWarp; ++i) acc[i] += s_w[k + u][warp * kLabelsPerWarp + i] * v[u][i];
        }
      }
      for (; k < kn; ++k) {  // labels innermost: eight independent loads in flight (the rest, with Unroll > 1)
#pragma unroll
        for (int i = 0; i < kLabelsPerWarp; ++i) {
          const int l = warp * kLabelsPerWarp + i;
          const TX* xr = xt + static_cast<int64_t>(s_idx[k][l]) * bpad + c0;
          acc[i] += s_w[k][l] * (row ? load_value(xr + lane) : T(0));
        }
      }
    }
    __syncthreads();  // s_out's previous readers are done
#pragma unroll
    for (int i = 0; i < kLabelsPerWarp; ++i) {
      const int l = warp * kLabelsPerWarp + i;
      s_out[lane][l] = acc[i] + (bias && j0 + l < labels ? bias[j0 + l] : T(0));
    }
    __syncthreads();
    for (int r = warp; r < kWarp; r += kWarps)
      if (c0 + r < batch && j0 + lane < labels)
        out[static_cast<int64_t>(c0 + r) * labels + j0 + lane] = s_out[r][lane];
  }
}

// The forward with 8 lanes per label and 4 batch rows per lane (benchmark only, xmc_bench::rows_forward_vec):
// forward_kernel's lanes spend about 40 instructions per connection on 8 gathers of one value each (shared index
// and weight loads, 64-bit address, load, FMA), and the H200's counters show it bound by instruction issue, not
// by L2. Here lane = 8q + s takes rows 4s..4s+3 of the chunk for label q of a group of 4 (the warp's 8 labels in
// 2 groups): one load4 per connection and label gathers 4 values, one warp instruction 4 whole rows. The sums
// run in forward_kernel's order (k ascending, acc += w * x per output), so the results are the same bits.
template <typename T, typename TX>
__global__ void __launch_bounds__(kThreads) forward_vec_kernel(
    const TX* __restrict__ xt, const int32_t* __restrict__ idx, const T* __restrict__ w,
    const T* __restrict__ bias, T* __restrict__ out, int batch, int bpad, int conn, int labels) {
  constexpr int kGroups = kLabelsPerWarp / 4;
  __shared__ int32_t s_idx[kWarp][kTile];
  __shared__ T s_w[kWarp][kTile];
  __shared__ T s_out[kWarp][kTile + 1];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, j0 = blockIdx.x * kTile;
  const int q = lane / 8, r0 = 4 * (lane % 8);  // label in the group, first of the lane's 4 rows
  for (int c0 = 0; c0 < batch; c0 += kWarp) {
    // Lanes past the batch read the row's last 4 values instead (bpad is a multiple of 8: row_pad), whose sector a
    // lane within the batch reads anyway (float32, bf16): no branch, no extra traffic; their sums are not stored.
    const TX* xc = xt + min(c0 + r0, bpad - 4);
    T acc[kGroups][4] = {};
    for (int k0 = 0; k0 < conn; k0 += kWarp) {
      __syncthreads();  // the previous chunk's tiles are read
      stage_tile(idx, conn, labels, k0, j0, s_idx);
      stage_tile(w, conn, labels, k0, j0, s_w);
      __syncthreads();
      const int kn = min(kWarp, conn - k0);
      for (int k = 0; k < kn; ++k) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          const int l = warp * kLabelsPerWarp + 4 * g + q;
          T v[4];
          load4(xc + static_cast<int64_t>(s_idx[k][l]) * bpad, v);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[g][i] += s_w[k][l] * v[i];
        }
      }
    }
    __syncthreads();  // s_out's previous readers are done
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int l = warp * kLabelsPerWarp + 4 * g + q;
      const T b = bias && j0 + l < labels ? bias[j0 + l] : T(0);
#pragma unroll
      for (int i = 0; i < 4; ++i) s_out[r0 + i][l] = acc[g][i] + b;
    }
    __syncthreads();
    for (int r = warp; r < kWarp; r += kWarps)
      if (c0 + r < batch && j0 + lane < labels)
        out[static_cast<int64_t>(c0 + r) * labels + j0 + lane] = s_out[r][lane];
  }
}

// grad_xt[indices[k, j], b] += weight[k, j] * grad_out[b, j], per tile of 32 labels x 32 batch rows one of two ways:
// - dense: a warp per label, one warp-wide atomic add of a 128-byte row per connection (one L2 request for up to
//   32 values); labels whose gradient is zero for the whole chunk are skipped;
// - sparse (a tile with at most SparseRows nonzero gradients per label that has any, on average over the tile, as
//   the squared hinge's late in training): a lane per label, one atomic add per nonzero value and connection. At one
//   nonzero row per label the dense way issues as many L2 requests (a 128-byte row with one lane active), at two up
//   to half as many, but a warp instruction per label and connection against one per 32 labels here.
// The choice is the block's own, from the tile it has staged: no host round trip. SparseRows = 0 (32) forces the
// dense (sparse) way, for the tests. Vec: the dense way in forward_vec_kernel's layout (backward_input_vec_kernel).
constexpr int kSparseRowsPerLabel = 2;
template <typename T, int SparseRows, bool Vec>
__device__ __forceinline__ void backward_input_tiles(
    const T* __restrict__ g, const int32_t* __restrict__ idx, const T* __restrict__ w, T* __restrict__ gxt,
    int batch, int bpad, int conn, int labels) {
  __shared__ int32_t s_idx[kWarp][kTile];
  __shared__ T s_w[kWarp][kTile];
  __shared__ T s_g[kWarp][kTile + 1];
  __shared__ unsigned s_rows[kTile];  // label l: bit b set where the chunk's row b has a nonzero gradient
  __shared__ int s_counts[kWarps][2];  // per warp: nonzero values, labels with any
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, j0 = blockIdx.x * kTile;
  for (int c0 = 0; c0 < batch; c0 += kWarp) {
    __syncthreads();
    stage_tile(g, batch, labels, c0, j0, s_g);
    __syncthreads();
    T gv[kLabelsPerWarp];
    unsigned active = 0;  // bit i: the warp's label i has a nonzero gradient in this chunk
    int nonzeros = 0;
#pragma unroll
    for (int i = 0; i < kLabelsPerWarp; ++i) {
      gv[i] = s_g[lane][warp * kLabelsPerWarp + i];
      const unsigned rows = __ballot_sync(kAll, gv[i] != T(0));
      if (rows) active |= 1u << i;
      nonzeros += __popc(rows);
      if (lane == 0) s_rows[warp * kLabelsPerWarp + i] = rows;
    }
    if (lane == 0) {
      s_counts[warp][0] = nonzeros;
      s_counts[warp][1] = __popc(active);
    }
    __syncthreads();
    int tile_nonzeros = 0, tile_active = 0;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {
      tile_nonzeros += s_counts[v][0];
      tile_active += s_counts[v][1];
    }
    if (tile_active == 0) continue;
    const bool sparse = tile_nonzeros <= SparseRows * tile_active;
    for (int k0 = 0; k0 < conn; k0 += kWarp) {
      __syncthreads();
      stage_tile(idx, conn, labels, k0, j0, s_idx);
      stage_tile(w, conn, labels, k0, j0, s_w);
      __syncthreads();
      const int kn = min(kWarp, conn - k0);
      if (sparse) {  // lane = label, the warps share out the connections
        const unsigned rows = s_rows[lane];
        if (rows == 0) continue;
        for (int k = warp; k < kn; k += kWarps) {
          const T wk = s_w[k][lane];
          T* dst = gxt + static_cast<int64_t>(s_idx[k][lane]) * bpad + c0;
          for (unsigned left = rows; left; left &= left - 1) {
            const int b = __ffs(left) - 1;
            atomicAdd(dst + b, wk * s_g[b][lane]);
          }
        }
        continue;
      }
      if constexpr (Vec) {  // lane 8q + s: rows r0..r0+3 (r0 = 4s) of label q of each group of 4
        const int q = lane / 8, r0 = 4 * (lane % 8);
#pragma unroll
        for (int grp = 0; grp < kLabelsPerWarp / 4; ++grp) {
          if (!(active & (0xfu << 4 * grp))) continue;  // the group's 4 labels have no nonzero gradient
          const int l = warp * kLabelsPerWarp + 4 * grp + q;
          T g4[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) g4[i] = s_g[r0 + i][l];  // zero beyond the batch
          // Tested on the gradients, not on the products (0 * inf is not 0): a lane issues only when a row of its 4
          // is within the batch, so (bpad a multiple of 8) all 4 lie within the row of gxt.
          if (g4[0] == T(0) && g4[1] == T(0) && g4[2] == T(0) && g4[3] == T(0)) continue;
          for (int k = 0; k < kn; ++k) {
            const T wk = s_w[k][l];
            const T add[4] = {wk * g4[0], wk * g4[1], wk * g4[2], wk * g4[3]};
            atomic_add4(gxt + static_cast<int64_t>(s_idx[k][l]) * bpad + c0 + r0, add);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < kLabelsPerWarp; ++i) {
          if (!(active & (1u << i))) continue;
          const int l = warp * kLabelsPerWarp + i;
          for (int k = 0; k < kn; ++k)
            if (gv[i] != T(0))
              atomicAdd(gxt + static_cast<int64_t>(s_idx[k][l]) * bpad + c0 + lane, s_w[k][l] * gv[i]);
        }
      }
    }
  }
}

template <typename T, int SparseRows = kSparseRowsPerLabel>
__global__ void __launch_bounds__(kThreads) backward_input_kernel(
    const T* __restrict__ g, const int32_t* __restrict__ idx, const T* __restrict__ w, T* __restrict__ gxt,
    int batch, int bpad, int conn, int labels) {
  backward_input_tiles<T, SparseRows, false>(g, idx, w, gxt, batch, bpad, conn, labels);
}

// The input backward with the dense way in forward_vec_kernel's layout (xmc_bench::rows_backward_input_vec; the op
// with XMC_SPARSE_KERNELS=vec:backward_input). backward_input_kernel's dense way, one warp-wide atomic of 32 scalar
// floats per (label, connection), keeps the H200's L2 96.9 % busy at dense gradients (0.797 ms against a 0.289 ms
// floor of its bytes). Here lane 8q + s adds its label's rows 4s..4s+3 with one atomic_add4 (on sm_90+ one 16-byte
// vector atomic; 4 scalar ones for double and below sm_90): a warp instruction covers 4 labels' rows, 8 vector adds
// per row instead of 32 scalar ones. Whether the L2 does less work that way is for the benchmark and the hardware
// counters to say. Sparse tiles as there.
template <typename T, int SparseRows = kSparseRowsPerLabel>
__global__ void __launch_bounds__(kThreads) backward_input_vec_kernel(
    const T* __restrict__ g, const int32_t* __restrict__ idx, const T* __restrict__ w, T* __restrict__ gxt,
    int batch, int bpad, int conn, int labels) {
  backward_input_tiles<T, SparseRows, true>(g, idx, w, gxt, batch, bpad, conn, labels);
}

// v[t] on each lane -> v[0] on lane k: the sum over lanes of v[k] (31 shuffles for 32 sums; with S = 4 on 8
// values, over each aligned group of 8 lanes, 7 shuffles). At step S a lane keeps one half of its 2S values, adds
// its partner's copy of that half and hands over the other.
template <int S, typename T, int N>
__device__ __forceinline__ void transpose_sum(T (&v)[N]) {
  static_assert(2 * S <= N, "2S values per lane");
  const bool upper = threadIdx.x & S;
#pragma unroll
  for (int t = 0; t < S; ++t) {
    const T send = upper ? v[t] : v[t + S];
    const T keep = upper ? v[t + S] : v[t];
    v[t] = keep + __shfl_xor_sync(kAll, send, S);
  }
  if constexpr (S > 1) transpose_sum<S / 2>(v);
}

// grad_w[k, j] = sum_b grad_out[b, j] * xt[indices[k, j], b]: lane b forms its products for 32
// connections of a label, one transposing reduction leaves connection k's sum on lane k. The bias
// gradient gb[j] = sum_b grad_out[b, j] is summed from the first connection tile's gradient tiles
// (conn >= 1: the host sums it otherwise).
template <typename T, typename TX>
__global__ void __launch_bounds__(kThreads) backward_weight_kernel(
    const T* __restrict__ g, const TX* __restrict__ xt, const int32_t* __restrict__ idx, T* __restrict__ gw,
    T* __restrict__ gb, int batch, int bpad, int conn, int labels) {
  __shared__ int32_t s_idx[kWarp][kTile];
  __shared__ T s_g[kWarp][kTile + 1];
  __shared__ T s_gw[kWarp][kTile + 1];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, j0 = blockIdx.x * kTile;
  for (int k0 = 0; k0 < conn; k0 += kWarp) {
    __syncthreads();
    stage_tile(idx, conn, labels, k0, j0, s_idx);
    const int kn = min(kWarp, conn - k0);
    T sums[kLabelsPerWarp] = {};  // lane k: connection k0 + k of each of the warp's labels
    T bias_sum = T(0);            // thread t < kTile: label j0 + t, while k0 == 0
    for (int c0 = 0; c0 < batch; c0 += kWarp) {
      __syncthreads();
      stage_tile(g, batch, labels, c0, j0, s_g);
      __syncthreads();
      if (k0 == 0 && threadIdx.x < kTile)
        for (int r = 0; r < kWarp; ++r) bias_sum += s_g[r][threadIdx.x];  // zero beyond the batch
#pragma unroll
      for (int i = 0; i < kLabelsPerWarp; ++i) {
        const int l = warp * kLabelsPerWarp + i;
        const T gb = s_g[lane][l];
        if (!__any_sync(kAll, gb != T(0))) continue;
        T prod[kWarp];
#pragma unroll
        for (int k = 0; k < kWarp; ++k)
          prod[k] = (k < kn && gb != T(0)) ? gb * load_value(xt + static_cast<int64_t>(s_idx[k][l]) * bpad + c0 + lane)
                                           : T(0);
        transpose_sum<kWarp / 2>(prod);
        sums[i] += prod[0];
      }
    }
    if (k0 == 0 && threadIdx.x < kTile && j0 + threadIdx.x < labels) gb[j0 + threadIdx.x] = bias_sum;
#pragma unroll
    for (int i = 0; i < kLabelsPerWarp; ++i) s_gw[lane][warp * kLabelsPerWarp + i] = sums[i];
    __syncthreads();
    for (int r = warp; r < kn; r += kWarps)
      if (j0 + lane < labels) gw[static_cast<int64_t>(k0 + r) * labels + j0 + lane] = s_gw[r][lane];
  }
}

// The weight gradient in forward_vec_kernel's layout (benchmark only, xmc_bench::rows_backward_weight_vec): lane
// 8q + s multiplies rows 4s..4s+3 of connection k's input row (one load4) with its label's 4 staged gradients, for
// 8 connections at a time; one transposing reduction over its 8 lanes (7 shuffles) leaves connection k0 + 8c + s's
// sum on lane s. backward_weight_kernel's 32 products per lane and label cost a load each; here a load gathers 4.
// The bias gradient as there.
template <typename T, typename TX>
__global__ void __launch_bounds__(kThreads) backward_weight_vec_kernel(
    const T* __restrict__ g, const TX* __restrict__ xt, const int32_t* __restrict__ idx, T* __restrict__ gw,
    T* __restrict__ gb, int batch, int bpad, int conn, int labels) {
  constexpr int kGroups = kLabelsPerWarp / 4, kBlocks = kWarp / 8;
  __shared__ int32_t s_idx[kWarp][kTile];
  __shared__ T s_g[kWarp][kTile + 1];
  __shared__ T s_gw[kWarp][kTile + 1];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, j0 = blockIdx.x * kTile;
  const int q = lane / 8, s = lane % 8;
  for (int k0 = 0; k0 < conn; k0 += kWarp) {
    __syncthreads();
    stage_tile(idx, conn, labels, k0, j0, s_idx);
    const int kn = min(kWarp, conn - k0);
    T sums[kGroups][kBlocks] = {};  // lane 8q + s: connection k0 + 8c + s of label 4g + q
    T bias_sum = T(0);              // thread t < kTile: label j0 + t, while k0 == 0
    for (int c0 = 0; c0 < batch; c0 += kWarp) {
      __syncthreads();
      stage_tile(g, batch, labels, c0, j0, s_g);
      __syncthreads();
      if (k0 == 0 && threadIdx.x < kTile)
        for (int r = 0; r < kWarp; ++r) bias_sum += s_g[r][threadIdx.x];  // zero beyond the batch
      const TX* xc = xt + c0 + 4 * s;
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        const int l = warp * kLabelsPerWarp + 4 * grp + q;
        T gv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) gv[i] = s_g[4 * s + i][l];
        // zero beyond the batch: a lane with no nonzero gradient loads nothing
        const bool any = gv[0] != T(0) || gv[1] != T(0) || gv[2] != T(0) || gv[3] != T(0);
        if (!__any_sync(kAll, any)) continue;
#pragma unroll
        for (int c = 0; c < kBlocks; ++c) {
          if (8 * c >= kn) continue;  // not break: the loop stays unrolled, sums[grp][c] in registers
          T prod[8];
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            const int k = 8 * c + t;
            prod[t] = T(0);
            if (k < kn && any) {
              T v[4];
              load4(xc + static_cast<int64_t>(s_idx[k][l]) * bpad, v);
              prod[t] = gv[0] * v[0] + gv[1] * v[1] + gv[2] * v[2] + gv[3] * v[3];
            }
          }
          transpose_sum<4>(prod);
          sums[grp][c] += prod[0];
        }
      }
    }
    if (k0 == 0 && threadIdx.x < kTile && j0 + threadIdx.x < labels) gb[j0 + threadIdx.x] = bias_sum;
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp)
#pragma unroll
      for (int c = 0; c < kBlocks; ++c) s_gw[8 * c + s][warp * kLabelsPerWarp + 4 * grp + q] = sums[grp][c];
    __syncthreads();
    for (int r = warp; r < kn; r += kWarps)
      if (j0 + lane < labels) gw[static_cast<int64_t>(k0 + r) * labels + j0 + lane] = s_gw[r][lane];
  }
}

// Rows of xt padded to whole 32-byte sectors (a multiple of 8 values: the vector kernels' 4 rows from a multiple of
// 4 are aligned and lie within a row); blocks (of kThreads) for `labels`.
inline int64_t row_pad(int64_t batch) { return (batch + 7) / 8 * 8; }
inline unsigned tiles(int64_t labels) { return static_cast<unsigned>((labels + kTile - 1) / kTile); }

}  // namespace rows
}  // namespace xmc_sparse
