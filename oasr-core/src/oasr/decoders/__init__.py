"""Generic decoders shared by model families (registered on the ``decoder`` axis by core).

``oasr.decoders.ctc``: CTC greedy, CTC prefix beam search (offline and incremental), U2/U2++
attention rescoring, token / word timestamps and confidences from the CTC alignment. Importing
this package imports nothing heavy; the functions import torch when called.
"""

from __future__ import annotations

from oasr.decoders.ctc import (
    CTCGreedySearch,
    CTCHypothesis,
    CTCPrefixBeamSearch,
    RescoringResult,
    TokenTiming,
    attention_rescoring,
    build_rescoring_inputs,
    ctc_greedy_search,
    ctc_prefix_beam_search,
    group_words,
    log_add,
    token_timestamps,
)

__all__ = [
    "CTCGreedySearch",
    "CTCHypothesis",
    "CTCPrefixBeamSearch",
    "RescoringResult",
    "TokenTiming",
    "attention_rescoring",
    "build_rescoring_inputs",
    "ctc_greedy_search",
    "ctc_prefix_beam_search",
    "group_words",
    "log_add",
    "token_timestamps",
]
