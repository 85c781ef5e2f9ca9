// CTC prefix beam search, every frame of a chunk in one launch: one block (a warp) per batch
// row runs oasr.decoders.ctc_gpu._frame's steps for each of its frames (the same candidates,
// merges, first-touch keys, selection order and token nodes, in float64), so the result equals
// the tensor implementation's. Lanes split the slots and candidates; the selection of each kept
// slot reduces the lanes' best through scratch memory. Launched by oasr_kernels/ctc_beam.py; the
// row function takes (lane, lanes) so tests run it serially (one lane) with a host compiler and
// with lanes as threads (tests/kernels/cuda_host_emulation.h).
//
// Layouts (row-major, b = batch row): tv (B,T,K) f64 and ti (B,T,K) i64 the frames' top-K;
// lens, beams, frame0 (B) i64; state F (B,W,5) f64 [s, ns, v_s, v_ns, context score],
// I (B,W,7) i64 [hash, parent hash, last, ptr_s, ptr_ns, up_ns, context state], valid (B,W) u8;
// nodes tok_par (B,T,W,2) i64, node_lp (B,T,W) f64; scratch cand_f (B,C,7) f64,
// cand_i (B,C,8) i64, flags (B,C) u8, merged (B,W*K) u8 with C = W + W*K, slot_f (B,W,2) f64,
// slot_i (B,W) i64, red_f (B,32) f64, red_i (B,32,2) i64; context tables
// (keys, next, bonus sorted by key; node_score per state; root per row) when has_ctx.

#ifndef OASR_CTC_HOST
#define OASR_CTC_DEVICE __device__
#define OASR_CTC_INF __longlong_as_double(0x7ff0000000000000LL)
#else
#define OASR_CTC_DEVICE static inline
#define OASR_CTC_INF __builtin_huge_val()
#endif
#ifdef OASR_CTC_SERIAL  // one lane on the host: nothing to wait for
#define OASR_CTC_SYNC()
#else
#define OASR_CTC_SYNC() __syncthreads()
#endif
#define OASR_CTC_LANES 32

typedef long long oasr_i64;

#define OASR_CTC_HASH_MUL 1099511628211ULL
#define OASR_CTC_BIG (1LL << 40)
#define OASR_CTC_MAX_W 64

OASR_CTC_DEVICE double oasr_ctc_neg_inf() { return -OASR_CTC_INF; }

// torch.logaddexp (float64): equal infinities stay, else max + log1p(exp(-|a - b|))
OASR_CTC_DEVICE double oasr_ctc_logaddexp(double a, double b) {
  if (a == b && (a == OASR_CTC_INF || a == -OASR_CTC_INF)) return a;
  double m = a > b ? a : b;
  double d = a - b;
  return m + log1p(exp(-(d < 0 ? -d : d)));
}

OASR_CTC_DEVICE oasr_i64 oasr_ctc_lower_bound(const oasr_i64* keys, oasr_i64 n, oasr_i64 key) {
  oasr_i64 lo = 0, hi = n;
  while (lo < hi) {
    oasr_i64 mid = (lo + hi) >> 1;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

OASR_CTC_DEVICE void oasr_ctc_row(
    int b, int lane, int nl, int T, int K, int W, int blank, oasr_i64 vocab, const double* tv,
    const oasr_i64* ti, const oasr_i64* lens, const oasr_i64* beams, const oasr_i64* frame0,
    double* F, oasr_i64* I, unsigned char* valid, oasr_i64* tok_par, double* node_lp,
    double* cand_f, oasr_i64* cand_i, unsigned char* flags, unsigned char* merged, double* slot_f,
    oasr_i64* slot_i, double* red_f, oasr_i64* red_i, int has_ctx, const oasr_i64* ckeys,
    const oasr_i64* cnext, const double* cbonus, oasr_i64 nkeys, const double* node_score,
    const oasr_i64* root) {
  const double NEG = oasr_ctc_neg_inf();
  const int C = W + W * K;
  const int len = (int)lens[b];
  const int wb = (int)beams[b];
  const int kb = wb < K ? wb : K;
  double* Fr = F + (oasr_i64)b * W * 5;
  oasr_i64* Ir = I + (oasr_i64)b * W * 7;
  unsigned char* vr = valid + (oasr_i64)b * W;
  double* cf = cand_f + (oasr_i64)b * C * 7;
  oasr_i64* ci = cand_i + (oasr_i64)b * C * 8;
  unsigned char* fl = flags + (oasr_i64)b * C;  // bit 0: exists, bit 1: taken
  unsigned char* mg = merged + (oasr_i64)b * W * K;
  double* sc = slot_f + (oasr_i64)b * W * 2;  // sc[j], vit[j] at sc[2 * j], sc[2 * j + 1]
  oasr_i64* ptr_t = slot_i + (oasr_i64)b * W;
  double* rf = red_f + (oasr_i64)b * OASR_CTC_LANES;
  oasr_i64* ri = red_i + (oasr_i64)b * OASR_CTC_LANES * 2;
  for (int t = 0; t < len; ++t) {
    const double* tvt = tv + ((oasr_i64)b * T + t) * K;
    const oasr_i64* tit = ti + ((oasr_i64)b * T + t) * K;
    // blank among the candidates
    int has_b = 0, rb = 0;
    double pb = NEG;
    for (int r = 0; r < kb; ++r) {
      if (tit[r] == blank) { has_b = 1; rb = r; pb = tvt[r]; break; }
    }
    for (int j = lane; j < W; j += nl) {
      double s = Fr[j * 5 + 0], ns = Fr[j * 5 + 1], vs = Fr[j * 5 + 2], vns = Fr[j * 5 + 3];
      sc[2 * j] = oasr_ctc_logaddexp(s, ns);
      int pick_s = vs > vns;
      sc[2 * j + 1] = pick_s ? vs : vns;
      ptr_t[j] = pick_s ? Ir[j * 7 + 3] : Ir[j * 7 + 4];
    }
    for (int n = lane; n < W * K; n += nl) mg[n] = 0;
    OASR_CTC_SYNC();
    // stay entries: the prefix itself
    for (int i = lane; i < W; i += nl) {
      const int vi = vr[i];
      const oasr_i64 last = Ir[i * 7 + 2], ph = Ir[i * 7 + 1];
      int has_l = 0, r_l = 0;
      double p_l = NEG;
      for (int r = 0; r < kb; ++r) {
        if (tit[r] == last) { has_l = 1; r_l = r; p_l = tvt[r]; break; }
      }
      has_l = has_l && vi;
      int has_p = 0, p = 0;
      if (last >= 0) {
        for (int j = 0; j < W; ++j) {
          if (vr[j] && Ir[j * 7 + 0] == ph) { has_p = 1; p = j; break; }
        }
      }
      has_p = has_p && vi;
      const int src_b = has_p && has_l;
      const int ext2p = Ir[p * 7 + 2] == last;
      const double b_ns = src_b ? (ext2p ? Fr[p * 5 + 0] : sc[2 * p]) + p_l : NEG;
      const double vb = src_b ? (ext2p ? Fr[p * 5 + 2] : sc[2 * p + 1]) + p_l : NEG;
      const oasr_i64 tb = ext2p ? Ir[p * 7 + 3] : ptr_t[p];
      const int hb = has_b && vi;
      const double st_s = hb ? sc[2 * i] + pb : NEG;
      const double st_vs = hb ? sc[2 * i + 1] + pb : NEG;
      const double va = has_l ? Fr[i * 5 + 3] + p_l : NEG;
      const double st_ns = oasr_ctc_logaddexp(has_l ? Fr[i * 5 + 1] + p_l : NEG, b_ns);
      const double st_vns = va > vb ? va : vb;
      const int a_first = !src_b || (i < p);
      const int choose_b = a_first ? (vb > va) : (vb > NEG);
      const int made = choose_b || (va > NEG);
      const oasr_i64 par = choose_b ? tb : Ir[i * 7 + 5];
      oasr_i64 key = OASR_CTC_BIG;
      if (hb) { oasr_i64 k = ((oasr_i64)rb * W + i) * 2; if (k < key) key = k; }
      if (has_l) { oasr_i64 k = ((oasr_i64)r_l * W + i) * 2; if (k < key) key = k; }
      if (src_b) { oasr_i64 k = ((oasr_i64)r_l * W + p) * 2 + ext2p; if (k < key) key = k; }
      const double ctx = Fr[i * 5 + 4];
      double* f = cf + (oasr_i64)i * 7;
      f[0] = st_s; f[1] = st_ns; f[2] = st_vs; f[3] = st_vns; f[4] = ctx; f[5] = p_l;
      oasr_i64* c = ci + (oasr_i64)i * 8;
      c[0] = Ir[i * 7 + 0]; c[1] = ph; c[2] = last; c[3] = ptr_t[i]; c[4] = par;
      c[5] = Ir[i * 7 + 6]; c[6] = made; c[7] = key;
      const double total = oasr_ctc_logaddexp(st_s, st_ns) + ctx;
      f[6] = total;
      fl[i] = (hb || has_l) && total > NEG ? 1 : 0;
      if (src_b) mg[p * K + r_l] = 1;
    }
    OASR_CTC_SYNC();
    // extension entries: prefix j + candidate r
    for (int e = lane; e < W * K; e += nl) {
      const int j = e / K, r = e % K;
      const oasr_i64 last = Ir[j * 7 + 2], h = Ir[j * 7 + 0], cst = Ir[j * 7 + 6];
      const double s = Fr[j * 5 + 0], vs = Fr[j * 5 + 2], ctx = Fr[j * 5 + 4];
      {
        const int n = W + j * K + r;
        const oasr_i64 u = tit[r];
        const double prob = tvt[r];
        const int ext2 = u == last;
        const double e_ns = (ext2 ? s : sc[2 * j]) + prob;
        const double e_vns = (ext2 ? vs : sc[2 * j + 1]) + prob;
        double e_ctx = ctx;
        oasr_i64 e_cst = cst;
        if (has_ctx) {
          const double base = node_score[cst];
          const oasr_i64 k1 = cst * vocab + u;
          oasr_i64 i1 = oasr_ctc_lower_bound(ckeys, nkeys, k1);
          if (i1 < nkeys && ckeys[i1] == k1) {
            e_ctx = ctx + cbonus[i1]; e_cst = cnext[i1];
          } else {
            const oasr_i64 k2 = root[b] * vocab + u;
            oasr_i64 i2 = oasr_ctc_lower_bound(ckeys, nkeys, k2);
            if (i2 < nkeys && ckeys[i2] == k2) {
              e_ctx = ctx + (cbonus[i2] - base); e_cst = cnext[i2];
            } else {
              e_ctx = ctx + (-base); e_cst = root[b];
            }
          }
        }
        double* f = cf + (oasr_i64)n * 7;
        f[0] = NEG; f[1] = e_ns; f[2] = NEG; f[3] = e_vns; f[4] = e_ctx; f[5] = prob;
        oasr_i64* c = ci + (oasr_i64)n * 8;
        c[0] = (oasr_i64)((unsigned long long)h * OASR_CTC_HASH_MUL + (unsigned long long)u + 1ULL);
        c[1] = h; c[2] = u; c[3] = -1; c[4] = ext2 ? Ir[j * 7 + 3] : ptr_t[j]; c[5] = e_cst;
        c[6] = e_vns > NEG; c[7] = ((oasr_i64)r * W + j) * 2 + ext2;
        const int ex = vr[j] && r < kb && u != blank && !mg[j * K + r];
        const double total = oasr_ctc_logaddexp(NEG, e_ns) + e_ctx;
        f[6] = total;
        fl[n] = ex && total > NEG ? 1 : 0;
      }
    }
    OASR_CTC_SYNC();
    // keep: the best entries by (total desc, first-touch key asc), at most the row's beam; each
    // lane offers its best, lane 0 takes the best offer and writes the slot
    const oasr_i64 node_base = (frame0[b] + t) * wb;
    oasr_i64* tp = tok_par + (((oasr_i64)b * T + t) * W) * 2;
    double* nlp = node_lp + ((oasr_i64)b * T + t) * W;
    for (int w = 0; w < W; ++w) {
      int best = -1;
      double bt = NEG;
      oasr_i64 bk = 0;
      if (w < wb) {
        for (int n = lane; n < C; n += nl) {
          if (fl[n] != 1) continue;  // not existing, or taken (2 | 1 = 3)
          const double total = cf[(oasr_i64)n * 7 + 6];
          const oasr_i64 k = ci[(oasr_i64)n * 8 + 7];
          if (best < 0 || total > bt || (total == bt && k < bk)) { best = n; bt = total; bk = k; }
        }
      }
      rf[lane] = bt;
      ri[lane * 2] = bk;
      ri[lane * 2 + 1] = best;
      // every lane reaches the same barriers (no barrier inside a divergent branch: the
      // aligned bar.sync of a warp requires it)
      OASR_CTC_SYNC();
      if (lane == 0) {
        for (int l = 1; l < nl; ++l) {
          const int n = (int)ri[l * 2 + 1];
          if (n < 0) continue;
          const double total = rf[l];
          const oasr_i64 k = ri[l * 2];
          if (best < 0 || total > bt || (total == bt && k < bk)) { best = n; bt = total; bk = k; }
        }
        double* Fw = Fr + w * 5;
        oasr_i64* Iw = Ir + w * 7;
        if (best < 0) {
          vr[w] = 0;
          Fw[0] = Fw[1] = Fw[2] = Fw[3] = NEG; Fw[4] = 0.0;
          Iw[0] = 0; Iw[1] = -1; Iw[2] = -1; Iw[3] = -1; Iw[4] = -1; Iw[5] = -1; Iw[6] = 0;
          tp[w * 2 + 0] = -1; tp[w * 2 + 1] = -1; nlp[w] = 0.0;
        } else {
          fl[best] = 3;
          const double* f = cf + (oasr_i64)best * 7;
          const oasr_i64* c = ci + (oasr_i64)best * 8;
          const int made = c[6] != 0;
          const oasr_i64 up = made ? c[4] : -1;
          vr[w] = 1;
          Fw[0] = f[0]; Fw[1] = f[1]; Fw[2] = f[2]; Fw[3] = f[3]; Fw[4] = f[4];
          Iw[0] = c[0]; Iw[1] = c[1]; Iw[2] = c[2]; Iw[3] = c[3];
          Iw[4] = made ? node_base + w : -1; Iw[5] = up; Iw[6] = c[5];
          tp[w * 2 + 0] = c[2]; tp[w * 2 + 1] = up; nlp[w] = f[5];
        }
      }
      OASR_CTC_SYNC();
    }
    OASR_CTC_SYNC();  // the new beam is written before the next frame reads it
  }
}

#ifndef OASR_CTC_SERIAL
// grid (B), block (OASR_CTC_LANES): one row per block
extern "C" __global__ void oasr_ctc_prefix_beam(
    int B, int T, int K, int W, int blank, oasr_i64 vocab, const double* tv, const oasr_i64* ti,
    const oasr_i64* lens, const oasr_i64* beams, const oasr_i64* frame0, double* F, oasr_i64* I,
    unsigned char* valid, oasr_i64* tok_par, double* node_lp, double* cand_f, oasr_i64* cand_i,
    unsigned char* flags, unsigned char* merged, double* slot_f, oasr_i64* slot_i, double* red_f,
    oasr_i64* red_i, int has_ctx, const oasr_i64* ckeys, const oasr_i64* cnext,
    const double* cbonus, oasr_i64 nkeys, const double* node_score, const oasr_i64* root) {
  const int b = blockIdx.x;
  if (b >= B) return;
  oasr_ctc_row(b, threadIdx.x, blockDim.x, T, K, W, blank, vocab, tv, ti, lens, beams, frame0, F,
               I, valid, tok_par, node_lp, cand_f, cand_i, flags, merged, slot_f, slot_i, red_f,
               red_i, has_ctx, ckeys, cnext, cbonus, nkeys, node_score, root);
}
#endif
