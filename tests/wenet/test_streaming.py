"""Streaming: chunk-by-chunk decoding through ``new_stream`` / ``stream_step``.

* the final result of a stream fed real audio equals WeNet's chunk-by-chunk golden result;
* streaming with chunk size C equals the offline pass with the same chunk mask (causal model);
* results do not depend on how audio is chunked when fed, nor on which other streams share the
  batch (hypothesis, few examples).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oasr.types import DecodingOptions

from .conftest import Golden, load  # noqa: TID252

CLIP = "zh_aishell_BAC009S0764W0121.wav"
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def run_stream(model, audio, sizes, options, chunk_size, left, *, extra=None):
    """Feed ``audio`` in pieces of ``sizes`` (cycled); ``extra``: other (state, audio, sizes)
    streams stepped in the same batches. Returns (final update, encoder output, partial texts)."""
    streams = [(model.new_stream(options, chunk_size=chunk_size, num_left_chunks=left), audio, list(sizes))]
    for a, s, opt, c, lft in extra or []:
        streams.append((model.new_stream(opt, chunk_size=c, num_left_chunks=lft), a, list(s)))
    pos = [0] * len(streams)
    k = [0] * len(streams)
    finals = [None] * len(streams)
    partials: list[str] = []
    while any(f is None for f in finals):
        states, chunks, lasts, idx = [], [], [], []
        for i, (state, a, sizes_i) in enumerate(streams):
            if finals[i] is not None:
                continue
            n = sizes_i[k[i] % len(sizes_i)]
            k[i] += 1
            piece = a[pos[i] : pos[i] + n]
            pos[i] += n
            states.append(state)
            chunks.append(piece)
            lasts.append(pos[i] >= len(a))
            idx.append(i)
        ups = model.stream_step(states, chunks, lasts)
        for i, up in zip(idx, ups, strict=True):
            if i == 0 and not up.is_final:
                partials.append(up.text)
            if up.is_final:
                finals[i] = up
    enc = streams[0][0].enc[0] if streams[0][0].enc else None
    return finals[0], enc, partials


@pytest.fixture(autouse=True)
def _keep_enc(u2pp, u2_conv2d6):
    u2pp.keep_encoder_output = True
    u2_conv2d6.keep_encoder_output = True
    yield


@pytest.mark.parametrize("variant,key", [("u2pp_conformer", "C4_L1_stream"),
                                         ("u2pp_conformer", "C16_L-1_stream"),
                                         ("u2_conformer_conv2d6", "C8_L1_stream")])
def test_stream_matches_wenet_chunk_by_chunk(variant, key, speech) -> None:
    g = Golden(variant)
    model = load(variant)
    model.keep_encoder_output = True
    run = g.run(key)
    model.ctc_weight, model.reverse_weight = run["ctc_weight"], run["reverse_weight"]
    opts = DecodingOptions(beam_size=run["beam"])
    final, enc, partials = run_stream(model, speech[CLIP], [3200, 1234, 777], opts, run["chunk"], run["left"])
    assert final.is_final and final.transcript is not None
    assert final.transcript.segments[0].tokens == run["results"][0]["rescoring"]
    if f"{key}_enc_0" in g.arrays:
        assert (enc - torch.from_numpy(g.arrays[f"{key}_enc_0"])).abs().max().item() < 1e-3
    assert len(partials) > 3  # a partial hypothesis after every chunk


def test_greedy_stream_partials_grow(u2pp, speech) -> None:
    opts = DecodingOptions(beam_size=1)
    final, _, partials = run_stream(u2pp, speech[CLIP], [1600], opts, 4, -1)
    # greedy partials only ever extend
    for a, b in zip(partials, partials[1:], strict=False):
        assert b.startswith(a)
    assert final.text.startswith(partials[-1])
    g = Golden("u2pp_conformer")
    assert final.transcript.segments[0].tokens == g.run("C4_L-1_stream")["results"][0]["greedy"]


@SETTINGS
@given(chunk=st.integers(1, 8), left=st.sampled_from([-1, 0, 1, 3]), start=st.integers(0, 20000),
       dur=st.integers(3000, 30000))
def test_streaming_equals_chunk_masked_offline(u2pp, speech, chunk, left, start, dur) -> None:
    """Causal U2++: chunk-by-chunk with caches == offline with the chunk mask (L >= 0: the same
    limited left context)."""
    audio = speech[CLIP][start : start + dur]
    final, enc, _ = run_stream(u2pp, audio, [2500], DecodingOptions(), chunk, left)
    ref, lens = u2pp.encode([audio], chunk, left)
    ref = ref[0, : lens[0]]
    if enc is None:
        assert lens[0] == 0
        return
    # WeNet drops a trailing partial chunk shorter than the subsampling context when streaming
    n = enc.shape[0]
    assert n <= ref.shape[0] <= n + 1
    assert (enc - ref[:n]).abs().max().item() < 1e-4


@SETTINGS
@given(sizes=st.lists(st.integers(700, 9000), min_size=1, max_size=3),
       others=st.lists(st.tuples(st.sampled_from([0, 1, 2, 3]), st.integers(500, 7000),
                                 st.integers(1, 3), st.sampled_from([-1, 1])), max_size=3))
def test_independent_of_chunking_and_batch(u2pp, speech, sizes, others) -> None:
    names = list(speech)
    opts = DecodingOptions(beam_size=3)
    solo, solo_enc, _ = run_stream(u2pp, speech[CLIP], [4000], opts, 4, 2)
    extra = [(speech[names[i]][:n * 40], [n], DecodingOptions(beam_size=1 + (c % 2) * 3), c * 4, lft)
             for i, n, c, lft in others]
    got, enc, _ = run_stream(u2pp, speech[CLIP], sizes, opts, 4, 2, extra=extra)
    assert got.text == solo.text
    assert got.transcript.segments[0].tokens == solo.transcript.segments[0].tokens
    assert (enc - solo_enc).abs().max().item() < 1e-4


def test_non_causal_model_streams(u2_conv2d6, speech) -> None:
    """A U2 model with a centred convolution streams WeNet's way (each chunk zero-padded)."""
    g = Golden("u2_conformer_conv2d6")
    run = g.run("C4_L-1_stream")
    u2_conv2d6.ctc_weight, u2_conv2d6.reverse_weight = run["ctc_weight"], run["reverse_weight"]
    final, _, _ = run_stream(u2_conv2d6, speech[CLIP], [5000], DecodingOptions(beam_size=5), 4, -1)
    assert final.transcript.segments[0].tokens == run["results"][0]["rescoring"]


def test_stream_errors(u2pp) -> None:
    from oasr.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        u2pp.new_stream(DecodingOptions(), chunk_size=0)
    s = u2pp.new_stream(DecodingOptions())
    assert s.samples_needed == 400 + ((16 - 1) * 4 + 7 - 1) * 160
    up = u2pp.stream_step([s], [np.zeros(100, np.float32)], [True])[0]
    assert up.is_final and up.text == ""
    with pytest.raises(InvalidRequestError):
        u2pp.stream_step([s], [np.zeros(10, np.float32)], [True])
