// CPU kernel of the fused squared hinge loss; the schema is defined in ../ops.cpp.
//   loss = mean over (B, L) of relu(1 - (2y - 1) s)^2, y = 1 at the flat positions in `positives`
//   grad = d loss / d scores
// Every entry is first treated as a negative (parallel, one pass), then the few positives are
// overwritten sequentially; see ../README.md for why the "already written" test counts a repeat once.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <functional>
#include <limits>
#include <tuple>

#include "../checks.h"

namespace xmc_sparse {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task

// NaN passes through (a NaN score must give a NaN loss for the non-finite loss watch).
template <typename T>
inline T relu(T v) { return v < T(0) ? T(0) : v; }

template <typename T>
double squared_hinge_cpu_kernel(const T* s, T* g, int64_t n, const int64_t* pos, int64_t npos) {
  const T two_over_n = static_cast<T>(2.0 / static_cast<double>(n));
  // at::parallel_reduce runs on OpenMP here and follows torch.set_num_threads.
  double sum = at::parallel_reduce(0, n, kGrain, 0.0, [&](int64_t lo, int64_t hi, double acc) {
    for (int64_t i = lo; i < hi; ++i) {
      const T h = relu(s[i] + T(1));
      g[i] = two_over_n * h;
      acc += static_cast<double>(h) * h;
    }
    return acc;
  }, std::plus<double>());
  for (int64_t k = 0; k < npos; ++k) {
    const int64_t p = pos[k];
    if (p < 0) continue;  // padding (the range was checked before the dispatch)
    const T x = s[p], neg = relu(x + T(1)), hinge = relu(T(1) - x);
    const T value = -two_over_n * hinge;
    // The negative gradient is >= 0, the positive one <= 0, and never both 0: equal means a repeat.
    if (g[p] == value) continue;
    g[p] = value;
    sum += static_cast<double>(hinge) * hinge - static_cast<double>(neg) * neg;
  }
  return sum / static_cast<double>(n);
}

std::tuple<at::Tensor, at::Tensor> squared_hinge_cpu(const at::Tensor& scores, const at::Tensor& positives) {
  check_squared_hinge(scores, positives);
  const int64_t n = scores.numel();
  auto grad = scores.new_empty(scores.sizes());
  if (n == 0) return {scores.new_full({}, std::numeric_limits<double>::quiet_NaN()), grad};  // mean of nothing
  const int64_t* pos = positives.const_data_ptr<int64_t>();
  // A literal message: a TORCH_CHECK that formats integers segfaulted in extensions built against the
  // torch 2.11 wheels of the GPU machine (literal and const char* messages are fine).
  for (int64_t k = 0; k < positives.numel(); ++k) {
    TORCH_CHECK(pos[k] < n, "positives hold a position beyond the scores (>= batch * labels)");
  }
  auto loss = scores.new_empty({});
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "squared_hinge_cpu", [&] {
    // Cast, not Scalar-converted: a sum beyond float's range is +inf (the non-finite loss watch stops the run),
    // where new_full would throw.
    *loss.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(squared_hinge_cpu_kernel<scalar_t>(
        scores.const_data_ptr<scalar_t>(), grad.mutable_data_ptr<scalar_t>(), n, pos, positives.numel()));
  });
  return {loss, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(xmc_sparse, CPU, m) {
  m.impl("squared_hinge", &squared_hinge_cpu);
}

}  // namespace xmc_sparse
