"""A causal icefall Zipformer behind ``oasr-server --service-mode streaming``: the realtime
WebSocket feeds a turn to the engine as its audio arrives; the final equals the in-process
streaming engine's, and the deltas (greedy transducer partials never revise) concatenate to it."""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("oasr_server")
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


def _quantised(x: np.ndarray) -> tuple[np.ndarray, bytes]:
    data = np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0, data


def test_realtime_websocket_streams_through_the_engine(causal_release, helpers) -> None:
    from starlette.testclient import TestClient

    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    path = str(causal_release[1])
    audio, data = _quantised(np.concatenate(helpers.waves(3, seed=4)))
    engine = ASREngine(EngineConfig(ckpt_dir=path, service_mode="streaming"))
    try:
        rid = engine.add_streaming_request(DecodingOptions())
        outs = []
        for i in range(0, len(audio), 3200):
            engine.feed_chunk(rid, audio[i : i + 3200], is_last=i + 3200 >= len(audio))
            outs += engine.step()
        while not any(o.is_final for o in outs):
            outs += engine.step()
        expected = next(o.text for o in outs if o.is_final)
    finally:
        engine.shutdown()
    assert expected

    app = create_app(ServerConfig(warmup=False, partial_interval_ms=200),
                     engine_config=EngineConfig(ckpt_dir=path, service_mode="streaming"))  # fmt: skip
    with TestClient(app) as client:
        assert app.state.oasr.wait_loaded(30), app.state.oasr.load_error
        ws = client.websocket_connect("/v1/realtime?intent=transcription").__enter__()
        try:
            assert ws.receive_json()["type"] == "session.created"
            ws.send_json({"type": "transcription_session.update",
                          "session": {"input_audio_sample_rate": 16000, "turn_detection": None}})
            assert ws.receive_json()["type"] == "session.updated"
            step = 3200 * 2
            for i in range(0, len(data), step):
                ws.send_json({"type": "input_audio_buffer.append",
                              "audio": base64.b64encode(data[i : i + step]).decode()})
            ws.send_json({"type": "input_audio_buffer.commit"})
            events = []
            while not any(e["type"] == COMPLETED for e in events):
                event = ws.receive_json()
                assert event["type"] != "error", event
                events.append(event)
        finally:
            ws.__exit__(None, None, None)
    (completed,) = [e for e in events if e["type"] == COMPLETED]
    assert completed["transcript"] == expected
    deltas = [e["delta"] for e in events if e["type"] == DELTA]
    assert deltas and "".join(deltas) == expected
