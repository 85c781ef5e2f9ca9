"""WeNet's own decoding options (``DecodingOptions.model_options`` for WeNet U2/U2++ models).

Declared once here; :mod:`oasr.options` parses them from any surface and refuses unknown names.
Each loaded model holds its defaults (``WenetASR.default_options``: WeNet's recipe values, the
checkpoint's static chunk, the native checkpoint's ``decoding`` section); a request overrides
them. The names follow WeNet's ``decode.py`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from oasr.decoders.graph_search import GraphSearchOptions
from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.options import ResolvedOptions, option

DecodingMethod = Literal[
    "auto", "ctc_greedy_search", "ctc_prefix_beam_search", "attention_rescoring", "attention"
]


@dataclass(frozen=True)
class WenetOptions(GraphSearchOptions):  # + wfst_graph & co.: CTC over a WFST graph
    family = "wenet"

    decoding_method: DecodingMethod = option(
        "auto",
        doc="Offline search: ctc_greedy_search, ctc_prefix_beam_search (beam_size wide), "
            "attention_rescoring (prefix beam n-best rescored by the attention decoders), "
            "attention (decoder beam search, no word times); auto: ctc_greedy_search at "
            "beam_size 1, attention_rescoring above. Streaming: greedy at beam_size 1, prefix "
            "beam search then attention rescoring at the end above.",
    )  # fmt: skip
    ctc_weight: float = option(
        0.3, ge=0, doc="Attention rescoring: weight of the CTC prefix score added to the decoder score."
    )
    reverse_weight: float = option(
        0.0, ge=0, le=1,
        doc="Attention rescoring, U2++: weight of the right-to-left decoder (0.5 by default on "
            "U2++ models; models without that decoder refuse a value above 0).",
    )  # fmt: skip
    chunk_size: int = option(
        16, gt=0,
        doc="Streaming: encoder frames per chunk (default: the checkpoint's static chunk, "
            "else 16).",
    )  # fmt: skip
    num_left_chunks: int = option(
        -1, ge=-1, doc="Streaming: chunks of left context kept in the attention cache; -1: all."
    )
    decoding_chunk_size: int = option(
        -1, ge=-1,
        doc="Offline: -1 attends over the whole input; N > 0 encodes with a chunk mask of N "
            "frames, as the stream would (models trained with chunk masks only; a static-chunk "
            "model always uses its own chunk).",
    )  # fmt: skip
    num_decoding_left_chunks: int = option(
        -1, ge=-1, doc="Offline with decoding_chunk_size > 0: chunks of left context; -1: all."
    )
    hotwords_score: float = option(
        1.5, gt=0, le=100,
        doc="Hotwords: bonus per matched token in the CTC prefix beam search (WeNet's "
            "context_score); a hotword may carry its own as 'PHRASE :SCORE'.",
    )  # fmt: skip

    def validate(self) -> None:
        if self.decoding_chunk_size == 0:
            raise InvalidRequestError(
                "decoding_chunk_size must be -1 (whole input) or a positive chunk size",
                param="decoding_chunk_size",
            )

    def resolve(self, options: Any) -> ResolvedOptions:
        resolved = super().resolve(options)
        method = resolved.decoding_method
        if resolved.hotwords and method in ("ctc_greedy_search", "attention"):
            # refused before any work: hotwords bias the CTC prefix beam search
            raise UnsupportedOptionError(
                f"hotwords bias the CTC prefix beam search; decoding_method {method} cannot use "
                "them (use auto, ctc_prefix_beam_search or attention_rescoring)", param="hotwords")
        return resolved
