"""Queueing, batching, back-pressure, timeouts, auth, readiness, metrics, models, recognize."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import numpy as np
import pytest


async def _wait_for(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        await asyncio.sleep(0.01)


def _gated(kit, app_factory, **cfg):
    """An app whose model blocks on a gate (armed after the warm-up)."""
    app, model = app_factory(**cfg)
    gate = threading.Event()
    return app, model, gate


def _arm(model, gate) -> None:
    model.gate = gate
    model.batches.clear()
    model.calls_started = threading.Semaphore(0)


async def _started(model) -> None:
    ok = await asyncio.to_thread(model.calls_started.acquire, True, 10)
    assert ok, "the engine never started a call"


def test_waiting_requests_are_batched_and_answered_in_order(kit, app_factory) -> None:
    app, model, gate = _gated(kit, app_factory)
    worker_depth = lambda: app.state.oasr.worker.depth  # noqa: E731

    async def go():
        async with kit.serving(app) as c:
            _arm(model, gate)
            first = asyncio.create_task(kit.post_audio(c, audio=kit.wav_bytes(0.5)))
            await _started(model)
            seconds = [0.25 * (i + 1) for i in range(8)]
            queued = [
                asyncio.create_task(kit.post_audio(c, audio=kit.wav_bytes(s))) for s in seconds
            ]
            await _wait_for(lambda: worker_depth() == 8)
            # the event loop is free while the engine works
            t0 = time.monotonic()
            health = await c.get("/healthz")
            assert health.status_code == 200 and time.monotonic() - t0 < 1.0
            gate.set()
            answers = await asyncio.gather(first, *queued)
            return seconds, answers

    seconds, answers = kit.run(go())
    assert [a.status_code for a in answers] == [200] * 9
    assert answers[0].json()["text"] == "hello world 0.50"
    for s, a in zip(seconds, answers[1:], strict=True):
        assert a.json()["text"] == f"hello world {s:.2f}"
    assert model.batches == [1, 8]


def test_only_matching_options_share_a_batch(kit, app_factory) -> None:
    app, model, gate = _gated(kit, app_factory)

    async def go():
        async with kit.serving(app) as c:
            _arm(model, gate)
            first = asyncio.create_task(kit.post_audio(c))
            await _started(model)
            tasks = [
                asyncio.create_task(kit.post_audio(c, fields={"language": lang}))
                for lang in ["en", "de", "en", "de", "en", "de"]
            ]
            await _wait_for(lambda: app.state.oasr.worker.depth == 6)
            gate.set()
            return await asyncio.gather(first, *tasks)

    answers = kit.run(go())
    assert all(a.status_code == 200 for a in answers)
    assert model.batches == [1, 3, 3]
    assert sorted(o.language for o in model.options[-2:]) == ["de", "en"]


def test_many_concurrent_requests_all_answered(kit, app_factory) -> None:
    app, model = app_factory(kit.FakeModel(delay=0.05), engine_kw={"max_batch_size": 4})

    async def go():
        async with kit.serving(app) as c:
            model.batches.clear()
            seconds = [0.1 + 0.05 * i for i in range(24)]
            answers = await asyncio.gather(
                *[kit.post_audio(c, audio=kit.wav_bytes(s)) for s in seconds]
            )
            return seconds, answers

    seconds, answers = kit.run(go())
    for s, a in zip(seconds, answers, strict=True):
        assert a.status_code == 200, a.text
        assert a.json()["text"] == f"hello world {s:.2f}"
    assert sum(model.batches) == 24
    assert max(model.batches) > 1  # requests that waited together were merged


def test_full_queue_503_overloaded_then_still_serving(kit, app_factory) -> None:
    app, model, gate = _gated(kit, app_factory, max_queue=2, retry_after_s=3)

    async def go():
        async with kit.serving(app) as c:
            _arm(model, gate)
            first = asyncio.create_task(kit.post_audio(c))
            await _started(model)
            queued = [asyncio.create_task(kit.post_audio(c)) for _ in range(2)]
            await _wait_for(lambda: app.state.oasr.worker.depth == 2)
            refused = await kit.post_audio(c)
            refused_raw = await c.post("/v1/speech:recognize", content=kit.wav_bytes())
            gate.set()
            accepted = await asyncio.gather(first, *queued)
            after = await kit.post_audio(c)
            return refused, refused_raw, accepted, after

    refused, refused_raw, accepted, after = kit.run(go())
    for r in (refused, refused_raw):
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert err["code"] == "overloaded" and err["type"] == "server_error"
    assert [a.status_code for a in accepted] == [200, 200, 200]  # nothing accepted is lost
    assert after.status_code == 200


def test_timeout_504_abandoned_work_is_skipped(kit, app_factory) -> None:
    app, model, gate = _gated(kit, app_factory, request_timeout=0.5)

    async def go():
        async with kit.serving(app) as c:
            _arm(model, gate)
            first = asyncio.create_task(kit.post_audio(c, audio=kit.wav_bytes(1.0)))
            await _started(model)
            second = await kit.post_audio(c, audio=kit.wav_bytes(2.0))  # waits in the queue
            first = await first
            gate.set()
            after = await kit.post_audio(c, audio=kit.wav_bytes(3.0))
            return first, second, after

    first, second, after = kit.run(go())
    for r in (first, second):
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "timeout" and err["type"] == "server_error"
    assert after.status_code == 200 and after.json()["text"] == "hello world 3.00"
    assert model.batches == [1, 1]  # the abandoned 2 s request never reached the model


def test_failing_input_does_not_fail_its_batch(kit, app_factory) -> None:
    app, model = app_factory(kit.FakeModel(fail_seconds=0.5))
    gate = threading.Event()

    async def go():
        async with kit.serving(app) as c:
            _arm(model, gate)
            first = asyncio.create_task(kit.post_audio(c, audio=kit.wav_bytes(1.0)))
            await _started(model)
            tasks = [
                asyncio.create_task(kit.post_audio(c, audio=kit.wav_bytes(s)))
                for s in (0.25, 0.5, 0.75)
            ]
            await _wait_for(lambda: app.state.oasr.worker.depth == 3)
            gate.set()
            answers = await asyncio.gather(first, *tasks)
            after = await kit.post_audio(c)
            return answers, after

    (first, a, bad, b), after = kit.run(go())
    assert first.status_code == a.status_code == b.status_code == after.status_code == 200
    assert a.json()["text"] == "hello world 0.25" and b.json()["text"] == "hello world 0.75"
    assert bad.status_code == 500
    assert bad.json()["error"]["type"] == "server_error"
    assert bad.json()["error"]["code"] == "engine_error"


def test_api_key(kit, app_factory) -> None:
    app, _ = app_factory(api_key="sekrit")

    async def go():
        async with kit.serving(app) as c:
            out = {
                "missing": await kit.post_audio(c),
                "wrong": await kit.post_audio(c, headers={"Authorization": "Bearer nope"}),
                "scheme": await kit.post_audio(c, headers={"Authorization": "Basic sekrit"}),
                "models": await c.get("/v1/models"),
                "metrics": await c.get("/metrics"),
                "unknown": await c.get("/v1/unknown"),
                "ok": await kit.post_audio(c, headers={"Authorization": "Bearer sekrit"}),
                "models_ok": await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}),
                "healthz": await c.get("/healthz"),
                "readyz": await c.get("/readyz"),
            }
            return out

    out = kit.run(go())
    for name in ("missing", "wrong", "scheme", "models", "metrics", "unknown"):
        r = out[name]
        assert r.status_code == 401, (name, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
    for name in ("ok", "models_ok", "healthz", "readyz"):
        assert out[name].status_code == 200, name


def test_readyz_before_and_after_load(kit) -> None:
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    release = threading.Event()
    model = kit.FakeModel()

    def factory():
        assert release.wait(10)
        return kit.make_engine(model)

    app = create_app(ServerConfig(), engine_factory=factory)

    async def go():
        async with kit.serving(app, wait_ready=False) as c:
            before = await c.get("/readyz")
            health = await c.get("/healthz")
            refused = await kit.post_audio(c)
            models = await c.get("/v1/models")
            release.set()
            await asyncio.to_thread(app.state.oasr.wait_loaded, 10)
            after = await c.get("/readyz")
            ok = await kit.post_audio(c)
            return before, health, refused, models, after, ok

    before, health, refused, models, after, ok = kit.run(go())
    assert before.status_code == 503 and before.json()["error"]["code"] == "model_not_ready"
    assert health.status_code == 200
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_not_ready"
    assert models.json()["data"][0]["ready"] is False
    assert after.status_code == 200 and after.json()["status"] == "ready"
    assert ok.status_code == 200
    assert model.batches[0] == 1  # the warm-up ran before ready


def test_load_failure_is_reported(kit) -> None:
    from oasr.errors import CheckpointError
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    seen = []

    def factory():
        raise CheckpointError("config.json is missing from /nowhere")

    app = create_app(ServerConfig(), engine_factory=factory, on_load_failure=seen.append)

    async def go():
        async with kit.serving(app, wait_ready=False) as c:
            await asyncio.to_thread(app.state.oasr.wait_loaded, 10)
            return await c.get("/readyz"), await kit.post_audio(c)

    ready, post = kit.run(go())
    assert ready.status_code == 503 and "config.json is missing" in ready.json()["error"]["message"]
    assert post.status_code == 503 and "failed to load" in post.json()["error"]["message"]
    assert len(seen) == 1 and isinstance(seen[0], CheckpointError)


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = (m.group(2) or "{}")[1:-1]
        if all(part in got.split(",") for part in want.split(",") if part):
            return float(m.group(3))
    return 0.0


def test_metrics_move(kit, app_factory) -> None:
    app, _ = app_factory(max_audio_seconds=5)

    async def go():
        async with kit.serving(app) as c:
            before = (await c.get("/metrics")).text
            for s in (1.0, 2.0):
                assert (await kit.post_audio(c, audio=kit.wav_bytes(s))).status_code == 200
            assert (await kit.post_audio(c, audio=b"junk" * 50)).status_code == 400
            assert (
                await c.post("/v1/speech:recognize", content=kit.wav_bytes(0.5))
            ).status_code == 200
            r = await c.get("/metrics")
            return before, r

    before, r = kit.run(go())
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    route = "/v1/audio/transcriptions"
    assert _metric(before, "oasr_requests_total", route=route, status="200") == 0
    assert _metric(text, "oasr_requests_total", route=route, method="POST", status="200") == 2
    assert _metric(text, "oasr_requests_total", route=route, status="400") == 1
    assert _metric(text, "oasr_requests_total", route="/v1/speech:recognize", status="200") == 1
    assert _metric(text, "oasr_request_duration_seconds_count", route=route) == 3
    assert _metric(text, "oasr_audio_seconds_total", route=route) == pytest.approx(3.0, abs=0.01)
    assert _metric(text, "oasr_batch_size_count") == 3  # one engine call per request here
    assert _metric(text, "oasr_errors_total", code="bad_audio") == 1
    assert _metric(text, "oasr_model_ready") == 1
    assert "oasr_queue_depth 0.0" in text
    assert "oasr_queue_wait_seconds_bucket" in text
    # RTFx: one observation per request through the engine queue, and the 60 s window's rate
    assert _metric(text, "oasr_request_rtfx_count") == 3
    assert _metric(text, "oasr_rtfx") == pytest.approx(3.5 / 60, rel=0.01)
    # GPU memory: declared, but a CPU model has no device to report
    assert "# TYPE oasr_gpu_memory_bytes gauge" in text
    assert "oasr_gpu_memory_bytes{" not in text


def test_throughput_window() -> None:
    from oasr_server.metrics import ThroughputWindow

    now = [100.0]
    window = ThroughputWindow(window=10.0, clock=lambda: now[0])
    assert window.rtfx() == 0
    window.add(30.0)
    now[0] = 105.0
    window.add(20.0)
    assert window.rtfx() == pytest.approx(5.0)  # 50 s of audio in the last 10 s
    now[0] = 111.0  # the first result left the window
    assert window.rtfx() == pytest.approx(2.0)
    now[0] = 200.0
    assert window.rtfx() == 0


@pytest.mark.gpu
def test_gpu_memory_metric() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from oasr_server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.bind_gpu("cuda")
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB
    text = metrics.render().decode()
    index = torch.cuda.current_device()
    allocated = _metric(text, "oasr_gpu_memory_bytes", device=f"cuda:{index}", kind="allocated")
    total = _metric(text, "oasr_gpu_memory_bytes", device=f"cuda:{index}", kind="total")
    used = _metric(text, "oasr_gpu_memory_bytes", device=f"cuda:{index}", kind="used")
    assert allocated >= block.numel() and total >= used >= allocated
    del block


def test_models_list(kit, app_factory) -> None:
    app, _ = app_factory(served_model_name="tiny-test")

    async def go():
        async with kit.serving(app) as c:
            return (await c.get("/v1/models")).json()

    body = kit.run(go())
    assert body["object"] == "list"
    (entry,) = body["data"]
    assert entry["id"] == "tiny-test" and entry["object"] == "model"
    assert isinstance(entry["created"], int) and entry["owned_by"] == "oasr"
    assert entry["oasr"]["name"] == "fake-model" and entry["oasr"]["decode_family"] == "aed"


def test_speech_recognize(kit, app_factory) -> None:
    app, model = app_factory()
    rate = 8000
    pcm = (0.2 * np.sin(2 * np.pi * 300 * np.arange(rate) / rate) * 32767).astype("<i2").tobytes()

    async def go():
        async with kit.serving(app) as c:
            wav = await c.post(
                "/v1/speech:recognize?language=fr&word_timestamps=true",
                content=kit.wav_bytes(1.0),
                headers={"Content-Type": "audio/wav"},
            )
            raw = await c.post(
                "/v1/speech:recognize?encoding=pcm_s16le&sample_rate=8000", content=pcm
            )
            no_rate = await c.post("/v1/speech:recognize?encoding=pcm_s16le", content=pcm)
            bad_task = await c.post("/v1/speech:recognize?task=summarise", content=pcm)
            bad_enc = await c.post(
                "/v1/speech:recognize?encoding=mp9&sample_rate=8000", content=pcm
            )
            junk = await c.post("/v1/speech:recognize", content=b"\x00\x01" * 100)
            return wav, raw, no_rate, bad_task, bad_enc, junk

    wav, raw, no_rate, bad_task, bad_enc, junk = kit.run(go())
    assert wav.status_code == 200, wav.text
    body = wav.json()
    assert body["text"] == "hello world 1.00" and body["language"] == "fr"
    assert body["duration"] == 1.0 and len(body["segments"]) == 2 and len(body["words"]) == 2
    assert set(body["words"][0]) == {"word", "start", "end", "confidence"}
    assert raw.status_code == 200 and raw.json()["text"] == "hello world 1.00"
    for r, param in ((no_rate, "sample_rate"), (bad_task, "task"), (bad_enc, "raw_format")):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert junk.status_code == 400 and junk.json()["error"]["code"] == "bad_audio"


def test_example_plugin_through_the_server(kit, example_installed, example_ckpt) -> None:
    """The real load path: a checkpoint dir, format detection, the plugin's model."""
    from oasr.types import EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    app = create_app(ServerConfig(), engine_config=EngineConfig(ckpt_dir=str(example_ckpt)))
    t = np.arange(16000) / 16000
    audio = np.concatenate([np.zeros(8000), 0.5 * np.sin(2 * np.pi * 440 * t), np.zeros(8000)])
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((audio * 32767).astype("<i2").tobytes())

    async def go():
        async with kit.serving(app) as c:
            return await kit.post_audio(
                c, audio=buf.getvalue(), fields={"response_format": "verbose_json"}
            )

    r = kit.run(go())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == "[speech]"
    assert body["segments"][0]["start"] == pytest.approx(0.5, abs=0.02)


def test_shutdown_finishes_accepted_requests(kit, app_factory) -> None:
    app, model, gate = _gated(kit, app_factory)
    state = app.state.oasr

    async def go():
        async with kit.serving(app) as c:
            _arm(model, gate)
            first = asyncio.create_task(kit.post_audio(c, audio=kit.wav_bytes(0.5)))
            await _started(model)
            queued = [
                asyncio.create_task(kit.post_audio(c, audio=kit.wav_bytes(s))) for s in (0.25, 0.75)
            ]
            await _wait_for(lambda: state.worker.depth == 2)
            stopping = asyncio.create_task(asyncio.to_thread(state.shutdown))
            await _wait_for(lambda: not state.ready)
            refused = await kit.post_audio(c)  # no new work once shutting down
            gate.set()
            answers = await asyncio.gather(first, *queued)
            await stopping
            return refused, answers

    refused, answers = kit.run(go())
    assert refused.status_code == 503
    assert [a.json()["text"] for a in answers] == [
        "hello world 0.50",
        "hello world 0.25",
        "hello world 0.75",
    ]
    assert model.batches == [1, 2]


def test_client_that_went_away_is_dropped(kit, app_factory) -> None:
    import httpx

    app, model, gate = _gated(kit, app_factory)
    built = httpx.Request(
        "POST",
        "http://oasr.test/v1/audio/transcriptions",
        files={"file": ("a.wav", kit.wav_bytes(2.0), "audio/wav")},
    )
    body = built.read()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/audio/transcriptions",
        "raw_path": b"/v1/audio/transcriptions",
        "query_string": b"",
        "root_path": "",
        "server": ("oasr.test", 80),
        "client": ("1.2.3.4", 5),
        "headers": [(k.lower().encode(), v.encode()) for k, v in built.headers.items()],
    }
    sent: list[dict] = []

    async def go():
        async with kit.serving(app) as c:
            _arm(model, gate)
            first = asyncio.create_task(kit.post_audio(c, audio=kit.wav_bytes(1.0)))
            await _started(model)
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            await asyncio.wait_for(
                app(scope, receive, send), 5
            )  # gives up once it sees the disconnect
            gate.set()
            first = await first
            after = await kit.post_audio(c, audio=kit.wav_bytes(3.0))
            metrics = (await c.get("/metrics")).text
            return first, after, metrics

    first, after, metrics = kit.run(go())
    assert first.status_code == after.status_code == 200
    assert sent[0]["status"] == 499
    assert model.batches == [1, 1]  # the 2 s request of the client that left never ran
    assert 'oasr_errors_total{code="client_closed_request"} 1.0' in metrics
