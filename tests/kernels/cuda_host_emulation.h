// Runs a CUDA kernel's source on the host, for tests on machines without a GPU: one cooperative
// fiber (ucontext) per CUDA thread, all on the calling thread; __syncthreads and the
// warp-synchronous shuffles are counting barriers at which a fiber yields until its whole group
// has arrived (as std::barrier per OS thread did, without an OS context switch per arrival).
// Only what oasr-kernels' sources use is emulated. Blocks run one after another.
#include <ucontext.h>

#include <algorithm>
#include <barrier>
#include <bit>
#include <cmath>
#include <math.h>
#include <cstdlib>
#include <cstring>
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
static EmuDim3 threadIdx, blockIdx;  // the running fiber's (set by the scheduler)
static EmuDim3 blockDim, gridDim;  // the same for every thread of a launch
static unsigned char* emu_dyn_smem;  // the current block's dynamic shared memory

// A barrier of `count` fibers: the last to arrive opens the next phase, the others yield to the
// scheduler until it has.
struct EmuBarrier {
  unsigned count = 0, arrived = 0, phase = 0;
};

constexpr int kEmuMaxWarps = 32;
static EmuBarrier emu_block_barrier;
static EmuBarrier emu_warp_barrier[kEmuMaxWarps];
static float emu_exchange[kEmuMaxWarps][32];

static ucontext_t emu_scheduler;
static ucontext_t* emu_fibers;
static unsigned emu_running;  // the running fiber's thread index
static std::vector<char> emu_done;

inline void emu_yield() { swapcontext(&emu_fibers[emu_running], &emu_scheduler); }

inline void emu_arrive_and_wait(EmuBarrier& b) {
  const unsigned phase = b.phase;
  if (++b.arrived == b.count) {
    b.arrived = 0;
    ++b.phase;
    return;
  }
  while (b.phase == phase) emu_yield();
}

inline void __syncthreads() { emu_arrive_and_wait(emu_block_barrier); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  emu_exchange[warp][lane] = v;
  emu_arrive_and_wait(emu_warp_barrier[warp]);
  const float r = emu_exchange[warp][lane ^ offset];
  emu_arrive_and_wait(emu_warp_barrier[warp]);
  return r;
}

inline float __shfl_sync(unsigned, float v, int src) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  emu_exchange[warp][lane] = v;
  emu_arrive_and_wait(emu_warp_barrier[warp]);
  const float r = emu_exchange[warp][src & 31];
  emu_arrive_and_wait(emu_warp_barrier[warp]);
  return r;
}

inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __int_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::min;

static void (*emu_fiber_body)(void*);
static void* emu_fiber_arg;

static void emu_fiber_main() {
  emu_fiber_body(emu_fiber_arg);
  emu_done[emu_running] = 1;  // returns to the scheduler (uc_link)
}

// Runs `threads` fibers of `body` for block `block` until every one has returned; a fiber runs
// until it finishes or waits at a barrier, then the next unfinished one (round robin).
template <class Body>
void emu_run_block(EmuDim3 block, unsigned threads, Body& body) {
  constexpr size_t kStack = 256 * 1024;  // -O0 frames of the kernels with their local arrays
  std::vector<ucontext_t> fibers(threads);
  char* stacks = static_cast<char*>(std::malloc(kStack * threads));  // untouched pages stay free
  emu_fibers = fibers.data();
  emu_done.assign(threads, 0);
  emu_fiber_body = [](void* b) { (*static_cast<Body*>(b))(); };
  emu_fiber_arg = &body;
  blockIdx = block;
  for (unsigned t = 0; t < threads; ++t) {
    getcontext(&fibers[t]);
    fibers[t].uc_stack.ss_sp = stacks + kStack * t;
    fibers[t].uc_stack.ss_size = kStack;
    fibers[t].uc_link = &emu_scheduler;
    makecontext(&fibers[t], emu_fiber_main, 0);
  }
  for (unsigned left = threads; left > 0;) {
    for (unsigned t = 0; t < threads; ++t) {
      if (emu_done[t]) continue;
      emu_running = t;
      threadIdx = {t, 0, 0};
      swapcontext(&emu_scheduler, &fibers[t]);
      left -= emu_done[t];
    }
  }
  std::free(stacks);
}

inline void emu_reset_barriers(unsigned threads) {
  emu_block_barrier = EmuBarrier{threads};
  for (unsigned w = 0; w < threads / 32; ++w) emu_warp_barrier[w] = EmuBarrier{32};
}

// Launch `body` (a kernel bound to its arguments) over grid (gx, gy) with `threads` threads per
// block and `smem_bytes` of dynamic shared memory (poisoned: real shared memory is not zeroed).
template <class Body>
void emu_launch(unsigned gx, unsigned gy, unsigned threads, unsigned smem_bytes,
                long long*& smem_symbol, Body body) {
  emu_reset_barriers(threads);
  std::vector<unsigned char> smem(smem_bytes + 16);
  for (unsigned by = 0; by < gy; ++by) {
    for (unsigned bx = 0; bx < gx; ++bx) {
      std::memset(smem.data(), 0xff, smem.size());
      smem_symbol = reinterpret_cast<long long*>(smem.data());
      emu_run_block({bx, by, 0}, threads, body);
    }
  }
}

// Launch over a 3-D grid with blockDim.x = threads; the kernel's dynamic shared memory is
// emu_dyn_smem (poisoned like real shared memory).
template <class Body>
void emu_launch3(unsigned gx, unsigned gy, unsigned gz, unsigned threads, unsigned smem_bytes,
                 Body body) {
  emu_reset_barriers(threads);
  blockDim = {threads, 1, 1};
  gridDim = {gx, gy, gz};
  std::vector<unsigned char> smem(smem_bytes + 16);
  for (unsigned bz = 0; bz < gz; ++bz) {
    for (unsigned by = 0; by < gy; ++by) {
      for (unsigned bx = 0; bx < gx; ++bx) {
        std::memset(smem.data(), 0xff, smem.size());
        emu_dyn_smem = smem.data();
        emu_run_block({bx, by, bz}, threads, body);
      }
    }
  }
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
