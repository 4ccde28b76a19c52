// The warp-per-label CUDA kernels (cuda_ext/cuda/uniform_sparse_rows_kernels.cuh) run on a CPU through
// simt.h, with the host steps of cuda_ext/cuda/uniform_sparse_rows_cuda.cu (transposed, padded inputs; the
// transposed input gradient). tests/test_rows_kernels.py writes a problem, runs this and compares with the
// reference.
//
//   rows_kernels PROBLEM RESULT
// PROBLEM: int64 header {x kind (0 float32, 1 float64, 2 bf16 with float32 weights), batch, inputs, labels,
// connectivity, has bias}, then x (batch, inputs), indices int32 (connectivity, labels), weight, bias if any,
// grad_out (batch, labels), contiguous. RESULT: forward (batch, labels), grad_x (batch, inputs),
// grad_w (connectivity, labels), in the weights' type.
#include "simt.h"  // first: CUDA's keywords for the kernels

#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "uniform_sparse_rows_kernels.cuh"

namespace {

using namespace xmc_sparse;

struct Reader {
  std::vector<char> bytes;
  size_t at = 0;
  template <typename T>
  std::vector<T> take(int64_t n) {
    std::vector<T> out(n);
    if (at + n * sizeof(T) > bytes.size()) throw std::runtime_error("problem file too short");
    std::memcpy(out.data(), bytes.data() + at, n * sizeof(T));
    at += n * sizeof(T);
    return out;
  }
};

template <typename T>
void append(std::ofstream& out, const std::vector<T>& v) {
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

// T: weights and results; TX: inputs (T, or Bf16 with float weights).
template <typename T, typename TX>
void run(Reader& in, const int64_t* h, std::ofstream& out) {
  const int64_t batch = h[1], inputs = h[2], labels = h[3], conn = h[4];
  const auto x = in.take<TX>(batch * inputs);
  const auto idx = in.take<int32_t>(conn * labels);
  const auto w = in.take<T>(conn * labels);
  const auto bias = in.take<T>(h[5] ? labels : 0);
  const auto g = in.take<T>(batch * labels);
  const int64_t bpad = rows::row_pad(batch);
  std::vector<TX> xt(inputs * bpad, TX{});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < inputs; ++i) xt[i * bpad + b] = x[b * inputs + i];
  const int B = static_cast<int>(batch), P = static_cast<int>(bpad), C = static_cast<int>(conn),
            L = static_cast<int>(labels);

  std::vector<T> scores(batch * labels), gxt(inputs * bpad, T(0)), grad_x(batch * inputs), grad_w(conn * labels);
  simt::launch(rows::tiles(labels), rows::kThreads, [&] {
    rows::forward_kernel<T, TX>(xt.data(), idx.data(), w.data(), h[5] ? bias.data() : nullptr, scores.data(), B, P,
                                C, L);
  });
  simt::launch(rows::tiles(labels), rows::kThreads,
               [&] { rows::backward_input_kernel<T>(g.data(), idx.data(), w.data(), gxt.data(), B, P, C, L); });
  simt::launch(rows::tiles(labels), rows::kThreads,
               [&] { rows::backward_weight_kernel<T, TX>(g.data(), xt.data(), idx.data(), grad_w.data(), B, P, C, L); });
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < inputs; ++i) grad_x[b * inputs + i] = gxt[i * bpad + b];
  append(out, scores);
  append(out, grad_x);
  append(out, grad_w);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s PROBLEM RESULT\n", argv[0]);
    return 2;
  }
  std::ifstream file(argv[1], std::ios::binary);
  Reader in{std::vector<char>(std::istreambuf_iterator<char>(file), {})};
  const auto header = in.take<int64_t>(6);
  std::ofstream out(argv[2], std::ios::binary);
  switch (header[0]) {
    case 0: run<float, float>(in, header.data(), out); break;
    case 1: run<double, double>(in, header.data(), out); break;
    case 2: run<float, Bf16>(in, header.data(), out); break;
    default: std::fprintf(stderr, "unknown x kind %lld\n", static_cast<long long>(header[0])); return 2;
  }
  return 0;
}
