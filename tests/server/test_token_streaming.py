"""Token-streaming partials through the OpenAI routes' ``stream=true`` SSE: a model whose executor
streams its text piece by piece (as the speech-LLM's does) reaches the client delta by delta while
it decodes; models without partials keep word deltas of the final text."""

from __future__ import annotations

import json
import threading
from typing import Any

from oasr.scheduler import Request
from oasr.types import Segment, Transcript

RATE = 16000
PIECES = ["hel", "lo", " stream", "ing", " wor", "ld"]


class PieceExecutor:
    """A continuous executor that decodes one piece per step for every admitted request and
    hands it to ``request.on_partial``. With ``wait_sent`` it holds the next piece until the test
    saw the previous one leave the server (so deltas provably go out while decoding)."""

    def __init__(self, wait_sent: Any = None, fail_after: int | None = None) -> None:
        self._rows: dict[str, tuple[Request, int]] = {}
        self.wait_sent = wait_sent
        self.fail_after = fail_after
        self.finished_after_sent: list[bool] = []

    @property
    def num_running(self) -> int:
        return len(self._rows)

    def try_admit(self, request: Request) -> bool:
        self._rows[request.rid] = (request, 0)
        return True

    def abort(self, request: Request) -> bool:
        return self._rows.pop(request.rid, None) is not None

    def step(self) -> list[tuple[Request, Transcript | BaseException]]:
        done: list[tuple[Request, Transcript | BaseException]] = []
        for rid, (req, k) in list(self._rows.items()):
            if k and self.wait_sent is not None and req.on_partial is not None:
                self.finished_after_sent.append(self.wait_sent(PIECES[k - 1]))
            if self.fail_after == k and req.on_partial is not None:
                del self._rows[rid]
                done.append((req, RuntimeError("decoder blew up mid-stream")))
                continue
            if k < len(PIECES):
                if req.on_partial is not None:
                    req.on_partial(PIECES[k])
                self._rows[rid] = (req, k + 1)
                continue
            del self._rows[rid]
            dur = req.num_samples / RATE
            text = "".join(PIECES)
            done.append((req, Transcript(text=text, language="en", duration=dur,
                                         segments=[Segment(0, 0.0, dur, text)])))  # fmt: skip
        return done


def piece_model(kit, executor: PieceExecutor) -> Any:
    """The server tests' fake model, with ``executor`` as its continuous executor."""

    class PieceModel(kit.FakeModel):
        def make_executor(self, config: Any) -> PieceExecutor:
            return executor

    return PieceModel()


class SentRecorder:
    """ASGI wrapper: notes every SSE delta the app sends, so the executor can wait for it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state
        self.router = app.router
        self.sent: list[str] = []
        self.cond = threading.Condition()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def spy(message: Any) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                for block in message["body"].decode().split("\n\n"):
                    if block.startswith("data: "):
                        event = json.loads(block[6:])
                        if event["type"] == "transcript.text.delta":
                            with self.cond:
                                self.sent.append(event["delta"])
                                self.cond.notify_all()
            await send(message)

        await self.app(scope, receive, spy)

    def wait_sent(self, piece: str) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: piece in self.sent, timeout=5)


def _events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(b[len("data: ") :]) for b in raw.strip().split("\n\n")]


def _serve(kit, app_factory, executor: PieceExecutor):
    app, _ = app_factory(model=piece_model(kit, executor))
    return app


def test_sse_deltas_leave_while_the_model_decodes(kit, app_factory) -> None:
    executor = PieceExecutor()
    app = _serve(kit, app_factory, executor)
    spy = SentRecorder(app)
    executor.wait_sent = spy.wait_sent

    async def go():
        async with kit.serving(app):
            import httpx

            transport = httpx.ASGITransport(app=spy)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                r = await kit.post_audio(c, audio=kit.wav_bytes(1.0), fields={"stream": "true"})
                plain = await kit.post_audio(c, audio=kit.wav_bytes(1.0))
            return r, plain

    r, plain = kit.run(go())
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    *deltas, done = _events(r.text)
    assert [e["type"] for e in deltas] == ["transcript.text.delta"] * len(PIECES)
    # the model's own pieces, not word deltas cut from the final text
    assert [e["delta"] for e in deltas] == PIECES
    assert done["type"] == "transcript.text.done" and done["text"] == "hello streaming world"
    assert "".join(e["delta"] for e in deltas) == done["text"]
    assert done["usage"] == {"type": "duration", "seconds": 1.0}
    # each piece had left the server before the model decoded the next one
    assert executor.finished_after_sent and all(executor.finished_after_sent)
    # without stream the same model answers once
    assert plain.status_code == 200 and plain.json()["text"] == "hello streaming world"


def test_sse_failure_mid_stream_is_an_error_event(kit, app_factory) -> None:
    app = _serve(kit, app_factory, PieceExecutor(fail_after=2))

    async def go():
        async with kit.serving(app) as c:
            r = await kit.post_audio(c, audio=kit.wav_bytes(1.0), fields={"stream": "true"})
            after = await kit.post_audio(c, audio=kit.wav_bytes(1.0))
            metrics = (await c.get("/metrics")).text
            return r, after, metrics

    r, after, metrics = kit.run(go())
    assert r.status_code == 200
    *deltas, err = _events(r.text)
    assert [e["delta"] for e in deltas] == PIECES[:2]
    assert err["type"] == "error" and err["error"]["code"] == "engine_error"
    assert "blew up" not in err["error"]["message"]  # details stay in the log
    assert after.status_code == 200  # the server keeps serving (this executor fails streams only)
    assert 'code="engine_error"' in metrics


def test_sse_without_partials_keeps_word_deltas(kit, app_factory) -> None:
    app, _ = app_factory()  # the batch executor: no partials

    async def go():
        async with kit.serving(app) as c:
            return await kit.post_audio(c, audio=kit.wav_bytes(2.0), fields={"stream": "true"})

    *deltas, done = _events(kit.run(go()).text)
    assert [e["delta"] for e in deltas] == ["hello", " world", " 2.00"]
    assert done["text"] == "hello world 2.00"
