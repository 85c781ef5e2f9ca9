"""Streaming causal Zipformer: chunk-by-chunk equal to icefall's own streaming encoder and
searches, equal to the chunk-masked offline encoder, independent of chunking and of the other
streams in the batch; the engine's streaming API and StreamingScheduler drive it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oasr.checkpoint import load_model
from oasr.streaming import StreamingScheduler
from oasr.types import DecodingOptions, EngineConfig

LOG_EPS = math.log(1e-10)


@pytest.fixture(scope="module")
def causal(causal_release):
    ref_model, path = causal_release
    return ref_model, load_model(EngineConfig(ckpt_dir=str(path)))


@pytest.fixture(scope="module")
def ws(helpers):
    return helpers.waves(3, seed=3)


def _stream(model, wave, options=None, splits=None, seed=0):
    """Feed one stream chunk by chunk (random sizes) through stream_step; final transcript."""
    st = model.new_stream(options or DecodingOptions())
    rng = np.random.default_rng(seed)
    i, partials = 0, []
    while i < len(wave):
        k = int(rng.integers(800, 9000)) if splits is None else splits
        up = model.stream_step([st], [wave[i : i + k]], [False])[0]
        partials.append(up.text)
        i += k
    final = model.stream_step([st], [np.zeros(0, np.float32)], [True])[0]
    assert final.is_final
    return final.transcript, partials


def _icefall_streaming_encoder(ref, ref_model, feats: torch.Tensor, chunk: int, left: int) -> torch.Tensor:
    """icefall's streaming_decode loop for one utterance: features padded with 13 frames of
    log(1e-10), chunks of 2 * chunk + 13 frames every 2 * chunk, StreamingEncoderWrapper."""
    ref_model.encoder.chunk_size = [chunk]
    ref_model.encoder.left_context_frames = [left]
    wrapper = ref.model.StreamingEncoderWrapper(ref_model.encoder, ref_model.encoder_embed)
    feats = torch.nn.functional.pad(feats, (0, 0, 0, 13), value=LOG_EPS)
    states = wrapper.get_init_states(1)
    outs, done, t = [], 0, 2 * chunk + 13
    while done < feats.shape[0]:
        x = feats[done : done + t]
        x = torch.nn.functional.pad(x, (0, 0, 0, t - x.shape[0]), value=LOG_EPS)
        with torch.no_grad():
            o, _, states = wrapper(x[None], torch.tensor([t]), states)
        outs.append(o[0])
        done += 2 * chunk
    return torch.cat(outs)


@pytest.mark.parametrize("chunk,left", [(16, 128), (32, 64)])
def test_stream_equals_icefall_streaming(ref, causal, ws, chunk, left) -> None:
    ref_model, model = causal
    opts = DecodingOptions.build(chunk_size=chunk, left_context_frames=left)
    hyps_ours, hyps_ref = [], []
    for k, w in enumerate(ws):
        feats = model.fbank(torch.from_numpy(w))
        enc = _icefall_streaming_encoder(ref, ref_model, feats, chunk, left)
        with torch.no_grad():
            greedy = ref.search.greedy_search(ref_model, enc[None], torch.tensor([enc.shape[0]]))
            beam = ref.search.modified_beam_search(ref_model, enc[None], torch.tensor([enc.shape[0]]), beam=4)
        tr, partials = _stream(model, w, opts, seed=k)
        hyps_ours.append(tr.segments[0].tokens if tr.segments else [])
        hyps_ref.append(list(greedy[0]))
        assert hyps_ours[-1] == hyps_ref[-1]
        trb, _ = _stream(model, w, opts.updated(beam_size=4), seed=k + 7)
        assert (trb.segments[0].tokens if trb.segments else []) == list(beam[0])
        assert partials[-1] and model.tokens.decode(hyps_ref[-1]).startswith(partials[-1][: len(partials[-1]) // 2])
    assert sum(len(h) for h in hyps_ref) >= 15 and len({t for h in hyps_ref for t in h}) >= 6


def test_stream_encoder_equals_chunk_masked_offline(causal, ws) -> None:
    """Streaming (with caches) is the chunk-masked offline encoder, away from the utterance end."""
    _, model = causal
    net = model.net
    feats = torch.nn.functional.pad(model.fbank(torch.from_numpy(ws[2])), (0, 0, 0, 13), value=LOG_EPS)
    for chunk, left in [(16, 64), (32, 128), (16, 32)]:
        with torch.no_grad():
            offline, _ = net.encode(feats[None], torch.tensor([feats.shape[0]]), chunk, left)
            caches = net.initial_state(1, left)
            outs, done, t = [], 0, 2 * chunk + 13
            while done + t <= feats.shape[0]:
                o, caches = net.streaming_forward(feats[None, done : done + t], caches, left)
                outs.append(o[0])
                done += 2 * chunk
        streamed = torch.cat(outs)
        n = streamed.shape[0] - chunk // 2  # the last chunk's right context differs at the end
        assert n >= 8
        assert (streamed[:n] - offline[0, :n]).abs().max() < 1e-4, (chunk, left)


def test_stream_independent_of_chunking_and_batch(causal, ws) -> None:
    _, model = causal
    alone = [_stream(model, w, seed=11 + k)[0] for k, w in enumerate(ws)]
    for k, w in enumerate(ws):
        other = _stream(model, w, splits=1600)[0]
        assert other.text == alone[k].text
    # all three together, started at different times, through the scheduler (batched steps)
    sched = StreamingScheduler(model, max_batch_size=8)
    rids = [sched.add_request(DecodingOptions()) for _ in ws]
    pos = [0, 0, 0]
    step = 0
    while any(p < len(w) for p, w in zip(pos, ws, strict=True)):
        for k, w in enumerate(ws):
            if step >= 2 * k and pos[k] < len(w):  # stream k starts 2 steps later than k - 1
                n = 3200 + 480 * k
                sched.feed_chunk(rids[k], w[pos[k] : pos[k] + n], is_last=pos[k] + n >= len(w))
                pos[k] += n
        sched.step()
        step += 1
    sched.run()
    assert [sched.result(r).text for r in rids] == [t.text for t in alone]


def test_engine_streaming_api(causal, causal_release, ws) -> None:
    from oasr.engine import ASREngine

    engine = ASREngine(EngineConfig(ckpt_dir=str(causal_release[1]), service_mode="streaming"))
    try:
        rid = engine.add_streaming_request(DecodingOptions(word_timestamps=True))
        outs = []
        for i in range(0, len(ws[1]), 5120):
            engine.feed_chunk(rid, ws[1][i : i + 5120], is_last=i + 5120 >= len(ws[1]))
            outs += engine.step()
        outs += [o for o in engine.step()]
        finals = [o for o in outs if o.is_final and o.request_id == rid]
        assert len(finals) == 1 and any(not o.is_final for o in outs)
        final = finals[0].transcript
        expected = _stream(causal[1], ws[1], DecodingOptions(word_timestamps=True), splits=5120)[0]
        assert final.text == expected.text and final.text
        assert final.segments[0].words
    finally:
        engine.shutdown()


def test_offline_model_refuses_streaming(offline_release) -> None:
    from oasr.errors import UnsupportedOptionError

    model = load_model(EngineConfig(ckpt_dir=str(offline_release[1])))
    with pytest.raises(UnsupportedOptionError):
        model.new_stream(DecodingOptions())


def test_ctc_stream_equals_icefall_streaming(ref, causal, ws) -> None:
    """decoding_method=ctc_greedy_search / ctc_prefix_beam_search while streaming: the CTC head
    over icefall's streaming encoder output."""
    ref_model, model = causal
    for k, w in enumerate(ws):
        enc = _icefall_streaming_encoder(ref, ref_model, model.fbank(torch.from_numpy(w)), 16, 128)
        with torch.no_grad():
            expected = ref.search.ctc_greedy_search(ref_model.ctc_output(enc[None]), torch.tensor([enc.shape[0]]))[0]
        tr, _ = _stream(model, w, DecodingOptions.build(decoding_method="ctc_greedy_search"), seed=k)
        assert (tr.segments[0].tokens if tr.segments else []) == expected and len(expected) >= 5
        beam, _ = _stream(model, w, DecodingOptions.build(decoding_method="ctc_prefix_beam_search",
                                                           beam_size=4, word_timestamps=True), seed=k)
        assert beam.segments and beam.segments[0].words


def test_silence_too_short_for_a_frame_is_empty(causal) -> None:
    _, model = causal
    for n in (0, 10):
        audio = np.full(n, 0.1, np.float32)
        assert model.transcribe([audio], DecodingOptions())[0].text == ""
        st = model.new_stream(DecodingOptions())
        final = model.stream_step([st], [audio], [True])[0]
        assert final.is_final and final.text == ""


@pytest.mark.parametrize("graphs", [False, True])
def test_batched_step_independent_of_other_streams(causal_release, ws, graphs, helpers) -> None:
    """A stream's tokens and token times (and, within float rounding, log-probabilities) do not
    depend on which streams share its steps: streams of different ages (and, with the graph steps simulated on the CPU, a
    batch padded to its bucket with scratch rows) equal each stream run alone."""
    model = load_model(EngineConfig(ckpt_dir=str(causal_release[1])))
    model.stream_cuda_graphs = model._simulate_stream_graphs = graphs
    opts = DecodingOptions(word_timestamps=True)
    solo = [helpers.run_alone(model, w, opts) for w in ws]
    states = [model.new_stream(opts) for _ in ws]
    # stream k joins k steps late; a batch of 1, 2 or 3 (bucket 4: one padded row)
    helpers.feed_staggered(model, states, ws)
    for st, one in zip(states, solo, strict=True):
        assert st.hyp.tokens == one.tokens and st.hyp.times == one.times
        # float rounding of a GEMM may depend on its row count (CPU BLAS): within 1e-4
        assert np.allclose(st.hyp.token_logprobs, one.token_logprobs, rtol=0, atol=1e-4)
        assert abs(st.hyp.score - one.score) < 1e-2
    assert sum(len(h.tokens) for h in solo) >= 10
    if graphs:
        stats = model.stream_occupancy()
        assert stats["graph_replays"] > 0 and stats["graph_captures"] >= 3  # buckets 1, 2, 4


def test_stream_framing_equals_offline_fbank(causal, ws) -> None:
    """The streaming framing (samples kept per stream, frames written as they complete, samples
    dropped once read, the end reflected at finish) gives the offline fbank of the whole signal."""
    from oasr_models_icefall.fbank import CenteredFbankStream

    model = causal[1]
    rng = np.random.default_rng(4)
    for w in ws:
        fb = CenteredFbankStream(model.fbank)
        parts, done, i = [], 0, 0
        while i < len(w):
            k = int(rng.integers(1, 4000))
            fb.accept(w[i : i + k])
            i += k
            parts.append(fb.frames(done, fb.emitted - done))
            done = fb.emitted
            fb.drop_before(done)
        fb.finish()
        parts.append(fb.frames(done))
        got = torch.cat(parts)
        want = model.fbank(torch.from_numpy(w))
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("graphs", [False, True])
def test_mixed_searches_share_a_step(causal_release, ws, graphs) -> None:
    """Streams with different searches in one batched step (greedy searched inside the step,
    greedy with a blank penalty, greedy with 2 symbols per frame, modified beam, CTC greedy): each
    gives what it gives alone (the step's greedy rows do not touch the others' decoder state)."""
    model = load_model(EngineConfig(ckpt_dir=str(causal_release[1])))
    model.stream_cuda_graphs = model._simulate_stream_graphs = graphs
    kinds = [DecodingOptions(), DecodingOptions.build(blank_penalty=0.7), DecodingOptions.build(max_sym_per_frame=2),
             DecodingOptions(beam_size=4), DecodingOptions.build(decoding_method="ctc_greedy_search")]  # fmt: skip
    w = ws[2]

    def run(options_list):
        states = [model.new_stream(o) for o in options_list]
        finals = []
        for i in range(0, len(w), 5120):
            ups = model.stream_step(states, [w[i : i + 5120]] * len(states), [i + 5120 >= len(w)] * len(states))
            finals = [u.transcript for u in ups if u.is_final]
        return [t.segments[0].tokens if t.segments else [] for t in finals]

    together = run(kinds)
    alone = [run([o])[0] for o in kinds]
    assert together == alone
    assert len({tuple(t) for t in alone}) >= 3  # the searches differ


def test_failed_capture_runs_the_step_eagerly(causal_release, ws, helpers) -> None:
    """Graphs are the default (on the CPU no step is graphed); a capture that fails while streams
    are served (after its warm-up and capture wrote the scratch slot, as a real one does) warns,
    runs that very step eagerly and turns graphs off: every stream still gives what it gives
    alone, none dropped, every slot returned. A failed capture ahead of serving returns 0."""
    model = load_model(EngineConfig(ckpt_dir=str(causal_release[1])))
    assert model._stream_graphs(model.default_options.left_context_frames) is None  # CPU: eager
    opts = DecodingOptions(word_timestamps=True)
    solo = [helpers.run_alone(model, w, opts) for w in ws]
    model.stream_cuda_graphs = model._simulate_stream_graphs = True
    graphs = model._stream_graphs(model.default_options.left_context_frames)
    capture = graphs.capture

    def failing(key, generation, fail_at=2):  # bucket 1 captured, the next one fails
        new = key not in graphs._graphs
        capture(key, generation)
        if new and graphs.stats["captures"] == fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")

    graphs.capture = failing
    states = [model.new_stream(opts) for _ in ws]
    with pytest.warns(RuntimeWarning, match="capture failed"):
        helpers.feed_staggered(model, states, ws)
    assert model.stream_cuda_graphs is False and graphs.stats["captures"] == 2
    for st, one in zip(states, solo, strict=True):
        assert st.hyp.tokens == one.tokens and st.hyp.times == one.times
    assert model.stream_occupancy()["streams"] == 0
    model.stream_cuda_graphs = True
    graphs.capture = lambda key, generation: failing(key, generation, fail_at=graphs.stats["captures"] + 1)
    graphs._graphs.clear()
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert model.capture_stream_graphs(8) == 0
    assert model.stream_cuda_graphs is False


def test_capture_stream_graphs_ahead(causal_release, ws) -> None:
    """capture_stream_graphs captures every bucket up to the batch size before serving (simulated
    on the CPU), so steps of 1..8 streams replay without capturing."""
    model = load_model(EngineConfig(ckpt_dir=str(causal_release[1])))
    model.stream_cuda_graphs = model._simulate_stream_graphs = True
    assert model.capture_stream_graphs(8) == 4  # buckets 1, 2, 4, 8
    states = [model.new_stream(DecodingOptions()) for _ in range(3)]
    model.stream_step(states, [w[:12000] for w in ws], [False] * 3)
    stats = model.stream_occupancy()
    assert stats["graph_captures"] == 4 and stats["graph_replays"] == 1
    model.stream_cuda_graphs = False  # off: steps run eagerly, nothing replayed
    assert model.capture_stream_graphs(8) == 0
