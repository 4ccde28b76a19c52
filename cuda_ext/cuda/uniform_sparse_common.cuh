// What the CUDA kernels of the uniform sparse op (uniform_sparse_cuda.cu) and their warp-per-label
// candidates (uniform_sparse_rows_cuda.cu) share: the bf16 input type, the vector loads and atomics, the transposed
// inputs, the dtype dispatch, and the switch that makes the op run the candidates.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

namespace xmc_sparse {

// A bf16 input value as stored (its upper 16 bits are the float32's).
struct Bf16 {
  uint16_t bits;
};

// Four consecutive inputs, converted to the accumulation type, in one or two vector loads (device code, for the
// thread- and the warp-per-label kernels; p aligned to 4 values: see transpose_padded).
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 q = __ldg(reinterpret_cast<const float4*>(p));
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
__device__ __forceinline__ void load4(const double* p, double (&v)[4]) {
  const double2 a = __ldg(reinterpret_cast<const double2*>(p));
  const double2 b = __ldg(reinterpret_cast<const double2*>(p) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}
__device__ __forceinline__ void load4(const Bf16* p, float (&v)[4]) {
  const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));  // little endian: the first value is the low half
  v[0] = __uint_as_float(q.x << 16); v[1] = __uint_as_float(q.x & 0xffff0000u);
  v[2] = __uint_as_float(q.y << 16); v[3] = __uint_as_float(q.y & 0xffff0000u);
}

// p[0..3] += v[0..3] atomically (device code, for the input backward kernels; p aligned to 4 values): a zero value
// is skipped, so a lane with 4 zeros issues nothing; on sm_90+ a float lane with 2 or more nonzero values issues one
// 16-byte vector atomic instead of a scalar one per value.
// tests/cuda_on_cpu/simt.h emulates that atomic and defines XMC_SIMT_VECTOR_ATOMICS, so the sm_90 path runs there.
template <typename T>
__device__ __forceinline__ void atomic_add4(T* p, const T (&v)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (v[i] != T(0)) atomicAdd(p + i, v[i]);
}
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900) || defined(XMC_SIMT_VECTOR_ATOMICS)
template <>
__device__ __forceinline__ void atomic_add4<float>(float* p, const float (&v)[4]) {
  const int nonzero = (v[0] != 0.f) + (v[1] != 0.f) + (v[2] != 0.f) + (v[3] != 0.f);
  if (nonzero >= 2) {
    atomicAdd(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (v[i] != 0.f) atomicAdd(p + i, v[i]);
  }
}
#endif

// x (batch, in) -> xt (in, bpad), rows beyond batch zero: one connection's inputs for the whole batch
// are one contiguous row. Its data are 16-byte aligned, so with bpad a multiple of 4 every 4 values from a
// multiple of 4 are one load4: a view of x is returned only then (x.t() is contiguous when in == 1 or x is
// itself a transposed tensor, and a view may start anywhere).
inline at::Tensor transpose_padded(const at::Tensor& x, int64_t bpad) {
  if (bpad == x.size(0)) {
    auto xt = x.t().contiguous();
    if (reinterpret_cast<uintptr_t>(xt.const_data_ptr()) % 16 == 0) return xt;
  }
  auto xt = x.new_zeros({x.size(1), bpad});
  xt.narrow(1, 0, x.size(0)).copy_(x.t());
  return xt;
}

// f(T{}, TX{}): the accumulation/weight type and the input type (bf16 inputs only with float32 weights).
template <typename F>
void with_types(const at::Tensor& x, const at::Tensor& weight, F&& f) {
  AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "uniform_sparse_cuda", [&] {
    if (x.scalar_type() == at::kBFloat16) {
      if constexpr (std::is_same_v<scalar_t, float>) f(float{}, Bf16{});
    } else {
      f(scalar_t{}, scalar_t{});
    }
  });
}

template <typename TX>
const TX* data_as(const at::Tensor& t) {
  return reinterpret_cast<const TX*>(t.const_data_ptr());
}

// The warp-per-label kernels, and which of the op's three CUDA kernels hand over to them: a mask of the bits
// below, set by xmc_bench::use_rows_kernels, which xmc_repro/sparse/op.py calls for XMC_SPARSE_KERNELS (rows:<phases>,
// vec:<phases>; KERNEL_BITS there). A phase with both its rows and its vec bit runs vec.
enum KernelChoice : int {
  kRowsForward = 1,
  kRowsBackwardInput = 2,
  kRowsBackwardWeight = 4,
  kVecForward = 8,  // 8 lanes per label, 4 batch rows per lane (forward_vec_kernel)
  kVecBackwardWeight = 16,
  kVecBackwardInput = 32,
};
constexpr int kAllKernelChoices = 63;
bool chosen(KernelChoice bit);
at::Tensor rows_forward_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias);
at::Tensor rows_forward_vec_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias);
at::Tensor rows_backward_input_cuda(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& weight,
                                    int64_t in_features);
at::Tensor rows_backward_input_vec_cuda(const at::Tensor& grad_out, const at::Tensor& indices,
                                        const at::Tensor& weight, int64_t in_features);
std::tuple<at::Tensor, at::Tensor> rows_backward_weight_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                             const at::Tensor& indices);
std::tuple<at::Tensor, at::Tensor> rows_backward_weight_vec_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                                 const at::Tensor& indices);

}  // namespace xmc_sparse
