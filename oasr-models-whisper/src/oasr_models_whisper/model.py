"""``WhisperASR``: the :class:`oasr.model.ASRModel` for Whisper checkpoints.

Built from a :class:`~oasr_models_whisper.checkpoints.LoadedWhisper` (any source layout) or from
OASR's native format; owns the network, the tokenizer and the decoding defaults that travel with
the checkpoint (suppressed tokens, language tokens, alignment heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.errors import CheckpointError, InvalidRequestError, UnsupportedOptionError
from oasr.layers import resolve_dtype
from oasr.model import ProgressCallback
from oasr.options import ResolvedOptions
from oasr.types import (
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Transcript,
)
from oasr_models_whisper.decoding import resolve_suppress_tokens
from oasr_models_whisper.network import WhisperNetwork
from oasr_models_whisper.options import DEFAULT_OPTIONS, WhisperOptions, whisper_options
from oasr_models_whisper.plugin import CAPABILITIES
from oasr_models_whisper.speech_gate import empty_transcript, speech_gate
from oasr_models_whisper.tokenizer import LANGUAGES, WhisperTokenizer, normalize_language
from oasr_models_whisper.transcribe import transcribe as _transcribe

if TYPE_CHECKING:
    from oasr_models_whisper.checkpoints import LoadedWhisper

class WhisperASR:
    """A loaded Whisper model: encoder-decoder network + tokenizer + decoding defaults."""

    #: the architecture's capabilities, as registered; an instance narrows them to its checkpoint
    capabilities: ModelCapabilities = CAPABILITIES

    def __init__(
        self,
        network: WhisperNetwork,
        tokenizer: WhisperTokenizer,
        *,
        multilingual: bool,
        name: str = "whisper",
        non_speech_tokens: Sequence[int] | None = None,
        max_batch_size: int = 16,
        loaded: LoadedWhisper | None = None,
    ) -> None:
        self.network = network
        self.tokenizer = tokenizer
        self.multilingual = bool(multilingual)
        self.name = name
        self.non_speech_tokens = tuple(non_speech_tokens) if non_speech_tokens is not None else None
        self.max_batch_size = max_batch_size
        self._loaded = loaded
        #: name -> stored dtype, once the network holds the only copy of the weights
        self._stored_dtypes: dict[str, torch.dtype] | None = None
        # English-only checkpoints neither translate nor detect languages
        self.capabilities = replace(
            CAPABILITIES,
            translation=self.multilingual,
            language_detection=self.multilingual,
            multilingual=self.multilingual,
        )
        self.feature_spec = FeatureSpec(
            kind="whisper_logmel", num_bins=network.dims.n_mels, options={"chunk_seconds": 30}
        )

    @property
    def device(self) -> torch.device:
        """The device the network runs on."""
        return self.network.device

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_loaded(cls, loaded: LoadedWhisper, config: EngineConfig | None = None) -> WhisperASR:
        from oasr_models_whisper.nn import build_network

        config = config or EngineConfig()
        network = build_network(loaded, config.device, resolve_dtype(config.dtype))
        files = {k: str(v) for k, v in (loaded.tokenizer_files or {}).items()}
        num_languages = loaded.num_languages if loaded.is_multilingual else None
        if any(Path(f).name in ("tokenizer.json", "vocab.json") or f.endswith(".tiktoken")
               for f in files.values()):  # fmt: skip
            tokenizer = WhisperTokenizer.from_files(files, num_languages=num_languages or None)
        else:  # openai-whisper .pt: the standard vocabulary for this model's size
            tokenizer = WhisperTokenizer.for_vocabulary(loaded.is_multilingual, num_languages or 99)
        if tokenizer.timestamp_end >= loaded.dims.n_vocab:
            raise CheckpointError(
                f"tokenizer does not fit the model: timestamps end at id {tokenizer.timestamp_end} "
                f"but the model has {loaded.dims.n_vocab} output tokens"
            )
        model = cls(
            network,
            tokenizer,
            multilingual=loaded.is_multilingual,
            name=f"whisper {loaded.size_name}",
            non_speech_tokens=loaded.suppress_tokens,
            max_batch_size=config.max_batch_size,
            loaded=loaded,
        )
        model._drop_stored_copy()
        return model

    def _drop_stored_copy(self) -> None:
        """Keep no second copy of the weights when the network's converts back exactly: a
        float16/bfloat16 checkpoint on a float32 network (tiny.en on CPU: 77 MB), or the same
        dtype. :attr:`loaded` then rebuilds the stored tensors from the network."""
        loaded, state = self._loaded, getattr(self.network, "state_dict", None)
        params = state() if callable(state) else {}
        if loaded is None or not loaded.state_dict or not set(loaded.state_dict) <= set(params):
            return
        exact = (torch.float16, torch.bfloat16)
        for k, v in loaded.state_dict.items():
            net = params[k].dtype
            if v.dtype != net and not (net == torch.float32 and v.dtype in exact):
                return
        self._stored_dtypes = {k: v.dtype for k, v in loaded.state_dict.items()}
        self._loaded = replace(loaded, state_dict={})

    @property
    def loaded(self) -> LoadedWhisper | None:
        """The checkpoint this model was built from (weights in their stored dtypes)."""
        if self._loaded is None or self._stored_dtypes is None:
            return self._loaded
        params = self.network.state_dict()
        state = {k: params[k].detach().to("cpu", dt) for k, dt in self._stored_dtypes.items()}
        return replace(self._loaded, state_dict=state)

    @classmethod
    def from_native(
        cls,
        path: str | Path,
        body: dict[str, Any] | None = None,
        config: EngineConfig | None = None,
    ) -> WhisperASR:
        from oasr_models_whisper.checkpoints import load_native

        return cls.from_loaded(load_native(Path(path), body), config)

    def make_executor(self, config: Any) -> Any:
        """The engine scheduler's continuous-batching executor for this model (or None)."""
        from oasr_models_whisper.engine_adapter import make_executor

        return make_executor(self, config)

    def save_native(self, dst: str | Path) -> str:
        """Write OASR's native format (safetensors + json + tokenizer assets); returns "whisper"."""
        from oasr_models_whisper.checkpoints import save_native

        if self.loaded is None:
            raise CheckpointError(f"{self.name} was not built from a checkpoint; cannot save it")
        return save_native(Path(dst), self.loaded)

    # ---------------------------------------------------------------- options
    #: Whisper's own options (``DecodingOptions.model_options``) start from openai-whisper's
    #: transcribe defaults for every checkpoint
    default_options: WhisperOptions = DEFAULT_OPTIONS

    def _check(self, options: DecodingOptions | ResolvedOptions) -> str | None:
        """Validate ``options`` for this model; return the language code to force (or None)."""
        options = whisper_options(options)
        if not self.multilingual:
            if options.task == "translate":
                raise UnsupportedOptionError(
                    f"{self.name} is an English-only model and cannot translate; use a "
                    f"multilingual Whisper checkpoint (one without '.en') for task 'translate'",
                    param="task",
                )
            if options.language is not None and normalize_language(options.language) != "en":
                raise UnsupportedOptionError(
                    f"{self.name} is an English-only model; language {options.language!r} is not "
                    f"supported (omit the language or pass 'en', or use a multilingual checkpoint)",
                    param="language",
                )
        options.check_supported(self.capabilities, self.name)
        language = normalize_language(options.language)
        if self.multilingual and language is not None and language not in self.tokenizer.languages:
            raise UnsupportedOptionError(
                f"{self.name} does not know language {language!r} ({LANGUAGES.get(language, '')}); "
                f"it supports {len(self.tokenizer.languages)} languages",
                param="language",
            )
        limit = self.network.dims.n_text_ctx // 2
        if options.max_new_tokens is not None and not 1 <= options.max_new_tokens <= limit:
            raise InvalidRequestError(
                f"max_new_tokens must be between 1 and {limit} for Whisper", param="max_new_tokens"
            )
        if options.suppress_tokens:
            bad = [t for t in options.suppress_tokens if t < -1 or t >= self.network.dims.n_vocab]
            if bad:
                raise InvalidRequestError(
                    f"suppress_tokens {bad} are not token ids of this model (use -1 for the "
                    f"default non-speech symbols)",
                    param="suppress_tokens",
                )
        if options.prompt is not None and not isinstance(options.prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        return "en" if not self.multilingual else language

    # ---------------------------------------------------------------- ASRModel
    def transcribe(
        self,
        audios: Sequence[np.ndarray],
        options: DecodingOptions,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        """Recognise mono float32 16 kHz waveforms of any length (long ones in 30 s windows)."""
        options = whisper_options(options)  # the Whisper options resolved once, read below
        language = self._check(options)
        waves = [as_mono_waveform(audio, f"audio #{k}") for k, audio in enumerate(audios)]
        if not waves:
            return []
        suppress = resolve_suppress_tokens(
            self.tokenizer, options.suppress_tokens, self.non_speech_tokens
        )
        if options.long_form == "vad":  # VAD chunks of all inputs decoded as one batch
            from oasr_models_whisper.vad_longform import transcribe_vad as _transcribe_vad

            return _transcribe_vad(self.network, self.tokenizer, waves, options,
                                   multilingual=self.multilingual, language=language,
                                   suppress=suppress, max_batch_size=self.max_batch_size,
                                   progress=progress)  # fmt: skip
        # inputs in which the VAD finds no speech are not decoded (Whisper invents words there)
        decode = speech_gate(waves, options, self.network.device)
        todo = [w for w, d in zip(waves, decode, strict=True) if d]
        if not todo:
            if progress is not None:
                progress(1.0, 1.0)
            decoded: list[Transcript] = []
        else:
            decoded = _transcribe(
                self.network,
                self.tokenizer,
                todo,
                options,
                multilingual=self.multilingual,
                language=language,
                suppress=suppress,
                max_batch_size=self.max_batch_size,
                progress=progress,
            )
        results = iter(decoded)
        return [next(results) if d else empty_transcript(len(w), options, language)
                for w, d in zip(waves, decode, strict=True)]  # fmt: skip

    def detect_language(self, audios: Sequence[np.ndarray]) -> list[dict[str, float]]:
        """Language probabilities from the first 30 s of each waveform (multilingual models)."""
        if not self.multilingual:
            raise UnsupportedOptionError(f"{self.name} is English-only; it cannot detect languages")
        from oasr.features.whisper import N_FRAMES, N_SAMPLES, log_mel_spectrogram
        from oasr_models_whisper.decoding import detect_language

        mels = [
            log_mel_spectrogram(torch.as_tensor(np.asarray(a, np.float32)), self.network.dims.n_mels,
                                padding=N_SAMPLES)[:, :N_FRAMES]
            for a in audios
        ]  # fmt: skip
        feats = self.network.encode(torch.stack(mels).to(self.network.device, self.network.dtype))
        return detect_language(self.network, self.tokenizer, feats)[1]
