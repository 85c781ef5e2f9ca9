"""FastConformer decoding options (``DecodingOptions.model_options`` for the NeMo family).

Declared once; :mod:`oasr.options` parses them from every surface. ``beam_size`` (common) picks
greedy (1) or beam search (CTC prefix beam, RNN-T modified beam) above 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from oasr.options import ModelOptions, option


@dataclass(frozen=True)
class NemoOptions(ModelOptions):
    family = "nemo"

    max_symbols_per_frame: int = option(
        10, gt=0,
        doc="Transducer greedy: most tokens emitted at one encoder frame before moving on "
            "(NeMo's max_symbols; the checkpoint's value by default).",
    )  # fmt: skip
    local_attention_window: int = option(
        -1, ge=-1,
        doc="Offline encoder attention: -1 (auto) full attention up to "
            "full_attention_max_frames encoder frames and local attention of 256 frames each "
            "side beyond (long audio, no length cap); 0 always full attention; N > 0 always "
            "local attention of N frames each side (NeMo's rel_pos_local_attn).",
    )  # fmt: skip
    full_attention_max_frames: int = option(
        6000, gt=0,
        doc="Auto local attention: longest input (encoder frames, 80 ms each) encoded with "
            "full attention.",
    )  # fmt: skip
    lookahead: int = option(
        -1, ge=-1,
        doc="Nemotron streaming: right attention context in encoder frames (one of the "
            "lookaheads the checkpoint was trained with; -1: its default). A chunk is "
            "lookahead + 1 frames.",
    )  # fmt: skip
