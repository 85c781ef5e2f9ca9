"""Hotword context graphs: an Aho-Corasick automaton over token ids that scores how far a
hypothesis has matched one of a request's hotwords (context biasing, "hotwords").

The semantics are those of icefall's and sherpa-onnx's ``ContextGraph`` (non-strict mode):

- every token that extends a match earns the phrase's per-token boost (``boost``; a phrase may
  carry its own);
- a token that breaks a partial match follows the automaton's failure links to the longest
  suffix that is still a prefix of some phrase, and the bonus given for the abandoned part is
  taken back (the step's bonus is ``node_score(new) - node_score(old)``, negative on a
  mismatch);
- a completed phrase keeps its bonus (the sum of its tokens' boosts) and the match restarts at
  the root; where several phrases end at once, the longest counts;
- at the end of decoding :meth:`ContextGraph.finalize` takes back the bonus of a partial match
  that never completed.

A state is an ``int`` (0 is the root), so a hypothesis carries it for nothing and the GPU search
can use the same graph as tensors (:meth:`ContextGraph.tables`). Phrases that share a prefix
share states; a shared state keeps the largest of the phrases' boosts.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from oasr.decoders.ctc import _is_cjk
from oasr.errors import InvalidRequestError

__all__ = ["DEFAULT_HOTWORD_BOOST", "ContextGraph", "ContextTables", "PieceEncoder",
           "parse_hotwords"]

#: per-token bonus (natural-log units) when a request gives no other (sherpa-onnx's default)
DEFAULT_HOTWORD_BOOST = 1.5

_BOOST_SUFFIX = re.compile(r"^(.*\S)\s+:\s*([-+]?[0-9]*\.?[0-9]+)\s*$")


def parse_hotwords(hotwords: Sequence[str], boost: float = DEFAULT_HOTWORD_BOOST
                   ) -> list[tuple[str, float]]:  # fmt: skip
    """``(phrase, per-token boost)`` for each hotword. A hotword may end in ``" :SCORE"``
    (sherpa-onnx's hotwords-file syntax, ``"OASR :3.0"``) to carry its own boost; empty ones are
    dropped."""
    out = []
    for raw in hotwords:
        text = str(raw).strip()
        if not text:
            continue
        m = _BOOST_SUFFIX.match(text)
        score = boost
        if m:
            text, score = m.group(1).strip(), float(m.group(2))
        if not 0 < score <= 100:
            raise InvalidRequestError(
                f"a hotword boost must be > 0 and at most 100, not {score} ({raw!r})",
                param="hotwords",
            )
        out.append((text, score))
    return out


@dataclass
class ContextTables:
    """A graph as flat arrays (what the GPU search gathers from), state ids 0..n-1.

    ``keys`` (sorted ``state * vocab + token``), ``next``, ``bonus``: for a non-root state,
    every token whose transition is not to the root, with :meth:`ContextGraph.step`'s exact
    result. The root's children are keyed by the token alone and hold the bonus before
    subtracting the current state's ``node_score``: look a (state, token) up by its own key,
    then by the token; found nowhere, the step goes to the root with bonus
    ``-node_score[state]``."""

    keys: list[int]
    next: list[int]
    bonus: list[float]
    node_score: list[float]


class ContextGraph:
    """Aho-Corasick automaton over token-id phrases with per-token boosts."""

    def __init__(self, phrases: Sequence[Sequence[int]], boost: float = DEFAULT_HOTWORD_BOOST,
                 boosts: Sequence[float] | None = None) -> None:
        if boosts is not None and len(boosts) != len(phrases):
            raise ValueError("boosts must have one value per phrase")
        self.boost = float(boost)
        # per state: children, token score, accumulated score, output score, end flag, fail, output
        self.children: list[dict[int, int]] = [{}]
        self.token_score: list[float] = [0.0]
        self.node_score: list[float] = [0.0]
        self.output_score: list[float] = [0.0]
        self.is_end: list[bool] = [False]
        self.fail: list[int] = [0]
        self.output: list[int] = [-1]
        self.num_phrases = 0
        for i, phrase in enumerate(phrases):
            tokens = [int(t) for t in phrase]
            if tokens:
                self._insert(tokens, self.boost if boosts is None else float(boosts[i]))
                self.num_phrases += 1
        self._link()

    @classmethod
    def from_hotwords(cls, hotwords: Sequence[str], encode: Callable[[str], Sequence[int]],
                      boost: float = DEFAULT_HOTWORD_BOOST) -> ContextGraph:
        """A graph of ``hotwords`` (``"PHRASE"`` or ``"PHRASE :BOOST"``), each tokenized with
        ``encode`` (the model's tokenizer)."""
        phrases, boosts = [], []
        for text, score in parse_hotwords(hotwords, boost):
            ids = list(encode(text))
            if ids:
                phrases.append(ids)
                boosts.append(score)
        return cls(phrases, boost, boosts)

    # -- construction ----------------------------------------------------------------------------
    def _new_state(self) -> int:
        self.children.append({})
        self.token_score.append(0.0)
        self.node_score.append(0.0)
        self.output_score.append(0.0)
        self.is_end.append(False)
        self.fail.append(0)
        self.output.append(-1)
        return len(self.children) - 1

    def _insert(self, tokens: list[int], score: float) -> None:
        node = 0
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            nxt = self.children[node].get(token)
            if nxt is None:
                nxt = self._new_state()
                self.children[node][token] = nxt
                self.token_score[nxt] = score
            else:  # a shared state keeps the larger boost
                self.token_score[nxt] = max(score, self.token_score[nxt])
            self.node_score[nxt] = self.node_score[node] + self.token_score[nxt]
            self.is_end[nxt] = self.is_end[nxt] or last
            self.output_score[nxt] = self.node_score[nxt] if self.is_end[nxt] else 0.0
            node = nxt

    def _link(self) -> None:
        """Failure links (breadth first) and output links (the nearest phrase end on the
        failure chain), with output scores accumulated along them."""
        queue = deque(self.children[0].values())
        while queue:
            node = queue.popleft()
            for token, child in self.children[node].items():
                f = self.fail[node]
                while True:
                    if token in self.children[f] and self.children[f][token] != child:
                        f = self.children[f][token]
                        break
                    if f == 0:
                        break
                    f = self.fail[f]
                self.fail[child] = f
                out = f
                while out != 0 and not self.is_end[out]:
                    out = self.fail[out]
                self.output[child] = out if out != 0 else -1
                if out != 0:
                    self.output_score[child] += self.output_score[out]
                queue.append(child)

    # -- search ----------------------------------------------------------------------------------
    @property
    def num_states(self) -> int:
        return len(self.children)

    def goto(self, state: int, token: int) -> int:
        """The automaton's transition: the child for ``token`` of the first state on
        ``state``'s failure chain that has one, else the root."""
        while True:
            nxt = self.children[state].get(token)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = self.fail[state]

    def _arrive(self, node: int) -> tuple[float, int]:
        """(bonus adjustment on reaching ``node``, state to continue from): where a phrase ends
        (``node`` or its output link), the match counts the longest such phrase and restarts at
        the root."""
        if self.output_score[node] != 0:
            end = node if self.is_end[node] else self.output[node]
            return self.node_score[end] - self.node_score[node], 0
        return 0.0, node

    def step(self, state: int, token: int) -> tuple[float, int]:
        """Feed ``token`` in ``state``: ``(bonus, next state)``."""
        child = self.children[state].get(token)
        if child is not None:  # the match goes on: this token's boost
            node, score = child, self.token_score[child]
        else:  # back off along the failure links: take back what the lost part earned
            node = self.goto(state, token)
            score = self.node_score[node] - self.node_score[state]
        extra, nxt = self._arrive(node)
        return score + extra, nxt

    def finalize(self, state: int) -> float:
        """Bonus to take back at the end of decoding (a partial match that never completed)."""
        return -self.node_score[state]

    def tables(self, vocab_size: int) -> ContextTables:
        """The graph as sorted lookup tables (see :class:`ContextTables`); made once per
        vocabulary size (a graph does not change after construction)."""
        cache = self.__dict__.setdefault("_tables", {})
        if vocab_size not in cache:
            cache[vocab_size] = self._make_tables(vocab_size)
        return cache[vocab_size]

    def _make_tables(self, vocab_size: int) -> ContextTables:
        entries: dict[int, tuple[int, float]] = {}
        for s in range(1, self.num_states):
            f = s
            while f != 0:  # children on the failure chain, nearest first; not the root's
                for token in self.children[f]:
                    key = s * vocab_size + token
                    if key not in entries:
                        entries[key] = self.step(s, token)[::-1]
                f = self.fail[f]
        for token, child in self.children[0].items():  # s-independent part of a root child
            extra, nxt = self._arrive(child)
            entries[token] = (nxt, self.node_score[child] + extra)
        order = sorted(entries)
        return ContextTables(order, [entries[k][0] for k in order],
                             [entries[k][1] for k in order], list(self.node_score))


class PieceEncoder:
    """Spells hotwords with a model's piece table (id -> piece, sentencepiece-style ``\u2581``
    word starts, or characters): each word as the fewest pieces that cover it exactly, tried
    as written, upper-cased, then lower-cased (BPE tables are often one case), with and without
    the word-start mark. Families whose tokenizer only decodes use this to tokenize hotwords."""

    def __init__(self, pieces: Sequence[str], word_start: str = "\u2581") -> None:
        self.index: dict[str, int] = {}
        for i, p in enumerate(pieces):
            if p and not (p.startswith("<") and p.endswith(">")) and p not in self.index:
                self.index[p] = i
        self.word_start = word_start
        self.longest = max((len(p) for p in self.index), default=1)

    def __call__(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in text.split():
            cjk = all(_is_cjk(ch) for ch in word)  # characters carry no word-start mark
            for variant in dict.fromkeys((word, word.upper(), word.lower())):
                marked = self._spell(self.word_start + variant)
                plain = self._spell(variant)
                got = (plain or marked) if cjk else (marked or plain)
                if got:
                    ids += got
                    break
            else:
                raise InvalidRequestError(
                    f"hotword {text!r}: the model's vocabulary cannot spell {word!r}",
                    param="hotwords",
                )
        return ids

    def _spell(self, s: str) -> list[int] | None:
        """Fewest pieces covering ``s`` exactly (dynamic programming), or None."""
        n = len(s)
        best: list[list[int] | None] = [None] * (n + 1)
        best[0] = []
        for a in range(n):
            if best[a] is None:
                continue
            for b in range(a + 1, min(n, a + self.longest) + 1):
                pid = self.index.get(s[a:b])
                if pid is not None and (best[b] is None or len(best[a]) + 1 < len(best[b])):
                    best[b] = [*best[a], pid]
        return best[n]


def context_graph_for(hotwords: Sequence[str] | None, encode: Callable[[str], Sequence[int]],
                      boost: float = DEFAULT_HOTWORD_BOOST) -> ContextGraph | None:
    """A request's graph (hotwords tokenized with ``encode``), or ``None`` without hotwords."""
    if not hotwords:
        return None
    graph = ContextGraph.from_hotwords(hotwords, encode, boost)
    return graph if graph.num_phrases else None
