"""The server reaches the engine through its public API only, and every upload goes through the
engine's scheduler (the one batching layer)."""

from __future__ import annotations

import asyncio
from typing import Any


class PublicOnly:
    """Forwards an engine's public attributes and fails on any private one."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.used: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AssertionError(f"the server reached into the engine's private {name!r}")
        self.used.add(name)
        return getattr(self._engine, name)


def test_server_uses_only_the_public_engine_api(kit) -> None:
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    model = kit.FakeModel()
    engine = PublicOnly(kit.make_engine(model, max_batch_size=4))
    app = create_app(ServerConfig(served_model_name="fake"), engine=engine)  # type: ignore[arg-type]

    async def go() -> list[Any]:
        async with kit.serving(app) as client:
            # BatchExecutor: one batch runs while the next gathers in the engine's scheduler
            assert app.state.oasr.worker.max_concurrency == 2 * 4
            model.batches.clear()
            return await asyncio.gather(
                *(kit.post_audio(client, audio=kit.wav_bytes(s)) for s in (0.5, 1.0, 1.5))
            )

    answers = kit.run(go())
    assert [a.json()["text"] for a in answers] == [f"hello world {s:.2f}" for s in (0.5, 1.0, 1.5)]
    assert "submit_many" in engine.used and "scheduler" in engine.used
    assert sum(model.batches) == 3 and max(model.batches) <= 4
    assert engine.scheduler.step_count > 0  # the uploads ran as scheduler steps
