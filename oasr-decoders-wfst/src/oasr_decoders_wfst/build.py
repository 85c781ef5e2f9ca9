"""Build a CTC decoding graph TLG = T o min(det(L o G)) with kaldifst (``oasr graph build``).

- G: the grammar, an ARPA n-gram LM as a WFST the way Kaldi's ``arpa2fst`` makes it: one state
  per history, an arc per n-gram (cost ``-ln(10) * log10 p``), a backoff arc per history to
  its one-shorter suffix (cost ``-ln(10) * backoff``, input ``#0``, output epsilon), ``</s>``
  as a final cost. N-grams with a word the lexicon does not spell are dropped.
- L: the lexicon, word -> token sequence, with Kaldi's disambiguation symbols ``#1, #2, ...``
  after pronunciations that are prefixes of others or homophones, and a ``#0`` self-loop that
  lets G's backoff arcs through.
- T: the standard CTC topology of k2 / icefall (``ctc_topo``): one state per token (state 0 =
  blank), an arc ``t:t`` into state ``t`` from every other state, a self-loop ``t:eps`` on
  every state (repeats and blanks emit nothing), every state final; plus ``eps:#k`` self-loops
  that consume L's disambiguation symbols, which so become input epsilons of TLG.

Input labels of the result are ``token + 1`` (0 is epsilon), as kaldi-decoder's ``DecodableCtc``
reads them; output labels are word ids. Only this module imports kaldifst.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oasr.errors import InvalidRequestError
from oasr_decoders_wfst.graph import WfstGraph, from_arrays

LN10 = math.log(10.0)
BLANK = "<blk>"


@dataclass
class ArpaLM:
    """An ARPA model: ``ngrams[n - 1]`` maps a word tuple of length ``n`` to
    ``(log10 prob, log10 backoff)``."""

    ngrams: list[dict[tuple[str, ...], tuple[float, float]]]

    @property
    def order(self) -> int:
        return len(self.ngrams)


def read_arpa(lines: Iterable[str]) -> ArpaLM:
    """Parse ARPA text (``\\data\\``, ``\\N-grams:`` sections, ``\\end\\``)."""
    ngrams: list[dict[tuple[str, ...], tuple[float, float]]] = []
    order = 0
    counts: dict[int, int] = {}
    section = None
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            continue
        if line == "\\data\\":
            section = "data"
            continue
        if line == "\\end\\":
            break
        m = re.fullmatch(r"\\(\d+)-grams:", line)
        if m:
            order = int(m.group(1))
            while len(ngrams) < order:
                ngrams.append({})
            section = "ngrams"
            continue
        if section == "data":
            m = re.fullmatch(r"ngram\s+(\d+)\s*=\s*(\d+)", line)
            if m:
                counts[int(m.group(1))] = int(m.group(2))
            continue
        if section != "ngrams":
            continue  # free text before \data\
        parts = line.split()
        if len(parts) < order + 1:
            raise InvalidRequestError(f"ARPA line {lineno}: expected a {order}-gram, got {line!r}")
        try:
            prob = float(parts[0])
            backoff = float(parts[order + 1]) if len(parts) > order + 1 else 0.0
        except ValueError:
            raise InvalidRequestError(f"ARPA line {lineno}: not a number in {line!r}") from None
        ngrams[order - 1][tuple(parts[1:order + 1])] = (prob, backoff)
    if not ngrams or not ngrams[0]:
        raise InvalidRequestError("not an ARPA language model: no \\1-grams: section")
    return ArpaLM(ngrams)


def read_lexicon(lines: Iterable[str]) -> list[tuple[str, list[str]]]:
    """``word unit unit ...`` per line (the first pronunciation of a word counts once per line;
    a word may have several lines). ``word(2)`` variants of CMU dictionaries keep their word."""
    out = []
    variant = re.compile(r"\(\d+\)$")
    for line in lines:
        parts = line.split()
        if len(parts) < 2 or parts[0].startswith("#"):
            continue
        word = variant.sub("", parts[0]) if parts[0].endswith(")") else parts[0]
        out.append((word, parts[1:]))
    return out


def tokens_from_lexicon(lexicon: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    units = sorted({u for _, pron in lexicon for u in pron})
    return [BLANK, *units]


def _disambiguate(prons: Sequence[tuple[str, ...]]) -> tuple[list[int], int]:
    """Kaldi's add_lex_disambig: the disambiguation symbol index (0 = none) appended to each
    pronunciation, and the largest used."""
    count: dict[tuple[str, ...], int] = {}
    for p in prons:
        count[p] = count.get(p, 0) + 1
    prefixes = {p[:i] for p in prons for i in range(1, len(p))}
    used: dict[tuple[str, ...], int] = {}
    out = []
    for p in prons:
        if p in prefixes or count[p] > 1:
            used[p] = used.get(p, 0) + 1
            out.append(used[p])
        else:
            out.append(0)
    return out, max(out, default=0)


def _fst_text(src, dst, ilabel, olabel, weight, finals, final_weights) -> str:
    arcs = np.stack([np.asarray(src), np.asarray(dst), np.asarray(ilabel), np.asarray(olabel)], 1)
    w = np.asarray(weight, dtype=np.float64)
    lines = [f"{a} {b} {c} {d} {x:.7g}" for (a, b, c, d), x in zip(arcs.tolist(), w.tolist(), strict=False)]
    lines += [f"{s} {x:.7g}" for s, x in zip(list(finals), list(final_weights), strict=False)]
    return "\n".join(lines) + "\n"


def _grammar_text(lm: ArpaLM, word_ids: dict[str, int], backoff_label: int) -> tuple[str, int]:
    """G as OpenFst text (first line the start state) and its number of states."""
    known = set(word_ids) | {"<s>", "</s>"}
    order = lm.order
    state: dict[tuple[str, ...], int] = {(): 0}
    kept: list[dict[tuple[str, ...], tuple[float, float]]] = []
    for n, table in enumerate(lm.ngrams, 1):
        keep = {}
        for ws, v in table.items():
            if all(w in known for w in ws) and "</s>" not in ws[:-1] and "<s>" not in ws[1:]:
                keep[ws] = v
        kept.append(keep)
        if n < order:
            for ws in keep:
                if ws[-1] != "</s>":
                    state.setdefault(ws, len(state))
    if ("<s>",) not in kept[0]:
        raise InvalidRequestError("the ARPA model has no <s> unigram")

    def dest(hist: tuple[str, ...]) -> int:
        while hist not in state:
            hist = hist[1:]
        return state[hist]

    src, dst, lab, wts = [], [], [], []
    finals: dict[int, float] = {}
    for table in kept:
        for ws, (prob, _) in table.items():
            hist, word = ws[:-1], ws[-1]
            if hist not in state or word == "<s>":
                continue
            cost = -prob * LN10
            if word == "</s>":
                finals[state[hist]] = cost
                continue
            src.append(state[hist])
            dst.append(dest(ws[-(order - 1):] if order > 1 else ()))
            lab.append(word_ids[word])
            wts.append(cost)
    for hist, s in state.items():
        if hist:
            bo = kept[len(hist) - 1][hist][1]
            src.append(s)
            dst.append(dest(hist[1:]))
            lab.append(backoff_label)
            wts.append(-bo * LN10)
    start = state.get(("<s>",), 0)  # a unigram model starts at its only history
    lab_a = np.asarray(lab)
    out = np.where(lab_a == backoff_label, 0, lab_a)
    # OpenFst text: the source of the first line is the start state
    order_idx = np.argsort(np.asarray(src) != start, kind="stable")
    text = _fst_text(np.asarray(src)[order_idx], np.asarray(dst)[order_idx], lab_a[order_idx],
                      out[order_idx], np.asarray(wts)[order_idx], list(finals), list(finals.values()))
    return text, len(state)


def _lexicon_text(lexicon: Sequence[tuple[str, Sequence[str]]], token_ids: dict[str, int],
                  word_ids: dict[str, int], first_disambig: int, word_disambig: int) -> str:
    prons = [tuple(p) for _, p in lexicon]
    disambig, _ = _disambiguate(prons)
    src, dst, il, ol = [], [], [], []
    next_state = 1
    for (word, pron), d in zip(lexicon, disambig, strict=False):
        labels = [token_ids[u] + 1 for u in pron]
        if d:
            labels.append(first_disambig + d)
        prev = 0
        for i, lab in enumerate(labels):
            last = i == len(labels) - 1
            nxt = 0 if last else next_state
            if not last:
                next_state += 1
            src.append(prev)
            dst.append(nxt)
            il.append(lab)
            ol.append(word_ids[word] if i == 0 else 0)
            prev = nxt
    src.append(0)
    dst.append(0)
    il.append(first_disambig)  # token #0 : word #0 (G's backoff label)
    ol.append(word_disambig)
    return _fst_text(src, dst, il, ol, np.zeros(len(src)), [0], [0.0])


def _ctc_topology_text(num_tokens: int, first_disambig: int, num_disambig: int) -> str:
    lines = []
    for i in range(num_tokens):
        for j in range(num_tokens):
            if i == j:
                lines.append(f"{i} {i} {j + 1} 0")
            else:
                lines.append(f"{i} {j} {j + 1} {j + 1 if j else 0}")
        for d in range(num_disambig + 1):
            lines.append(f"{i} {i} 0 {first_disambig + d}")
    lines += [str(i) for i in range(num_tokens)]
    return "\n".join(lines) + "\n"


_STATE = np.dtype([("final", "<f4"), ("pos", "<u4"), ("narcs", "<u4"), ("nie", "<u4"),
                   ("noe", "<u4")])  # fmt: skip
_ARC = np.dtype([("ilabel", "<i4"), ("olabel", "<i4"), ("weight", "<f4"), ("next", "<i4")])


def _read_string(buf: bytes, pos: int) -> tuple[str, int]:
    n = int(np.frombuffer(buf, "<i4", 1, pos)[0])
    return buf[pos + 4:pos + 4 + n].decode(), pos + 4 + n


def fst_to_arrays(fst) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                np.ndarray]:  # fmt: skip
    """(start, offsets, next, ilabels, olabels, weights, finals) of a kaldifst FST, read from
    its OpenFst ConstFst binary image (no per-arc Python loop)."""
    import kaldifst

    const = kaldifst.StdConstFst(fst)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "g.fst")
        const.write(path)
        buf = Path(path).read_bytes()
    magic = int(np.frombuffer(buf, "<i4", 1, 0)[0])
    if magic != 2125659606:
        raise RuntimeError("unexpected OpenFst header")
    fst_type, pos = _read_string(buf, 4)
    arc_type, pos = _read_string(buf, pos)
    if fst_type != "const" or arc_type != "standard":
        raise RuntimeError(f"unexpected FST type {fst_type}/{arc_type}")
    _version, flags = np.frombuffer(buf, "<i4", 2, pos)
    pos += 8 + 8  # version, flags, properties
    start, num_states, num_arcs = (int(x) for x in np.frombuffer(buf, "<i8", 3, pos))
    pos += 24
    if flags & 3:
        raise RuntimeError("FST image with symbol tables is not expected here")
    if flags & 4:  # aligned
        pos = (pos + 15) // 16 * 16
    states = np.frombuffer(buf, _STATE, num_states, pos)
    pos += num_states * _STATE.itemsize
    if flags & 4:
        pos = (pos + 15) // 16 * 16
    arcs = np.frombuffer(buf, _ARC, num_arcs, pos)
    offsets = np.zeros(num_states + 1, dtype=np.int64)
    offsets[:-1] = states["pos"]
    offsets[-1] = num_arcs
    return (start, offsets, arcs["next"].astype(np.int32), arcs["ilabel"].astype(np.int32),
            arcs["olabel"].astype(np.int32), arcs["weight"].astype(np.float32),
            states["final"].astype(np.float32))  # fmt: skip


def build_tlg(lexicon: Sequence[tuple[str, Sequence[str]]], lm: ArpaLM,
              tokens: Sequence[str] | None = None) -> WfstGraph:  # fmt: skip
    """TLG for a CTC model whose units are ``tokens`` (``tokens[0]`` the blank)."""
    import kaldifst

    tokens = list(tokens) if tokens is not None else tokens_from_lexicon(lexicon)
    token_ids = {u: i for i, u in enumerate(tokens)}
    missing = sorted({u for _, p in lexicon for u in p} - set(token_ids))
    if missing:
        raise InvalidRequestError(f"lexicon units not in the token table: {missing[:10]}")
    lm_words = {ws[0] for ws in lm.ngrams[0]}
    lexicon = [(w, list(p)) for w, p in lexicon if w in lm_words and p]
    if not lexicon:
        raise InvalidRequestError("no word of the lexicon is in the language model")
    words = ["<eps>", *sorted({w for w, _ in lexicon})]
    word_ids = {w: i for i, w in enumerate(words)}
    word_disambig = len(words)  # "#0": G's backoff label, never in the result
    num_labels = len(tokens) + 1  # input labels 1..len(tokens) are tokens
    first_disambig = num_labels  # token "#0"; "#k" = first_disambig + k
    _, max_disambig = _disambiguate([tuple(p) for _, p in lexicon])

    g_text, _ = _grammar_text(lm, word_ids, word_disambig)
    G = kaldifst.compile(g_text)
    kaldifst.arcsort(G, sort_type="ilabel")
    L = kaldifst.compile(_lexicon_text(lexicon, token_ids, word_ids, first_disambig, word_disambig))
    kaldifst.arcsort(L, sort_type="olabel")
    LG = kaldifst.compose(L, G)
    kaldifst.determinize_star(LG, use_log=True)
    kaldifst.minimize_encoded(LG)
    kaldifst.arcsort(LG, sort_type="ilabel")
    T = kaldifst.compile(_ctc_topology_text(len(tokens), first_disambig, max_disambig))
    kaldifst.arcsort(T, sort_type="olabel")
    TLG = kaldifst.compose(T, LG)
    kaldifst.connect(TLG)
    if TLG.num_states == 0:
        raise InvalidRequestError("the graph is empty: no word sequence of the LM can be spelt")
    start, offsets, nxt, il, ol, w, finals = fst_to_arrays(TLG)
    if il.size and il.max() > len(tokens):
        raise RuntimeError("a disambiguation symbol survived into TLG")
    sources = np.repeat(np.arange(len(finals), dtype=np.int64), np.diff(offsets))
    info = {
        "builder": "oasr graph build (kaldifst)",
        "kaldifst": getattr(kaldifst, "__version__", "unknown"),
        "lm_order": lm.order,
        "lexicon_entries": len(lexicon),
        "topology": "ctc (k2 standard)",
    }
    return from_arrays(start, sources, nxt, il, ol, w, finals, tokens, words, info)


def _open_text(path: str | Path) -> list[str]:
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return fh.read().splitlines()
    return path.read_text(encoding="utf-8").splitlines()


def read_tokens(lines: Iterable[str]) -> list[str]:
    """icefall's ``tokens.txt`` (``unit id`` per line, ids 0..n-1, 0 the blank) or one unit a
    line."""
    pairs = [line.split() for line in lines if line.strip()]
    if all(len(p) == 2 and p[1].isdigit() for p in pairs):
        table = dict((int(i), u) for u, i in pairs)
        if sorted(table) != list(range(len(table))):
            raise InvalidRequestError("tokens file ids are not 0..n-1")
        return [table[i] for i in range(len(table))]
    return [p[0] for p in pairs]


def build_from_files(lexicon: str | Path, arpa: str | Path, tokens: str | Path | None = None,
                     words: Sequence[str] | None = None) -> WfstGraph:  # fmt: skip
    """:func:`build_tlg` from a lexicon file, an ARPA file (``.gz`` too) and optionally a token
    table; ``words`` restricts the vocabulary."""
    lex = read_lexicon(_open_text(lexicon))
    if words is not None:
        keep = set(words)
        lex = [(w, p) for w, p in lex if w in keep]
    toks = read_tokens(_open_text(tokens)) if tokens else None
    return build_tlg(lex, read_arpa(_open_text(arpa)), toks)
