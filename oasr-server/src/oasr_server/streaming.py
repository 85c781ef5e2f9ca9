"""Live audio streams cut into turns: the part shared by the realtime WebSocket
(:mod:`oasr_server.realtime`) and gRPC ``StreamingRecognize``.

A :class:`TurnStream` takes raw audio bytes (PCM or G.711 at any rate), converts them to the
model's rate, keeps the *input buffer*, optionally runs server VAD (an
:class:`oasr.vad.Endpointer` over the Silero detector) and commits turns:

* with VAD, a turn starts at ``speech_start`` (minus ``prefix_padding_ms``) and is committed at
  ``speech_end`` (after ``silence_duration_ms`` of silence), with ``END_PAD_MS`` of the trailing
  silence kept;
* without VAD, the caller commits (``commit()``); the whole buffer is the turn.

Every transcription goes through the server's :class:`~oasr_server.worker.EngineWorker` queue,
so streams share the engine (and its batches) with HTTP requests.

**Interim results.** While a turn grows, it is re-transcribed after every
``partial_interval_ms`` of new audio (one interim job per stream at a time; greedy decoding
without temperature fallback; best effort: a full queue or a failure just skips it). Each
hypothesis is compared with the previous one and the words both agree on (a common word prefix:
"local agreement") are the *stable* text; the part of it not sent before is the *delta*. Deltas
therefore only ever append. When the turn's final transcript arrives and starts with the text
already sent, the rest is sent as a last delta, so the deltas of a turn concatenate to its final
transcript; when the final transcript revised the stable words (rare), no last delta is sent and
the final transcript is what counts.

Heavy work never runs on the event loop: decoding, resampling and VAD run in a thread
(``state.run_vad``), the model in the engine worker. Calls into one ``TurnStream`` must be
sequential (each transport drives it from one task).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from oasr.errors import InvalidRequestError, OASRError

if TYPE_CHECKING:
    from oasr.types import DecodingOptions, Transcript
    from oasr_server.app import ServerState

log = logging.getLogger("oasr_server.streaming")

#: trailing silence kept after the end of speech in a VAD turn
END_PAD_MS = 200
#: shortest turn a manual commit accepts (OpenAI's limit)
MIN_COMMIT_MS = 100
#: shortest turn audio worth an interim transcription
MIN_PARTIAL_MS = 300


class CommitEmptyError(InvalidRequestError):
    """``commit`` with (almost) no audio in the buffer."""

    code = "input_audio_buffer_commit_empty"


@dataclass(frozen=True)
class VADSettings:
    """OpenAI's ``server_vad`` turn detection settings."""

    threshold: float = 0.5
    prefix_padding_ms: float = 300
    silence_duration_ms: float = 500


@dataclass(frozen=True)
class InputFormat:
    """Headerless input audio: ``encoding`` as :class:`oasr.audio.RawPCMFormat` names it."""

    encoding: str = "pcm_s16le"
    sample_rate: int = 24000
    channels: int = 1


@dataclass
class StreamEvent:
    """What a stream reports. ``kind``: ``speech_started``, ``speech_stopped``, ``committed``,
    ``partial`` (``text``: the hypothesis, ``stable``: agreed text so far, ``delta``: newly
    stable text), ``completed`` (``transcript``; ``delta``: the last piece of text not sent as a
    delta yet), ``failed`` (``error``). Times in seconds since the stream started."""

    kind: str
    item_id: str
    previous_item_id: str | None = None
    start_s: float | None = None
    end_s: float | None = None
    text: str = ""
    stable: str = ""
    delta: str = ""
    transcript: Transcript | None = None
    error: OASRError | None = None


@dataclass(eq=False)
class _Item:
    id: str
    start: int  # absolute sample (model rate) where the turn's audio starts
    committed: bool = False
    emitted: str = ""  # stable text sent as deltas
    prev_tokens: list[str] = field(default_factory=list)
    partial_len: int = 0  # turn length (samples) at the last interim job
    partial_task: asyncio.Task[None] | None = None


def _tokens(text: str) -> list[str]:
    return re.findall(r"\s*\S+", text)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class TurnStream:
    def __init__(
        self,
        state: ServerState,
        *,
        api: str,
        fmt: InputFormat,
        options: DecodingOptions,
        emit: Callable[[StreamEvent], None],
        partial_interval_ms: int | None = None,
        route: str = "",
    ) -> None:
        engine, _ = state.require_ready()
        self.state = state
        self.api = api
        self.route = route or api
        self.rate = engine.sample_rate
        self.emit = emit
        self.options = options
        interval = (
            state.config.partial_interval_ms if partial_interval_ms is None else partial_interval_ms
        )
        self.partial_interval = int(self.rate * interval / 1000)
        self.fmt = fmt
        self._raw_format: Any = None
        self._resampler: Any = None
        self._leftover = b""
        self._set_format(fmt)
        # input buffer: audio [buf_start, received) at the model rate
        self._chunks: list[np.ndarray] = []
        self.buf_start = 0
        self.received = 0
        # VAD
        self.vad: VADSettings | None = None
        self._endpointer: Any = None
        self._vad_rate = 16000
        self._vad_resampler: Any = None
        self._vad_offset = 0  # absolute sample (model rate) of the endpointer's sample 0
        # turns
        self.item: _Item | None = None
        self.last_item_id: str | None = None
        self._finals: asyncio.Queue[tuple[_Item, asyncio.Task[Any]] | None] = asyncio.Queue()
        self._current: asyncio.Task[Any] | None = None
        self._finalizer = asyncio.get_running_loop().create_task(self._finalize())
        self._closed = False

    # -- configuration -----------------------------------------------------------------------
    def _set_format(self, fmt: InputFormat) -> None:
        from oasr.audio import RawPCMFormat, Resampler

        raw = RawPCMFormat(
            sample_rate=fmt.sample_rate, encoding=fmt.encoding, channels=fmt.channels
        )  # type: ignore[arg-type]
        self._raw_format = raw
        self._resampler = Resampler(fmt.sample_rate, self.rate)
        self._leftover = b""
        self.fmt = fmt

    async def set_format(self, fmt: InputFormat) -> None:
        if fmt == self.fmt:
            return
        tail = await self.state.run_vad(self._resampler.flush)
        self._set_format(fmt)
        if len(tail):
            await self._take(tail, await self.state.run_vad(self._vad_feed, tail))

    def set_options(self, options: DecodingOptions) -> None:
        self.options = options

    async def set_vad(self, vad: VADSettings | None) -> None:
        """Turn server VAD on (or change its settings: a fresh endpointer from here) or off.
        Loads the detector (in a thread) the first time."""
        if vad == self.vad:
            return
        if vad is None:
            self.vad = None
            self._endpointer = None
            return
        from oasr.audio import Resampler
        from oasr.vad import Endpointer, SegmentationOptions

        det = await self.state.vad_detector()
        rates = tuple(det.sample_rates)
        self._vad_rate = (
            self.rate if self.rate in rates else (16000 if 16000 in rates else rates[0])
        )
        self._vad_resampler = (
            None if self._vad_rate == self.rate else Resampler(self.rate, self._vad_rate)
        )
        self._endpointer = Endpointer(
            det,
            self._vad_rate,
            SegmentationOptions(threshold=vad.threshold),
            end_silence_ms=vad.silence_duration_ms,
        )
        self._vad_offset = self.received
        self.vad = vad
        if self.item is not None and not self.item.committed:
            # a manual-mode buffer becomes the prefix of whatever the VAD finds
            self.item = None

    # -- buffer ------------------------------------------------------------------------------
    def _slice(self, start: int, end: int) -> np.ndarray:
        audio = np.concatenate(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks = [audio] if len(audio) else []
        a = max(0, start - self.buf_start)
        b = max(a, end - self.buf_start)
        return audio[a:b].copy()

    def _drop_before(self, pos: int) -> None:
        if pos <= self.buf_start:
            return
        audio = self._slice(pos, self.received)
        self._chunks = [audio] if len(audio) else []
        self.buf_start = min(pos, self.received)

    @property
    def buffered_s(self) -> float:
        return (self.received - self.buf_start) / self.rate

    # -- input -------------------------------------------------------------------------------
    def _ingest(self, data: bytes) -> tuple[np.ndarray, list[Any]]:
        """Thread: bytes -> model-rate float32 (+ VAD events)."""
        from oasr.audio import decode_raw_pcm

        data = self._leftover + data
        frame = self._raw_format.bytes_per_frame
        cut = len(data) - len(data) % frame
        self._leftover = data[cut:]
        x = decode_raw_pcm(data[:cut], self._raw_format)
        x = x.mean(axis=0) if x.shape[0] > 1 else x[0]
        y = self._resampler.process(x)
        return y, self._vad_feed(y)

    def _vad_feed(self, y: np.ndarray) -> list[Any]:
        ep = self._endpointer
        if ep is None or not len(y):
            return []
        v = self._vad_resampler.process(y) if self._vad_resampler is not None else y
        return ep.feed(v)

    def _abs(self, vad_sample: int) -> int:
        return self._vad_offset + round(vad_sample * self.rate / self._vad_rate)

    async def append(self, data: bytes) -> None:
        """Raw audio bytes in the input format (any length; a partial frame waits for the
        next call)."""
        if not data:
            return
        y, events = await self.state.run_vad(self._ingest, data)
        await self._take(y, events)

    async def _take(self, y: np.ndarray, events: list[Any]) -> None:
        if len(y):
            self._chunks.append(y.astype(np.float32, copy=False))
            self.received += len(y)
            self.state.metrics.audio_seconds.labels(self.route).inc(len(y) / self.rate)
        for ev in events:
            self._on_vad(ev)
        max_len = int(self.state.config.max_audio_seconds * self.rate)
        if self.vad is not None:
            item = self.item
            if item is None:
                # keep what a turn starting in the next chunk may need as prefix padding
                keep = int(self.rate * (self.vad.prefix_padding_ms + 2 * 32 + 100) / 1000)
                self._drop_before(self.received - keep)
            elif self.received - item.start >= max_len:
                # a turn may not outgrow --max-audio-seconds: commit, keep listening
                self._commit(item, item.start, self.received)
                self.item = _Item(new_id("item"), self.received)
        elif self.received - self.buf_start > max_len:
            from oasr.errors import AudioTooLongError

            self._drop_before(self.received - max_len)
            raise AudioTooLongError(
                f"the input audio buffer holds more than {self.state.config.max_audio_seconds:g} s "
                "(--max-audio-seconds); commit more often. The oldest audio was dropped."
            )
        if self.vad is None and self.item is None and self.received > self.buf_start:
            self.item = _Item(new_id("item"), self.buf_start)
        self._maybe_partial()

    def _on_vad(self, ev: Any) -> None:
        if ev.kind == "speech_start":
            if self.item is not None:
                return
            at = self._abs(ev.sample)
            pad = int(self.rate * self.vad.prefix_padding_ms / 1000)  # type: ignore[union-attr]
            self.item = _Item(new_id("item"), max(self.buf_start, at - pad))
            self.emit(StreamEvent("speech_started", self.item.id, start_s=at / self.rate))
        elif ev.kind == "speech_end":
            item = self.item
            if item is None:
                return
            at = self._abs(ev.sample)
            self.emit(StreamEvent("speech_stopped", item.id, end_s=at / self.rate))
            end = min(self.received, at + int(self.rate * END_PAD_MS / 1000))
            self._commit(item, item.start, max(end, item.start))
            self.item = None

    # -- turns -------------------------------------------------------------------------------
    def commit(self) -> str:
        """Commit the input buffer as one turn (manual mode; in VAD mode it cuts the current
        turn here). Returns the item id; raises :class:`CommitEmptyError` under 100 ms."""
        item = self.item or _Item(new_id("item"), self.buf_start)
        start = max(item.start, self.buf_start)
        have_ms = (self.received - start) / self.rate * 1000
        if have_ms < MIN_COMMIT_MS:
            raise CommitEmptyError(
                f"Error committing input audio buffer: buffer too small. Expected at least "
                f"{MIN_COMMIT_MS}ms of audio, but buffer only has {have_ms:.2f}ms of audio."
            )
        self._commit(item, start, self.received)
        in_turn = (
            self.vad is not None and self._endpointer is not None and self._endpointer.in_speech
        )
        self.item = _Item(new_id("item"), self.received) if in_turn else None
        return item.id

    def clear(self) -> None:
        """Drop the buffered audio (and the open turn's interim state)."""
        item = self.item
        if item is not None and item.partial_task is not None:
            item.partial_task.cancel()
        self._drop_before(self.received)
        in_turn = (
            self.vad is not None and self._endpointer is not None and self._endpointer.in_speech
        )
        self.item = _Item(item.id, self.received) if (in_turn and item is not None) else None

    def _commit(self, item: _Item, start: int, end: int) -> None:
        audio = self._slice(start, end)
        item.committed = True
        if item.partial_task is not None:
            item.partial_task.cancel()
        self.emit(
            StreamEvent(
                "committed",
                item.id,
                previous_item_id=self.last_item_id,
                start_s=start / self.rate,
                end_s=end / self.rate,
            )
        )
        self.last_item_id = item.id
        self._drop_before(end)
        self.state.metrics.stream_turns.labels(self.api).inc()
        task = asyncio.get_running_loop().create_task(self._run(audio, self.options))
        self._finals.put_nowait((item, task))

    async def _run(self, audio: np.ndarray, options: DecodingOptions) -> Transcript:
        _, worker = self.state.require_ready()
        deadline = time.monotonic() + self.state.config.request_timeout
        return await self.state.transcribe(worker, audio, options, deadline)

    def _maybe_partial(self) -> None:
        item = self.item
        if item is None or item.committed or self.partial_interval <= 0:
            return
        if item.partial_task is not None:
            return
        length = self.received - max(item.start, self.buf_start)
        if length < self.rate * MIN_PARTIAL_MS / 1000:
            return
        if length - item.partial_len < self.partial_interval:
            return
        item.partial_len = length
        audio = self._slice(item.start, self.received)
        options = replace(self.options, temperature=0.0, word_timestamps=False)
        item.partial_task = asyncio.get_running_loop().create_task(
            self._partial(item, audio, options)
        )

    async def _partial(self, item: _Item, audio: np.ndarray, options: DecodingOptions) -> None:
        try:
            t = await self._run(audio, options)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - interim results are best effort
            item.partial_task = None
            log.debug("interim transcription skipped: %s", exc)
            return
        item.partial_task = None
        if item.committed or self._closed:
            return
        tokens = _tokens(t.text)
        stable: list[str] = []
        for a, b in zip(item.prev_tokens, tokens, strict=False):
            if a != b:
                break
            stable.append(a)
        item.prev_tokens = tokens
        stable_text = "".join(stable)
        delta = ""
        if len(stable_text) > len(item.emitted) and stable_text.startswith(item.emitted):
            delta = stable_text[len(item.emitted) :]
            item.emitted = stable_text
        self.emit(StreamEvent("partial", item.id, text=t.text, stable=item.emitted, delta=delta))
        if item is self.item:
            self._maybe_partial()  # audio that arrived meanwhile may make the next one due

    async def _finalize(self) -> None:
        """Answer committed turns in commit order."""
        while True:
            entry = await self._finals.get()
            if entry is None:
                return
            item, task = entry
            self._current = task
            try:
                t = await task
            except asyncio.CancelledError:
                if self._closed:
                    raise
                continue
            except Exception as exc:  # noqa: BLE001 - reported as a failed turn
                if not isinstance(exc, OASRError):
                    log.exception("stream transcription failed")
                    from oasr_server.errors import EngineFailureError

                    exc = EngineFailureError("internal error; the details are in the server log")
                self.state.metrics_error(exc)
                self.emit(StreamEvent("failed", item.id, error=exc))
                continue
            rest = t.text[len(item.emitted) :] if t.text.startswith(item.emitted) else ""
            self.emit(StreamEvent("completed", item.id, transcript=t, text=t.text, delta=rest))

    # -- end ---------------------------------------------------------------------------------
    async def finish(self) -> None:
        """End of input: flush the resampler and the VAD, commit what is left of a turn, wait
        until every committed turn has been answered."""
        tail = await self.state.run_vad(self._resampler.flush)
        await self._take(tail, await self.state.run_vad(self._vad_feed, tail))
        if self._endpointer is not None:
            events = await self.state.run_vad(self._endpointer.finish)
            self._endpointer = None
            for ev in events:
                self._on_vad(ev)
        item = self.item
        if item is not None and not item.committed:
            start = max(item.start, self.buf_start)
            if (self.received - start) / self.rate * 1000 >= MIN_COMMIT_MS:
                self._commit(item, start, self.received)
            elif item.partial_task is not None:
                item.partial_task.cancel()
            self.item = None
        self._finals.put_nowait(None)
        await self._finalizer

    def abort(self) -> list[asyncio.Task[Any]]:
        """Stop everything now (the client went away): pending work is dropped (queued engine
        jobs are skipped). Returns the cancelled tasks (await them to be sure they ended)."""
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [self._finalizer]
        if self.item is not None and self.item.partial_task is not None:
            tasks.append(self.item.partial_task)
        if self._current is not None:
            tasks.append(self._current)
        while not self._finals.empty():
            entry = self._finals.get_nowait()
            if entry is not None:
                tasks.append(entry[1])
        for task in tasks:
            task.cancel()
        return tasks

    async def aclose(self) -> None:
        await asyncio.gather(*self.abort(), return_exceptions=True)
