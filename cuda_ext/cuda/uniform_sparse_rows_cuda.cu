// Host side of the warp-per-label kernels (uniform_sparse_rows_kernels.cuh), measured against the
// thread-per-label kernels (uniform_sparse_cuda.cu) by xmc_repro.bench (methods `uniform-rows` and
// `uniform-rows-bf16`). Registered as xmc_bench::rows_forward / rows_backward_input / rows_backward_weight,
// with the schemas of xmc_sparse::forward / backward_input / backward_weight (and the benchmark's variants
// rows_forward_unroll2/4, rows_forward_vec, rows_backward_input_vec and rows_backward_weight_vec); the op runs them
// in the phases of xmc_bench::use_rows_kernels(mask), which xmc_repro.sparse.op sets from XMC_SPARSE_KERNELS (unset:
// forward and input backward; the vec variants only when named, vec:<phases>).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "../checks.h"
#include "../schema.h"
#include "uniform_sparse_common.cuh"
#include "uniform_sparse_rows_kernels.cuh"

namespace xmc_sparse {
namespace {

std::atomic<int> kernel_choices{0};  // KernelChoice bits

}  // namespace

bool chosen(KernelChoice bit) { return (kernel_choices.load(std::memory_order_relaxed) & bit) != 0; }

// The forward's variants for the benchmark: Unroll connections' gathers in flight, or (Unroll = 0) 8 lanes per
// label with 4 batch rows each (forward_vec_kernel).
template <int Unroll>
at::Tensor rows_forward_unrolled(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias) {
  check_forward(x, indices, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), conn = indices.size(0), labels = indices.size(1);
  auto out = weight.new_empty({batch, labels});
  if (batch == 0 || labels == 0) return out;
  const int64_t bpad = rows::row_pad(batch);
  const auto xt = transpose_padded(x, bpad);
  with_types(x, weight, [&](auto t, auto tx) {
    using T = decltype(t);
    using TX = decltype(tx);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const auto kernel =
        Unroll == 0 ? rows::forward_vec_kernel<T, TX> : rows::forward_kernel<T, TX, Unroll ? Unroll : 1>;
    kernel<<<rows::tiles(labels), rows::kThreads, 0, stream>>>(
        data_as<TX>(xt), indices.const_data_ptr<int32_t>(), weight.const_data_ptr<T>(),
        bias.has_value() ? bias->const_data_ptr<T>() : nullptr, out.mutable_data_ptr<T>(), batch, bpad, conn, labels);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor rows_forward_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias) {
  return rows_forward_unrolled<1>(x, indices, weight, bias);
}

at::Tensor rows_forward_vec_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias) {
  return rows_forward_unrolled<0>(x, indices, weight, bias);
}

// Vec: backward_input_vec_kernel (xmc_bench::rows_backward_input_vec).
template <bool Vec>
at::Tensor rows_backward_input(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& weight,
                               int64_t in_features) {
  check_backward_input(grad_out, indices, weight);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t batch = grad_out.size(0), conn = indices.size(0), labels = indices.size(1);
  if (batch == 0 || labels == 0) return grad_out.new_zeros({batch, in_features});
  const int64_t bpad = rows::row_pad(batch);
  auto gxt = grad_out.new_zeros({in_features, bpad});
  AT_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "rows_backward_input_cuda", [&] {
    const auto kernel = Vec ? rows::backward_input_vec_kernel<scalar_t> : rows::backward_input_kernel<scalar_t>;
    kernel<<<rows::tiles(labels), rows::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        grad_out.const_data_ptr<scalar_t>(), indices.const_data_ptr<int32_t>(), weight.const_data_ptr<scalar_t>(),
        gxt.mutable_data_ptr<scalar_t>(), batch, bpad, conn, labels);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return gxt.narrow(1, 0, batch).t().contiguous();
}

at::Tensor rows_backward_input_cuda(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& weight,
                                    int64_t in_features) {
  return rows_backward_input<false>(grad_out, indices, weight, in_features);
}

at::Tensor rows_backward_input_vec_cuda(const at::Tensor& grad_out, const at::Tensor& indices,
                                        const at::Tensor& weight, int64_t in_features) {
  return rows_backward_input<true>(grad_out, indices, weight, in_features);
}

// Vec: backward_weight_vec_kernel (the benchmark's xmc_bench::rows_backward_weight_vec).
template <bool Vec>
std::tuple<at::Tensor, at::Tensor> rows_backward_weight(const at::Tensor& grad_out, const at::Tensor& x,
                                                        const at::Tensor& indices) {
  check_backward_weight(grad_out, x, indices);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t batch = grad_out.size(0), conn = indices.size(0), labels = indices.size(1);
  auto grad_w = grad_out.new_empty({conn, labels});
  if (batch == 0 || labels == 0 || conn == 0) return {grad_w.zero_(), grad_out.sum(0)};
  auto grad_b = grad_out.new_empty({labels});
  const int64_t bpad = rows::row_pad(batch);
  const auto xt = transpose_padded(x, bpad);
  with_types(x, grad_out, [&](auto t, auto tx) {
    using T = decltype(t);
    using TX = decltype(tx);
    const auto kernel = Vec ? rows::backward_weight_vec_kernel<T, TX> : rows::backward_weight_kernel<T, TX>;
    kernel<<<rows::tiles(labels), rows::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        grad_out.const_data_ptr<T>(), data_as<TX>(xt), indices.const_data_ptr<int32_t>(),
        grad_w.mutable_data_ptr<T>(), grad_b.mutable_data_ptr<T>(), batch, bpad, conn, labels);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {grad_w, grad_b};
}

std::tuple<at::Tensor, at::Tensor> rows_backward_weight_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                             const at::Tensor& indices) {
  return rows_backward_weight<false>(grad_out, x, indices);
}

std::tuple<at::Tensor, at::Tensor> rows_backward_weight_vec_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                                 const at::Tensor& indices) {
  return rows_backward_weight<true>(grad_out, x, indices);
}

}  // namespace xmc_sparse

TORCH_LIBRARY_FRAGMENT(xmc_bench, m) {  // the op's own schemas (schema.h), names prefixed with "rows_"
  for (const std::string schema : xmc_sparse::kSchemas) {
    if (schema.rfind("squared_hinge", 0) == 0) continue;
    m.def(("rows_" + schema).c_str());
    if (schema.rfind("forward", 0) == 0)  // the forward's variants, for the benchmark
      for (const std::string variant : {"_unroll2", "_unroll4", "_vec"})
        m.def(("rows_forward" + variant + schema.substr(7)).c_str());
    if (schema.rfind("backward_input", 0) == 0) m.def(("rows_backward_input_vec" + schema.substr(14)).c_str());
    if (schema.rfind("backward_weight", 0) == 0) m.def(("rows_backward_weight_vec" + schema.substr(15)).c_str());
  }
  m.def("use_rows_kernels(int phases) -> ()", [](int64_t phases) {
    TORCH_CHECK(phases >= 0 && phases <= xmc_sparse::kAllKernelChoices, "use_rows_kernels: a mask of rows forward "
                "(1), backward_input (2), backward_weight (4), vec forward (8), backward_weight (16), backward_input "
                "(32), got ", phases);
    xmc_sparse::kernel_choices.store(static_cast<int>(phases));
  });
}

TORCH_LIBRARY_IMPL(xmc_bench, CUDA, m) {
  m.impl("rows_forward", &xmc_sparse::rows_forward_cuda);
  m.impl("rows_forward_unroll2", &xmc_sparse::rows_forward_unrolled<2>);
  m.impl("rows_forward_unroll4", &xmc_sparse::rows_forward_unrolled<4>);
  m.impl("rows_forward_vec", &xmc_sparse::rows_forward_vec_cuda);
  m.impl("rows_backward_input", &xmc_sparse::rows_backward_input_cuda);
  m.impl("rows_backward_input_vec", &xmc_sparse::rows_backward_input_vec_cuda);
  m.impl("rows_backward_weight", &xmc_sparse::rows_backward_weight_cuda);
  m.impl("rows_backward_weight_vec", &xmc_sparse::rows_backward_weight_vec_cuda);
}
