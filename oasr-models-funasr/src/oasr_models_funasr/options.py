"""Paraformer's own decoding options (``DecodingOptions.model_options`` for FunASR models)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from oasr.options import ModelOptions, option


@dataclass(frozen=True)
class ParaformerOptions(ModelOptions):
    family = "funasr"

    long_form: Literal["auto", "vad", "off"] = option(
        "auto",
        doc="auto: inputs longer than max_segment_s are cut at VAD (Silero) speech segments and "
            "all segments run as one batch; vad: every input is cut so; off: every input is "
            "decoded whole.",
    )  # fmt: skip
    max_segment_s: float = option(
        30.0, gt=0, doc="Longest piece decoded at once; longer VAD speech segments are split."
    )
