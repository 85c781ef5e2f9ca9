"""The WFST decoder on CUDA, the tensor search and (unless ``OASR_WFST_FUSED=0``) the fused
kernel, each of its variants: the same one-best (words, word frames, cost) as on the CPU and as kaldi-decoder's
FasterDecoder, batched and streaming. Run with ``pytest -m gpu``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr_decoders_wfst.build import build_tlg, read_arpa
from oasr_decoders_wfst.decoder import WfstDecoder, WfstSearchOptions
from oasr_decoders_wfst.fused import VARIANTS, decode_fused

sys.path.insert(0, str(Path(__file__).parent))
from test_wfst_decoder import TOY_ARPA, TOY_LEXICON, _inputs  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# the fused kernel (the default on CUDA) is compared unless it is switched off
FUSED = os.environ.get("OASR_WFST_FUSED", "1") != "0"


@pytest.fixture(autouse=True)
def _one_thread():
    # the CPU references are many tiny ops: intra-op threads only contend
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _same(a, b):
    assert [h.word_ids for h in a] == [h.word_ids for h in b]
    assert [h.word_frames for h in a] == [h.word_frames for h in b]
    assert [h.cost for h in a] == pytest.approx([h.cost for h in b], abs=1e-6)


def _kaldi_check(graph, lp, lengths, opts, hyps):
    pytest.importorskip("kaldi_decoder")
    from _kaldi_reference import kaldi_decode, to_kaldifst

    fst = to_kaldifst(graph)
    for b, hyp in enumerate(hyps):
        scaled = lp[b, : lengths[b]].cpu().numpy() * np.float32(opts.acoustic_scale)
        words, frames, _ = kaldi_decode(fst, scaled, opts.beam, opts.max_active,
                                        opts.min_active, opts.beam_delta)
        assert (hyp.word_ids, hyp.word_frames) == (words, frames), b


@pytest.mark.parametrize("opts", [WfstSearchOptions(beam=16.0),
                                  WfstSearchOptions(beam=7.0, max_active=30, min_active=2, acoustic_scale=0.7)],
                         ids=["default", "max_active"])  # fmt: skip
def test_toy_graph_cuda_equals_cpu_and_kaldi(opts):
    pytest.importorskip("kaldifst")
    graph = build_tlg(TOY_LEXICON, read_arpa(TOY_ARPA.splitlines()))
    lp, lengths = _inputs(graph, 8, 60, seed=11, peaky=True)
    cpu = WfstDecoder(graph, "cpu", opts).decode(lp, lengths)
    dec = WfstDecoder(graph, "cuda", opts)
    tensor = dec.decode(lp.cuda(), lengths, fused=False)
    _same(tensor, cpu)
    _kaldi_check(graph, lp, lengths, opts, tensor)
    if FUSED:
        _same(dec.decode(lp.cuda(), lengths, fused=True), cpu)
        for variant in VARIANTS:
            _same(decode_fused(dec, lp.cuda(), lengths, variant=variant), cpu)


def test_realistic_graph_cuda_batch_and_streaming():
    from benchmarks.wfstbench import build_realistic_graph, pocketsphinx_model_dir, synthetic_batch

    if pocketsphinx_model_dir() is None:
        pytest.skip("needs the pocketsphinx-en-us LM (apt) or the pocketsphinx wheel")
    pytest.importorskip("kaldifst")
    graph = build_realistic_graph(1000, min_log10_prob=-1.5)
    lp = torch.from_numpy(synthetic_batch(graph, 8, 200, seed=2))
    lengths = [200, 160, 200, 120, 200, 90, 185, 200]
    opts = WfstSearchOptions(beam=11.0, max_active=2000, acoustic_scale=0.9)
    dec = WfstDecoder(graph, "cuda", opts)
    offline = dec.decode(lp.cuda(), lengths, fused=False)
    _same(offline, WfstDecoder(graph, "cpu", opts).decode(lp, lengths))
    if FUSED:
        _same(dec.decode(lp.cuda(), lengths, fused=True), offline)
        for variant in VARIANTS:
            _same(decode_fused(dec, lp.cuda(), lengths, variant=variant), offline)
    state = dec.init_state(8)
    done = np.zeros(8, dtype=int)
    rng = np.random.default_rng(1)
    while (done < lengths).any():
        take = np.minimum(np.asarray(lengths) - done, rng.integers(1, 40, size=8))
        chunk = torch.zeros(8, int(take.max()), graph.num_tokens)
        for b in range(8):
            chunk[b, : take[b]] = lp[b, done[b]: done[b] + take[b]]
        dec.advance(state, chunk.cuda(), take.tolist())
        done += take
    _same(dec.finalize(state), offline)
    _kaldi_check(graph, lp, lengths, opts, offline)
