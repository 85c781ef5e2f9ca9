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


def test_streambench_phases_and_lockstep(tmp_path):
    """``--phases`` accounts every model step and row; ``--lockstep`` advances every stream in
    each step; both report GC collections. Timings are only checked to be non-negative."""
    pytest.importorskip("oasr_models_wenet")
    from benchmarks.streambench import main

    paced = main(["--streams", "2", "--seconds", "2", "--threads", "1", "--phases",
                  "--json", str(tmp_path / "p.json")])  # fmt: skip
    r = paced["results"][0]
    ph = r["phases"]
    assert ph["steps"] == r["steps"] and ph["rows"] == r["steps"] * r["mean_batch"]
    assert ph["finals"] == 2 and ph["encoder_calls"] > 0
    assert set(ph["seconds"]) == {"features", "gather", "encoder", "wait", "search", "scatter", "results", "finals"}
    assert all(v >= 0 for v in ph["seconds"].values()) and ph["seconds"]["encoder"] > 0
    assert set(ph["loop_seconds"]) == {"scheduler", "feed", "bookkeeping", "poll"}
    assert r["step_time"]["p50_ms"] <= r["step_time"]["max_ms"] and r["step_time"]["max_batch"] <= 2
    assert len(r["gc"]["collections"]) == 3 and paced["gc_freeze"] is True

    lock = main(["--lockstep", "--streams", "3", "--seconds", "2", "--threads", "1", "--phases", "--gc", "default"])
    (x,) = lock["results"]
    assert lock["workload"] == "streaming-lockstep" and lock["gc_freeze"] is False
    assert x["rows"] == x["phases"]["rows"] and x["phases"]["finals"] == 3
    # every step carries all three streams (they are fed alike), at most one step per round
    assert x["rows"] == 3 * x["steps"] and 0 < x["steps"] <= x["rounds"]
