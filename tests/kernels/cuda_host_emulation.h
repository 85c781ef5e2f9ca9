// Runs a CUDA kernel's source on the host, for tests on machines without a GPU: one std::thread
// per CUDA thread, std::barrier for __syncthreads and for the warp-synchronous __shfl_xor_sync.
// Only what oasr-kernels' sources use is emulated. Blocks run one after another.
#include <algorithm>
#include <barrier>
#include <bit>
#include <cmath>
#include <math.h>
#include <cstring>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__

struct EmuDim3 {
  unsigned x, y, z;
};
thread_local EmuDim3 threadIdx, blockIdx;
static EmuDim3 blockDim, gridDim;  // the same for every thread of a launch
static unsigned char* emu_dyn_smem;  // the current block's dynamic shared memory

constexpr int kEmuMaxWarps = 32;
static std::barrier<>* emu_block_barrier;
static std::barrier<>* emu_warp_barrier[kEmuMaxWarps];
static float emu_exchange[kEmuMaxWarps][32];

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  emu_exchange[warp][lane] = v;
  emu_warp_barrier[warp]->arrive_and_wait();
  const float r = emu_exchange[warp][lane ^ offset];
  emu_warp_barrier[warp]->arrive_and_wait();
  return r;
}

inline float __shfl_sync(unsigned, float v, int src) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  emu_exchange[warp][lane] = v;
  emu_warp_barrier[warp]->arrive_and_wait();
  const float r = emu_exchange[warp][src & 31];
  emu_warp_barrier[warp]->arrive_and_wait();
  return r;
}

inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __int_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::min;

// Launch `body` (a kernel bound to its arguments) over grid (gx, gy) with `threads` threads per
// block and `smem_bytes` of dynamic shared memory (poisoned: real shared memory is not zeroed).
template <class Body>
void emu_launch(unsigned gx, unsigned gy, unsigned threads, unsigned smem_bytes,
                long long*& smem_symbol, Body body) {
  const unsigned warps = threads / 32;
  std::barrier<> block_barrier(threads);
  std::vector<std::barrier<>*> warp_barriers;
  for (unsigned w = 0; w < warps; ++w) warp_barriers.push_back(new std::barrier<>(32));
  emu_block_barrier = &block_barrier;
  for (unsigned w = 0; w < warps; ++w) emu_warp_barrier[w] = warp_barriers[w];
  std::vector<unsigned char> smem(smem_bytes + 16);
  for (unsigned by = 0; by < gy; ++by) {
    for (unsigned bx = 0; bx < gx; ++bx) {
      std::memset(smem.data(), 0xff, smem.size());
      smem_symbol = reinterpret_cast<long long*>(smem.data());
      std::vector<std::thread> pool;
      for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([=] {
          threadIdx = {t, 0, 0};
          blockIdx = {bx, by, 0};
          body();
        });
      }
      for (auto& th : pool) th.join();
    }
  }
  for (auto* b : warp_barriers) delete b;
}

// Launch over a 3-D grid with blockDim.x = threads; the kernel's dynamic shared memory is
// emu_dyn_smem (poisoned like real shared memory).
template <class Body>
void emu_launch3(unsigned gx, unsigned gy, unsigned gz, unsigned threads, unsigned smem_bytes,
                 Body body) {
  const unsigned warps = threads / 32;
  std::barrier<> block_barrier(threads);
  std::vector<std::barrier<>*> warp_barriers;
  for (unsigned w = 0; w < warps; ++w) warp_barriers.push_back(new std::barrier<>(32));
  emu_block_barrier = &block_barrier;
  for (unsigned w = 0; w < warps; ++w) emu_warp_barrier[w] = warp_barriers[w];
  blockDim = {threads, 1, 1};
  gridDim = {gx, gy, gz};
  std::vector<unsigned char> smem(smem_bytes + 16);
  for (unsigned bz = 0; bz < gz; ++bz) {
    for (unsigned by = 0; by < gy; ++by) {
      for (unsigned bx = 0; bx < gx; ++bx) {
        std::memset(smem.data(), 0xff, smem.size());
        emu_dyn_smem = smem.data();
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < threads; ++t) {
          pool.emplace_back([=] {
            threadIdx = {t, 0, 0};
            blockIdx = {bx, by, bz};
            body();
          });
        }
        for (auto& th : pool) th.join();
      }
    }
  }
  for (auto* b : warp_barriers) delete b;
}

// Calls a kernel with its arguments given as cuLaunchKernel does: an array of pointers to each
// argument's value (pointer arguments as 64-bit addresses).
template <class P>
P emu_arg(void* p) {
  if constexpr (std::is_pointer_v<P>) {
    return reinterpret_cast<P>(*static_cast<unsigned long long*>(p));
  } else {
    return *static_cast<P*>(p);
  }
}

template <class... P, std::size_t... I>
void emu_call_impl(void (*f)(P...), void** a, std::index_sequence<I...>) {
  f(emu_arg<P>(a[I])...);
}

template <class... P>
void emu_call(void (*f)(P...), void** a) {
  emu_call_impl(f, a, std::index_sequence_for<P...>{});
}
