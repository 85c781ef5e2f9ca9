"""Nemotron streams with their caches in core's ``StreamCachePool`` (``oasr_models_nemo.streaming``):

* property (hypothesis, few examples): a stream's tokens and encoder output do not depend on the
  streams that share its steps: alone, or batched with streams of other ages, lookaheads and
  chunk sizes, rows in any order, after other streams took and returned slots; eagerly and
  through the CUDA-graph path's bucketing (``GraphSteps(simulate=True)``: batch padded to its
  bucket with scratch rows, static buffers, captured on scratch inputs first);
* every slot is returned on finish and abort (through the engine's scheduler), and an empty
  stream says what offline decoding says (nothing).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from oasr.types import DecodingOptions

from .conftest import SR  # noqa: TID252

FEW = settings(max_examples=2, deadline=None, derandomize=True, phases=[Phase.generate],
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def nemotron(hf_checkpoints):
    from oasr_models_nemo.model import NemoASR

    model = NemoASR.from_hf(hf_checkpoints["nemotron"].path)
    model.keep_encoder_output = True
    return model


@pytest.fixture(scope="module")
def clips(waves) -> list[np.ndarray]:
    return [*waves, np.concatenate([waves[2], waves[0]])]


def _feed(model, streams, *, starts=None, order_seed=None):
    """Feed (state, audio, piece) streams together until each is final; stream k joins at step
    ``starts[k]``; rows in a shuffled order when ``order_seed`` is set. Returns per stream its
    final update and its encoder output."""
    rng = np.random.default_rng(order_seed)
    pos = [0] * len(streams)
    finals: list = [None] * len(streams)
    step = 0
    while any(f is None for f in finals):
        rows = [i for i, f in enumerate(finals) if f is None and step >= (starts[i] if starts else 0)]
        if order_seed is not None:
            rng.shuffle(rows)
        if rows:
            chunks, lasts = [], []
            for i in rows:
                state, audio, piece = streams[i]
                chunks.append(audio[pos[i]: pos[i] + piece])
                pos[i] += piece
                lasts.append(pos[i] >= len(audio))
            for i, up in zip(rows, model.stream_step([streams[i][0] for i in rows], chunks, lasts),
                             strict=True):
                if up.is_final:
                    finals[i] = up
                elif streams[i][0].search is None:  # greedy partials: decoded incrementally
                    assert up.text == model.tokenizer.decode(streams[i][0].hyp.tokens)
        step += 1
    return [(f, torch.cat(s[0].encoder_output) if s[0].encoder_output else None)
            for f, s in zip(finals, streams, strict=True)]


def _tokens(update) -> list[int]:
    return update.transcript.segments[0].tokens if update.transcript.segments else []


@pytest.mark.slow
@FEW
@given(specs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8000), st.sampled_from([0, 2]),
                                st.integers(1, 6), st.integers(0, 3), st.sampled_from([1, 3])),
                      min_size=2, max_size=4),
       noise=st.integers(0, 4), seed=st.integers(0, 99))
@pytest.mark.parametrize("bucketed", [False, True], ids=["eager", "bucketed"])
def test_results_do_not_depend_on_the_batch(nemotron, clips, specs, noise, seed, bucketed) -> None:
    from oasr.stream_cache import GraphSteps

    model = nemotron

    def make():
        out = []
        for clip, start, lookahead, pieces, _, max_sym in specs:
            opts = DecodingOptions(model_options={"lookahead": lookahead, "max_symbols_per_frame": max_sym})
            out.append((model.new_stream(opts), clips[clip][start:], 800 * pieces + 160 * clip))
        return out

    rt = model.stream_runtime
    saved = rt.graphs
    try:
        solo = [_feed(model, [s])[0] for s in make()]
        if bucketed:  # the CUDA-graph path's padded buckets, on the CPU
            rt.graphs = GraphSteps(rt.compute, rt.dummy_inputs, simulate=True)
        others = [(model.new_stream(DecodingOptions()), clips[0][:9000], 2400) for _ in range(noise)]
        _feed(model, others[: noise // 2])  # these finish: their slots go back in another order
        together = _feed(model, make(), order_seed=seed, starts=[s[4] for s in specs])
        if bucketed:
            assert rt.graphs.stats["replays"] > 0
    finally:
        rt.graphs = saved
    for (f1, e1), (f2, e2) in zip(solo, together, strict=True):
        assert f1.text == f2.text
        assert _tokens(f1) == _tokens(f2)
        if e1 is None:
            assert e2 is None
        else:
            assert e1.shape == e2.shape and (e1 - e2).abs().max().item() < 1e-4
    for s, _, _ in others[noise // 2:]:
        model.release_stream(s)


@pytest.mark.slow
def test_bucketed_steps_equal_offline_and_capture_counts(nemotron, clips) -> None:
    """Padded buckets (simulated graphs) captured ahead: streams of different ages give offline
    decoding's tokens, and serving captures nothing more."""
    from oasr.stream_cache import GraphSteps

    model = nemotron
    rt = model.stream_runtime
    saved = rt.graphs
    rt.graphs = GraphSteps(rt.compute, rt.dummy_inputs, simulate=True)
    try:
        assert model.capture_stream_graphs(max_batch=4) == 3  # buckets 1, 2, 4
        captures = rt.graphs.stats["captures"]
        opts = DecodingOptions(word_timestamps=True)
        streams = [(model.new_stream(opts), c, 2000 + 900 * k) for k, c in enumerate(clips)]
        got = _feed(model, streams, starts=[0, 1, 1, 3])
        assert rt.graphs.stats["captures"] == captures
    finally:
        rt.graphs = saved
    offline = model.transcribe(clips, opts)
    for (f, _), o in zip(got, offline, strict=True):
        assert f.text == o.text and _tokens(f) == (o.segments[0].tokens if o.segments else [])
        assert [(w.word, w.start, w.end) for w in f.transcript.words] == [(w.word, w.start, w.end) for w in o.words]


@pytest.mark.slow
def test_empty_and_tiny_streams_equal_offline(nemotron, waves) -> None:
    model = nemotron
    for n in (0, 100, 700):
        w = waves[0][:n]
        offline = model.transcribe([w], DecodingOptions())[0].text
        st = model.new_stream(DecodingOptions())
        assert model.stream_step([st], [w], [True])[0].text == offline


@pytest.mark.slow
def test_finish_and_abort_return_every_slot(hf_checkpoints, waves) -> None:
    from oasr.streaming import StreamingScheduler
    from oasr_models_nemo.model import NemoASR

    model = NemoASR.from_hf(hf_checkpoints["nemotron"].path)
    sched = StreamingScheduler(model, max_batch_size=3)
    rids = [sched.add_request(DecodingOptions(beam_size=1 + 2 * (i % 3 == 2))) for i in range(6)]
    assert model.stream_occupancy()["streams"] == 6
    for i, rid in enumerate(rids):
        sched.feed_chunk(rid, waves[i % 3][: SR // 2], is_last=i % 2 == 0)
    sched.run()
    for rid in rids[1::2]:
        assert sched.abort(rid)
    model.stream_runtime.pool.reserve([], [])  # apply pending releases
    occ = model.stream_occupancy()
    assert occ["streams"] == 0 and model.stream_runtime.pool.stats["released"] == 6


def test_incremental_partial_text_equals_decoding_everything() -> None:
    """A greedy stream's partial text is built from each step's new tokens only; it equals the
    tokenizer's decoding of the whole hypothesis, also with byte pieces that split a character
    across steps, control pieces, unknown ids and runs of spaces."""
    import random

    from oasr_models_nemo.streaming import NemotronStreamState, _extend_text
    from oasr_models_nemo.tokenizer import SentencePieceDecoder

    pieces = ["<unk>", "<s>", "</s>", "\u2581", "\u2581a", "b", "\u2581\u2581c", "d\u2581", "  ", " e", "\u00e9",
              "\u2581\u5317\u4eac"] + [f"<0x{i:02X}>" for i in range(256)]
    tok = SentencePieceDecoder(pieces)
    byte_ids = list(range(12, len(pieces)))
    split = [pieces.index(f"<0x{x:02X}>") for x in "\u00e9\u5317".encode()]
    rng = random.Random(0)
    for _ in range(2000):
        st = NemotronStreamState(options=None, lookahead=2, search=None, hop=160, n_fft=512,
                                 window_extra=96, subsampling=8)
        tokens: list[int] = []
        for _ in range(rng.randint(1, 6)):
            new = [rng.choice(byte_ids) if rng.random() < 0.15 else rng.randrange(len(tok) + 2)
                   for _ in range(rng.randint(0, 4))]
            if rng.random() < 0.3:  # a character's bytes, possibly cut short, over steps
                new += split[: rng.randint(1, 5)]
            tokens += new
            _extend_text(st, tok.decode_bytes(new))
            assert st.text == tok.decode(tokens)


def _FailingCapture(rt, fail_at: int):  # noqa: ANN001, ANN202, N802
    """Simulated graphs whose ``fail_at``-th capture fails after its warm-up and capture ran on
    the scratch slot (what a real capture that cannot finish has done by then)."""
    from oasr.stream_cache import GraphSteps

    class Failing(GraphSteps):
        calls = 0

        def capture(self, key, generation) -> None:  # noqa: ANN001
            new = key not in self._graphs
            super().capture(key, generation)
            self.calls += new
            if new and self.calls == fail_at:
                raise RuntimeError("operation not permitted when stream is capturing")

    return Failing(rt.compute, rt.dummy_inputs, simulate=True)


def test_failed_capture_runs_the_step_eagerly(nemotron, clips) -> None:
    """Graphs are the default (on the CPU the runtime has none); a capture that fails in the
    middle of serving warns, runs that very step eagerly and turns graphs off: no stream is
    advanced twice or dropped, every final equals offline decoding and every slot comes back.
    A failed capture ahead of serving returns 0 and leaves the steps eager."""
    from oasr_models_nemo.model import NemotronASR

    model = nemotron
    rt = model.stream_runtime
    assert os.environ.get("OASR_NEMO_STREAM_GRAPHS") == "0" or NemotronASR.stream_cuda_graphs
    assert rt.graphs is None  # CPU: eager whatever the default
    opts = DecodingOptions(model_options={"max_symbols_per_frame": 3})
    try:
        rt.graphs = _FailingCapture(rt, fail_at=2)  # bucket 1 captured, the next one fails
        streams = [(model.new_stream(opts), c, 2400 + 800 * k) for k, c in enumerate(clips[:3])]
        with pytest.warns(RuntimeWarning, match="capture failed"):
            got = _feed(model, streams, starts=[0, 2, 2])
        assert rt.graphs is None
        rt.graphs = _FailingCapture(rt, fail_at=1)
        with pytest.warns(RuntimeWarning, match="capture failed"):
            assert model.capture_stream_graphs(max_batch=4) == 0
        assert rt.graphs is None
    finally:
        rt.graphs = None
    offline = model.transcribe(clips[:3], opts)
    for (f, _), o in zip(got, offline, strict=True):
        assert f.text == o.text and _tokens(f) == (o.segments[0].tokens if o.segments else [])
    assert model.stream_occupancy()["streams"] == 0
