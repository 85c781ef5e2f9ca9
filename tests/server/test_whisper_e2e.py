"""End to end with the real Whisper tiny.en (the default checkpoint) through the HTTP API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

FLAC = Path(__file__).resolve().parents[1] / "data" / "speech" / "en_jfk_inaugural.flac"


def _whisper_checkpoint() -> Path:
    pytest.importorskip("oasr_models_whisper.formats")
    from oasr.defaults import default_checkpoint
    from oasr.errors import UnknownModelError

    try:
        return default_checkpoint()
    except UnknownModelError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_whisper_tiny_en_over_http(kit) -> None:
    from oasr.types import EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    ckpt = _whisper_checkpoint()
    app = create_app(
        ServerConfig(served_model_name="tiny.en"), engine_config=EngineConfig(ckpt_dir=str(ckpt))
    )
    audio = FLAC.read_bytes()

    async def go():
        async with kit.serving(app) as c:
            files = {"file": (FLAC.name, audio, "audio/flac")}
            verbose = await c.post(
                "/v1/audio/transcriptions",
                files=files,
                data={
                    "model": "tiny.en",
                    "response_format": "verbose_json",
                    "timestamp_granularities[]": ["word", "segment"],
                },
            )
            translate = await c.post("/v1/audio/translations", files=files)
            return verbose, translate

    verbose, translate = kit.run(go())
    assert verbose.status_code == 200, verbose.text
    body = verbose.json()
    text = re.sub(r"[^a-z ]+", "", body["text"].lower())
    assert "ask not what your country can do for you" in " ".join(text.split())
    assert body["segments"] and body["words"]
    assert all(w["end"] >= w["start"] for w in body["words"])
    # tiny.en is English-only: a translation request is refused with a 400 that says so
    assert translate.status_code == 400
    assert translate.json()["error"]["code"] == "unsupported_option"
    assert "translate" in translate.json()["error"]["message"]


@pytest.mark.slow
def test_whisper_tiny_en_over_realtime(kit) -> None:
    """OpenAI realtime events with server VAD, the real model, real speech (JFK: three turns
    at 700 ms of silence)."""
    import base64
    import concurrent.futures as cf

    import numpy as np
    from starlette.testclient import TestClient

    from oasr.audio import load_audio
    from oasr.types import EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    ckpt = _whisper_checkpoint()
    app = create_app(
        ServerConfig(served_model_name="tiny.en", partial_interval_ms=2000),
        engine_config=EngineConfig(ckpt_dir=str(ckpt)),
    )
    audio = np.concatenate([load_audio(str(FLAC), 24000), np.zeros(48000, np.float32)])
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    pool = cf.ThreadPoolExecutor(1)  # receive with a timeout: a failure must not hang the run
    with TestClient(app) as client:
        assert app.state.oasr.wait_loaded(60), app.state.oasr.load_error
        with client.websocket_connect("/v1/realtime?intent=transcription") as ws:
            assert ws.receive_json()["type"] == "session.created"
            ws.send_json(
                {
                    "type": "transcription_session.update",
                    "session": {
                        "input_audio_transcription": {"model": "gpt-4o-transcribe"},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 700},
                    },
                }
            )
            assert ws.receive_json()["type"] == "session.updated"
            for i in range(0, len(pcm), 9600):  # 200 ms chunks
                chunk = base64.b64encode(pcm[i : i + 9600]).decode()
                ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
            events: list[dict] = []
            started = completed = 0
            while not started or completed < started:  # every turn ends inside the stream
                event = pool.submit(ws.receive_json).result(timeout=60)
                events.append(event)
                assert event["type"] != "error", event
                started += event["type"] == "input_audio_buffer.speech_started"
                completed += event["type"].endswith("transcription.completed")
    pool.shutdown()
    done = [e for e in events if e["type"].endswith("transcription.completed")]
    assert [e["item_id"] for e in done] == [
        e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"
    ]
    text = re.sub(r"[^a-z ]+", "", " ".join(e["transcript"] for e in done).lower())
    assert "ask not what your country can do for you" in " ".join(text.split())
    for d in done:
        deltas = [
            e["delta"]
            for e in events
            if e["type"].endswith("transcription.delta") and e["item_id"] == d["item_id"]
        ]
        joined = "".join(deltas)
        # complete unless the final transcript revised words an interim result had made stable
        assert joined == d["transcript"] or not d["transcript"].startswith(joined)
