"""Read CMU Sphinx's binary trie language models (``*.lm.bin``, e.g. Debian's
``pocketsphinx-en-us``) into an :class:`~oasr_decoders_wfst.build.ArpaLM`.

Written from the format's description in pocketsphinx's sources (``lm_trie.c``,
``lm_trie_quant.c``, ``bitarr.c``); no Sphinx code is used. Needed because Sphinx's own
converter (``sphinx_lm_convert``, Debian 0.8+5prealpha) aborts on this model before writing its
bigrams. Layout (little-endian):

- ``"Trie Language Model"``, ``uint8`` order, ``uint32`` n-gram count per order;
- an ``int32`` (0/1), then the quantiser's tables: per middle order a 65536-entry float table
  of probabilities then one of backoffs, then one of probabilities for the highest order;
- ``count[0] + 1`` unigrams ``(float prob, float backoff, uint32 next)``;
- per middle order a bit-packed array of entries ``word | backoff code (16) | prob code (16) |
  next``; then the highest order's ``word | prob code (16)``. Each array holds ``count + 1``
  entries and 8 bytes of padding; field widths are the bits needed for the largest value;
- ``int32`` byte length, then the words, NUL-terminated.

The trie is reversed: a unigram's children are the words *before* it, so the entry reached by
``w_n, w_{n-1}, ..., w_1`` is the n-gram ``w_1 ... w_n``. Values are logarithms in base
1.0001 (Sphinx's default) and are returned as log10.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from oasr.errors import InvalidRequestError
from oasr_decoders_wfst.build import ArpaLM

MAGIC = b"Trie Language Model"
LOG10_OF_BASE = float(np.log10(1.0001))
QUANT_BITS = 16


def _bits(max_value: int) -> int:
    return int(max_value).bit_length()


def _read_field(buf: np.ndarray, bit_offsets: np.ndarray, width: int) -> np.ndarray:
    byte = bit_offsets >> 3
    value = np.zeros(bit_offsets.shape, dtype=np.uint64)
    for k in range(5):  # shift <= 7 plus a field <= 25 bits fits in 5 bytes
        value |= buf[byte + k].astype(np.uint64) << np.uint64(8 * k)
    value >>= (bit_offsets & 7).astype(np.uint64)
    return (value & np.uint64((1 << width) - 1)).astype(np.int64)


def is_sphinx_trie(path: str | Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(len(MAGIC)) == MAGIC


def read_sphinx_trie(path: str | Path, vocabulary: Iterable[str] | None = None,
                     max_order: int | None = None, min_log10_prob: float | None = None) -> ArpaLM:  # fmt: skip
    """The model's n-grams (log10): only those made of ``vocabulary`` words (plus ``<s>``,
    ``</s>``) when given, up to ``max_order``, and of order 2 and above only those at least as
    probable as ``min_log10_prob`` (count pruning's cheap cousin: a smaller graph for tests;
    backoff weights are kept as they are)."""
    raw = Path(path).read_bytes()
    if not raw.startswith(MAGIC):
        raise InvalidRequestError(f"{str(path)!r} is not a Sphinx trie language model")
    buf = np.frombuffer(raw, dtype=np.uint8)
    pos = len(MAGIC)
    order = int(buf[pos])
    pos += 1
    counts = np.frombuffer(raw, "<u4", order, pos).astype(np.int64)
    pos += 4 * order
    tables: list[tuple[np.ndarray, np.ndarray | None]] = []
    if order > 1:
        pos += 4  # former quantisation type
        for _ in range(order - 2):
            prob = np.frombuffer(raw, "<f4", 1 << QUANT_BITS, pos)
            bo = np.frombuffer(raw, "<f4", 1 << QUANT_BITS, pos + 4 * (1 << QUANT_BITS))
            tables.append((prob, bo))
            pos += 8 * (1 << QUANT_BITS)
        tables.append((np.frombuffer(raw, "<f4", 1 << QUANT_BITS, pos), None))
        pos += 4 * (1 << QUANT_BITS)
    uni = np.frombuffer(raw, np.dtype([("prob", "<f4"), ("bo", "<f4"), ("next", "<u4")]),
                        int(counts[0]) + 1, pos)  # fmt: skip
    pos += uni.nbytes
    word_bits = _bits(int(counts[0]))
    arrays = []
    for n in range(2, order + 1):
        middle = n < order
        next_bits = _bits(int(counts[n])) if middle else 0
        total = word_bits + (2 * QUANT_BITS if middle else QUANT_BITS) + next_bits
        size = ((1 + int(counts[n - 1])) * total + 7) // 8 + 8
        arrays.append((pos, total, next_bits))
        pos += size
    nbytes = int(np.frombuffer(raw, "<i4", 1, pos)[0])
    words = raw[pos + 4:pos + 4 + nbytes].decode("utf-8", errors="replace").split("\0")[:-1]
    if len(words) != counts[0]:
        raise InvalidRequestError(f"{str(path)!r}: {len(words)} words for {counts[0]} unigrams")

    keep_word = np.ones(len(words), dtype=bool)
    if vocabulary is not None:
        allowed = set(vocabulary) | {"<s>", "</s>"}
        keep_word = np.array([w in allowed for w in words], dtype=bool)

    to10 = LOG10_OF_BASE
    ids = np.nonzero(keep_word)[0]
    ngrams: list[dict[tuple[str, ...], tuple[float, float]]] = [
        {(words[i],): (float(uni["prob"][i]) * to10, float(uni["bo"][i]) * to10) for i in ids.tolist()}
    ]
    # Walk down level by level: `paths` holds the word ids (w_n, w_{n-1}, ...) of the entries
    # below kept words and `begin`/`end` their children.
    nexts = uni["next"].astype(np.int64)
    begin, end = nexts[:-1], nexts[1:]
    paths = np.arange(len(words), dtype=np.int64)[:, None]
    alive = keep_word.copy()
    listed_keys = None  # keys of the n-grams listed at the previous level (n >= 2)
    for level, (base, total, next_bits) in enumerate(arrays):
        n = level + 2
        if max_order is not None and n > max_order:
            break
        middle = n < order
        begin, end, paths = begin[alive], end[alive], paths[alive]
        lens = end - begin
        owner = np.repeat(np.arange(len(begin)), lens)
        entry = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        entry += begin[owner]
        off = base * 8 + entry * total
        word = _read_field(buf, off, word_bits)
        prob_tab, bo_tab = tables[level]
        if middle:
            bo_code = _read_field(buf, off + word_bits, QUANT_BITS)
            prob_code = _read_field(buf, off + word_bits + QUANT_BITS, QUANT_BITS)
            nxt_off = off + word_bits + 2 * QUANT_BITS
            c_begin = _read_field(buf, nxt_off, next_bits)
            c_end = _read_field(buf, nxt_off + total, next_bits)
        else:
            prob_code = _read_field(buf, off + word_bits, QUANT_BITS)
        paths = np.concatenate([paths[owner], word[:, None]], axis=1)
        alive = keep_word[word]
        probs = prob_tab[prob_code] * to10
        listed = alive if min_log10_prob is None else alive & (probs >= min_log10_prob)
        # in text order w_1 .. w_n; an n-gram whose history was not listed is unreachable
        text_order = paths[:, ::-1]
        if listed_keys is not None:
            listed &= np.isin(_keys(text_order[:, :-1], len(words)), listed_keys)
        listed_keys = _keys(text_order[listed], len(words))
        bos = bo_tab[bo_code] * to10 if middle else np.zeros(len(word))
        table: dict[tuple[str, ...], tuple[float, float]] = {}
        sel = np.nonzero(listed)[0]
        for row, p, b in zip(text_order[sel].tolist(), probs[sel].tolist(), bos[sel].tolist(),
                             strict=True):  # fmt: skip
            table[tuple(words[i] for i in row)] = (p, b)
        ngrams.append(table)
        if middle:
            begin, end = c_begin, c_end
    return ArpaLM(ngrams)


def _keys(rows: np.ndarray, vocab: int) -> np.ndarray:
    """One integer per row of word ids (exact while vocab ** columns < 2 ** 63)."""
    key = np.zeros(rows.shape[0], dtype=np.int64)
    for c in range(rows.shape[1]):
        key = key * vocab + rows[:, c]
    return key
