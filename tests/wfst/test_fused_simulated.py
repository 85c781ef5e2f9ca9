"""The fused CUDA kernel (``oasr_decoders_wfst.fused``, each variant), on numba's CUDA simulator:
the same one-best (words, word frames, cost, final) as the tensor search: beam only, max-active
binding, min-active binding; at 13 threads (both k-th cost selections run: ranking where the
tokens fit the block, else quickselect) and at 4 (a thread owns several tokens in the arc
numbering); at 3 with too small a candidate buffer (the emitting candidates beyond it
recomputed), the token arc starts in global memory and the log-probs read in place. The simulator runs the kernel with the shared-memory prefix sum (it has no warp
shuffles; the GPU's build differs only there, ``tests/wfst/test_wfst_gpu.py`` checks it).
Runs in subprocesses: the simulator must be chosen before numba.cuda is imported; two at once
(the simulator is single-threaded), each taking part of the cases, so every case still runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")
pytest.importorskip("kaldifst")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {here!r})
    from test_wfst_decoder import TOY_ARPA, TOY_LEXICON, _inputs
    from oasr_decoders_wfst.build import build_tlg, read_arpa
    from oasr_decoders_wfst.decoder import WfstDecoder, WfstSearchOptions
    from oasr_decoders_wfst.fused import decode_fused, fused_decode

    from oasr_decoders_wfst._fused_kernel import cost_key
    costs = [-float("inf"), -3.5e9, -2.0, -1.0, -1e-300, 0.0, 1e-300, 1.0, 1.0000001, 7e9, float("inf")]
    keys = [int(cost_key(c)) for c in costs]  # the state table's keys order as the costs
    assert keys == sorted(keys) and len(set(keys)) == len(keys), keys
    g = build_tlg(TOY_LEXICON, read_arpa(TOY_ARPA.splitlines()))
    for seed, opts in ((1, WfstSearchOptions(beam=16.0)),
                       (2, WfstSearchOptions(beam=7.0, max_active=5, min_active=2, acoustic_scale=0.7)),
                       (3, WfstSearchOptions(beam=0.5, min_active=10))):  # min-active changes the result here
        lp, lengths = _inputs(g, 2, 18, seed=seed, peaky=True)
        dec = WfstDecoder(g, "cpu", opts)
        ref = dec.decode(lp, lengths, fused=False)
        for variant, threads in {cases!r}:
            got = decode_fused(dec, lp, lengths, threads=threads, variant=variant)
            for a, b in zip(got, ref, strict=True):
                assert (a.word_ids, a.word_frames, a.reached_final) == (b.word_ids, b.word_frames, b.reached_final), (variant, a, b)
                assert a.cost == b.cost, (variant, a.cost, b.cost)
                assert a.word_ids
        if seed == 1 and {small_buffer!r}:  # frames here have up to 118 emitting candidates: most are recomputed
            from oasr_decoders_wfst import _fused_kernel, fused
            _fused_kernel.SHARED_TOKENS = 3  # token arc starts in global memory
            _fused_kernel.LP_SHARED = 2  # log-probs read in place
            fused._kernels.clear()  # a kernel is built with the constants of its time
            for variant in {small_buffer!r}:
                (prev, word, _), best, cost, _, overflowed = fused_decode(
                    dec, lp, lengths, threads=3, variant=variant, candidate_capacity=24)
                assert not overflowed.any()
                for b, h in enumerate(ref):
                    chain, r = [], int(best[b])
                    while r >= 0:
                        chain.append(int(word[b, r]))
                        r = int(prev[b, r])
                    assert (chain[::-1], float(cost[b])) == (h.word_ids, h.cost), (variant, chain, h)
            _fused_kernel.SHARED_TOKENS = 2048
            _fused_kernel.LP_SHARED = 1024
            fused._kernels.clear()
    print("fused == tensor")
""")


#: per subprocess: (variant, threads) cases and the variants run with the small buffers; about
#: equal simulator time each, together every variant in every case
PARTS = [((("arc", 13),), ("arc",)), ((("arc", 4),), ())]


@pytest.mark.slow
def test_fused_kernel_equals_tensor_search_on_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    here = str(Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT.format(here=here, cases=cases, small_buffer=small)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cases, small in PARTS]  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "fused == tensor" in out
