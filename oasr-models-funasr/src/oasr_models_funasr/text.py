"""Tokens -> text and words, as FunASR's ``sentence_postprocess`` builds them.

* Special tokens (``<s>``, ``</s>``, ``<unk>``, ``<OOV>``) are dropped.
* A token list of only CJK characters (FunASR counts digits and ``@`` as CJK too) gives one word
  per token, joined without spaces; each keeps its own timestamp.
* Latin pieces: a piece ending in ``@@`` continues into the next one; a word spans its
  pieces' times. Words are separated by spaces.
* Mixed lists: CJK tokens are words (a space before one is dropped), ``@@`` pieces continue,
  Latin pieces end a word; any other token is kept in the text but gets no time.
* Runs of single letters separated by spaces become one upper-case abbreviation ("a b c" ->
  "ABC") spanning their times.

The text is FunASR's text without timestamps; words and their times are what it reports with
``output_timestamp=True`` (a word per entry of its timestamp list).
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence

SPECIALS = ("<s>", "</s>", "<unk>", "<OOV>")
Span = tuple[int, int]


def _is_cjk(tok: str) -> bool:
    # FunASR compares the whole token string (lexicographically) with the CJK block bounds
    return "\u4e00" <= tok <= "\u9fff" or "\u0030" <= tok <= "\u0039" or tok == "@"


def _clean(tok: str) -> str:
    for s in (" ", "</s>", "<s>", "<unk>", "<OOV>"):
        tok = tok.replace(s, "")
    return tok


# The predicates below are FunASR's ``isAllChinese`` / ``isAllAlpha``: on a token list they test
# every token, on a string every character. A vocabulary is a few thousand strings, so each
# string's answer is cached (the uncached per-character scans cost milliseconds per batch).


@functools.lru_cache(maxsize=1 << 16)
def _piece_cjk(piece: str) -> bool:
    return _is_cjk(_clean(piece))


@functools.lru_cache(maxsize=1 << 16)
def _piece_alpha(piece: str) -> bool:
    t = _clean(piece)
    return (t.isalpha() or t == "'") and not (t.isalpha() and _is_cjk(t))


@functools.lru_cache(maxsize=1 << 16)
def _string_all_cjk(s: str) -> bool:
    return bool(s) and all(map(_piece_cjk, s))


@functools.lru_cache(maxsize=1 << 16)
def _string_all_alpha(s: str) -> bool:
    return bool(s) and all(map(_piece_alpha, s))


def _all_cjk(toks: Sequence[str]) -> bool:
    if isinstance(toks, str):
        return _string_all_cjk(toks)
    return bool(toks) and all(map(_piece_cjk, toks))


def _all_alpha(toks: Sequence[str]) -> bool:
    if isinstance(toks, str):
        return _string_all_alpha(toks)
    return bool(toks) and all(map(_piece_alpha, toks))


def _words(toks: list[str], times: Sequence[Span] | None) -> tuple[list[str], list[Span]]:
    """FunASR's word list (with " " separators) and the times of its timed words."""
    words: list[str] = []
    spans: list[Span] = []
    if _all_cjk(toks):
        words = [t.replace(" ", "") for t in toks]
        return words, list(times or [])
    pending = ""
    timed = times is not None
    if _all_alpha(toks):
        begin = end = 0
        open_word = False
        for i, t in enumerate(toks):
            if timed and not open_word:
                begin, end = times[i]
            if "@@" in t:
                pending += t.replace("@@", "")
                open_word = True
                if timed:
                    end = times[i][1]
            else:
                words += [pending + t, " "]
                pending = ""
                open_word = False
                if timed:
                    end = times[i][1]
                    spans.append((begin, end))
        return words, spans
    space_after_latin = False
    open_word = False
    begin = end = -1
    for i, t in enumerate(toks):
        if timed and not open_word:
            begin, end = times[i] if i < len(times) else (begin, end)
        if _all_cjk(t):
            if space_after_latin:
                words.pop()
            words.append(t)
            space_after_latin = False
            open_word = False
            if timed:
                spans.append((begin, end))
        elif "@@" in t:
            pending += t.replace("@@", "")
            space_after_latin = False
            open_word = True
            if timed and i < len(times):
                end = times[i][1]
        elif _all_alpha(t):
            words += [pending + t, " "]
            pending = ""
            space_after_latin = True
            open_word = False
            if timed and i < len(times):
                end = times[i][1]
            if timed:
                spans.append((begin, end))
        else:
            words.append(t)
    return words, spans


#: FunASR's single letter, ``len(w) == 1 and w.encode("utf-8").isalpha()``: one ASCII letter
_LETTERS = frozenset(string.ascii_letters)
_single_letter = _LETTERS.__contains__


def _abbreviations(words: list[str], spans: list[Span] | None) -> tuple[list[str], list[Span]]:
    """FunASR's ``abbr_dispose``: "a", " ", "b", " ", "c" -> "ABC"."""
    n = len(words)
    if sum(map(_single_letter, words)) < 2:
        # no abbreviation: the words as they are; the k-th word that is not " " has the k-th
        # span (while there are spans)
        if spans is None:
            return list(words), []
        timed = len(words) - words.count(" ")
        return list(words), [tuple(sp) for sp in spans[:timed]]  # type: ignore[misc]
    begins: list[int] = []
    ends: list[int] = []
    last = -1
    for i in range(n):
        if i <= last:
            continue
        if (
            _single_letter(words[i])
            and i + 2 < n
            and words[i + 1] == " "
            and _single_letter(words[i + 2])
        ):
            begins.append(i)
            j = i + 2
            ends.append(j)
            while True:
                j += 1
                if j < n and words[j] == " ":
                    j += 1
                    if j < n and _single_letter(words[j]):
                        ends[-1] = j
                        last = j
                    else:
                        break
                else:
                    break
    starts, stops = set(begins), set(ends)
    # index into ``spans`` of each word (spaces share the next word's index)
    ts_index: list[int] = []
    k = 0
    for w in words:
        ts_index.append(k)
        if w != " ":
            k += 1
    out: list[str] = []
    out_spans: list[Span] = []
    last = -1
    begin = 0
    i = 0
    while i < n:
        if i <= last:
            i += 1
            continue
        if i in starts:
            if spans is not None:
                begin = spans[ts_index[i]][0]
            word = words[i].upper()
            i += 1
            while i < n:
                if i in stops:
                    word += words[i].upper()
                    last = i
                    break
                if words[i].encode("utf-8").isalpha():
                    word += words[i].upper()
                i += 1
            out.append(word)
            if spans is not None and ts_index[i] < len(spans):
                out_spans.append((begin, spans[ts_index[i]][1]))
        else:
            out.append(words[i])
            if spans is not None and ts_index[i] < len(spans) and words[i] != " ":
                out_spans.append(tuple(spans[ts_index[i]]))  # type: ignore[arg-type]
        i += 1
    return out, out_spans


def postprocess(
    tokens: Sequence[str], times: Sequence[Span] | None = None
) -> tuple[str, list[str], list[Span]]:
    """(text, words, word times in ms). ``times``: one (start_ms, end_ms) per token of
    ``tokens``, as :func:`oasr.decoders.cif.cif_timestamps` gives them; without it the
    word times are empty."""
    toks = [t for t in tokens if t not in SPECIALS]
    words, spans = _words(toks, times)
    merged, merged_spans = _abbreviations(words, spans if times is not None else None)
    text = "".join(merged).strip()
    real = [w for w in merged if w != " "]
    return text, real, merged_spans
