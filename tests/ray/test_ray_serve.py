"""OASR on Ray Serve (``oasr_server.ray_serve``): a local Ray cluster (2 CPUs, no dashboard,
started once for the module) serving 2 replicas of the real Whisper tiny.en behind Serve's proxy.

- the ``openai`` SDK gets the same transcripts from the Ray deployment as from a plain
  in-process oasr-server app, SSE included; ``/v1/models``, ``/readyz`` and ``/metrics`` cover
  both replicas; a realtime WebSocket works through Serve's proxy;
- a replica killed (``ray.kill``) while requests are in flight is replaced, and every request
  is answered: the right transcript (retried by the proxy-side failover) or a well-formed 503
  ``replica_unavailable`` with ``Retry-After``; the two counts add up to the requests sent.

The layout, metrics merge and failover middleware also have cluster-free unit tests.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.serve")

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
CLIPS = ["en_ls_2830-3980-0043.wav", "en_ls_4507-16021-0012.wav", "en_ls_1221-135766-0002.wav"]
SERVED = "tiny.en"


# -- cluster-free ------------------------------------------------------------------------------


def test_server_and_cli_do_not_import_ray() -> None:
    """Ray is an optional extra: only ``--ray`` (or ``oasr_server.ray_serve``'s functions) load it."""
    import subprocess
    import sys

    code = (
        "import sys, oasr_server, oasr_server.app, oasr_server.cli, oasr_server.ray_serve\n"
        "from oasr.cli.main import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--ray-replicas" in done.stdout


def test_serve_on_ray_ignores_a_repeated_sigterm_while_deleting_the_app(monkeypatch) -> None:
    """After SIGTERM stops ``oasr serve --ray``, a second SIGTERM (orchestrators repeat it) must
    not kill the process before the Serve application is deleted."""
    import signal
    import types

    from ray import serve

    from oasr_server import ray_serve

    layout = types.SimpleNamespace(autoscaling=None, num_replicas=1, gpus_per_replica=0.0,
                                   device="cpu")  # fmt: skip
    monkeypatch.setattr(ray_serve, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(ray_serve, "deploy", lambda *a, **k: layout)
    monkeypatch.setattr(ray_serve, "wait_running", lambda *a, **k: True)
    seen: list[Any] = []
    monkeypatch.setattr(serve, "delete", lambda name: seen.append(signal.getsignal(signal.SIGTERM)))
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    options = types.SimpleNamespace(address=None, app_name="oasr")
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = ray_serve.serve_on_ray(None, None, options, host="127.0.0.1", port=0,  # type: ignore[arg-type]
                                      log=lambda _: None)  # fmt: skip
    finally:
        timer.join()
        signal.signal(signal.SIGTERM, before)
    assert code == 0
    assert seen == [signal.SIG_IGN]


def test_plan_layout_one_replica_per_gpu_and_cpu_fallback() -> None:
    from oasr.errors import InvalidRequestError
    from oasr_server.ray_serve import RayOptions, plan_layout

    gpu = plan_layout(RayOptions(), cluster_gpus=8, device="cpu", max_batch_size=16, max_streams=8)
    assert (gpu.num_replicas, gpu.gpus_per_replica, gpu.device) == (8, 1.0, "cuda")
    assert gpu.max_ongoing_requests == 40 and gpu.autoscaling is None
    opts = gpu.deployment_options(2.0)
    assert opts["num_replicas"] == 8 and opts["ray_actor_options"] == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
    }
    half = plan_layout(RayOptions(gpus_per_replica=0.5), cluster_gpus=2)
    assert half.num_replicas == 4
    cpu = plan_layout(RayOptions(), cluster_gpus=0)
    assert (cpu.num_replicas, cpu.gpus_per_replica, cpu.device) == (1, 0.0, "cpu")
    assert "num_gpus" not in cpu.deployment_options(1.0)["ray_actor_options"]
    auto = plan_layout(RayOptions(min_replicas=1, max_replicas=4), cluster_gpus=2, max_batch_size=8)
    assert auto.autoscaling == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                "target_ongoing_requests": 8}  # fmt: skip
    assert "num_replicas" not in auto.deployment_options(1.0)
    with pytest.raises(InvalidRequestError):
        plan_layout(RayOptions(gpus_per_replica=0), cluster_gpus=0, device="cuda:1")
    with pytest.raises(InvalidRequestError):
        RayOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(InvalidRequestError):
        RayOptions(replicas=0)


def test_build_app_arguments_as_serve_run_passes_them() -> None:
    """``serve run oasr_server.ray_serve:build_app key=value ...`` passes text."""
    from oasr.errors import InvalidRequestError
    from oasr_server.ray_serve import _parse_args

    server, engine, options, grpc = _parse_args({
        "ckpt_dir": "/models/x", "replicas": "3", "gpus_per_replica": "0.5", "device": "cuda",
        "max_batch_size": "8", "max_queue": "9", "warmup": "false", "grpc_bind": ":50051",
    })  # fmt: skip
    assert (options.replicas, options.gpus_per_replica) == (3, 0.5)
    assert (engine.ckpt_dir, engine.device, engine.max_batch_size) == ("/models/x", "cuda", 8)
    assert (server.max_queue, server.warmup, server.max_batch_size) == (9, False, 8)
    assert server.model_aliases == ("whisper-1", "/models/x") and grpc == ":50051"
    with pytest.raises(InvalidRequestError, match="unknown build_app arguments: nope"):
        _parse_args({"ckpt_dir": "/m", "nope": "1"})


def test_merge_metrics_labels_every_sample_with_its_replica() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from oasr_server.metrics import ServerMetrics
    from oasr_server.ray_serve import merge_metrics

    a, b = ServerMetrics(), ServerMetrics()
    a.requests.labels("/v1/audio/transcriptions", "POST", "200").inc(3)
    b.requests.labels("/v1/audio/transcriptions", "POST", "200").inc(4)
    a.ready.set(1)
    text = merge_metrics([("r1", a.render().decode()), ("r2", b.render().decode())]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses: well formed
    assert families["oasr_ray_replicas"].samples[0].value == 2
    counts = {
        s.labels["replica"]: s.value
        for s in families["oasr_requests"].samples
        if s.name == "oasr_requests_total"
    }
    assert counts == {"r1": 3, "r2": 4}
    ready = {s.labels["replica"]: s.value for s in families["oasr_model_ready"].samples}
    assert ready == {"r1": 1, "r2": 0}
    assert text.count("# TYPE oasr_requests_total counter") == 1


def _run_middleware(
    inner: Any, body: bytes, *, client_leaves: bool = False, **kw: Any
) -> tuple[list[dict], int]:
    from oasr_server.ray_serve import ReplicaFailoverMiddleware

    calls = [0]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls[0] += 1
        await inner(calls[0], receive, send)

    async def go() -> list[dict]:
        chunks = [body[:5], body[5:]]
        sent: list[dict] = []

        async def receive() -> dict:
            if chunks:
                part = chunks.pop(0)
                return {"type": "http.request", "body": part, "more_body": bool(chunks)}
            if not client_leaves:
                await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        mw = ReplicaFailoverMiddleware(app, backoff_s=0.01, **kw)
        scope = {
            "type": "http",
            "path": "/v1/audio/transcriptions",
            "method": "POST",
            "headers": [],
        }
        await mw(scope, receive, send)
        return sent

    return asyncio.run(go()), calls[0]


def test_failover_middleware_retries_a_dead_replica_then_answers_503() -> None:
    async def dies_once(call: int, receive: Any, send: Any) -> None:
        msg = await receive()
        assert msg["body"] == b"0123456789" and not msg["more_body"]  # the whole body, each try
        if call == 1:
            return  # the replica died: nothing was sent
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    sent, calls = _run_middleware(dies_once, b"0123456789")
    assert calls == 2 and sent[0]["status"] == 200 and sent[1]["body"] == b"ok"

    async def always_dead(call: int, receive: Any, send: Any) -> None:
        await receive()

    sent, calls = _run_middleware(always_dead, b"0123456789", retries=2)
    assert calls == 3
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 503 and int(headers[b"retry-after"]) >= 1
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"

    async def dies_mid_stream(call: int, receive: Any, send: Any) -> None:
        await receive()
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    async def client_left(call: int, receive: Any, send: Any) -> None:
        await receive()
        assert (await receive())["type"] == "http.disconnect"  # the proxy gives up: no answer

    sent, calls = _run_middleware(client_left, b"0123456789", client_leaves=True)
    assert calls == 1 and sent == []  # a client that left is not retried for

    sent, calls = _run_middleware(dies_mid_stream, b"0123456789")
    assert calls == 1  # an answer that began is never sent twice
    assert b'"replica_unavailable"' in sent[-1]["body"] and sent[-1]["more_body"] is False


# -- one local Ray cluster for the module --------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint() -> str:
    pytest.importorskip("oasr_models_whisper.formats")
    from oasr.defaults import default_checkpoint
    from oasr.errors import UnknownModelError

    try:
        return str(default_checkpoint())
    except UnknownModelError as exc:
        pytest.skip(str(exc))


def _configs(ckpt: str) -> tuple[Any, Any]:
    from oasr.types import EngineConfig
    from oasr_server.config import ServerConfig

    server = ServerConfig(served_model_name=SERVED, model_aliases=("whisper-1", ckpt),
                          max_batch_size=1, decode_processes=0, demo=False,
                          warmup=False)  # fmt: skip
    # one request at a time per replica: a replica holding several is busy for seconds, so the
    # kill below lands while it has work even on a fast machine
    engine = EngineConfig(ckpt_dir=ckpt, device="cpu", max_batch_size=1, num_threads=1)
    return server, engine


def _reference(ckpt: str) -> dict[str, str]:
    """Each clip's transcript from a plain oasr-server app (in-process, over ASGI)."""
    import httpx

    from oasr_server.app import create_app

    server, engine = _configs(ckpt)
    app = create_app(server, engine_config=engine)

    async def go() -> dict[str, str]:
        async with app.router.lifespan_context(app):
            assert await asyncio.to_thread(app.state.oasr.wait_loaded, 120)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
                out = {}
                for name in CLIPS:
                    files = {"file": (name, (SPEECH / name).read_bytes(), "audio/wav")}
                    r = await c.post("/v1/audio/transcriptions", files=files)
                    assert r.status_code == 200, r.text
                    out[name] = r.json()["text"]
                return out

    return asyncio.run(go())


@pytest.fixture(scope="module")
def deployment(checkpoint: str) -> Any:
    """(base URL, reference transcripts): the reference is computed while the replicas load."""
    import ray

    from oasr_server import ray_serve as rs

    port = _free_port()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report attempt from CI
    rs.init_ray(None, num_cpus=2, include_dashboard=False, log_to_driver=False,
                object_store_memory=78 * 1024 * 1024)  # fmt: skip
    try:
        server, engine = _configs(checkpoint)
        layout = rs.deploy(server, engine, rs.RayOptions(replicas=2, cpus_per_replica=0.5),
                           host="127.0.0.1", port=port, grpc_bind="127.0.0.1:0",
                           wait=False)  # fmt: skip
        assert layout.num_replicas == 2 and layout.device == "cpu"
        reference = _reference(checkpoint)
        assert rs.wait_running(rs.APP_NAME, 240), rs.app_message(rs.APP_NAME)
        base = f"http://127.0.0.1:{port}"
        _wait_replicas(base, 2, 30)
        yield base, reference
    finally:
        ray.shutdown()  # the local cluster, Serve with it


@pytest.fixture
def cluster(deployment: tuple[str, dict]) -> str:
    return deployment[0]


@pytest.fixture
def reference(deployment: tuple[str, dict]) -> dict[str, str]:
    return deployment[1]


def _models(base: str) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]


def _wait_replicas(base: str, n: int, timeout: float, exclude: set[str] = frozenset()) -> list:
    """Wait until ``n`` ready replicas (none of ``exclude``) report; their entries."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = [r for r in _models(base)["oasr"]["replicas"] if r["ready"]]
        if len(replicas) == n and not {r["replica"] for r in replicas} & exclude:
            return replicas
        assert time.monotonic() < deadline, f"replicas now: {replicas}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_openai_sdk_on_two_replicas_matches_plain_server(cluster: str, reference: dict) -> None:
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="x", max_retries=0, timeout=60)
    for name in CLIPS:
        with open(SPEECH / name, "rb") as f:
            assert (
                client.audio.transcriptions.create(model="whisper-1", file=f).text
                == (reference[name])
            )
    with open(SPEECH / CLIPS[0], "rb") as f:
        events = list(client.audio.transcriptions.create(model=SERVED, file=f, stream=True))
    *deltas, done = events
    assert done.type == "transcript.text.done" and done.text == reference[CLIPS[0]]
    assert "".join(e.delta for e in deltas) == done.text
    with open(SPEECH / CLIPS[0], "rb") as f, pytest.raises(openai.BadRequestError) as refused:
        client.audio.translations.create(model="whisper-1", file=f)  # tiny.en: English only
    assert refused.value.code == "unsupported_option"

    # the whole deployment, whichever replica answers
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    entry = _models(cluster)
    assert entry["ready"] and entry["oasr"]["name"] == "whisper tiny.en"
    assert len({r["replica"] for r in entry["oasr"]["replicas"]}) == 2
    one = httpx.get(f"{cluster}/v1/models/whisper-1").json()  # retrieve: by an alias
    assert one["id"] == SERVED and len(one["oasr"]["replicas"]) == 2
    missing = httpx.get(f"{cluster}/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    ready = httpx.get(f"{cluster}/readyz").json()
    assert ready == {"status": "ready", "model": SERVED, "replicas": 2, "ready": 2}
    text = httpx.get(f"{cluster}/metrics").text
    assert "oasr_ray_replicas 2.0" in text
    assert len([ln for ln in text.splitlines() if ln.startswith("oasr_model_ready{")]) == 2


@pytest.mark.slow
def test_realtime_websocket_through_the_proxy(cluster: str, reference: dict) -> None:
    from websockets.sync.client import connect

    from oasr.audio import load_audio

    audio = load_audio(str(SPEECH / CLIPS[0]), 24000)
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    url = cluster.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    with connect(url, open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["type"].endswith("session.created")
        ws.send(json.dumps({"type": "transcription_session.update",
                            "session": {"turn_detection": None}}))  # fmt: skip
        for i in range(0, len(pcm), 48000):
            chunk = base64.b64encode(pcm[i : i + 48000]).decode()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while True:
            event = json.loads(ws.recv(timeout=60))
            assert event["type"] != "error", event
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                break
    words = lambda s: "".join(c for c in s.lower() if c.isalpha() or c == " ").split()  # noqa: E731
    assert words(event["transcript"]) == words(reference[CLIPS[0]])


@pytest.mark.slow
def test_grpc_on_each_replica_port(cluster: str, reference: dict) -> None:
    """gRPC goes to a replica's own port (listed in /v1/models): a call, and a stream, stays
    on that replica."""
    import grpc

    from oasr_server.grpc_api import speech_pb2, speech_pb2_grpc

    replicas = _wait_replicas(cluster, 2, 30)
    addresses = {r["grpc"] for r in replicas}
    assert len(addresses) == 2 and None not in addresses
    audio = (SPEECH / CLIPS[1]).read_bytes()
    for address in sorted(addresses):
        with grpc.insecure_channel(address) as channel:
            answer = speech_pb2_grpc.SpeechStub(channel).Recognize(
                speech_pb2.RecognizeRequest(audio=audio), timeout=60
            )
        assert answer.text == reference[CLIPS[1]]


def _busy_replica(base: str, replicas: list[dict], timeout: float) -> dict:
    """The first of ``replicas`` whose last report shows two or more requests in its engine or
    queue (one running, at least one waiting)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        busy: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name in ("oasr_engine_in_flight", "oasr_queue_depth"):
                for s in family.samples:
                    busy[s.labels["replica"]] = busy.get(s.labels["replica"], 0) + s.value
        for r in replicas:
            if busy.get(r["replica"], 0) >= 2:
                return r
        time.sleep(0.2)
    raise AssertionError("no replica reported work in flight")


@pytest.mark.slow
def test_replica_killed_mid_load_is_replaced_and_no_request_is_lost(
    cluster: str, reference: dict
) -> None:
    import httpx
    import ray

    before = _wait_replicas(cluster, 2, 30)
    sent = 12
    results: list[Any] = [None] * sent

    def one(i: int) -> None:
        name = CLIPS[i % len(CLIPS)]
        files = {"file": (name, (SPEECH / name).read_bytes(), "audio/wav")}
        try:
            results[i] = httpx.post(f"{cluster}/v1/audio/transcriptions", files=files, timeout=120)
        except Exception as exc:  # noqa: BLE001 - counted as lost below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(sent)]
    for t in threads:
        t.start()
    victim = _busy_replica(cluster, before, 60)  # holds requests in its engine or queue now
    ray.kill(ray.get_actor(victim["actor"], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(180)

    ok = unavailable = retried = 0
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), f"request {i} lost: {r!r}"
        if r.status_code == 200:
            assert r.json()["text"] == reference[CLIPS[i % len(CLIPS)]]
            ok += 1
            retried += int(r.headers.get("x-oasr-attempts", 1)) > 1
        else:
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] in ("replica_unavailable", "overloaded")
            unavailable += 1
    assert ok + unavailable == sent
    assert ok > 0
    assert retried + unavailable > 0  # the kill did hit requests in flight on that replica
    # Serve starts a new replica in its place; the registry drops the dead one
    after = _wait_replicas(cluster, 2, 90, exclude={victim["replica"]})
    assert {r["replica"] for r in after} & {r["replica"] for r in before}
    with open(SPEECH / CLIPS[1], "rb") as f:
        r = httpx.post(
            f"{cluster}/v1/audio/transcriptions", files={"file": (CLIPS[1], f)}, timeout=60
        )
    assert r.status_code == 200 and r.json()["text"] == reference[CLIPS[1]]
    print(f"after the kill: {ok} answered ({retried} retried), {unavailable} 503, of {sent}")
