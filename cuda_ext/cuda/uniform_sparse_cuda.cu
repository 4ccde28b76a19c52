// Host side of the uniform sparse op's CUDA kernels (uniform_sparse_kernels.cuh): argument checks, the
// transposed inputs, the batch-chunk width, the launches, and the hand-over to the warp-per-label
// kernels (or their vec variants) in the phases XMC_SPARSE_KERNELS names (uniform_sparse_rows_cuda.cu; by default
// forward and input backward on the warp-per-label ones).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "uniform_sparse_common.cuh"
#include "uniform_sparse_kernels.cuh"

namespace xmc_sparse {
namespace {

using namespace threads;

at::Tensor forward_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  if (chosen(kVecForward)) return rows_forward_vec_cuda(x, indices, weight, bias);
  if (chosen(kRowsForward)) return rows_forward_cuda(x, indices, weight, bias);
  check_forward(x, indices, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), conn = indices.size(0), labels = indices.size(1);
  auto out = weight.new_empty({batch, labels});
  if (batch == 0) return out;
  const int v = pick_v(batch);
  const int64_t bpad = padded(batch, v);
  const auto xt = transpose_padded(x, bpad);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  with_types(x, weight, [&](auto t, auto tx) {
    using T = decltype(t);
    using TX = decltype(tx);
    with_v(v, [&](auto vc) {
      forward_kernel<T, TX, decltype(vc)::value><<<blocks_for(labels), kThreads, 0, stream>>>(
          data_as<TX>(xt), indices.const_data_ptr<int32_t>(), weight.const_data_ptr<T>(),
          bias.has_value() ? bias->const_data_ptr<T>() : nullptr, out.mutable_data_ptr<T>(), batch, bpad, conn,
          labels);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

at::Tensor backward_input_cuda(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& weight,
                               int64_t in_features) {
  if (chosen(kVecBackwardInput)) return rows_backward_input_vec_cuda(grad_out, indices, weight, in_features);
  if (chosen(kRowsBackwardInput)) return rows_backward_input_cuda(grad_out, indices, weight, in_features);
  check_backward_input(grad_out, indices, weight);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t batch = grad_out.size(0), conn = indices.size(0), labels = indices.size(1);
  if (batch == 0) return grad_out.new_zeros({batch, in_features});
  const int v = pick_v(batch);
  const int64_t bpad = padded(batch, v);
  auto gxt = grad_out.new_zeros({in_features, bpad});
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "uniform_sparse_backward_input_cuda", [&] {
    with_v(v, [&](auto vc) {
      backward_input_kernel<scalar_t, decltype(vc)::value><<<blocks_for(labels), kThreads, 0, stream>>>(
          grad_out.const_data_ptr<scalar_t>(), indices.const_data_ptr<int32_t>(), weight.const_data_ptr<scalar_t>(),
          gxt.mutable_data_ptr<scalar_t>(), batch, bpad, conn, labels);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return gxt.narrow(1, 0, batch).t().contiguous();
}

std::tuple<at::Tensor, at::Tensor> backward_weight_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                        const at::Tensor& indices) {
  if (chosen(kVecBackwardWeight)) return rows_backward_weight_vec_cuda(grad_out, x, indices);
  if (chosen(kRowsBackwardWeight)) return rows_backward_weight_cuda(grad_out, x, indices);
  check_backward_weight(grad_out, x, indices);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t batch = grad_out.size(0), conn = indices.size(0), labels = indices.size(1);
  auto grad_w = grad_out.new_empty({conn, labels});
  auto grad_b = grad_out.new_empty({labels});
  if (batch == 0) return {grad_w.zero_(), grad_b.zero_()};
  const int v = pick_v(batch);
  const int64_t bpad = padded(batch, v);
  const auto xt = transpose_padded(x, bpad);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  with_types(x, grad_out, [&](auto t, auto tx) {
    using T = decltype(t);
    using TX = decltype(tx);
    with_v(v, [&](auto vc) {
      backward_weight_kernel<T, TX, decltype(vc)::value><<<blocks_for(labels), kThreads, 0, stream>>>(
          grad_out.const_data_ptr<T>(), data_as<TX>(xt), indices.const_data_ptr<int32_t>(),
          grad_w.mutable_data_ptr<T>(), grad_b.mutable_data_ptr<T>(), batch, bpad, conn, labels);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {grad_w, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(xmc_sparse, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("backward_input", &backward_input_cuda);
  m.impl("backward_weight", &backward_weight_cuda);
}

}  // namespace xmc_sparse
