"""Parakeet CTC / RNN-T / TDT against ``transformers``' own classes, run in the test on random
checkpoints saved in the Hugging Face layout (conftest): features, encoder output, and greedy
token sequences (and frames / durations) identical, over a padded batch; the engine's offline
path, word timestamps, beam search, the native format and the registry."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from oasr.types import DecodingOptions

from .conftest import BLANK, SR  # noqa: TID252

pytestmark = pytest.mark.slow


def _reference_inputs(ck, waves):
    inp = ck.processor(waves, sampling_rate=SR, return_tensors="pt", padding=True)
    return inp.input_features, inp.attention_mask


@pytest.fixture(scope="module")
def models(hf_checkpoints):
    from oasr_models_nemo.model import NemoASR

    return {k: NemoASR.from_hf(ck.path) for k, ck in hf_checkpoints.items() if k != "nemotron"}


def _assert_varied(token_lists: list[list[int]]) -> None:
    flat = [t for ts in token_lists for t in ts]
    assert len(set(flat)) >= 5, token_lists
    assert all(ts for ts in token_lists), "an input decoded to nothing"


@pytest.mark.parametrize("kind", ["ctc", "rnnt", "tdt"])
def test_features_and_encoder_equal_transformers(hf_checkpoints, models, waves, kind) -> None:
    ck, model = hf_checkpoints[kind], models[kind]
    feats_ref, mask = _reference_inputs(ck, waves)
    feats, flens = model.features(waves)
    assert flens.tolist() == mask.sum(-1).tolist()
    for b, n in enumerate(flens.tolist()):
        assert torch.allclose(feats[b, :n], feats_ref[b, :n], atol=1e-4), b
    with torch.no_grad():
        ref = ck.model.encoder(input_features=feats_ref, attention_mask=mask)
        ours, lens = model.encode_features(feats_ref, mask.sum(-1))
    assert lens.tolist() == ref.attention_mask.sum(-1).tolist()
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(ours[b, :n], ref.last_hidden_state[b, :n], atol=1e-4, rtol=1e-4)


def _transducer_reference(ck, feats, mask) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """transformers' generate, replayed into tokens, their frames and (TDT) durations."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lengths = ck.model.get_audio_features(input_features=feats, attention_mask=mask,
                                              output_attention_mask=True).attention_mask.sum(-1)
        # room for every step: at most max_symbols tokens and one blank per frame
        out = ck.model.generate(input_features=feats, attention_mask=mask,
                                max_new_tokens=12 * int(lengths.max()))
    tokens, times, durations = [], [], []
    for b in range(feats.shape[0]):
        frame, tk, tm, du = 0, [], [], []
        for tok, dur in zip(out.sequences[b, 1:].tolist(), out.durations[b, 1:].tolist(), strict=True):
            if frame >= int(lengths[b]):
                break
            if tok != BLANK:
                tk.append(tok)
                tm.append(frame)
                du.append(dur)
            frame += dur
        assert frame >= int(lengths[b]), "the reference stopped before the end of its frames"
        tokens.append(tk)
        times.append(tm)
        durations.append(du)
    return tokens, times, durations


def test_ctc_greedy_equals_transformers_generate(hf_checkpoints, models, waves) -> None:
    ck, model = hf_checkpoints["ctc"], models["ctc"]
    feats, mask = _reference_inputs(ck, waves)
    with torch.no_grad():
        seq = ck.model.generate(input_features=feats, attention_mask=mask)
    ref = []
    for row in seq.tolist():
        collapsed = [t for i, t in enumerate(row) if i == 0 or t != row[i - 1]]
        ref.append([t for t in collapsed if t != BLANK])
    out = model.transcribe(waves, DecodingOptions())
    ours = [t.segments[0].tokens if t.segments else [] for t in out]
    assert ours == ref
    _assert_varied(ours)
    assert out[0].text == model.tokenizer.decode(ref[0]) and out[0].text


@pytest.mark.parametrize("kind", ["rnnt", "tdt"])
def test_transducer_greedy_equals_transformers_generate(hf_checkpoints, models, waves, kind) -> None:
    ck, model = hf_checkpoints[kind], models[kind]
    feats, mask = _reference_inputs(ck, waves)
    tokens, times, durations = _transducer_reference(ck, feats, mask)
    # transformers' TDT loop has no per-frame symbol limit: give ours one it never reaches
    opts = DecodingOptions(model_options={"max_symbols_per_frame": 10_000 if kind == "tdt" else 10})
    options = model._check(opts)
    with torch.no_grad():
        enc, lens = model.encode_features(feats, mask.sum(-1), options)
    hyps = model.search(enc, lens, options)
    assert [h.tokens for h in hyps] == tokens
    assert [h.times for h in hyps] == times
    if kind == "tdt":
        assert [h.durations for h in hyps] == durations
        assert len({d for ds in durations for d in ds}) >= 2, durations
    _assert_varied(tokens)
    # the whole offline path (features from audio) gives the same tokens
    out = model.transcribe(waves, opts)
    assert [t.segments[0].tokens for t in out] == tokens


def test_word_timestamps(models, waves) -> None:
    for kind, model in models.items():
        out = model.transcribe(waves[:1], DecodingOptions(word_timestamps=True))[0]
        words = out.words
        assert words, kind
        assert all(0 <= w.start <= w.end <= out.duration + 1e-6 for w in words), kind
        assert all(a.start <= b.start for a, b in zip(words, words[1:], strict=False)), kind
        assert "".join(w.word for w in words) == out.text.replace(" ", ""), kind
    # TDT: token ends from the predicted durations
    tdt = models["tdt"]
    opts = tdt._check(DecodingOptions(word_timestamps=True))
    enc, lens = tdt.encode(waves[:1], opts)
    hyp = tdt.search(enc, lens, opts)[0]
    words = tdt.transcript(hyp, len(waves[0]) / SR, int(lens[0]), opts).words
    last = hyp.times[-1] + hyp.durations[-1]
    expected = min(min(last, int(lens[0])) * tdt.frame_shift, len(waves[0]) / SR)
    assert words[-1].end == pytest.approx(expected, abs=1e-3)
    assert words[0].start == pytest.approx(hyp.times[0] * tdt.frame_shift, abs=1e-3)


def test_beam_search(models, waves) -> None:
    for kind in ("ctc", "rnnt"):
        model = models[kind]
        greedy = model.transcribe(waves, DecodingOptions())
        beam = model.transcribe(waves, DecodingOptions(beam_size=4, word_timestamps=True))
        assert [b.text for b in beam]
        # a beam of one is greedy
        one = model.transcribe(waves, DecodingOptions(beam_size=1))
        assert [t.text for t in one] == [t.text for t in greedy]
    tdt = models["tdt"]
    beam = tdt.transcribe(waves, DecodingOptions(beam_size=4, word_timestamps=True))
    assert all(t.text and t.words for t in beam)


def test_tdt_beam_of_one_is_greedy_and_wider_beams_rank(models, waves) -> None:
    from oasr.decoders.tdt_beam import tdt_beam_search

    tdt = models["tdt"]
    c = tdt.config
    opts = tdt._check(DecodingOptions())
    enc, lens = tdt.encode(waves, opts)
    greedy = tdt.search(enc, lens, opts)
    with torch.no_grad():
        proj = tdt.net.encoder_projector(enc)
        one = tdt_beam_search(tdt.transducer, proj, lens.tolist(), durations=c.durations,
                              blank_id=c.blank_id, beam_size=1)
        wide = tdt_beam_search(tdt.transducer, proj, lens.tolist(), durations=c.durations,
                               blank_id=c.blank_id, beam_size=6, length_norm=False)
    for g, (b,), w in zip(greedy, one, wide, strict=True):
        assert (b.tokens, b.times, b.durations) == (g.tokens, g.times, g.durations)
        assert b.score == pytest.approx(g.score, abs=1e-3)
        assert len(w) <= 6
        assert [h.score for h in w] == sorted((h.score for h in w), reverse=True)
        # the merged beam keeps at least the probability of the greedy path
        assert w[0].score >= g.score - 1e-4


def test_batched_equals_one_at_a_time(models, waves) -> None:
    for kind, model in models.items():
        batch = [t.text for t in model.transcribe(waves, DecodingOptions())]
        single = [model.transcribe([w], DecodingOptions())[0].text for w in waves]
        assert batch == single, kind


def test_native_round_trip(models, waves, tmp_path) -> None:
    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    for kind, model in models.items():
        dst = tmp_path / kind
        arch = model.save_native(dst)
        assert arch == f"parakeet_{kind}"
        again = load_model(EngineConfig(ckpt_dir=str(dst)))
        assert type(again) is type(model)
        for (k, a), (_, b) in zip(model.net.state_dict().items(), again.net.state_dict().items(),
                                  strict=True):
            assert torch.equal(a, b), k
        assert [t.text for t in again.transcribe(waves, DecodingOptions())] == \
            [t.text for t in model.transcribe(waves, DecodingOptions())]


def test_registry_and_engine(hf_checkpoints, waves) -> None:
    from oasr.checkpoint import detect_format, load_model
    from oasr.engine import ASREngine
    from oasr.plugins import get_registry
    from oasr.types import EngineConfig

    archs = get_registry("architecture")
    for key in ("nemotron", "parakeet_ctc", "parakeet_rnnt", "parakeet_tdt"):
        assert archs.get(key).distribution == "oasr-models-nemo"
    assert archs.get("fastconformer_rnnt") is archs.get("nemotron")
    path = hf_checkpoints["tdt"].path
    assert detect_format(path) == "hf-parakeet"
    model = load_model(EngineConfig(ckpt_dir=str(path)))
    expected = [t.text for t in model.transcribe(waves, DecodingOptions())]
    engine = ASREngine(EngineConfig(ckpt_dir=str(path), max_batch_size=2))
    try:
        got = [t.text for t in engine.transcribe(list(waves))]
    finally:
        engine.shutdown()
    assert got == expected


def test_missing_tokenizer_is_a_clear_error(hf_checkpoints, tmp_path) -> None:
    import shutil

    from oasr.errors import CheckpointError
    from oasr_models_nemo.model import NemoASR

    src = hf_checkpoints["ctc"].path
    dst = tmp_path / "no_tok"
    shutil.copytree(src, dst)
    (dst / "tokenizer.model").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.model"):
        NemoASR.from_hf(dst)


def test_tokenizer_is_the_real_parakeet_one(models) -> None:
    tok = models["ctc"].tokenizer
    assert len(tok) == 8192
    assert tok.decode([]) == ""
    text = tok.decode(list(range(274, 300)))
    assert text and "\u2581" not in text
    assert np.isclose(len(tok.pieces), 8192)
