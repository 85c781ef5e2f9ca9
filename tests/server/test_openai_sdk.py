"""The official ``openai`` Python SDK against the server (skipped when the SDK is absent)."""

from __future__ import annotations

import io

import httpx
import pytest

openai = pytest.importorskip("openai")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_openai_sdk_transcriptions_translations_stream_errors(kit, app_factory) -> None:
    app, model = app_factory(api_key="sk-test")

    async def go():
        async with kit.serving(app):
            http = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://oasr.test"
            )
            client = openai.AsyncOpenAI(
                api_key="sk-test", base_url="http://oasr.test/v1", http_client=http, max_retries=0
            )
            audio = ("speech.wav", io.BytesIO(kit.wav_bytes(1.0)), "audio/wav")
            out = {}
            out["json"] = await client.audio.transcriptions.create(model="whisper-1", file=audio)
            audio[1].seek(0)
            out["verbose"] = await client.audio.transcriptions.create(
                model="whisper-1",
                file=audio,
                response_format="verbose_json",
                timestamp_granularities=["word", "segment"],
                language="en",
                temperature=0.2,
            )
            audio[1].seek(0)
            out["text"] = await client.audio.transcriptions.create(
                model="whisper-1", file=audio, response_format="text"
            )
            audio[1].seek(0)
            out["srt"] = await client.audio.transcriptions.create(
                model="whisper-1", file=audio, response_format="srt"
            )
            audio[1].seek(0)
            out["translation"] = await client.audio.translations.create(
                model="whisper-1", file=audio
            )
            audio[1].seek(0)
            stream = await client.audio.transcriptions.create(
                model="whisper-1", file=audio, stream=True
            )
            out["events"] = [event async for event in stream]
            out["models"] = await client.models.list()
            bad = openai.AsyncOpenAI(
                api_key="wrong", base_url="http://oasr.test/v1", http_client=http, max_retries=0
            )
            audio[1].seek(0)
            with pytest.raises(openai.AuthenticationError) as auth:
                await bad.audio.transcriptions.create(model="whisper-1", file=audio)
            out["auth"] = auth.value
            with pytest.raises(openai.BadRequestError) as bad_audio:
                await client.audio.transcriptions.create(
                    model="whisper-1", file=("x.wav", b"not audio" * 20, "audio/wav")
                )
            out["bad_audio"] = bad_audio.value
            with pytest.raises(openai.NotFoundError) as unknown:
                await client.audio.transcriptions.create(model="gpt-9", file=audio)
            out["unknown"] = unknown.value
            await http.aclose()
            return out

    out = kit.run(go())
    assert out["json"].text == "hello world 1.00"
    v = out["verbose"]
    assert (
        v.text == "hello world 1.00"
        and v.language == "english"
        and v.duration == pytest.approx(1.0)
    )
    assert [w.word for w in v.words] == [" hello", " world"] and len(v.segments) == 2
    assert model.options[2].temperatures == (0.2,)  # [0] is the warm-up
    assert out["text"].strip() == "hello world 1.00"
    assert out["srt"].startswith("1\n00:00:00,000 --> ")
    assert out["translation"].text == "translated words 1.00"
    *deltas, done = out["events"]
    assert {e.type for e in deltas} == {"transcript.text.delta"}
    assert done.type == "transcript.text.done" and done.text == "hello world 1.00"
    assert "".join(e.delta for e in deltas) == done.text
    assert [m.id for m in out["models"].data] == ["fake"]
    assert out["auth"].status_code == 401 and out["auth"].code == "invalid_api_key"
    assert out["bad_audio"].code == "bad_audio" and out["bad_audio"].param is None
    assert out["unknown"].code == "model_not_found" and out["unknown"].param == "model"


def test_openai_sdk_chunking_strategy(kit, app_factory) -> None:
    """The SDK sends chunking_strategy as a form field ("auto") or bracketed fields (object)."""
    import numpy as np

    app, model = app_factory()
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(np.zeros(32000, "<i2").tobytes())

    async def go():
        async with kit.serving(app):
            http = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://oasr.test"
            )
            client = openai.AsyncOpenAI(
                api_key="x", base_url="http://oasr.test/v1", http_client=http, max_retries=0
            )
            out = []
            for strategy in (
                "auto",
                {
                    "type": "server_vad",
                    "threshold": 0.4,
                    "prefix_padding_ms": 200,
                    "silence_duration_ms": 300,
                },
            ):
                out.append(
                    await client.audio.transcriptions.create(
                        model="whisper-1",
                        file=("s.wav", io.BytesIO(buf.getvalue()), "audio/wav"),
                        chunking_strategy=strategy,
                    )
                )
            try:
                await client.audio.transcriptions.create(
                    model="whisper-1",
                    file=("s.wav", io.BytesIO(buf.getvalue()), "audio/wav"),
                    chunking_strategy={"type": "server_vad", "threshold": 7},
                )
            except openai.BadRequestError as exc:
                out.append(exc)
            return out

    auto, vad, bad = kit.run(go())
    assert auto.text == "" and vad.text == ""  # silence: no segment reached the engine
    assert bad.body["param"] == "chunking_strategy"


def test_openai_sdk_realtime_transcription(kit, app_factory) -> None:
    """The SDK's realtime client (websockets) against the server on a real socket."""
    import asyncio
    import base64
    import socket
    import threading

    import numpy as np
    import uvicorn

    pytest.importorskip("websockets")
    app, model = app_factory(api_key="sk-rt", partial_interval_ms=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        import time

        deadline = time.monotonic() + 20
        while not (server.started and app.state.oasr.ready):
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)

        async def go():
            client = openai.AsyncOpenAI(api_key="sk-rt", base_url=f"http://127.0.0.1:{port}/v1")
            events = []
            async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
                await conn.send(
                    {
                        "type": "session.update",
                        "session": {
                            "type": "transcription",
                            "audio": {
                                "input": {
                                    "format": {"type": "audio/pcm", "rate": 24000},
                                    "transcription": {
                                        "model": "gpt-4o-transcribe",
                                        "language": "en",
                                    },
                                    "turn_detection": None,
                                }
                            },
                        },
                    }
                )
                pcm = (np.zeros(36000) + 0.01 * 32767).astype("<i2").tobytes()
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
                await conn.input_audio_buffer.commit()
                async for event in conn:
                    events.append(event)
                    if event.type == "conversation.item.input_audio_transcription.completed":
                        break
            return events

        events = asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        server.should_exit = True
        thread.join(10)
    types = [e.type for e in events]
    # the SDK parses each event into its own model (transcription_session.created, the beta
    # name, fell back to ConversationCreatedEvent)
    assert types[0] == "session.created" and type(events[0]).__name__ == "SessionCreatedEvent"
    assert events[0].session.type == "transcription"
    assert "session.updated" in types and "input_audio_buffer.committed" in types
    assert type(events[-1]).__name__ == "ConversationItemInputAudioTranscriptionCompletedEvent"
    assert events[-1].transcript == "hello world 1.50"
