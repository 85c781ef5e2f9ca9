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


def test_http_hotwords_reach_the_model(setup) -> None:
    """The OpenAI-compatible upload: repeated ``hotwords[]`` (and ``hotwords_score``) give the
    model's own biased result; a word the vocabulary cannot spell is a 400 naming hotwords."""
    import io
    import wave

    import numpy as np

    pytest.importorskip("oasr_server")
    from starlette.testclient import TestClient

    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    model, ws, _, _ = setup
    pcm = np.clip(np.round(ws[0] * 32768.0), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(pcm.tobytes())
    audio = pcm.astype(np.float32) / 32768.0
    word = model.tokens.piece(3).lstrip("\u2581") + model.tokens.piece(4)
    want = model.transcribe([audio], DecodingOptions.build(
        hotwords=(word, "AD"), hotwords_score=5.0, beam_size=4, decoding_method="ctc_prefix_beam_search"))
    app = create_app(ServerConfig(warmup=False),
                     engine_config=EngineConfig(ckpt_dir=str(model.source_path)))
    with TestClient(app) as client:
        assert app.state.oasr.wait_loaded(60), app.state.oasr.load_error
        files = {"file": ("a.wav", buf.getvalue(), "audio/wav")}
        r = client.post("/v1/audio/transcriptions", files=files, data={
            "hotwords[]": [word, "AD"], "hotwords_score": "5", "beam_size": "4",
            "decoding_method": "ctc_prefix_beam_search", "response_format": "json"})
        assert r.status_code == 200, r.text
        assert r.json()["text"] == want[0].text
        bad = client.post("/v1/audio/transcriptions", files=files,
                          data={"hotwords": "ZZQ", "beam_size": "4"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "hotwords"


@pytest.mark.gpu
def test_gpu_model_uses_the_tensor_search(offline_release, helpers) -> None:
    """On CUDA the CTC prefix beam search runs as tensor operations: its result equals the
    host search (with the same hotwords) on the CUDA model's own log-probabilities."""
    model = load_model(EngineConfig(ckpt_dir=str(offline_release[1]), device="cuda", dtype="float32"))
    ws = helpers.waves(3)
    word = model.tokens.piece(3).lstrip("\u2581") + model.tokens.piece(4)
    for hotwords in (None, (word + " :6",)):
        opts = model._check(DecodingOptions.build(beam_size=6, decoding_method="ctc_prefix_beam_search",
                                                  hotwords=hotwords))
        feats, lens = model.features(ws)
        with torch.no_grad():
            enc, enc_lens = model.encode_features(feats, lens, opts)
            lp = model.net.ctc_log_probs(enc).float().cpu()
        graph = model._context_graph(opts)
        want = ctc_prefix_beam_search(lp, enc_lens.tolist(), beam_size=6,
                                      context_graphs=[graph] * len(ws))
        got = model.decode(enc, enc_lens, opts)
        assert [h.tokens for h in got] == [w[0].tokens for w in want]
        assert [h.times for h in got] == [w[0].times for w in want]


def _stream_finals(path: str, audios, device: str, tensor: bool, force: bool = False) -> list[str]:
    """Finals of streams fed together chunk by chunk (CTC prefix beam, beam 4, a hotword);
    ``tensor``: the tensor search (batched per step), ``force``: even off CUDA."""
    from oasr.decoders.ctc_gpu import GPUCTCPrefixBeamSearch
    from oasr.engine import ASREngine

    engine = ASREngine(EngineConfig(ckpt_dir=path, service_mode="streaming", device=device,
                                    dtype="float32"))
    try:
        model = engine.model
        model.tensor_ctc_search = tensor
        if force:
            model._new_search = lambda o, method, batch: GPUCTCPrefixBeamSearch(
                model._beam(o), model.blank_id, model.device, model._context_graph(o))
        word = model.tokens.piece(3).lstrip("\u2581") + model.tokens.piece(4)
        opts = DecodingOptions.build(beam_size=4, decoding_method="ctc_prefix_beam_search",
                                     hotwords=(word + " :3",))
        rids = [engine.add_streaming_request(opts) for _ in audios]
        done: dict[str, str] = {}
        step = 3200
        for i in range(0, max(len(a) for a in audios), step):
            for rid, a in zip(rids, audios, strict=True):
                if i < len(a):
                    engine.feed_chunk(rid, a[i : i + step], is_last=i + step >= len(a))
            done |= {o.request_id: o.text for o in engine.step() if o.is_final}
        done |= {rid: t.text for rid, t in engine.run().items() if t is not None}
        return [done[r] for r in rids]
    finally:
        engine.shutdown()


def test_streams_batch_the_tensor_search(causal_release, helpers) -> None:
    """Streams whose CTC prefix beams are tensor searches advance in one batched step per
    chunk (``step_streams``); the finals equal the host search's, hotwords included."""
    import numpy as np

    audios = [np.concatenate(helpers.waves(2, seed=s)) for s in (5, 6)]
    path = str(causal_release[1])
    host = _stream_finals(path, audios, "cpu", False)
    assert any(host)
    assert _stream_finals(path, audios, "cpu", True, force=True) == host


@pytest.mark.gpu
def test_gpu_streams_batch_the_tensor_search(causal_release, helpers) -> None:
    """On CUDA the model picks the tensor search for streams by itself."""
    import numpy as np

    audios = [np.concatenate(helpers.waves(2, seed=s)) for s in (5, 6)]
    path = str(causal_release[1])
    assert _stream_finals(path, audios, "cuda", True) == _stream_finals(path, audios, "cuda", False)


def test_realtime_session_hotwords(causal_release, helpers) -> None:
    """The realtime WebSocket session's ``input_audio_transcription.model_options.hotwords``
    reach the stream: the completed transcript equals the in-process streaming engine's with
    the same options."""
    import base64

    import numpy as np

    pytest.importorskip("oasr_server")
    from starlette.testclient import TestClient

    from oasr.engine import ASREngine
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    path = str(causal_release[1])
    pcm = np.clip(np.round(np.concatenate(helpers.waves(2, seed=7)) * 32768.0), -32768, 32767).astype("<i2")
    audio = pcm.astype(np.float32) / 32768.0
    engine = ASREngine(EngineConfig(ckpt_dir=path, service_mode="streaming"))

    def final(**extra) -> str:
        rid = engine.add_streaming_request(DecodingOptions.build(
            decoding_method="ctc_prefix_beam_search", beam_size=4, **extra))
        engine.feed_chunk(rid, audio, is_last=True)
        return engine.run()[rid].text

    try:
        plain = final()
        for piece in engine.model.tokens.pieces[3:15]:  # a hotword that changes this result
            extra = {"decoding_method": "ctc_prefix_beam_search", "beam_size": 4,
                     "hotwords": [piece.lstrip("\u2581") + " :8"]}
            expected = final(hotwords=extra["hotwords"])
            if expected != plain:
                break
        else:
            pytest.fail("no hotword changed the stream's result")
    finally:
        engine.shutdown()
    app = create_app(ServerConfig(warmup=False),
                     engine_config=EngineConfig(ckpt_dir=path, service_mode="streaming"))
    with TestClient(app) as client:
        assert app.state.oasr.wait_loaded(30), app.state.oasr.load_error
        with client.websocket_connect("/v1/realtime?intent=transcription") as ws:
            assert ws.receive_json()["type"] == "session.created"
            ws.send_json({"type": "session.update", "session": {
                "input_audio_sample_rate": 16000, "turn_detection": None,
                "input_audio_transcription": {"model_options": extra}}})
            assert ws.receive_json()["type"] == "session.updated"
            ws.send_json({"type": "input_audio_buffer.append",
                          "audio": base64.b64encode(pcm.tobytes()).decode()})
            ws.send_json({"type": "input_audio_buffer.commit"})
            while True:
                event = ws.receive_json()
                assert event["type"] != "error", event
                if event["type"] == "conversation.item.input_audio_transcription.completed":
                    break
    assert event["transcript"] == expected
