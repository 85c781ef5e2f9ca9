"""``ASREngine``: one loaded model behind a small, thread-safe API.

This first engine serves the offline mode: inputs are decoded, checked against the configured
limits, sorted by length and run through the model in length-bucketed batches of at most
``max_batch_size`` (similar lengths together waste the least padding). The streaming mode and the
continuous-batching scheduler are the engine issue's work; asking for streaming on a model that
cannot stream is refused here with a typed error.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Union

from oasr.errors import AudioTooLongError, UnsupportedOptionError
from oasr.types import DecodingOptions, EngineConfig, Transcript

if TYPE_CHECKING:
    import numpy as np

    from oasr.model import ASRModel, ProgressCallback

AudioInput = Union[str, Path, bytes, BinaryIO, "np.ndarray"]


class ASREngine:
    def __init__(self, config: EngineConfig, model: ASRModel | None = None) -> None:
        from oasr.checkpoint import load_model

        self.config = config
        if config.num_threads:
            import torch

            torch.set_num_threads(config.num_threads)
        self.model: ASRModel = model if model is not None else load_model(config)
        caps = self.model.capabilities
        if config.service_mode == "streaming" and not caps.streaming:
            raise UnsupportedOptionError(
                f"{self.model.name} cannot stream; start the engine with service_mode='offline'",
                param="service_mode",
            )
        self._lock = threading.Lock()

    @property
    def sample_rate(self) -> int:
        return self.model.feature_spec.sample_rate

    def load_audio(self, source: AudioInput) -> np.ndarray:
        """Decode and resample one input to the model's rate; enforce the duration limit."""
        import numpy as np

        if isinstance(source, np.ndarray):
            audio = np.ascontiguousarray(source, dtype=np.float32)
        else:
            from oasr.audio import load_audio

            audio = load_audio(
                source, self.sample_rate, max_seconds=self.config.max_audio_seconds
            )
        seconds = audio.shape[-1] / self.sample_rate
        if seconds > self.config.max_audio_seconds:
            raise AudioTooLongError(
                f"audio is {seconds:.1f} s long; this engine accepts at most "
                f"{self.config.max_audio_seconds:.0f} s (EngineConfig.max_audio_seconds)"
            )
        return audio

    def transcribe_offline(
        self,
        inputs: AudioInput | Sequence[AudioInput],
        decoding: DecodingOptions | None = None,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        """Transcribe one or several inputs (paths, bytes, file objects or 1-D float arrays).
        Returns one :class:`Transcript` per input, in input order."""
        if isinstance(inputs, (str, Path, bytes)) or hasattr(inputs, "read") or (
            hasattr(inputs, "ndim") and getattr(inputs, "ndim", 0) == 1
        ):
            inputs = [inputs]  # type: ignore[list-item]
        audios = [self.load_audio(x) for x in inputs]  # type: ignore[union-attr]
        return self.transcribe_arrays(audios, decoding, progress)

    def transcribe_arrays(
        self,
        audios: Sequence[np.ndarray],
        decoding: DecodingOptions | None = None,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        options = decoding or DecodingOptions()
        options.check_supported(self.model.capabilities, self.model.name)
        order = sorted(range(len(audios)), key=lambda i: audios[i].shape[-1])
        total = float(sum(a.shape[-1] for a in audios)) / self.sample_rate
        done = 0.0
        results: list[Transcript | None] = [None] * len(audios)
        batch = self.config.max_batch_size
        with self._lock:
            for start in range(0, len(order), batch):
                idx = order[start : start + batch]
                batch_seconds = sum(audios[i].shape[-1] for i in idx) / self.sample_rate
                base = done

                def batch_progress(d: float, t: float, base: float = base, span: float = batch_seconds) -> None:
                    if progress is not None and t > 0:
                        progress(base + span * min(d / t, 1.0), total)

                outs = self.model.transcribe([audios[i] for i in idx], options, batch_progress)
                for i, out in zip(idx, outs, strict=True):
                    results[i] = out
                done += batch_seconds
                if progress is not None:
                    progress(done, total)
        return [r for r in results if r is not None]
