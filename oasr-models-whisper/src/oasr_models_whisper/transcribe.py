"""Whole-recording transcription: 30 s windows, seeking on timestamp tokens, batched over inputs.

Each input is cut into 30-second windows exactly as openai-whisper's ``transcribe`` does: a window
ends at the last complete timestamp pair the model produced (or at the window end when the text
closes with a single timestamp), text before it becomes segments, and the next window starts
there. With ``condition_on_previous_text`` the tokens decoded so far are the prompt of the next
window. Temperature fallback re-decodes a window that looks repetitive (compression ratio) or
unsure (average log-probability), unless it is silence (no-speech probability).

All inputs advance together: at every step the current window of each unfinished input is
encoded and decoded in one batch (rows whose initial token sequences differ in length are
decoded in separate sub-batches), so short inputs are transcribed in a single batched step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from oasr.features.whisper import (
    HOP_LENGTH,
    N_FFT,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    log_mel_spectrogram,
    mel_filters,
)
from oasr.types import Segment, Transcript
from oasr_models_whisper.alignment import FRAMES_PER_SECOND, add_word_timestamps, last_word_end
from oasr_models_whisper.decoding import (
    WindowOptions,
    WindowResult,
    decode_windows,
    detect_language,
    initial_tokens,
)
from oasr_models_whisper.network import WhisperNetwork
from oasr_models_whisper.options import RequestOptions, whisper_options
from oasr_models_whisper.tokenizer import WhisperTokenizer

INPUT_STRIDE = 2  # mel frames per audio-encoder position
TIME_PRECISION = INPUT_STRIDE * HOP_LENGTH / SAMPLE_RATE  # 0.02 s
#: windows quieter than this RMS (-70 dBFS) are silence: skipped without decoding, because
#: Whisper tends to hallucinate ("you") on digital silence
SILENCE_RMS = 10 ** (-70 / 20)


#: inputs longer than this (samples) get their log-mel computed in pieces to bound memory
LONG_AUDIO_SAMPLES = 20 * 60 * SAMPLE_RATE
_PIECE_FRAMES = 30000  # 5 minutes of frames per STFT piece


def whole_log_mel(wave: torch.Tensor, n_mels: int, piece_frames: int = _PIECE_FRAMES,
                  long_samples: int = LONG_AUDIO_SAMPLES) -> torch.Tensor:  # fmt: skip
    """Log-mel of ``wave`` followed by 30 s of silence, normalised over the whole recording
    (as openai-whisper's transcribe computes it). Long recordings are transformed piecewise
    with identical frames, so the STFT of hours of audio never sits in memory at once."""
    if wave.numel() <= long_samples:
        return log_mel_spectrogram(wave, n_mels, padding=N_SAMPLES)
    x = torch.nn.functional.pad(wave.float(), (0, N_SAMPLES))
    n_frames = x.numel() // HOP_LENGTH  # the last STFT frame is dropped
    half = N_FFT // 2
    padded = torch.nn.functional.pad(x[None, None], (half, half), mode="reflect")[0, 0]
    window = torch.hann_window(N_FFT, device=x.device)
    filters = torch.from_numpy(mel_filters(n_mels)).to(x.device)
    pieces = []
    for f0 in range(0, n_frames, piece_frames):
        f1 = min(n_frames, f0 + piece_frames)
        seg = padded[f0 * HOP_LENGTH : (f1 - 1) * HOP_LENGTH + N_FFT]
        stft = torch.stft(seg, N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
        mel = filters @ (stft.abs() ** 2)
        pieces.append(torch.clamp(mel, min=1e-10).log10())
    log_spec = torch.cat(pieces, dim=-1)
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


@dataclass
class _Job:
    index: int
    wave: torch.Tensor  # (samples,)
    mel: torch.Tensor | None  # (n_mels, frames + N_FRAMES of padding); the engine fills it late
    content_frames: int
    duration: float
    language: str | None = None
    sot_sequence: tuple[int, ...] = ()
    seek: int = 0
    all_tokens: list[int] = field(default_factory=list)
    prompt_tokens_initial: int = 0
    prompt_reset_since: int = 0
    segments: list[Segment] = field(default_factory=list)
    last_speech_timestamp: float = 0.0

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames


def _needs_fallback(r: WindowResult, o: RequestOptions) -> bool:
    o = whisper_options(o)
    bad = False
    if (
        o.compression_ratio_threshold is not None
        and r.compression_ratio > o.compression_ratio_threshold
    ):
        bad = True  # too repetitive
    if o.logprob_threshold is not None and r.avg_logprob < o.logprob_threshold:
        bad = True  # too unsure
    if (
        o.no_speech_threshold is not None
        and r.no_speech_prob > o.no_speech_threshold
        and o.logprob_threshold is not None
        and r.avg_logprob < o.logprob_threshold
    ):
        bad = False  # silence: nothing to fix by sampling
    return bad


def _window_options(
    o: RequestOptions, temperature: float, suppress: tuple[int, ...]
) -> WindowOptions:
    return WindowOptions(
        temperature=temperature,
        beam_size=o.beam_size if temperature == 0 else 1,
        patience=o.patience,
        length_penalty=o.length_penalty,
        best_of=1,
        sample_len=o.max_new_tokens,
        without_timestamps=o.without_timestamps,
        suppress_blank=o.suppress_blank,
        suppress_tokens=suppress,
    )


def decode_with_fallback(
    network: WhisperNetwork,
    tokenizer: WhisperTokenizer,
    features: torch.Tensor,
    inits: Sequence[Sequence[int]],
    options: RequestOptions,
    suppress: tuple[int, ...],
    max_batch_size: int = 16,
) -> list[WindowResult]:
    """Decode each row, retrying rows that need it at the next temperature of ``options``."""
    options = whisper_options(options)
    n = features.shape[0]
    results: list[WindowResult | None] = [None] * n
    pending = list(range(n))
    for temperature in options.temperatures:
        wopts = _window_options(options, temperature, suppress)
        by_len: dict[int, list[int]] = {}
        for i in pending:
            by_len.setdefault(len(inits[i]), []).append(i)
        for rows in by_len.values():
            for k in range(0, len(rows), max_batch_size):
                chunk = rows[k : k + max_batch_size]
                idx = torch.tensor(chunk, device=features.device)
                out = decode_windows(
                    network,
                    tokenizer,
                    features.index_select(0, idx),
                    [inits[i] for i in chunk],
                    wopts,
                )
                for i, r in zip(chunk, out, strict=False):
                    results[i] = r
        pending = [i for i in pending if _needs_fallback(results[i], options)]
        if not pending:
            break
    return results  # type: ignore[return-value]


def _encode(network: WhisperNetwork, mels: list[torch.Tensor], max_batch_size: int) -> torch.Tensor:
    outs = []
    for k in range(0, len(mels), max_batch_size):
        batch = torch.stack(mels[k : k + max_batch_size]).to(network.device, network.dtype)
        outs.append(network.encode(batch))
    return torch.cat(outs, dim=0)


def _window_mel(mel: torch.Tensor, seek: int, size: int) -> torch.Tensor:
    seg = mel[:, seek : seek + size]
    if seg.shape[-1] < N_FRAMES:
        seg = torch.nn.functional.pad(seg, (0, N_FRAMES - seg.shape[-1]))
    return seg


def _new_segment(tokenizer, job: _Job, start: float, end: float, tokens: list[int],
                 r: WindowResult) -> Segment:  # fmt: skip
    text_tokens = [t for t in tokens if t < tokenizer.eot]
    return Segment(
        id=0,
        start=start,
        end=end,
        text=tokenizer.decode(text_tokens),
        tokens=list(tokens),
        avg_logprob=r.avg_logprob,
        compression_ratio=r.compression_ratio,
        no_speech_prob=r.no_speech_prob,
        temperature=r.temperature,
        seek=job.seek,
    )


@torch.no_grad()
def transcribe(
    network: WhisperNetwork,
    tokenizer: WhisperTokenizer,
    audios: Sequence[np.ndarray | torch.Tensor],
    options: RequestOptions,
    *,
    multilingual: bool,
    language: str | None = None,
    suppress: tuple[int, ...] = (),
    max_batch_size: int = 16,
    progress: Callable[[float, float], None] | None = None,
) -> list[Transcript]:
    """Transcribe (or translate) 16 kHz mono waveforms of any length.

    ``language`` is the already-validated language code (None: detect per input on multilingual
    models); ``suppress`` the resolved suppress-token ids.
    """
    options = whisper_options(options)
    n_mels = network.dims.n_mels
    n_ctx = network.dims.n_text_ctx
    task = options.task if multilingual else None
    jobs: list[_Job] = []
    for i, audio in enumerate(audios):
        wave = torch.as_tensor(np.asarray(audio, dtype=np.float32)).flatten()
        mel = whole_log_mel(wave, n_mels)
        content = mel.shape[-1] - N_FRAMES
        jobs.append(_Job(i, wave, mel, content, wave.shape[0] / SAMPLE_RATE))

    # language: given, English-only model, or detected from the first 30 s of each input
    to_detect = [j for j in jobs if language is None and multilingual and j.content_frames > 0]
    for j in jobs:
        j.language = language if language is not None else ("en" if not multilingual else None)
    if to_detect:
        feats = _encode(network, [j.mel[:, :N_FRAMES] for j in to_detect], max_batch_size)
        codes, _ = detect_language(network, tokenizer, feats)
        for j, code in zip(to_detect, codes, strict=False):
            j.language = code
    for j in jobs:
        j.sot_sequence = tokenizer.sot_sequence(j.language, task, multilingual=multilingual)

    if options.prompt:
        prompt_ids = tokenizer.encode(" " + options.prompt.strip())
        for j in jobs:
            j.all_tokens.extend(prompt_ids)
            j.prompt_tokens_initial = len(prompt_ids)

    total = float(sum(j.content_frames for j in jobs))

    def report() -> None:
        if progress is not None:
            progress(float(sum(min(j.seek, j.content_frames) for j in jobs)), total)

    while True:
        active = [j for j in jobs if not j.done]
        if options.no_speech_threshold is not None:
            for j in active:
                size = min(N_FRAMES, j.content_frames - j.seek)
                if _is_silent(j.wave[j.seek * HOP_LENGTH : (j.seek + size) * HOP_LENGTH]):
                    j.seek += size
            active = [j for j in active if not j.done]
        if not active:
            report()
            break
        sizes = [min(N_FRAMES, j.content_frames - j.seek) for j in active]
        mels = [_window_mel(j.mel, j.seek, s) for j, s in zip(active, sizes, strict=False)]
        feats = _encode(network, mels, max_batch_size)
        inits = [
            initial_tokens(
                tokenizer, j.sot_sequence, prompt=j.all_tokens[j.prompt_reset_since :],
                without_timestamps=options.without_timestamps, n_text_ctx=n_ctx,
            )
            for j in active
        ]  # fmt: skip
        results = decode_with_fallback(
            network, tokenizer, feats, inits, options, suppress, max_batch_size
        )
        for row, (job, size, result) in enumerate(zip(active, sizes, results, strict=False)):
            _advance(job, size, result, feats[row : row + 1], network, tokenizer, options)
        report()

    out = []
    for j in jobs:
        segs = [s for s in j.segments if s.text.strip()]
        for k, s in enumerate(segs):
            s.id = k
        text = tokenizer.decode(j.all_tokens[j.prompt_tokens_initial :]).strip()
        out.append(Transcript(text=text, language=j.language, duration=j.duration,
                              segments=segs, task=options.task))  # fmt: skip
    return out


def _is_silent(samples: torch.Tensor) -> bool:
    if samples.numel() == 0:
        return True
    return float(samples.double().square().mean().sqrt()) < SILENCE_RMS


def _clamp_to(segments: list[Segment], duration: float) -> None:
    """Segment and word times inside ``[0, duration]``: the last window's timestamp tokens may
    run past the end of the audio (a 29.4 s clip's last segment ended at 32.6 s)."""
    end = round(duration, 3)
    for s in segments:
        s.end = min(s.end, end)
        s.start = min(s.start, s.end)
        for w in s.words:
            w.end = min(w.end, end)
            w.start = min(w.start, w.end)


def _advance(job: _Job, size: int, r: WindowResult, feats: torch.Tensor, network, tokenizer,
             options: RequestOptions) -> None:  # fmt: skip
    """Turn one decoded window into segments and move ``job.seek`` forward."""
    options = whisper_options(options)
    time_offset = job.seek * HOP_LENGTH / SAMPLE_RATE
    if options.no_speech_threshold is not None:
        skip = r.no_speech_prob > options.no_speech_threshold
        if options.logprob_threshold is not None and r.avg_logprob > options.logprob_threshold:
            skip = False
        if skip:
            job.seek += size  # silence: jump over the whole window
            return

        # a window of nothing but punctuation at a high no-speech probability is noise
        if r.no_speech_prob > options.no_speech_threshold and not any(
            ch.isalnum() for ch in tokenizer.decode(r.tokens)
        ):
            job.seek += size
            return

    tb = tokenizer.timestamp_begin
    tokens = r.tokens
    is_ts = [t >= tb for t in tokens]
    single_ending = is_ts[-2:] == [False, True]
    consecutive = [k + 1 for k in range(len(tokens) - 1) if is_ts[k] and is_ts[k + 1]]
    current: list[Segment] = []
    if consecutive:
        slices = list(consecutive)
        if single_ending:
            slices.append(len(tokens))
        last = 0
        for cut in slices:
            piece = tokens[last:cut]
            start = time_offset + (piece[0] - tb) * TIME_PRECISION
            end = time_offset + (piece[-1] - tb) * TIME_PRECISION
            current.append(_new_segment(tokenizer, job, start, end, piece, r))
            last = cut
        if single_ending:
            new_seek = job.seek + size
        else:
            new_seek = job.seek + (tokens[last - 1] - tb) * INPUT_STRIDE
    else:
        duration = size * HOP_LENGTH / SAMPLE_RATE
        stamps = [t for t in tokens if t >= tb]
        if stamps and stamps[-1] != tb:
            duration = (stamps[-1] - tb) * TIME_PRECISION
        current.append(_new_segment(tokenizer, job, time_offset, time_offset + duration, tokens, r))
        new_seek = job.seek + size

    if options.word_timestamps:
        add_word_timestamps(
            current, network, tokenizer, job.sot_sequence, feats, size, job.language,
            time_offset, job.last_speech_timestamp,
        )  # fmt: skip
        if not single_ending:
            end = last_word_end(current)
            if end is not None and end > time_offset:
                new_seek = round(end * FRAMES_PER_SECOND)
        end = last_word_end(current)
        if end is not None:
            job.last_speech_timestamp = end

    for s in current:
        if s.start == s.end or not s.text.strip():
            s.text = ""
            s.tokens = []
            s.words = []
    _clamp_to(current, job.duration)
    job.segments.extend(current)
    job.all_tokens.extend(t for s in current for t in s.tokens)
    if not options.condition_on_previous_text or r.temperature > 0.5:
        job.prompt_reset_since = len(job.all_tokens)
    job.seek = new_seek
