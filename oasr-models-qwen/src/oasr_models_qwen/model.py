"""``Qwen2AudioASR``: the :class:`oasr.model.ASRModel` for Qwen2-Audio checkpoints.

Every request, from the engine or from :meth:`Qwen2AudioASR.transcribe`, runs on the core's
:class:`~oasr.executors.autoregressive.AutoregressiveExecutor` (paged KV cache, continuous
batching, CUDA graphs on GPU) with :mod:`oasr_models_qwen.engine_adapter`'s step model and
driver: there is no second decoding loop."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oasr.errors import CheckpointError, InvalidRequestError, UnsupportedOptionError
from oasr.layers import resolve_dtype
from oasr.model import ProgressCallback
from oasr.options import ResolvedOptions
from oasr.types import DecodingOptions, EngineConfig, FeatureSpec, ModelCapabilities, Transcript
from oasr_models_qwen.engine_adapter import DEFAULT_CONTEXT
from oasr_models_qwen.options import DEFAULT_OPTIONS, QwenOptions, qwen_options
from oasr_models_qwen.plugin import CAPABILITIES
from oasr_models_qwen.tokenizer import AUDIO, ENDOFTEXT, IM_END, QwenTokenizer, build_prompt

if TYPE_CHECKING:
    from oasr_models_qwen.checkpoints import LoadedQwenAudio
    from oasr_models_qwen.nn import Qwen2AudioNet

__all__ = ["Qwen2AudioASR"]


class Qwen2AudioASR:
    """A loaded Qwen2-Audio: network + tokenizer + prompt style + generation defaults."""

    capabilities: ModelCapabilities = CAPABILITIES
    #: Qwen's own options (``DecodingOptions.model_options``)
    default_options: QwenOptions = DEFAULT_OPTIONS

    def __init__(self, network: Qwen2AudioNet, tokenizer: QwenTokenizer, *, name: str = "qwen2-audio",
                 chat_template: str | None = None, stop_tokens: Sequence[int] = (),
                 max_batch_size: int = 16, context: int = DEFAULT_CONTEXT) -> None:  # fmt: skip
        self.network = network
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template = chat_template
        self.max_batch_size = max_batch_size
        self.context = min(int(context), network.config.text.max_positions)
        stops = [t for t in stop_tokens if t is not None]
        for special in (IM_END, ENDOFTEXT):
            tid = tokenizer.token_id(special)
            if tid is not None and tid not in stops:
                stops.append(tid)
        if not stops:
            raise CheckpointError(f"{name}: no end-of-sequence token (generation_config.json or <|im_end|>)")
        self.stop_tokens = tuple(stops)
        if tokenizer.audio_id != network.config.audio_token_id:
            raise CheckpointError(f"{name}: the tokenizer's {AUDIO} is id {tokenizer.audio_id}, the config's "
                                  f"audio_token_index {network.config.audio_token_id}")  # fmt: skip
        self._prompt_ids: dict[str, tuple[tuple[int, ...], int]] = {}  # prompt text -> ids, placeholder
        self.feature_spec = FeatureSpec(kind="whisper_logmel", num_bins=network.config.audio.n_mels,
                                        options={"chunk_seconds": 30})  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.network.device

    @classmethod
    def from_loaded(cls, loaded: LoadedQwenAudio, config: EngineConfig | None = None) -> Qwen2AudioASR:
        from oasr_models_qwen.nn import build_network

        config = config or EngineConfig()
        network = build_network(loaded, config.device, resolve_dtype(config.dtype))
        eos = loaded.generation.get("eos_token_id", list(loaded.config.eos_token_ids))
        eos = eos if isinstance(eos, list) else [eos]
        return cls(network, QwenTokenizer.from_files(loaded.tokenizer_files), name=loaded.name,
                   chat_template=loaded.chat_template, stop_tokens=[int(e) for e in eos if e is not None],
                   max_batch_size=config.max_batch_size)  # fmt: skip

    @classmethod
    def from_native(cls, path: str | Path, body: dict[str, Any] | None = None,
                    config: EngineConfig | None = None) -> Qwen2AudioASR:  # fmt: skip
        """A checkpoint ``oasr convert`` wrote (:func:`oasr_models_qwen.checkpoints.save_native`)."""
        from oasr.checkpoint import read_native_config
        from oasr_models_qwen.checkpoints import load_native

        body = body or read_native_config(Path(path))
        model = cls.from_loaded(load_native(Path(path), body), config)
        model.name = str(body.get("name", model.name))
        if body.get("context"):
            model.context = min(int(body["context"]), model.network.config.text.max_positions)
        model.default_options = model.default_options.with_saved(body.get("decoding"))
        return model

    def save_native(self, dst: str | Path) -> str:
        """OASR's native format: weights in the network's names, ``tokenizer.json``, and
        ``oasr_model.json`` (dimensions, chat template, stop tokens, decoding defaults)."""
        from oasr_models_qwen.checkpoints import save_native

        return save_native(Path(dst), self)

    def make_executor(self, config: Any) -> Any:
        from oasr_models_qwen.engine_adapter import make_executor

        return make_executor(self, config)

    # ---------------------------------------------------------------- options and prompts
    def check(self, options: DecodingOptions | ResolvedOptions) -> ResolvedOptions:
        """Validate ``options`` for this model (typed errors, one line each)."""
        options = qwen_options(options)
        options.check_supported(self.capabilities, self.name)
        if options.beam_size > 1:
            raise UnsupportedOptionError(f"{self.name} decodes with sampling or greedy search; beam_size must be 1",
                                         param="beam_size")  # fmt: skip
        if options.prompt is not None and not isinstance(options.prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        limit = self.context - self.network.config.audio.max_audio_tokens - 16
        if options.max_new_tokens is not None and options.max_new_tokens > limit:
            raise InvalidRequestError(f"max_new_tokens must be at most {limit} for {self.name}",
                                      param="max_new_tokens")  # fmt: skip
        return options

    def chat(self, options: ResolvedOptions) -> bool:
        style = options.prompt_style
        if style == "auto":  # a template that places audio: the Instruct model's
            return self.chat_template is not None and AUDIO in self.chat_template
        return style == "chat"

    def prompt_text(self, options: DecodingOptions | ResolvedOptions) -> str:
        """The request's prompt with one ``<|AUDIO|>`` placeholder."""
        o = qwen_options(options)
        return build_prompt(chat=self.chat(o), task=o.task, language=o.language, prompt=o.prompt,
                            system_prompt=o.system_prompt, chat_template=self.chat_template)  # fmt: skip

    def prompt_ids(self, options: DecodingOptions | ResolvedOptions) -> tuple[list[int], int]:
        """The prompt's token ids and the index of its one ``<|AUDIO|>`` placeholder (kept per
        prompt text: a batch of requests with the same options tokenizes it once)."""
        text = self.prompt_text(options)
        hit = self._prompt_ids.get(text)
        if hit is None:
            ids = self.tokenizer.encode(text)
            at = [i for i, t in enumerate(ids) if t == self.tokenizer.audio_id]
            if len(at) != 1:
                raise InvalidRequestError(f"the prompt must hold one {AUDIO} placeholder, not {len(at)}",
                                          param="prompt")  # fmt: skip
            if len(self._prompt_ids) >= 256:  # bounded: free-form prompts differ per request
                self._prompt_ids.pop(next(iter(self._prompt_ids)))
            hit = self._prompt_ids[text] = (tuple(ids), at[0])
        return list(hit[0]), hit[1]

    # ---------------------------------------------------------------- ASRModel
    def transcribe(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                   progress: ProgressCallback | None = None) -> list[Transcript]:  # fmt: skip
        """Recognise mono float32 16 kHz waveforms (any length: 30 s windows) on the executor."""
        from oasr.scheduler import Scheduler, SchedulerConfig

        self.check(options)
        if not audios:
            return []
        # a private executor sized to this call (its KV pool is freed when the call returns)
        config = SchedulerConfig(max_batch_size=min(self.max_batch_size, len(audios)), min_admit_group=1)
        scheduler = Scheduler(self.make_executor(config), config)
        futures = [scheduler.submit(np.asarray(a, dtype=np.float32), options) for a in audios]
        scheduler.run_until_idle()
        if progress is not None:
            progress(1.0, 1.0)
        return [f.result() for f in futures]
