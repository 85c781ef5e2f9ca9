"""Generic decoders shared by model families (registered on the ``decoder`` axis by core).

``oasr.decoders.ctc``: CTC greedy, CTC prefix beam search (offline and incremental), U2/U2++
attention rescoring, token / word timestamps and confidences from the CTC alignment.
``oasr.decoders.transducer``: RNN-T greedy (icefall / NeMo), icefall's modified beam search and
NeMo's TDT greedy over a family's ``TransducerNetwork`` (offline and incremental).
``oasr.decoders.hypothesis``: the ``Hypothesis`` every one of them returns. Importing this package
imports nothing heavy; the functions import torch when called.
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
from oasr.decoders.hypothesis import Hypothesis
from oasr.decoders.transducer import (
    TDTGreedySearch,
    TransducerGreedySearch,
    TransducerModifiedBeamSearch,
    TransducerNetwork,
    duration_token_timestamps,
    tdt_greedy_search,
    transducer_greedy_search,
    transducer_modified_beam_search,
)

__all__ = [
    "CTCGreedySearch",
    "CTCHypothesis",
    "CTCPrefixBeamSearch",
    "Hypothesis",
    "RescoringResult",
    "TDTGreedySearch",
    "TokenTiming",
    "TransducerGreedySearch",
    "TransducerModifiedBeamSearch",
    "TransducerNetwork",
    "attention_rescoring",
    "build_rescoring_inputs",
    "ctc_greedy_search",
    "ctc_prefix_beam_search",
    "duration_token_timestamps",
    "group_words",
    "log_add",
    "tdt_greedy_search",
    "token_timestamps",
    "transducer_greedy_search",
    "transducer_modified_beam_search",
]
