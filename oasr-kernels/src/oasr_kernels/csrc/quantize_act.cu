// Per-token activation quantization in one launch (oasr.layers.quantized.quantize_activations):
// one block per row of x (M, K): the row's max |x| -> scale = max(amax * (1 / QMAX), 1e-12) ->
// q = x / scale as e4m3 bytes (RNE) or int8 (round half to even). The same float32 operations
// in the same order as the native torch ops (numerics.quantize_activations on CUDA: torch divides
// by a Python scalar as a multiply by its float32 reciprocal, then a true division per element),
// so the bytes and scales are identical; the native path is five launches and writes a float32
// copy of x between them.

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

template <typename T, bool kFp8>
__device__ __forceinline__ void quantize_row(const T* __restrict__ x, unsigned char* __restrict__ q,
                                             float* __restrict__ scales, int k, float inv_qmax) {
  __shared__ float red[32];
  const long row = blockIdx.x;
  const T* xr = x + row * (long)k;
  unsigned char* qr = q + row * (long)k;
  constexpr int N = oasr::VecTraits<T>::N;
  const bool vec = (k % N == 0) && ((reinterpret_cast<unsigned long>(xr) & 15u) == 0);
  float m = 0.f;
  float f[N];
  if (vec) {
    for (int i = threadIdx.x * N; i < k; i += blockDim.x * N) {
      oasr::load_vec<T>(xr + i, f);
#pragma unroll
      for (int j = 0; j < N; ++j) m = fmaxf(m, fabsf(f[j]));
    }
  } else {
    for (int i = threadIdx.x; i < k; i += blockDim.x) m = fmaxf(m, fabsf(oasr::to_float(xr[i])));
  }
  m = oasr::warp_max(m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < warps; ++w) m = fmaxf(m, red[w]);
  const float s = fmaxf(m * inv_qmax, 1e-12f);
  if (threadIdx.x == 0) scales[row] = s;
  if (vec) {
    for (int i = threadIdx.x * N; i < k; i += blockDim.x * N) {
      oasr::load_vec<T>(xr + i, f);
      // N bytes in one store (q's rows start at multiples of N: k % N == 0, q 256-byte aligned)
      unsigned long long packed = 0;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float v = __fdiv_rn(f[j], s);
        const unsigned char b = kFp8 ? e4m3_from_float(v) : (unsigned char)(signed char)(int)rintf(v);
        packed |= (unsigned long long)b << (8 * j);
      }
      if (N == 8) {
        *reinterpret_cast<unsigned long long*>(qr + i) = packed;
      } else {
        *reinterpret_cast<unsigned int*>(qr + i) = (unsigned int)packed;
      }
    }
  } else {
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
      const float v = __fdiv_rn(oasr::to_float(xr[i]), s);
      qr[i] = kFp8 ? e4m3_from_float(v) : (unsigned char)(signed char)(int)rintf(v);
    }
  }
}

}  // namespace oasr_qact

#define OASR_QACT(TAG, T)                                                                            \
  extern "C" __global__ void oasr_quantize_act_fp8_##TAG(const T* x, unsigned char* q, float* s, \
                                                         int k, float inv_qmax) {                   \
    oasr_qact::quantize_row<T, true>(x, q, s, k, inv_qmax);                                          \
  }                                                                                                  \
  extern "C" __global__ void oasr_quantize_act_int8_##TAG(const T* x, unsigned char* q, float* s, \
                                                          int k, float inv_qmax) {                  \
    oasr_qact::quantize_row<T, false>(x, q, s, k, inv_qmax);                                         \
  }

OASR_QACT(f32, float)
OASR_QACT(f16, oasr::f16)
OASR_QACT(bf16, oasr::bf16)
