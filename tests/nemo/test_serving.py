"""Nemotron behind ``oasr-server --service-mode streaming``: the realtime WebSocket and gRPC
``StreamingRecognize`` feed each turn to the engine's streaming API as its audio arrives; the
final text equals offline decoding of the same (pcm16-quantised) audio."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from oasr.types import DecodingOptions

from .conftest import SR  # noqa: TID252

pytestmark = pytest.mark.slow
pytest.importorskip("oasr_server")
COMPLETED = "conversation.item.input_audio_transcription.completed"


def _pcm16(x: np.ndarray) -> bytes:
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()


def _from_pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


@pytest.fixture(scope="module")
def served(hf_checkpoints):
    from starlette.testclient import TestClient

    from oasr.types import EngineConfig
    from oasr_models_nemo.model import NemoASR
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    path = hf_checkpoints["nemotron"].path
    app = create_app(ServerConfig(warmup=False, grpc_bind="127.0.0.1:0", partial_interval_ms=200),
                     engine_config=EngineConfig(ckpt_dir=str(path), service_mode="streaming"))
    client = TestClient(app)
    client.__enter__()
    try:
        assert app.state.oasr.wait_loaded(60), app.state.oasr.load_error
        yield client, app, NemoASR.from_hf(path)
    finally:
        client.__exit__(None, None, None)


def test_realtime_websocket(served, waves) -> None:
    client, _, model = served
    audio = _from_pcm(_pcm16(np.concatenate([waves[0], waves[1]])))
    expected = model.transcribe([audio], DecodingOptions())[0].text
    ws = client.websocket_connect("/v1/realtime?intent=transcription").__enter__()
    try:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"type": "transcription_session.update",
                      "session": {"input_audio_sample_rate": SR, "turn_detection": None}})
        assert ws.receive_json()["type"] == "session.updated"
        data = _pcm16(audio)
        for i in range(0, len(data), 3200):
            ws.send_json({"type": "input_audio_buffer.append",
                          "audio": base64.b64encode(data[i:i + 3200]).decode()})
        ws.send_json({"type": "input_audio_buffer.commit"})
        events: list[dict[str, Any]] = []
        while not any(e["type"] == COMPLETED for e in events):
            event = ws.receive_json()
            assert event["type"] != "error", event
            events.append(event)
    finally:
        ws.__exit__(None, None, None)
    (done,) = [e for e in events if e["type"] == COMPLETED]
    assert done["transcript"] == expected and expected


def test_grpc_streaming_recognize(served, waves) -> None:
    grpc = pytest.importorskip("grpc")
    from oasr_server.grpc_api import speech_pb2 as pb
    from oasr_server.grpc_api import speech_pb2_grpc

    _, app, model = served
    audio = _from_pcm(_pcm16(waves[0]))
    expected = model.transcribe([audio], DecodingOptions())[0].text

    def requests():
        yield pb.StreamingRecognizeRequest(streaming_config=pb.StreamingRecognitionConfig(
            config=pb.RecognitionConfig(encoding=pb.PCM_S16LE, sample_rate_hertz=SR),
            interim_results=True))
        data = _pcm16(audio)
        for i in range(0, len(data), 3200):
            yield pb.StreamingRecognizeRequest(audio_content=data[i:i + 3200])

    port = app.state.grpc_server.oasr_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        results = [r.result for r in speech_pb2_grpc.SpeechStub(channel).StreamingRecognize(requests())]
    finals = [r for r in results if r.is_final]
    assert finals and finals[-1].text == expected and expected
