// Paged decode attention: one query token per row over a paged KV cache.
//
//   out[b, h, :] = softmax(q[b, h, :] . K[b, j, h, :] * scale, j < len[b]) @ V[b, j, h, :]
//
// K/V live in pools of shape (num_blocks, block_size, H_kv, D) (H_kv divides H: grouped-query
// attention, query head h reads kv head h / (H / H_kv)); key j of row b is at slot
// tables[b, j / block_size] * block_size + j % block_size. One thread block per (head, row).
//
// Compiled by NVRTC (through CuPy) with no headers: fp16/bf16 are handled as raw 16-bit words,
// converted with PTX (fp16) or bit shifts (bf16). All arithmetic is fp32.
//
// Shared memory (dynamic, sized by the launcher):
//   long long tbl[nb]                  the row's block ids
//   float     part[NWARPS * D]         per-warp partial outputs
//   float     red_max[NWARPS], red_sum[NWARPS]
//   float     scores[nb * block_size]  scores, then unnormalised probabilities

namespace oasr_pda {

constexpr int kThreads = 128;  // the launcher uses the same number
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;  // 16-byte loads each thread keeps in flight per round

struct alignas(16) Vec16 {
  unsigned int x, y, z, w;
};

__device__ __forceinline__ float half_bits_to_float(unsigned int bits) {
  unsigned short h = (unsigned short)(bits & 0xffffu);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (unsigned short)(u >> 16);
}

// KIND 0: float32, 1: float16, 2: bfloat16
template <int KIND> struct Elem;

template <> struct Elem<0> {
  typedef float T;
  static constexpr int kPerVec = 4;
  static __device__ __forceinline__ float load1(const T* p) { return *p; }
  static __device__ __forceinline__ void unpack(const Vec16& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ T pack1(float f) { return f; }
};

template <> struct Elem<1> {
  typedef unsigned short T;
  static constexpr int kPerVec = 8;
  static __device__ __forceinline__ float load1(const T* p) { return half_bits_to_float(*p); }
  static __device__ __forceinline__ void unpack(const Vec16& v, float* f) {
    // little endian: the lower 16 bits hold the element at the lower address
    f[0] = half_bits_to_float(v.x);
    f[1] = half_bits_to_float(v.x >> 16);
    f[2] = half_bits_to_float(v.y);
    f[3] = half_bits_to_float(v.y >> 16);
    f[4] = half_bits_to_float(v.z);
    f[5] = half_bits_to_float(v.z >> 16);
    f[6] = half_bits_to_float(v.w);
    f[7] = half_bits_to_float(v.w >> 16);
  }
  static __device__ __forceinline__ T pack1(float f) { return float_to_half_bits(f); }
};

template <> struct Elem<2> {
  typedef unsigned short T;
  static constexpr int kPerVec = 8;
  static __device__ __forceinline__ float load1(const T* p) {
    return __uint_as_float(((unsigned int)*p) << 16);
  }
  static __device__ __forceinline__ void unpack(const Vec16& v, float* f) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16);
    f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16);
    f[7] = __uint_as_float(v.w & 0xffff0000u);
  }
  static __device__ __forceinline__ T pack1(float f) { return float_to_bf16_bits(f); }
};

}  // namespace oasr_pda

extern __shared__ long long oasr_pda_smem[];

namespace oasr_pda {

// One round of kUnroll 16-byte loads of this thread's keys (zeros past the row's length) from a
// K or V pool: both passes read their pool the same way.
template <typename T>
__device__ __forceinline__ void load_round(Vec16 (&raw)[kUnroll], const T* __restrict__ pool,
                                           const long long* tbl, int base, int first, int kpb,
                                           int len, int block_size, long long slot_stride,
                                           long long head_off) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int j = base + u * kpb + first;
    if (j < len) {
      const long long slot = tbl[j / block_size] * block_size + (j % block_size);
      raw[u] = *reinterpret_cast<const Vec16*>(pool + slot * slot_stride + head_off);
    } else {
      raw[u] = Vec16{0u, 0u, 0u, 0u};
    }
  }
}

// Each key of D elements is read as G 16-byte vectors by G neighbouring lanes; a warp covers
// KPW = 32 / G keys per load and the block KPB = 4 * KPW; every thread issues kUnroll loads
// before using them so enough bytes are in flight to stream the pools at memory speed.
template <int KIND, int D>
__device__ __forceinline__ void paged_decode_attention(
    const void* __restrict__ q_raw, long long q_stride_b, long long q_stride_h,
    const void* __restrict__ k_raw, const void* __restrict__ v_raw,
    const long long* __restrict__ tables, const long long* __restrict__ lengths,
    void* __restrict__ out_raw, int num_heads, int num_kv_heads, int nb, int block_size,
    float scale) {
  typedef Elem<KIND> E;
  typedef typename E::T T;
  constexpr int EPL = E::kPerVec;  // elements per lane per load
  constexpr int G = D / EPL;       // lanes per key
  constexpr int KPW = 32 / G;      // keys per warp per load
  constexpr int KPB = kWarps * KPW;
  constexpr int STEP = kUnroll * KPB;  // keys per block per round
  static_assert(D % EPL == 0 && G >= 1 && G <= 32 && 32 % G == 0, "unsupported head size");

  const int h = blockIdx.x;
  const long long b = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane % G;   // which 16-byte piece of the key this lane reads
  const int ks = lane / G;  // which of the warp's KPW keys

  const int max_keys = nb * block_size;
  const long long len_raw = lengths[b];
  const int len = (int)(len_raw < 0 ? 0 : (len_raw > max_keys ? max_keys : len_raw));

  long long* tbl = oasr_pda_smem;
  float* part = reinterpret_cast<float*>(oasr_pda_smem + nb);
  float* red_max = part + kWarps * D;
  float* red_sum = red_max + kWarps;
  float* scores = red_sum + kWarps;

  const int used_blocks = (len + block_size - 1) / block_size;
  for (int i = tid; i < used_blocks; i += kThreads) tbl[i] = tables[b * nb + i];

  const T* q = static_cast<const T*>(q_raw) + b * q_stride_b + (long long)h * q_stride_h + g * EPL;
  float qf[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) qf[i] = E::load1(q + i) * scale;
  __syncthreads();

  const T* K = static_cast<const T*>(k_raw);
  const T* V = static_cast<const T*>(v_raw);
  const long long slot_stride = (long long)num_kv_heads * D;  // elements per slot
  const int kv_head = h / (num_heads / num_kv_heads);  // the group's shared key/value head
  const long long head_off = (long long)kv_head * D + g * EPL;
  const int first = warp * KPW + ks;  // this thread's key within a round, before u * KPB

  // Pass 1: scores[j] = q . K[j] * scale
  for (int base = 0; base < len; base += STEP) {
    Vec16 raw[kUnroll];
    load_round(raw, K, tbl, base, first, KPB, len, block_size, slot_stride, head_off);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[EPL];
      E::unpack(raw[u], kf);
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < EPL; ++i) s = fmaf(qf[i], kf[i], s);
#pragma unroll
      for (int off = G / 2; off > 0; off >>= 1) s += __shfl_xor_sync(OASR_FULL_MASK, s, off);
      const int j = base + u * KPB + first;
      if (g == 0 && j < len) scores[j] = s;
    }
  }
  __syncthreads();

  // Softmax numerators in place, and their sum
  const float sum = oasr::block_softmax_numerators<kWarps>(scores, len, red_max, red_sum);

  // Pass 2: acc = sum_j p[j] * V[j] over this thread's keys and EPL output dims.
  float acc[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) acc[i] = 0.f;
  for (int base = 0; base < len; base += STEP) {
    Vec16 raw[kUnroll];
    load_round(raw, V, tbl, base, first, KPB, len, block_size, slot_stride, head_off);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * KPB + first;
      if (j < len) {
        const float p = scores[j];
        float vf[EPL];
        E::unpack(raw[u], vf);
#pragma unroll
        for (int i = 0; i < EPL; ++i) acc[i] = fmaf(p, vf[i], acc[i]);
      }
    }
  }
  // Lanes with the same g hold the same output dims for different keys: add them up.
#pragma unroll
  for (int off = G; off < 32; off <<= 1) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) acc[i] += __shfl_xor_sync(OASR_FULL_MASK, acc[i], off);
  }
  if (ks == 0) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) part[warp * D + g * EPL + i] = acc[i];
  }
  __syncthreads();

  const float inv = sum > 0.f ? 1.f / sum : 0.f;  // len == 0 (never valid input) writes zeros
  T* out = static_cast<T*>(out_raw) + (b * num_heads + h) * D;
  for (int d = tid; d < D; d += kThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += part[w * D + d];
    out[d] = E::pack1(o * inv);
  }
}

}  // namespace oasr_pda

#define OASR_PDA_KERNEL(NAME, KIND, D)                                                        \
  extern "C" __global__ void NAME(                                                            \
      const void* __restrict__ q, long long q_stride_b, long long q_stride_h,                 \
      const void* __restrict__ k, const void* __restrict__ v,                                 \
      const long long* __restrict__ tables, const long long* __restrict__ lengths,            \
      void* __restrict__ out, int num_heads, int num_kv_heads, int nb, int block_size,        \
      float scale) {                                                                          \
    oasr_pda::paged_decode_attention<KIND, D>(q, q_stride_b, q_stride_h, k, v, tables,        \
                                              lengths, out, num_heads, num_kv_heads, nb,      \
                                              block_size, scale);                             \
  }

OASR_PDA_KERNEL(oasr_paged_decode_attention_f32_d64, 0, 64)
OASR_PDA_KERNEL(oasr_paged_decode_attention_f32_d128, 0, 128)
OASR_PDA_KERNEL(oasr_paged_decode_attention_f16_d64, 1, 64)
OASR_PDA_KERNEL(oasr_paged_decode_attention_f16_d128, 1, 128)
OASR_PDA_KERNEL(oasr_paged_decode_attention_bf16_d64, 2, 64)
OASR_PDA_KERNEL(oasr_paged_decode_attention_bf16_d128, 2, 128)
