"""Token lists -> text, words and word times: ``oasr_models_funasr.text.postprocess`` against
FunASR's own ``sentence_postprocess`` on random token lists (CJK characters, digits, ``@@``
pieces, single letters, apostrophes, specials, punctuation, tokens with spaces)."""

from __future__ import annotations

import importlib.util
import random

import pytest

from oasr_models_funasr.text import postprocess

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("funasr") is None, reason="funasr not installed"
)

POOL = ["你", "好", "中", "国", "人", "3", "12", "0x", "@", "a", "b", "c", "i", "x", "the", "cat",
        "he@@", "llo", "wor@@", "ld", "s@@", "'", "don't", "<unk>", "<s>", "</s>", "，", "。",
        "?", " a", "中a", "A", "ok"]  # fmt: skip


def _reference():  # noqa: ANN202
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from funasr.utils.postprocess_utils import sentence_postprocess
    return sentence_postprocess


@pytest.mark.parametrize("pool", ["mixed", "cjk", "latin"])
def test_postprocess_matches_funasr(pool: str) -> None:
    ref = _reference()
    rng = random.Random(pool)
    choices = {
        "mixed": POOL,
        "cjk": [t for t in POOL if t in "你好中国人3@" or t == "12"],
        "latin": [t for t in POOL if t.replace("@", "").replace("'", "").isascii() and t[0] != "<"],
    }[pool]
    for _ in range(400):
        toks = [rng.choice(choices) for _ in range(rng.randint(0, 14))]
        times = [(60 * i, 60 * i + 50) for i in range(len(toks))]
        text, words, _ = postprocess(toks)
        want_text, want_words = ref(list(toks))
        assert (text, words) == (want_text, want_words), toks
        n = sum(t not in ("<s>", "</s>", "<unk>", "<OOV>") for t in toks)
        try:
            want = ref(list(toks), [list(t) for t in times[:n]])
        except IndexError:
            continue  # FunASR's own timestamp path fails on this list
        _, words, spans = postprocess(toks, times[:n])
        assert words == want[2], toks
        assert spans == [tuple(s) for s in want[1]], toks
