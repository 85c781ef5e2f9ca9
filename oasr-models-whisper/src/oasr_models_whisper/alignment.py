"""Word timestamps and confidences from Whisper's cross-attention.

The text of a window is teacher-forced through the decoder; the cross-attention weights of the
checkpoint's alignment heads are normalised per head over tokens, median-filtered over time and
averaged; dynamic time warping then finds the monotonic token -> audio-frame path, and words are
timed at their first token's jump. Punctuation is merged into neighbouring words and overly long
words at pauses are trimmed, with the same heuristics as openai-whisper so results agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from oasr.types import Segment, Word
from oasr_models_whisper.network import WhisperNetwork
from oasr_models_whisper.tokenizer import WhisperTokenizer

#: decoder positions (audio frames after the 2x conv stride) per second
TOKENS_PER_SECOND = 50
FRAMES_PER_SECOND = 100  # mel frames per second

PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END_MARKS = ".。!！?？"


@dataclass
class WordTiming:
    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of odd ``width`` along the last axis, reflect-padded."""
    if width <= 1:
        return x
    if width % 2 != 1:
        raise ValueError("median filter width must be odd")
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    left = x[..., 1 : pad + 1].flip(-1)
    right = x[..., -pad - 1 : -1].flip(-1)
    padded = torch.cat([left, x, right], dim=-1)
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through ``cost`` (N, M) from (0, 0) to (N-1, M-1).

    Steps are diagonal, down (next token, same frame) or right (same token, next frame); ties go
    right, then down. Cells on one anti-diagonal are independent, so each diagonal is one
    vectorised numpy step. Returns (token indices, frame indices) along the path.
    """
    cost = np.asarray(cost, dtype=np.float64)
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0 = acc[i - 1, j - 1]
        c1 = acc[i - 1, j]
        c2 = acc[i, j - 1]
        take0 = (c0 < c1) & (c0 < c2)
        take1 = ~take0 & (c1 < c0) & (c1 < c2)
        best = np.where(take0, c0, np.where(take1, c1, c2))
        acc[i, j] = cost[i - 1, j - 1] + best
        trace[i, j] = np.where(take0, 0, np.where(take1, 1, 2))
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = n, m
    path_i, path_j = [], []
    while i > 0 or j > 0:
        path_i.append(i - 1)
        path_j.append(j - 1)
        t = trace[i, j]
        if t == 0:
            i -= 1
            j -= 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    return np.array(path_i[::-1]), np.array(path_j[::-1])


@torch.no_grad()
def find_alignment(
    network: WhisperNetwork,
    tokenizer: WhisperTokenizer,
    sot_sequence: Sequence[int],
    text_tokens: Sequence[int],
    audio_features: torch.Tensor,
    num_frames: int,
    language: str | None,
    medfilt_width: int = 7,
) -> list[WordTiming]:
    """Time each word of ``text_tokens`` within a window of ``num_frames`` mel frames.

    ``audio_features`` is the encoder output of that window, shape (1, n_audio_ctx, state).
    Times are relative to the window start.
    """
    if len(text_tokens) == 0:
        return []
    text_tokens = [int(t) for t in text_tokens]
    seq = [*sot_sequence, tokenizer.no_timestamps, *text_tokens, tokenizer.eot]
    tokens = torch.tensor([seq], dtype=torch.long, device=audio_features.device)

    # token confidences: teacher-forced probabilities over the text vocabulary
    cache = network.new_cache(audio_features)
    logits = network.decode(tokens, cache)[0].float()
    start = len(sot_sequence)
    probs = logits[start : start + len(text_tokens), : tokenizer.eot].softmax(dim=-1)
    token_probs = probs[torch.arange(len(text_tokens)), torch.tensor(text_tokens)].cpu().numpy()

    # (heads, T, n_audio_ctx): restrict to the frames that hold audio and renormalise, which
    # equals a softmax over those frames only
    weights = network.cross_attention(tokens, audio_features)[0].float().cpu()
    weights = weights[:, :, : num_frames // 2]
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = (weights - mean) / std
    weights = median_filter(weights, medfilt_width)
    matrix = weights.mean(dim=0)[start:-1]  # rows: no_timestamps .. last text token

    text_idx, time_idx = dtw(-matrix.double().numpy())

    words, word_tokens = tokenizer.split_to_word_tokens([*text_tokens, tokenizer.eot], language)
    if len(word_tokens) <= 1:
        return []
    bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] / TOKENS_PER_SECOND
    starts = jump_times[bounds[:-1]]
    ends = jump_times[bounds[1:]]
    out = []
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        out.append(
            WordTiming(
                word=words[k],
                tokens=list(word_tokens[k]),
                start=float(starts[k]),
                end=float(ends[k]),
                probability=float(np.mean(token_probs[a:b])),
            )
        )
    return out


def merge_punctuations(alignment: list[WordTiming], prepended: str, appended: str) -> None:
    """Attach opening punctuation to the following word and closing punctuation to the previous
    one (in place; the emptied entries keep an empty word and no tokens)."""
    i = len(alignment) - 2
    j = len(alignment) - 1
    while i >= 0:
        prev, nxt = alignment[i], alignment[j]
        if prev.word.startswith(" ") and prev.word.strip() in prepended:
            nxt.word = prev.word + nxt.word
            nxt.tokens = prev.tokens + nxt.tokens
            prev.word = ""
            prev.tokens = []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        prev, nxt = alignment[i], alignment[j]
        if not prev.word.endswith(" ") and nxt.word in appended:
            prev.word = prev.word + nxt.word
            prev.tokens = prev.tokens + nxt.tokens
            nxt.word = ""
            nxt.tokens = []
        else:
            i = j
        j += 1


def add_word_timestamps(
    segments: list[Segment],
    network: WhisperNetwork,
    tokenizer: WhisperTokenizer,
    sot_sequence: Sequence[int],
    audio_features: torch.Tensor,
    num_frames: int,
    language: str | None,
    time_offset: float,
    last_speech_timestamp: float,
    prepend_punctuations: str = PREPEND_PUNCTUATIONS,
    append_punctuations: str = APPEND_PUNCTUATIONS,
) -> None:
    """Fill ``segment.words`` for the segments decoded from one window (in place), adjusting
    segment boundaries to the words as openai-whisper does."""
    if not segments:
        return
    per_segment = [[t for t in s.tokens if t < tokenizer.eot] for s in segments]
    text_tokens = [t for toks in per_segment for t in toks]
    alignment = find_alignment(
        network, tokenizer, sot_sequence, text_tokens, audio_features, num_frames, language
    )
    durations = np.array([w.end - w.start for w in alignment])
    durations = durations[durations.nonzero()]
    median = float(np.median(durations)) if len(durations) > 0 else 0.0
    median = min(0.7, median)
    max_duration = median * 2

    # long words at sentence boundaries are usually a pause absorbed into the word
    if len(durations) > 0:
        for k in range(1, len(alignment)):
            if alignment[k].end - alignment[k].start > max_duration:
                if alignment[k].word in SENTENCE_END_MARKS:
                    alignment[k].end = alignment[k].start + max_duration
                elif alignment[k - 1].word in SENTENCE_END_MARKS:
                    alignment[k].start = alignment[k].end - max_duration

    merge_punctuations(alignment, prepend_punctuations, append_punctuations)

    index = 0
    for segment, toks in zip(segments, per_segment, strict=False):
        used = 0
        words: list[Word] = []
        while index < len(alignment) and used < len(toks):
            timing = alignment[index]
            if timing.word:
                words.append(
                    Word(
                        word=timing.word,
                        start=round(time_offset + timing.start, 2),
                        end=round(time_offset + timing.end, 2),
                        confidence=timing.probability,
                    )
                )
            used += len(timing.tokens)
            index += 1
        if words:
            first, last = words[0], words[-1]
            # the first word after a pause must not swallow the pause
            if first.end - last_speech_timestamp > median * 4 and (
                first.end - first.start > max_duration
                or (len(words) > 1 and words[1].end - first.start > max_duration * 2)
            ):
                if len(words) > 1 and words[1].end - words[1].start > max_duration:
                    boundary = max(words[1].end / 2, words[1].end - max_duration)
                    first.end = words[1].start = boundary
                first.start = max(0.0, first.end - max_duration)
            # prefer the segment-level start when the first word is suspiciously long
            if segment.start < first.end and segment.start - 0.5 > first.start:
                first.start = max(0.0, min(first.end - median, segment.start))
            else:
                segment.start = first.start
            # prefer the segment-level end when the last word is suspiciously long
            if segment.end > last.start and segment.end + 0.5 < last.end:
                last.end = max(last.start + median, segment.end)
            else:
                segment.end = last.end
            last_speech_timestamp = segment.end
        segment.words = words


def last_word_end(segments: Sequence[Segment]) -> float | None:
    """End of the last word of ``segments`` or, without words, of the last segment."""
    for s in reversed(segments):
        for w in reversed(s.words):
            return w.end
    return segments[-1].end if segments else None
