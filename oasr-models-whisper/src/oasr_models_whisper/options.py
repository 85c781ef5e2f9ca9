"""Whisper's own decoding options (``DecodingOptions.model_options`` for Whisper models).

Declared once here; :mod:`oasr.options` parses them from any surface and refuses unknown names.
The defaults are openai-whisper's ``transcribe()`` defaults. Whisper code resolves a request's
options once at its entry (:func:`whisper_options`) and reads common and Whisper options as
attributes of the result (``options.beam_size``, ``options.no_speech_threshold``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from oasr.errors import InvalidRequestError
from oasr.options import ModelOptions, ResolvedOptions, option
from oasr.types import DecodingOptions

#: what Whisper's decoding functions take: a request's options, resolved or not (they resolve
#: them with :func:`whisper_options` on entry)
RequestOptions = DecodingOptions | ResolvedOptions


@dataclass(frozen=True)
class WhisperOptions(ModelOptions):
    family = "whisper"

    patience: float | None = option(
        None, gt=0,
        doc="Beam search: a window ends once round(beam_size * patience) hypotheses finished "
            "(unset: beam_size).",
    )  # fmt: skip
    length_penalty: float | None = option(
        None, ge=0, le=1,
        doc="Beam ranking: ((5 + length) / 6) ** length_penalty divides the summed log "
            "probability (unset: divide by the length).",
    )  # fmt: skip
    compression_ratio_threshold: float | None = option(
        2.4, doc="Temperature fallback when a window's gzip compression ratio is above this "
                 "(repetitive output); none: never.",
    )  # fmt: skip
    logprob_threshold: float | None = option(
        -1.0, doc="Temperature fallback when a window's average token log probability is "
                  "below this; none: never.",
    )  # fmt: skip
    no_speech_threshold: float | None = option(
        0.6, ge=0, le=1,
        doc="A window whose no-speech probability is above this (and whose log probability "
            "is below logprob_threshold) is silence; none turns every no-speech rule off, the "
            "VAD gate and the digital-silence skip included.",
    )  # fmt: skip
    condition_on_previous_text: bool = option(
        True, doc="Sequential long-form: the text decoded so far prompts the next window."
    )
    suppress_tokens: tuple[int, ...] | None = option(
        (-1,), doc="Token ids never sampled; -1 stands for the checkpoint's non-speech symbols; "
                   "empty: none.",
    )  # fmt: skip
    suppress_blank: bool = option(
        True, doc="Suppress a blank (space) or end-of-text as the first sampled token."
    )
    without_timestamps: bool = option(
        False, doc="Decode without timestamp tokens (one segment per 30 s window)."
    )
    long_form: Literal["sequential", "vad"] = option(
        "sequential",
        doc="Audio over 30 s: sequential (seek window by window, conditioned on previous "
            "text, as openai-whisper) or vad (cut at VAD speech segments, decode them as one "
            "batch: faster, no cross-window context).",
    )  # fmt: skip
    vad_gate: bool = option(
        True,
        doc="Sequential long-form: an input in which a VAD finds no speech gets an empty "
            "transcript instead of being decoded (Whisper invents words on music and noise). "
            "Needs a vad_detector plugin (oasr-vad-silero); skipped with a warning without "
            "one; off when no_speech_threshold is none.",
    )  # fmt: skip

    def validate(self) -> None:
        if self.suppress_tokens is not None and any(t < -1 for t in self.suppress_tokens):
            raise InvalidRequestError(
                "suppress_tokens are token ids (>= 0) or -1 for the non-speech symbols",
                param="suppress_tokens",
            )


#: the defaults every Whisper checkpoint starts from
DEFAULT_OPTIONS = WhisperOptions()


def whisper_options(options: RequestOptions) -> ResolvedOptions:
    """``options`` (a ``DecodingOptions``, or already resolved) with Whisper's options
    resolved; cheap when they already are."""
    return DEFAULT_OPTIONS.resolve(options)
