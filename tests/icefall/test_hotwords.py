"""Hotwords on a random-weight icefall Zipformer (CTC head) through the engine: the biased
result is exactly the biased prefix beam search on the model's own log-probabilities with the
same graph; a hotword from a hypothesis the plain beam ranks lower wins; greedy requests switch
to the beam (auto) or are refused (explicit); no hotwords changes nothing."""

from __future__ import annotations

import pytest
import torch

from oasr.checkpoint import load_model
from oasr.decoders.context_graph import ContextGraph, PieceEncoder
from oasr.decoders.ctc import ctc_prefix_beam_search
from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.types import DecodingOptions, EngineConfig


@pytest.fixture(scope="module")
def setup(offline_release, helpers):
    model = load_model(EngineConfig(ckpt_dir=str(offline_release[1])))
    ws = helpers.waves(2)
    feats, lens = model.features(ws)
    opts = model._check(DecodingOptions.build(decoding_method="ctc_prefix_beam_search"))
    with torch.no_grad():
        enc, enc_lens = model.encode_features(feats, lens, opts)
        lp = model.net.ctc_log_probs(enc).cpu()
    return model, ws, lp, [int(n) for n in enc_lens]


def test_capability_and_greedy_rules(setup) -> None:
    model, ws, _, _ = setup
    assert model.capabilities.hotwords
    for method in ("ctc_greedy_search", "greedy_search"):
        with pytest.raises(UnsupportedOptionError, match="hotwords"):
            model.transcribe(ws[:1], DecodingOptions.build(hotwords=("AB",), decoding_method=method))
    with pytest.raises(InvalidRequestError, match="cannot spell"):  # not in the vocabulary
        model.transcribe(ws[:1], DecodingOptions.build(hotwords=("ZZQ",), beam_size=4))
    # auto + beam_size 1 + hotwords: the model's beam search (beam 4) runs, biased
    word = model.tokens.piece(3).lstrip("\u2581") + model.tokens.piece(4)  # "▁AD" + "BK"
    assert PieceEncoder(model.tokens.pieces)(word) == [3, 4]
    auto = model.transcribe(ws, DecodingOptions.build(hotwords=(word + " :4",)))
    beam = model.transcribe(ws, DecodingOptions.build(hotwords=(word + " :4",), beam_size=4,
                                                      decoding_method="modified_beam_search"))
    assert [t.text for t in auto] == [t.text for t in beam]


def test_biased_result_is_the_biased_search(setup) -> None:
    from oasr.engine import ASREngine

    model, ws, lp, lens = setup
    plain = ctc_prefix_beam_search(lp, lens, beam_size=6)
    # a hotword from the second hypothesis of the first utterance (not in the first)
    best, other = plain[0][0].tokens, plain[0][1].tokens
    extra = [t for t in other if t not in best] or other[-1:]
    piece = model.tokens.piece(extra[0])
    hotwords = (piece.replace("\u2581", "") + " :12",)
    spelled = PieceEncoder(model.tokens.pieces)(piece.replace("\u2581", ""))
    graph = ContextGraph([spelled], 12.0)
    want = ctc_prefix_beam_search(lp, lens, beam_size=6, context_graphs=[graph, graph])
    engine = ASREngine(EngineConfig(ckpt_dir=model.source_path if isinstance(model.source_path, str)
                                    else str(model.source_path), max_batch_size=4))
    try:
        opts = DecodingOptions.build(beam_size=6, decoding_method="ctc_prefix_beam_search",
                                     hotwords=hotwords)
        got = engine.transcribe_arrays(ws, decoding=opts)
        none = engine.transcribe_arrays(ws, decoding=DecodingOptions.build(
            beam_size=6, decoding_method="ctc_prefix_beam_search"))
    finally:
        engine.shutdown()
    assert [t.segments[0].tokens if t.segments else [] for t in got] == [w[0].tokens for w in want]
    assert set(spelled) <= set(want[0][0].tokens) and want[0][0].tokens != best
    assert [t.segments[0].tokens if t.segments else [] for t in none] == [p[0].tokens for p in plain]
