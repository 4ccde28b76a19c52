// The part of CUDA's kernel language the sparse op's kernels use, on a CPU, for tests on machines without
// a GPU: every CUDA thread of a block is a std::thread, warp intrinsics and __syncthreads are barriers
// over the warp's or the block's threads, and blocks run one after another, so a function-level static
// serves as the block's shared memory. Slow (a barrier per shuffle) but exact: the kernels' own source
// runs, with their indexing, tiling, synchronisation and atomics.
#pragma once
#include <c10/macros/Macros.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cassert>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct SimtIndex {
  unsigned x = 0;
};
inline thread_local SimtIndex threadIdx, blockIdx;
inline SimtIndex gridDim;  // set by simt::launch

// CUDA's vector types the kernels load through (each alignas its size, as in CUDA).
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) double2 {
  double x, y;
};
struct alignas(8) uint2 {
  unsigned x, y;
};

namespace simt {

constexpr int kWarp = 32;

// The running block's barriers and the slots its threads exchange values through.
struct Block {
  explicit Block(int threads) : block(threads), slots(threads) {
    for (int w = 0; w < threads / kWarp; ++w) warps.push_back(std::make_unique<std::barrier<>>(kWarp));
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> slots;  // one value (up to 8 bytes) per thread
};
inline Block* running = nullptr;

// Every thread of the block (or of the warp) publishes `value`; returns all of them, in thread order.
template <typename T>
std::vector<T> exchange(T value, bool whole_block) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && !std::is_same_v<T, bool>, "exchange ints, not bools");
  Block& b = *running;
  const int t = threadIdx.x, first = whole_block ? 0 : t / kWarp * kWarp;
  const int count = whole_block ? static_cast<int>(b.slots.size()) : kWarp;
  auto& barrier = whole_block ? b.block : *b.warps[t / kWarp];
  std::memcpy(&b.slots[t], &value, sizeof(T));
  barrier.arrive_and_wait();
  std::vector<T> all(count);
  for (int i = 0; i < count; ++i) std::memcpy(&all[i], &b.slots[first + i], sizeof(T));
  barrier.arrive_and_wait();  // nobody overwrites a slot before everyone has read it
  return all;
}

// kernel() on grid x threads CUDA threads (threads a multiple of the warp size). A block whose threads wait
// at different barriers (a __syncthreads some threads skip) would hang on a GPU; here it ends the process.
template <typename Kernel>
void launch(unsigned grid, int threads, Kernel&& kernel) {
  gridDim.x = grid;
  for (unsigned b = 0; b < grid; ++b) {
    Block block(threads);
    running = &block;
    std::atomic<int> finished{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t, b] {
        threadIdx.x = t;
        blockIdx.x = b;
        kernel();
        ++finished;
      });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (finished < threads) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr, "block %u: %d of %d threads finished after 60 s: they wait at different barriers\n", b,
                     finished.load(), threads);
        std::_Exit(3);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (auto& thread : pool) thread.join();
  }
  running = nullptr;
}

}  // namespace simt

inline void __syncthreads() { simt::running->block.arrive_and_wait(); }
inline int __syncthreads_or(int predicate) {
  const auto all = simt::exchange(int{predicate != 0}, true);
  return std::any_of(all.begin(), all.end(), [](int p) { return p != 0; });
}
inline bool __any_sync(unsigned, bool predicate) {
  const auto all = simt::exchange(int{predicate}, false);
  return std::any_of(all.begin(), all.end(), [](int p) { return p != 0; });
}
inline unsigned __ballot_sync(unsigned, bool predicate) {
  const auto all = simt::exchange(int{predicate}, false);
  unsigned bits = 0;
  for (int i = 0; i < simt::kWarp; ++i) bits |= (all[i] != 0 ? 1u : 0u) << i;
  return bits;
}
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(static_cast<unsigned>(x)) + 1; }
template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  return simt::exchange(value, false)[(threadIdx.x % simt::kWarp) ^ lane_mask];
}
template <typename T>
T __shfl_down_sync(unsigned, T value, unsigned delta) {
  const unsigned lane = threadIdx.x % simt::kWarp;
  const auto all = simt::exchange(value, false);
  return lane + delta < simt::kWarp ? all[lane + delta] : value;
}
template <typename T>
T __ldg(const T* p) {
  return *p;
}
inline float __uint_as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T>
T atomicAdd(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_add(value);
}
// sm_90's vector atomic, atomic per value (as on the GPU, not as a whole), counted for the tests
// (kernels.cpp prints the count). The kernels' atomic_add4 uses it here as on an sm_90 GPU.
#define XMC_SIMT_VECTOR_ATOMICS 1
namespace simt {
inline std::atomic<long> vector_atomics{0};
}
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float4 atomicAdd(float4* address, float4 value) {
  if (reinterpret_cast<uintptr_t>(address) % alignof(float4) != 0) {  // a misaligned address faults on the GPU
    std::fprintf(stderr, "atomicAdd(float4*) at a misaligned address %p\n", static_cast<void*>(address));
    std::abort();
  }
  ++simt::vector_atomics;
  float* p = &address->x;
  const float x = atomicAdd(p, value.x), y = atomicAdd(p + 1, value.y), z = atomicAdd(p + 2, value.z),
              w = atomicAdd(p + 3, value.w);
  return {x, y, z, w};
}
template <typename T>
T atomicExch(T* address, T value) {
  return std::atomic_ref<T>(*address).exchange(value);
}
inline double __longlong_as_double(long long bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}
inline long long __double_as_longlong(double d) {
  long long bits;
  std::memcpy(&bits, &d, sizeof bits);
  return bits;
}
#ifndef CUDA_KERNEL_ASSERT  // c10's device assertion, where this torch defines it only for CUDA builds
#define CUDA_KERNEL_ASSERT(cond) assert(cond)
#endif
using std::min;
