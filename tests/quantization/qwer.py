"""Corpus WER of tiny.en on the repository's English clips, for the quantization WER tests on
CPU and GPU. Whisper's English normaliser when openai-whisper is installed, else lower case
without punctuation (the device machine has no openai-whisper); word edit distance computed
here (no jiwer needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "tests" / "data" / "speech"


def english_clips() -> list[tuple[str, str]]:
    """(file name, reference text) of every English recording in the manifest, each once (the
    same recording in several containers counts once)."""
    rows = [json.loads(line) for line in (SPEECH / "manifest.jsonl").read_text().splitlines() if line.strip()]
    seen: dict[str, tuple[str, str]] = {}
    for r in rows:
        if r["language"] == "en":
            seen.setdefault(Path(r["audio"]).stem, (r["audio"], r["text"]))
    return list(seen.values())


def transcripts(ckpt: str, device: str, quantization: str | None, kv_cache_dtype: str | None,
                threads: int | None = None) -> list[tuple[str, str]]:  # fmt: skip
    """(reference, hypothesis) per English clip: greedy, no temperature fallback, no VAD gate
    (as the faster-whisper comparison in tests/whisper/test_wer.py)."""
    from oasr.audio import load_audio
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig

    clips = english_clips()
    engine = ASREngine(EngineConfig(ckpt_dir=ckpt, device=device, quantization=quantization,
                                    kv_cache_dtype=kv_cache_dtype, num_threads=threads))  # fmt: skip
    try:
        waves = [load_audio(SPEECH / name, 16000) for name, _ in clips]
        outs = engine.transcribe_offline(waves, DecodingOptions.build(beam_size=1, temperature=0.0, vad_gate=False))
    finally:
        engine.shutdown()
    return [(ref, t.text) for (_, ref), t in zip(clips, outs, strict=True)]


def _normalizer():
    try:
        from whisper.normalizers import EnglishTextNormalizer

        return EnglishTextNormalizer()
    except ImportError:
        return lambda s: " ".join(re.sub(r"[^\w\s']", " ", s.lower()).split())


def _edits(ref: list[str], hyp: list[str]) -> int:
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def wer(pairs: list[tuple[str, str]]) -> float:
    """Corpus WER in percent: word edits over reference words, all clips together."""
    norm = _normalizer()
    edits = words = 0
    for ref, hyp in pairs:
        r, h = norm(ref).split(), norm(hyp).split()
        edits += _edits(r, h)
        words += len(r)
    return 100.0 * edits / max(1, words)


def corpus_wer(ckpt: str, device: str, quantization: str | None, kv_cache_dtype: str | None,
               threads: int | None = None) -> float:  # fmt: skip
    return wer(transcripts(ckpt, device, quantization, kv_cache_dtype, threads))
