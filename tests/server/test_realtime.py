"""``/v1/realtime``: OpenAI's Realtime transcription events over a real WebSocket client (the
starlette TestClient drives the app in process), with the in-test model and the real Silero
VAD on real speech."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
FIRST = SPEECH / "en_ls_2830-3980-0043.wav"  # 1.975 s
SECOND = SPEECH / "en_ls_4507-16021-0012.wav"  # 2.735 s


def two_utterances(rate: int) -> np.ndarray:
    """0.5 s silence, clip 1, 1.5 s silence, clip 2, 1 s silence (float32 at ``rate``)."""
    from oasr.audio import load_audio

    a, b = load_audio(str(FIRST), rate), load_audio(str(SECOND), rate)
    z = lambda s: np.zeros(int(s * rate), np.float32)  # noqa: E731
    return np.concatenate([z(0.5), a, z(1.5), b, z(1.0)])


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def g711(x: np.ndarray, law: str) -> bytes:
    """Encode with the decoder's own table: the nearest code for every sample."""
    from oasr.audio import _alaw_table, _mulaw_table

    table = _mulaw_table() if law == "mulaw" else _alaw_table()
    order = np.argsort(table)
    values = table[order]
    idx = np.clip(np.searchsorted(values, x), 1, len(values) - 1)
    nearer = np.where(np.abs(values[idx - 1] - x) <= np.abs(values[idx] - x), idx - 1, idx)
    return order[nearer].astype(np.uint8).tobytes()


def append(ws: Any, data: bytes, step: int) -> None:
    for i in range(0, len(data), step):
        chunk = base64.b64encode(data[i : i + step]).decode()
        ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})


def receive_until(ws: Any, kind: str, count: int = 1) -> list[dict[str, Any]]:
    """Every event up to and including the ``count``-th event of type ``kind``."""
    events: list[dict[str, Any]] = []
    seen = 0
    while seen < count:
        event = ws.receive_json()
        assert "event_id" in event
        events.append(event)
        if event["type"] == kind:
            seen += 1
        assert len(events) < 500, events[-5:]
    return events


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


@pytest.fixture
def client_for(app_factory):
    clients = []

    def build(**cfg: Any) -> tuple[TestClient, Any, Any]:
        app, model = app_factory(**cfg)
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        assert app.state.oasr.wait_loaded(10), app.state.oasr.load_error
        return client, app, model

    yield build
    for client in clients:
        client.__exit__(None, None, None)


def test_server_vad_two_turns_pcm16_24k(client_for) -> None:
    client, app, model = client_for(partial_interval_ms=500)
    audio = two_utterances(24000)
    with client.websocket_connect("/v1/realtime?intent=transcription") as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created"
        session = created["session"]
        assert session["input_audio_format"] == "pcm16"
        assert session["input_audio_sample_rate"] == 24000
        assert session["turn_detection"] == {
            "type": "server_vad",
            "threshold": 0.5,
            "prefix_padding_ms": 300,
            "silence_duration_ms": 500,
        }
        append(ws, pcm16(audio), 4800)  # 100 ms chunks
        events = receive_until(ws, "conversation.item.input_audio_transcription.completed", 2)
        metrics = client.get("/metrics").text
        assert 'oasr_streams_active{api="realtime"} 1.0' in metrics
    assert not of(events, "error")
    started = of(events, "input_audio_buffer.speech_started")
    stopped = of(events, "input_audio_buffer.speech_stopped")
    committed = of(events, "input_audio_buffer.committed")
    completed = of(events, "conversation.item.input_audio_transcription.completed")
    assert len(started) == len(stopped) == len(committed) == len(completed) == 2
    items = [e["item_id"] for e in started]
    assert [e["item_id"] for e in stopped] == items
    assert [e["item_id"] for e in committed] == items
    assert [e["item_id"] for e in completed] == items
    assert committed[0]["previous_item_id"] is None
    assert committed[1]["previous_item_id"] == items[0]
    # speech at 0.5-2.5 s and 4.0-6.7 s of the stream
    assert 300 <= started[0]["audio_start_ms"] <= 900
    assert 1500 <= stopped[0]["audio_end_ms"] <= 2700
    assert 3800 <= started[1]["audio_start_ms"] <= 4900
    assert 5800 <= stopped[1]["audio_end_ms"] <= 7000
    # the in-test model names the committed duration: each turn is one clip (+ padding)
    durations = [float(e["transcript"].split()[-1]) for e in completed]
    assert 1.3 <= durations[0] <= 2.9 and 1.9 <= durations[1] <= 3.6, durations
    assert all(e["transcript"].startswith("hello world ") for e in completed)
    for item, done in zip(items, completed, strict=False):
        deltas = [
            e["delta"]
            for e in of(events, "conversation.item.input_audio_transcription.delta")
            if e["item_id"] == item
        ]
        # interim results (when they came in time: "hello world" is stable across them),
        # then the rest with the final transcript
        assert deltas and "".join(deltas) == done["transcript"]
        pos_delta = events.index(
            next(e for e in events if e.get("item_id") == item and e["type"].endswith(".delta"))
        )
        assert pos_delta < events.index(done)
        assert done["usage"]["type"] == "duration"
    metrics = client.get("/metrics").text
    assert 'oasr_streams_active{api="realtime"} 0.0' in metrics
    assert 'oasr_streams_total{api="realtime",outcome="closed"} 1.0' in metrics
    assert 'oasr_stream_turns_total{api="realtime"} 2.0' in metrics
    assert 'oasr_audio_seconds_total{route="/v1/realtime"}' in metrics


def test_manual_commit_clear_and_16k(client_for) -> None:
    client, app, model = client_for(partial_interval_ms=0)
    with client.websocket_connect("/v1/realtime") as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json(
            {
                "type": "session.update",
                "event_id": "ev1",
                "session": {
                    "input_audio_format": "pcm16",
                    "input_audio_sample_rate": 16000,
                    "turn_detection": None,
                    "input_audio_transcription": {
                        "model": "whisper-1",
                        "language": "fr",
                        "prompt": "Bonjour",
                    },
                },
            }
        )
        updated = ws.receive_json()
        assert updated["type"] == "session.updated"
        assert updated["session"]["turn_detection"] is None
        assert updated["session"]["input_audio_sample_rate"] == 16000
        assert updated["session"]["input_audio_transcription"]["language"] == "fr"
        tone = 0.3 * np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)
        append(ws, pcm16(tone), 3201)  # odd sizes: a split sample waits for the next chunk
        ws.send_json({"type": "input_audio_buffer.commit", "event_id": "c1"})
        events = receive_until(ws, "conversation.item.input_audio_transcription.completed")
        assert [e["type"] for e in events] == [
            "input_audio_buffer.committed",
            "conversation.item.created",
            "conversation.item.input_audio_transcription.delta",
            "conversation.item.input_audio_transcription.completed",
        ]
        assert events[-1]["transcript"] == "hello world 1.00"
        assert events[-1]["language"] == "fr"
        assert model.options[-1].prompt == "Bonjour" and model.options[-1].language == "fr"
        # nothing buffered: commit is refused, the socket stays open
        ws.send_json({"type": "input_audio_buffer.commit", "event_id": "c2"})
        err = ws.receive_json()
        assert err["type"] == "error"
        assert err["error"]["code"] == "input_audio_buffer_commit_empty"
        assert err["error"]["event_id"] == "c2"
        # clear drops what was appended
        append(ws, pcm16(tone), 16000)
        ws.send_json({"type": "input_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "input_audio_buffer.cleared"
        append(ws, pcm16(tone[:8000]), 16000)
        ws.send_json({"type": "input_audio_buffer.commit"})
        done = receive_until(ws, "conversation.item.input_audio_transcription.completed")[-1]
        assert done["transcript"] == "hello world 0.50"


def test_interim_deltas_while_the_turn_grows(client_for) -> None:
    client, app, model = client_for(partial_interval_ms=500)
    with client.websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
        ws.receive_json()
        # two interim hypotheses ("hello world 0.60", "hello world 1.20") agree on two words
        append(ws, pcm16(np.zeros(14400, np.float32)), 14400)
        append(ws, pcm16(np.zeros(14400, np.float32)), 14400)
        first = receive_until(ws, "conversation.item.input_audio_transcription.delta")
        assert first[-1]["delta"] == "hello world"
        assert len(model.options) >= 3  # warm-up + two interim calls
        interim = model.options[-1]
        assert interim.temperature == 0.0  # greedy, no fallback, for interim results
        ws.send_json({"type": "input_audio_buffer.commit"})
        events = receive_until(ws, "conversation.item.input_audio_transcription.completed")
    deltas = [e["delta"] for e in first + events if e["type"].endswith(".delta")]
    assert deltas == ["hello world", " 1.20"]
    assert events[-1]["transcript"] == "hello world 1.20"
    # the final: the fallback schedule cut to 1 + --max-fallback-rounds (2) temperatures
    assert model.options[-1].temperature == (0.0, 0.2, 0.4)


@pytest.mark.parametrize("law,name", [("mulaw", "g711_ulaw"), ("alaw", "g711_alaw")])
def test_g711_input(client_for, law: str, name: str) -> None:
    client, app, model = client_for(partial_interval_ms=0)
    tone = 0.3 * np.sin(2 * np.pi * 300 * np.arange(12000) / 8000)  # 1.5 s at 8 kHz
    with client.websocket_connect("/v1/realtime?intent=transcription") as ws:
        ws.receive_json()
        # two updates back to back: the second builds on the first
        ws.send_json(
            {"type": "transcription_session.update", "session": {"input_audio_format": name}}
        )
        ws.send_json({"type": "transcription_session.update", "session": {"turn_detection": None}})
        assert ws.receive_json()["type"] == "session.updated"
        updated = ws.receive_json()
        assert updated["type"] == "session.updated"
        assert updated["session"]["input_audio_format"] == name
        assert updated["session"]["turn_detection"] is None
        append(ws, g711(tone, law), 800)
        ws.send_json({"type": "input_audio_buffer.commit"})
        done = receive_until(ws, "conversation.item.input_audio_transcription.completed")[-1]
    assert done["transcript"] == "hello world 1.50"


def test_g711_speech_with_server_vad(client_for) -> None:
    """Real speech through mu-law at 8 kHz, GA-style session.update, server VAD turns."""
    client, app, model = client_for(partial_interval_ms=0)
    audio = two_utterances(8000)
    with client.websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        ws.send_json(
            {
                "type": "session.update",
                "session": {
                    "type": "transcription",
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcmu"},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 700},
                        }
                    },
                },
            }
        )
        updated = ws.receive_json()
        assert updated["session"]["input_audio_format"] == "g711_ulaw"
        assert updated["session"]["turn_detection"]["silence_duration_ms"] == 700
        append(ws, g711(audio, "mulaw"), 1600)
        events = receive_until(ws, "conversation.item.input_audio_transcription.completed", 2)
    assert len(of(events, "input_audio_buffer.speech_started")) == 2
    assert not of(events, "error")


def test_bad_events_keep_the_socket_usable(client_for) -> None:
    client, app, model = client_for(partial_interval_ms=0)
    with client.websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        bad = [
            ("not json", "invalid_json", None),
            ('["a list"]', "invalid_json", None),
            (json.dumps({"type": "response.create", "event_id": "e1"}), "invalid_value", "type"),
            (
                json.dumps({"type": "input_audio_buffer.append", "audio": "@@@not base64"}),
                "invalid_value",
                "audio",
            ),
            (
                json.dumps({"type": "input_audio_buffer.append"}),
                "missing_required_parameter",
                "audio",
            ),
            (
                json.dumps({"type": "session.update", "session": {"input_audio_format": "mp3"}}),
                "invalid_value",
                "session.input_audio_format",
            ),
            (
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {"turn_detection": {"type": "server_vad", "threshold": 2}},
                    }
                ),
                "invalid_value",
                "session.turn_detection.threshold",
            ),
            (
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {"input_audio_transcription": {"model": "nope"}},
                    }
                ),
                "model_not_found",
                "session.input_audio_transcription.model",
            ),
            (json.dumps({"type": "session.update", "session": "x"}), "invalid_type", "session"),
        ]
        for text, code, param in bad:
            ws.send_text(text)
            err = ws.receive_json()
            assert err["type"] == "error", (text, err)
            assert err["error"]["code"] == code, (text, err)
            assert err["error"]["param"] == param, (text, err)
            assert err["error"]["type"] == "invalid_request_error"
        ws.send_bytes(b"\x00\x01")
        assert ws.receive_json()["error"]["code"] == "invalid_json"
        # a refused update changed nothing; the session still works (manual mode now)
        ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
        updated = ws.receive_json()
        assert updated["session"]["input_audio_format"] == "pcm16"
        append(ws, pcm16(np.zeros(24000, np.float32)), 9600)
        ws.send_json({"type": "input_audio_buffer.commit"})
        done = receive_until(ws, "conversation.item.input_audio_transcription.completed")[-1]
        assert done["transcript"] == "hello world 1.00"
    metrics = client.get("/metrics").text
    assert 'oasr_errors_total{code="invalid_json"} 3.0' in metrics


def test_max_streams_and_api_key(client_for) -> None:
    client, app, model = client_for(max_streams=1, api_key="s3cret", partial_interval_ms=0)
    # no key: an error event, then close code 1008
    with client.websocket_connect("/v1/realtime") as ws:
        err = ws.receive_json()
        assert err["error"]["code"] == "invalid_api_key"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1008
    # the browser way: the key as a subprotocol; "realtime" is the one echoed
    with client.websocket_connect(
        "/v1/realtime",
        subprotocols=["realtime", "openai-insecure-api-key.s3cret", "openai-beta.realtime-v1"],
    ) as ws:
        assert ws.accepted_subprotocol == "realtime"
        assert ws.receive_json()["type"] == "session.created"
        # a second stream is one too many: error event + close code 1013
        with client.websocket_connect(
            "/v1/realtime", headers={"Authorization": "Bearer s3cret"}
        ) as second:
            err = second.receive_json()
            assert err["type"] == "error" and err["error"]["code"] == "overloaded"
            with pytest.raises(WebSocketDisconnect) as closed:
                second.receive_json()
            assert closed.value.code == 1013
        ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
        assert ws.receive_json()["type"] == "session.updated"
    # the slot is free again
    with client.websocket_connect("/v1/realtime", headers={"Authorization": "Bearer s3cret"}) as ws:
        assert ws.receive_json()["type"] == "session.created"
    metrics = client.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text
    assert 'oasr_streams_total{api="realtime",outcome="rejected"} 2.0' in metrics


def test_realtime_work_shares_the_engine_queue(client_for, kit) -> None:
    """A realtime turn and an HTTP request waiting together are answered by one engine call."""
    import threading

    gate = threading.Event()
    client, app, model = client_for(partial_interval_ms=0)
    model.gate = gate
    with client.websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
        ws.receive_json()
        # hold the engine with one HTTP request, queue a turn and another HTTP request
        results: list[Any] = []

        def post() -> None:
            files = {"file": ("a.wav", kit.wav_bytes(2.0), "audio/wav")}
            results.append(client.post("/v1/audio/transcriptions", files=files))

        # the warm-up call released the semaphore too: without draining it, the acquire below
        # could return before the first request reached the model, and that request would then
        # share a batch with the turn (a flaky [2, 1] on a slow CI box)
        while model.calls_started.acquire(blocking=False):
            pass
        first = threading.Thread(target=post)
        first.start()
        assert model.calls_started.acquire(timeout=10)
        append(ws, pcm16(np.zeros(24000, np.float32)), 24000)
        ws.send_json({"type": "input_audio_buffer.commit"})
        assert ws.receive_json()["type"] == "input_audio_buffer.committed"
        second = threading.Thread(target=post)
        second.start()
        import time

        deadline = time.monotonic() + 10
        while app.state.oasr.worker.depth < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.state.oasr.worker.depth == 2
        gate.set()
        done = receive_until(ws, "conversation.item.input_audio_transcription.completed")[-1]
        first.join(10)
        second.join(10)
    assert done["transcript"] == "hello world 1.00"
    assert [r.status_code for r in results] == [200, 200]
    assert model.batches[-2:] == [1, 2]  # the held call, then the turn with the 2nd request


def test_not_ready_and_audio_limits(kit) -> None:
    import threading

    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    release = threading.Event()
    model = kit.FakeModel()

    def factory():
        assert release.wait(10)
        return kit.make_engine(model)

    app = create_app(
        ServerConfig(max_audio_seconds=1.0, partial_interval_ms=0), engine_factory=factory
    )
    with TestClient(app) as client:
        with client.websocket_connect("/v1/realtime") as ws:
            assert ws.receive_json()["error"]["code"] == "model_not_ready"
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()
            assert closed.value.code == 1013
        release.set()
        assert app.state.oasr.wait_loaded(10)
        with client.websocket_connect("/v1/realtime") as ws:
            ws.receive_json()
            ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
            ws.receive_json()
            append(ws, pcm16(np.zeros(36000, np.float32)), 36000)  # 1.5 s > 1 s
            err = ws.receive_json()
            assert err["type"] == "error" and err["error"]["code"] == "audio_too_long"
            ws.send_json({"type": "input_audio_buffer.commit"})
            done = receive_until(ws, "conversation.item.input_audio_transcription.completed")
            assert done[-1]["transcript"] == "hello world 1.00"  # the newest second was kept
