// The op's schema, written once. ops.cpp defines the ops from this list (TORCH_LIBRARY); when no
// compiled library loads, xmc_repro/sparse/op.py reads the same quoted strings from this file.
// Keep one schema per line, each a plain string literal.
#pragma once

namespace xmc_sparse {

inline constexpr const char* kSchemas[] = {
    "forward(Tensor x, Tensor indices, Tensor weight, Tensor? bias) -> Tensor",
    "backward_input(Tensor grad_out, Tensor indices, Tensor weight, SymInt in_features) -> Tensor",
    "backward_weight(Tensor grad_out, Tensor x, Tensor indices) -> (Tensor, Tensor)",
    "squared_hinge(Tensor scores, Tensor positives) -> (Tensor, Tensor)",
};

}  // namespace xmc_sparse
