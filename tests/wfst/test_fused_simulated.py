"""The fused CUDA kernel (``oasr_decoders_wfst.fused``) on numba's CUDA simulator: the same
one-best (words, word frames, cost, final) as the tensor search: beam only, max-active binding,
min-active binding.
Runs in a subprocess: the simulator must be chosen before numba.cuda is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")
pytest.importorskip("kaldifst")

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {here!r})
    from test_wfst_decoder import TOY_ARPA, TOY_LEXICON, _inputs
    from oasr_decoders_wfst.build import build_tlg, read_arpa
    from oasr_decoders_wfst.decoder import WfstDecoder, WfstSearchOptions
    from oasr_decoders_wfst.fused import decode_fused

    g = build_tlg(TOY_LEXICON, read_arpa(TOY_ARPA.splitlines()))
    for seed, opts in ((1, WfstSearchOptions(beam=16.0)),
                       (2, WfstSearchOptions(beam=7.0, max_active=5, min_active=2, acoustic_scale=0.7)),
                       (3, WfstSearchOptions(beam=0.5, min_active=10))):  # min-active changes the result here
        lp, lengths = _inputs(g, 2, 18, seed=seed, peaky=True)
        dec = WfstDecoder(g, "cpu", opts)
        ref = dec.decode(lp, lengths, fused=False)
        got = decode_fused(dec, lp, lengths, threads=4)
        for a, b in zip(got, ref, strict=True):
            assert (a.word_ids, a.word_frames, a.reached_final) == (b.word_ids, b.word_frames, b.reached_final), (a, b)
            assert a.cost == b.cost, (a.cost, b.cost)
            assert a.word_ids
    print("fused == tensor")
''')


@pytest.mark.slow
def test_fused_kernel_equals_tensor_search_on_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    here = str(Path(__file__).parent)
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(here=here)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fused == tensor" in run.stdout
