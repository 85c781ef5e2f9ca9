// Per-token activation quantization in one launch (oasr.layers.quantized.quantize_activations):
// per row of x (M, K): max |x| -> scale = max(amax * (1 / QMAX), 1e-12) -> q = x / scale as e4m3
// bytes (RNE) or int8 (round half to even). The same float32 operations in the same order as the
// native torch ops (numerics.quantize_activations on CUDA: torch divides by a Python scalar as a
// multiply by its float32 reciprocal, then a true division per element), so the bytes and scales
// are identical; the native path is five launches and writes a float32 copy of x between them.
//
// A row belongs to a group of `group` threads (whole warps; a block holds blockDim.x / group
// rows): a warp per row when there are rows enough to fill the GPU (Whisper's 96 000-frame
// encoder batches), up to a thread per 16-byte vector for the few rows of a decode step. The
// oasr_quantize_act_* kernels with a suffix _vV hold each thread's V vectors in registers between
// the maximum and the quantization (x is read from memory once); _v0 reads the row twice (rows
// too long for the registers, or not whole aligned vectors).

namespace oasr_qact {

// float -> e4m3fn byte, round to nearest even, |f| <= 448 (the caller's scale guarantees it;
// larger magnitudes saturate to 448 instead of torch's NaN, which never happens here).
__device__ __forceinline__ unsigned char e4m3_from_float(float f) {
  const unsigned int bits = __float_as_uint(f);
  const unsigned int sign = (bits >> 24) & 0x80u;
  const float a = fabsf(f);
  unsigned int r;
  if (a < 0.015625f) {                          // below e4m3's smallest normal, 2^-6: steps of 2^-9
    r = (unsigned int)rintf(a * 512.0f);        // exact scaling; 8 is the smallest normal's code
  } else {
    unsigned int u = __float_as_uint(a);
    u += 0x7ffffu + ((u >> 20) & 1u);           // keep 3 mantissa bits, ties to even
    r = (u >> 20) - (120u << 3);                // float exponent bias 127 -> e4m3's 7
    if (r > 0x7eu) r = 0x7eu;                   // 448
  }
  return (unsigned char)(sign | r);
}

// Two e4m3 bytes, lo's in the low byte. sm_89+ converts in hardware: the same round to nearest
// even with saturation to 448 in one instruction for both (the software conversion is about ten
// integer instructions per element, as many as the rest of the kernel's work on it). The
// software path elsewhere, and in the host emulation of the tests.
__device__ __forceinline__ unsigned int e4m3x2_from_floats(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned int)e4m3_from_float(lo) | ((unsigned int)e4m3_from_float(hi) << 8);
#endif
}

__device__ __forceinline__ unsigned int int8_from_float(float v) {
  return (unsigned char)(signed char)(int)rintf(v);
}

// N (8 or 4) floats divided by s -> N bytes, element j in byte j
template <int N, bool kFp8>
__device__ __forceinline__ unsigned long long quantize_vec(const float* f, float s) {
  unsigned long long packed = 0;
#pragma unroll
  for (int j = 0; j < N; j += 2) {
    const float a = __fdiv_rn(f[j], s), b = __fdiv_rn(f[j + 1], s);
    const unsigned int two = kFp8 ? e4m3x2_from_floats(a, b) : int8_from_float(a) | (int8_from_float(b) << 8);
    packed |= (unsigned long long)two << (8 * j);
  }
  return packed;
}

template <int N>
__device__ __forceinline__ void store_bytes(unsigned char* p, unsigned long long packed) {
  // N bytes in one store (q's rows start at multiples of N: k % N == 0, q 256-byte aligned)
  if (N == 8) {
    *reinterpret_cast<unsigned long long*>(p) = packed;
  } else {
    *reinterpret_cast<unsigned int*>(p) = (unsigned int)packed;
  }
}

// The maximum over the row's group (`group` a multiple of 32). Every thread of the block calls
// it: the groups of more than one warp meet at a barrier; red holds a float per warp.
__device__ __forceinline__ float group_max(float m, int group, float* red) {
  m = oasr::warp_max(m);
  if (group == 32) return m;
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  const int warps = group >> 5, first = (threadIdx.x / group) * warps;
  m = red[first];
  for (int w = 1; w < warps; ++w) m = fmaxf(m, red[first + w]);
  return m;
}

template <typename T, bool kFp8, int V>
__device__ __forceinline__ void quantize_rows(const T* __restrict__ x, unsigned char* __restrict__ q,
                                              float* __restrict__ scales, int rows, int k, int group,
                                              float inv_qmax, int vec) {
  extern __shared__ float oasr_qact_smem[];
  constexpr int N = oasr::VecTraits<T>::N;
  const int t = threadIdx.x % group;
  const long long row = (long long)blockIdx.x * (blockDim.x / group) + threadIdx.x / group;
  const bool live = row < rows;  // the last block's spare groups still meet at the barrier
  const T* xr = x + (live ? row : 0) * (long long)k;
  unsigned char* qr = q + (live ? row : 0) * (long long)k;
  float m = 0.f;
  float f[N];
  if constexpr (V > 0) {
    const int units = k / N;  // 16-byte vectors of the row (vec: k % N == 0, x 16-byte aligned)
    oasr::Vec16 v[V];
    // every load issued before the first is used
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int u = t + i * group;
      if (live && u < units) v[i] = *reinterpret_cast<const oasr::Vec16*>(xr + (long long)u * N);
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (live && t + i * group < units) {
        oasr::load_vec<T>(reinterpret_cast<const T*>(&v[i]), f);
#pragma unroll
        for (int j = 0; j < N; ++j) m = fmaxf(m, fabsf(f[j]));
      }
    }
    m = group_max(m, group, oasr_qact_smem);
    if (!live) return;
    const float s = fmaxf(m * inv_qmax, 1e-12f);
    if (t == 0) scales[row] = s;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int u = t + i * group;
      if (u < units) {
        oasr::load_vec<T>(reinterpret_cast<const T*>(&v[i]), f);
        store_bytes<N>(qr + (long long)u * N, quantize_vec<N, kFp8>(f, s));
      }
    }
  } else {
    if (live) {
      if (vec) {
        for (int i = t * N; i < k; i += group * N) {
          oasr::load_vec<T>(xr + i, f);
#pragma unroll
          for (int j = 0; j < N; ++j) m = fmaxf(m, fabsf(f[j]));
        }
      } else {
        for (int i = t; i < k; i += group) m = fmaxf(m, fabsf(oasr::to_float(xr[i])));
      }
    }
    m = group_max(m, group, oasr_qact_smem);
    if (!live) return;
    const float s = fmaxf(m * inv_qmax, 1e-12f);
    if (t == 0) scales[row] = s;
    if (vec) {
      for (int i = t * N; i < k; i += group * N) {
        oasr::load_vec<T>(xr + i, f);
        store_bytes<N>(qr + i, quantize_vec<N, kFp8>(f, s));
      }
    } else {
      for (int i = t; i < k; i += group) {
        const float v = __fdiv_rn(oasr::to_float(xr[i]), s);
        qr[i] = (unsigned char)(kFp8 ? e4m3_from_float(v) : int8_from_float(v));
      }
    }
  }
}

}  // namespace oasr_qact

#define OASR_QACT_V(TAG, T, V)                                                                      \
  extern "C" __global__ void oasr_quantize_act_fp8_##TAG##_v##V(                                    \
      const T* x, unsigned char* q, float* s, int rows, int k, int group, float inv_qmax, int vec) { \
    oasr_qact::quantize_rows<T, true, V>(x, q, s, rows, k, group, inv_qmax, vec);                   \
  }                                                                                                 \
  extern "C" __global__ void oasr_quantize_act_int8_##TAG##_v##V(                                   \
      const T* x, unsigned char* q, float* s, int rows, int k, int group, float inv_qmax, int vec) { \
    oasr_qact::quantize_rows<T, false, V>(x, q, s, rows, k, group, inv_qmax, vec);                  \
  }

// V: quantize_act.py's _VECS (and 0)
#define OASR_QACT(TAG, T) \
  OASR_QACT_V(TAG, T, 0)  \
  OASR_QACT_V(TAG, T, 1)  \
  OASR_QACT_V(TAG, T, 2)  \
  OASR_QACT_V(TAG, T, 3)  \
  OASR_QACT_V(TAG, T, 4)  \
  OASR_QACT_V(TAG, T, 6)  \
  OASR_QACT_V(TAG, T, 8)  \
  OASR_QACT_V(TAG, T, 12) \
  OASR_QACT_V(TAG, T, 16)

OASR_QACT(f32, float)
OASR_QACT(f16, oasr::f16)
OASR_QACT(bf16, oasr::bf16)

// ------------------------------------------------------------------------------------ fp8 KV
// numerics.quantize_kv written straight into its destination (oasr.layers.quantized.
// quantize_kv_into): x (rows, inner, heads, d), one scale per (row, inner, head) vector of d
// elements: amax -> scale = max(amax * (1 / 448), 1e-12) -> e4m3 bytes of x / scale, the same
// float32 operations as the native ops (so the same bytes and scales). The bytes and the scale
// go to q / s at (index[row] or row, inner, head) through their strides: the paged cache's slot
// scatter and the cross-attention pools' (rows, heads, frames, d) layout need no second copy.
// `group` lanes (a power of two dividing 32) share a vector; a warp takes 32 / group vectors.

namespace oasr_qkv {

template <typename T>
__device__ __forceinline__ void quantize_kv_rows(
    const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ s,
    const long long* __restrict__ index, int rows, int inner, int heads, int d, long long xr,
    long long xi, long long xh, long long qr, long long qi, long long qh, long long sr, long long si,
    long long sh, int group, int vec, float inv_qmax) {
  constexpr int N = oasr::VecTraits<T>::N;
  const long long total = (long long)rows * inner * heads;
  const int lane = threadIdx.x & 31;
  const int sub = lane & (group - 1);
  const long long per_warp = 32 / group;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  // warp-uniform loop: every lane reaches the shuffles, lanes past the end hold 0
  for (long long base = warp * per_warp; base < total; base += warps * per_warp) {
    const long long v = base + lane / group;
    const bool ok = v < total;
    const T* xv = x;
    long long r = 0, i = 0, h = 0;
    if (ok) {
      h = v % heads;
      const long long t = v / heads;
      i = t % inner;
      r = t / inner;
      xv = x + r * xr + i * xi + h * xh;
    }
    float m = 0.f;
    float f[N];
    if (ok) {
      if (vec) {
        for (int c = sub * N; c < d; c += group * N) {
          oasr::load_vec<T>(xv + c, f);
#pragma unroll
          for (int j = 0; j < N; ++j) m = fmaxf(m, fabsf(f[j]));
        }
      } else {
        for (int c = sub; c < d; c += group) m = fmaxf(m, fabsf(oasr::to_float(xv[c])));
      }
    }
    for (int off = group >> 1; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(OASR_FULL_MASK, m, off));
    if (!ok) continue;
    const float sc = fmaxf(m * inv_qmax, 1e-12f);
    const long long dr = index ? index[r] : r;
    unsigned char* qv = q + dr * qr + i * qi + h * qh;
    if (sub == 0) s[dr * sr + i * si + h * sh] = sc;
    if (vec) {
      for (int c = sub * N; c < d; c += group * N) {
        oasr::load_vec<T>(xv + c, f);
        unsigned long long packed = 0;
#pragma unroll
        for (int j = 0; j < N; ++j)
          packed |= (unsigned long long)oasr_qact::e4m3_from_float(__fdiv_rn(f[j], sc)) << (8 * j);
        if (N == 8) {
          *reinterpret_cast<unsigned long long*>(qv + c) = packed;
        } else {
          *reinterpret_cast<unsigned int*>(qv + c) = (unsigned int)packed;
        }
      }
    } else {
      for (int c = sub; c < d; c += group)
        qv[c] = oasr_qact::e4m3_from_float(__fdiv_rn(oasr::to_float(xv[c]), sc));
    }
  }
}

// e4m3fn byte -> float, exact (0x7f / 0xff, NaN, never written by the quantizers: read as 480)
__device__ __forceinline__ float e4m3_to_float(unsigned int b) {
  const unsigned int e = (b >> 3) & 15u, m = b & 7u;
  const float a = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
  return (b & 0x80u) ? -a : a;
}

// numerics.dequantize_kv: out = (float(q) * scale) rounded to T, one scale per d elements;
// contiguous q (n * d bytes), scale (n), out (n * d). vec: d % 8 == 0, 8 elements per step.
template <typename T>
__device__ __forceinline__ void dequantize_kv_rows(const unsigned char* __restrict__ q,
                                                   const float* __restrict__ scale, T* __restrict__ out,
                                                   long long n, int d, int vec) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x;
  if (vec) {
    const long long chunks = n * (d / 8);
    for (long long c = tid; c < chunks; c += stride) {
      const long long e = c * 8;
      const float sc = scale[e / d];
      const unsigned long long b = *reinterpret_cast<const unsigned long long*>(q + e);
      float f[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = __fmul_rn(e4m3_to_float((unsigned int)(b >> (8 * j)) & 0xffu), sc);
      if (oasr::VecTraits<T>::N == 8) {
        oasr::store_vec<T>(out + e, f);
      } else {
        oasr::store_vec<T>(out + e, f);
        oasr::store_vec<T>(out + e + 4, f + 4);
      }
    }
  } else {
    const long long total = n * d;
    for (long long e = tid; e < total; e += stride)
      out[e] = oasr::from_float<T>(__fmul_rn(e4m3_to_float(q[e]), scale[e / d]));
  }
}

}  // namespace oasr_qkv

#define OASR_QKV(TAG, T)                                                                              \
  extern "C" __global__ void oasr_quantize_kv_##TAG(                                                \
      const T* x, unsigned char* q, float* s, const long long* index, int rows, int inner, int heads, \
      int d, long long xr, long long xi, long long xh, long long qr, long long qi, long long qh,     \
      long long sr, long long si, long long sh, int group, int vec, float inv_qmax) {               \
    oasr_qkv::quantize_kv_rows<T>(x, q, s, index, rows, inner, heads, d, xr, xi, xh, qr, qi, qh, sr, \
                                  si, sh, group, vec, inv_qmax);                                     \
  }                                                                                                   \
  extern "C" __global__ void oasr_dequantize_kv_##TAG(const unsigned char* q, const float* scale,   \
                                                      T* out, long long n, int d, int vec) {        \
    oasr_qkv::dequantize_kv_rows<T>(q, scale, out, n, d, vec);                                      \
  }

OASR_QKV(f32, float)
OASR_QKV(f16, oasr::f16)
OASR_QKV(bf16, oasr::bf16)
