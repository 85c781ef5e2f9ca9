// Rotary position embedding of the queries and keys of one fused q/k/v projection, in one pass.
//
//   x (B, T, H + H_kv, D): any batch, token and head strides, the last axis contiguous
//   cos, ssin (B, T, D): cos and the signed sine (its first half negated), any batch and
//   token strides (0: broadcast)
//   y[j] = round(round(x[j] * cos[j]) + round(x[j ^ half] * ssin[j]))    (halves swapped)
//
// Each product and the sum are rounded to T as the native ops round them (a multiply, a
// multiply and an add, each a kernel), so y is the native result bit for bit; __fmul_rn /
// __fadd_rn keep the compiler from fusing them into an FMA. Heads h < H go to q (B, T, H, D),
// the others to k (B, T, H_kv, D), both contiguous.
//
// Grid (tokens, head groups): block (tok, g) does the (head, j < half) pairs
// [g * group_pairs, (g + 1) * group_pairs) of token tok. A block per token alone left a 32-row
// decode step with 32 blocks on a 132-SM GPU (18 us a call at Qwen-7B width). rotary_qk_vec
// below is the launcher's choice wherever the rows are whole, aligned 16-byte vectors.

namespace oasr_rope {

template <typename T>
__device__ __forceinline__ void rotary_qk(const T* __restrict__ x, long long xb, long long xt,
                                          long long xh, const T* __restrict__ cosv, long long cb,
                                          long long ct, const T* __restrict__ ssin, long long sb,
                                          long long st, T* __restrict__ q, T* __restrict__ k,
                                          int t_len, int heads, int kv_heads, int d,
                                          int group_pairs) {
  const long long tok = blockIdx.x;
  const long long b = tok / t_len;
  const long long t = tok % t_len;
  const int half = d / 2;
  const int pairs = (heads + kv_heads) * half;
  const T* xr = x + b * xb + t * xt;
  const T* cr = cosv + b * cb + t * ct;
  const T* sr = ssin + b * sb + t * st;
  const int first = blockIdx.y * group_pairs;
  const int end = min(pairs, first + group_pairs);
  for (int p = first + threadIdx.x; p < end; p += blockDim.x) {
    const int h = p / half;
    const int j = p - h * half;
    const T* xh_ = xr + (long long)h * xh;
    const float lo = oasr::to_float(xh_[j]);
    const float hi = oasr::to_float(xh_[j + half]);
    const float a_lo = oasr::round_to<T>(__fmul_rn(lo, oasr::to_float(cr[j])));
    const float b_lo = oasr::round_to<T>(__fmul_rn(hi, oasr::to_float(sr[j])));
    const float a_hi = oasr::round_to<T>(__fmul_rn(hi, oasr::to_float(cr[j + half])));
    const float b_hi = oasr::round_to<T>(__fmul_rn(lo, oasr::to_float(sr[j + half])));
    T* out = h < heads ? q + (tok * heads + h) * (long long)d
                       : k + (tok * kv_heads + (h - heads)) * (long long)d;
    out[j] = oasr::from_float<T>(__fadd_rn(a_lo, b_lo));
    out[j + half] = oasr::from_float<T>(__fadd_rn(a_hi, b_hi));
  }
}

// The same with N = VecTraits<T>::N neighbouring pairs per thread, read and written as 16-byte
// vectors (the launcher checks half % N == 0 and that every row start is 16-byte aligned): a
// decode step's thread then has six vector loads in flight instead of six 2-byte loads. Block
// (tok, g) does the units [g * group_units, (g + 1) * group_units) of token tok, unit u being
// pairs [u * N, u * N + N) of the token's (head, j < half) pairs.
template <typename T>
__device__ __forceinline__ void rotary_qk_vec(const T* __restrict__ x, long long xb, long long xt,
                                              long long xh, const T* __restrict__ cosv,
                                              long long cb, long long ct,
                                              const T* __restrict__ ssin, long long sb,
                                              long long st, T* __restrict__ q,
                                              T* __restrict__ k, int t_len, int heads,
                                              int kv_heads, int d, int group_units) {
  constexpr int N = oasr::VecTraits<T>::N;
  const long long tok = blockIdx.x;
  const long long b = tok / t_len;
  const long long t = tok % t_len;
  const int half = d / 2;
  const int units_per_head = half / N;
  const int units = (heads + kv_heads) * units_per_head;
  const T* xr = x + b * xb + t * xt;
  const T* cr = cosv + b * cb + t * ct;
  const T* sr = ssin + b * sb + t * st;
  const int first = blockIdx.y * group_units;
  const int end = min(units, first + group_units);
  for (int u = first + threadIdx.x; u < end; u += blockDim.x) {
    const int h = u / units_per_head;
    const int j = (u - h * units_per_head) * N;
    const T* xh_ = xr + (long long)h * xh;
    float lo[N], hi[N], c_lo[N], c_hi[N], s_lo[N], s_hi[N], y_lo[N], y_hi[N];
    oasr::load_vec<T>(xh_ + j, lo);
    oasr::load_vec<T>(xh_ + j + half, hi);
    oasr::load_vec<T>(cr + j, c_lo);
    oasr::load_vec<T>(cr + j + half, c_hi);
    oasr::load_vec<T>(sr + j, s_lo);
    oasr::load_vec<T>(sr + j + half, s_hi);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float a_lo = oasr::round_to<T>(__fmul_rn(lo[i], c_lo[i]));
      const float b_lo = oasr::round_to<T>(__fmul_rn(hi[i], s_lo[i]));
      const float a_hi = oasr::round_to<T>(__fmul_rn(hi[i], c_hi[i]));
      const float b_hi = oasr::round_to<T>(__fmul_rn(lo[i], s_hi[i]));
      y_lo[i] = __fadd_rn(a_lo, b_lo);
      y_hi[i] = __fadd_rn(a_hi, b_hi);
    }
    T* out = h < heads ? q + (tok * heads + h) * (long long)d
                       : k + (tok * kv_heads + (h - heads)) * (long long)d;
    oasr::store_vec<T>(out + j, y_lo);
    oasr::store_vec<T>(out + j + half, y_hi);
  }
}

}  // namespace oasr_rope

// FN: rotary_qk (GROUP = pairs a block) or rotary_qk_vec (GROUP = 16-byte units a block)
#define OASR_ROTARY_QK(NAME, T, FN)                                                            \
  extern "C" __global__ void NAME(const T* x, long long xb, long long xt, long long xh,       \
                                  const T* cosv, long long cb, long long ct, const T* ssin,    \
                                  long long sb, long long st, T* q, T* k, int t_len,           \
                                  int heads, int kv_heads, int d, int group) {                 \
    oasr_rope::FN<T>(x, xb, xt, xh, cosv, cb, ct, ssin, sb, st, q, k, t_len, heads, kv_heads,  \
                     d, group);                                                                \
  }

OASR_ROTARY_QK(oasr_rotary_qk_f32, float, rotary_qk)
OASR_ROTARY_QK(oasr_rotary_qk_f16, oasr::f16, rotary_qk)
OASR_ROTARY_QK(oasr_rotary_qk_bf16, oasr::bf16, rotary_qk)
OASR_ROTARY_QK(oasr_rotary_qk_f32_v, float, rotary_qk_vec)
OASR_ROTARY_QK(oasr_rotary_qk_f16_v, oasr::f16, rotary_qk_vec)
OASR_ROTARY_QK(oasr_rotary_qk_bf16_v, oasr::bf16, rotary_qk_vec)

// Gated SiLU of a fused gate/up projection: x (rows, 2H) (gate, then up, per row; contiguous)
//   out (rows, H) = round(silu(gate)) * up,   silu(g) = g / (1 + exp(-g))
// rounded as the native ops round (silu, then the multiply). Grid (rows, column chunks): block
// (row, c) does the row's elements [c * chunk, (c + 1) * chunk). One block per row left a 32-row
// decode step of a 7B model (H = 11008) with 32 blocks looping six times each. VEC: 16-byte
// loads and stores (H a whole number of vectors, 16-byte aligned rows; chunk a multiple of N).

namespace oasr_swiglu {

template <typename T>
__device__ __forceinline__ float silu_mul1(float g, float u) {
  const float s = oasr::round_to<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
  return __fmul_rn(s, u);
}

template <typename T, bool VEC>
__device__ __forceinline__ void silu_mul(const T* __restrict__ x, T* __restrict__ out, int h,
                                         int chunk) {
  const long long row = blockIdx.x;
  const T* g = x + row * 2 * (long long)h;
  const T* u = g + h;
  T* o = out + row * (long long)h;
  const int first = blockIdx.y * chunk;
  const int end = min(h, first + chunk);
  if (VEC) {
    constexpr int N = oasr::VecTraits<T>::N;
    for (int c = first + threadIdx.x * N; c < end; c += blockDim.x * N) {
      float gv[N], uv[N], y[N];
      oasr::load_vec<T>(g + c, gv);
      oasr::load_vec<T>(u + c, uv);
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] = silu_mul1<T>(gv[i], uv[i]);
      oasr::store_vec<T>(o + c, y);
    }
  } else {
    for (int c = first + threadIdx.x; c < end; c += blockDim.x) {
      o[c] = oasr::from_float<T>(silu_mul1<T>(oasr::to_float(g[c]), oasr::to_float(u[c])));
    }
  }
}

}  // namespace oasr_swiglu

#define OASR_SILU_MUL(NAME, T, VEC)                                                            \
  extern "C" __global__ void NAME(const T* x, T* out, int h, int chunk) {                      \
    oasr_swiglu::silu_mul<T, VEC>(x, out, h, chunk);                                           \
  }

OASR_SILU_MUL(oasr_silu_mul_f32, float, false)
OASR_SILU_MUL(oasr_silu_mul_f16, oasr::f16, false)
OASR_SILU_MUL(oasr_silu_mul_bf16, oasr::bf16, false)
OASR_SILU_MUL(oasr_silu_mul_f32_v, float, true)
OASR_SILU_MUL(oasr_silu_mul_f16_v, oasr::f16, true)
OASR_SILU_MUL(oasr_silu_mul_bf16_v, oasr::bf16, true)
