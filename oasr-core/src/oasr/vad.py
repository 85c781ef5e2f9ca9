"""Voice activity detection: the detector protocol, speech segmentation and endpointing.

* A **detector** (``get_detector("silero")``, provided by a plugin through
  ``register_vad_detectors``) turns audio into one speech probability per window, offline
  (``speech_probs``) or streaming (``new_state`` / ``step``).
* :class:`StreamingSegmenter` turns probabilities into :class:`SpeechSegment`\\ s with
  hysteresis, minimum speech / silence durations, padding and a maximum segment length. Fed all
  at once (:func:`segments_from_probs`) or window by window it gives the same segments as
  ``silero_vad.get_speech_timestamps`` on the same probabilities, sample for sample; streaming,
  a segment is emitted as soon as its padded boundaries can no longer change.
* :class:`Endpointer` runs a detector and the segmenter on a live stream and emits
  :class:`VADEvent`\\ s: ``speech_start``, ``speech_end`` (the turn ended: trailing silence of
  ``end_silence_ms``) and ``segment`` (a final segment). Any chunking of the same audio gives the
  same events.

This module imports numpy but not torch; detectors import torch when resolved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "Endpointer",
    "SegmentationOptions",
    "SpeechSegment",
    "StreamingSegmenter",
    "VADEvent",
    "VoiceActivityDetector",
    "default_detector",
    "get_detector",
    "get_speech_segments",
    "segments_from_probs",
]


# --------------------------------------------------------------------------------------------
# Detector protocol


@runtime_checkable
class VoiceActivityDetector(Protocol):
    """What a ``vad_detector`` plugin provides (structural: subclass nothing).

    ``sample_rates``: the rates it runs at natively. ``window_size(rate)``: samples per
    probability. ``speech_probs(audio, rate)``: float32 array, one probability per window
    (``ceil(len(audio) / window)``; the last window zero-padded). Streaming:
    ``state = new_state(rate)``; ``step(state, chunk, final=False)`` takes any number of samples
    and returns the probabilities of the windows completed so far (``final=True`` also scores
    the zero-padded remainder); the concatenation equals ``speech_probs`` of the whole signal to
    float rounding.
    """

    sample_rates: tuple[int, ...]

    def window_size(self, sample_rate: int = 16000) -> int: ...

    def speech_probs(self, audio: Any, sample_rate: int = 16000) -> np.ndarray: ...

    def new_state(self, sample_rate: int = 16000) -> Any: ...

    def step(self, state: Any, chunk: Any, *, final: bool = False) -> np.ndarray: ...


_DEFAULT: dict[str, VoiceActivityDetector] = {}


def default_detector() -> VoiceActivityDetector:
    """``get_detector()`` built once per process (what ``detector=None`` arguments use)."""
    det = _DEFAULT.get("silero")
    if det is None:
        det = _DEFAULT.setdefault("silero", get_detector())
    return det


def get_detector(key: str = "silero", **kwargs: Any) -> VoiceActivityDetector:
    """Build the detector registered under ``key`` (``kwargs`` go to its constructor, e.g.
    ``checkpoint=``, ``device=``). Raises :class:`~oasr.errors.MissingPluginError` naming the
    distribution to install when no plugin provides ``key``."""
    from oasr.plugins import resolve

    factory = resolve("vad_detector", key)
    return factory(**kwargs)


# --------------------------------------------------------------------------------------------
# Segments and options


@dataclass(frozen=True)
class SpeechSegment:
    """A speech region ``[start, end)`` in samples at ``sample_rate``."""

    start: int
    end: int
    sample_rate: int

    @property
    def start_s(self) -> float:
        return self.start / self.sample_rate

    @property
    def end_s(self) -> float:
        return self.end / self.sample_rate

    @property
    def duration_s(self) -> float:
        return (self.end - self.start) / self.sample_rate

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "start_s": round(self.start_s, 4),
            "end_s": round(self.end_s, 4),
        }


@dataclass(frozen=True)
class SegmentationOptions:
    """Segmentation settings; defaults equal ``silero_vad.get_speech_timestamps``'s.

    ``threshold``: a window with P(speech) >= it is speech. ``neg_threshold``: once in speech,
    only a window below it counts as silence (hysteresis; default ``max(threshold - 0.15,
    0.01)``). ``min_speech_ms``: shorter segments are dropped. ``min_silence_ms``: silence that
    ends a segment. ``speech_pad_ms``: added on both sides (halved gaps when two segments are
    closer than twice it). ``max_speech_s``: longer segments are split, at the longest silence
    (> ``min_silence_at_max_speech_ms``) inside them when ``split_at_longest_silence`` (else at
    the last such silence), or right there if there is none.
    """

    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_ms: float = 250
    min_silence_ms: float = 100
    speech_pad_ms: float = 30
    max_speech_s: float = math.inf
    min_silence_at_max_speech_ms: float = 98
    split_at_longest_silence: bool = True

    @property
    def exit_threshold(self) -> float:
        if self.neg_threshold is not None:
            return self.neg_threshold
        return max(self.threshold - 0.15, 0.01)

    def __post_init__(self) -> None:
        from oasr.errors import InvalidRequestError

        if not 0.0 <= self.threshold <= 1.0:
            raise InvalidRequestError("threshold must be in [0, 1]", param="threshold")
        for name in ("min_speech_ms", "min_silence_ms", "speech_pad_ms",
                     "min_silence_at_max_speech_ms"):
            if getattr(self, name) < 0:
                raise InvalidRequestError(f"{name} must be >= 0", param=name)
        if not self.max_speech_s > 0:
            raise InvalidRequestError("max_speech_s must be > 0", param="max_speech_s")


# --------------------------------------------------------------------------------------------
# Segmenter


@dataclass
class _Held:
    start: int
    end: int


class StreamingSegmenter:
    """Probabilities in, final :class:`SpeechSegment`\\ s out, window by window.

    ``push(probs)`` consumes probabilities of consecutive full windows and returns the segments
    that became final; ``finish(audio_length)`` ends the stream (``audio_length`` in samples:
    the true length, the last window may be partial) and returns the rest. The union equals
    :func:`segments_from_probs` on all probabilities, whatever the grouping of ``push`` calls.

    A segment is final once the next kept segment is known, or once no later segment can start
    closer than ``2 * speech_pad`` to its end (then its end is simply ``end + pad``).
    """

    def __init__(
        self, sample_rate: int, window: int, options: SegmentationOptions | None = None
    ) -> None:
        o = options or SegmentationOptions()
        self.options = o
        self.sample_rate = sample_rate
        self.window = window
        sr = sample_rate
        self.threshold = o.threshold
        self.neg_threshold = o.exit_threshold
        self.min_speech = sr * o.min_speech_ms / 1000
        self.pad = sr * o.speech_pad_ms / 1000
        self.max_speech = sr * o.max_speech_s - window - 2 * self.pad
        self.min_silence = sr * o.min_silence_ms / 1000
        self.min_silence_at_max = sr * o.min_silence_at_max_speech_ms / 1000
        self.longest = o.split_at_longest_silence
        # detection state
        self.windows = 0
        self.triggered = False
        self.start: int | None = None  # start of the segment being detected
        self.temp_end = 0
        self.prev_end = 0
        self.next_start = 0
        self.possible_ends: list[tuple[int, int]] = []
        # padding state
        self._held: _Held | None = None  # kept segment whose end may still change
        self._kept = 0  # segments kept so far
        self._held_released = False  # the previous kept segment was released by the bound rule
        self._finished = False
        #: samples where a new trigger (speech onset) happened during the last push
        self.onsets: list[int] = []

    # -- detection (one window) -------------------------------------------------------------
    def _reset_after_cut(self) -> None:
        self.prev_end = self.next_start = self.temp_end = 0
        self.possible_ends = []

    def _advance(self, p: float, out: list[SpeechSegment]) -> None:
        cur = self.window * self.windows
        self.windows += 1
        speech = p >= self.threshold
        if speech and self.temp_end:
            silence = cur - self.temp_end
            if silence > self.min_silence_at_max:
                self.possible_ends.append((self.temp_end, silence))
            self.temp_end = 0
            if self.next_start < self.prev_end:
                self.next_start = cur
        if speech and not self.triggered:
            self.triggered = True
            self.start = cur
            self.onsets.append(cur)
            return
        if self.triggered and cur - self.start > self.max_speech:  # type: ignore[operator]
            start = self.start
            if self.longest and self.possible_ends:
                cut, dur = max(self.possible_ends, key=lambda e: e[1])  # first longest
                self._keep(start, cut, out)  # type: ignore[arg-type]
                self.start = None
                resume = cut + dur
                if resume < cut + cur:
                    self.start = resume
                else:
                    self.triggered = False
                self._reset_after_cut()
            elif self.prev_end:
                self._keep(start, self.prev_end, out)  # type: ignore[arg-type]
                self.start = None
                if self.next_start < self.prev_end:
                    self.triggered = False
                else:
                    self.start = self.next_start
                self._reset_after_cut()
            else:
                self._keep(start, cur, out)  # type: ignore[arg-type]
                self.start = None
                self.triggered = False
                self._reset_after_cut()
                return
        if p < self.neg_threshold and self.triggered:
            if not self.temp_end:
                self.temp_end = cur
            silence = cur - self.temp_end
            if not self.longest and silence > self.min_silence_at_max:
                self.prev_end = self.temp_end
            if silence < self.min_silence:
                return
            if self.temp_end - self.start > self.min_speech:  # type: ignore[operator]
                self._keep(self.start, self.temp_end, out)  # type: ignore[arg-type]
            self.start = None
            self.triggered = False
            self._reset_after_cut()

    # -- padding ----------------------------------------------------------------------------
    def _seg(self, start: int, end: int) -> SpeechSegment:
        return SpeechSegment(int(start), int(end), self.sample_rate)

    def _keep(self, start: int, end: int, out: list[SpeechSegment]) -> None:
        """A segment is kept: fix its start and the end of the one held before it."""
        pad = self.pad
        held = self._held
        if self._kept == 0 or self._held_released:
            start = int(max(0, start - pad))
        elif held is not None:
            gap = start - held.end
            if gap < 2 * pad:
                held.end += int(gap // 2)
                start = int(max(0, start - gap // 2))
            else:
                # the new start lies inside the audio, so the audio is longer than end + pad
                held.end = int(held.end + pad)
                start = int(max(0, start - pad))
            out.append(self._seg(held.start, held.end))
        self._kept += 1
        self._held_released = False
        self._held = _Held(start, end)

    def _release(self, out: list[SpeechSegment]) -> None:
        """Emit the held segment if no later segment can start within 2 * pad of its end."""
        held = self._held
        if held is None:
            return
        earliest_next = self.start if self.triggered else self.window * self.windows
        known_length = self.window * (self.windows - 1) + 1  # the last window has >= 1 sample
        if earliest_next - held.end >= 2 * self.pad and known_length >= held.end + self.pad:
            out.append(self._seg(held.start, int(held.end + self.pad)))
            self._held = None
            self._held_released = True

    # -- public -----------------------------------------------------------------------------
    def push(self, probs: Iterable[float]) -> list[SpeechSegment]:
        if self._finished:
            raise ValueError("segmenter already finished")
        out: list[SpeechSegment] = []
        self.onsets = []
        for p in probs:
            self._advance(float(p), out)
            self._release(out)
        return out

    def finish(self, audio_length: int | None = None) -> list[SpeechSegment]:
        """End of stream. ``audio_length`` defaults to ``windows * window``."""
        if self._finished:
            raise ValueError("segmenter already finished")
        self._finished = True
        length = self.window * self.windows if audio_length is None else int(audio_length)
        out: list[SpeechSegment] = []
        if self.start is not None and (length - self.start) > self.min_speech:
            self._keep(self.start, length, out)
        self.start = None
        self.triggered = False
        if self._held is not None:
            held = self._held
            out.append(self._seg(held.start, int(min(length, held.end + self.pad))))
            self._held = None
        return out


def segments_from_probs(
    probs: Sequence[float] | np.ndarray,
    sample_rate: int,
    window: int,
    options: SegmentationOptions | None = None,
    audio_length: int | None = None,
) -> list[SpeechSegment]:
    """Offline segmentation of per-window probabilities (same result as
    ``silero_vad.get_speech_timestamps_from_probs`` with the same settings)."""
    seg = StreamingSegmenter(sample_rate, window, options)
    return seg.push(probs) + seg.finish(audio_length)


def _native_rate(detector: VoiceActivityDetector, sample_rate: int) -> tuple[int, int | None]:
    """(rate the detector runs at, decimation step or None for resampling)."""
    rates = tuple(detector.sample_rates)
    if sample_rate in rates:
        return sample_rate, 1
    if sample_rate % 16000 == 0 and 16000 in rates:
        return 16000, sample_rate // 16000  # what silero-vad does: keep every k-th sample
    return (16000 if 16000 in rates else max(rates)), None


def get_speech_segments(
    audio: Any,
    sample_rate: int = 16000,
    detector: VoiceActivityDetector | None = None,
    options: SegmentationOptions | None = None,
) -> list[SpeechSegment]:
    """Speech segments of a mono signal, in samples at ``sample_rate``.

    Rates the detector does not run at are brought to one it does: multiples of 16 kHz by
    decimation (as ``silero-vad`` does, boundaries multiplied back), others by resampling.
    """
    det = detector if detector is not None else default_detector()
    x = np.asarray(audio, dtype=np.float32).reshape(-1)
    rate, step = _native_rate(det, sample_rate)
    if step is None:
        from oasr.audio import resample

        y = resample(x, sample_rate, rate)
    else:
        y = x[::step]
    probs = det.speech_probs(y, rate)
    segs = segments_from_probs(probs, rate, det.window_size(rate), options, len(y))
    if rate == sample_rate:
        return segs
    if step is not None:
        return [SpeechSegment(s.start * step, s.end * step, sample_rate) for s in segs]
    scale = sample_rate / rate
    return [
        SpeechSegment(round(s.start * scale), min(len(x), round(s.end * scale)), sample_rate)
        for s in segs
    ]


# --------------------------------------------------------------------------------------------
# Endpointer


EventKind = Literal["speech_start", "speech_end", "segment"]


@dataclass(frozen=True)
class VADEvent:
    """``speech_start``: speech began at ``sample``. ``speech_end``: the turn ended; speech
    stopped at ``sample`` and ``end_silence_ms`` of silence followed (or the stream ended).
    ``segment``: a final :class:`SpeechSegment` (``sample`` is its start). ``emitted_at``: how
    many samples had been received when the event was decided (its latency is
    ``emitted_at - sample``)."""

    kind: EventKind
    sample: int
    sample_rate: int
    emitted_at: int
    segment: SpeechSegment | None = None

    @property
    def time_s(self) -> float:
        return self.sample / self.sample_rate

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "segment"}
        d["time_s"] = round(self.time_s, 4)
        if self.segment is not None:
            d["segment"] = self.segment.to_dict()
        return d


@dataclass
class _Turn:
    active: bool = False
    silence_since: int | None = None


class Endpointer:
    """Live VAD for one stream: ``feed(chunk) -> events``, then ``finish() -> events``.

    Turn logic (``speech_start`` / ``speech_end``) uses the same hysteresis as segmentation:
    a window >= ``threshold`` starts (or continues) a turn; once silence (windows below the exit
    threshold, interrupted by no window >= ``threshold``) has lasted ``end_silence_ms``, the turn
    ends at the start of that silence. ``segment`` events come from a
    :class:`StreamingSegmenter` and equal the offline segmentation.

    The detector is stepped one window at a time, so every window is computed identically
    whatever the chunk sizes: any chunking of the same audio gives the same events.
    """

    def __init__(
        self,
        detector: VoiceActivityDetector | None = None,
        sample_rate: int = 16000,
        options: SegmentationOptions | None = None,
        end_silence_ms: float = 500,
    ) -> None:
        self.detector = detector if detector is not None else default_detector()
        if sample_rate not in tuple(self.detector.sample_rates):
            from oasr.errors import InvalidRequestError

            raise InvalidRequestError(
                f"the detector streams at {self.detector.sample_rates} Hz, not {sample_rate}; "
                "resample the stream (oasr.audio.Resampler)",
                param="sample_rate",
            )
        self.sample_rate = sample_rate
        self.options = options or SegmentationOptions()
        self.window = self.detector.window_size(sample_rate)
        self.end_silence = sample_rate * end_silence_ms / 1000
        self.state = self.detector.new_state(sample_rate)
        self.segmenter = StreamingSegmenter(sample_rate, self.window, self.options)
        self._buf = np.zeros(0, np.float32)
        self._received = 0
        self._windows = 0
        self._turn = _Turn()
        self._done = False
        #: every probability so far (one per window)
        self.probs: list[float] = []

    @property
    def in_speech(self) -> bool:
        return self._turn.active

    @property
    def earliest_end(self) -> int:
        """The earliest sample a later ``speech_end`` of the current turn can report: the start
        of the silence now running, else the first sample not scored yet. Audio before it
        belongs to the current turn whatever the detector says next (a live recogniser may be
        fed up to here without overshooting the turn)."""
        turn = self._turn
        if turn.active and turn.silence_since is not None:
            return turn.silence_since
        return self.window * self._windows

    def _window(self, p: float, decided_at: int, events: list[VADEvent]) -> None:
        cur = self.window * self._windows
        self._windows += 1
        self.probs.append(p)
        sr = self.sample_rate
        turn = self._turn
        if p >= self.options.threshold:
            turn.silence_since = None
            if not turn.active:
                turn.active = True
                events.append(VADEvent("speech_start", cur, sr, decided_at))
        elif turn.active and p < self.options.exit_threshold:
            if turn.silence_since is None:
                turn.silence_since = cur
            if cur + self.window - turn.silence_since >= self.end_silence:
                events.append(VADEvent("speech_end", turn.silence_since, sr, decided_at))
                turn.active = False
                turn.silence_since = None
        for seg in self.segmenter.push([p]):
            events.append(VADEvent("segment", seg.start, sr, decided_at, seg))

    def feed(self, chunk: Any) -> list[VADEvent]:
        """Add samples (float32 mono at ``sample_rate``, any length); returns new events."""
        if self._done:
            raise ValueError("endpointer already finished")
        x = np.asarray(chunk, dtype=np.float32).reshape(-1)
        events: list[VADEvent] = []
        buf = np.concatenate([self._buf, x]) if len(self._buf) else x
        self._received += len(x)
        w = self.window
        pos = 0
        while len(buf) - pos >= w:
            win = buf[pos : pos + w]
            decided_at = self._windows * w + w  # samples received when this window completed
            (p,) = self.detector.step(self.state, win)
            self._window(float(p), decided_at, events)
            pos += w
        self._buf = np.array(buf[pos:], np.float32)
        return events

    def finish(self) -> list[VADEvent]:
        """End of stream: scores the partial last window, closes the turn and the segments."""
        if self._done:
            raise ValueError("endpointer already finished")
        self._done = True
        events: list[VADEvent] = []
        end = self._received
        probs = self.detector.step(self.state, self._buf, final=True)
        self._buf = np.zeros(0, np.float32)
        for p in probs:
            self._window(float(p), end, events)
        if self._turn.active:
            since = self._turn.silence_since
            events.append(
                VADEvent("speech_end", end if since is None else min(since, end),
                         self.sample_rate, end)
            )
            self._turn = _Turn()
        for seg in self.segmenter.finish(end):
            events.append(VADEvent("segment", seg.start, self.sample_rate, end, seg))
        return events

    def run(self, chunks: Iterable[Any]) -> list[VADEvent]:
        """Feed every chunk, then finish; all events in order."""
        events: list[VADEvent] = []
        for chunk in chunks:
            events.extend(self.feed(chunk))
        events.extend(self.finish())
        return events

