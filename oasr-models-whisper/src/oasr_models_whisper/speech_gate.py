"""Voice-activity gate of sequential long-form Whisper (the ``vad_gate`` Whisper option).

Whisper writes text on inputs that hold no speech at all, and openai-whisper's no-speech rules
(no-speech probability + average logprob) do not catch every case: tiny.en writes "A" on a pure
440 Hz tone. Before sequential decoding, the default voice activity detector (Silero, through
the ``vad_detector`` registry) scans each input with the segmentation of ``long_form="vad"``
(:data:`~oasr_models_whisper.vad_longform.DEFAULT_SEGMENTATION`); an input in which it finds no
speech segment gets :func:`empty_transcript` and is never decoded. An input with any speech is
decoded whole, exactly as without the gate (no window is cut or skipped by the VAD), so
timestamps and text of speech are unchanged.

The gate is on when ``options.vad_gate`` is set, ``options.no_speech_threshold`` is not None (the
gate is a no-speech rule: ``no_speech_threshold=None`` turns all of them off, like the
digital-silence skip) and ``options.long_form == "sequential"`` (the VAD mode runs the VAD
itself). Without an installed detector it is skipped with one logged warning per process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from oasr.errors import CheckpointError, MissingPluginError, PluginLoadError
from oasr.features.whisper import N_SAMPLES, SAMPLE_RATE
from oasr.options import ResolvedOptions
from oasr.types import DecodingOptions, Transcript
from oasr.vad import SegmentationOptions, StreamingSegmenter, VoiceActivityDetector
from oasr_models_whisper.options import whisper_options

__all__ = [
    "GateScan",
    "empty_transcript",
    "gate_detector",
    "gate_enabled",
    "has_speech",
    "speech_gate",
]

log = logging.getLogger(__name__)
_warned_no_detector = False


def gate_enabled(options: DecodingOptions | ResolvedOptions) -> bool:
    """Whether ``options`` ask for the gate (see the module docstring)."""
    options = whisper_options(options)
    return (
        options.vad_gate
        and options.no_speech_threshold is not None
        and options.long_form == "sequential"
    )


def gate_detector(device: torch.device | str = "cpu") -> VoiceActivityDetector | None:
    """The default detector on ``device``, or None (logged once per process) when none is
    installed: no ``vad_detector`` plugin, a plugin that failed to load, or missing weights."""
    global _warned_no_detector
    from oasr_models_whisper.vad_longform import detector_for

    try:
        return detector_for(device)
    except (MissingPluginError, PluginLoadError, CheckpointError) as exc:
        if not _warned_no_detector:
            _warned_no_detector = True
            log.warning(
                "vad_gate: no voice activity detector is available (%s); every input is "
                "decoded without the gate, so non-speech may get invented text. "
                "Pass vad_gate=False to skip the gate.",
                exc,
            )
        return None


def has_speech(
    audio: np.ndarray | torch.Tensor,
    detector: VoiceActivityDetector,
    options: SegmentationOptions | None = None,
    piece: int = N_SAMPLES,
) -> bool:
    """Whether ``detector`` finds a speech segment in a 16 kHz input.

    The input is scored ``piece`` samples at a time through the detector's streaming state and
    the scan stops at the first final segment, so speech is usually found in the first seconds
    of a long recording; only inputs without speech are scanned to the end. The decision equals
    ``bool(get_speech_segments(audio, 16000, detector, options))`` (streaming and offline
    probabilities agree to float rounding)."""
    from oasr.vad import get_speech_segments
    from oasr_models_whisper.vad_longform import DEFAULT_SEGMENTATION

    opts = options or DEFAULT_SEGMENTATION
    x = np.asarray(audio, dtype=np.float32).reshape(-1)
    if len(x) == 0:
        return False
    if SAMPLE_RATE not in tuple(detector.sample_rates):  # it needs resampling: offline path
        return bool(get_speech_segments(x, SAMPLE_RATE, detector, opts))
    state = detector.new_state(SAMPLE_RATE)
    segmenter = StreamingSegmenter(SAMPLE_RATE, detector.window_size(SAMPLE_RATE), opts)
    for start in range(0, len(x), piece):
        last = start + piece >= len(x)
        if segmenter.push(detector.step(state, x[start : start + piece], final=last)):
            return True
    return bool(segmenter.finish(len(x)))


def speech_gate(
    audios: Sequence[np.ndarray],
    options: DecodingOptions | ResolvedOptions,
    device: torch.device | str = "cpu",
    detector: VoiceActivityDetector | None = None,
) -> list[bool]:
    """Per input, whether to decode it: False only when the gate is on and the detector finds
    no speech in it (give it :func:`empty_transcript`). All True when the gate is off or no
    detector is available. ``detector`` defaults to the default detector on ``device``."""
    if not gate_enabled(options) or not audios:
        return [True] * len(audios)
    det = detector if detector is not None else gate_detector(device)
    if det is None:
        return [True] * len(audios)
    on_cpu = str(getattr(det, "device", "cpu")).startswith("cpu")
    if len(audios) > 1 and hasattr(det, "speech_probs_batch") and not on_cpu:
        # on an accelerator one batched scan of all inputs beats early exits one by one (the
        # per-window LSTM steps are launch-bound; see docs/vad.md)
        from oasr_models_whisper.vad_longform import speech_segments_batch

        return [bool(s) for s in speech_segments_batch(list(audios), det)]
    return [has_speech(a, det) for a in audios]


class GateScan:
    """The gate over many inputs, a bounded slice of audio at a time (the continuous executor's:
    one scheduler step must not scan hours of audio while other requests wait for it).

    ``add(key, audio)`` queues an input; each :meth:`advance` scans at most ``budget`` samples
    summed over the queued inputs and returns the inputs decided by it, ``{key: has_speech}``.
    The budget is shared max-min fairly: inputs are served shortest remaining scan first, each
    taking at most an equal share of what is left, so a short clip is decided in the first
    advance after it arrives however long the others are, and every input moves at least one
    detector window per advance. All slices of one advance go through the detector together
    (``step_batch``: one forward where the detector offers it). Each decision equals
    :func:`has_speech` on the whole input (the same streaming scan, cut at other places)."""

    def __init__(self, detector: VoiceActivityDetector, budget: int,
                 options: SegmentationOptions | None = None) -> None:  # fmt: skip
        from oasr_models_whisper.vad_longform import DEFAULT_SEGMENTATION

        self.detector = detector
        self.options = options or DEFAULT_SEGMENTATION
        self.window = int(detector.window_size(SAMPLE_RATE))
        #: samples scanned per advance, summed over the inputs (at least one window each)
        self.budget = max(self.window, int(budget))
        self._native = SAMPLE_RATE in tuple(detector.sample_rates)
        on_cpu = str(getattr(detector, "device", "cpu")).startswith("cpu")
        self._whole_batch = not on_cpu and hasattr(detector, "speech_probs_batch")
        self._scans: dict[object, list] = {}  # key -> [audio, position, state, segmenter]

    def __len__(self) -> int:
        return len(self._scans)

    def __contains__(self, key: object) -> bool:
        return key in self._scans

    def add(self, key: object, audio: np.ndarray | torch.Tensor) -> None:
        x = np.asarray(audio, dtype=np.float32).reshape(-1)
        state = self.detector.new_state(SAMPLE_RATE) if self._native else None
        segmenter = StreamingSegmenter(SAMPLE_RATE, self.window, self.options)
        self._scans[key] = [x, 0, state, segmenter]

    def remove(self, key: object) -> None:
        self._scans.pop(key, None)

    def advance(self) -> dict[object, bool]:
        decided: dict[object, bool] = {}
        for key, (x, *_rest) in list(self._scans.items()):
            if len(x) == 0:
                decided[key] = False
            elif not self._native:  # resampling needed: the offline path, whole
                from oasr.vad import get_speech_segments

                decided[key] = bool(get_speech_segments(x, SAMPLE_RATE, self.detector, self.options))
        for key in decided:
            del self._scans[key]
        if not self._scans:
            return decided
        # max-min fair shares of the budget, shortest remaining scan first, whole windows
        order = sorted(self._scans, key=lambda k: len(self._scans[k][0]) - self._scans[k][1])
        left, keys, chunks, finals = self.budget, [], [], []
        for i, key in enumerate(order):
            x, pos, _, _ = self._scans[key]
            share = max(self.window, left // (len(order) - i) // self.window * self.window)
            end = min(len(x), pos + share)
            left = max(0, left - (end - pos))
            keys.append(key)
            chunks.append(x[pos:end])
            finals.append(end >= len(x))
            self._scans[key][1] = end
        probs: list = [None] * len(keys)
        sliced = list(range(len(keys)))
        if self._whole_batch:
            # inputs scanned whole in this advance: one stateless batched forward (cuDNN's LSTM
            # over the whole sequence; a stateful step with rows of different lengths runs the
            # launch-bound masked loop)
            whole = [i for i in sliced if finals[i] and len(chunks[i]) == len(self._scans[keys[i]][0])]
            if len(whole) > 1:
                batch = self.detector.speech_probs_batch([chunks[i] for i in whole], SAMPLE_RATE)
                for i, p in zip(whole, batch, strict=True):
                    probs[i] = p
                sliced = [i for i in sliced if probs[i] is None]
        states = [self._scans[keys[i]][2] for i in sliced]
        parts = [chunks[i] for i in sliced]
        ends = [finals[i] for i in sliced]
        if hasattr(self.detector, "step_batch"):
            stepped = self.detector.step_batch(states, parts, final=ends) if sliced else []
        else:
            stepped = [self.detector.step(st, c, final=f) for st, c, f in zip(states, parts, ends, strict=True)]
        for i, p in zip(sliced, stepped, strict=True):
            probs[i] = p
        for key, p, final in zip(keys, probs, finals, strict=True):
            x, _, _, segmenter = self._scans[key]
            if segmenter.push(p):
                decided[key] = True
            elif final:
                decided[key] = bool(segmenter.finish(len(x)))
        for key in decided:
            self._scans.pop(key, None)
        return decided


def empty_transcript(
    n_samples: int, options: DecodingOptions | ResolvedOptions, language: str | None
) -> Transcript:
    """The transcript of an input without speech: no text, no segments, its duration, and the
    given language ("en" on English-only models; None when a multilingual model would have had
    to detect it, as ``long_form="vad"`` does)."""
    return Transcript(text="", language=language, duration=n_samples / SAMPLE_RATE, segments=[],
                      task=options.task)  # fmt: skip
