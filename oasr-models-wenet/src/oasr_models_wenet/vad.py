"""``ctc_blank``: voice activity from a WeNet model's CTC blank posteriors.

A CTC model puts almost all probability on *blank* in silence and noise, and on tokens (or a
mix) where speech is. ``CTCBlankVAD`` reports ``1 - P(blank)`` per encoder frame (one
"window" = ``subsampling * hop`` samples, 40 ms for a x4 model at 10 ms hop) as the speech
probability, so OASR's segmenter / endpointer (``oasr.vad``) work on it unchanged. Useful when a
WeNet model is already loaded (no second network) and for endpointing streams: a run of blank
frames after speech is the end of a turn.

Probabilities are computed chunk by chunk with the model's streaming encoder (``chunk_size``
encoder frames, ``num_left_chunks`` chunks of left context: bounded, so a detector can run on a
stream for hours in constant memory and time per chunk), both offline (``speech_probs``) and streaming (``step``), so
the two agree. ``speech_probs`` returns ``ceil(len(audio) / window)`` values: frames the encoder
does not produce (the tail shorter than its receptive field) read 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class CTCBlankVAD:
    sample_rates = (16000,)

    def __init__(self, checkpoint: str | None = None, *, model: Any = None, device: str = "cpu",
                 chunk_size: int = 16, num_left_chunks: int = 8) -> None:
        if model is None:
            if checkpoint is None:
                raise ValueError("CTCBlankVAD needs a WeNet model (model=...) or checkpoint=PATH")
            from oasr.checkpoint import load_model
            from oasr.types import EngineConfig

            model = load_model(EngineConfig(ckpt_dir=str(checkpoint), device=device))
        if not hasattr(model, "ctc_blank_posteriors"):
            raise ValueError(f"{getattr(model, 'name', model)!r} is not a WeNet CTC model")
        self.model = model
        self.chunk_size = chunk_size
        self.num_left_chunks = num_left_chunks
        self.sample_rates = (model.feature_spec.sample_rate,)

    def window_size(self, sample_rate: int = 16000) -> int:
        self._check_rate(sample_rate)
        spec = self.model.feature_spec
        return self.model.net.encoder.subsampling_rate * spec.hop_length

    def _check_rate(self, sample_rate: int) -> None:
        if sample_rate not in self.sample_rates:
            raise ValueError(f"ctc_blank VAD runs at {self.sample_rates[0]} Hz, not {sample_rate}")

    def new_state(self, sample_rate: int = 16000) -> dict[str, Any]:
        from oasr.types import DecodingOptions

        self._check_rate(sample_rate)
        st = self.model.new_stream(DecodingOptions(), chunk_size=self.chunk_size,
                                  num_left_chunks=self.num_left_chunks, force=True,
                                  keep_encoder_output=True)
        return {"stream": st, "emitted": 0, "samples": 0, "done": False}

    def step(self, state: dict[str, Any], chunk: Any, *, final: bool = False) -> np.ndarray:
        import torch

        if state["done"]:
            raise ValueError("this VAD state is closed (final=True was passed)")
        a = np.asarray(chunk, dtype=np.float32).reshape(-1)
        state["samples"] += len(a)
        st = state["stream"]
        self.model.stream_step([st], [a], [False])
        if final:
            # flush the partial last chunk (no rescoring: only the posteriors are needed)
            self.model.flush_stream(st)
            state["done"] = True
        new, st.enc = st.enc, []  # the VAD keeps no encoder history
        if final:
            self.model.release_stream(st)  # its caches go back to the model's pool
        if new:
            with torch.no_grad():
                logp = self.model.net.ctc_log_probs(torch.cat(new))[:, self.model.config.blank_id]
            probs = (1.0 - logp.exp()).float().cpu().numpy()
        else:
            probs = np.zeros(0, np.float32)
        state["emitted"] += len(probs)
        if final:
            want = math.ceil(state["samples"] / self.window_size(self.sample_rates[0]))
            if want > state["emitted"]:
                probs = np.concatenate([probs, np.zeros(want - state["emitted"], np.float32)])
                state["emitted"] = want
        return probs.astype(np.float32)

    def speech_probs(self, audio: Any, sample_rate: int = 16000) -> np.ndarray:
        state = self.new_state(sample_rate)
        return self.step(state, audio, final=True)
