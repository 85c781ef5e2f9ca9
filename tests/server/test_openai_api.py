"""OpenAI-compatible /v1/audio/transcriptions and /v1/audio/translations over ASGI."""

from __future__ import annotations

import json

import pytest


def _error(resp, status: int, code: str, param: str | None = "__any__") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code, err
    assert err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


def test_json_is_the_default(kit, app_factory) -> None:
    app, model = app_factory()

    async def go():
        async with kit.serving(app) as c:
            r = await kit.post_audio(c, audio=kit.wav_bytes(1.0), fields={"model": "fake"})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("application/json")
            assert r.json() == {
                "text": "hello world 1.00",
                "usage": {"type": "duration", "seconds": 1.0},
            }

    kit.run(go())


@pytest.mark.parametrize(
    ("fmt", "ctype"),
    [
        ("json", "application/json"),
        ("text", "text/plain"),
        ("srt", "application/x-subrip"),
        ("vtt", "text/vtt"),
        ("verbose_json", "application/json"),
    ],
)
def test_each_response_format(kit, app_factory, fmt: str, ctype: str) -> None:
    app, _ = app_factory()

    async def go():
        async with kit.serving(app) as c:
            r = await kit.post_audio(
                c, audio=kit.wav_bytes(2.0), fields={"response_format": fmt, "model": "whisper-1"}
            )
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith(ctype)
            return r.text

    body = kit.run(go())
    if fmt == "json":
        assert json.loads(body) == {
            "text": "hello world 2.00",
            "usage": {"type": "duration", "seconds": 2.0},
        }
    elif fmt == "text":
        assert body == "hello world 2.00\n"
    elif fmt == "srt":
        assert body.startswith("1\n00:00:00,000 --> 00:00:01,000\nhello world\n")
        assert "2\n00:00:01,000 --> 00:00:02,000\n2.00" in body
    elif fmt == "vtt":
        assert body.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nhello world\n")
    else:
        v = json.loads(body)
        assert v["task"] == "transcribe" and v["language"] == "english"
        assert v["duration"] == pytest.approx(2.0)
        assert [s["text"] for s in v["segments"]] == [" hello world", " 2.00"]
        assert "words" not in v


def test_verbose_json_word_and_segment_granularities(kit, app_factory) -> None:
    app, model = app_factory()

    async def go():
        async with kit.serving(app) as c:
            words_only = await kit.post_audio(
                c,
                fields=[("response_format", "verbose_json"), ("timestamp_granularities[]", "word")],
            )
            both = await kit.post_audio(
                c,
                fields=[
                    ("response_format", "verbose_json"),
                    ("timestamp_granularities[]", "word"),
                    ("timestamp_granularities[]", "segment"),
                ],
            )
            return words_only.json(), both.json()

    words_only, both = kit.run(go())
    assert [w["word"] for w in words_only["words"]] == [" hello", " world"]
    # OpenAI keeps the segments when only word timestamps are asked
    assert [s["text"] for s in words_only["segments"]] == [" hello world", " 1.00"]
    assert words_only["usage"] == {"type": "duration", "seconds": 1.0}
    assert set(words_only["words"][0]) == {"word", "start", "end", "probability"}
    assert "segments" in both and len(both["words"]) == 2
    assert model.options[-1].word_timestamps is True


def test_options_reach_the_model(kit, app_factory) -> None:
    app, model = app_factory()

    async def go():
        async with kit.serving(app) as c:
            r = await kit.post_audio(
                c, fields={"language": "de", "prompt": "Hallo", "temperature": "0.4"}
            )
            assert r.status_code == 200, r.text
            r = await kit.post_audio(c)  # temperature 0 (default): greedy with fallback
            assert r.status_code == 200, r.text

    kit.run(go())
    first, second = model.options[-2:]
    assert first.language == "de" and first.prompt == "Hallo" and first.temperatures == (0.4,)
    assert first.task == "transcribe" and not first.word_timestamps
    assert second.temperatures[0] == 0.0 and len(second.temperatures) > 1


def test_translations(kit, app_factory) -> None:
    app, model = app_factory()

    async def go():
        async with kit.serving(app) as c:
            r = await kit.post_audio(
                c, "/v1/audio/translations", fields={"response_format": "verbose_json"}
            )
            assert r.status_code == 200, r.text
            return r.json()

    body = kit.run(go())
    assert body["task"] == "translate"
    assert body["text"].startswith("translated words")
    assert model.options[-1].task == "translate"


def test_sse_stream(kit, app_factory) -> None:
    app, _ = app_factory()

    async def go():
        async with kit.serving(app) as c:
            r = await kit.post_audio(c, audio=kit.wav_bytes(1.5), fields={"stream": "true"})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("text/event-stream")
            return r.text

    raw = kit.run(go())
    assert raw.endswith("\n\n")
    events = [json.loads(block[len("data: ") :]) for block in raw.strip().split("\n\n")]
    assert all(set(e) >= {"type"} for e in events)
    *deltas, done = events
    assert done["type"] == "transcript.text.done"
    assert done["text"] == "hello world 1.50"
    assert [e["type"] for e in deltas] == ["transcript.text.delta"] * 3
    assert "".join(e["delta"] for e in deltas) == done["text"]
    assert done["usage"] == {"type": "duration", "seconds": 1.5}


def test_stream_refuses_subtitle_formats(kit, app_factory) -> None:
    app, _ = app_factory()

    async def go():
        async with kit.serving(app) as c:
            return await kit.post_audio(c, fields={"stream": "true", "response_format": "srt"})

    _error(kit.run(go()), 400, "invalid_request", "stream")


def test_family_that_cannot_gets_400(kit, app_factory) -> None:
    app, model = app_factory(kit.FakeModel(word_timestamps=False, translation=False))

    async def go():
        async with kit.serving(app) as c:
            words = await kit.post_audio(
                c,
                fields=[("response_format", "verbose_json"), ("timestamp_granularities[]", "word")],
            )
            translate = await kit.post_audio(c, "/v1/audio/translations")
            return words, translate

    words, translate = kit.run(go())
    err = _error(words, 400, "unsupported_option", "timestamp_granularities")
    assert "word timestamps" in err["message"] and err["type"] == "invalid_request_error"
    err = _error(translate, 400, "unsupported_option", "task")
    assert "cannot translate" in err["message"]
    assert model.batches == [1]  # only the warm-up: nothing refused reached the model


def test_request_validation_errors(kit, app_factory) -> None:
    app, _ = app_factory()

    async def go():
        async with kit.serving(app) as c:
            out = {}
            out["no_file"] = await c.post(
                "/v1/audio/transcriptions", data={"model": "fake"}, files={"other": ("x", b"1")}
            )
            out["file_as_text"] = await c.post(
                "/v1/audio/transcriptions", files={"model": (None, "fake")}, data={"file": "abc"}
            )
            out["not_multipart"] = await c.post("/v1/audio/transcriptions", json={"file": "x"})
            out["format"] = await kit.post_audio(c, fields={"response_format": "mp3"})
            out["temperature"] = await kit.post_audio(c, fields={"temperature": "7"})
            out["temperature_nan"] = await kit.post_audio(c, fields={"temperature": "hot"})
            out["grain"] = await kit.post_audio(
                c,
                fields=[("response_format", "verbose_json"), ("timestamp_granularities[]", "char")],
            )
            out["grain_json"] = await kit.post_audio(
                c, fields=[("timestamp_granularities[]", "word")]
            )
            out["stream"] = await kit.post_audio(c, fields={"stream": "maybe"})
            out["model"] = await kit.post_audio(c, fields={"model": "gpt-4o-transcribe"})
            out["bad_audio"] = await kit.post_audio(c, audio=b"this is not audio at all" * 10)
            out["empty_audio"] = await kit.post_audio(c, audio=b"")
            out["route"] = await c.get("/v1/nothing")
            out["method"] = await c.get("/v1/audio/transcriptions")
            return out

    out = kit.run(go())
    _error(out["no_file"], 400, "invalid_request", "file")
    _error(out["file_as_text"], 400, "invalid_request", "file")
    _error(out["not_multipart"], 400, "invalid_request", "file")
    _error(out["format"], 400, "invalid_request", "response_format")
    _error(out["temperature"], 400, "invalid_request", "temperature")
    _error(out["temperature_nan"], 400, "invalid_request", "temperature")
    _error(out["grain"], 400, "invalid_request", "timestamp_granularities")
    _error(out["grain_json"], 400, "invalid_request", "timestamp_granularities")
    _error(out["stream"], 400, "invalid_request", "stream")
    err = _error(out["model"], 404, "model_not_found", "model")
    assert "'fake'" in err["message"]
    _error(out["bad_audio"], 400, "bad_audio")
    _error(out["empty_audio"], 400, "bad_audio")
    _error(out["route"], 404, "not_found")
    _error(out["method"], 405, "method_not_allowed")


def test_oversize_upload_413(kit, app_factory) -> None:
    app, model = app_factory(max_upload_bytes=20_000)

    async def go():
        async with kit.serving(app) as c:
            declared = await kit.post_audio(c, audio=kit.wav_bytes(1.0))  # 32 kB > 20 kB

            async def chunks():  # no Content-Length: refused while reading
                for _ in range(100):
                    yield b"\0" * 1000

            streamed = await c.post("/v1/speech:recognize", content=chunks())
            small = await kit.post_audio(c, audio=kit.wav_bytes(0.25))
            return declared, streamed, small

    declared, streamed, small = kit.run(go())
    _error(declared, 413, "upload_too_large")
    _error(streamed, 413, "upload_too_large")
    assert small.status_code == 200, small.text


def test_too_long_audio_413(kit, app_factory) -> None:
    app, model = app_factory(max_audio_seconds=1.0)

    async def go():
        async with kit.serving(app) as c:
            return await kit.post_audio(c, audio=kit.wav_bytes(3.0)), await kit.post_audio(c)

    long, ok = kit.run(go())
    _error(long, 413, "audio_too_long")
    assert ok.status_code == 200


def test_multipart_edge_cases(kit, app_factory) -> None:
    app, _ = app_factory()

    async def go():
        async with kit.serving(app) as c:
            big = await kit.post_audio(c, audio=kit.wav_bytes(12.0))  # > 256 kB: parsed in a thread
            no_boundary = await c.post(
                "/v1/audio/transcriptions",
                content=b"x",
                headers={"Content-Type": "multipart/form-data"},
            )
            garbage = await c.post(
                "/v1/audio/transcriptions",
                content=b"--b\r\nnonsense",
                headers={"Content-Type": "multipart/form-data; boundary=b"},
            )
            return big, no_boundary, garbage

    big, no_boundary, garbage = kit.run(go())
    assert big.status_code == 200 and big.json()["text"] == "hello world 12.00"
    _error(no_boundary, 400, "invalid_request", "file")
    _error(garbage, 400, "invalid_request", "file")
