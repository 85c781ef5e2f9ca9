"""Hotwords on a WeNet U2++ model (tests/data/wenet, real Chinese speech): the engine's result
is exactly the biased CTC prefix beam search on the model's own log-probabilities with the same
context graph; the hotword changes the output; greedy methods refuse hotwords at submit;
auto switches to the prefix beam search."""

from __future__ import annotations

import pytest
import torch

from oasr.decoders.context_graph import ContextGraph, PieceEncoder
from oasr.decoders.ctc import ctc_prefix_beam_search
from oasr.errors import UnsupportedOptionError
from oasr.types import DecodingOptions, EngineConfig

from .conftest import load  # noqa: TID252

CLIP = "zh_aishell_BAC009S0764W0121.wav"


def _log_probs(model, audio):
    with torch.no_grad():
        enc, lens = model.encode([audio])
        return model.net.ctc_log_probs(enc).float().cpu()[0, : int(lens[0])]


def _runner_up_hotword(model, lp):
    """A runner-up character of some frame that the plain result lacks and that a boost of 6
    brings into it: (the character, its graph, the biased n-best at beam 8)."""
    best = ctc_prefix_beam_search(lp, beam_size=8)[0][0].tokens
    top_v, top_i = lp.topk(3, dim=-1)
    runners = sorted({(float(v), int(u)) for vs, us in zip(top_v[:, 1:], top_i[:, 1:], strict=True)
                      for v, u in zip(vs, us, strict=True) if int(u) not in best and int(u) != 0},
                     reverse=True)
    encode = PieceEncoder(model.units.pieces)
    for _, extra in runners[:20]:
        word = model.units.piece(extra)
        graph = ContextGraph([encode(word)], 6.0)
        want = ctc_prefix_beam_search(lp, beam_size=8, context_graphs=[graph])[0]
        if extra in want[0].tokens:
            return word, graph, want
    pytest.fail("no runner-up character wins with a boost of 6")


def test_biased_prefix_beam_is_the_reference_search(speech) -> None:
    from oasr.engine import ASREngine

    model = load("u2pp_conformer")
    assert model.capabilities.hotwords
    lp = _log_probs(model, speech[CLIP])
    word, graph, want = _runner_up_hotword(model, lp)
    assert want[0].tokens != ctc_prefix_beam_search(lp, beam_size=8)[0][0].tokens
    engine = ASREngine(EngineConfig(), model=model)
    try:
        opts = DecodingOptions.build(beam_size=8, decoding_method="ctc_prefix_beam_search",
                                     hotwords=(word,), hotwords_score=6.0)
        got = engine.transcribe_arrays([speech[CLIP]], decoding=opts)[0]
        assert got.segments[0].tokens == want[0].tokens
        # attention rescoring ranks the biased n-best: its pick is one of them
        resc = engine.transcribe_arrays([speech[CLIP]], decoding=DecodingOptions.build(
            beam_size=8, hotwords=(word,), hotwords_score=6.0))[0]
        assert resc.segments[0].tokens in [h.tokens for h in want]
        # auto at beam_size 1 with hotwords: the prefix beam search (beam 4), biased
        auto = engine.transcribe_arrays([speech[CLIP]], decoding=DecodingOptions(hotwords=(word + " :6",)))[0]
        four = ctc_prefix_beam_search(lp, beam_size=4, context_graphs=[graph])[0][0]
        assert auto.segments[0].tokens == four.tokens
        with pytest.raises(UnsupportedOptionError, match="hotwords") as info:
            engine.submit(speech[CLIP], DecodingOptions.build(hotwords=(word,),
                                                              decoding_method="ctc_greedy_search"))
        assert info.value.param == "hotwords"
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_gpu_prefix_beam_with_hotwords_matches_host(speech) -> None:
    """On CUDA the offline prefix beam search runs as tensor operations: the same tokens as
    the host search on the CUDA model's log-probabilities, with and without hotwords."""
    from oasr.checkpoint import load_model

    from .conftest import DATA  # noqa: TID252

    model = load_model(EngineConfig(ckpt_dir=str(DATA / "u2pp_conformer"), device="cuda",
                                    dtype="float32"))
    lp = _log_probs(model, speech[CLIP])
    word, graph, _ = _runner_up_hotword(model, lp)
    for hotwords, g in ((None, None), ((word + " :6",), graph)):
        want = ctc_prefix_beam_search(lp, beam_size=8, context_graphs=[g])[0][0]
        got = model.transcribe([speech[CLIP]], DecodingOptions.build(
            beam_size=8, decoding_method="ctc_prefix_beam_search", hotwords=hotwords))[0]
        assert got.segments[0].tokens == want.tokens
