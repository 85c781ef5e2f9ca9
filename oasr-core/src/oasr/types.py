"""Core contracts: the small typed vocabulary every package speaks.

Everything here is plain dataclasses and enums (no torch), so it is cheap to import from the CLI,
the server and third-party plugins alike.
"""

from __future__ import annotations

import enum
import functools
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from oasr.errors import InvalidRequestError, UnsupportedOptionError

if TYPE_CHECKING:
    from oasr.options import ResolvedOptions


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
    #: biases recognition towards ``DecodingOptions.hotwords`` (refused where False)
    hotwords: bool = False


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


#: Temperature schedule the CLI and the server use for "temperature 0": greedy first, then
#: re-decode a window at the next temperature when its output looks like a failure.
FALLBACK_TEMPERATURES: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass
class DecodingOptions:
    """Per-request decoding choices.

    The fields are the options every model family understands. Options of one family (Whisper's
    ``no_speech_threshold``, WeNet's ``decoding_method``, ...) go by name in ``model_options``;
    the family that serves the request declares, parses and validates them
    (:mod:`oasr.options`; ``docs/decoding.md`` lists them)::

        DecodingOptions(beam_size=5, model_options={"no_speech_threshold": None})
        DecodingOptions.build(beam_size=5, no_speech_threshold=None)  # the same, names split

    Options compare with ``==`` (the scheduler runs requests with equal options in one batch).
    Validation here is family-independent; :meth:`validate_for` adds what the model refuses.
    """

    beam_size: int = 1  # 1 = greedy
    language: str | None = None
    task: Task = "transcribe"
    temperature: float | tuple[float, ...] = 0.0
    prompt: str | None = None
    word_timestamps: bool = False
    max_new_tokens: int | None = None
    #: words or phrases to bias recognition towards; a family that cannot bias refuses them
    #: (``ModelCapabilities.hotwords``)
    hotwords: tuple[str, ...] | None = None
    #: family options by name (values typed, or strings as the CLI and HTTP send them)
    model_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.beam_size <= MAX_BEAM_SIZE:
            raise InvalidRequestError(
                f"beam_size must be between 1 and {MAX_BEAM_SIZE}, not {self.beam_size}",
                param="beam_size",
            )
        self._check_sizes()
        if self.task not in ("transcribe", "translate"):
            raise InvalidRequestError(
                f"task must be 'transcribe' or 'translate', not {self.task!r}", param="task"
            )
        temps = self.temperatures
        if any(t < 0 for t in temps):
            raise InvalidRequestError("temperature must be >= 0", param="temperature")
        if isinstance(self.temperature, list):
            self.temperature = tuple(self.temperature)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be >= 1", param="max_new_tokens")
        if isinstance(self.hotwords, str):
            raise InvalidRequestError(
                "hotwords must be a list of words or phrases, not one string", param="hotwords"
            )
        if self.hotwords is not None:
            self.hotwords = tuple(self.hotwords) or None
        if not isinstance(self.model_options, Mapping):
            raise InvalidRequestError(
                "model_options must be a mapping of option name to value", param="model_options"
            )
        # a copy: later changes to the caller's dict do not reach validated options
        self.model_options = dict(self.model_options)
        for name in self.model_options:
            if not isinstance(name, str):
                raise InvalidRequestError(
                    f"model_options names must be strings, not {name!r}", param="model_options"
                )
            if name in _COMMON_OPTIONS:
                raise InvalidRequestError(
                    f"{name} is a common option: set DecodingOptions({name}=...), not "
                    f"model_options (DecodingOptions.build splits the names for you)",
                    param=name,
                )

    def _check_sizes(self) -> None:
        """Bounds on what a client controls, checked before any work: an absurd value (a
        megabyte prompt, ten thousand hotwords) is a 400, not minutes of tokenizing."""
        if self.prompt is not None and len(self.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(
                f"prompt is {len(self.prompt)} characters; at most {MAX_PROMPT_CHARS} are "
                "accepted (Whisper reads only the last 223 tokens of it)",
                param="prompt",
            )
        if self.language is not None and len(self.language) > MAX_LANGUAGE_CHARS:
            raise InvalidRequestError(
                f"language must be a language code such as 'en', not a "
                f"{len(self.language)}-character string",
                param="language",
            )
        if len(self.temperatures) > MAX_TEMPERATURES:
            raise InvalidRequestError(
                f"at most {MAX_TEMPERATURES} fallback temperatures, not {len(self.temperatures)}",
                param="temperature",
            )
        if self.max_new_tokens is not None and self.max_new_tokens > MAX_NEW_TOKENS:
            raise InvalidRequestError(
                f"max_new_tokens must be at most {MAX_NEW_TOKENS}", param="max_new_tokens"
            )
        if self.hotwords is not None and not isinstance(self.hotwords, str):
            if len(self.hotwords) > MAX_HOTWORDS:
                raise InvalidRequestError(
                    f"at most {MAX_HOTWORDS} hotwords, not {len(self.hotwords)}", param="hotwords"
                )
            if any(len(str(h)) > MAX_HOTWORD_CHARS for h in self.hotwords):
                raise InvalidRequestError(
                    f"a hotword is longer than {MAX_HOTWORD_CHARS} characters", param="hotwords"
                )
        options = self.model_options
        if isinstance(options, Mapping):
            if len(options) > MAX_MODEL_OPTIONS:
                raise InvalidRequestError(
                    f"at most {MAX_MODEL_OPTIONS} model options, not {len(options)}",
                    param="model_options",
                )
            for name, value in options.items():
                if len(str(name)) > MAX_OPTION_CHARS or _text_size(value) > MAX_OPTION_CHARS:
                    raise InvalidRequestError(
                        f"model option {str(name)[:64]!r} is longer than {MAX_OPTION_CHARS} "
                        "characters",
                        param=str(name)[:64],
                    )

    @classmethod
    def build(cls, **options: Any) -> DecodingOptions:
        """Options from flat keyword arguments: the common names fill the fields, every other
        name goes to ``model_options``. String values are parsed as the CLI and HTTP send them
        (``"5"``, ``"true"``, ``"none"``, ``"0.0,0.2"``)."""
        return cls().updated(**options)

    def updated(self, **changes: Any) -> DecodingOptions:
        """A copy with ``changes`` applied, common and family names alike (family options are
        merged into ``model_options``)."""
        from oasr.options import coerce_value

        hints = _common_hints()
        common: dict[str, Any] = {}
        family = dict(self.model_options)
        for name, value in changes.items():
            if name == "model_options":
                family.update(value or {})
            elif name in hints:
                common[name] = coerce_value(name, value, hints[name])
            else:
                family[name] = value
        return replace(self, **common, model_options=family)

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
        if self.hotwords and not capabilities.hotwords:
            raise UnsupportedOptionError(
                f"{model_name} cannot bias recognition towards hotwords; remove the option",
                param="hotwords",
            )

    def validate_for(self, model: Any) -> ResolvedOptions:
        """Everything ``model`` refuses, before any work: :meth:`check_supported` against its
        capabilities, then its family options (unknown names, types, bounds). Returns the
        options with the family's resolved (:class:`oasr.options.ResolvedOptions`)."""
        from oasr.options import resolve_options

        self.check_supported(model.capabilities, model.name)
        return resolve_options(model, self)


#: Bounds on client-controlled option sizes (documented in docs/serving.md, "Limits").
MAX_PROMPT_CHARS = 8192
MAX_BEAM_SIZE = 64
MAX_LANGUAGE_CHARS = 32
MAX_TEMPERATURES = 16
MAX_NEW_TOKENS = 1 << 16
MAX_HOTWORDS = 1024
MAX_HOTWORD_CHARS = 256
MAX_MODEL_OPTIONS = 64
MAX_OPTION_CHARS = 16384


def _text_size(value: Any) -> int:
    """Characters in an option value as sent (a list counts all of its items)."""
    if isinstance(value, (list, tuple)):
        return sum(len(str(v)) for v in value)
    return len(value) if isinstance(value, str) else 0


_COMMON_OPTIONS = frozenset(
    ("beam_size", "language", "task", "temperature", "prompt", "word_timestamps",
     "max_new_tokens", "hotwords")
)  # fmt: skip


@functools.cache
def _common_hints() -> dict[str, Any]:
    hints = typing.get_type_hints(DecodingOptions)
    return {name: hints[name] for name in _COMMON_OPTIONS}


@dataclass
class Word:
    word: str
    start: float
    end: float
    confidence: float


@dataclass
class Segment:
    """One stretch of a transcript.

    ``id``, ``start``, ``end``, ``text``, ``tokens`` and ``words`` are what every family fills.
    The other fields are optional decoder reports with neutral defaults, kept as fields because
    OpenAI's ``verbose_json`` segment carries each of them (the formatter writes them for every
    family, so the output shape never depends on the model): ``avg_logprob`` (mean token
    log-probability; CTC and AED families fill it, ``confidence`` derives from it);
    ``no_speech_prob``, ``compression_ratio``, ``temperature`` and ``seek`` (the window start in
    10 ms frames) are Whisper's and stay 0 elsewhere.
    """

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

    def __str__(self) -> str:
        """The recognised text (``print(engine.transcribe_offline("a.wav"))`` prints it)."""
        return self.text

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
    #: W8A8 quantization of the model's linears: "int8_w8a8" (CPU, CUDA) or "fp8_w8a8" (CUDA
    #: compute capability >= 8.9); None keeps them in ``dtype`` (docs/quantization.md)
    quantization: str | None = None
    #: the autoregressive decoders' KV cache: None/"auto" (the model's dtype) or "fp8"
    kv_cache_dtype: str | None = None
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
        from oasr.quantization import check_kv_cache_dtype, check_method

        self.quantization = check_method(self.quantization)
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
