"""Issue #26 item 5: decoding work follows the audio's length. An autoregressive model gets a
token budget per window from the clip's duration (``--max-tokens-per-second``) unless the client
set ``max_new_tokens``; other families are untouched. The bound against the real tiny.en:
a 1 s clip of noise with a prompt cannot run a full window of tokens in every fallback round."""

from __future__ import annotations

import time

import numpy as np
import pytest


def continuous(kit) -> object:
    """The in-test AED model behind an executor that is not the ``BatchExecutor`` (as
    Whisper's and Qwen2-Audio's continuous executors: per-request budgets do not split
    batches there)."""
    from oasr.scheduler import BatchExecutor

    class Rows:
        def __init__(self, model: object) -> None:
            self.inner = BatchExecutor(model, 8)

        @property
        def num_running(self) -> int:
            return self.inner.num_running

        def try_admit(self, request: object) -> bool:
            return self.inner.try_admit(request)

        def step(self) -> list:
            return self.inner.step()

        def abort(self, request: object) -> bool:
            return self.inner.abort(request)

    class Model(kit.FakeModel):
        def make_executor(self, config: object) -> Rows:
            return Rows(self)

    return Model()


def test_short_clips_get_a_token_budget(kit, app_factory) -> None:
    app, model = app_factory(model=continuous(kit))

    async def go():
        async with kit.serving(app) as c:
            for seconds in (1.0, 4.0, 12.0):
                r = await kit.post_audio(c, audio=kit.wav_bytes(seconds))
                assert r.status_code == 200, r.text
            r = await kit.post_audio(c, audio=kit.wav_bytes(1.0), fields={"max_new_tokens": "200"})
            assert r.status_code == 200, r.text

    kit.run(go())
    budgets = [o.max_new_tokens for o in model.options[-4:]]
    # 32 + 20/s, rounded up to 32; none past 224 (the model's own budget); the client's own wins
    assert budgets == [64, 128, None, 200]


def test_other_families_and_zero_keep_the_model_budget(kit, app_factory) -> None:
    from oasr.types import DecodeFamily, ModelCapabilities

    ctc = continuous(kit)
    ctc.capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)
    app, _ = app_factory(model=ctc)
    off, aed = app_factory(model=continuous(kit), max_tokens_per_second=0)
    batch, batched = app_factory()  # the BatchExecutor: budgets would split its batches

    async def go():
        async with kit.serving(app) as c:
            assert (await kit.post_audio(c, audio=kit.wav_bytes(1.0))).status_code == 200
        async with kit.serving(off) as c:
            assert (await kit.post_audio(c, audio=kit.wav_bytes(1.0))).status_code == 200
        async with kit.serving(batch) as c:
            assert (await kit.post_audio(c, audio=kit.wav_bytes(1.0))).status_code == 200

    kit.run(go())
    assert ctc.options[-1].max_new_tokens is None
    assert aed.options[-1].max_new_tokens is None
    assert batched.options[-1].max_new_tokens is None


@pytest.mark.slow  # the real tiny.en
def test_expensive_input_costs_what_its_length_does() -> None:
    from oasr.defaults import default_checkpoint
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig
    from oasr_server.app import ServerState
    from oasr_server.config import ServerConfig

    engine = ASREngine(EngineConfig(ckpt_dir=str(default_checkpoint()), device="cpu"))
    state = ServerState(ServerConfig(), engine=engine)
    noise = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.3
    opts = DecodingOptions(prompt="lorem ipsum dolor sit amet " * 8, temperature=(0.0, 0.5, 1.0))
    bounded = state.bounded_options(opts, noise)
    assert bounded.max_new_tokens == 64
    try:
        t0 = time.monotonic()
        out = engine.transcribe_arrays([noise], bounded)[0]
        took = time.monotonic() - t0
    finally:
        engine.shutdown()
    tokens = sum(len(s.tokens) for s in out.segments)
    assert tokens <= 64, tokens  # one window: at most its budget (every round is bounded)
    assert took < 30, took
