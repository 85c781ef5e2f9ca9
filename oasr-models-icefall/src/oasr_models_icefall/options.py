"""icefall's decoding options (``DecodingOptions.model_options`` for icefall models), named as
icefall's ``decode.py`` / ``streaming_decode.py`` flags. Declared once; :mod:`oasr.options`
parses them from every surface and refuses unknown names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from oasr.decoders.graph_search import GraphSearchOptions
from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.options import ResolvedOptions, option

DecodingMethod = Literal[
    "auto", "greedy_search", "modified_beam_search", "ctc_greedy_search", "ctc_prefix_beam_search"
]


@dataclass(frozen=True)
class IcefallOptions(GraphSearchOptions):  # + wfst_graph & co.: CTC over a WFST graph
    family = "icefall"

    decoding_method: DecodingMethod = option(
        "auto",
        doc="greedy_search / modified_beam_search (transducer), ctc_greedy_search / "
            "ctc_prefix_beam_search (CTC head); auto: the model's head, greedy at beam_size 1, "
            "beam search of beam_size above.",
    )  # fmt: skip
    max_sym_per_frame: int = option(
        1, ge=1, le=100, doc="Transducer greedy search: symbols emitted per encoder frame at most."
    )
    blank_penalty: float = option(
        0.0, ge=0, doc="Subtracted from the blank logit before the search (icefall --blank-penalty)."
    )
    chunk_size: int = option(
        16, ge=-1,
        doc="Causal models: 50 Hz frames per chunk (16 = 320 ms), for streams and, masked, for "
            "offline decoding; -1 decodes offline with full context.",
    )  # fmt: skip
    left_context_frames: int = option(
        128, ge=0, doc="Causal models: 50 Hz frames of left context each chunk attends to."
    )
    hotwords_score: float = option(
        1.5, gt=0, le=100,
        doc="Hotwords: bonus per matched token (sherpa-onnx --hotwords-score); a hotword may "
            "carry its own as 'PHRASE :SCORE'.",
    )  # fmt: skip

    def validate(self) -> None:
        if self.chunk_size == 0:
            raise InvalidRequestError("chunk_size must be -1 (full context) or a positive number "
                                      "of 50 Hz frames", param="chunk_size")

    def resolve(self, options: Any) -> ResolvedOptions:
        resolved = super().resolve(options)
        method = resolved.decoding_method
        if resolved.hotwords and method in ("greedy_search", "ctc_greedy_search"):
            # refused before any work: greedy search has no beam to bias
            raise UnsupportedOptionError(
                f"hotwords need a beam search; {method} cannot use them (use "
                "decoding_method auto or a beam search)", param="hotwords")
        return resolved
