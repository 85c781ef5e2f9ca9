"""Smoke run of the server load test: the real ``oasr-server`` process with the real Whisper
tiny.en, 4 uploads at concurrency 4 plus one realtime stream, every answer checked against the
in-process engine (``benchmarks/serverbench.py``)."""

from __future__ import annotations

import pytest

#: benchmark smoke runs: skipped by `scripts/test.sh --fast`, run by CI
pytestmark = pytest.mark.slow


def test_serverbench_smoke() -> None:
    pytest.importorskip("oasr_models_whisper")
    pytest.importorskip("websockets")
    from oasr.defaults import default_checkpoint

    try:
        ckpt = str(default_checkpoint())
    except Exception as exc:  # noqa: BLE001 - no default model on this machine
        pytest.skip(f"default model unavailable: {exc}")
    from benchmarks.serverbench import run

    report = run(requests=4, concurrency=4, streams=1, threads=2, ckpt=ckpt, shortest=True)
    assert report.ok, report.mismatches
    assert report.server_counted == 12  # the 4 uploads as warm-up, then 4 + 4, each answered once
    assert report.latency_p99_s >= report.latency_p50_s > 0
    assert report.stream_texts and all(t.strip() for t in report.stream_texts)
