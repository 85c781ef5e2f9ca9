// Shared by oasr-kernels' sources (prepended to each by the launcher: NVRTC compiles them with no
// include path). fp16 and bf16 are plain 16-bit words converted with PTX (fp16) or bit shifts
// (bf16), so no CUDA header is needed and nothing beyond SM75 is used. All arithmetic is fp32.

#define OASR_FULL_MASK 0xffffffffu
#define OASR_NEG_INF __int_as_float(0xff800000)

namespace oasr {

struct f16 {
  unsigned short bits;
};
struct bf16 {
  unsigned short bits;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16 v) {
  return __uint_as_float(((unsigned int)v.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float f);

template <>
__device__ __forceinline__ float from_float<float>(float f) {
  return f;
}
template <>
__device__ __forceinline__ f16 from_float<f16>(float f) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float f) {
  unsigned int u = __float_as_uint(f);
  bf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = (unsigned short)0x7fc0u;  // NaN
    return r;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  r.bits = (unsigned short)(u >> 16);
  return r;
}

// The value a float takes once stored in T and read back (what torch's op in T computes
// before its next op reads it).
template <typename T>
__device__ __forceinline__ float round_to(float f) {
  return to_float(from_float<T>(f));
}

// 16-byte vectors: 4 floats or 8 16-bit values. The caller guarantees 16-byte alignment.
struct alignas(16) Vec16 {
  unsigned int w[4];
};

template <typename T>
struct VecTraits {
  static constexpr int N = 8;  // f16, bf16
};
template <>
struct VecTraits<float> {
  static constexpr int N = 4;
};

__device__ __forceinline__ unsigned short lo16(unsigned int u) { return (unsigned short)(u & 0xffffu); }
__device__ __forceinline__ unsigned short hi16(unsigned int u) { return (unsigned short)(u >> 16); }

template <typename T>
__device__ __forceinline__ T bits_to(unsigned short b) {
  T t;
  t.bits = b;
  return t;
}

// Load VecTraits<T>::N elements at p (16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* f) {
  const Vec16 v = *reinterpret_cast<const Vec16*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = to_float(bits_to<T>(lo16(v.w[i])));
    f[2 * i + 1] = to_float(bits_to<T>(hi16(v.w[i])));
  }
}
template <>
__device__ __forceinline__ void load_vec<float>(const float* p, float* f) {
  const Vec16 v = *reinterpret_cast<const Vec16*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(v.w[i]);
}

// Store VecTraits<T>::N floats at p (16-byte aligned) as T.
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float* f) {
  Vec16 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v.w[i] = (unsigned int)from_float<T>(f[2 * i]).bits |
             ((unsigned int)from_float<T>(f[2 * i + 1]).bits << 16);
  }
  *reinterpret_cast<Vec16*>(p) = v;
}
template <>
__device__ __forceinline__ void store_vec<float>(float* p, const float* f) {
  Vec16 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.w[i] = __float_as_uint(f[i]);
  *reinterpret_cast<Vec16*>(p) = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(OASR_FULL_MASK, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(OASR_FULL_MASK, v, off));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); `red` holds 32 floats of
// shared memory. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += red[w];
  return total;
}

// The softmax numerators of scores[0, len) in place (exp(score - max), in float32) by one block
// of kWarps warps (threadIdx.x < 32 * kWarps); returns their sum, the same in every thread.
// red_max and red_sum hold kWarps floats each of shared memory. The last barrier also publishes
// the exponentials to every thread.
template <int kWarps>
__device__ __forceinline__ float block_softmax_numerators(float* scores, int len, float* red_max,
                                                          float* red_sum) {
  constexpr int kThreads = 32 * kWarps;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float m = -3.0e38f;
  for (int j = tid; j < len; j += kThreads) m = fmaxf(m, scores[j]);
  m = warp_max(m);
  if (lane == 0) red_max[warp] = m;
  __syncthreads();
  m = red_max[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red_max[w]);
  float sum = 0.f;
  for (int j = tid; j < len; j += kThreads) {
    const float e = expf(scores[j] - m);
    scores[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  if (lane == 0) red_sum[warp] = sum;
  __syncthreads();
  sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red_sum[w];
  return sum;
}

}  // namespace oasr
