"""CTC decoding over a WFST graph (TLG), for every CTC family at once.

A CTC family's options subclass :class:`GraphSearchOptions` (instead of
:class:`~oasr.options.ModelOptions`), which adds ``wfst_graph`` and the search's settings, and
its decode path makes one call: when :func:`graph_search_requested` it returns
:func:`graph_transcripts` over its CTC log-probabilities instead of running its own search. The
search is a plugin's: whatever the ``decoder`` registry holds under ``"wfst"`` (first party:
``oasr-decoders-wfst``), called as::

    search(log_probs, lengths, *, graph, beam, max_active, acoustic_scale) -> list[hyp]

with ``log_probs`` a [B, T, V] tensor on the model's device and each ``hyp`` having ``words``
(text) and ``word_frames`` (the frame of the arc that output each word). Core imports nothing
heavy here until a request sets ``wfst_graph``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oasr.options import ModelOptions, option
from oasr.types import Segment, Transcript, Word

DECODER_KEY = "wfst"


@dataclass(frozen=True)
class GraphSearchOptions(ModelOptions):
    """Options of decoding over a WFST graph, shared by the CTC families."""

    wfst_graph: str | None = option(
        None,
        doc="Path of a decoding graph image (`oasr graph build`, oasr-decoders-wfst): decode "
            "the CTC output over it (lexicon + n-gram LM) instead of the CTC search; the "
            "graph's token table must be the model's.",
    )  # fmt: skip
    wfst_beam: float = option(16.0, gt=0, doc="WFST search: beam (cost units).")
    wfst_max_active: int = option(7000, ge=2, doc="WFST search: most tokens kept per frame.")
    acoustic_scale: float = option(1.0, gt=0, doc="WFST search: scale of the CTC log-probs.")


def graph_search_requested(options: Any) -> bool:
    """True when the request's resolved options name a graph."""
    return bool(getattr(options, "wfst_graph", None))


def graph_transcripts(log_probs: Any, lengths: Sequence[int], options: Any,
                      durations: Sequence[float], frame_shift: float,
                      language: str | None = None) -> list[Transcript]:  # fmt: skip
    """One :class:`Transcript` per row of ``log_probs`` [B, T, V] (CTC log-probabilities, blank
    at 0) decoded over ``options.wfst_graph``. Words are joined with spaces (with nothing for
    Chinese, Japanese and Cantonese, ``language`` "zh" / "ja" / "yue"); a word starts at
    its frame and ends where the next one starts (the last at the utterance's end); its
    confidence is the highest non-blank posterior at its frame."""
    from oasr.plugins import resolve

    search = resolve("decoder", DECODER_KEY)
    lengths = [int(n) for n in lengths]
    hyps = search(log_probs, lengths, graph=options.wfst_graph, beam=options.wfst_beam,
                  max_active=options.wfst_max_active, acoustic_scale=options.acoustic_scale)  # fmt: skip
    peaks = log_probs[..., 1:].max(dim=-1).values.float().cpu()  # [B, T]
    out = []
    for b, hyp in enumerate(hyps):
        duration = float(durations[b])
        text = ("" if language in ("zh", "ja", "yue") else " ").join(hyp.words)
        words = []
        for i, (w, f) in enumerate(zip(hyp.words, hyp.word_frames, strict=True)):
            start = min(f * frame_shift, duration)
            nxt = hyp.word_frames[i + 1] if i + 1 < len(hyp.words) else lengths[b]
            end = min(max(nxt, f + 1) * frame_shift, duration)
            conf = math.exp(float(peaks[b, min(f, max(lengths[b] - 1, 0))])) if lengths[b] else 0.0
            words.append(Word(w, round(start, 3), round(end, 3), round(conf, 4)))
        seg = Segment(id=0, start=0.0, end=round(duration, 3), text=text, words=words)
        out.append(Transcript(text=text, language=language, duration=duration,
                              segments=[seg] if text else []))  # fmt: skip
    return out


def refuse_graph_search_streaming(options: Any) -> None:
    """Streams do not decode over a graph yet: a streaming request naming one is refused."""
    if graph_search_requested(options):
        from oasr.errors import UnsupportedOptionError

        raise UnsupportedOptionError("wfst_graph decodes offline requests only; streams use the "
                                     "CTC search", param="wfst_graph")  # fmt: skip
