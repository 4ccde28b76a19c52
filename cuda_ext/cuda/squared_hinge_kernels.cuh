// CUDA kernels of the fused squared hinge loss (device code only; the host side is squared_hinge_cuda.cu, and
// tests/cuda_on_cpu/ runs these same kernels on a CPU). The schema is defined in ../ops.cpp.
//   loss = mean over (B, L) of relu(1 - (2y - 1) s)^2, y = 1 at the flat positions in `positives`
//   grad = d loss / d scores
// Three launches, no host sync (capturable in a CUDA graph): zero the loss; negatives_kernel
// treats every entry as a negative (one read of the scores, one write of the gradient, a block sum
// and one atomic per block); positives_kernel overwrites the positive entries and adds the loss
// correction once per distinct position (the atomicExch test, see ../README.md).
#pragma once
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>

namespace xmc_sparse {
namespace hinge {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // 2048 resident threads per SM: enough loads in flight for full bandwidth

// NaN passes through (a NaN score must give a NaN loss for the non-finite loss watch).
template <typename T>
__device__ __forceinline__ T relu(T v) { return v < T(0) ? T(0) : v; }

// V consecutive values moved as one 16-byte access when V * sizeof(T) == 16.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Sum over the block, valid in thread 0.
template <typename T>
__device__ __forceinline__ T block_sum(T v) {
  __shared__ T warp_sums[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_sums[lane] : T(0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

// grad = 2/N relu(s + 1) everywhere; loss += sum relu(s + 1)^2 / N. Grid-stride over packs of V,
// then the < V trailing elements.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) negatives_kernel(const T* __restrict__ s, T* __restrict__ g, int64_t n,
                                                             T two_over_n, T inv_n, T* __restrict__ loss) {
  using P = Pack<T, V>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t packs = n / V;
  T sum = T(0);
  for (int64_t i = tid; i < packs; i += stride) {
    const P in = reinterpret_cast<const P*>(s)[i];
    P out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const T h = relu(in.v[k] + T(1));
      sum += h * h;
      out.v[k] = two_over_n * h;
    }
    reinterpret_cast<P*>(g)[i] = out;
  }
  for (int64_t i = packs * V + tid; i < n; i += stride) {
    const T h = relu(s[i] + T(1));
    sum += h * h;
    g[i] = two_over_n * h;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) atomicAdd(loss, sum * inv_n);
}

__device__ __forceinline__ float exchange(float* p, float v) { return atomicExch(p, v); }
__device__ __forceinline__ double exchange(double* p, double v) {
  return __longlong_as_double(static_cast<long long>(atomicExch(
      reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(__double_as_longlong(v)))));
}

// One thread per listed position p >= 0: grad[p] = -2/N relu(1 - s[p]). negatives_kernel left
// 2/N relu(s[p] + 1) >= 0 there, this value is <= 0, and they are never both 0, so only the first
// thread to exchange at p gets back a different value: it alone corrects the loss (a repeated
// position counts once).
template <typename T>
__global__ void __launch_bounds__(kThreads) positives_kernel(const T* __restrict__ s, T* __restrict__ g,
                                                             const int64_t* __restrict__ pos, int64_t npos,
                                                             int64_t n, T two_over_n, T inv_n, T* __restrict__ loss) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= npos) return;
  const int64_t p = pos[k];
  if (p < 0) return;  // padding
  CUDA_KERNEL_ASSERT(p < n);
  const T x = s[p], neg = relu(x + T(1)), hinge = relu(T(1) - x);
  const T value = -two_over_n * hinge;
  if (exchange(g + p, value) != value) atomicAdd(loss, (hinge * hinge - neg * neg) * inv_n);
}

inline unsigned blocks_for(int64_t work, int64_t cap) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, cap)));
}

}  // namespace hinge
}  // namespace xmc_sparse
