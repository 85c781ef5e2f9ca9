"""VAD-batched long-form transcription (the Whisper option ``long_form="vad"``).

Instead of seeking through a recording window by window (``transcribe.transcribe``, each window
conditioned on the text before it), every input is first cut by a voice activity detector:

1. the detector (``oasr.vad``, Silero by default) finds the speech segments of each input, with
   over-long speech split at the detector's ``max_speech_s`` split (at the longest pause inside
   it, or hard at the limit when there is none);
2. neighbouring segments are merged into **chunks** while the span from the first segment's start
   to the last one's end fits in one 30 s model window; a chunk is that contiguous span of the
   original audio (the short pauses between its segments included), so its times map back to
   the recording by adding the chunk start;
3. the chunks of **all** inputs are encoded and decoded together through the regular batched
   window decoder (``transcribe.decode_with_fallback``: the same logit filters, temperature
   fallback per chunk), ``max_batch_size`` chunks at a time;
4. each chunk's tokens become segments at its timestamp tokens (nothing is re-decoded: a chunk
   is decoded exactly once), words are aligned per chunk when ``word_timestamps`` is on, and all
   times are offset by the chunk start and clipped to the chunk's bounds.

Inputs with no speech (silence, noise, music the detector rejects) produce no chunk and an empty
transcript of the right duration. The language is set per input: the given one, ``en`` on an
English-only model, or detected (multilingual models) from the input's first chunk.

There is no cross-chunk context: ``condition_on_previous_text`` does not apply; an initial
``prompt`` precedes every chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from oasr.features.whisper import HOP_LENGTH, N_FRAMES, N_SAMPLES, SAMPLE_RATE, log_mel_spectrogram
from oasr.types import Segment, Transcript, Word
from oasr.vad import SegmentationOptions, SpeechSegment, VoiceActivityDetector
from oasr_models_whisper.alignment import add_word_timestamps
from oasr_models_whisper.decoding import WindowResult, detect_language, initial_tokens
from oasr_models_whisper.network import WhisperNetwork
from oasr_models_whisper.options import RequestOptions, whisper_options
from oasr_models_whisper.tokenizer import WhisperTokenizer
from oasr_models_whisper.transcribe import (
    TIME_PRECISION,
    _encode,
    _is_silent,
    decode_with_fallback,
)

__all__ = [
    "DEFAULT_SEGMENTATION",
    "Chunk",
    "detector_for",
    "merge_segments",
    "speech_chunks",
    "speech_segments_batch",
    "transcribe_vad",
]

#: VAD settings of this mode: Silero's hysteresis thresholds; 160 ms of silence ends a segment;
#: 200 ms of context kept on each side; speech longer than one window (minus the padding) is
#: split at its longest pause.
DEFAULT_SEGMENTATION = SegmentationOptions(
    threshold=0.5,
    min_speech_ms=250,
    min_silence_ms=160,
    speech_pad_ms=200,
    max_speech_s=N_SAMPLES / SAMPLE_RATE,
)


@dataclass(frozen=True)
class Chunk:
    """A span ``[start, end)`` (samples at 16 kHz) of input ``index`` decoded as one window."""

    index: int
    start: int
    end: int
    #: the VAD segments it covers (samples, original timeline)
    segments: tuple[SpeechSegment, ...] = ()

    @property
    def start_s(self) -> float:
        return self.start / SAMPLE_RATE

    @property
    def end_s(self) -> float:
        return self.end / SAMPLE_RATE


def merge_segments(
    segments: Sequence[SpeechSegment], index: int = 0, max_samples: int = N_SAMPLES
) -> list[Chunk]:
    """Merge consecutive speech segments into chunks whose span fits ``max_samples``.

    A segment joins the current chunk while ``segment.end - chunk.start <= max_samples``; a
    segment longer than ``max_samples`` on its own (possible only with custom VAD settings) is
    cut into ``max_samples`` pieces.
    """
    chunks: list[Chunk] = []
    cur: list[SpeechSegment] = []
    for seg in segments:
        if seg.end <= seg.start:
            continue
        if cur and seg.end - cur[0].start <= max_samples:
            cur.append(seg)
            continue
        if cur:
            chunks.append(Chunk(index, cur[0].start, cur[-1].end, tuple(cur)))
            cur = []
        if seg.end - seg.start > max_samples:
            for a in range(seg.start, seg.end, max_samples):
                b = min(seg.end, a + max_samples)
                piece = SpeechSegment(a, b, seg.sample_rate)
                if b == seg.end:
                    cur = [piece]
                else:
                    chunks.append(Chunk(index, a, b, (piece,)))
        else:
            cur = [seg]
    if cur:
        chunks.append(Chunk(index, cur[0].start, cur[-1].end, tuple(cur)))
    return chunks


def speech_chunks(
    audio: np.ndarray,
    index: int = 0,
    detector: VoiceActivityDetector | None = None,
    options: SegmentationOptions | None = None,
    max_samples: int = N_SAMPLES,
) -> list[Chunk]:
    """VAD segments of one 16 kHz input merged into chunks of at most ``max_samples``."""
    from oasr.vad import get_speech_segments

    if len(audio) == 0:
        return []
    segs = get_speech_segments(audio, SAMPLE_RATE, detector, options or DEFAULT_SEGMENTATION)
    return merge_segments(segs, index, max_samples)


_DETECTORS: dict[str, VoiceActivityDetector] = {}


def detector_for(device: torch.device | str) -> VoiceActivityDetector:
    """The default detector (Silero) on the model's device: :func:`oasr.vad.default_detector`
    on CPU, else one ``get_detector(device=...)`` built once per device."""
    from oasr.vad import default_detector, get_detector

    key = str(device)
    if key.startswith("cpu"):
        return default_detector()
    det = _DETECTORS.get(key)
    if det is None:
        det = _DETECTORS.setdefault(key, get_detector(device=key))
    return det


#: inputs scored by the detector in one batched call hold at most this many (padded) samples
VAD_BATCH_SAMPLES = 64 * 2**20


def speech_segments_batch(
    audios: Sequence[np.ndarray],
    detector: VoiceActivityDetector | None = None,
    options: SegmentationOptions | None = None,
    max_samples: int = VAD_BATCH_SAMPLES,
) -> list[list[SpeechSegment]]:
    """VAD segments of several 16 kHz inputs. A detector with ``speech_probs_batch`` (Silero)
    scores groups of inputs in one call (its recurrent part steps all rows together), grouped so
    that ``len(group) * longest <= max_samples``; other detectors go one input at a time."""
    from oasr.vad import default_detector, get_speech_segments, segments_from_probs

    det = detector if detector is not None else default_detector()
    opts = options or DEFAULT_SEGMENTATION
    out: list[list[SpeechSegment]] = [[] for _ in audios]
    # on CPU, batching rows does not pay (measured: 16 x 93 s took 3.3 s batched, 2.4 s one by
    # one); on an accelerator the per-window LSTM steps are launch-bound and batching does
    device = str(getattr(det, "device", "cpu"))
    batched = (
        hasattr(det, "speech_probs_batch")
        and SAMPLE_RATE in tuple(det.sample_rates)
        and not device.startswith("cpu")
    )
    if not batched:
        for i, a in enumerate(audios):
            if len(a):
                out[i] = get_speech_segments(a, SAMPLE_RATE, det, opts)
        return out
    window = det.window_size(SAMPLE_RATE)
    todo = [i for i, a in enumerate(audios) if len(a)]
    group: list[int] = []

    def flush() -> None:
        if group:
            probs = det.speech_probs_batch([audios[i] for i in group], SAMPLE_RATE)  # type: ignore[attr-defined]
            for i, p in zip(group, probs, strict=True):
                out[i] = segments_from_probs(p, SAMPLE_RATE, window, opts, len(audios[i]))
            group.clear()

    for i in todo:
        longest = max([len(audios[k]) for k in group] + [len(audios[i])])
        if group and (len(group) + 1) * longest > max_samples:
            flush()
        group.append(i)
    flush()
    return out


@dataclass
class _Input:
    index: int
    wave: torch.Tensor
    duration: float
    chunks: list[Chunk] = field(default_factory=list)
    language: str | None = None
    sot_sequence: tuple[int, ...] = ()
    segments: list[Segment] = field(default_factory=list)


def _chunk_mel(wave: torch.Tensor, chunk: Chunk, n_mels: int) -> tuple[torch.Tensor, int]:
    """(n_mels, N_FRAMES) log-mel of the chunk's audio and its number of content frames.

    As sequential mode does with a recording: the log-mel of the audio followed by 30 s of
    silence, normalised over both, keeps the chunk's frames and pads them with zeros to one
    window (so a whole clip of up to 30 s gets exactly the features sequential mode gives it).
    """
    x = wave[chunk.start : chunk.end]
    mel = log_mel_spectrogram(x, n_mels, padding=N_SAMPLES)
    content = max(0, min(N_FRAMES, mel.shape[-1] - N_FRAMES))
    mel = mel[:, :content]
    if mel.shape[-1] < N_FRAMES:
        mel = torch.nn.functional.pad(mel, (0, N_FRAMES - mel.shape[-1]))
    return mel, content


def _is_non_speech(r: WindowResult, o: RequestOptions, tokenizer: WhisperTokenizer) -> bool:
    """The chunk decodes to silence (Whisper's no-speech rule) or to nothing but punctuation
    at a high no-speech probability."""
    if o.no_speech_threshold is None:
        return False
    if r.no_speech_prob > o.no_speech_threshold:
        if o.logprob_threshold is None or r.avg_logprob < o.logprob_threshold:
            return True
        if not any(ch.isalnum() for ch in tokenizer.decode(r.tokens)):
            return True
    return False


def _segments_of_chunk(tokenizer: WhisperTokenizer, chunk: Chunk, r: WindowResult) -> list[Segment]:
    """Cut a chunk's tokens into segments at consecutive timestamp pairs; the whole output is
    used (text after the last timestamp ends at the chunk end). Times are absolute."""
    tb = tokenizer.timestamp_begin
    t0, t1 = chunk.start_s, chunk.end_s
    span = t1 - t0
    tokens = list(r.tokens)
    pieces: list[list[int]] = []
    cur: list[int] = []
    for k, t in enumerate(tokens):
        if t >= tb and k > 0 and tokens[k - 1] >= tb and cur:
            pieces.append(cur)
            cur = []
        cur.append(t)
    if cur:
        pieces.append(cur)
    out: list[Segment] = []
    prev_end = 0.0
    for piece in pieces:
        text_tokens = [t for t in piece if t < tokenizer.eot]
        start = (piece[0] - tb) * TIME_PRECISION if piece[0] >= tb else prev_end
        end = (piece[-1] - tb) * TIME_PRECISION if piece[-1] >= tb and len(piece) > 1 else span
        start = min(max(start, 0.0), span)
        end = min(max(end, start), span)
        prev_end = end
        out.append(
            Segment(
                id=0,
                start=round(t0 + start, 3),
                end=round(t0 + end, 3),
                text=tokenizer.decode(text_tokens),
                tokens=piece,
                avg_logprob=r.avg_logprob,
                compression_ratio=r.compression_ratio,
                no_speech_prob=r.no_speech_prob,
                temperature=r.temperature,
                seek=chunk.start // HOP_LENGTH,
            )
        )
    return out


def _clip_to_chunk(segments: list[Segment], chunk: Chunk) -> None:
    """Keep segment and word times inside the chunk, and words in order."""
    lo, hi = round(chunk.start_s, 3), round(chunk.end_s, 3)

    def clip(t: float) -> float:
        return min(max(t, lo), hi)

    prev = lo
    for s in segments:
        words: list[Word] = []
        for w in s.words:
            w.start = max(clip(w.start), prev)
            w.end = max(clip(w.end), w.start)
            prev = w.start
            words.append(w)
        s.words = words
        s.start = clip(s.start)
        s.end = max(clip(s.end), s.start)


def _covered(segs: Sequence[Segment]) -> list[tuple[float, float]]:
    spans = []
    for s in segs:
        if s.words:
            spans.append((min(s.start, s.words[0].start), max(s.end, s.words[-1].end)))
        else:
            spans.append((s.start, s.end))
    return sorted(spans)


def _uncovered(chunk: Chunk, segs: Sequence[Segment], min_seconds: float,
               tolerance: float = 0.3) -> list[Chunk]:  # fmt: skip
    """Parts of the chunk's VAD segments that none of its decoded segments (or their words)
    covers, as chunks to decode again. A part counts only if it is at least ``min_seconds``
    long after giving ``tolerance`` s to each decoded span it borders (Whisper's segment times
    are only roughly aligned); the chunk itself still starts right where the decoded span
    ends, so a word just after it is not cut."""
    spans = _covered(segs)
    out: list[SpeechSegment] = []
    for vs in chunk.segments:
        a, b = vs.start_s, vs.end_s
        cur, cur_covered = a, False
        pieces = []
        for s0, s1 in spans:
            if s1 <= cur or s0 >= b:
                continue
            if s0 > cur:
                pieces.append((cur, s0, cur_covered, True))
            cur, cur_covered = max(cur, s1), True
        if cur < b:
            pieces.append((cur, b, cur_covered, False))
        for p0, p1, left, right in pieces:
            if p1 - p0 - tolerance * (left + right) >= min_seconds:
                out.append(SpeechSegment(round(p0 * SAMPLE_RATE), round(p1 * SAMPLE_RATE),
                                         SAMPLE_RATE))  # fmt: skip
    if not out or (len(out) == 1 and out[0].start <= chunk.start and out[0].end >= chunk.end):
        return []  # nothing missing, or the same chunk again (it would decode the same way)
    # Each gap is its own chunk: merging two gaps into one span would take the decoded audio
    # between them along, and decoding it a second time repeats its words (issue #14). Only
    # gaps with no decoded span between them (neighbouring VAD segments) share a chunk.
    chunks: list[Chunk] = []
    run: list[SpeechSegment] = []
    for piece in out:
        if run and not any(s0 < piece.start_s and s1 > run[-1].end_s for s0, s1 in spans):
            run.append(piece)
            continue
        if run:
            chunks.extend(merge_segments(run, chunk.index))
        run = [piece]
    if run:
        chunks.extend(merge_segments(run, chunk.index))
    return chunks


def _words(text: str) -> list[str]:
    return ["".join(ch for ch in w.lower() if ch.isalnum()) for w in text.split()]


def _drop_repeats(segments: list[Segment], tokenizer: WhisperTokenizer,
                  min_run: int = 3) -> list[Segment]:  # fmt: skip
    """Segments sorted by start -> segments that neither overlap nor repeat each other.

    A segment whose time span lies mostly (over half of it) inside the one before is the same
    audio decoded twice and goes; a smaller overlap moves its start to the previous end. A
    segment that begins with the last ``min_run`` or more words of the one before (the same words
    heard twice, Whisper's times being only roughly aligned at a repair chunk's edge) loses them.
    """
    out: list[Segment] = []
    for s in segments:
        if out:
            prev = out[-1]
            overlap = prev.end - s.start
            if overlap > 0:
                if overlap > 0.5 * max(s.end - s.start, 1e-6):
                    continue
                s.start = prev.end
                if s.words:
                    for w in s.words:
                        w.start = max(w.start, s.start)
                        w.end = max(w.end, w.start)
            head, tail = _words(s.text), _words(prev.text)
            n = 0
            for k in range(min(len(head), len(tail)), min_run - 1, -1):
                if head[:k] == tail[-k:] and all(head[:k]):
                    n = k
                    break
            if n:
                if n >= len(head):
                    continue
                kept = s.text.split()[n:]
                s.text = " " + " ".join(kept)
                ts = tokenizer.timestamp_begin
                lead = [t for t in s.tokens[:1] if t >= ts]
                trail = [t for t in s.tokens[-1:] if t >= ts] if len(s.tokens) > 1 else []
                s.tokens = lead + tokenizer.encode(s.text) + trail
                if s.words:
                    s.words = s.words[n:] if len(s.words) > n else s.words
                    s.start = max(s.start, s.words[0].start)
        out.append(s)
    return out


def _decode_group(network, tokenizer, inputs: list[_Input], group: Sequence[Chunk],
                  options: RequestOptions, suppress: tuple[int, ...], max_batch_size: int,
                  n_ctx: int, n_mels: int, prompt_ids) -> list[tuple[Chunk, list[Segment]]]:  # fmt: skip
    """Encode and decode a batch of chunks; their segments (absolute times) are added to their
    inputs and returned per chunk."""
    mels, sizes, keep = [], [], []
    for c in group:
        job = inputs[c.index]
        if options.no_speech_threshold is not None and _is_silent(job.wave[c.start : c.end]):
            continue
        mel, size = _chunk_mel(job.wave, c, n_mels)
        mels.append(mel)
        sizes.append(size)
        keep.append(c)
    if not keep:
        return []
    feats = _encode(network, mels, max_batch_size)
    inits = [
        initial_tokens(
            tokenizer, inputs[c.index].sot_sequence, prompt=prompt_ids,
            without_timestamps=options.without_timestamps, n_text_ctx=n_ctx,
        )
        for c in keep
    ]  # fmt: skip
    results = decode_with_fallback(network, tokenizer, feats, inits, options, suppress,
                                   max_batch_size)  # fmt: skip
    out = []
    for row, (c, size, r) in enumerate(zip(keep, sizes, results, strict=True)):
        if _is_non_speech(r, options, tokenizer):
            continue
        job = inputs[c.index]
        segs = _segments_of_chunk(tokenizer, c, r)
        if options.word_timestamps:
            before = [s for s in job.segments if s.end <= c.start_s + 1e-6]
            last = max(before, key=lambda s: s.end) if before else None
            last_speech = (last.words[-1].end if last.words else last.end) if last else 0.0
            add_word_timestamps(
                segs, network, tokenizer, job.sot_sequence, feats[row : row + 1], size,
                job.language, c.start_s, last_speech,
            )  # fmt: skip
        _clip_to_chunk(segs, c)
        segs = [s for s in segs if s.start != s.end and s.text.strip()]
        job.segments.extend(segs)
        out.append((c, segs))
    return out


@torch.no_grad()
def transcribe_vad(
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
    detector: VoiceActivityDetector | None = None,
    vad_options: SegmentationOptions | None = None,
    repair_rounds: int = 2,
    min_uncovered: float = 0.5,
    whole_short_inputs: bool = True,
) -> list[Transcript]:
    """Transcribe (or translate) 16 kHz mono waveforms: VAD chunks of all inputs, one batch.

    Arguments as :func:`oasr_models_whisper.transcribe.transcribe`; ``detector`` defaults to
    the Silero detector on the network's device (:func:`detector_for`), ``vad_options`` to
    :data:`DEFAULT_SEGMENTATION`.

    An input of at most 30 s in which the VAD finds speech is decoded whole, as one chunk
    (``whole_short_inputs``; it then gets the features and the single window sequential mode
    gives it); the VAD only gates it.

    Whisper sometimes ends a window early or jumps over a sentence; VAD speech of a decoded
    chunk that no decoded segment covers (at least ``min_uncovered`` seconds of one VAD segment)
    is decoded again as a new, shorter chunk, batched, up to ``repair_rounds`` times.
    """
    options = whisper_options(options)
    n_mels = network.dims.n_mels
    n_ctx = network.dims.n_text_ctx
    task = options.task if multilingual else None
    if detector is None:
        detector = detector_for(network.device)
    vad_opts = vad_options or DEFAULT_SEGMENTATION

    inputs: list[_Input] = []
    for i, audio in enumerate(audios):
        wave = torch.as_tensor(np.asarray(audio, dtype=np.float32)).flatten()
        inputs.append(_Input(i, wave, wave.shape[0] / SAMPLE_RATE))
    speech = speech_segments_batch([j.wave.numpy() for j in inputs], detector, vad_opts)
    for j, segs in zip(inputs, speech, strict=True):
        n = j.wave.shape[0]
        if segs and n <= N_SAMPLES and whole_short_inputs:
            # the whole input fits one window: decode all of it, as sequential mode would
            j.chunks = [Chunk(j.index, 0, n, tuple(segs))]
        else:
            j.chunks = merge_segments(segs, j.index)

    chunks = [c for j in inputs for c in j.chunks]
    total = float(sum(c.end - c.start for c in chunks)) or 1.0
    done = 0.0

    def report() -> None:
        if progress is not None:
            progress(min(done, total), total)

    # language: given, English-only, or detected from each input's first chunk
    for j in inputs:
        j.language = language if language is not None else ("en" if not multilingual else None)
    to_detect = [j for j in inputs if j.language is None and j.chunks]
    if to_detect:
        mels = [_chunk_mel(j.wave, j.chunks[0], n_mels)[0] for j in to_detect]
        codes, _ = detect_language(network, tokenizer, _encode(network, mels, max_batch_size))
        for j, code in zip(to_detect, codes, strict=True):
            j.language = code
    for j in inputs:
        if j.chunks:  # (an input without speech keeps language None on multilingual models)
            j.sot_sequence = tuple(
                tokenizer.sot_sequence(j.language, task, multilingual=multilingual)
            )

    prompt_ids = tokenizer.encode(" " + options.prompt.strip()) if options.prompt else None

    pending = chunks
    for round_ in range(1 + max(0, repair_rounds)):
        repairs: list[Chunk] = []
        for k in range(0, len(pending), max_batch_size):
            group = pending[k : k + max_batch_size]
            decoded = _decode_group(network, tokenizer, inputs, group, options, suppress,
                                    max_batch_size, n_ctx, n_mels, prompt_ids)  # fmt: skip
            for c, segs in decoded:
                if segs and round_ < repair_rounds:
                    repairs.extend(_uncovered(c, segs, min_uncovered))
            if round_ == 0:
                done += sum(c.end - c.start for c in group)
                report()
        if not repairs:
            break
        pending = repairs

    out = []
    for j in inputs:
        j.segments.sort(key=lambda seg: (seg.start, seg.end))
        j.segments = _drop_repeats(j.segments, tokenizer)
        for n, s in enumerate(j.segments):
            s.id = n
        text_tokens = [t for s in j.segments for t in s.tokens if t < tokenizer.eot]
        out.append(
            Transcript(
                text=tokenizer.decode(text_tokens).strip(),
                language=j.language,
                duration=j.duration,
                segments=j.segments,
                task=options.task,
            )
        )
    if progress is not None:
        progress(total, total)
    return out
