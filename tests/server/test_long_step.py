"""Issue #26 item 4: a long scheduler step does not hold everyone. An abort of a running request
is answered at once (the executor frees it before the next step), so a client that leaves
while the engine is busy with a long step stops counting as in flight right away."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from oasr.scheduler import RequestAbortedError


def test_abort_during_a_long_step_is_answered_at_once(kit) -> None:
    gate = threading.Event()
    model = kit.FakeModel(gate=gate)
    engine = kit.make_engine(model)
    try:
        audio = [np.zeros(16000, "float32")]
        (busy,) = engine.submit_many(audio)
        assert model.calls_started.acquire(timeout=10)  # the step is inside the model now
        t0 = time.monotonic()
        assert engine.abort(busy.rid) is True
        took = time.monotonic() - t0
        with pytest.raises(RequestAbortedError):
            busy.result(timeout=1)
        assert took < 0.5, took  # not after the step
        gate.set()
        # the engine keeps serving, the aborted request is gone from it
        again: Future = engine.submit(np.zeros(8000, "float32"))
        assert again.result(timeout=10).text == "hello world 0.50"
        sched = engine.scheduler
        deadline = time.monotonic() + 5
        while sched.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.num_running == 0 and sched.executor.num_running == 0
    finally:
        gate.set()
        engine.shutdown()


def test_client_gone_during_a_long_step_frees_its_slot(kit, app_factory) -> None:
    gate = threading.Event()
    app, model = app_factory(model=kit.FakeModel(gate=gate), warmup=False)
    state = app.state.oasr

    async def go():
        async with kit.serving(app):
            worker = state.worker
            engine = state.engine
            job = worker.submit(np.zeros(16000, "float32"), _opts())
            await asyncio.to_thread(model.calls_started.acquire, True, 10)
            assert worker.in_flight == 1
            t0 = time.monotonic()
            worker.abandon(job)  # the client left (as state.transcribe does)
            while worker.in_flight and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.01)
            freed = time.monotonic() - t0
            gate.set()
            return freed, engine

    freed, _ = kit.run(go())
    assert freed < 1.0, freed  # while the step still ran (the gate opened after)


def _opts():
    from oasr.types import DecodingOptions

    return DecodingOptions()
