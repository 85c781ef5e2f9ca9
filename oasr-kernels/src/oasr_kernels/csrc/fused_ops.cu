// Fused elementwise / normalisation / convolution kernels for oasr.layers' fused ops
// (oasr-core/src/oasr/layers/fused.py holds each op's native reference). common.cuh is prepended.
//
// Every kernel reads and writes the dtype T (float, f16, bf16) and computes in fp32. Where the
// native op rounds an intermediate to T (the residual sum, GLU's output, ...), the kernel rounds
// it the same way, so the kernel differs from the native op only by fp32 summation order.
//
// Launch parameters that are not fixed here (threads per block, tiles) come from the launcher,
// which reads them from the autotune cache (oasr.tune).

namespace oasr {

// ---------------------------------------------------------------- residual add + layer norm
// One block per row of D elements: s = x + r (rounded to T, written to sum_out), then
// layer_norm(s) * w + b (mode 0) or rms_norm(s) * w (mode 1) written to out. r == nullptr: no
// residual (sum_out is not written). Statistics in fp32, two passes for the variance.
//
// add_norm_vec: rows of whole 16-byte vectors (the launcher checks D % (16 / sizeof(T)) == 0
// and alignment); thread t holds vectors t, t + blockDim.x, ... (VPT of them) in registers
// between the passes; 32 floats of shared memory for the reductions.
template <typename T, int MODE, int VPT>
__device__ __forceinline__ void add_norm_vec(const T* __restrict__ x, const T* __restrict__ r,
                                             const T* __restrict__ w, const T* __restrict__ b,
                                             T* __restrict__ sum_out, T* __restrict__ out, int D,
                                             float eps) {
  extern __shared__ float oasr_fused_smem[];
  float* red = oasr_fused_smem;
  constexpr int N = VecTraits<T>::N;
  const long long base = (long long)blockIdx.x * D;
  const int units = D / N;
  float v[VPT][N];
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int u = threadIdx.x + j * blockDim.x;
    if (u < units) {
      load_vec<T>(x + base + (long long)u * N, v[j]);
      if (r != nullptr) {
        float rv[N];
        load_vec<T>(r + base + (long long)u * N, rv);
#pragma unroll
        for (int k = 0; k < N; ++k) v[j][k] = round_to<T>(v[j][k] + rv[k]);
        store_vec<T>(sum_out + base + (long long)u * N, v[j]);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) acc += (MODE == 0) ? v[j][k] : v[j][k] * v[j][k];
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) v[j][k] = 0.f;
    }
  }
  const float total = block_sum(acc, red);
  float mean = 0.f, rstd;
  if (MODE == 0) {
    mean = total / D;
    float var = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      if (threadIdx.x + j * blockDim.x < units) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float c = v[j][k] - mean;
          var += c * c;
        }
      }
    }
    var = block_sum(var, red);
    rstd = rsqrtf(var / D + eps);
  } else {
    rstd = rsqrtf(total / D + eps);
  }
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int u = threadIdx.x + j * blockDim.x;
    if (u >= units) continue;
    float wv[N], bv[N], y[N];
    load_vec<T>(w + u * N, wv);
    if (MODE == 0) load_vec<T>(b + u * N, bv);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (MODE == 0) {
        y[k] = (v[j][k] - mean) * rstd * wv[k] + bv[k];
      } else {
        // the native op normalises in fp32, casts to T, then scales by the weight in T
        y[k] = wv[k] * round_to<T>(v[j][k] * rstd);
      }
    }
    store_vec<T>(out + base + (long long)u * N, y);
  }
}

// add_norm: any D; the row is kept in dynamic shared memory (D floats, then 32 for the
// reductions) between the passes.
template <typename T, int MODE>
__device__ __forceinline__ void add_norm(const T* __restrict__ x, const T* __restrict__ r,
                                         const T* __restrict__ w, const T* __restrict__ b,
                                         T* __restrict__ sum_out, T* __restrict__ out, int D,
                                         float eps) {
  extern __shared__ float oasr_fused_smem[];
  float* row = oasr_fused_smem;
  float* red = oasr_fused_smem + D;
  const long long base = (long long)blockIdx.x * D;
  float acc = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float s = to_float(x[base + i]);
    if (r != nullptr) {
      s = round_to<T>(s + to_float(r[base + i]));
      sum_out[base + i] = from_float<T>(s);
    }
    row[i] = s;
    acc += (MODE == 0) ? s : s * s;
  }
  const float total = block_sum(acc, red);
  float mean = 0.f, rstd;
  if (MODE == 0) {
    mean = total / D;
    float var = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float c = row[i] - mean;
      var += c * c;
    }
    var = block_sum(var, red);
    rstd = rsqrtf(var / D + eps);
  } else {
    rstd = rsqrtf(total / D + eps);
  }
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float y;
    if (MODE == 0) {
      y = (row[i] - mean) * rstd * to_float(w[i]) + to_float(b[i]);
    } else {
      y = to_float(w[i]) * round_to<T>(row[i] * rstd);
    }
    out[base + i] = from_float<T>(y);
  }
}

// ---------------------------------------------------------------- bias + activation
// out[i] = act(x[i] + bias[i % D]) over n contiguous elements, grid-stride.
// ACT 0: exact (erf) GELU, 1: SiLU / Swish. VEC: 16-byte vectors (the launcher checks
// D % (16 / sizeof(T)) == 0 and alignment; then n is a multiple too).
template <int ACT>
__device__ __forceinline__ float activate(float s) {
  if (ACT == 0) return 0.5f * s * (1.f + erff(s * 0.70710678118654752f));
  return s / (1.f + expf(-s));
}

template <typename T, int ACT, bool VEC>
__device__ __forceinline__ void bias_act(const T* __restrict__ x, const T* __restrict__ bias,
                                         T* __restrict__ out, long long n, int D) {
  constexpr int N = VEC ? VecTraits<T>::N : 1;
  const long long units = n / N;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += stride) {
    const long long i0 = u * N;
    float s[N];
    if constexpr (VEC) {
      load_vec<T>(x + i0, s);
    } else {
      s[0] = to_float(x[i0]);
    }
    if (bias != nullptr) {
      const int c0 = (int)(i0 % D);
      float bv[N];
      if constexpr (VEC) {
        load_vec<T>(bias + c0, bv);
      } else {
        bv[0] = to_float(bias[c0]);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) s[k] = round_to<T>(s[k] + bv[k]);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) s[k] = activate<ACT>(s[k]);
    if constexpr (VEC) {
      store_vec<T>(out + i0, s);
    } else {
      out[i0] = from_float<T>(s[0]);
    }
  }
}

// ---------------------------------------------------------------- GLU + depthwise conv1d
// x (B, 2C, Tin) contiguous; g = x[:, :C] * sigmoid(x[:, C:]) (rounded to T, as F.glu's output);
// out[b, c, t] = bias[c] + sum_k w[c, k] * g[b, c, t + k - P] (zero outside [0, Tin)),
// t < Tout = Tin + 2P - K + 1. Grid (ceil(Tout / (OPT * blockDim.x)), C, B). The block's
// OPT * blockDim.x + K - 1 GLU inputs and the channel's K weights go to shared memory once;
// each thread then computes OPT neighbouring outputs, sliding a window of OPT inputs along the
// taps (one shared-memory read per OPT multiply-adds).
constexpr int kConvOutputsPerThread = 4;

template <typename T>
__device__ __forceinline__ void glu_dwconv(const T* __restrict__ x, const T* __restrict__ w,
                                           const T* __restrict__ bias, T* __restrict__ out, int C,
                                           int Tin, int Tout, int K, int P) {
  constexpr int OPT = kConvOutputsPerThread;
  extern __shared__ float oasr_fused_smem[];
  float* ws = oasr_fused_smem;  // K
  float* g = oasr_fused_smem + K;  // OPT * blockDim.x + K - 1
  const int c = blockIdx.y;
  const long long b = blockIdx.z;
  const int tile = OPT * blockDim.x;
  const int t0 = blockIdx.x * tile;
  const T* xa = x + (b * 2 * C + c) * (long long)Tin;
  const T* xg = xa + (long long)C * Tin;
  for (int k = threadIdx.x; k < K; k += blockDim.x) ws[k] = to_float(w[(long long)c * K + k]);
  const int span = tile + K - 1;
  for (int i = threadIdx.x; i < span; i += blockDim.x) {
    const int p = t0 - P + i;
    float v = 0.f;
    if (p >= 0 && p < Tin) {
      const float gate = to_float(xg[p]);
      v = round_to<T>(to_float(xa[p]) * (1.f / (1.f + expf(-gate))));
    }
    g[i] = v;
  }
  __syncthreads();
  const int tb = threadIdx.x * OPT;  // this thread's first output within the tile
  if (t0 + tb >= Tout) return;
  float acc[OPT], win[OPT];
#pragma unroll
  for (int j = 0; j < OPT; ++j) {
    acc[j] = 0.f;
    win[j] = g[tb + j];
  }
  for (int k = 0; k < K; ++k) {
    const float wk = ws[k];
#pragma unroll
    for (int j = 0; j < OPT; ++j) acc[j] = fmaf(wk, win[j], acc[j]);
#pragma unroll
    for (int j = 0; j < OPT - 1; ++j) win[j] = win[j + 1];
    if (k + 1 < K) win[OPT - 1] = g[tb + OPT + k];
  }
  const float bv = bias != nullptr ? to_float(bias[c]) : 0.f;
  T* o = out + (b * C + c) * (long long)Tout;
#pragma unroll
  for (int j = 0; j < OPT; ++j) {
    const int t = t0 + tb + j;
    if (t < Tout) o[t] = from_float<T>(acc[j] + bv);
  }
}

// The same over frames-major memory (what the Conformer's pointwise GEMM leaves): x (B, Tin, 2C),
// each frame's row [value | gate]; out (B, Tout, C); act 1 applies SiLU to the biased sum (as
// it is rounded to T first, like the native ops). Block: cw channels x (blockDim.x / cw)
// lanes, each lane kBtcOutputsPerThread consecutive output frames, so a block covers a tile of
// lanes * kBtcOutputsPerThread frames; its GLU inputs (tile + K - 1 frames) and weights sit in
// shared memory with the channel fastest (loads coalesced across the channels).
constexpr int kBtcOutputsPerThread = 8;

template <typename T>
__device__ __forceinline__ void glu_dwconv_btc(const T* __restrict__ x, const T* __restrict__ w,
                                               const T* __restrict__ bias, T* __restrict__ out,
                                               int C, int Tin, int Tout, int K, int P, int act,
                                               int cw) {
  constexpr int OPT = kBtcOutputsPerThread;
  extern __shared__ float oasr_fused_smem[];
  const int tx = threadIdx.x % cw, ty = threadIdx.x / cw, lanes = blockDim.x / cw;
  float* ws = oasr_fused_smem;           // K x cw
  float* g = oasr_fused_smem + K * cw;   // (tile + K - 1) x cw
  const int c = blockIdx.y * cw + tx;
  const bool live = c < C;
  const long long b = blockIdx.z;
  const int tile = OPT * lanes;
  const int t0 = blockIdx.x * tile;
  for (int k = ty; k < K; k += lanes)
    ws[k * cw + tx] = live ? to_float(w[(long long)c * K + k]) : 0.f;
  const T* xb = x + b * (long long)Tin * 2 * C;
  const int span = tile + K - 1;
  for (int i = ty; i < span; i += lanes) {
    const int p = t0 - P + i;
    float v = 0.f;
    if (live && p >= 0 && p < Tin) {
      const T* row = xb + (long long)p * 2 * C;
      const float gate = to_float(row[C + c]);
      v = round_to<T>(to_float(row[c]) * (1.f / (1.f + expf(-gate))));
    }
    g[i * cw + tx] = v;
  }
  __syncthreads();
  const int tb = ty * OPT;  // this lane's first output within the tile
  if (!live || t0 + tb >= Tout) return;
  float acc[OPT], win[OPT];
#pragma unroll
  for (int j = 0; j < OPT; ++j) {
    acc[j] = 0.f;
    win[j] = g[(tb + j) * cw + tx];
  }
  for (int k = 0; k < K; ++k) {
    const float wk = ws[k * cw + tx];
#pragma unroll
    for (int j = 0; j < OPT; ++j) acc[j] = fmaf(wk, win[j], acc[j]);
#pragma unroll
    for (int j = 0; j < OPT - 1; ++j) win[j] = win[j + 1];
    if (k + 1 < K) win[OPT - 1] = g[(tb + OPT + k) * cw + tx];
  }
  const float bv = bias != nullptr ? to_float(bias[c]) : 0.f;
  T* o = out + b * (long long)Tout * C + c;
#pragma unroll
  for (int j = 0; j < OPT; ++j) {
    const int t = t0 + tb + j;
    if (t < Tout) {
      float v = acc[j] + bv;
      if (act == 1) {
        v = round_to<T>(v);
        v = v / (1.f + expf(-v));
      }
      o[(long long)t * C] = from_float<T>(v);
    }
  }
}

// ---------------------------------------------------------------- log-mel from an STFT
// spec: the STFT as floats (re, im) with strides sb, sf, st (in floats; re at +0, im at +1);
// out (B, M, frames) float: log10(max(sum_f filt[m, f] * |spec[b, f, t]|^2, 1e-10)).
// The mel filters are sparse: filter m is non-zero only on bins [lo[m], hi[m]). Grid
// (ceil(frames / TT), B); the tile's power spectrum (F x TT floats, rows padded to TT + 1) is
// computed once into shared memory, reading along whichever of f and t is contiguous
// (f_fastest: torch.stft's layout), then each thread writes outputs with t fastest.
__device__ __forceinline__ void log_mel(const float* __restrict__ spec, long long sb, long long sf,
                                        long long st, const float* __restrict__ filt,
                                        const int* __restrict__ lo, const int* __restrict__ hi,
                                        float* __restrict__ out, int F, int M, int frames, int TT,
                                        int f_fastest) {
  extern __shared__ float oasr_fused_smem[];
  float* power = oasr_fused_smem;  // F * (TT + 1)
  const int ld = TT + 1;
  const long long b = blockIdx.y;
  const int t0 = blockIdx.x * TT;
  for (int i = threadIdx.x; i < F * TT; i += blockDim.x) {
    const int f = f_fastest ? i % F : i / TT;
    const int tt = f_fastest ? i / F : i % TT;
    const int t = t0 + tt;
    float p = 0.f;
    if (t < frames) {
      const float* z = spec + b * sb + f * sf + t * st;
      p = z[0] * z[0] + z[1] * z[1];
    }
    power[f * ld + tt] = p;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < M * TT; i += blockDim.x) {
    const int m = i / TT, tt = i % TT;
    const int t = t0 + tt;
    if (t >= frames) continue;
    float acc = 0.f;
    const float* fm = filt + (long long)m * F;
    for (int f = lo[m]; f < hi[m]; ++f) acc = fmaf(fm[f], power[f * ld + tt], acc);
    out[(b * M + m) * (long long)frames + t] = log10f(fmaxf(acc, 1e-10f));
  }
}

}  // namespace oasr

#define OASR_ADD_NORM(NAME, T, MODE)                                                         \
  extern "C" __global__ void NAME(const T* x, const T* r, const T* w, const T* b, T* sum_out, \
                                  T* out, int D, float eps) {                                \
    oasr::add_norm<T, MODE>(x, r, w, b, sum_out, out, D, eps);                               \
  }
#define OASR_ADD_NORM_VEC(NAME, T, MODE, VPT)                                                \
  extern "C" __global__ void NAME(const T* x, const T* r, const T* w, const T* b, T* sum_out, \
                                  T* out, int D, float eps) {                                \
    oasr::add_norm_vec<T, MODE, VPT>(x, r, w, b, sum_out, out, D, eps);                      \
  }
#define OASR_BIAS_ACT(NAME, T, ACT, VEC)                                                     \
  extern "C" __global__ void NAME(const T* x, const T* bias, T* out, long long n, int D) {   \
    oasr::bias_act<T, ACT, VEC>(x, bias, out, n, D);                                          \
  }
#define OASR_GLU_DWCONV(NAME, T)                                                             \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* bias, T* out, int C,      \
                                  int Tin, int Tout, int K, int P) {                         \
    oasr::glu_dwconv<T>(x, w, bias, out, C, Tin, Tout, K, P);                                \
  }

#define OASR_GLU_DWCONV_BTC(NAME, T)                                                         \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* bias, T* out, int C,      \
                                  int Tin, int Tout, int K, int P, int act, int cw) {        \
    oasr::glu_dwconv_btc<T>(x, w, bias, out, C, Tin, Tout, K, P, act, cw);                   \
  }

OASR_ADD_NORM(oasr_add_layer_norm_f32, float, 0)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_f32_v1, float, 0, 1)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_f32_v2, float, 0, 2)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_f32_v4, float, 0, 4)
OASR_ADD_NORM(oasr_add_layer_norm_f16, oasr::f16, 0)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_f16_v1, oasr::f16, 0, 1)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_f16_v2, oasr::f16, 0, 2)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_f16_v4, oasr::f16, 0, 4)
OASR_ADD_NORM(oasr_add_layer_norm_bf16, oasr::bf16, 0)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_bf16_v1, oasr::bf16, 0, 1)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_bf16_v2, oasr::bf16, 0, 2)
OASR_ADD_NORM_VEC(oasr_add_layer_norm_bf16_v4, oasr::bf16, 0, 4)
OASR_ADD_NORM(oasr_add_rms_norm_f32, float, 1)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_f32_v1, float, 1, 1)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_f32_v2, float, 1, 2)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_f32_v4, float, 1, 4)
OASR_ADD_NORM(oasr_add_rms_norm_f16, oasr::f16, 1)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_f16_v1, oasr::f16, 1, 1)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_f16_v2, oasr::f16, 1, 2)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_f16_v4, oasr::f16, 1, 4)
OASR_ADD_NORM(oasr_add_rms_norm_bf16, oasr::bf16, 1)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_bf16_v1, oasr::bf16, 1, 1)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_bf16_v2, oasr::bf16, 1, 2)
OASR_ADD_NORM_VEC(oasr_add_rms_norm_bf16_v4, oasr::bf16, 1, 4)
OASR_BIAS_ACT(oasr_bias_gelu_f32, float, 0, false)
OASR_BIAS_ACT(oasr_bias_gelu_f16, oasr::f16, 0, false)
OASR_BIAS_ACT(oasr_bias_gelu_bf16, oasr::bf16, 0, false)
OASR_BIAS_ACT(oasr_bias_silu_f32, float, 1, false)
OASR_BIAS_ACT(oasr_bias_silu_f16, oasr::f16, 1, false)
OASR_BIAS_ACT(oasr_bias_silu_bf16, oasr::bf16, 1, false)
OASR_BIAS_ACT(oasr_bias_gelu_f32_v, float, 0, true)
OASR_BIAS_ACT(oasr_bias_gelu_f16_v, oasr::f16, 0, true)
OASR_BIAS_ACT(oasr_bias_gelu_bf16_v, oasr::bf16, 0, true)
OASR_BIAS_ACT(oasr_bias_silu_f32_v, float, 1, true)
OASR_BIAS_ACT(oasr_bias_silu_f16_v, oasr::f16, 1, true)
OASR_BIAS_ACT(oasr_bias_silu_bf16_v, oasr::bf16, 1, true)
OASR_GLU_DWCONV(oasr_glu_dwconv_f32, float)
OASR_GLU_DWCONV(oasr_glu_dwconv_f16, oasr::f16)
OASR_GLU_DWCONV(oasr_glu_dwconv_bf16, oasr::bf16)
OASR_GLU_DWCONV_BTC(oasr_glu_dwconv_btc_f32, float)
OASR_GLU_DWCONV_BTC(oasr_glu_dwconv_btc_f16, oasr::f16)
OASR_GLU_DWCONV_BTC(oasr_glu_dwconv_btc_bf16, oasr::bf16)

extern "C" __global__ void oasr_log_mel_f32(const float* spec, long long sb, long long sf,
                                            long long st, const float* filt, const int* lo,
                                            const int* hi, float* out, int F, int M, int frames,
                                            int TT, int f_fastest) {
  oasr::log_mel(spec, sb, sf, st, filt, lo, hi, out, F, M, frames, TT, f_fastest);
}
