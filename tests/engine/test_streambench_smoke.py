"""The asrbench streaming smoke profile (WeNet small, CPU, N=1,2, 3 s of audio) runs in-process.

Asserts only that it ran, every stream finished and the report is well-formed; speed is never
asserted."""

from __future__ import annotations

import json
import math

import pytest

#: benchmark smoke runs: skipped by `scripts/test.sh --fast`, run by CI
pytestmark = pytest.mark.slow


def test_asrbench_streaming_smoke(tmp_path):
    pytest.importorskip("oasr_models_wenet")
    from benchmarks.asrbench import main

    out = tmp_path / "s.json"
    report = main(
        ["--workload", "streaming", "--profile", "smoke", "--threads", "1", "--json", str(out)]
    )
    assert report["workload"] == "streaming"
    assert [r["streams"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["finished"] == r["streams"]
        assert len(r["texts"]) == r["streams"] and all(isinstance(t, str) for t in r["texts"])
        assert r["steps"] > 0 and 1 <= r["mean_batch"] <= r["streams"]
        assert r["busy_s"] > 0 and r["wall_s"] > 0 and r["rtf"] > 0
        for key in ("chunk_latency", "step_latency"):
            p50, p90, p99 = (r[f"{key}_p{q}_ms"] for q in (50, 90, 99))
            assert 0 <= p50 <= p90 <= p99 and math.isfinite(p99)
        assert math.isfinite(r["last_latency_max_ms"]) and isinstance(r["held"], bool)
        assert (
            0.0 <= r["text_equal_offline"] <= 1.0 and 0.0 <= r["text_equal_offline_chunked"] <= 1.0
        )
    assert json.loads(out.read_text())["results"][0]["streams"] == 1
