// Paged decode attention over an fp8 KV cache (oasr.kv_cache.PagedKVCache, kv_dtype="fp8"):
//
//   out[b, h, :] = softmax(q[b, h, :] . K[j] * scale, j < len[b]) @ V[j]
//   K[j] = k_scale[slot(j), kvh] * e4m3(k_pool[slot(j), kvh, :])   (V likewise)
//
// Pools (num_blocks, block_size, H_kv, D) of e4m3 bytes; scales (num_blocks, block_size, H_kv)
// float32, one per key/value vector; key j of row b is at slot tables[b, j / block_size] *
// block_size + j % block_size; query head h reads kv head h / (H / H_kv). One thread block per
// (head, row), 128 threads. Each key is read as D / 8 lanes x 8 bytes; e4m3 is decoded with
// integer operations (no fp8 instruction needed: any SM75+ GPU runs it). All arithmetic fp32.
//
// Shared memory (dynamic, sized by the launcher):
//   long long tbl[nb]; float part[kWarps * D], red_max[kWarps], red_sum[kWarps],
//   scores[nb * block_size]

namespace oasr_fp8 {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kEpl = 8;  // fp8 elements (bytes) per lane per load

struct alignas(8) Bytes8 {  // (no CUDA header under NVRTC: no uint2)
  unsigned int lo, hi;
};

// float8 e4m3 (finite, "fn": no infinities; the cache never stores NaN) to float
__device__ __forceinline__ float e4m3_to_float(unsigned int b) {
  const unsigned int sign = (b & 0x80u) << 24;
  const unsigned int e = (b >> 3) & 0xFu;
  const unsigned int m = b & 0x7u;
  if (e == 0u) {
    const float f = (float)m * 0.001953125f;  // subnormal: m * 2^-9
    return sign ? -f : f;
  }
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));  // 2^(e-7) * (1 + m/8)
}

__device__ __forceinline__ void unpack8(unsigned int lo, unsigned int hi, float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[i] = e4m3_to_float((lo >> (8 * i)) & 0xffu);
    f[4 + i] = e4m3_to_float((hi >> (8 * i)) & 0xffu);
  }
}

template <typename T, int D>
__device__ __forceinline__ void decode_fp8(const T* __restrict__ q_all, long long q_stride_b,
                                           long long q_stride_h,
                                           const unsigned char* __restrict__ k_pool,
                                           const unsigned char* __restrict__ v_pool,
                                           const float* __restrict__ k_scale,
                                           const float* __restrict__ v_scale,
                                           const long long* __restrict__ tables,
                                           const long long* __restrict__ lengths,
                                           T* __restrict__ out_all, int num_heads,
                                           int num_kv_heads, int nb, int block_size,
                                           float scale) {
  constexpr int G = D / kEpl;    // lanes per key
  constexpr int KPW = 32 / G;    // keys per warp per step
  constexpr int KPB = kWarps * KPW;
  static_assert(D % kEpl == 0 && 32 % G == 0, "unsupported head size");

  extern __shared__ long long smem[];
  const int h = blockIdx.x;
  const long long b = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane % G, ks = lane / G;

  const int max_keys = nb * block_size;
  const long long len_raw = lengths[b];
  const int len = (int)(len_raw < 0 ? 0 : (len_raw > max_keys ? max_keys : len_raw));

  long long* tbl = smem;
  float* part = reinterpret_cast<float*>(smem + nb);
  float* red_max = part + kWarps * D;
  float* red_sum = red_max + kWarps;
  float* scores = red_sum + kWarps;

  const int used = (len + block_size - 1) / block_size;
  for (int i = tid; i < used; i += kThreads) tbl[i] = tables[b * nb + i];

  const T* q = q_all + b * q_stride_b + (long long)h * q_stride_h + g * kEpl;
  float qf[kEpl];
#pragma unroll
  for (int i = 0; i < kEpl; ++i) qf[i] = oasr::to_float(q[i]) * scale;
  __syncthreads();

  const int kvh = h / (num_heads / num_kv_heads);
  const long long slot_stride = (long long)num_kv_heads * D;  // bytes per slot
  const long long head_off = (long long)kvh * D + g * kEpl;

  // Pass 1: scores
  for (int base = 0; base < len; base += KPB) {
    const int j = base + warp * KPW + ks;
    float s = 0.f;
    if (j < len) {
      const long long slot = tbl[j / block_size] * block_size + (j % block_size);
      const Bytes8 raw = *reinterpret_cast<const Bytes8*>(k_pool + slot * slot_stride + head_off);
      float kf[kEpl];
      unpack8(raw.lo, raw.hi, kf);
#pragma unroll
      for (int i = 0; i < kEpl; ++i) s = fmaf(qf[i], kf[i], s);
      s *= k_scale[slot * num_kv_heads + kvh];
    }
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) s += __shfl_xor_sync(OASR_FULL_MASK, s, off);
    if (g == 0 && j < len) scores[j] = s;
  }
  __syncthreads();

  // Softmax numerators in place, and their sum
  const float sum = oasr::block_softmax_numerators<kWarps>(scores, len, red_max, red_sum);

  // Pass 2: acc = sum_j p[j] * v_scale[j] * V[j]
  float acc[kEpl];
#pragma unroll
  for (int i = 0; i < kEpl; ++i) acc[i] = 0.f;
  for (int base = 0; base < len; base += KPB) {
    const int j = base + warp * KPW + ks;
    if (j < len) {
      const long long slot = tbl[j / block_size] * block_size + (j % block_size);
      const Bytes8 raw = *reinterpret_cast<const Bytes8*>(v_pool + slot * slot_stride + head_off);
      const float p = scores[j] * v_scale[slot * num_kv_heads + kvh];
      float vf[kEpl];
      unpack8(raw.lo, raw.hi, vf);
#pragma unroll
      for (int i = 0; i < kEpl; ++i) acc[i] = fmaf(p, vf[i], acc[i]);
    }
  }
#pragma unroll
  for (int off = G; off < 32; off <<= 1) {
#pragma unroll
    for (int i = 0; i < kEpl; ++i) acc[i] += __shfl_xor_sync(OASR_FULL_MASK, acc[i], off);
  }
  if (ks == 0) {
#pragma unroll
    for (int i = 0; i < kEpl; ++i) part[warp * D + g * kEpl + i] = acc[i];
  }
  __syncthreads();
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  T* out = out_all + (b * num_heads + h) * D;
  for (int d = tid; d < D; d += kThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += part[w * D + d];
    out[d] = oasr::from_float<T>(o * inv);
  }
}

}  // namespace oasr_fp8

#define OASR_PDA_FP8_KERNEL(NAME, T, D)                                                        \
  extern "C" __global__ void NAME(                                                             \
      const T* __restrict__ q, long long q_stride_b, long long q_stride_h,                     \
      const unsigned char* __restrict__ k, const unsigned char* __restrict__ v,                \
      const float* __restrict__ ks, const float* __restrict__ vs,                              \
      const long long* __restrict__ tables, const long long* __restrict__ lengths,             \
      T* __restrict__ out, int num_heads, int num_kv_heads, int nb, int block_size,            \
      float scale) {                                                                           \
    oasr_fp8::decode_fp8<T, D>(q, q_stride_b, q_stride_h, k, v, ks, vs, tables, lengths, out,  \
                               num_heads, num_kv_heads, nb, block_size, scale);                \
  }

OASR_PDA_FP8_KERNEL(oasr_paged_decode_attention_fp8_f32_d64, float, 64)
OASR_PDA_FP8_KERNEL(oasr_paged_decode_attention_fp8_f32_d128, float, 128)
OASR_PDA_FP8_KERNEL(oasr_paged_decode_attention_fp8_f16_d64, oasr::f16, 64)
OASR_PDA_FP8_KERNEL(oasr_paged_decode_attention_fp8_f16_d128, oasr::f16, 128)
OASR_PDA_FP8_KERNEL(oasr_paged_decode_attention_fp8_bf16_d64, oasr::bf16, 64)
OASR_PDA_FP8_KERNEL(oasr_paged_decode_attention_fp8_bf16_d128, oasr::bf16, 128)
