"""The asrbench smoke profile (synthetic workload, CPU, tiny shapes) runs in-process."""

from __future__ import annotations

import pytest


def test_asrbench_synthetic_smoke(tmp_path):
    pytest.importorskip("transformers")
    from benchmarks.asrbench import main

    report = main(["--workload", "synthetic", "--profile", "smoke", "--threads", "1",
                   "--json", str(tmp_path / "r.json")])  # fmt: skip
    names = [r["backend"] for r in report["results"]]
    assert names == ["oasr_engine", "transformers"]
    for r in report["results"]:
        assert r["tokens"] == report["requests"] * report["tokens_per_request"]
        assert r["wall_s"] > 0 and r["latency_p99_s"] >= r["latency_p50_s"]
    assert report["text_agreement_with_transformers"] >= 0.5
    assert (tmp_path / "r.json").is_file()
