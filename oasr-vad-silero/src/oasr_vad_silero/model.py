"""``SileroVAD``: the ``silero`` voice-activity detector (``oasr.vad`` protocol).

Offline: ``speech_probs(audio, sample_rate)`` scores every window (512 samples at 16 kHz, 256 at
8 kHz; the last one zero-padded) exactly as the ``silero-vad`` package's JIT model does when fed
window by window from a fresh state. ``speech_probs_batch`` scores several files in one pass.

Streaming: ``state = vad.new_state(sample_rate)``; ``vad.step(state, chunk)`` accepts chunks of
any length and returns the probabilities of the windows completed so far; ``final=True`` scores
the zero-padded remainder. ``step_batch(states, chunks)`` advances many streams in one forward.
A state holds the LSTM ``h``/``c``, the last ``context`` samples (64 at 16 kHz, 32 at 8 kHz),
the samples of the incomplete window and counters; it lives on the detector's device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oasr_vad_silero.network import HIDDEN, RATES, RateConfig, SileroVADNet, frames_from_audio
from oasr_vad_silero.weights import load_state, save_oasr


@dataclass
class SileroStreamState:
    """Per-stream streaming state (create with :meth:`SileroVAD.new_state`)."""

    sample_rate: int
    h: torch.Tensor  # (1, 128)
    c: torch.Tensor  # (1, 128)
    context: torch.Tensor  # (1, context) last samples already scored
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    windows: int = 0  # windows scored so far
    samples: int = 0  # samples received so far
    finished: bool = False


def _as_mono_f32(audio: Any) -> np.ndarray:
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().cpu().numpy()
    x = np.asarray(audio, dtype=np.float32)
    if x.ndim != 1:
        x = np.squeeze(x)  # (1, T) or (T, 1)
    if x.ndim != 1:
        raise ValueError(f"expected mono audio (1-D), got shape {np.shape(audio)}")
    return x


class SileroVAD:
    """Silero VAD rebuilt on ``oasr.layers``; 16 kHz and 8 kHz sub-models.

    ``checkpoint``: ``None`` for the ``silero-vad`` package's ``silero_vad.jit`` weights (needs
    ``pip install silero-vad``), or a ``.jit`` file, the package's ``silero_vad_16k.safetensors``
    (different, 16 kHz-only weights) or an OASR export (:meth:`export`).
    """

    name = "silero"

    def __init__(
        self,
        checkpoint: str | os.PathLike[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        states = load_state(checkpoint)
        self.nets: dict[int, SileroVADNet] = {}
        for rate, sd in states.items():
            net = SileroVADNet(RATES[rate])
            net.load_state_dict(sd)
            self.nets[rate] = net.to(self.device, dtype).eval()
        self.sample_rates: tuple[int, ...] = tuple(sorted(self.nets))

    # -- helpers ----------------------------------------------------------------------------
    def _cfg(self, sample_rate: int) -> RateConfig:
        if sample_rate not in self.nets:
            from oasr.errors import InvalidRequestError

            rates = ", ".join(str(r) for r in self.sample_rates)
            raise InvalidRequestError(
                f"Silero VAD runs at {rates} Hz, not {sample_rate} Hz; resample first "
                "(oasr.audio.resample) or use oasr.vad.get_speech_segments, which does",
                param="sample_rate",
            )
        return RATES[sample_rate]

    def window_size(self, sample_rate: int = 16000) -> int:
        return self._cfg(sample_rate).window

    def context_size(self, sample_rate: int = 16000) -> int:
        return self._cfg(sample_rate).context

    def to(self, device: str | torch.device) -> SileroVAD:
        self.device = torch.device(device)
        for net in self.nets.values():
            net.to(self.device)
        return self

    # -- offline ----------------------------------------------------------------------------
    def speech_probs(self, audio: Any, sample_rate: int = 16000) -> np.ndarray:
        """P(speech) per window of ``audio`` (mono), float32 ``(ceil(len / window),)``."""
        return self.speech_probs_batch([audio], sample_rate)[0]

    @torch.inference_mode()
    def speech_probs_batch(self, audios: list[Any], sample_rate: int = 16000) -> list[np.ndarray]:
        """``speech_probs`` of several signals in one batched forward."""
        cfg = self._cfg(sample_rate)
        xs = [_as_mono_f32(a) for a in audios]
        if not xs:
            return []
        counts = [-(-len(x) // cfg.window) for x in xs]
        n = max(counts)
        if n == 0:
            return [np.zeros(0, np.float32) for _ in xs]
        batch = np.zeros((len(xs), n * cfg.window), np.float32)
        for i, x in enumerate(xs):
            batch[i, : len(x)] = x
        audio = torch.from_numpy(batch).to(self.device, self.dtype)
        frames = frames_from_audio(audio, cfg)
        probs, _, _ = self.nets[sample_rate](frames)
        probs = probs.float().cpu().numpy()
        return [probs[i, : counts[i]].copy() for i in range(len(xs))]

    # -- streaming --------------------------------------------------------------------------
    def new_state(self, sample_rate: int = 16000) -> SileroStreamState:
        cfg = self._cfg(sample_rate)
        z = torch.zeros(1, HIDDEN, device=self.device, dtype=self.dtype)
        return SileroStreamState(
            sample_rate=sample_rate,
            h=z,
            c=z.clone(),
            context=torch.zeros(1, cfg.context, device=self.device, dtype=self.dtype),
        )

    def step(self, state: SileroStreamState, chunk: Any, *, final: bool = False) -> np.ndarray:
        """Feed ``chunk`` (any length, may be empty); returns P(speech) of each window completed
        by it. With ``final=True`` the incomplete remainder is zero-padded and scored too, and the
        state is closed."""
        return self.step_batch([state], [chunk], final=final)[0]

    @torch.inference_mode()
    def step_batch(
        self, states: list[SileroStreamState], chunks: list[Any], *, final: bool | list[bool] = False
    ) -> list[np.ndarray]:
        """Advance several streams (same sample rate or not) with one forward per sample rate."""
        if len(states) != len(chunks):
            raise ValueError("one chunk per state")
        finals = final if isinstance(final, list) else [final] * len(states)
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(states)
        groups: dict[int, list[int]] = {}
        for i, st in enumerate(states):
            if st.finished:
                raise ValueError("stream already finished (step(..., final=True) was called)")
            groups.setdefault(st.sample_rate, []).append(i)
        for rate, idx in groups.items():
            cfg = self._cfg(rate)
            win = cfg.window
            audio_rows: list[np.ndarray] = []
            counts: list[int] = []
            for i in idx:
                st = states[i]
                x = _as_mono_f32(chunks[i])
                st.samples += len(x)
                buf = np.concatenate([st.pending, x]) if len(st.pending) else x
                k = len(buf) // win
                rest = buf[k * win :]
                if finals[i] and len(rest):
                    k += 1
                    full = np.zeros(k * win, np.float32)
                    full[: len(buf)] = buf
                    rest = np.zeros(0, np.float32)
                else:
                    full = buf[: k * win]
                st.pending = np.array(rest, np.float32)
                audio_rows.append(full)
                counts.append(k)
            n = max(counts)
            if n == 0:
                for i in idx:
                    states[i].finished = finals[i]
                continue
            b = len(idx)
            batch = np.zeros((b, n * win), np.float32)
            for j, row in enumerate(audio_rows):
                batch[j, : len(row)] = row
            audio = torch.from_numpy(batch).to(self.device, self.dtype)
            context = torch.cat([states[i].context for i in idx], dim=0)
            h = torch.cat([states[i].h for i in idx], dim=0)
            c = torch.cat([states[i].c for i in idx], dim=0)
            frames = frames_from_audio(audio, cfg, context)
            mask = None
            if min(counts) != n:
                mask = torch.arange(n, device=self.device)[None, :] < torch.tensor(
                    counts, device=self.device
                )[:, None]
            probs, h, c = self.nets[rate](frames, h, c, mask)
            probs_np = probs.float().cpu().numpy()
            for j, i in enumerate(idx):
                st = states[i]
                k = counts[j]
                if k:
                    st.h, st.c = h[j : j + 1].clone(), c[j : j + 1].clone()
                    st.context = frames[j : j + 1, k - 1, -cfg.context :].clone()
                    st.windows += k
                st.finished = finals[i]
                out[i] = probs_np[j, :k].copy()
        return out

    # -- export -----------------------------------------------------------------------------
    def export(self, path: str | os.PathLike[str]) -> Path:
        """Write the weights in OASR's safetensors format (``{16k,8k}.*`` names)."""
        return save_oasr({r: net.state_dict() for r, net in self.nets.items()}, path)


__all__ = ["SileroStreamState", "SileroVAD"]
