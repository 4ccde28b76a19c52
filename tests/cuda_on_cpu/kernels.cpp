// The project's CUDA kernels, run on a CPU through simt.h: the uniform op's own (thread per label,
// cuda_ext/cuda/uniform_sparse_kernels.cuh), its warp-per-label candidates (uniform_sparse_rows_kernels.cuh)
// and the fused squared hinge loss (squared_hinge_kernels.cuh), with the host steps of their launchers
// (transposed, padded inputs; the transposed input gradient; the loss's grid and paths).
// tests/test_cuda_kernels_on_cpu.py writes a problem, runs this and compares with the reference.
//
//   kernels threads|rows|rows-unroll2|rows-unroll4|rows-vec|rows-dense|rows-sparse|rows-vec-dense|rows-vec-sparse
//           PROBLEM RESULT
// (rows-vec: the vector kernels of the benchmark, uniform-rows-vec, in every phase; -dense and -sparse force the
// input backward's way on every tile.) Prints the count of vector atomics (sm_90's atomicAdd(float4*)) to stderr.
// PROBLEM: int64 header {x kind (0 float32, 1 float64, 2 bf16 with float32 weights), batch, inputs, labels,
// connectivity, has bias}, then x (batch, inputs), indices int32 (connectivity, labels), weight, bias if any,
// grad_out (batch, labels), contiguous. RESULT: forward (batch, labels), grad_x (batch, inputs),
// grad_w (connectivity, labels), grad_b (labels), in the weights' type.
//
//   kernels hinge PROBLEM RESULT
// The fused squared hinge loss (cuda_ext/cuda/squared_hinge_kernels.cuh), both paths of its negatives kernel.
// PROBLEM: int64 header {kind (0 float32, 1 float64), entries, positives, most blocks}, then the scores and the
// int64 positions. RESULT: loss and gradient with 16-byte packs, then loss and gradient one value at a time.
#include "simt.h"  // first: CUDA's keywords for the kernels

#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>

#include "squared_hinge_kernels.cuh"
#include "uniform_sparse_kernels.cuh"
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
    if (n > 0) std::memcpy(out.data(), bytes.data() + at, n * sizeof(T));  // no bias: out.data() may be null
    at += n * sizeof(T);
    return out;
  }
};

template <typename T>
void append(std::ofstream& out, const std::vector<T>& v) {
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

// One problem's arrays, the transposed inputs (xt, bpad columns) and the results.
template <typename T, typename TX>
struct Problem {
  Problem(Reader& in, const int64_t* h, int64_t pad)
      : batch(h[1]), inputs(h[2]), labels(h[3]), conn(h[4]), bpad(pad), x(in.take<TX>(batch * inputs)),
        idx(in.take<int32_t>(conn * labels)), w(in.take<T>(conn * labels)), bias(in.take<T>(h[5] ? labels : 0)),
        g(in.take<T>(batch * labels)), xt(inputs * bpad, TX{}), scores(batch * labels), gxt(inputs * bpad, T(0)),
        grad_w(conn * labels), grad_b(labels) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < inputs; ++i) xt[i * bpad + b] = x[b * inputs + i];
  }
  const T* bias_or_null() const { return bias.empty() ? nullptr : bias.data(); }
  void write(std::ofstream& out) const {
    std::vector<T> grad_x(batch * inputs);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < inputs; ++i) grad_x[b * inputs + i] = gxt[i * bpad + b];
    append(out, scores);
    append(out, grad_x);
    append(out, grad_w);
    append(out, grad_b);
  }
  int64_t batch, inputs, labels, conn, bpad;
  std::vector<TX> x;
  std::vector<int32_t> idx;
  std::vector<T> w, bias, g;
  std::vector<TX> xt;
  std::vector<T> scores, gxt, grad_w, grad_b;
};

template <typename T, typename TX>
void run_threads(Reader& in, const int64_t* h, std::ofstream& out) {
  const int v = threads::pick_v(h[1]);
  Problem<T, TX> p(in, h, threads::padded(h[1], v));
  const int B = p.batch, P = p.bpad, C = p.conn, L = p.labels;
  threads::with_v(v, [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    const unsigned grid = threads::blocks_for(p.labels);
    simt::launch(grid, threads::kThreads, [&] {
      threads::forward_kernel<T, TX, V>(p.xt.data(), p.idx.data(), p.w.data(), p.bias_or_null(), p.scores.data(), B,
                                        P, C, L);
    });
    simt::launch(grid, threads::kThreads, [&] {
      threads::backward_input_kernel<T, V>(p.g.data(), p.idx.data(), p.w.data(), p.gxt.data(), B, P, C, L);
    });
    simt::launch(grid, threads::kThreads, [&] {
      threads::backward_weight_kernel<T, TX, V>(p.g.data(), p.xt.data(), p.idx.data(), p.grad_w.data(),
                                                p.grad_b.data(), B, P, C, L);
    });
  });
  p.write(out);
}

// Unroll = 0: the vector kernels (forward_vec_kernel, backward_input_vec_kernel, backward_weight_vec_kernel).
template <typename T, typename TX, int Unroll, int SparseRows = rows::kSparseRowsPerLabel>
void run_rows(Reader& in, const int64_t* h, std::ofstream& out) {
  Problem<T, TX> p(in, h, rows::row_pad(h[1]));
  const int B = p.batch, P = p.bpad, C = p.conn, L = p.labels;
  const unsigned grid = rows::tiles(p.labels);
  simt::launch(grid, rows::kThreads, [&] {
    const auto forward =
        Unroll == 0 ? rows::forward_vec_kernel<T, TX> : rows::forward_kernel<T, TX, Unroll ? Unroll : 1>;
    forward(p.xt.data(), p.idx.data(), p.w.data(), p.bias_or_null(), p.scores.data(), B, P, C, L);
  });
  simt::launch(grid, rows::kThreads, [&] {
    const auto input =
        Unroll == 0 ? rows::backward_input_vec_kernel<T, SparseRows> : rows::backward_input_kernel<T, SparseRows>;
    input(p.g.data(), p.idx.data(), p.w.data(), p.gxt.data(), B, P, C, L);
  });
  simt::launch(grid, rows::kThreads, [&] {
    const auto weight = Unroll == 0 ? rows::backward_weight_vec_kernel<T, TX> : rows::backward_weight_kernel<T, TX>;
    weight(p.g.data(), p.xt.data(), p.idx.data(), p.grad_w.data(), p.grad_b.data(), B, P, C, L);
  });
  p.write(out);
}

template <typename T, typename TX>
void run(const std::string& family, Reader& in, const int64_t* h, std::ofstream& out) {
  if (family == "rows") {
    run_rows<T, TX, 1>(in, h, out);
  } else if (family == "rows-unroll2") {  // the benchmark's forward variants (xmc_bench::rows_forward_unroll2/4)
    run_rows<T, TX, 2>(in, h, out);
  } else if (family == "rows-unroll4") {
    run_rows<T, TX, 4>(in, h, out);
  } else if (family == "rows-vec") {  // and xmc_bench::rows_forward_vec, rows_backward_input_vec, ..._weight_vec
    run_rows<T, TX, 0>(in, h, out);
  } else if (family == "rows-vec-dense") {
    run_rows<T, TX, 0, 0>(in, h, out);
  } else if (family == "rows-vec-sparse") {
    run_rows<T, TX, 0, 32>(in, h, out);
  } else if (family == "rows-dense") {  // the input backward's two ways, each forced on every tile
    run_rows<T, TX, 1, 0>(in, h, out);
  } else if (family == "rows-sparse") {
    run_rows<T, TX, 1, 32>(in, h, out);
  } else if (family == "threads") {
    run_threads<T, TX>(in, h, out);
  } else {
    throw std::runtime_error("kernel family must be threads, rows, rows-unroll2, rows-unroll4, rows-vec, rows-dense, "
                             "rows-sparse, rows-vec-dense or rows-vec-sparse, not " + family);
  }
}

// The launches of squared_hinge_cuda, with at most `cap` blocks for the negatives (the grid-stride loop); the
// positives get a thread each, as there.
template <typename T, int V>
void run_hinge_path(const std::vector<T>& scores, const std::vector<int64_t>& pos, int64_t cap, std::ofstream& out) {
  const int64_t n = scores.size(), npos = pos.size();
  std::vector<T> loss(1, T(0)), grad(n);
  const T two_over_n = static_cast<T>(2.0 / n), inv_n = static_cast<T>(1.0 / n);
  simt::launch(hinge::blocks_for(n / V, cap), hinge::kThreads, [&] {
    hinge::negatives_kernel<T, V>(scores.data(), grad.data(), n, two_over_n, inv_n, loss.data());
  });
  if (npos > 0)
    simt::launch(hinge::blocks_for(npos, std::numeric_limits<int32_t>::max()), hinge::kThreads, [&] {  // as the host
      hinge::positives_kernel<T>(scores.data(), grad.data(), pos.data(), npos, n, two_over_n, inv_n, loss.data());
    });
  append(out, loss);
  append(out, grad);
}

template <typename T>
void run_hinge(Reader& in, const int64_t* h, std::ofstream& out) {
  const auto scores = in.take<T>(h[1]);
  const auto pos = in.take<int64_t>(h[2]);
  run_hinge_path<T, 16 / sizeof(T)>(scores, pos, h[3], out);
  run_hinge_path<T, 1>(scores, pos, h[3], out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s threads|rows|rows-unroll2|rows-unroll4|rows-vec|rows-dense|rows-sparse|"
                 "rows-vec-dense|rows-vec-sparse|hinge PROBLEM RESULT\n", argv[0]);
    return 2;
  }
  std::ifstream file(argv[2], std::ios::binary);
  Reader in{std::vector<char>(std::istreambuf_iterator<char>(file), {})};
  std::ofstream out(argv[3], std::ios::binary);
  if (std::string(argv[1]) == "hinge") {
    const auto header = in.take<int64_t>(4);
    if (header[0] == 0) run_hinge<float>(in, header.data(), out);
    else run_hinge<double>(in, header.data(), out);
    return 0;
  }
  const auto header = in.take<int64_t>(6);
  switch (header[0]) {
    case 0: run<float, float>(argv[1], in, header.data(), out); break;
    case 1: run<double, double>(argv[1], in, header.data(), out); break;
    case 2: run<float, Bf16>(argv[1], in, header.data(), out); break;
    default: std::fprintf(stderr, "unknown x kind %lld\n", static_cast<long long>(header[0])); return 2;
  }
  std::fprintf(stderr, "vector atomics: %ld\n", simt::vector_atomics.load());
  return 0;
}
