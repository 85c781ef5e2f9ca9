"""The fused WFST search kernel (numba.cuda); see ``oasr_decoders_wfst.fused``. Imported only
when the fused search runs."""

# ruff: noqa: E501
from __future__ import annotations

import math
import os
import types

import numpy as np
from numba import cuda, float32, float64, int32, int64
from numba.cuda import libdevice

INT32_MAX = 2**31 - 1

inf = math.inf


@cuda.jit(device=True)
def kth_cost(tok_cost, b, cur, n, k, si, sf):
    """The k-th smallest (0-based) of tok_cost[b, cur, :n], by the whole block."""
    tid = cuda.threadIdx.x
    nth = cuda.blockDim.x
    if tid == 0:
        sf[4] = -inf
        sf[5] = inf
    cuda.syncthreads()
    kk = k
    kval = inf
    while True:
        if tid == 0:
            si[6] = INT32_MAX
            si[7] = 0
            si[8] = 0
        cuda.syncthreads()
        lo = sf[4]
        hi = sf[5]
        first = INT32_MAX  # per thread first, then one atomic each (less contention)
        for i in range(tid, n, nth):
            c = tok_cost[b, cur, i]
            if c > lo and c < hi:
                first = min(first, i)
        if first < INT32_MAX:
            cuda.atomic.min(si, 6, first)
        cuda.syncthreads()
        if si[6] == INT32_MAX:  # nothing left in range (only with NaN costs): no cutoff
            kval = inf
            break
        pivot = tok_cost[b, cur, si[6]]
        n_less = 0
        n_eq = 0
        for i in range(tid, n, nth):
            c = tok_cost[b, cur, i]
            if c > lo and c < pivot:
                n_less += 1
            elif c == pivot:
                n_eq += 1
        if n_less:
            cuda.atomic.add(si, 7, n_less)
        if n_eq:
            cuda.atomic.add(si, 8, n_eq)
        cuda.syncthreads()
        less = si[7]
        eq = si[8]
        cuda.syncthreads()
        if kk < less:
            if tid == 0:
                sf[5] = pivot
        elif kk < less + eq:
            kval = pivot
            break
        else:
            kk -= less + eq
            if tid == 0:
                sf[4] = pivot
        cuda.syncthreads()
    cuda.syncthreads()
    return kval


# ---------------------------------------------------------------------------------------------
# The search kernel: one block per utterance, a thread per emitting arc (not per token: on the
# 5000-word graph a frame has ~190 tokens and ~1500 emitting arcs, but almost every frame has one
# token with ~37, which a thread per token walks serially while the block waits). The arcs of the
# tokens under the cutoff are numbered by a block prefix sum over per-thread arc counts; thread
# tid takes arcs tid, tid + threads, ... (its token found by binary search over the token starts).
# The frame loop is bound by chains of dependent memory round trips, so:
# - the per-state table interleaves each state's cost key, token slot and epsilon claim in 16
#   bytes (``table``: int64 [2 * state] the key; its int32 view ``table32`` [4 * state + 2] the
#   slot, [+ 3] the claim): the slot / claim after a cost atomic is in the same 32-byte sector;
# - two emitting passes: every candidate lowers its state's key (and is stored), then the claim
#   pass keeps those under the next cutoff (the minimum over all candidates is under the cutoff
#   iff the minimum over those under it is, and then they are the same); a state whose minimum
#   is not under it is reset there by its candidates;
# - stored candidates carry destination, cost, word and their token's record: the claim passes
#   load nothing after their atomics;
# - the block's best costs are int64 keys in shared memory (a native 64-bit atomic min, not
#   numba's float64 compare-and-swap loop, which 1024 threads on one word retry).

#: token arc numbers and first arcs live in shared memory up to this many tokens (else in global
#: scratch)
SHARED_TOKENS = 2048

# The per-state cost table holds as int64 keys that order as the float64 costs
# (non-negative: the bits; negative: all bits but the sign flipped), so lowering an entry is one
# native 64-bit atomic min the thread need not wait for, not numba's float64 atomic min (a load,
# then a compare-and-swap loop: two waits). inf's key is its bits.
INF_KEY = 0x7FF0000000000000
FLIP = 0x7FFFFFFFFFFFFFFF

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":  # the simulator has no libdevice

    @cuda.jit(device=True)
    def cost_key(x):
        u = int(np.float64(x).view(np.int64))
        return np.int64(u if u >= 0 else u ^ FLIP)

else:

    @cuda.jit(device=True)
    def cost_key(x):
        u = libdevice.double_as_longlong(x)
        if u < 0:
            u ^= FLIP
        return u


@cuda.jit(device=True)
def kth_cost_ranked(tok_cost, b, cur, n, k, sf, costs):
    """``kth_cost`` where n <= the block's threads: each thread ranks one token against all (in
    shared memory); two barriers instead of quickselect's five a round. Returns ``inf`` where no
    cost qualifies (only with NaN costs), as ``kth_cost``."""
    tid = cuda.threadIdx.x
    if tid == 0:
        sf[6] = inf
    if tid < n:
        costs[tid] = tok_cost[b, cur, tid]
    cuda.syncthreads()
    if tid < n:
        c = costs[tid]
        less = 0
        eq = 0
        for j in range(n):
            v = costs[j]
            if v < c:
                less += 1
            elif v == c:
                eq += 1
        if less <= k and k < less + eq:  # every thread holding the k-th value writes the same
            sf[6] = c
    cuda.syncthreads()
    return sf[6]


@cuda.jit(device=True)
def owner_of(aoff, n, j):
    """The token whose arc range holds arc number j: the last i < n with aoff[i] <= j."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) >> 1
        if aoff[mid] <= j:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@cuda.jit(device=True)
def arc_candidate(aoff, arc0, n, j, tok_cost, b, cur, e_w, e_tok, lp, t):
    """(token, arc, new cost) of emitting candidate number j, summed in Kaldi's order; aoff /
    arc0: each token's first arc number / its state's first emitting arc."""
    o = owner_of(aoff, n, j)
    a = arc0[o] + (j - aoff[o])
    nc = (tok_cost[b, cur, o] + e_w[a]) + float64(-lp[b, t, e_tok[a]])
    return o, a, nc


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":

    @cuda.jit(device=True)
    def key_cost(k):
        u = int(k)
        return float(np.int64(u if u >= 0 else u ^ FLIP).view(np.float64))

else:

    @cuda.jit(device=True)
    def key_cost(k):
        u = k
        if u < 0:
            u ^= FLIP
        return libdevice.longlong_as_double(u)


#: a frame's log-probs are copied to shared memory up to this many tokens in the vocabulary (one
#: dependent global load fewer a candidate), else read in place
LP_SHARED = 1024

#: the block prefix sum by warp shuffles (two barriers) instead of Hillis-Steele in shared memory
#: (about log2(threads) barriers). A constant of the compiled kernel (``build_kernel``): numba's
#: simulator has no shuffles, so it runs the kernel with this false
WARP_SCAN = False


@cuda.jit(device=True)
def warp_scan(x, warp_sums):
    """(block total, exclusive prefix) of x over the block's threads (a multiple of 32, all here):
    a shuffle scan in each warp, then one over the warps' sums; two barriers."""
    tid = cuda.threadIdx.x
    lane = tid & 31
    wid = tid >> 5
    nwarps = cuda.blockDim.x >> 5
    v = x
    off = 1
    while off < 32:
        y = cuda.shfl_up_sync(0xFFFFFFFF, v, off)
        if lane >= off:
            v += y
        off *= 2
    if lane == 31:
        warp_sums[wid] = v
    cuda.syncthreads()
    if wid == 0:
        w = warp_sums[lane] if lane < nwarps else 0
        off = 1
        while off < 32:
            y = cuda.shfl_up_sync(0xFFFFFFFF, w, off)
            if lane >= off:
                w += y
            off *= 2
        if lane < nwarps:
            warp_sums[lane] = w
    cuda.syncthreads()
    before = warp_sums[wid - 1] if wid > 0 else 0
    return warp_sums[nwarps - 1], before + v - x


def search(e_off, e_next, e_tok, e_olab, e_w, p_off, p_next, p_olab, p_w, final, start, lp,
           lens, beam, max_active, min_active, beam_delta, tok_state, tok_cost, tok_rec, table,
           table32, frontier, cand_dest, cand_word, cand_cost, cand_rec, rec_prev, rec_word,
           rec_frame, out_rec, out_cost, out_final, status, out_nrec, tok_aoff):  # fmt: skip
    """The kernel's body (``build_kernel`` compiles it): decodes utterance ``blockIdx.x``."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nth = cuda.blockDim.x
    S = final.shape[0]
    cap = tok_state.shape[2]
    ccap = cand_dest.shape[1]
    rcap = rec_prev.shape[1]
    base = b * S
    # shared scalars: ints [0 n_cur, 1 n_new, 2 n_cand, 3 n_rec, 4 n_front, 5 n_front_next,
    # 6 pivot index, 7 count less, 8 count equal, 9 status, 10 round id, 11 count < beam cutoff,
    # 12 count <= it]; floats [0 best, 2 cutoff, 4 lo, 5 hi, 6 k-th cost]; sk: int64 keys [0 best
    # new cost, 1 best cost of the tokens the last frame left]
    si = cuda.shared.array(16, dtype=int32)
    sf = cuda.shared.array(8, dtype=float64)
    sk = cuda.shared.array(2, dtype=int64)
    scan = cuda.shared.array((2, 1024), dtype=int32)
    aoff_shared = cuda.shared.array(SHARED_TOKENS, dtype=int32)
    arc0_shared = cuda.shared.array(SHARED_TOKENS, dtype=int32)
    ranked = cuda.shared.array(1024, dtype=float64)
    warp_sums = cuda.shared.array(32, dtype=int32)
    lp_row = cuda.shared.array(LP_SHARED, dtype=float32)  # the frame's log-probs
    V = lp.shape[2]
    if tid == 0:
        tok_state[b, 0, 0] = start
        tok_cost[b, 0, 0] = 0.0
        tok_rec[b, 0, 0] = -1
        si[0] = 1
        si[3] = 0
        si[9] = 0
        si[10] = 0
        table[2 * (base + start)] = 0  # the key of 0.0
        table32[4 * (base + start) + 2] = 0
    cuda.syncthreads()
    cur = 0
    n_frames = lens[b]
    for t in range(-1, n_frames):
        nb = cur if t < 0 else 1 - cur
        if t >= 0:
            n = si[0]
            if V <= LP_SHARED:  # read by the first emitting pass, after the barriers below
                for v in range(tid, V, nth):
                    lp_row[v] = lp[b, t, v]
            aoff = aoff_shared if n <= SHARED_TOKENS else tok_aoff[b, 0]
            arc0 = arc0_shared if n <= SHARED_TOKENS else tok_aoff[b, 1]
            best_cost = key_cost(sk[1])  # from the last frame's clean-up pass
            beam_cut = best_cost + beam
            cutoff = beam_cut
            adaptive = float64(beam)
            # ---- cutoff (GetCutoff) and arc counts: each thread a contiguous run of tokens, their
            # counts under / at the beam cutoff and their emitting arc counts (under it), one pass
            per = (n + nth - 1) // nth
            lo_i = tid * per
            hi_i = min(n, lo_i + per)
            active = (n + per - 1) // per  # threads that own tokens
            m_lt = 0
            m_le = 0
            tot = 0
            for i in range(lo_i, hi_i):
                c = tok_cost[b, cur, i]
                k = 0
                if c < beam_cut:
                    m_lt += 1
                    s = tok_state[b, cur, i]
                    a0 = e_off[s]
                    k = int32(e_off[s + 1] - a0)
                    arc0[i] = a0
                if c <= beam_cut:
                    m_le += 1
                aoff[i] = k
                tot += k
            if not (max_active == INT32_MAX and min_active == 0):
                if m_lt:
                    cuda.atomic.add(si, 11, m_lt)
                if m_le:
                    cuda.atomic.add(si, 12, m_le)
                cuda.syncthreads()
                n_lt = si[11]  # reset at the end of the frame: no barrier needed after the read
                n_le = si[12]
                if n > max_active and n_lt > max_active:
                    if n <= nth:
                        kval = kth_cost_ranked(tok_cost, b, cur, n, max_active, sf, ranked)
                    else:
                        kval = kth_cost(tok_cost, b, cur, n, max_active, si, sf)
                    cutoff = kval
                    adaptive = float64(float32(kval - best_cost + beam_delta))
                elif min_active > 0 and n_le <= min_active:
                    kval = inf  # Kaldi: with at most min_active tokens the min-active cutoff is infinite
                    if n > min_active:
                        if n <= nth:
                            kval = kth_cost_ranked(tok_cost, b, cur, n, min_active, sf, ranked)
                        else:
                            kval = kth_cost(tok_cost, b, cur, n, min_active, si, sf)
                    cutoff = kval
                    adaptive = float64(float32(kval - best_cost + beam_delta))
                if cutoff != beam_cut:  # the k-th cost decided: count the arcs again
                    tot = 0
                    for i in range(lo_i, hi_i):
                        k = 0
                        if tok_cost[b, cur, i] < cutoff:
                            s = tok_state[b, cur, i]
                            a0 = e_off[s]
                            k = int32(e_off[s + 1] - a0)
                            arc0[i] = a0
                        aoff[i] = k
                        tot += k
            # ---- block prefix sum of the per-thread arc counts: each token's first arc number
            if WARP_SCAN:
                total, run = warp_scan(tot, warp_sums)
            else:
                scan[0, tid] = tot
                cuda.syncthreads()
                src = 0
                step = 1
                while step < active:
                    v = scan[src, tid]
                    if tid >= step:
                        v += scan[src, tid - step]
                    scan[1 - src, tid] = v
                    src = 1 - src
                    step *= 2
                    cuda.syncthreads()
                total = scan[src, active - 1]
                run = scan[src, tid] - tot
            for i in range(lo_i, hi_i):
                k = aoff[i]
                aoff[i] = run
                run += k
            cuda.syncthreads()
            # ---- emitting arcs, one pass: each candidate lowers its state's key and is stored
            # (destination, cost, word, its token's record); the block's best new cost
            mine = INF_KEY
            for j in range(tid, total, nth):
                o = owner_of(aoff, n, j)
                a = arc0[o] + (j - aoff[o])
                r = tok_rec[b, cur, o]
                w = e_olab[a]
                d = e_next[a]
                u = e_tok[a]
                x = lp_row[u] if V <= LP_SHARED else lp[b, t, u]
                nc = (tok_cost[b, cur, o] + e_w[a]) + float64(-x)
                if j < ccap:
                    cand_dest[b, j] = d
                    cand_word[b, j] = w
                    cand_cost[b, j] = nc
                    cand_rec[b, j] = r
                key = cost_key(nc)
                cuda.atomic.min(table, 2 * (base + d), key)
                mine = min(mine, key)
            if mine < INF_KEY:
                cuda.atomic.min(sk, 0, mine)
            if tid == 0:
                si[1] = 0
            cuda.syncthreads()
            next_cutoff = key_cost(sk[0]) + adaptive
            for j in range(tid, total, nth):
                if j < ccap:  # all four loads at once
                    nc = cand_cost[b, j]
                    d = cand_dest[b, j]
                    r = cand_rec[b, j]
                    w = cand_word[b, j]
                else:
                    o, a, nc = arc_candidate(aoff, arc0, n, j, tok_cost, b, cur, e_w, e_tok, lp, t)  # fmt: skip
                    d = e_next[a]
                    r = tok_rec[b, cur, o]
                    w = e_olab[a]
                # the table was lowered by atomics: read it with one (no stale L1 line)
                low = cuda.atomic.min(table, 2 * (base + d), INF_KEY)
                if nc < next_cutoff:
                    if cost_key(nc) == low and cuda.atomic.cas(table32, 4 * (base + d) + 2, -1, -2) == -1:  # fmt: skip
                        jj = cuda.atomic.add(si, 1, 1)
                        if jj < cap:
                            if w != 0:
                                q = cuda.atomic.add(si, 3, 1)
                                if q < rcap:
                                    rec_prev[b, q] = r
                                    rec_word[b, q] = w
                                    rec_frame[b, q] = t
                                else:
                                    si[9] = 1
                                r = q
                            tok_state[b, nb, jj] = d
                            tok_cost[b, nb, jj] = nc
                            tok_rec[b, nb, jj] = r
                            table32[4 * (base + d) + 2] = jj
                        else:
                            si[9] = 1
                elif not (key_cost(low) < next_cutoff):
                    # no candidate of this state is under the cutoff: no token, reset its key
                    # (every candidate of the state writes the same)
                    table[2 * (base + d)] = INF_KEY
            cuda.syncthreads()
            if tid == 0:
                if si[1] > cap:
                    si[1] = cap
                sf[2] = next_cutoff
            n_tok_slot = 1
        else:
            n_tok_slot = 0
            if tid == 0:
                sf[2] = inf
        # ---- epsilon closure over buffer nb (its count in si[n_tok_slot]) in rounds over a
        # frontier: candidates at or under the cutoff that beat their state's key lower it and are
        # stored; after a barrier the one at the minimum claims the state for the round (atomic
        # max of a round id), updates its token in place or appends one, and joins the next
        # frontier. The first round's frontier is every token at or under the cutoff, read in place
        if tid == 0:
            si[4] = si[n_tok_slot]
            si[2] = 0
            si[5] = 0
            si[10] += 1
        cuda.syncthreads()
        ccut = sf[2]
        frame = t if t >= 0 else 0
        fb = 0
        rounds = 0
        while si[4] > 0:
            rounds += 1
            if rounds > 10000:  # an epsilon cycle that keeps improving: give the row up
                if tid == 0:
                    si[9] = 1
                break
            nf = si[4]
            rid = si[10]
            for fi in range(tid, nf, nth):
                if rounds == 1:
                    i = fi
                    if tok_cost[b, nb, i] > ccut:
                        continue
                else:
                    i = frontier[b, fb, fi]
                c = tok_cost[b, nb, i]
                s = tok_state[b, nb, i]
                r = tok_rec[b, nb, i]
                for a in range(p_off[s], p_off[s + 1]):
                    nc = c + p_w[a]
                    d = p_next[a]
                    w = p_olab[a]
                    key = cost_key(nc)
                    if nc <= ccut and key < table[2 * (base + d)]:
                        cuda.atomic.min(table, 2 * (base + d), key)
                        k = cuda.atomic.add(si, 2, 1)
                        if k < ccap:
                            cand_dest[b, k] = d
                            cand_word[b, k] = w
                            cand_cost[b, k] = nc
                            cand_rec[b, k] = r
                        else:
                            si[9] = 1
            cuda.syncthreads()
            if si[2] == 0:  # nothing improved: done (counters reset before the next closure)
                break
            ncand = min(si[2], ccap)
            for k in range(tid, ncand, nth):
                d = cand_dest[b, k]
                w = cand_word[b, k]
                nc = cand_cost[b, k]
                r = cand_rec[b, k]
                if cost_key(nc) == cuda.atomic.min(table, 2 * (base + d), INF_KEY) and cuda.atomic.max(table32, 4 * (base + d) + 3, rid) < rid:  # fmt: skip
                    if w != 0:
                        q = cuda.atomic.add(si, 3, 1)
                        if q < rcap:
                            rec_prev[b, q] = r
                            rec_word[b, q] = w
                            rec_frame[b, q] = frame
                        else:
                            si[9] = 1
                        r = q
                    j = table32[4 * (base + d) + 2]
                    if j < 0:
                        j = cuda.atomic.add(si, n_tok_slot, 1)
                        if j >= cap:
                            si[9] = 1
                            continue
                        tok_state[b, nb, j] = d
                        table32[4 * (base + d) + 2] = j
                    tok_cost[b, nb, j] = nc
                    tok_rec[b, nb, j] = r
                    f = cuda.atomic.add(si, 5, 1)
                    frontier[b, 1 - fb, f] = j
            cuda.syncthreads()
            if tid == 0:
                if si[n_tok_slot] > cap:
                    si[n_tok_slot] = cap
                si[4] = si[5]
                si[2] = 0
                si[5] = 0
                si[10] += 1
            fb = 1 - fb
            cuda.syncthreads()
        # ---- the new set becomes current; clean its table entries; its best cost (the next
        # frame's GetCutoff starts from it)
        if tid == 0:
            if n_tok_slot == 1:
                si[0] = si[1]
            sk[0] = INF_KEY
            sk[1] = INF_KEY
            si[11] = 0
            si[12] = 0
        cuda.syncthreads()
        mine = INF_KEY
        for i in range(tid, si[0], nth):
            s = tok_state[b, nb, i]
            mine = min(mine, cost_key(tok_cost[b, nb, i]))
            table[2 * (base + s)] = INF_KEY
            table32[4 * (base + s) + 2] = -1
        if mine < INF_KEY:
            cuda.atomic.min(sk, 1, mine)
        cur = nb
        cuda.syncthreads()
        if si[9] != 0 or si[0] == 0:
            break
    # ---- best path: the cheapest token with its final cost where any is final, else the cheapest
    n = si[0]
    if tid == 0:
        sf[0] = inf
        si[6] = INT32_MAX
        si[7] = 0
    cuda.syncthreads()
    for i in range(tid, n, nth):
        if final[tok_state[b, cur, i]] != inf:
            si[7] = 1
    cuda.syncthreads()
    use_final = si[7] != 0
    for i in range(tid, n, nth):
        c = tok_cost[b, cur, i]
        if use_final:
            c = c + final[tok_state[b, cur, i]]
        cuda.atomic.min(sf, 0, c)
    cuda.syncthreads()
    for i in range(tid, n, nth):
        c = tok_cost[b, cur, i]
        if use_final:
            c = c + final[tok_state[b, cur, i]]
        if c == sf[0]:
            cuda.atomic.min(si, 6, i)
    cuda.syncthreads()
    if tid == 0:
        status[b] = si[9]
        out_nrec[b] = min(si[3], rcap)
        out_final[b] = 1 if use_final else 0
        if si[6] < n:
            out_rec[b] = tok_rec[b, cur, si[6]]
            out_cost[b] = sf[0]
        else:
            out_rec[b] = -1
            out_cost[b] = inf


def build_kernel(warp_scan: bool = False, max_registers: int | None = None):
    """``search`` compiled as a kernel, with ``WARP_SCAN = warp_scan`` and this module's other
    globals as they are now (a copy: setting one later changes no kernel already built), at most
    ``max_registers`` registers a thread."""
    fn = types.FunctionType(search.__code__, dict(globals(), WARP_SCAN=warp_scan), "search_kernel")
    return cuda.jit(max_registers=max_registers)(fn) if max_registers else cuda.jit(fn)
