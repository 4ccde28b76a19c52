// Host side of the fused squared hinge loss's CUDA kernels (squared_hinge_kernels.cuh): three launches, no
// host sync, capturable in a CUDA graph.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "../checks.h"
#include "squared_hinge_kernels.cuh"

namespace xmc_sparse {
namespace {

using namespace hinge;

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
