// Cross-attention over fp8 keys/values: the autoregressive executor's cross-attention pools with
// kv_cache_dtype="fp8" (oasr.layers.quantized.cross_attention_fp8), one query per (row, head):
//
//   out[b, h, :] = softmax(q[b, h, :] . K[b, c, j] * scale, j < S) @ V[b, c, j],  c = h / (H / H_kv)
//   K[b, c, j] = k_scale[b, c, j] * e4m3(k[b, c, j, :])   (V likewise)
//
// k, v: (B, H_kv, S, D) e4m3 bytes, contiguous, so a (row, kv head) is one run of S * D bytes;
// scales (B, H_kv, S) float32, also one run per (row, kv head). One thread block per (head, row),
// 128 threads; a lane reads 16 bytes of a key per load with U loads in flight (the read is the
// whole cost: every decode step reads every frame of every row). All arithmetic fp32.
// Two variants: U = 2 with at most 48 registers per thread (10 blocks per SM: Whisper large-v3's
// 64 rows x 20 heads resident at once on a 132-SM GPU) and U = 4 (more bytes in flight per block,
// fewer blocks resident); the launcher picks one (oasr_kernels/cross_attention_fp8.py).
//
// e4m3 -> float in 2-3 integer operations, no branch and no fp8 instruction (any SM75+ GPU): the
// byte at the top of a word, shifted right 4 arithmetically with bits 27..30 and 0..19 cleared, is
// the float 2^-120 * x for every e4m3 x (exponent field = e4m3's exponent; e4m3 subnormals become
// float denormals, which are kept: no -ftz). The 2^-120 is taken back in two halves: 2^64 on the
// query and on the probabilities, 2^56 after the sums, so products stay in float's normal range.
//
// Shared memory (dynamic, sized by the launcher): float part[kWarps * D], red[2 * kWarps],
// scores[S].

namespace oasr_xfp8 {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kBytes = 16;  // e4m3 elements per lane per load

struct alignas(16) Bytes16 {  // (no CUDA header under NVRTC: no uint4)
  unsigned int w[4];
};

__device__ __forceinline__ float two_pow(int e) { return __int_as_float((127 + e) << 23); }

// byte ``k`` (0..3) of ``word`` as the float 2^-120 * e4m3
__device__ __forceinline__ float e4m3_lo(unsigned int word, int k) {
  const int top = (int)(word << (24 - 8 * k));
  return __int_as_float((top >> 4) & (int)0x87F00000);
}

template <typename T, int D, int U>
__device__ __forceinline__ void cross_fp8(const T* __restrict__ q_all, long long q_stride_b,
                                          long long q_stride_h,
                                          const unsigned char* __restrict__ k_all,
                                          const unsigned char* __restrict__ v_all,
                                          const float* __restrict__ k_scale,
                                          const float* __restrict__ v_scale,
                                          T* __restrict__ out_all, int num_heads,
                                          int num_kv_heads, int S, float scale) {
  constexpr int G = D / kBytes;                   // lanes per key
  constexpr int KPW = 32 / G;                     // keys per warp per load
  constexpr int KPI = kWarps * KPW * U;           // keys per block per iteration
  static_assert(D % kBytes == 0 && 32 % G == 0, "unsupported head size");

  extern __shared__ float smem[];
  float* part = smem;
  float* red_max = part + kWarps * D;
  float* red_sum = red_max + kWarps;
  float* scores = red_sum + kWarps;

  const int h = blockIdx.x;
  const long long b = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane % G, ks = lane / G;
  const int c = h / (num_heads / num_kv_heads);
  const long long head = b * num_kv_heads + c;
  const unsigned char* kp = k_all + head * S * D + g * kBytes;
  const unsigned char* vp = v_all + head * S * D + g * kBytes;
  const float* ksp = k_scale + head * S;
  const float* vsp = v_scale + head * S;

  const T* q = q_all + b * q_stride_b + (long long)h * q_stride_h + g * kBytes;
  const float pre = scale * two_pow(64);
  float qf[kBytes];
#pragma unroll
  for (int i = 0; i < kBytes; ++i) qf[i] = oasr::to_float(q[i]) * pre;
  const float post = two_pow(56);

  // Pass 1: scores[j] = q . K[j] * scale
  for (int base = 0; base < S; base += KPI) {
    Bytes16 raw[U];
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + (u * kWarps + warp) * KPW + ks;
      if (j < S) {
        raw[u] = *reinterpret_cast<const Bytes16*>(kp + (long long)j * D);
        sc[u] = ksp[j];
      } else {
        raw[u].w[0] = raw[u].w[1] = raw[u].w[2] = raw[u].w[3] = 0u;
        sc[u] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
#pragma unroll
        for (int k = 0; k < 4; ++k) s = fmaf(qf[4 * w + k], e4m3_lo(raw[u].w[w], k), s);
      }
#pragma unroll
      for (int off = G / 2; off > 0; off >>= 1) s += __shfl_xor_sync(OASR_FULL_MASK, s, off);
      const int j = base + (u * kWarps + warp) * KPW + ks;
      if (g == 0 && j < S) scores[j] = s * post * sc[u];
    }
  }
  __syncthreads();

  // Softmax numerators in place, and their sum
  const float sum = oasr::block_softmax_numerators<kWarps>(scores, S, red_max, red_sum);

  // Pass 2: acc = sum_j p[j] * v_scale[j] * V[j]
  float acc[kBytes];
#pragma unroll
  for (int i = 0; i < kBytes; ++i) acc[i] = 0.f;
  const float p_pre = two_pow(64);
  for (int base = 0; base < S; base += KPI) {
    Bytes16 raw[U];
    float p[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + (u * kWarps + warp) * KPW + ks;
      if (j < S) {
        raw[u] = *reinterpret_cast<const Bytes16*>(vp + (long long)j * D);
        p[u] = scores[j] * vsp[j] * p_pre;
      } else {
        raw[u].w[0] = raw[u].w[1] = raw[u].w[2] = raw[u].w[3] = 0u;
        p[u] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[4 * w + k] = fmaf(p[u], e4m3_lo(raw[u].w[w], k), acc[4 * w + k]);
      }
    }
  }
#pragma unroll
  for (int off = G; off < 32; off <<= 1) {
#pragma unroll
    for (int i = 0; i < kBytes; ++i) acc[i] += __shfl_xor_sync(OASR_FULL_MASK, acc[i], off);
  }
  if (ks == 0) {
#pragma unroll
    for (int i = 0; i < kBytes; ++i) part[warp * D + g * kBytes + i] = acc[i];
  }
  __syncthreads();
  const float inv = sum > 0.f ? post / sum : 0.f;
  T* out = out_all + (b * num_heads + h) * D;
  for (int d = tid; d < D; d += kThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += part[w * D + d];
    out[d] = oasr::from_float<T>(o * inv);
  }
}

}  // namespace oasr_xfp8

// U = 2: 10 blocks per SM where an SM runs 1280+ threads (SM80+), 8 before
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define OASR_XFP8_MIN_BLOCKS 8
#else
#define OASR_XFP8_MIN_BLOCKS 10
#endif

#define OASR_XA_FP8_KERNEL(NAME, T, D, U, MIN_BLOCKS)                                           \
  extern "C" __global__ void __launch_bounds__(oasr_xfp8::kThreads, MIN_BLOCKS) NAME(           \
      const T* __restrict__ q, long long q_stride_b, long long q_stride_h,                      \
      const unsigned char* __restrict__ k, const unsigned char* __restrict__ v,                 \
      const float* __restrict__ ks, const float* __restrict__ vs, T* __restrict__ out,          \
      int num_heads, int num_kv_heads, int S, float scale) {                                    \
    oasr_xfp8::cross_fp8<T, D, U>(q, q_stride_b, q_stride_h, k, v, ks, vs, out, num_heads,         \
                               num_kv_heads, S, scale);                                         \
  }

OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_f32_d64_u2, float, 64, 2, OASR_XFP8_MIN_BLOCKS)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_f32_d128_u2, float, 128, 2, OASR_XFP8_MIN_BLOCKS)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_f16_d64_u2, oasr::f16, 64, 2, OASR_XFP8_MIN_BLOCKS)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_f16_d128_u2, oasr::f16, 128, 2, OASR_XFP8_MIN_BLOCKS)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_bf16_d64_u2, oasr::bf16, 64, 2, OASR_XFP8_MIN_BLOCKS)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_bf16_d128_u2, oasr::bf16, 128, 2, OASR_XFP8_MIN_BLOCKS)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_f32_d64_u4, float, 64, 4, 1)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_f32_d128_u4, float, 128, 4, 1)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_f16_d64_u4, oasr::f16, 64, 4, 1)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_f16_d128_u4, oasr::f16, 128, 4, 1)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_bf16_d64_u4, oasr::bf16, 64, 4, 1)
OASR_XA_FP8_KERNEL(oasr_cross_attention_fp8_bf16_d128_u4, oasr::bf16, 128, 4, 1)
