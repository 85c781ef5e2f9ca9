"""benchmarks.qwenbench's smoke profile in-process (CPU, tiny shapes): both sides generate the
forced number of tokens, the same greedy tokens, and the report has its fields."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_qwenbench_smoke(tmp_path):
    pytest.importorskip("transformers")
    from benchmarks.qwenbench import main

    report = main(["--profile", "smoke", "--batch-sizes", "1,2", "--tokens", "6", "--repeats", "2",
                   "--json", str(tmp_path / "r.json")])  # fmt: skip
    rows = report["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tokens"] == r["batch"] * 6
        assert r["token_agreement"] == 1.0
        assert r["oasr_s"] > 0 and r["transformers_s"] > 0 and r["speedup"] > 0
        # two alternating runs a side; the reported time is one of them (the upper median)
        assert len(r["oasr_runs_s"]) == len(r["transformers_runs_s"]) == 2
        assert r["oasr_s"] == max(r["oasr_runs_s"])
        assert r["transformers_s"] == max(r["transformers_runs_s"])
    assert "oasr_ttft_s" in rows[0] and (tmp_path / "r.json").is_file()
