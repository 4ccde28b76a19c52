// CUDA kernels of the fused squared hinge loss; the schema is defined in ../ops.cpp.
//   loss = mean over (B, L) of relu(1 - (2y - 1) s)^2, y = 1 at the flat positions in `positives`
//   grad = d loss / d scores
// Three launches, no host sync (capturable in a CUDA graph): zero the loss; negatives_kernel
// treats every entry as a negative (one read of the scores, one write of the gradient, a block sum
// and one atomic per block); positives_kernel overwrites the positive entries and adds the loss
// correction once per distinct position (the atomicExch test, see ../README.md).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

#include "../checks.h"

namespace xmc_sparse {
namespace {

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

unsigned blocks_for(int64_t work, int64_t cap) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, cap)));
}

std::tuple<at::Tensor, at::Tensor> squared_hinge_cuda(const at::Tensor& scores, const at::Tensor& positives) {
  check_squared_hinge(scores, positives);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t n = scores.numel(), npos = positives.numel();
  auto grad = scores.new_empty(scores.sizes());
  if (n == 0) return {scores.new_full({}, std::numeric_limits<double>::quiet_NaN()), grad};  // mean of nothing
  auto loss = scores.new_zeros({});
  int sms = 0;  // a device attribute query: no stream work, allowed during graph capture
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, scores.get_device()));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "squared_hinge_cuda", [&] {
    constexpr int kPack = 16 / sizeof(scalar_t);
    const scalar_t two_over_n = static_cast<scalar_t>(2.0 / static_cast<double>(n));
    const scalar_t inv_n = static_cast<scalar_t>(1.0 / static_cast<double>(n));
    const scalar_t* s = scores.const_data_ptr<scalar_t>();
    scalar_t* g = grad.mutable_data_ptr<scalar_t>();
    scalar_t* acc = loss.mutable_data_ptr<scalar_t>();
    const unsigned grid = blocks_for(n / kPack, static_cast<int64_t>(sms) * kBlocksPerSm);
    // A view with a storage offset may not be 16-byte aligned: then move one value at a time.
    if (reinterpret_cast<std::uintptr_t>(s) % 16 == 0 && reinterpret_cast<std::uintptr_t>(g) % 16 == 0) {
      negatives_kernel<scalar_t, kPack><<<grid, kThreads, 0, stream>>>(s, g, n, two_over_n, inv_n, acc);
    } else {
      negatives_kernel<scalar_t, 1><<<grid, kThreads, 0, stream>>>(s, g, n, two_over_n, inv_n, acc);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (npos > 0) {
      positives_kernel<scalar_t><<<blocks_for(npos, std::numeric_limits<int32_t>::max()), kThreads, 0, stream>>>(
          s, g, positives.const_data_ptr<int64_t>(), npos, n, two_over_n, inv_n, acc);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {loss, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(xmc_sparse, CUDA, m) {
  m.impl("squared_hinge", &squared_hinge_cuda);
}

}  // namespace xmc_sparse
