"""Parity with WeNet's own code (golden outputs in tests/data/wenet, produced by WeNet at a
recorded commit from the same features): encoder outputs, CTC log-posteriors, greedy / prefix
beam / attention-rescoring hypotheses, offline (full and chunk-masked, padded batch of two) and
chunk by chunk with K/V + convolution caches."""

from __future__ import annotations

import pytest
import torch

from oasr.decoders.ctc import ctc_greedy_search, ctc_prefix_beam_search

from .conftest import VARIANTS, Golden, load  # noqa: TID252

ENC_TOL = 1e-4
CTC_TOL = 1e-4


def _encode_run(model, g: Golden, run: dict) -> list[torch.Tensor]:
    f0, f1 = g.feats
    if run["simulate_streaming"]:
        st = model.new_stream(None, chunk_size=run["chunk"], num_left_chunks=run["left"])
        st.keep_encoder_output = True
        model.stream_features(st, f0.clone())
        return [torch.cat(st.enc)]
    feats = torch.nn.utils.rnn.pad_sequence([f0, f1], batch_first=True)
    enc, lens = model.encode_features(feats, torch.tensor([len(f0), len(f1)]), run["chunk"], run["left"])
    return [enc[b, : lens[b]] for b in range(2)]


CASES = [(v, r["key"]) for v in VARIANTS for r in Golden(v).meta["runs"]]


@pytest.mark.parametrize("variant,key", CASES)
def test_matches_wenet(variant: str, key: str) -> None:
    g = Golden(variant)
    model = load(variant)
    run = g.run(key)
    encs = _encode_run(model, g, run)
    for b, enc in enumerate(encs):
        assert enc.shape[0] == run["enc_lens"][b]
        if f"{key}_enc_{b}" in g.arrays:
            ref = torch.from_numpy(g.arrays[f"{key}_enc_{b}"])
            assert (enc - ref).abs().max().item() < ENC_TOL
        with torch.no_grad():
            logp = model.net.ctc_log_probs(enc[None])[0]
        if f"{key}_ctc_{b}" in g.arrays:
            ref_lp = torch.from_numpy(g.arrays[f"{key}_ctc_{b}"])
            assert (logp - ref_lp).abs().max().item() < CTC_TOL
        r = run["results"][b]
        assert ctc_greedy_search(logp)[0].tokens == r["greedy"]
        nbest = ctc_prefix_beam_search(logp, beam_size=run["beam"])[0]
        assert [h.tokens for h in nbest] == r["prefix_nbest"]
        assert [h.times for h in nbest] == r["prefix_times"]
        for h, s in zip(nbest, r["prefix_scores"], strict=True):
            assert h.score == pytest.approx(s, abs=1e-3)
        model.ctc_weight, model.reverse_weight = run["ctc_weight"], run["reverse_weight"]
        hyp, conf = model._rescore(enc, nbest)
        assert hyp.tokens == r["rescoring"]
        assert hyp.score == pytest.approx(r["rescoring_score"], abs=1e-3)
        assert conf == pytest.approx(r["rescoring_token_confidence"], abs=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoders_exact_on_wenet_posteriors(variant: str) -> None:
    """Given WeNet's own CTC log-posteriors, our decoders reproduce WeNet's n-best exactly
    (tokens, Viterbi times, scores to float rounding)."""
    g = Golden(variant)
    for run in g.meta["runs"]:
        for b, r in enumerate(run["results"]):
            key = f"{run['key']}_ctc_{b}"
            if key not in g.arrays:
                continue
            lp = torch.from_numpy(g.arrays[key])
            assert ctc_greedy_search(lp)[0].tokens == r["greedy"]
            nbest = ctc_prefix_beam_search(lp, beam_size=run["beam"])[0]
            assert [h.tokens for h in nbest] == r["prefix_nbest"]
            assert [h.times for h in nbest] == r["prefix_times"]
            assert [h.score for h in nbest] == pytest.approx(r["prefix_scores"], abs=1e-9)


def test_frontend_reproduces_golden_features(speech) -> None:
    """The golden features were computed by OASR's Kaldi fbank (scale 32768, dither 0); the
    model's frontend gives the same frames."""
    g = Golden("u2pp_conformer")
    model = load("u2pp_conformer")
    wave = speech["zh_aishell_BAC009S0764W0121.wav"]
    feats = model.fbank(torch.from_numpy(wave))
    assert feats.shape == g.feats[0].shape
    assert (feats - g.feats[0]).abs().max().item() < 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_beam_search_matches_wenet(variant: str) -> None:
    """WeNet's ``attention`` method (decoder beam search, batch of two padded items)."""
    g = Golden(variant)
    model = load(variant)
    f0, f1 = g.feats
    feats = torch.nn.utils.rnn.pad_sequence([f0, f1], batch_first=True)
    for run in g.meta["runs"]:
        if run["simulate_streaming"] or run["key"] not in ("C-1_L-1_mask", "C4_L1_mask"):
            continue
        enc, lens = model.encode_features(feats, torch.tensor([len(f0), len(f1)]), run["chunk"], run["left"])
        got = model.attention_beam_search(enc, lens, run["beam"])
        assert got == [r["attention"] for r in run["results"]]


def test_decoding_methods(speech) -> None:
    """decoding_method per request (a WeNet option), each matching WeNet's own method."""
    from oasr.errors import InvalidRequestError
    from oasr.types import DecodingOptions

    g = Golden("u2pp_conformer")
    model = load("u2pp_conformer")
    run = g.run("C-1_L-1_mask")
    model.ctc_weight, model.reverse_weight = run["ctc_weight"], run["reverse_weight"]
    audio = [speech["zh_aishell_BAC009S0764W0121.wav"]]
    want = {"ctc_greedy_search": run["results"][0]["greedy"],
            "ctc_prefix_beam_search": run["results"][0]["prefix_nbest"][0],
            "attention_rescoring": run["results"][0]["rescoring"]}
    for method, tokens in want.items():
        opts = DecodingOptions.build(beam_size=5, word_timestamps=True, decoding_method=method)
        assert model.transcribe(audio, opts)[0].segments[0].tokens == tokens
    tr = model.transcribe(audio, DecodingOptions.build(beam_size=5, decoding_method="attention"))[0]
    assert tr.text and tr.words == []  # no alignment, no word times
    with pytest.raises(InvalidRequestError) as info:
        model.transcribe(audio, DecodingOptions.build(beam_size=5, decoding_method="nope"))
    assert info.value.param == "decoding_method"
    # the model-level default is what a request without the option gets
    model.decoding_method = "ctc_prefix_beam_search"
    try:
        got = model.transcribe(audio, DecodingOptions(beam_size=5))[0].segments[0].tokens
        assert got == want["ctc_prefix_beam_search"]
        with pytest.raises(InvalidRequestError):
            model.decoding_method = "nope"  # a default is validated when it is set
    finally:
        model.decoding_method = "auto"
