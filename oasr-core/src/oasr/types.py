"""Core contracts: the small typed vocabulary every package speaks.

Everything here is plain dataclasses and enums (no torch), so it is cheap to import from the CLI,
the server and third-party plugins alike.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from oasr.errors import InvalidRequestError, UnsupportedOptionError


class DecodeFamily(str, enum.Enum):
    """How a model turns encoder output into tokens; decides which decoders apply."""

    CTC = "ctc"
    TRANSDUCER = "transducer"
    AED = "aed"  # attention encoder-decoder (Whisper)
    CIF = "cif"  # continuous integrate-and-fire, non-autoregressive (Paraformer)
    LLM = "llm"  # speech-LLM (Qwen2-Audio)


@dataclass(frozen=True)
class ModelCapabilities:
    """What an architecture can do; the engine and server refuse what is not listed."""

    decode_family: DecodeFamily
    offline: bool = True
    streaming: bool = False
    word_timestamps: bool = False
    translation: bool = False
    language_detection: bool = False
    multilingual: bool = False


@dataclass(frozen=True)
class FeatureSpec:
    """Describes a feature frontend exactly enough to reproduce a checkpoint's training features.

    ``kind`` is a key in the feature-extractor registry ("whisper_logmel", "kaldi_fbank", ...);
    ``options`` holds that frontend's parameters (window, hop, dither, CMVN stats path, ...).
    """

    kind: str
    sample_rate: int = 16000
    num_bins: int = 80
    hop_length: int = 160
    win_length: int = 400
    n_fft: int = 400
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop_length


@dataclass(frozen=True)
class TokenizerSpec:
    """Names a tokenizer implementation and where its assets live inside a checkpoint."""

    kind: str  # registry key: "whisper_bpe", "sentencepiece", "char_units", ...
    files: dict[str, str] = field(default_factory=dict)  # role -> path
    options: dict[str, Any] = field(default_factory=dict)


Task = Literal["transcribe", "translate"]


@dataclass
class DecodingOptions:
    """Per-request decoding choices. Validation here is family-independent; a model refuses
    what its capabilities do not cover via :meth:`check_supported`."""

    beam_size: int = 1  # 1 = greedy
    patience: float | None = None
    length_penalty: float | None = None
    language: str | None = None
    task: Task = "transcribe"
    temperature: float | tuple[float, ...] = 0.0
    prompt: str | None = None
    word_timestamps: bool = False
    without_timestamps: bool = False
    max_new_tokens: int | None = None
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    suppress_tokens: tuple[int, ...] | None = (-1,)
    suppress_blank: bool = True
    hotwords: tuple[str, ...] | None = None  # not supported by any family yet: refused
    #: How audio longer than one model window is handled: "sequential" (seek window by window,
    #: conditioned on previous text, as openai-whisper does) or "vad" (cut at speech segments
    #: found by a VAD and decode the segments as one batch: faster, no cross-window context).
    long_form: Literal["sequential", "vad"] = "sequential"
    #: Whisper, sequential long-form: before decoding, a voice activity detector scans each
    #: input, and an input without any speech gets an empty transcript instead of being decoded
    #: (Whisper invents words on music, tones and noise). Needs a ``vad_detector`` plugin
    #: (oasr-vad-silero); skipped with a warning without one, and off when
    #: ``no_speech_threshold`` is None. ``long_form="vad"`` always runs the VAD.
    vad_gate: bool = True

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise InvalidRequestError("beam_size must be >= 1", param="beam_size")
        if self.task not in ("transcribe", "translate"):
            raise InvalidRequestError(
                f"task must be 'transcribe' or 'translate', not {self.task!r}", param="task"
            )
        temps = self.temperatures
        if any(t < 0 for t in temps):
            raise InvalidRequestError("temperature must be >= 0", param="temperature")
        if self.patience is not None and self.patience <= 0:
            raise InvalidRequestError("patience must be > 0", param="patience")
        if self.long_form not in ("sequential", "vad"):
            raise InvalidRequestError(
                f"long_form must be 'sequential' or 'vad', not {self.long_form!r}", param="long_form"
            )
        if not isinstance(self.vad_gate, bool):
            raise InvalidRequestError(
                f"vad_gate must be true or false, not {self.vad_gate!r}", param="vad_gate"
            )
        if self.hotwords:
            raise UnsupportedOptionError(
                "hotwords are not supported yet by any model family; remove the option",
                param="hotwords",
            )

    @property
    def temperatures(self) -> tuple[float, ...]:
        t = self.temperature
        return tuple(t) if isinstance(t, (tuple, list)) else (float(t),)

    def check_supported(self, capabilities: ModelCapabilities, model_name: str) -> None:
        """Raise :class:`UnsupportedOptionError` for options this model cannot honour."""
        if self.word_timestamps and not capabilities.word_timestamps:
            raise UnsupportedOptionError(
                f"{model_name} cannot produce word timestamps", param="timestamp_granularities"
            )
        if self.task == "translate" and not capabilities.translation:
            raise UnsupportedOptionError(f"{model_name} cannot translate", param="task")
        if self.beam_size > 1 and capabilities.decode_family == DecodeFamily.CIF:
            raise UnsupportedOptionError(
                f"{model_name} is non-autoregressive; beam_size must be 1", param="beam_size"
            )


@dataclass
class Word:
    word: str
    start: float
    end: float
    confidence: float


@dataclass
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    words: list[Word] = field(default_factory=list)
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    temperature: float = 0.0
    seek: int = 0

    @property
    def confidence(self) -> float:
        import math

        return math.exp(self.avg_logprob)


@dataclass
class Transcript:
    """The result of recognising one audio input."""

    text: str
    language: str | None
    duration: float
    segments: list[Segment] = field(default_factory=list)
    task: Task = "transcribe"

    @property
    def words(self) -> list[Word]:
        return [w for s in self.segments for w in s.words]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["words"] = [asdict(w) for w in self.words]
        return out


ServiceMode = Literal["offline", "streaming"]


@dataclass
class EngineConfig:
    """Everything an :class:`oasr.engine.ASREngine` is built from."""

    ckpt_dir: str | None = None
    service_mode: ServiceMode = "offline"
    device: str = "cpu"
    dtype: str = "auto"  # auto: fp32 on CPU, fp16 on CUDA
    max_batch_size: int = 16
    max_audio_seconds: float = 4 * 3600.0
    num_threads: int | None = None
    quantization: str | None = None
    architecture: str | None = None  # force an architecture key instead of detecting one
    #: worker processes that decode many inputs at once (``load_audios``, ``transcribe_offline``,
    #: ``transcribe_outputs``; :mod:`oasr.decode_pool`); 0 decodes in the calling thread
    decode_processes: int = 0

    def __post_init__(self) -> None:
        if self.service_mode not in ("offline", "streaming"):
            raise InvalidRequestError(
                f"service_mode must be 'offline' or 'streaming', not {self.service_mode!r}",
                param="service_mode",
            )
        if self.max_batch_size < 1:
            raise InvalidRequestError("max_batch_size must be >= 1", param="max_batch_size")
        if self.decode_processes < 0:
            raise InvalidRequestError("decode_processes must be >= 0", param="decode_processes")
        if self.quantization is not None:
            raise UnsupportedOptionError(
                "quantization is not implemented yet; leave it unset", param="quantization"
            )
