"""Issue #26 item 5: a window's decoding work is bounded, whatever the temperatures asked.

The server cuts a request's temperature schedule to ``1 + --max-fallback-rounds`` temperatures
(default 2) and gives short clips a token budget per window (``--max-tokens-per-second``), so a
window costs at most ``(1 + rounds) x budget`` sampled tokens. Checked with the real tiny.en on
the worst input that passes the speech gate: 1 s of loud noise decoded ungated, with a prompt:
sixteen temperatures of 1.0 sample at most 3 x 64 tokens, and sixteen greedy rounds (each one
repeats the same failing window, the most work a schedule can ask) sample exactly three times
one round's tokens. Before the cap those could sample 16 x 64 tokens (16 x 224 without the
budget; the default six-round schedule without either sampled 702 tokens here, 138 with both).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the real tiny.en


def test_fallback_rounds_are_capped_by_the_server() -> None:
    pytest.importorskip("oasr_models_whisper")
    from oasr.defaults import default_checkpoint
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig
    from oasr_server.app import ServerState
    from oasr_server.config import ServerConfig

    try:
        ckpt = str(default_checkpoint())
    except Exception as exc:  # noqa: BLE001 - no default model on this machine
        pytest.skip(f"default model unavailable: {exc}")
    engine = ASREngine(EngineConfig(ckpt_dir=ckpt, device="cpu"))
    try:
        noise = np.random.default_rng(1).standard_normal(16000).astype(np.float32) * 0.3
        asked = DecodingOptions.build(
            temperature=(1.0,) * 16, prompt="lorem ipsum dolor sit amet " * 8, vad_gate=False
        )
        state = ServerState(ServerConfig(), engine=engine)
        bounded = state.bounded_options(asked, noise)
        assert bounded.temperatures == (1.0, 1.0, 1.0) and bounded.max_new_tokens == 64
        uncapped = ServerState(ServerConfig(max_fallback_rounds=None), engine=engine)
        assert len(uncapped.bounded_options(asked, noise).temperatures) == 16
        # the client's own short schedule is untouched
        assert state.bounded_options(DecodingOptions(temperature=(0.0, 0.5)), noise).temperatures == (0.0, 0.5)

        executor = engine.scheduler.executor

        def sampled(options: DecodingOptions) -> tuple[int, float]:
            before, t0 = executor.stats["tokens"], time.monotonic()
            engine.transcribe_arrays([noise], options)
            return executor.stats["tokens"] - before, time.monotonic() - t0

        hot, took = sampled(bounded)
        # the worst case: a schedule of greedy rounds repeats the same failing window each round
        greedy = DecodingOptions.build(temperature=0.0, prompt=asked.prompt, vad_gate=False)
        one, _ = sampled(state.bounded_options(greedy, noise))
        zeros = state.bounded_options(DecodingOptions.build(
            temperature=(0.0,) * 16, prompt=asked.prompt, vad_gate=False), noise)  # fmt: skip
        assert zeros.temperatures == (0.0,) * 3
        cold, took_cold = sampled(zeros)
    finally:
        engine.shutdown()
    assert 0 < hot <= 3 * 64, hot  # three rounds at most, each within its budget
    assert 0 < one <= 64 and cold == 3 * one, (one, cold)  # every round ran, and only three
    assert took < 30 and took_cold < 30, (took, took_cold)
