// The uniform sparse op's CUDA kernels (device code only; the host side is uniform_sparse_cuda.cu, and
// tests/cuda_on_cpu/ runs these same kernels on a CPU). The layout choices are explained in ../README.md.
//   out[b, j] = sum_k weight[k, j] * x[b, indices[k, j]] + bias[j]
// One thread per label j. Consecutive threads take consecutive labels, so every load of
// indices[k, j], weight[k, j], grad_out[b, j] and every store of out[b, j] / grad_w[k, j] is
// coalesced over a warp. The inputs are used transposed and zero-padded, xt (in_features, bpad),
// so one connection's gather reads the whole batch chunk as contiguous 8- or 16-byte vectors.
// The gathers are served from L2 (xt is small) and bound the forward and the weight gradient: bf16
// inputs (bf16-mixed training) are gathered as bf16, half the bytes, and accumulated in float32.
#pragma once
#include <cstdint>
#include <type_traits>

#include "uniform_sparse_common.cuh"

namespace xmc_sparse {
namespace threads {

constexpr int kThreads = 128;
// Forward: connections whose index/weight loads are issued together (more requests in flight).
// The backward kernels measured faster without this (fewer registers, higher occupancy).
constexpr int kUnroll = 4;

// Loads this label's gradient for batch rows [c0, c0 + 4V) (zero beyond batch); returns a bit
// mask of the 4-wide groups that hold any nonzero value.
template <typename T, int V>
__device__ __forceinline__ unsigned load_grad(const T* __restrict__ g, int64_t labels, int64_t j, int c0,
                                              int batch, T (&gv)[4 * V]) {
  unsigned mask = 0;
#pragma unroll
  for (int i = 0; i < 4 * V; ++i) {
    gv[i] = (c0 + i < batch) ? g[static_cast<int64_t>(c0 + i) * labels + j] : T(0);
    if (gv[i] != T(0)) mask |= 1u << (i / 4);
  }
  return mask;
}

template <typename T, typename TX, int V>
__global__ void __launch_bounds__(kThreads) forward_kernel(
    const TX* __restrict__ xt, const int32_t* __restrict__ idx, const T* __restrict__ w,
    const T* __restrict__ bias, T* __restrict__ out, int batch, int bpad, int conn, int labels) {
  const int j = blockIdx.x * kThreads + threadIdx.x;
  if (j >= labels) return;
  const T b0 = bias ? bias[j] : T(0);
  for (int c0 = 0; c0 < batch; c0 += 4 * V) {
    T acc[4 * V];
#pragma unroll
    for (int i = 0; i < 4 * V; ++i) acc[i] = T(0);
    for (int k0 = 0; k0 < conn; k0 += kUnroll) {
      int src[kUnroll];
      T wv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool ok = k0 + u < conn;
        const int64_t at = static_cast<int64_t>(k0 + u) * labels + j;
        src[u] = ok ? __ldg(idx + at) : 0;
        wv[u] = ok ? __ldg(w + at) : T(0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const TX* xr = xt + static_cast<int64_t>(src[u]) * bpad + c0;
#pragma unroll
        for (int v = 0; v < V; ++v) {
          T q[4];
          load4(xr + 4 * v, q);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[4 * v + i] += wv[u] * q[i];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4 * V; ++i)
      if (c0 + i < batch) out[static_cast<int64_t>(c0 + i) * labels + j] = acc[i] + b0;
  }
}

// grad_xt[src, b] += weight[k, j] * grad_out[b, j]: skips labels (and 4-row groups) whose gradient
// is exactly zero before loading their indices and weights.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) backward_input_kernel(
    const T* __restrict__ g, const int32_t* __restrict__ idx, const T* __restrict__ w, T* __restrict__ gxt,
    int batch, int bpad, int conn, int labels) {
  const int j = blockIdx.x * kThreads + threadIdx.x;
  if (j >= labels) return;
  for (int c0 = 0; c0 < batch; c0 += 4 * V) {
    T gv[4 * V];
    const unsigned mask = load_grad<T, V>(g, labels, j, c0, batch, gv);
    if (!mask) continue;
    for (int k = 0; k < conn; ++k) {
      const int64_t at = static_cast<int64_t>(k) * labels + j;
      const int src = __ldg(idx + at);
      const T wk = __ldg(w + at);
      T* dst = gxt + static_cast<int64_t>(src) * bpad + c0;
#pragma unroll
      for (int v = 0; v < V; ++v) {
        if (!(mask & (1u << v))) continue;
        const T add[4] = {wk * gv[4 * v], wk * gv[4 * v + 1], wk * gv[4 * v + 2], wk * gv[4 * v + 3]};
        atomic_add4(dst + 4 * v, add);
      }
    }
  }
}

// grad_w[k, j] = sum_b grad_out[b, j] * xt[indices[k, j], b], and the bias gradient gb[j] = sum_b grad_out[b, j]
// from the same loads. A label whose gradient column is all zero writes zeros without loading indices or
// inputs; zero 4-row groups skip their input loads.
template <typename T, typename TX, int V>
__global__ void __launch_bounds__(kThreads) backward_weight_kernel(
    const T* __restrict__ g, const TX* __restrict__ xt, const int32_t* __restrict__ idx, T* __restrict__ gw,
    T* __restrict__ gb, int batch, int bpad, int conn, int labels) {
  const int j = blockIdx.x * kThreads + threadIdx.x;
  if (j >= labels) return;
  bool written = false;
  T bias_sum = T(0);
  for (int c0 = 0; c0 < batch; c0 += 4 * V) {
    T gv[4 * V];
    const unsigned mask = load_grad<T, V>(g, labels, j, c0, batch, gv);
    if (!mask) continue;
#pragma unroll
    for (int i = 0; i < 4 * V; ++i) bias_sum += gv[i];  // zero beyond the batch
    for (int k = 0; k < conn; ++k) {
      const int64_t at = static_cast<int64_t>(k) * labels + j;
      const TX* xr = xt + static_cast<int64_t>(__ldg(idx + at)) * bpad + c0;
      T acc = T(0);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        if (!(mask & (1u << v))) continue;
        T q[4];
        load4(xr + 4 * v, q);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc += gv[4 * v + i] * q[i];
      }
      gw[at] = written ? gw[at] + acc : acc;
    }
    written = true;
  }
  gb[j] = bias_sum;
  if (!written)
    for (int k = 0; k < conn; ++k) gw[static_cast<int64_t>(k) * labels + j] = T(0);
}

// Batch chunk per pass = 4V rows: the smallest that covers a batch up to 32, else 32 (V = 8 keeps
// the per-thread accumulators in registers).
inline int pick_v(int64_t batch) { return batch <= 4 ? 1 : batch <= 8 ? 2 : batch <= 16 ? 4 : 8; }
inline int64_t padded(int64_t batch, int v) { return (batch + 4 * v - 1) / (4 * v) * (4 * v); }

template <typename F>
void with_v(int v, F&& f) {
  switch (v) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

inline unsigned blocks_for(int64_t labels) { return static_cast<unsigned>((labels + kThreads - 1) / kThreads); }

}  // namespace threads
}  // namespace xmc_sparse
