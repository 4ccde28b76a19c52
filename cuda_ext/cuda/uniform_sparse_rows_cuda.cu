// Warp-per-label kernels of the uniform sparse op: candidates, measured against the op's own
// thread-per-label kernels (uniform_sparse_cuda.cu) by xmc_repro.bench (methods `uniform-rows` and
// `uniform-rows-bf16`). Registered as xmc_bench::rows_forward / rows_backward_input / rows_backward_weight,
// with the schemas of xmc_sparse::forward / backward_input / backward_weight; the op runs them instead of its
// own after xmc_bench::use_rows_kernels(true) (XMC_SPARSE_KERNELS=rows), to measure them in training.
//
// Why: in the op's kernels a thread takes a label, and every connection reads (or atomically adds)
// the 32 batch values of one input row with eight 16-byte accesses, so one warp instruction touches
// 32 different rows: 32 L1 wavefronts (or 32 L2 atomic requests) for 512 bytes. Here a warp takes a
// label and a lane a batch row: a connection's 32 values are one 128-byte row, one coalesced access.
// Indices, weights, gradients and outputs pass through shared memory in tiles of 32 labels x 32
// connections / batch rows, so their global accesses stay coalesced over labels.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "../checks.h"
#include "../schema.h"
#include "uniform_sparse_common.cuh"

namespace xmc_sparse {
namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;                        // per block
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
__device__ __forceinline__ void stage_tile(const T* __restrict__ a, int rows, int labels, int r0, int j0,
                                           T (&tile)[kWarp][Stride]) {
  const int lane = threadIdx.x % kWarp, j = j0 + lane;
  for (int r = threadIdx.x / kWarp; r < kWarp; r += kWarps) {
    const bool ok = r0 + r < rows && j < labels;
    tile[r][lane] = ok ? __ldg(a + static_cast<int64_t>(r0 + r) * labels + j) : T(0);
  }
}

// out[b, j] = sum_k weight[k, j] * xt[indices[k, j], b] + bias[j]; lane = batch row.
template <typename T, typename TX>
__global__ void __launch_bounds__(kWarp* kWarps) forward_rows_kernel(
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
      for (int k = 0; k < kn; ++k) {  // labels innermost: eight independent loads in flight
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

// grad_xt[indices[k, j], b] += weight[k, j] * grad_out[b, j]: one warp-wide atomic add of a 128-byte
// row per connection. Labels whose gradient is zero for the whole batch chunk are skipped.
template <typename T>
__global__ void __launch_bounds__(kWarp* kWarps) backward_input_rows_kernel(
    const T* __restrict__ g, const int32_t* __restrict__ idx, const T* __restrict__ w, T* __restrict__ gxt,
    int batch, int bpad, int conn, int labels) {
  __shared__ int32_t s_idx[kWarp][kTile];
  __shared__ T s_w[kWarp][kTile];
  __shared__ T s_g[kWarp][kTile + 1];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, j0 = blockIdx.x * kTile;
  for (int c0 = 0; c0 < batch; c0 += kWarp) {
    __syncthreads();
    stage_tile(g, batch, labels, c0, j0, s_g);
    __syncthreads();
    T gv[kLabelsPerWarp];
    unsigned active = 0;  // bit i: the warp's label i has a nonzero gradient in this chunk
#pragma unroll
    for (int i = 0; i < kLabelsPerWarp; ++i) {
      gv[i] = s_g[lane][warp * kLabelsPerWarp + i];
      if (__any_sync(kAll, gv[i] != T(0))) active |= 1u << i;
    }
    if (!__syncthreads_or(active)) continue;
    for (int k0 = 0; k0 < conn; k0 += kWarp) {
      __syncthreads();
      stage_tile(idx, conn, labels, k0, j0, s_idx);
      stage_tile(w, conn, labels, k0, j0, s_w);
      __syncthreads();
      const int kn = min(kWarp, conn - k0);
#pragma unroll
      for (int i = 0; i < kLabelsPerWarp; ++i) {
        if (!(active & (1u << i))) continue;
        const int l = warp * kLabelsPerWarp + i;
        for (int k = 0; k < kn; ++k)
          if (gv[i] != T(0)) atomicAdd(gxt + static_cast<int64_t>(s_idx[k][l]) * bpad + c0 + lane, s_w[k][l] * gv[i]);
      }
    }
  }
}

// v[t] on each lane -> v[0] on lane k: the sum over lanes of v[k] (31 shuffles for 32 sums). At step S a
// lane keeps one half of its 2S values, adds its partner's copy of that half and hands over the other.
template <int S, typename T>
__device__ __forceinline__ void transpose_sum(T (&v)[kWarp]) {
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
// connections of a label, one transposing reduction leaves connection k's sum on lane k.
template <typename T, typename TX>
__global__ void __launch_bounds__(kWarp* kWarps) backward_weight_rows_kernel(
    const T* __restrict__ g, const TX* __restrict__ xt, const int32_t* __restrict__ idx, T* __restrict__ gw,
    int batch, int bpad, int conn, int labels) {
  __shared__ int32_t s_idx[kWarp][kTile];
  __shared__ T s_g[kWarp][kTile + 1];
  __shared__ T s_gw[kWarp][kTile + 1];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, j0 = blockIdx.x * kTile;
  for (int k0 = 0; k0 < conn; k0 += kWarp) {
    __syncthreads();
    stage_tile(idx, conn, labels, k0, j0, s_idx);
    const int kn = min(kWarp, conn - k0);
    T sums[kLabelsPerWarp] = {};  // lane k: connection k0 + k of each of the warp's labels
    for (int c0 = 0; c0 < batch; c0 += kWarp) {
      __syncthreads();
      stage_tile(g, batch, labels, c0, j0, s_g);
      __syncthreads();
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
#pragma unroll
    for (int i = 0; i < kLabelsPerWarp; ++i) s_gw[lane][warp * kLabelsPerWarp + i] = sums[i];
    __syncthreads();
    for (int r = warp; r < kn; r += kWarps)
      if (j0 + lane < labels) gw[static_cast<int64_t>(k0 + r) * labels + j0 + lane] = s_gw[r][lane];
  }
}

// Rows of xt padded to whole 32-byte sectors.
int64_t row_pad(int64_t batch) { return (batch + 7) / 8 * 8; }
unsigned tiles(int64_t labels) { return static_cast<unsigned>((labels + kTile - 1) / kTile); }

std::atomic<bool> use_rows{false};

}  // namespace

bool rows_kernels() { return use_rows.load(std::memory_order_relaxed); }

at::Tensor rows_forward_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias) {
  check_forward(x, indices, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), conn = indices.size(0), labels = indices.size(1);
  auto out = weight.new_empty({batch, labels});
  if (batch == 0 || labels == 0) return out;
  const int64_t bpad = row_pad(batch);
  const auto xt = transpose_padded(x, bpad);
  with_types(x, weight, [&](auto t, auto tx) {
    using T = decltype(t);
    using TX = decltype(tx);
    forward_rows_kernel<T, TX><<<tiles(labels), kWarp * kWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
        data_as<TX>(xt), indices.const_data_ptr<int32_t>(), weight.const_data_ptr<T>(),
        bias.has_value() ? bias->const_data_ptr<T>() : nullptr, out.mutable_data_ptr<T>(), batch, bpad, conn, labels);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor rows_backward_input_cuda(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& weight,
                                    int64_t in_features) {
  check_backward_input(grad_out, indices, weight);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t batch = grad_out.size(0), conn = indices.size(0), labels = indices.size(1);
  if (batch == 0 || labels == 0) return grad_out.new_zeros({batch, in_features});
  const int64_t bpad = row_pad(batch);
  auto gxt = grad_out.new_zeros({in_features, bpad});
  AT_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "rows_backward_input_cuda", [&] {
    backward_input_rows_kernel<scalar_t><<<tiles(labels), kWarp * kWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
        grad_out.const_data_ptr<scalar_t>(), indices.const_data_ptr<int32_t>(), weight.const_data_ptr<scalar_t>(),
        gxt.mutable_data_ptr<scalar_t>(), batch, bpad, conn, labels);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return gxt.narrow(1, 0, batch).t().contiguous();
}

at::Tensor rows_backward_weight_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices) {
  check_backward_weight(grad_out, x, indices);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t batch = grad_out.size(0), conn = indices.size(0), labels = indices.size(1);
  auto grad_w = grad_out.new_empty({conn, labels});
  if (batch == 0 || labels == 0) return grad_w.zero_();
  const int64_t bpad = row_pad(batch);
  const auto xt = transpose_padded(x, bpad);
  with_types(x, grad_out, [&](auto t, auto tx) {
    using T = decltype(t);
    using TX = decltype(tx);
    backward_weight_rows_kernel<T, TX><<<tiles(labels), kWarp * kWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
        grad_out.const_data_ptr<T>(), data_as<TX>(xt), indices.const_data_ptr<int32_t>(),
        grad_w.mutable_data_ptr<T>(), batch, bpad, conn, labels);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_w;
}

}  // namespace xmc_sparse

TORCH_LIBRARY_FRAGMENT(xmc_bench, m) {  // the op's own schemas (schema.h), names prefixed with "rows_"
  for (const std::string schema : xmc_sparse::kSchemas)
    if (schema.rfind("squared_hinge", 0) != 0) m.def(("rows_" + schema).c_str());
  m.def("use_rows_kernels(bool enable) -> ()", [](bool enable) { xmc_sparse::use_rows.store(enable); });
}

TORCH_LIBRARY_IMPL(xmc_bench, CUDA, m) {
  m.impl("rows_forward", &xmc_sparse::rows_forward_cuda);
  m.impl("rows_backward_input", &xmc_sparse::rows_backward_input_cuda);
  m.impl("rows_backward_weight", &xmc_sparse::rows_backward_weight_cuda);
}
