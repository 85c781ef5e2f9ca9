"""``oasr transcribe --long-form vad`` on long real speech: segments neither overlap nor repeat
words, and the text is as good as the sequential mode's (issue #14, item 2).

The recording is 79 s of real English (ten speech clips of tests/data/speech, 0.2 s apart, in an
order where the VAD repair pass used to merge two uncovered gaps of one chunk into one span and
decode the speech between them a second time: a sentence came out twice, in overlapping
segments). Both modes are scored against the clips' own transcripts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from .conftest import manifest, write_wav  # noqa: TID252

#: order and gap (0.2 s) that showed the duplication before the fix
ORDER = [
    "en_ls_1995-1837-0001.wav", "en_ls_1272-128104-0000.wav", "en_fleurs_007.ogg",
    "en_fleurs_002.ogg", "en_ls_4507-16021-0012.wav", "en_jfk_inaugural.flac",
    "en_fleurs_006.ogg", "en_ls_2830-3980-0043.wav", "en_fleurs_000.ogg",
    "en_ls_1089-134686-0001.wav",
]  # fmt: skip


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def _wer(ref: list[str], hyp: list[str]) -> float:
    d = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, d[0] = d[0], i
        for j, h in enumerate(hyp, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r != h))
    return d[len(hyp)] / max(1, len(ref))


@pytest.fixture(scope="module")
def long_recording(tmp_path_factory: pytest.TempPathFactory, speech_16k) -> Path:  # noqa: ANN001
    gap = np.zeros(int(0.2 * 16000), np.float32)
    audio = np.concatenate([x for name in ORDER for x in (speech_16k[name], gap)])
    return write_wav(tmp_path_factory.mktemp("long") / "long.wav", audio)


@pytest.mark.slow
def test_vad_long_form_has_no_overlapping_or_repeated_segments(oasr, long_recording: Path) -> None:
    out = {}
    for mode in ("sequential", "vad"):
        r = oasr("transcribe", long_recording, "--long-form", mode, "-f", "verbose_json")
        assert r.exit_code == 0, r.stderr
        out[mode] = json.loads(r.stdout)
    segs = out["vad"]["segments"]
    assert len(segs) > 5
    for a, b in zip(segs, segs[1:], strict=False):
        assert b["start"] >= a["end"] - 1e-3, (a, b)  # no overlap
        assert a["end"] <= out["vad"]["duration"] + 1e-3
    # no run of 4 words repeated across a segment boundary
    for a, b in zip(segs, segs[1:], strict=False):
        tail, head = _words(a["text"]), _words(b["text"])
        for k in range(4, min(len(tail), len(head)) + 1):
            assert tail[-k:] != head[:k], (a["text"], b["text"])
    words = _words(out["vad"]["text"])
    grams = [tuple(words[i : i + 6]) for i in range(len(words) - 5)]
    assert len(grams) == len(set(grams)), "a 6-word run appears twice"
    rows = manifest()
    ref = _words(" ".join(rows[name]["text"] for name in ORDER))
    wer_vad, wer_seq = _wer(ref, words), _wer(ref, _words(out["sequential"]["text"]))
    assert wer_vad <= wer_seq + 0.02, (wer_vad, wer_seq)
    assert len(words) <= len(ref) * 1.05  # nothing said twice
