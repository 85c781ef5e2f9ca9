"""The graph image: a decoding graph (TLG) as flat arrays, read with numpy alone.

One ``.npz`` file (no pickled objects) holding

========================  ===========  ==================================================
array                     dtype        meaning
========================  ===========  ==================================================
``header``                uint8        UTF-8 JSON: format, version, sizes, start state,
                                       tokens and words tables, how it was built
``state_offsets``         int64 [S+1]  arcs of state ``s`` are ``state_offsets[s]:[s+1]``
``next_states``           int32 [A]    destination state of each arc
``ilabels``               int32 [A]    input label: 0 = epsilon, ``t + 1`` = CTC token ``t``
                                       (token 0 is the blank)
``olabels``               int32 [A]    output label: 0 = epsilon, else a word id
``weights``               float32 [A]  arc cost (tropical: -log probability)
``final_weights``         float32 [S]  final cost; ``inf`` for a non-final state
========================  ===========  ==================================================

Arcs are sorted by source state (CSR). Decoding needs nothing but these arrays.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from oasr.errors import InvalidRequestError

FORMAT = "oasr-wfst-graph"
VERSION = 1


@dataclass
class WfstGraph:
    """A decoding graph. ``words[i]`` is the text of output label ``i`` (``words[0]`` is
    ``<eps>``); ``tokens[t]`` the unit of CTC token ``t`` (input label ``t + 1``)."""

    start: int
    state_offsets: np.ndarray
    next_states: np.ndarray
    ilabels: np.ndarray
    olabels: np.ndarray
    weights: np.ndarray
    final_weights: np.ndarray
    tokens: list[str]
    words: list[str]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_states(self) -> int:
        return int(self.final_weights.shape[0])

    @property
    def num_arcs(self) -> int:
        return int(self.next_states.shape[0])

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` when the arrays do not make one graph."""
        s, a = self.num_states, self.num_arcs
        off = self.state_offsets
        problems = []
        if off.shape != (s + 1,) or off[0] != 0 or off[-1] != a or np.any(np.diff(off) < 0):
            problems.append("state_offsets is not a CSR index over the arcs")
        for name in ("ilabels", "olabels", "weights"):
            if getattr(self, name).shape != (a,):
                problems.append(f"{name} has {getattr(self, name).shape[0]} entries for {a} arcs")
        if a and (self.next_states.min() < 0 or self.next_states.max() >= s):
            problems.append("an arc leads to a state that does not exist")
        if a and (self.ilabels.min() < 0 or self.ilabels.max() > self.num_tokens):
            problems.append(f"an input label is outside 0..{self.num_tokens} (tokens + 1)")
        if a and (self.olabels.min() < 0 or self.olabels.max() >= len(self.words)):
            problems.append("an output label has no entry in the words table")
        if not 0 <= self.start < max(s, 1):
            problems.append(f"start state {self.start} does not exist")
        if problems:
            raise InvalidRequestError("not a valid WFST graph image: " + "; ".join(problems),
                                      param="wfst_graph")

    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "num_states": self.num_states,
            "num_arcs": self.num_arcs,
            "start": self.start,
            "blank_token": 0,
            "labels": "ilabel 0 = epsilon, ilabel t+1 = CTC token t; olabel 0 = epsilon, "
                      "olabel w = words[w]",
            "tokens": self.tokens,
            "words": self.words,
            "info": self.info,
        }  # fmt: skip


def save_graph(graph: WfstGraph, path: str | Path) -> Path:
    """Write ``graph`` as a graph image (``.npz``, see the module documentation)."""
    graph.validate()
    path = Path(path)
    header = json.dumps(graph.header(), ensure_ascii=False).encode("utf-8")
    with open(path, "wb") as fh:  # np.savez would append .npz to a name without it
        np.savez(
            fh,
            header=np.frombuffer(header, dtype=np.uint8),
            state_offsets=graph.state_offsets.astype(np.int64, copy=False),
            next_states=graph.next_states.astype(np.int32, copy=False),
            ilabels=graph.ilabels.astype(np.int32, copy=False),
            olabels=graph.olabels.astype(np.int32, copy=False),
            weights=graph.weights.astype(np.float32, copy=False),
            final_weights=graph.final_weights.astype(np.float32, copy=False),
        )
    return path


def load_graph(path: str | Path) -> WfstGraph:
    """Read a graph image written by :func:`save_graph` (``oasr graph build``)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"WFST graph image {str(path)!r} does not exist; build one with "
                                  f"`oasr graph build`", param="wfst_graph")  # fmt: skip
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        header = json.loads(arrays.pop("header").tobytes().decode("utf-8"))
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidRequestError(f"{str(path)!r} is not a WFST graph image: {exc}",
                                  param="wfst_graph") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise InvalidRequestError(
            f"{str(path)!r} is not a {FORMAT} version {VERSION} image "
            f"(format {header.get('format')!r}, version {header.get('version')!r})",
            param="wfst_graph",
        )
    missing = {"state_offsets", "next_states", "ilabels", "olabels", "weights",
               "final_weights"} - set(arrays)  # fmt: skip
    if missing:
        raise InvalidRequestError(f"{str(path)!r} lacks arrays {sorted(missing)}", param="wfst_graph")
    graph = WfstGraph(
        start=int(header["start"]),
        tokens=list(header["tokens"]),
        words=list(header["words"]),
        info=dict(header.get("info", {})),
        **arrays,
    )
    graph.validate()
    return graph


def from_arrays(start: int, sources: np.ndarray, next_states: np.ndarray, ilabels: np.ndarray,
                olabels: np.ndarray, weights: np.ndarray, final_weights: np.ndarray,
                tokens: list[str], words: list[str], info: dict[str, Any] | None = None
                ) -> WfstGraph:  # fmt: skip
    """A graph from an arc list in any order (sorted here by source state, stably)."""
    sources = np.asarray(sources, dtype=np.int64)
    order = np.argsort(sources, kind="stable")
    num_states = int(np.asarray(final_weights).shape[0])
    counts = np.bincount(sources, minlength=num_states)
    offsets = np.zeros(num_states + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return WfstGraph(
        start=int(start),
        state_offsets=offsets,
        next_states=np.asarray(next_states, dtype=np.int32)[order],
        ilabels=np.asarray(ilabels, dtype=np.int32)[order],
        olabels=np.asarray(olabels, dtype=np.int32)[order],
        weights=np.asarray(weights, dtype=np.float32)[order],
        final_weights=np.asarray(final_weights, dtype=np.float32),
        tokens=list(tokens),
        words=list(words),
        info=dict(info or {}),
    )


INF = math.inf
