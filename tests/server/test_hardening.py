"""The engine-scheduler worker, the new CLI flags and bad input: every bad request gets its own
error, the server keeps serving, and no stream slot or queue entry is left behind (/metrics)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

# -- helpers -------------------------------------------------------------------------------------


class PassThroughExecutor:
    """A plugin executor that is not :class:`BatchExecutor` (so the worker takes the scheduler
    path) but runs the in-test model the same way."""

    def __init__(self, model: Any, max_batch_size: int) -> None:
        from oasr.scheduler import BatchExecutor

        self.inner = BatchExecutor(model, max_batch_size)

    @property
    def num_running(self) -> int:
        return self.inner.num_running

    def try_admit(self, request: Any) -> bool:
        return self.inner.try_admit(request)

    def step(self) -> list[Any]:
        return self.inner.step()

    def abort(self, request: Any) -> bool:
        return self.inner.abort(request)


def scheduled_model(kit: Any, **kw: Any) -> Any:
    model = kit.FakeModel(**kw)
    model.make_executor = lambda config: PassThroughExecutor(model, config.max_batch_size)
    return model


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        if all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live(app_factory):
    """``live(**config)`` -> (base url, app, model): the app under a real uvicorn server in a
    thread (raw sockets can then misbehave against it)."""
    import uvicorn

    servers = []

    def start(model: Any = None, **cfg: Any) -> tuple[str, Any, Any]:
        app, model = app_factory(model, **cfg)
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert app.state.oasr.wait_loaded(10)
        return f"http://127.0.0.1:{port}", app, model

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def settled(base: str, timeout: float = 5.0) -> str:
    """/metrics once nothing is queued, in the engine or streaming (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base}/metrics").text
        busy = (
            metric(text, "oasr_queue_depth")
            + metric(text, "oasr_engine_in_flight")
            + metric(text, "oasr_streams_active")
        )
        if not busy or time.monotonic() > deadline:
            assert busy == 0, text
            return text
        time.sleep(0.05)


def still_serving(base: str, kit: Any) -> None:
    r = httpx.post(
        f"{base}/v1/audio/transcriptions",
        files={"file": ("a.wav", kit.wav_bytes(1.0), "audio/wav")},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "hello world 1.00"


# -- the engine scheduler -------------------------------------------------------------------------


def test_worker_uses_the_engine_scheduler(kit, app_factory) -> None:
    model = scheduled_model(kit, fail_seconds=0.7)
    app, _ = app_factory(model, max_concurrency=3, engine_kw={"max_batch_size": 8})

    async def go() -> None:
        async with kit.serving(app) as client:
            worker = app.state.oasr.worker
            assert worker.max_concurrency == 3
            assert type(app.state.oasr.engine.scheduler.executor).__name__ == "PassThroughExecutor"
            durations = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.1]
            import asyncio

            rs = await asyncio.gather(
                *(kit.post_audio(client, audio=kit.wav_bytes(d)) for d in durations)
            )
            for d, r in zip(durations, rs, strict=True):
                if d == 0.7:  # the failing input fails alone
                    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
                else:
                    assert r.status_code == 200 and r.json()["text"] == f"hello world {d:.2f}"
            # multi-input jobs (chunking_strategy) go through the scheduler too
            r = await kit.post_audio(
                client, audio=kit.wav_bytes(1.0), fields={"chunking_strategy": "auto"}
            )
            assert r.status_code == 200, r.text
            text = (await client.get("/metrics")).text
            assert metric(text, "oasr_engine_in_flight") == 0
            assert metric(text, "oasr_queue_depth") == 0
            assert metric(text, "oasr_batch_size_count") >= 1

    kit.run(go())
    assert max(model.batches) <= 3  # never more than --max-concurrency requests in the engine


def test_scheduler_timeout_aborts_and_keeps_serving(kit, app_factory) -> None:
    gate = threading.Event()
    model = scheduled_model(kit, gate=gate)
    app, _ = app_factory(model, request_timeout=0.5, warmup=False)

    async def go() -> None:
        async with kit.serving(app) as client:
            r = await kit.post_audio(client)
            assert r.status_code == 504
            gate.set()
            r = await kit.post_audio(client)
            assert r.status_code == 200
            text = (await client.get("/metrics")).text
            assert metric(text, "oasr_engine_in_flight") == 0

    kit.run(go())


def test_models_without_an_executor_go_through_the_batch_executor(kit, app_factory) -> None:
    from oasr.scheduler import BatchExecutor

    app, _ = app_factory(max_concurrency=2)

    async def go() -> None:
        async with kit.serving(app) as client:
            assert isinstance(app.state.oasr.engine.scheduler.executor, BatchExecutor)
            assert (await kit.post_audio(client)).status_code == 200

    kit.run(go())


# -- CLI flags ------------------------------------------------------------------------------------


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from oasr_server.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_documents_the_new_flags() -> None:
    from typer.testing import CliRunner

    from oasr_server.cli import app

    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    for flag in ("--service-mode", "--max-concurrency", "--realtime-idle-timeout"):
        assert flag in out
    bad = CliRunner().invoke(app, ["--service-mode", "sideways"])
    assert bad.exit_code == 2 and "offline or streaming" in bad.output
    bad = CliRunner().invoke(app, ["--max-concurrency", "0"])
    assert bad.exit_code == 2


def test_streaming_mode_refused_for_a_model_that_cannot_stream() -> None:
    proc = _cli("--service-mode", "streaming", "--http-bind", f"127.0.0.1:{free_port()}",
                "--no-warmup", "--log-level", "error")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--service-mode streaming" in proc.stderr and "cannot stream" in proc.stderr


def test_config_values() -> None:
    from oasr.errors import InvalidRequestError
    from oasr_server.config import ServerConfig

    with pytest.raises(InvalidRequestError):
        ServerConfig(max_concurrency=0)
    with pytest.raises(InvalidRequestError):
        ServerConfig(realtime_idle_timeout=-1)


# -- bad input over real sockets ------------------------------------------------------------------


def test_bad_uploads_get_their_errors(kit, live) -> None:
    base, _, _ = live()
    url = f"{base}/v1/audio/transcriptions"
    # malformed multipart: a boundary that never appears / a truncated body
    r = httpx.post(
        url,
        content=b'--zzz\r\nContent-Disposition: form-data; name="file"\r\n\r\nabc',
        headers={"content-type": "multipart/form-data; boundary=zzz"},
    )
    assert r.status_code == 400, r.text
    r = httpx.post(url, content=b"garbage", headers={"content-type": "multipart/form-data"})
    assert r.status_code == 400, r.text
    r = httpx.post(url, content=b"{}", headers={"content-type": "application/json"})
    assert r.status_code in (400, 415), r.text
    # missing file
    r = httpx.post(url, data={"model": "whisper-1"}, files={"x": ("x", b"1")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    # wrong field types
    wav = {"file": ("a.wav", kit.wav_bytes(1.0), "audio/wav")}
    for field, value in [
        ("temperature", "warm"),
        ("stream", "maybe"),
        ("response_format", "xml"),
        ("timestamp_granularities[]", "syllable"),
        ("chunking_strategy", "{not json"),
    ]:
        r = httpx.post(url, files=wav, data={field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    # a file field that is not audio
    r = httpx.post(url, files={"file": ("a.wav", b"not audio at all", "audio/wav")})
    assert r.status_code == 400, r.text
    settled(base)
    still_serving(base, kit)


def test_client_gone_mid_upload_and_mid_sse(kit, live) -> None:
    base, _, model = live()
    host, port = base.removeprefix("http://").split(":")
    body = kit.wav_bytes(2.0)
    boundary = "b0undary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    full = head + body + tail
    # mid-upload: declare the whole body, send half, hang up
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                (
                    "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                    f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                    f"Content-Length: {len(full)}\r\n\r\n"
                ).encode()
                + full[: len(full) // 2]
            )
    # mid-SSE: ask for a stream, read the first bytes, hang up
    stream_body = full.replace(
        tail,
        f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="stream"\r\n\r\ntrue'
        f"\r\n--{boundary}--\r\n".encode(),
    )
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                (
                    "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                    f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                    f"Content-Length: {len(stream_body)}\r\n\r\n"
                ).encode()
                + stream_body
            )
            s.settimeout(10)
            assert s.recv(64).startswith(b"HTTP/1.1 200")
    settled(base)
    still_serving(base, kit)


def test_realtime_garbage_and_idle_timeout(kit, live) -> None:
    from websockets.sync.client import connect

    base, _, _ = live(realtime_idle_timeout=0.5, max_streams=1)
    ws_url = base.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    with connect(ws_url, open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
        for garbage in ["{not json", json.dumps([1, 2]), json.dumps({"type": 7})]:
            ws.send(garbage)
            event = json.loads(ws.recv(timeout=5))
            assert event["type"] == "error", event
        ws.send(b"\x00\x01binary")
        assert json.loads(ws.recv(timeout=5))["type"] == "error"
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "!!notbase64!!"}))
        assert json.loads(ws.recv(timeout=5))["type"] == "error"
        # then the client stops sending: an idle_timeout error, then close 1008
        event = json.loads(ws.recv(timeout=5))
        assert event["type"] == "error" and event["error"]["code"] == "idle_timeout", event
        with pytest.raises(Exception):  # noqa: B017 - the server closed the socket
            ws.recv(timeout=5)
        assert ws.close_code == 1008
    text = settled(base)
    assert metric(text, "oasr_errors_total", code="idle_timeout") == 1
    # the slot is free again (max_streams=1): a new session opens
    with connect(ws_url, open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
    # a client that disappears without a close frame frees its slot too
    with contextlib.suppress(Exception), connect(ws_url, open_timeout=10) as ws:
        ws.recv(timeout=5)
        ws.socket.shutdown(socket.SHUT_RDWR)
        ws.socket.close()
    settled(base)
    still_serving(base, kit)


def test_streaming_mode_serves_a_streaming_model(kit) -> None:
    """``--service-mode streaming`` with a model that can stream (the bundled random-weight
    WeNet U2++ test checkpoint): ready, and uploads answered through the batch path."""
    from pathlib import Path

    pytest.importorskip("oasr_models_wenet")
    from oasr.types import EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    ckpt = Path(__file__).resolve().parents[1] / "data" / "wenet" / "u2pp_conformer"
    app = create_app(
        ServerConfig(),
        engine_config=EngineConfig(ckpt_dir=str(ckpt), service_mode="streaming"),
    )

    async def go() -> None:
        async with kit.serving(app) as client:
            assert app.state.oasr.engine.config.service_mode == "streaming"
            assert type(app.state.oasr.engine.scheduler.executor).__name__ == "BatchExecutor"
            r = await kit.post_audio(client, audio=kit.wav_bytes(1.0))
            assert r.status_code == 200, r.text
            assert isinstance(r.json()["text"], str)

    kit.run(go())
