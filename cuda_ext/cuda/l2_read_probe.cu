// A benchmark kernel, not part of the sparse op: the read bandwidth of data that stays in L2, the
// ceiling of the uniform forward's gathers (xmc_repro.bench reports the layer's time as a multiple
// of it). Registered as xmc_bench::l2_read(Tensor buffer, int passes) -> Tensor.
//
// Every block reads the whole float32 buffer `passes` times with 16-byte loads that bypass L1
// (ld.global.cg): after the first touch every load is served by L2 (a buffer well under L2's
// size). Blocks start at evenly spread offsets, one block further each pass, so they do not read
// the same lines at the same time. The result is (blocks, threads): each thread's sum of what it
// read (the loads are not dead code, and a caller can check the total). Bytes read = passes *
// buffer bytes * blocks.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

namespace xmc_bench {
namespace {

constexpr int kThreads = 256;

__global__ void l2_read_kernel(const float4* __restrict__ buffer, int64_t n4, int passes,
                               float* __restrict__ out) {
  float acc = 0.f;
  for (int p = 0; p < passes; ++p) {
    const int64_t shift = ((blockIdx.x + p) % gridDim.x) * (n4 / gridDim.x);
    for (int64_t i = threadIdx.x; i < n4; i += kThreads) {
      int64_t j = i + shift;
      if (j >= n4) j -= n4;
      const float4 v = __ldcg(buffer + j);
      acc += (v.x + v.y) + (v.z + v.w);
    }
  }
  out[static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}

at::Tensor l2_read_cuda(const at::Tensor& buffer, int64_t passes) {
  TORCH_CHECK(buffer.is_cuda() && buffer.scalar_type() == at::kFloat && buffer.is_contiguous(),
              "l2_read: buffer must be a contiguous float32 CUDA tensor");
  TORCH_CHECK(buffer.numel() % 4 == 0 && buffer.numel() > 0, "l2_read: buffer length must be a positive multiple of 4");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buffer.data_ptr()) % 16 == 0, "l2_read: buffer must be 16-byte aligned");
  TORCH_CHECK(passes > 0, "l2_read: passes must be positive");
  const c10::cuda::CUDAGuard guard(buffer.device());
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, buffer.get_device()));
  const int blocks = sms * 4;
  auto out = buffer.new_empty({static_cast<int64_t>(blocks), static_cast<int64_t>(kThreads)});
  l2_read_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const float4*>(buffer.data_ptr<float>()), buffer.numel() / 4,
      static_cast<int>(passes), out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace xmc_bench

TORCH_LIBRARY(xmc_bench, m) { m.def("l2_read(Tensor buffer, int passes) -> Tensor"); }

TORCH_LIBRARY_IMPL(xmc_bench, CUDA, m) { m.impl("l2_read", &xmc_bench::l2_read_cuda); }
