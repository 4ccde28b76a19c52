// Argument checks shared by the CPU and CUDA kernels of the uniform sparse op and the squared hinge loss.
// The Python wrapper gives friendlier messages; these guard direct torch.ops calls.
#pragma once
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: halves the compile time
#include <limits>
#include <optional>

namespace xmc_sparse {

inline void check_structure(const at::Tensor& indices, const at::Tensor& weight) {
  TORCH_CHECK(indices.dim() == 2, "indices must be 2-D (connectivity, out_features)");
  TORCH_CHECK(indices.scalar_type() == at::kInt, "indices must be int32");
  TORCH_CHECK(indices.is_contiguous() && weight.is_contiguous(), "indices and weight must be contiguous");
  TORCH_CHECK(weight.sizes() == indices.sizes(), "weight shape must equal indices shape");
  TORCH_CHECK(weight.device() == indices.device(), "weight and indices must be on one device");
  TORCH_CHECK(indices.numel() < std::numeric_limits<int32_t>::max(),
              "connectivity * out_features must be < 2**31");
}

inline void check_dense(const at::Tensor& t, const at::Tensor& like, const char* name, bool bf16_ok = false) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble ||
                  (bf16_ok && t.scalar_type() == at::kBFloat16),
              name, bf16_ok ? " must be float32/float64/bfloat16" : " must be float32/float64");
  TORCH_CHECK(t.device() == like.device(), name, " must be on the device of indices");
}

// x's dtype is the weight's, or bf16 with float32 weights (bf16-mixed training; the CUDA kernels only).
inline void check_input_dtype(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() ||
                  (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kFloat),
              "x dtype must equal the weight dtype, or be bfloat16 with float32 weights");
}

inline void check_forward(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  check_structure(indices, weight);
  check_dense(x, indices, "x", /*bf16_ok=*/true);
  check_input_dtype(x, weight);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == indices.size(1), "bias must have shape (out_features,)");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type() && bias->is_contiguous(),
                "bias: dtype of the weight, contiguous");
    TORCH_CHECK(bias->device() == x.device(), "bias must be on the device of x");
  }
}

inline void check_grad(const at::Tensor& grad_out, const at::Tensor& indices) {
  check_dense(grad_out, indices, "grad_out");
  TORCH_CHECK(grad_out.size(1) == indices.size(1), "grad_out must have out_features columns");
}

inline void check_backward_input(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& weight) {
  check_structure(indices, weight);
  check_grad(grad_out, indices);
  TORCH_CHECK(weight.scalar_type() == grad_out.scalar_type(), "weight dtype must equal grad_out dtype");
}

inline void check_backward_weight(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices) {
  check_grad(grad_out, indices);
  check_dense(x, indices, "x", /*bf16_ok=*/true);
  TORCH_CHECK(indices.dim() == 2 && indices.scalar_type() == at::kInt && indices.is_contiguous(),
              "indices must be contiguous int32 (connectivity, out_features)");
  TORCH_CHECK(x.size(0) == grad_out.size(0), "x and grad_out must share the batch size");
  check_input_dtype(x, grad_out);
}

// squared_hinge: scores (B, L) float, positives flat int64 positions into scores (< 0: padding).
inline void check_squared_hinge(const at::Tensor& scores, const at::Tensor& positives) {
  TORCH_CHECK(scores.dim() == 2, "scores must be 2-D (batch, labels)");
  TORCH_CHECK(scores.is_contiguous(), "scores must be contiguous");
  TORCH_CHECK(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble,
              "scores must be float32/float64");
  TORCH_CHECK(positives.dim() == 1 && positives.scalar_type() == at::kLong && positives.is_contiguous(),
              "positives must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(positives.device() == scores.device(), "positives must be on the device of scores");
}

}  // namespace xmc_sparse
