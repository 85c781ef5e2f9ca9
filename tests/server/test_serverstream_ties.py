"""The finals check of ``benchmarks/serverstreambench.py`` (issue #20): a server batches streams
in other shapes than the in-process reference, which moves the CTC logits by rounding only, so a
final may differ from the reference's only where a frame's two best tokens are tied within that
rounding. The check lets such a final pass (``tie_margin`` within the tolerance) and nothing else:
a dropped piece of audio must still fail it.

The bundled random-weight WeNet ``u2_conformer_conv2d6`` checkpoint (its text grows at every chunk).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("oasr_models_wenet")
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
CKPT = str(REPO / "tests" / "data" / "wenet" / "u2_conformer_conv2d6")
CHUNK = 1600  # the client's 100 ms appends at 16 kHz


def test_reachable_follows_ctc_collapse_and_spelling() -> None:
    from benchmarks.serverstreambench import ctc_reachable, tie_margin

    pieces = ["<blank>", "\u2581a", "b", "\u2581c"]
    big = 10.0
    # frames: a, a, blank, b, then a near tie between b and blank (b ahead by 0.001)
    logits = np.zeros((5, 4), np.float32)
    for t, u in enumerate([1, 1, 0, 2, 2]):
        logits[t, u] = big
    logits[4, 0] = big - 0.001
    assert ctc_reachable(logits, pieces, 0, "ab", 0.0)  # repeats merged, blank dropped
    assert not ctc_reachable(logits, pieces, 0, "abb", 0.0)
    logits[4, 2], logits[3, 2], logits[3, 0] = big, 0.0, big  # a a _ _ b: still "ab"
    assert ctc_reachable(logits, pieces, 0, "ab", 0.0)
    logits[4, 0] = big - 0.001  # frame 4 nearly blank: "a" only within the tie
    assert not ctc_reachable(logits, pieces, 0, "a", 0.0)
    assert ctc_reachable(logits, pieces, 0, "a", 0.002)
    spread = float(logits.std())
    assert tie_margin(logits, pieces, 0, "a", 0.5) == pytest.approx(0.001 / spread, rel=1e-3)
    assert tie_margin(logits, pieces, 0, "ab", 0.5) == 0.0
    assert tie_margin(logits, pieces, 0, "ac", 0.5) is None  # c never near the top
    # word boundaries become spaces, the text is stripped
    logits[:] = 0.0
    for t, u in enumerate([1, 0, 3, 3, 0]):
        logits[t, u] = big
    assert ctc_reachable(logits, pieces, 0, "a c", 0.0)
    assert not ctc_reachable(logits, pieces, 0, " a c", 0.0)


def _reference(pcm: list[np.ndarray], uploads: list[np.ndarray] = (),
               max_batch: int | None = None) -> tuple[list[str], list[str]]:  # fmt: skip
    from benchmarks.serverstreambench import reference

    refs, texts, _ = reference(CKPT, "cpu", 1, pcm, CHUNK, list(uploads), max_batch=max_batch)
    return [r.final for r in refs], texts


def _finals(pcm: list[np.ndarray], max_batch: int | None) -> list[str]:
    return _reference(pcm, max_batch=max_batch)[0]


def test_batch_composition_keeps_finals_and_a_dropped_piece_fails_the_check() -> None:
    """CPU float32: the same streams stepped all at once and one per step give the same finals;
    a stream missing one 100 ms append gives a final the tie check refuses (its margin is far
    above any tolerance), and ``check_stream`` reports it."""
    from benchmarks.serverstreambench import (
        TIE_TOLERANCE,
        StreamRef,
        check_stream,
        model_logits,
        stream_pcm,
        tie_margin,
    )

    pcm = [stream_pcm(i, 4.0, 16000) for i in range(4)]
    together = _finals(pcm, None)
    assert _finals(pcm, 1) == together
    assert all(len(t) >= 10 for t in together)  # texts to compare, not blanks
    broken = [np.concatenate([p[: 10 * CHUNK], p[11 * CHUNK :]]) for p in pcm]
    dropped = _finals(broken, None)
    waves = [p.astype(np.float32) / 32768.0 for p in pcm]
    logits, offline, pieces, blank = model_logits(CKPT, "cpu", "float32", waves, CHUNK, waves[:2])
    # the offline logits are the upload path's: its text is their best path
    _, uploads = _reference(pcm[:1], pcm[:2])
    assert [
        tie_margin(lg, pieces, blank, t, 0.5) for lg, t in zip(offline, uploads, strict=True)
    ] == [0.0, 0.0]
    tol = TIE_TOLERANCE["float32"]
    for i in range(len(pcm)):
        assert tie_margin(logits[i], pieces, blank, together[i], 0.5) == 0.0
        assert dropped[i] != together[i]
        margin = tie_margin(logits[i], pieces, blank, dropped[i], 0.5)
        assert margin is None or margin > 20 * tol, margin
        rec = {"i": i, "errors": [], "final": dropped[i], "deltas": [], "sent": []}
        _, problems = check_stream(StreamRef([], together[i]), rec)
        assert problems and "final" in problems[0]
        assert check_stream(StreamRef([], together[i]), {**rec, "final": together[i]})[1] == []
    # a final the tie check explained passes, its deltas only need to lead to it
    ref = StreamRef([(3, together[0][:2])], together[0])
    rec = {
        "i": 0,
        "errors": [],
        "final": "x" + together[0],
        "deltas": [(1.0, "x")],
        "sent": [0.0] * 5,
    }
    assert check_stream(ref, rec, tied=True) == ([], [])
    assert check_stream(ref, {**rec, "deltas": [(1.0, "y")]}, tied=True)[1]
