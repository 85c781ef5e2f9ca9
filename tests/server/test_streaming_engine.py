"""``--service-mode streaming``: the realtime WebSocket and gRPC ``StreamingRecognize`` feed each
turn to the engine as its audio arrives (one engine streaming request per turn, stepped by the
server's ``StreamingEngineLoop``), with the bundled random-weight WeNet checkpoint on real speech.

Every final text is checked against the in-process ``ASREngine(service_mode="streaming")`` fed
the same audio (random weights give garbage text, but deterministic garbage), every turn's
deltas against its final, and every end path (completed, clear, disconnect, idle close, gRPC
cancel) against ``/metrics`` (``oasr_engine_streams`` and ``oasr_streams_active`` back to 0)
and the engine itself (it holds no stream afterwards).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("oasr_models_wenet")
torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
# conv2d6 subsampling: one model chunk is 0.96 s, and the random weights emit a growing text
CKPT = REPO / "tests" / "data" / "wenet" / "u2_conformer_conv2d6"
SPEECH = REPO / "tests" / "data" / "speech"
RATE = 16000
LONG = "en_ls_1221-135766-0002.wav"  # 4.8 s
SHORT = ("en_ls_2830-3980-0043.wav", "en_ls_4507-16021-0012.wav")  # 2.0 s, 2.7 s
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Many tiny model steps: one intra-op thread is fastest on the 2-core test machines (the
    server's engine threads start after this and pick it up)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# -- audio and the reference engine ----------------------------------------------------------


def speech(name: str) -> np.ndarray:
    """A clip at 16 kHz, quantised as pcm16 travels (so the server sees exactly these samples)."""
    from oasr.audio import load_audio

    return from_pcm(pcm16(load_audio(str(SPEECH / name), RATE)))


def pcm16(x: np.ndarray) -> bytes:
    # the inverse of from_pcm: a quantised signal round-trips exactly
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()


def from_pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


_REFERENCE: list[Any] = []


def engine_text(audio: np.ndarray, chunk: int = 2400) -> str:
    """The final text of the in-process streaming engine fed ``audio`` chunk by chunk."""
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig

    if not _REFERENCE:
        _REFERENCE.append(ASREngine(EngineConfig(ckpt_dir=str(CKPT), service_mode="streaming")))
    engine = _REFERENCE[0]
    rid = engine.add_streaming_request(DecodingOptions())
    outputs = []
    for i in range(0, len(audio), chunk):
        engine.feed_chunk(rid, audio[i : i + chunk], is_last=i + chunk >= len(audio))
        outputs += engine.step()
    while not any(o.is_final for o in outputs):
        outputs += engine.step()
    engine.abort(rid)
    return next(o.text for o in outputs if o.is_final)


# -- servers ---------------------------------------------------------------------------------


def streaming_app(**cfg: Any) -> Any:
    from oasr.types import EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    cfg.setdefault("warmup", False)
    return create_app(
        ServerConfig(**cfg),
        engine_config=EngineConfig(ckpt_dir=str(CKPT), service_mode="streaming"),
    )


def metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def engine_holds(app: Any) -> int:
    """Streams the engine's scheduler still keeps (finished ones included: a final that was
    never released would show here)."""
    return len(app.state.oasr.engine.streaming._streams)


def wait_released(get_metrics: Callable[[], str], app: Any, api: str) -> str:
    """Poll until no stream is left anywhere (the loop thread applies aborts asynchronously)."""
    deadline = time.monotonic() + 10
    while True:
        text = get_metrics()
        if (
            metric(text, "oasr_engine_streams") == 0
            and metric(text, "oasr_streams_active", api=api) == 0
            and engine_holds(app) == 0
            and metric(text, "oasr_stream_cache", kind="streams") == 0  # cache slots freed
        ):
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.05)


# -- realtime WebSocket ----------------------------------------------------------------------


@pytest.fixture
def realtime() -> Any:
    """``realtime(**config)`` -> (TestClient, app), in streaming mode, closed afterwards."""
    from starlette.testclient import TestClient

    clients = []

    def build(**cfg: Any) -> tuple[Any, Any]:
        app = streaming_app(**cfg)
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        assert app.state.oasr.wait_loaded(30), app.state.oasr.load_error
        assert app.state.oasr.stream_engine is not None and app.state.oasr.stream_engine.running
        return client, app

    yield build
    for client in clients:
        client.__exit__(None, None, None)


def open_session(client: Any, turn_detection: Any = None) -> Any:
    ws = client.websocket_connect("/v1/realtime?intent=transcription").__enter__()
    assert ws.receive_json()["type"] == "session.created"
    ws.send_json(
        {
            "type": "transcription_session.update",
            "session": {"input_audio_sample_rate": RATE, "turn_detection": turn_detection},
        }
    )
    assert ws.receive_json()["type"] == "session.updated"
    return ws


def append(ws: Any, audio: np.ndarray, step_s: float = 0.1) -> None:
    data = pcm16(audio)
    step = int(step_s * RATE) * 2
    for i in range(0, len(data), step):
        ws.send_json(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(data[i : i + step]).decode(),
            }
        )


def receive_until(ws: Any, kind: str, count: int = 1) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while sum(e["type"] == kind for e in events) < count:
        event = ws.receive_json()
        assert event["type"] != "error", event
        events.append(event)
        assert len(events) < 500, events[-5:]
    return events


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def check_deltas(events: list[dict[str, Any]], item_id: str, transcript: str) -> list[str]:
    """The item's deltas: they come before its completed event and concatenate to its
    transcript (the greedy CTC final of this model never revises its partials)."""
    deltas = [e["delta"] for e in events if e["type"] == DELTA and e["item_id"] == item_id]
    done = next(
        i for i, e in enumerate(events) if e["type"] == COMPLETED and e["item_id"] == item_id
    )
    last = max(i for i, e in enumerate(events) if e["type"] == DELTA and e["item_id"] == item_id)
    assert last < done
    assert all(deltas) and "".join(deltas) == transcript
    return deltas


def test_realtime_manual_turn_streams_through_the_engine(realtime) -> None:
    client, app = realtime(partial_interval_ms=500)
    audio = speech(LONG)
    half = len(audio) // 2
    ws = open_session(client)
    try:
        append(ws, audio[:half])
        # a delta arrives while the turn is still open and half of its audio not even sent
        early = receive_until(ws, DELTA)
        metrics = client.get("/metrics").text
        assert metric(metrics, "oasr_engine_streams") == 1
        append(ws, audio[half:])
        ws.send_json({"type": "input_audio_buffer.commit"})
        events = early + receive_until(ws, COMPLETED)
    finally:
        ws.__exit__(None, None, None)
    (completed,) = of(events, COMPLETED)
    assert completed["transcript"] == engine_text(audio)
    assert completed["transcript"]  # the random model says something on this clip
    deltas = check_deltas(events, completed["item_id"], completed["transcript"])
    assert len(deltas) >= 3  # one per model chunk as the text grows, not one at the end
    text = wait_released(lambda: client.get("/metrics").text, app, "realtime")
    # nothing was re-transcribed through the engine worker's queue
    assert metric(text, "oasr_queue_wait_seconds_count") == 0
    assert metric(text, "oasr_batch_size_count") > 0  # the engine loop's steps


def test_realtime_server_vad_turns(realtime) -> None:
    """Server VAD cuts two turns; each is fed to the engine while it is spoken and answered
    in order, with deltas ahead of its final."""
    client, app = realtime(partial_interval_ms=500)
    a, b = speech(SHORT[0]), speech(SHORT[1])
    audio = np.concatenate([silence(0.5), a, silence(1.5), b, silence(1.0)])
    ws = open_session(client, {"type": "server_vad"})
    try:
        append(ws, audio)
        events = receive_until(ws, COMPLETED, 2)
    finally:
        ws.__exit__(None, None, None)
    completed = of(events, COMPLETED)
    items = [e["item_id"] for e in of(events, "input_audio_buffer.committed")]
    assert [e["item_id"] for e in completed] == items and len(items) == 2
    for event in completed:
        assert event["transcript"]
        check_deltas(events, event["item_id"], event["transcript"])
    wait_released(lambda: client.get("/metrics").text, app, "realtime")


def test_realtime_clear_garbage_and_next_turn(realtime) -> None:
    """``clear`` aborts the open turn's engine stream; garbage in the middle of a turn leaves
    it alone; the next turn is recognised from its own audio only."""
    client, app = realtime(partial_interval_ms=500)
    first, second = speech(SHORT[0]), speech(LONG)
    ws = open_session(client)
    try:
        append(ws, first)
        receive_until(ws, DELTA)
        ws.send_json({"type": "input_audio_buffer.clear"})
        receive_until(ws, "input_audio_buffer.cleared")
        wait_engine = time.monotonic() + 10
        while metric(client.get("/metrics").text, "oasr_engine_streams") != 0:
            assert time.monotonic() < wait_engine
            time.sleep(0.05)
        append(ws, second[: len(second) // 2])
        ws.send_text("this is not json")
        events = []
        while not events or events[-1]["type"] != "error":
            events.append(ws.receive_json())
        assert events.pop()["error"]["code"] == "invalid_json"
        append(ws, second[len(second) // 2 :])
        ws.send_json({"type": "input_audio_buffer.commit"})
        events += receive_until(ws, COMPLETED)
    finally:
        ws.__exit__(None, None, None)
    (completed,) = of(events, COMPLETED)
    assert completed["transcript"] == engine_text(second)
    check_deltas(events, completed["item_id"], completed["transcript"])
    wait_released(lambda: client.get("/metrics").text, app, "realtime")


@pytest.mark.parametrize("end", ["disconnect", "idle_timeout"])
def test_realtime_stream_released_when_the_session_ends(realtime, end: str) -> None:
    client, app = realtime(partial_interval_ms=500, realtime_idle_timeout=1.5)
    ws = open_session(client)
    try:
        append(ws, speech(LONG)[: 3 * RATE])
        receive_until(ws, DELTA)
        assert metric(client.get("/metrics").text, "oasr_engine_streams") == 1
        if end == "idle_timeout":
            event = ws.receive_json()
            while event["type"] == DELTA:
                event = ws.receive_json()
            assert event["type"] == "error" and event["error"]["code"] == "idle_timeout"
    finally:
        ws.__exit__(None, None, None)
    wait_released(lambda: client.get("/metrics").text, app, "realtime")


# -- gRPC StreamingRecognize -----------------------------------------------------------------


def test_grpc_streams(kit) -> None:
    """Interim results while audio is still being sent and a final equal to the engine's;
    VAD utterances equal to the engine on their spans; four concurrent streams equal to one
    at a time; a cancelled call releases its engine stream."""
    grpc = pytest.importorskip("grpc")
    from oasr_server.grpc_api import speech_pb2 as pb
    from oasr_server.grpc_api import speech_pb2_grpc

    app = streaming_app(grpc_bind="127.0.0.1:0", partial_interval_ms=500)

    def config(vad: bool = False, interim: bool = True) -> Any:
        return pb.StreamingRecognizeRequest(
            streaming_config=pb.StreamingRecognitionConfig(
                config=pb.RecognitionConfig(encoding=pb.PCM_S16LE, sample_rate_hertz=RATE),
                interim_results=interim,
                voice_activity=pb.VoiceActivityConfig(enabled=vad),
            )
        )

    async def requests(audio: np.ndarray, vad: bool = False, pause: asyncio.Queue | None = None):
        yield config(vad)
        data = pcm16(audio)
        half = len(data) // 2
        for piece, at in ((data[:half], 0), (data[half:], half)):
            for i in range(0, len(piece), 3200):
                yield pb.StreamingRecognizeRequest(audio_content=piece[i : i + 3200])
            if pause is not None and at == 0:
                await pause.get()  # hold the second half back until an interim result came

    async def go() -> None:
        async with kit.serving(app) as client:

            async def get_metrics() -> str:
                return (await client.get("/metrics")).text

            port = app.state.grpc_server.oasr_port
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = speech_pb2_grpc.SpeechStub(channel)
                # interim results before the second half of the audio is sent
                long_audio = speech(LONG)
                pause: asyncio.Queue = asyncio.Queue()
                results = []
                async for r in stub.StreamingRecognize(requests(long_audio, pause=pause)):
                    results.append(r.result)
                    if not r.result.is_final and pause.empty() and len(results) == 1:
                        pause.put_nowait(None)
                *interim, final = results
                assert interim and not any(r.is_final for r in interim) and final.is_final
                assert final.text == engine_text(long_audio)
                for r in interim:
                    assert r.text.startswith(r.stable_text) and final.text.startswith(r.stable_text)

                # server VAD: each utterance equals the engine on the utterance's own span
                a, b = speech(SHORT[0]), speech(SHORT[1])
                two = np.concatenate([silence(0.5), a, silence(1.5), b, silence(0.5)])
                finals = [
                    r.result
                    async for r in stub.StreamingRecognize(requests(two, vad=True))
                    if r.result.is_final
                ]
                assert [f.utterance_index for f in finals] == [0, 1]
                for f in finals:
                    span = two[round(f.start * RATE) : round(f.end * RATE)]
                    assert f.text == engine_text(span)

                # four streams at once give what each gives alone
                clips = [speech(n) for n in (*SHORT, LONG, SHORT[0])]

                async def final_text(audio: np.ndarray) -> str:
                    calls = stub.StreamingRecognize(requests(audio))
                    return [r.result.text async for r in calls if r.result.is_final][-1]

                together = await asyncio.gather(*(final_text(c) for c in clips))
                assert list(together) == [engine_text(c) for c in clips]

                # a cancelled call releases its engine stream
                call = stub.StreamingRecognize(requests(long_audio, pause=asyncio.Queue()))
                async for r in call:
                    if not r.result.is_final:
                        break
                assert metric(await get_metrics(), "oasr_engine_streams") == 1
                call.cancel()

            deadline = time.monotonic() + 10
            while True:
                text = await get_metrics()
                released = (
                    metric(text, "oasr_engine_streams") == 0
                    and metric(text, "oasr_streams_active", api="grpc") == 0
                    and engine_holds(app) == 0
                )
                if released:
                    break
                assert time.monotonic() < deadline, text
                await asyncio.sleep(0.05)
            assert metric(text, "oasr_queue_wait_seconds_count") == 0

    kit.run(go())


# -- the engine loop itself ------------------------------------------------------------------


def test_engine_loop_batches_concurrent_streams() -> None:
    """Streams whose chunks are ready together go through one ``engine.step`` (one model call);
    each still gets exactly what it gets alone, and leaves the engine with its final."""
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig
    from oasr_server.stream_worker import StreamingEngineLoop

    engine = ASREngine(EngineConfig(ckpt_dir=str(CKPT), service_mode="streaming"))
    sizes: list[int] = []
    loop = StreamingEngineLoop(engine, on_batch=lambda n, _s: sizes.append(n))
    clips = [speech(n) for n in (*SHORT, LONG)]
    partials: list[list[str]] = [[] for _ in clips]

    async def go() -> list[str]:
        streams = []
        for k, clip in enumerate(clips):
            stream = loop.open(DecodingOptions(), partials[k].append)
            loop.feed(stream, clip, is_last=True)
            streams.append(stream)
        loop.start()  # every stream is ready before the first step
        try:
            finals = await asyncio.wait_for(asyncio.gather(*(s.final for s in streams)), 30)
        finally:
            loop.stop()
        return [t.text for t in finals]

    texts = asyncio.run(go())
    assert texts == [engine_text(c) for c in clips]
    assert sizes[0] == len(clips)
    assert all(p for p in partials)
    assert loop.open_streams == 0 and not engine.streaming._streams


def test_engine_loop_stop_fails_open_streams() -> None:
    """Shutting down ends every stream the engine still holds with ``model_not_ready``."""
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig
    from oasr_server.errors import NotReadyError
    from oasr_server.stream_worker import StreamingEngineLoop

    engine = ASREngine(EngineConfig(ckpt_dir=str(CKPT), service_mode="streaming"))
    loop = StreamingEngineLoop(engine)

    async def go() -> None:
        loop.start()
        stream = loop.open(DecodingOptions(), lambda _text: None)
        loop.feed(stream, speech(SHORT[0])[:RATE])
        await asyncio.sleep(0.2)
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)
        with pytest.raises(NotReadyError):
            await asyncio.wait_for(stream.final, 5)
        late = loop.open(DecodingOptions(), lambda _text: None)
        with pytest.raises(NotReadyError):
            await late.final

    asyncio.run(go())
    assert loop.open_streams == 0 and not engine.streaming._streams


def test_uploads_beside_live_streams_give_unchanged_answers(realtime) -> None:
    """In streaming mode HTTP uploads take the batch path (``model.transcribe``) on the same
    model that the stream loop steps in its own thread. Run both at once: neither may change
    the other's answers."""
    import threading

    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    client, app = realtime()
    path = SPEECH / SHORT[1]
    clip = path.read_bytes()

    def upload() -> str:
        r = client.post("/v1/audio/transcriptions", files={"file": (path.name, clip, "audio/wav")})
        assert r.status_code == 200, r.text
        return r.json()["text"]

    offline = ASREngine(EngineConfig(ckpt_dir=str(CKPT))).submit(str(path)).result().text
    alone = upload()
    assert alone == offline and alone  # the batch path is the offline model's answer
    answers: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def keep_uploading() -> None:
        try:
            while not stop.is_set():
                answers.append(upload())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    uploader = threading.Thread(target=keep_uploading)
    uploader.start()
    finals: list[tuple[str, np.ndarray]] = []
    try:
        for audio in (speech(LONG), speech(SHORT[0])):
            ws = open_session(client)
            try:
                append(ws, audio)
                ws.send_json({"type": "input_audio_buffer.commit"})
                (completed,) = of(receive_until(ws, COMPLETED), COMPLETED)
            finally:
                ws.__exit__(None, None, None)
            finals.append((completed["transcript"], audio))
    finally:
        stop.set()
        uploader.join(60)
    assert not errors, errors
    assert len(answers) >= 2 and set(answers) == {alone}
    for text, audio in finals:
        assert text == engine_text(audio)
    wait_released(lambda: client.get("/metrics").text, app, "realtime")
