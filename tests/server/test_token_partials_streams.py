"""Issue #19, serving: the speech-LLM's token-streaming partials reach live streams. A committed
realtime turn gets one ``conversation.item.input_audio_transcription.delta`` per decoded piece
while the model decodes it, and a gRPC ``StreamingRecognize`` utterance one interim result per
piece, through the same path as re-transcription interims. Checked with the tiny random-weight
Qwen2-Audio checkpoint of ``tests/qwen`` against the engine's own ``transcribe_partials`` on the
same audio and options."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

pytest.importorskip("oasr_models_qwen")
pytest.importorskip("transformers")
grpc = pytest.importorskip("grpc")

RATE = 16000


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from tests.qwen.conftest import _write

    return _write(tmp_path_factory.mktemp("qwen_stream"), chat=True, seed=0)


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """2.25 s of a tone in noise."""
    rng = np.random.default_rng(0)
    t = np.arange(36000) / RATE
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def _pcm(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).round().astype("<i2").tobytes()


def _expected(app, audio: np.ndarray) -> list[str]:
    """The engine's pieces for the turn (the samples the server decodes from the 16-bit PCM),
    with the options the stream's final uses."""
    from oasr.audio import RawPCMFormat, decode_raw_pcm
    from oasr_server.realtime import SessionConfig, session_options

    audio = decode_raw_pcm(_pcm(audio), RawPCMFormat(sample_rate=RATE, encoding="pcm_s16le"))[0]
    state = app.state.oasr
    options = state.bounded_options(session_options(SessionConfig("x")), audio)
    updates = list(state.engine.transcribe_partials(audio, options))
    assert updates[-1].is_final
    return [u.delta for u in updates[:-1]]


def test_realtime_and_grpc_stream_the_tokens(kit, qwen_dir, audio) -> None:
    from starlette.testclient import TestClient

    from oasr.types import EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig
    from oasr_server.grpc_api import speech_pb2 as pb
    from oasr_server.grpc_api import speech_pb2_grpc

    app = create_app(
        ServerConfig(served_model_name="qwen", grpc_bind="127.0.0.1:0", warmup=False),
        engine_config=EngineConfig(ckpt_dir=str(qwen_dir), device="cpu", dtype="float32"),
    )
    with TestClient(app) as client:
        assert app.state.oasr.wait_loaded(60), app.state.oasr.load_error
        want = _expected(app, audio)
        assert len(want) >= 3  # several pieces: the test means something

        with client.websocket_connect("/v1/realtime") as ws:
            assert ws.receive_json()["type"] == "session.created"
            ws.send_json({"type": "session.update", "session": {
                "turn_detection": None, "input_audio_sample_rate": 16000}})  # fmt: skip
            assert ws.receive_json()["type"] == "session.updated"
            chunk = base64.b64encode(_pcm(audio)).decode()
            ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
            ws.send_json({"type": "input_audio_buffer.commit"})
            events = []
            while not events or not events[-1]["type"].endswith(".completed"):
                events.append(ws.receive_json())
        deltas = [e["delta"] for e in events if e["type"].endswith(".delta")]
        completed = events[-1]
        # one delta per decoded piece, in order, adding up to the transcript
        assert deltas == want, (deltas, want)
        assert "".join(deltas) == completed["transcript"]

        async def grpc_stream() -> list:
            port = app.state.grpc_server.oasr_port
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = speech_pb2_grpc.SpeechStub(channel)

                async def requests():
                    yield pb.StreamingRecognizeRequest(streaming_config=pb.StreamingRecognitionConfig(
                        config=pb.RecognitionConfig(encoding=pb.PCM_S16LE, sample_rate_hertz=RATE),
                        interim_results=True))  # fmt: skip
                    yield pb.StreamingRecognizeRequest(audio_content=_pcm(audio))

                return [r async for r in stub.StreamingRecognize(requests())]

        responses = asyncio.run(grpc_stream())
    results = [r.result for r in responses if r.HasField("result")]
    final = results[-1]
    assert final.is_final and final.text == completed["transcript"]
    interims = [r for r in results if not r.is_final]
    texts = [r.text for r in interims]
    # each piece is one interim result whose text is the hypothesis so far
    want_texts = [("".join(want[: k + 1])) for k in range(len(want))]
    assert texts[-len(want_texts) :] == want_texts, (texts, want_texts)
    assert all(r.stable_text == r.text for r in interims[-len(want_texts) :])
