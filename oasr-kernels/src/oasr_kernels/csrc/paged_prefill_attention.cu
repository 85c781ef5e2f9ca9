// Paged prefill attention: a block of T query tokens per row over a paged KV cache, causal.
//
//   query i of row b sits at position p = len[b] - T + i and attends to keys j <= p:
//   out[b, h, i, :] = softmax_j(q[b, h, i, :] . K[b, j, kvh, :] * scale) @ V[b, j, kvh, :]
//
// K/V pools (num_blocks, block_size, H_kv, D); key j of row b is at slot
// tables[b, j / block_size] * block_size + j % block_size; query head h reads kv head
// h / (H / H_kv). common.cuh is prepended.
//
// Flash-style (online softmax, fp32): grid (ceil(T / QB), H, B), blockDim = 32 * W; each warp
// owns QPW = 4 queries (QB = 4 W). The block walks its keys in tiles of KT = 32: the tile's K and
// V are staged in shared memory as fp32 (rows padded to D + 1 floats: lane j reading key j is
// conflict-free), each lane scores one key against a query, and the warp folds the tile into
// the query's running max, sum and output (lane l owns output dims l, l + 32, ...).
//
// Shared memory (dynamic, sized by the launcher):
//   long long tbl[nb]; float qs[QB * D]; float ks[KT * (D + 1)]; float vs[KT * (D + 1)]

namespace oasr_ppa {

constexpr int kKeyTile = 32;
constexpr int kQueriesPerWarp = 4;

template <typename T, int D>
__device__ __forceinline__ void paged_prefill_attention(
    const T* __restrict__ q, long long q_sb, long long q_sh, long long q_st,
    const T* __restrict__ K, const T* __restrict__ V, const long long* __restrict__ tables,
    const long long* __restrict__ lengths, T* __restrict__ out, int T_q, int num_heads,
    int num_kv_heads, int nb, int block_size, float scale) {
  constexpr int DPL = D / 32;  // output dims per lane
  extern __shared__ long long oasr_ppa_smem[];
  const int warps = blockDim.x >> 5;
  const int qb = warps * kQueriesPerWarp;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.y;
  const long long b = blockIdx.z;
  const int i0 = blockIdx.x * qb;  // first query of the block

  long long* tbl = oasr_ppa_smem;
  float* qs = reinterpret_cast<float*>(oasr_ppa_smem + nb);
  float* ks = qs + qb * D;
  float* vs = ks + kKeyTile * (D + 1);

  const int max_keys = nb * block_size;
  const long long len_raw = lengths[b];
  const int len = (int)(len_raw < 0 ? 0 : (len_raw > max_keys ? max_keys : len_raw));
  const int first_pos = len - T_q;  // position of query 0
  // keys this block needs: up to its last query's position
  const int last_q = min(T_q, i0 + qb) - 1;
  const int kend = min(len, first_pos + last_q + 1);

  const int used_blocks = (len + block_size - 1) / block_size;
  for (int i = threadIdx.x; i < used_blocks; i += blockDim.x) tbl[i] = tables[b * nb + i];
  for (int i = threadIdx.x; i < qb * D; i += blockDim.x) {
    const int qi = i / D, d = i % D;
    const int t = i0 + qi;
    float v = 0.f;
    if (t < T_q) {
      v = oasr::to_float(q[b * q_sb + (long long)h * q_sh + (long long)t * q_st + d]) * scale;
    }
    qs[i] = v;
  }

  const int kv_head = h / (num_heads / num_kv_heads);
  const long long slot_stride = (long long)num_kv_heads * D;
  const long long head_off = (long long)kv_head * D;

  float m[kQueriesPerWarp], l[kQueriesPerWarp], acc[kQueriesPerWarp][DPL];
  int pos[kQueriesPerWarp];
#pragma unroll
  for (int u = 0; u < kQueriesPerWarp; ++u) {
    m[u] = OASR_NEG_INF;
    l[u] = 0.f;
    const int t = i0 + warp * kQueriesPerWarp + u;
    pos[u] = t < T_q ? first_pos + t : -1;  // -1: no query (or no key to see)
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[u][e] = 0.f;
  }

  for (int kt = 0; kt < kend; kt += kKeyTile) {
    __syncthreads();  // the previous tile is consumed (and tbl / qs written, first time)
    for (int i = threadIdx.x; i < kKeyTile * D; i += blockDim.x) {
      const int j = i / D, d = i % D;
      const int key = kt + j;
      float kv = 0.f, vv = 0.f;
      if (key < kend) {
        const long long slot = tbl[key / block_size] * block_size + (key % block_size);
        const long long off = slot * slot_stride + head_off + d;
        kv = oasr::to_float(K[off]);
        vv = oasr::to_float(V[off]);
      }
      ks[j * (D + 1) + d] = kv;
      vs[j * (D + 1) + d] = vv;
    }
    __syncthreads();
    const int key = kt + lane;
#pragma unroll
    for (int u = 0; u < kQueriesPerWarp; ++u) {
      if (pos[u] < kt) continue;  // every key of the tile is in this query's future (warp-uniform)
      const float* qv = qs + (warp * kQueriesPerWarp + u) * D;
      const float* kr = ks + lane * (D + 1);
      float s = 0.f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) s = fmaf(qv[d], kr[d], s);
      const bool valid = key <= pos[u] && key < kend;
      s = valid ? s : OASR_NEG_INF;
      const float m_new = fmaxf(m[u], oasr::warp_max(s));  // finite: key kt is valid
      const float p = valid ? expf(s - m_new) : 0.f;
      const float corr = expf(m[u] - m_new);
      l[u] = l[u] * corr + oasr::warp_sum(p);
      m[u] = m_new;
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[u][e] *= corr;
      for (int j = 0; j < kKeyTile; ++j) {
        const float pj = __shfl_sync(OASR_FULL_MASK, p, j);
        const float* vr = vs + j * (D + 1);
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[u][e] = fmaf(pj, vr[lane + 32 * e], acc[u][e]);
      }
    }
  }

#pragma unroll
  for (int u = 0; u < kQueriesPerWarp; ++u) {
    const int t = i0 + warp * kQueriesPerWarp + u;
    if (t >= T_q) continue;
    const float inv = l[u] > 0.f ? 1.f / l[u] : 0.f;  // no visible key (invalid input): zeros
    T* o = out + ((b * num_heads + h) * (long long)T_q + t) * D;
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[lane + 32 * e] = oasr::from_float<T>(acc[u][e] * inv);
  }
}

}  // namespace oasr_ppa

#define OASR_PPA_KERNEL(NAME, T, D)                                                            \
  extern "C" __global__ void NAME(const T* q, long long q_sb, long long q_sh, long long q_st,  \
                                  const T* k, const T* v, const long long* tables,            \
                                  const long long* lengths, T* out, int T_q, int num_heads,    \
                                  int num_kv_heads, int nb, int block_size, float scale) {     \
    oasr_ppa::paged_prefill_attention<T, D>(q, q_sb, q_sh, q_st, k, v, tables, lengths, out,   \
                                            T_q, num_heads, num_kv_heads, nb, block_size,      \
                                            scale);                                            \
  }

OASR_PPA_KERNEL(oasr_paged_prefill_attention_f32_d64, float, 64)
OASR_PPA_KERNEL(oasr_paged_prefill_attention_f32_d128, float, 128)
OASR_PPA_KERNEL(oasr_paged_prefill_attention_f16_d64, oasr::f16, 64)
OASR_PPA_KERNEL(oasr_paged_prefill_attention_f16_d128, oasr::f16, 128)
OASR_PPA_KERNEL(oasr_paged_prefill_attention_bf16_d64, oasr::bf16, 64)
OASR_PPA_KERNEL(oasr_paged_prefill_attention_bf16_d128, oasr::bf16, 128)
