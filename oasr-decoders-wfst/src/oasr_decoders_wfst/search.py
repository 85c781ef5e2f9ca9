"""The entry core calls (``decoder`` registry key ``"wfst"``, see ``oasr.decoders.graph_search``):
decode a batch of CTC log-probs over a graph image, graphs and decoders cached per process."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from oasr.errors import InvalidRequestError
from oasr_decoders_wfst.decoder import WfstDecoder, WfstHypothesis, WfstSearchOptions
from oasr_decoders_wfst.graph import WfstGraph, load_graph

_lock = threading.Lock()
_graphs: dict[tuple[str, float], WfstGraph] = {}
_decoders: dict[tuple[Any, ...], tuple[WfstDecoder, threading.Lock]] = {}


def _graph(path: str) -> WfstGraph:
    real = os.path.realpath(path)
    try:
        mtime = os.path.getmtime(real)
    except OSError:
        mtime = -1.0  # load_graph raises the typed error
    key = (real, mtime)
    with _lock:
        if key not in _graphs:
            _graphs.clear()  # one graph at a time: a changed file replaces the old one
            _decoders.clear()
            _graphs[key] = load_graph(real)
        return _graphs[key]


def graph_search(log_probs: Any, lengths: Sequence[int], *, graph: str, beam: float = 16.0,
                 max_active: int = 7000, acoustic_scale: float = 1.0) -> list[WfstHypothesis]:  # fmt: skip
    """One-best of each row of ``log_probs`` [B, T, V] over the graph image at ``graph``."""
    g = _graph(graph)
    if log_probs.shape[-1] != g.num_tokens:
        raise InvalidRequestError(
            f"the graph {graph!r} is built over {g.num_tokens} tokens, the model has "
            f"{log_probs.shape[-1]}: build it with the model's token table (oasr graph build --tokens)",
            param="wfst_graph",
        )
    opts = WfstSearchOptions(beam=beam, max_active=max_active, min_active=min(20, max_active - 1),
                             acoustic_scale=acoustic_scale)  # fmt: skip
    key = (id(g), str(log_probs.device), opts)
    with _lock:
        entry = _decoders.get(key)
        if entry is None:
            entry = _decoders[key] = (WfstDecoder(g, log_probs.device, opts), threading.Lock())
    dec, busy = entry
    with busy:  # a decoder's scratch buffers serve one call at a time
        return dec.decode(log_probs, lengths)
