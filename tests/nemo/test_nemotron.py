"""Nemotron cache-aware streaming FastConformer RNN-T against ``transformers``'
``NemotronAsrStreamingForRNNT`` (random checkpoint saved with ``save_pretrained``, conftest):
offline encoder output and greedy tokens, and chunk by chunk against its own streaming path
(``use_cache`` with its sliding-window K/V cache and convolution padding caches; its streaming
``generate`` over a generator of mel chunks). Streams of different ages batched in one step,
partial results, the engine's streaming API."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from oasr.types import DecodingOptions

from .conftest import BLANK, SR  # noqa: TID252

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nemotron(hf_checkpoints):
    from oasr_models_nemo.model import NemoASR

    ck = hf_checkpoints["nemotron"]
    return ck, NemoASR.from_hf(ck.path)


def _lookahead(ck) -> int:
    return ck.model.config.encoder_config.default_num_lookahead_tokens


def _stream(model, wave: np.ndarray, sizes=(1600, 4000, 777), options=None):
    st = model.new_stream(options or DecodingOptions())
    pos, i, partials = 0, 0, []
    update = None
    while pos < len(wave) or update is None:
        n = sizes[i % len(sizes)]
        i += 1
        chunk = wave[pos:pos + n]
        pos += n
        update = model.stream_step([st], [chunk], [pos >= len(wave)])[0]
        partials.append(update.text)
    return st, update, partials


def test_offline_equals_transformers(nemotron, waves) -> None:
    ck, model = nemotron
    r = _lookahead(ck)
    inp = ck.processor(waves, sampling_rate=SR, return_tensors="pt", padding=True)
    mask = inp.attention_mask
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ck.model.encoder(input_features=inp.input_features, attention_mask=mask,
                               num_lookahead_tokens=r)
        ours, lens = model.encode_features(inp.input_features, mask.sum(-1))
        assert lens.tolist() == ref.attention_mask.sum(-1).tolist()
        for b, n in enumerate(lens.tolist()):
            torch.testing.assert_close(ours[b, :n], ref.last_hidden_state[b, :n], atol=1e-4, rtol=1e-4)
        # greedy tokens, one input at a time (the reference's padded rows are not masked)
        for w in waves:
            x = ck.processor([w], sampling_rate=SR, return_tensors="pt")
            n = int(ck.model.get_audio_features(input_features=x.input_features,
                                                attention_mask=x.attention_mask,
                                                num_lookahead_tokens=r).attention_mask.sum())
            out = ck.model.generate(input_features=x.input_features, attention_mask=x.attention_mask,
                                    num_lookahead_tokens=r, max_new_tokens=12 * n)
            tokens, frame = [], 0
            for tok, dur in zip(out.sequences[0, 1:].tolist(), out.durations[0, 1:].tolist(), strict=True):
                if frame >= n:
                    break
                if tok != BLANK:
                    tokens.append(tok)
                frame += dur
            got = model.transcribe([w], DecodingOptions())[0]
            assert got.segments[0].tokens == tokens
            assert len(set(tokens)) >= 5


def test_chunk_by_chunk_equals_transformers_streaming(nemotron) -> None:
    """Audio of exactly n chunks (1 + 8r mel frames, then 8(r+1) each): every chunk's encoder
    output equals transformers' cache-aware streaming forward, and the tokens its streaming
    generate emits."""
    ck, model = nemotron
    r = _lookahead(ck)
    mel_frames = 1 + 8 * r + 8 * (r + 1) * 5
    rng = np.random.default_rng(3)
    wave = (rng.standard_normal(mel_frames * 160 + 50) * 0.1).astype(np.float32)
    feats = ck.processor([wave], sampling_rate=SR, return_tensors="pt").input_features[:, :mel_frames]
    sizes = [1 + 8 * r] + [8 * (r + 1)] * 5
    chunks = list(torch.split(feats, sizes, dim=1))
    ref_chunks = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = padding_cache = None
        for chunk in chunks:
            out = ck.model.encoder(input_features=chunk, cache=cache, padding_cache=padding_cache,
                                   use_cache=True, num_lookahead_tokens=r)
            cache, padding_cache = out.cache, out.padding_cache
            ref_chunks.append(out.last_hidden_state[0])
        gen = ck.model.generate(input_features=(c for c in chunks), num_lookahead_tokens=r)
    model.keep_encoder_output = True
    try:
        st, final, _ = _stream(model, wave, sizes=(2000, 5000, 1234))
    finally:
        model.keep_encoder_output = False
    ours = torch.cat(st.encoder_output)
    ref = torch.cat(ref_chunks)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    tokens = [t for t in gen.sequences[0, 1:].tolist() if t != BLANK]
    assert final.transcript.segments[0].tokens == tokens
    assert len(set(tokens)) >= 5


def test_stream_equals_offline_and_partials_grow(nemotron, waves) -> None:
    _, model = nemotron
    for w in [*waves, waves[0][:3000], waves[1][:200]]:
        offline = model.transcribe([w], DecodingOptions(word_timestamps=True))[0]
        st, final, partials = _stream(model, w, options=DecodingOptions(word_timestamps=True))
        assert final.is_final and final.text == offline.text
        got = final.transcript.words
        assert [(x.word, x.start, x.end) for x in got] == [(x.word, x.start, x.end) for x in offline.words]
        assert [x.confidence for x in got] == pytest.approx([x.confidence for x in offline.words], abs=1e-5)
        assert all(a == b[:len(a)] or not a for a, b in zip(partials, partials[1:], strict=False))


def test_streams_of_different_ages_batch_in_one_step(nemotron, waves) -> None:
    _, model = nemotron
    expected = [t.text for t in model.transcribe(waves, DecodingOptions())]
    states = [model.new_stream(DecodingOptions()) for _ in waves]
    fed = [0] * len(waves)
    starts = [0, 2, 4]  # stream k joins at step starts[k]
    step, done = 0, [False] * len(waves)
    finals: dict[int, str] = {}
    while not all(done):
        rows = [k for k in range(len(waves)) if step >= starts[k] and not done[k]]
        chunks, lasts = [], []
        for k in rows:
            n = 1500 + 700 * k
            chunks.append(waves[k][fed[k]:fed[k] + n])
            fed[k] += n
            lasts.append(fed[k] >= len(waves[k]))
        for k, u, last in zip(rows, model.stream_step([states[k] for k in rows], chunks, lasts),
                              lasts, strict=True):
            if last:
                done[k] = True
                finals[k] = u.text
        step += 1
    assert [finals[k] for k in range(len(waves))] == expected


def test_other_lookahead_and_errors(nemotron, waves) -> None:
    from oasr.errors import InvalidRequestError

    ck, model = nemotron
    opts = DecodingOptions(model_options={"lookahead": 0})
    offline = model.transcribe(waves[:1], opts)[0]
    _, final, _ = _stream(model, waves[0], options=opts)
    assert final.text == offline.text
    with pytest.raises(InvalidRequestError, match="lookahead"):
        model.new_stream(DecodingOptions(model_options={"lookahead": 5}))


def test_engine_streaming_api(hf_checkpoints, nemotron, waves) -> None:
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    ck, model = nemotron
    expected = [t.text for t in model.transcribe(waves, DecodingOptions())]
    engine = ASREngine(EngineConfig(ckpt_dir=str(ck.path), service_mode="streaming",
                                    max_batch_size=4))
    try:
        got = [t.text for t in engine.transcribe(list(waves))]
        rid = engine.add_streaming_request()
        for i in range(0, len(waves[0]), 3200):
            engine.feed_chunk(rid, waves[0][i:i + 3200], is_last=i + 3200 >= len(waves[0]))
        finals = engine.run()
    finally:
        engine.shutdown()
    assert got == expected
    assert finals[rid].text == expected[0]


def test_samples_needed_makes_a_chunk(nemotron, waves) -> None:
    """Feeding exactly ``samples_needed`` samples always completes the next chunk (the mel of a
    frame needs half a window past it), so a stream never waits a tick too long."""
    _, model = nemotron
    st = model.new_stream(DecodingOptions())
    pos = 0
    for _ in range(4):
        n = st.samples_needed
        before = st.emitted
        model.stream_step([st], [waves[0][pos:pos + n]], [False])
        pos += n
        assert st.emitted == before + st.lookahead + 1


def test_beam_stream_equals_offline_beam(nemotron, waves) -> None:
    _, model = nemotron
    opts = DecodingOptions(beam_size=3)
    offline = model.transcribe(waves[:1], opts)[0]
    _, final, _ = _stream(model, waves[0], options=opts)
    assert final.text == offline.text and final.text
