"""Qwen2-Audio on the core's continuous-batching executor (:mod:`oasr.executors.autoregressive`).

* :class:`QwenStepModel`: the audio encoder + projector (``encode``) and one Qwen2 decoder
  forward over the executor's paged cache (grouped-query attention, rotary positions); no
  cross-attention: the audio reaches the decoder as embeddings in the prompt
  (``Window.embeds``).
* :class:`QwenDriver`: a request is its audio cut into windows the encoder accepts (at most
  30 s; beyond 30 s cut at the silences a VAD finds: :func:`plan_windows`), decoded one after
  another, their texts joined. Each window's prompt is the task's prompt (chat template or base
  prompt) with the placeholder ``<|AUDIO|>`` expanded to one token per audio embedding, exactly
  as ``Qwen2AudioProcessor`` expands it; greedy by default, sampling options per request. It
  streams partials (:class:`~oasr.executors.autoregressive.StreamsPartials`): a request with an
  ``on_partial`` callback gets its text piece by piece as tokens are sampled (a piece is held
  back while it ends inside a UTF-8 character); the pieces add up to the final text.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.errors import MissingPluginError
from oasr.executors.autoregressive import AttentionContext, AutoregressiveExecutor, Row, Window
from oasr.features.whisper import HOP_LENGTH, N_FRAMES, N_SAMPLES, SAMPLE_RATE, log_mel_spectrogram
from oasr.layers.attention import fixed_shape_attention
from oasr.types import Segment, Transcript
from oasr_models_qwen.nn import encoder_lengths
from oasr_models_qwen.options import DEFAULT_MAX_NEW_TOKENS, qwen_options
from oasr_models_qwen.tokenizer import split_language_tag

if TYPE_CHECKING:
    from oasr.scheduler import Request, SchedulerConfig
    from oasr_models_qwen.model import Qwen2AudioASR

__all__ = ["QwenDriver", "QwenStepModel", "make_executor", "plan_windows", "window_mel"]

log = logging.getLogger(__name__)

#: the decoder context the executor reserves per row: the audio tokens of a 30 s window,
#: the prompt text and the generated tokens (a checkpoint's 32k positions would reserve
#: gigabytes of KV per row)
DEFAULT_CONTEXT = 1536


def make_executor(model: Qwen2AudioASR, config: SchedulerConfig) -> AutoregressiveExecutor:
    return AutoregressiveExecutor(model, QwenStepModel(model), QwenDriver(model), config)


def plan_windows(wave: np.ndarray, long_form: str) -> list[tuple[int, int]]:
    """Sample ranges of at most 30 s covering ``wave``: one window up to 30 s; beyond, with
    ``long_form="vad"``, the speech segments of :func:`oasr.vad.get_speech_segments` packed into
    windows (a segment longer than 30 s is split by the segmenter; no speech: no window), else
    (or without a detector installed) every 30 s."""
    n = int(wave.shape[0])
    if n <= N_SAMPLES:
        return [(0, n)]
    if long_form == "vad":
        try:
            from oasr.vad import SegmentationOptions, get_speech_segments

            segments = get_speech_segments(wave, SAMPLE_RATE, options=SegmentationOptions(max_speech_s=29.5))
        except MissingPluginError:
            log.warning("no VAD detector installed (pip install oasr-vad-silero): cutting every 30 s")
        else:
            windows: list[tuple[int, int]] = []
            for s in segments:
                start, end = s.start, min(s.end, s.start + N_SAMPLES)
                if windows and end - windows[-1][0] <= N_SAMPLES:
                    windows[-1] = (windows[-1][0], end)
                else:
                    windows.append((start, end))
            return windows
    return [(s, min(n, s + N_SAMPLES)) for s in range(0, n, N_SAMPLES)]


def window_mel(wave: torch.Tensor, n_mels: int) -> tuple[torch.Tensor, int]:
    """The (n_mels, 3000) log-mel of a window of at most 30 s (or (B, n_mels, 3000) of a batch
    of equal-length windows (B, n)), zero-padded to 30 s as
    ``WhisperFeatureExtractor(padding="max_length")`` pads it, and its valid frame count
    (the extractor's attention mask: one frame per started hop)."""
    n = int(wave.shape[-1])
    mel = log_mel_spectrogram(wave, n_mels, padding=N_SAMPLES - n)
    return mel, max(1, math.ceil(n / HOP_LENGTH))


# --------------------------------------------------------------------------- the network
class QwenStepModel:
    """:class:`oasr.executors.autoregressive.StepModel` over a :class:`Qwen2AudioNet`."""

    def __init__(self, model: Qwen2AudioASR) -> None:
        net = model.network
        self.net = net
        text = net.config.text
        self.device = net.device
        self.dtype = net.dtype
        self.num_layers = text.layers
        self.num_kv_heads = text.kv_heads
        self.head_dim = text.head_dim
        self.max_positions = min(text.max_positions, model.context)
        self.vocab_size = text.vocab
        self.cross_shape = None
        self.extra_bytes = 0

    def encode(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``inputs``: (mel,) when every window is a full 30 s, else (mel, valid frames)."""
        mel, frames = inputs[0], (inputs[1] if len(inputs) > 1 else None)
        with fixed_shape_attention():  # the encoder's length is always 30 s
            return self.net.encode(mel, frames)

    def project_cross(self, layer: int, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("Qwen2-Audio has no cross-attention")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = ctx.input_embeddings(self.net.decoder.embed_tokens(tokens))
        # a prefill reads only the next token's logits: the decoder's last layer runs on the
        # last position alone (its keys/values are all stored)
        h = self.net.decoder(x, positions, ctx.self_attention, last_only=tokens.shape[1] > 1)
        return self.net.logits(h).float()


# --------------------------------------------------------------------------- the requests
@dataclass(eq=False)
class _Request:
    request: Request
    options: Any  # ResolvedOptions
    wave: torch.Tensor
    chunks: list[tuple[int, int]]  # sample ranges of the windows
    prompt: tuple[list[int], int]  # prompt ids with one placeholder, its index
    next: int = 0
    texts: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    language: str | None = None
    emitted: str = ""  # the text streamed so far (token-streaming partials)


class QwenDriver:
    """:class:`oasr.executors.autoregressive.RequestDriver` for Qwen2-Audio (module docstring)."""

    def __init__(self, model: Qwen2AudioASR) -> None:
        self.model = model
        self.tok = model.tokenizer
        self.n_mels = model.network.config.audio.n_mels
        self.device = model.network.device
        self.states: dict[str, _Request] = {}

    def accept(self, request: Request) -> bool:
        self.model.check(request.options)
        as_mono_waveform(request.audio)
        return True

    def begin(self, requests: list[Request], ex: AutoregressiveExecutor) -> None:
        for request in requests:
            try:
                options = qwen_options(request.options)
                audio = np.asarray(request.audio, dtype=np.float32)
                wave = torch.as_tensor(audio)
                chunks = plan_windows(audio, options.long_form)
                st = _Request(request, options, wave, chunks, self.model.prompt_ids(options))
                self.states[request.rid] = st
                self._next_window(st, ex)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                ex.finish(request, exc)

    def release(self, request: Request) -> None:
        self.states.pop(request.rid, None)

    def _next_window(self, st: _Request, ex: AutoregressiveExecutor) -> None:
        if st.next >= len(st.chunks):
            ex.finish(st.request, self._result(st))
            return
        ex.encode_later(Window(st.request, state=st, info=st.chunks[st.next]))
        st.next += 1

    def _result(self, st: _Request) -> Transcript:
        text = " ".join(t for t in st.texts if t)
        return Transcript(text=text, language=st.language or st.options.language,
                          duration=st.wave.shape[0] / SAMPLE_RATE, segments=st.segments,
                          task=st.options.task)  # fmt: skip

    def encoder_inputs(self, windows: list[Window]) -> tuple[torch.Tensor, ...]:
        """(mel,) when every window fills the encoder's 30 s (no padding mask needed), else
        (mel, valid frames). Windows of one length share one batched log-mel (one host copy,
        one STFT: per window it is a dozen small kernels; on the CPU the batched values are
        the one-at-a-time values exactly)."""
        mels: list[torch.Tensor] = []
        frames: list[int] = []
        order: list[int] = []
        by_len: dict[int, list[int]] = {}
        for k, w in enumerate(windows):
            start, end = w.info
            by_len.setdefault(end - start, []).append(k)
        for ks in by_len.values():
            waves = torch.stack([windows[k].state.wave[windows[k].info[0] : windows[k].info[1]] for k in ks])
            if self.device.type == "cuda":
                waves = waves.pin_memory()
            batch, valid = window_mel(waves.to(self.device, non_blocking=True), self.n_mels)
            mels.append(batch)
            frames.extend([valid] * len(ks))
            order.extend(ks)
        mel = torch.cat(mels) if len(mels) > 1 else mels[0]
        if order != sorted(order):  # back to the windows' order
            mel = mel[torch.tensor(order, device=mel.device).argsort()]
            frames = [frames[i] for i in np.argsort(order)]
        mel = mel.to(self.device, self.model.network.dtype)
        if all(f >= N_FRAMES for f in frames):
            return (mel,)
        return mel, torch.tensor(frames, dtype=torch.long, device=self.device)

    def encoded(self, windows: list[Window], features: torch.Tensor, ex: AutoregressiveExecutor) -> None:
        for k, w in enumerate(windows):
            try:
                self._prepare(w, features[k])
                ex.decode_later(w)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                ex.finish(w.request, exc)

    def _prepare(self, w: Window, features: torch.Tensor) -> None:
        st: _Request = w.state
        o = st.options
        start, end = w.info
        frames = max(1, math.ceil((end - start) / HOP_LENGTH))
        n_audio = int(encoder_lengths(torch.tensor(frames))[1])
        ids, at = st.prompt
        w.prompt = ids[:at] + [self.tok.audio_id] * n_audio + ids[at + 1 :]
        w.embeds = (range(at, at + n_audio), features[:n_audio])
        room = self.model.context - len(w.prompt)
        w.sample_len = max(1, min(o.max_new_tokens or DEFAULT_MAX_NEW_TOKENS, room))
        temps = o.temperatures
        w.temperature = float(temps[0]) if temps else 0.0
        w.top_k = o.top_k or None
        w.top_p = o.top_p
        w.repetition_penalty = float(o.repetition_penalty)
        w.seed = o.seed
        w.stop_tokens = self.model.stop_tokens

    def prefilled(self, rows: list[Row], logits: torch.Tensor) -> None:
        pass

    def process_logits(self, logits: torch.Tensor, rows: list[Row]) -> None:
        pass

    def _text(self, st: _Request, toks: list[int]) -> str:
        """The request's text with this window's tokens: what the transcript will say."""
        _, text = split_language_tag(self.tok.decode(toks))
        return " ".join(t for t in (*st.texts, text) if t)

    def partial(self, row: Row) -> None:
        st: _Request = row.window.state
        toks = [t for t in row.sampled if t not in row.window.stop_tokens]
        text = self._text(st, toks)
        if text.endswith("\ufffd") or not text.startswith(st.emitted) or len(text) == len(st.emitted):
            return  # inside a character, or (rarely) a decoding that does not extend the last
        delta, st.emitted = text[len(st.emitted) :], text
        row.window.request.on_partial(delta)

    def finished(self, row: Row, ex: AutoregressiveExecutor) -> None:
        w = row.window
        st: _Request = w.state
        toks = [t for t in row.sampled if t not in w.stop_tokens]
        language, text = split_language_tag(self.tok.decode(toks))
        if language and st.language is None:
            st.language = language
        start, end = w.info
        n = len(toks)
        avg = float(row.sum_logprob) / max(1, len(row.sampled)) if row.sum_logprob is not None else 0.0
        st.segments.append(Segment(id=len(st.segments), start=start / SAMPLE_RATE, end=end / SAMPLE_RATE,
                                   text=text, tokens=toks[:n], avg_logprob=avg,
                                   temperature=w.temperature))  # fmt: skip
        st.texts.append(text)
        on_partial = st.request.on_partial
        final = " ".join(t for t in st.texts if t)
        if on_partial is not None and final.startswith(st.emitted) and len(final) > len(st.emitted):
            on_partial(final[len(st.emitted) :])  # what was held back
            st.emitted = final
        w.features = None
        w.embeds = None
        self._next_window(st, ex)
