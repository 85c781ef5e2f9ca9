"""Live audio streams cut into turns: the part shared by the realtime WebSocket
(:mod:`oasr_server.realtime`) and gRPC ``StreamingRecognize``.

A :class:`TurnStream` takes raw audio bytes (PCM or G.711 at any rate), converts them to the
model's rate, keeps the *input buffer*, optionally runs server VAD (an
:class:`oasr.vad.Endpointer` over the Silero detector) and commits turns:

* with VAD, a turn starts at ``speech_start`` (minus ``prefix_padding_ms``) and is committed at
  ``speech_end`` (after ``silence_duration_ms`` of silence), with ``END_PAD_MS`` of the trailing
  silence kept;
* without VAD, the caller commits (``commit()``); the whole buffer is the turn.

How a turn becomes text is the stream's *turn recogniser*, chosen by the engine's service mode:

* :class:`Retranscribe` (offline engines, e.g. Whisper): every transcription goes through the
  server's :class:`~oasr_server.worker.EngineWorker` queue, so streams share the engine (and its
  batches) with HTTP requests. While a turn grows, it is re-transcribed after every
  ``partial_interval_ms`` of new audio (one interim job per stream at a time; greedy decoding
  without temperature fallback; best effort: a full queue or a failure just skips it). Each
  hypothesis is compared with the previous one and the words both agree on (a common word
  prefix: "local agreement") are the *stable* text. A model that streams its tokens (the
  speech-LLM) also makes the committed turn's text stable piece by piece while its final
  transcription decodes.
* :class:`EngineStreaming` (streaming engines, e.g. WeNet): each turn is one engine streaming
  request (:class:`~oasr_server.stream_worker.StreamingEngineLoop`), fed as the audio arrives;
  the model's partial hypothesis after each of its chunks is the stable text, its final result
  the transcript. With server VAD, audio is fed only up to where the turn can still end
  (``Endpointer.earliest_end`` plus ``END_PAD_MS``), so the engine gets exactly the turn's audio.

Either way the part of the stable text not sent before is the *delta*, and only a stable text
that extends what was sent yields one: deltas only ever append. When the turn's final transcript
arrives and starts with the text already sent, the rest is sent as a last delta, so the deltas
of a turn concatenate to its final transcript; when the final transcript revised the sent text
(rare: Whisper re-decoding, WeNet attention rescoring or a beam search changing its mind), no
last delta is sent and the final transcript is what counts.

Heavy work never runs on the event loop: decoding, resampling and VAD run in a thread
(``state.run_vad``), the model in the engine worker or the streaming engine loop. The one
exception is tiny: an append of at most ``INLINE_APPEND_S`` of raw PCM at the model's rate with
server VAD off is taken in place, which costs less than the thread hop; mono pcm16 is not even
converted there: its samples stay int16 in the buffer (a view of the received bytes) and are
scaled to float32 where they are read (:meth:`TurnStream._slice`; the streaming engine loop's
thread for the audio it feeds). Calls into one ``TurnStream`` must be sequential (each
transport drives it from one task).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from oasr.errors import InvalidRequestError, OASRError

if TYPE_CHECKING:
    from oasr.types import DecodingOptions, Transcript
    from oasr_server.app import ServerState
    from oasr_server.stream_worker import EngineStream, StreamingEngineLoop

log = logging.getLogger("oasr_server.streaming")

#: trailing silence kept after the end of speech in a VAD turn
END_PAD_MS = 200
#: shortest turn a manual commit accepts (OpenAI's limit)
MIN_COMMIT_MS = 100
#: shortest turn audio worth an interim transcription
MIN_PARTIAL_MS = 300
#: longest append (seconds) decoded on the event loop when it needs no resampling and no VAD
INLINE_APPEND_S = 0.5
_PCM16_SCALE = np.float32(1.0 / 32768.0)
#: most elements of one numpy call on the event loop (numpy releases the GIL above 500)
_GIL_KEPT = 500


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
    answered: bool = False  # completed or failed was emitted
    emitted: str = ""  # stable text sent as deltas
    hypothesis: str = ""  # the last interim hypothesis
    # Retranscribe
    prev_tokens: list[str] = field(default_factory=list)
    partial_len: int = 0  # turn length (samples) at the last interim job
    partial_task: asyncio.Task[None] | None = None
    # EngineStreaming
    engine: EngineStream | None = None
    fed: int = -1  # absolute sample up to which the turn's audio went to the engine

    def __post_init__(self) -> None:
        if self.fed < 0:
            self.fed = self.start


def _tokens(text: str) -> list[str]:
    return re.findall(r"\s*\S+", text)


def pcm16_as_float(x: np.ndarray) -> np.ndarray:
    """int16 pcm samples as float32 in [-1, 1) (``decode_raw_pcm``'s values: scaling by 2**-15
    is exact); float32 samples unchanged."""
    if x.dtype.kind != "i":
        return x
    return np.multiply(x, _PCM16_SCALE, dtype=np.float32)


def _pcm16_to_float(data: bytes, n: int) -> np.ndarray:
    """The first ``n`` mono pcm16 samples of ``data`` as float32 in [-1, 1): the values of
    ``decode_raw_pcm`` (scaling by 2**-15 is exact), in pieces of at most ``_GIL_KEPT``
    samples. Used where such audio is decoded in a thread (server VAD on; without VAD the
    samples stay int16, :meth:`TurnStream.append_now`): numpy lets go of the GIL for a loop over
    more than 500 elements, and a thread that let go waits for the other threads' switch
    interval to get it back, once per such call (measured here: 0.4-1 ms per call beside a
    busy thread, 3 us without the release)."""
    src = np.frombuffer(data, "<i2", n)
    out = np.empty(n, np.float32)
    for k in range(0, n, _GIL_KEPT):
        np.multiply(src[k : k + _GIL_KEPT], _PCM16_SCALE, out=out[k : k + _GIL_KEPT])
    return out


def new_id(prefix: str) -> str:
    # 80 random bits, as uuid4().hex[:20] was, at a fifth of its cost (one per server event)
    return f"{prefix}_{os.urandom(10).hex()}"


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
        self._audio_seconds = state.metrics.audio_seconds.labels(self.route)
        #: ``max_buffer`` (the server's settings do not change while it runs; read per append)
        self._max_len = self.max_buffer
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
        self.recognizer: TurnRecognizer = (
            EngineStreaming(self, state.stream_engine)
            if state.stream_engine is not None
            else Retranscribe(self)
        )

    # -- configuration -----------------------------------------------------------------------
    def _set_format(self, fmt: InputFormat) -> None:
        from oasr.audio import RawPCMFormat, Resampler

        raw = RawPCMFormat(
            sample_rate=fmt.sample_rate, encoding=fmt.encoding, channels=fmt.channels
        )  # type: ignore[arg-type]
        self._raw_format = raw
        self._resampler = Resampler(fmt.sample_rate, self.rate)
        #: appends are mono pcm16 at the model's rate: buffered as int16 (``append_now``)
        self._pcm16_direct = (
            raw.encoding == "pcm_s16le" and raw.channels == 1 and fmt.sample_rate == self.rate
        )
        self._leftover = b""
        self.fmt = fmt

    async def set_format(self, fmt: InputFormat) -> None:
        if fmt == self.fmt:
            return
        tail = await self.state.run_vad(self._resampler.flush)
        self._set_format(fmt)
        if len(tail):
            self._take(tail, await self.state.run_vad(self._vad_feed, tail))

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
            self.recognizer.discard(self.item)
            self.item = None

    # -- buffer ------------------------------------------------------------------------------
    def _slice(self, start: int, end: int, view: bool = False) -> np.ndarray:
        """A copy of the buffered audio ``[start, end)`` (absolute samples, clipped to the
        buffer) as float32. Walks back from the newest chunk, so recent audio is cheap however
        long the buffer is (a streaming recogniser takes every new chunk of a long turn).
        ``view``: a view when one buffered chunk holds it all (for a reader that copies it
        anyway; buffered chunks are never written to), then int16 pcm where the chunk came as
        pcm16 at the model's rate (:meth:`append_now`): scale it with :func:`pcm16_as_float`."""
        start = max(start, self.buf_start)
        end = min(end, self.received)
        parts: list[np.ndarray] = []
        chunk_end = self.received
        for chunk in reversed(self._chunks):
            if chunk_end <= start:
                break
            chunk_start = chunk_end - len(chunk)
            if chunk_start < end:
                parts.append(chunk[max(0, start - chunk_start) : end - chunk_start])
            chunk_end = chunk_start
        if not parts:
            return np.zeros(0, np.float32)
        if view and len(parts) == 1:
            return parts[0]  # int16 when it came as pcm16 (the reader scales it)
        parts.reverse()
        if len(parts) == 1 or all(p.dtype == parts[0].dtype for p in parts):
            return pcm16_as_float(np.concatenate(parts))  # (one part: still a copy)
        return np.concatenate([pcm16_as_float(p) for p in parts])

    def _drop_before(self, pos: int) -> None:
        """Forget the audio before ``pos``: whole chunks go, only a chunk cut in two is copied
        (a full buffer that drops its head on every append must not copy all of it each time)."""
        if pos <= self.buf_start:
            return
        pos = min(pos, self.received)
        start, chunks, i = self.buf_start, self._chunks, 0
        while i < len(chunks) and start + len(chunks[i]) <= pos:
            start += len(chunks[i])
            i += 1
        rest = chunks[i:]
        if rest and start < pos:
            rest[0] = rest[0][pos - start :].copy()  # a copy: the cut-off head is freed
        self._chunks = rest
        self.buf_start = pos

    @property
    def answering(self) -> bool:
        """Committed turns are still waiting for (or sending) their final transcript."""
        current = self._current
        return not self._finals.empty() or (current is not None and not current.done())

    @property
    def max_buffer(self) -> int:
        """Most samples the input buffer may hold (``--max-audio-seconds``,
        ``--stream-buffer-seconds`` and ``--stream-buffer-bytes``, the smallest)."""
        cfg = self.state.config
        seconds = min(cfg.max_audio_seconds, cfg.stream_buffer_seconds)
        return max(1, min(int(seconds * self.rate), cfg.stream_buffer_bytes // 4))

    def _too_long(self, what: str) -> OASRError:
        from oasr.errors import AudioTooLongError

        cfg = self.state.config
        return AudioTooLongError(
            f"{what} more than {self.max_buffer / self.rate:g} s of uncommitted audio "
            f"(--stream-buffer-seconds {cfg.stream_buffer_seconds:g}, --stream-buffer-bytes "
            f"{cfg.stream_buffer_bytes}, --max-audio-seconds {cfg.max_audio_seconds:g}); "
            "commit more often"
        )

    @property
    def buffered_s(self) -> float:
        return (self.received - self.buf_start) / self.rate

    # -- input -------------------------------------------------------------------------------
    def _ingest(self, data: bytes) -> tuple[np.ndarray, list[Any]]:
        """Thread: bytes -> model-rate float32 (+ VAD events)."""
        from oasr.audio import decode_raw_pcm

        if self._leftover:
            data = self._leftover + data
        raw = self._raw_format
        cut = len(data) - len(data) % raw.bytes_per_frame
        self._leftover = data[cut:]
        if raw.encoding == "pcm_s16le" and raw.channels == 1 and self._resampler.src_rate == self.rate:
            y = _pcm16_to_float(data, cut // 2)
        else:
            x = decode_raw_pcm(data[:cut], raw)
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
        if not self.append_now(data):
            y, events = await self.state.run_vad(self._ingest, data)
            self._take(y, events)

    def append_now(self, data: bytes) -> bool:
        """:meth:`append` here and now when it needs no thread: raw PCM of a short append at
        the model's rate with server VAD off (a table lookup or a scale of a few thousand
        samples, cheaper than the hop to a thread and back: the hop per append was most of the
        event loop's time with hundreds of streams). False (nothing done): it needs
        :meth:`append`."""
        if not data:
            return True
        fmt = self._raw_format
        incoming = len(data) // max(1, fmt.bytes_per_frame) * self.rate / fmt.sample_rate
        if incoming > self._max_len:  # refused whole, before any decoding
            raise self._too_long("this append holds")
        if self._endpointer is not None or incoming > self.rate * INLINE_APPEND_S or (
            self._resampler.src_rate != self._resampler.dst_rate
        ):
            return False
        if self._pcm16_direct:
            # mono pcm16 at the model's rate: its samples are buffered as they came (a view of
            # ``data``, no conversion on the event loop: numpy's scaling of an append was the
            # largest piece of the event loop's own work per append); whoever reads them scales
            if self._leftover:
                data = self._leftover + data
            n = len(data) // 2
            self._leftover = data[2 * n :]
            self._take(np.frombuffer(data, "<i2", n), [])
            return True
        y, events = self._ingest(data)
        self._take(y, events)
        return True

    def _take(self, y: np.ndarray, events: list[Any]) -> None:
        if len(y):
            self._chunks.append(y if y.dtype.kind == "i" else y.astype(np.float32, copy=False))
            self.received += len(y)
            self._audio_seconds.inc(len(y) / self.rate)
        for ev in events:
            self._on_vad(ev)
        max_len = self._max_len
        item = self.item
        if self.vad is not None and item is None:
            # keep what a turn starting in the next chunk may need as prefix padding
            keep = int(self.rate * (self.vad.prefix_padding_ms + 2 * 32 + 100) / 1000)
            self._drop_before(self.received - keep)
        elif (
            item is not None
            and (self.vad is not None or self.recognizer.incremental)
            and self.received - item.start >= max_len
        ):
            # a turn may not outgrow --max-audio-seconds: commit, keep listening (a streaming
            # recogniser has the audio already: a manual-mode turn cannot drop its head)
            self._commit(item, item.start, self.received)
            self.item = _Item(new_id("item"), self.received) if self.vad is not None else None
        elif self.vad is None and self.received - self.buf_start > max_len:
            self._drop_before(self.received - max_len)
            if self.item is not None and self.item.start < self.buf_start:
                self.item.start = self.buf_start
            raise self._too_long("the input audio buffer holds (the oldest audio was dropped)")
        if self.vad is None and self.item is None and self.received > self.buf_start:
            self.item = _Item(new_id("item"), self.buf_start)
        self._advance()

    def _advance(self) -> None:
        item = self.item
        if item is not None and not item.committed:
            self.recognizer.advance(item)

    def turn_safe_end(self) -> int:
        """Audio of the open turn before this sample is the turn's whatever comes next: all
        that arrived without VAD; with VAD, up to ``END_PAD_MS`` after the earliest sample the
        turn can still end at."""
        ep = self._endpointer
        if self.vad is None or ep is None:
            return self.received
        pad = int(self.rate * END_PAD_MS / 1000)
        return min(self.received, self._abs(ep.earliest_end) + pad)

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
        if item is not None:
            self.recognizer.discard(item)
        self._drop_before(self.received)
        in_turn = (
            self.vad is not None and self._endpointer is not None and self._endpointer.in_speech
        )
        self.item = _Item(item.id, self.received) if (in_turn and item is not None) else None

    def _commit(self, item: _Item, start: int, end: int) -> None:
        item.committed = True
        final = self.recognizer.final(item, start, end)  # takes the audio before it is dropped
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
        task = asyncio.get_running_loop().create_task(final)
        self._finals.put_nowait((item, task))

    def _interim(self, item: _Item, text: str, stable: str) -> None:
        """A new interim hypothesis ``text`` of a turn, of which ``stable`` will not change:
        the part of ``stable`` that extends what was sent goes out as the delta."""
        if self._closed or item.answered or self.partial_interval <= 0:
            return
        item.hypothesis = text
        delta = ""
        if len(stable) > len(item.emitted) and stable.startswith(item.emitted):
            delta = stable[len(item.emitted) :]
            item.emitted = stable
        self.emit(StreamEvent("partial", item.id, text=text, stable=item.emitted, delta=delta))

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
                item.answered = True
                self.emit(StreamEvent("failed", item.id, error=exc))
                continue
            rest = t.text[len(item.emitted) :] if t.text.startswith(item.emitted) else ""
            item.answered = True
            self.emit(StreamEvent("completed", item.id, transcript=t, text=t.text, delta=rest))

    # -- end ---------------------------------------------------------------------------------
    async def finish(self) -> None:
        """End of input: flush the resampler and the VAD, commit what is left of a turn, wait
        until every committed turn has been answered."""
        tail = await self.state.run_vad(self._resampler.flush)
        self._take(tail, await self.state.run_vad(self._vad_feed, tail))
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
            else:
                self.recognizer.discard(item)
            self.item = None
        self._finals.put_nowait(None)
        await self._finalizer

    def abort(self) -> list[asyncio.Task[Any]]:
        """Stop everything now (the client went away): pending work is dropped (queued engine
        jobs are skipped). Returns the cancelled tasks (await them to be sure they ended)."""
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [self._finalizer]
        tasks.extend(self.recognizer.close())
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


# -- turn recognisers ------------------------------------------------------------------------------


class TurnRecognizer(Protocol):
    """How a :class:`TurnStream` turns a turn's audio into interim and final transcripts."""

    #: True when the turn's audio is consumed as it arrives (it cannot be dropped later)
    incremental: bool

    def advance(self, item: _Item) -> None:
        """The open turn ``item`` grew (event loop; must not block)."""

    def final(self, item: _Item, start: int, end: int) -> Awaitable[Transcript]:
        """``item`` was committed as the audio ``[start, end)`` (still buffered during this
        call): start its final transcription."""
        ...

    def discard(self, item: _Item) -> None:
        """Drop the interim work of a turn that will not be committed (clear, VAD switched)."""

    def close(self) -> list[asyncio.Task[Any]]:
        """The stream ends now: stop all work; returns the cancelled tasks."""
        ...


class Retranscribe:
    """Offline engines: interim results re-transcribe the growing turn through the engine
    worker queue (local agreement), the final transcribes the committed turn once."""

    incremental = False

    def __init__(self, stream: TurnStream) -> None:
        self.stream = stream

    async def _transcribe(self, audio: np.ndarray, options: DecodingOptions) -> Transcript:
        state = self.stream.state
        _, worker = state.require_ready()
        deadline = time.monotonic() + state.config.request_timeout
        return await state.transcribe(worker, audio, options, deadline)

    def advance(self, item: _Item) -> None:
        st = self.stream
        if st.partial_interval <= 0 or item.partial_task is not None:
            return
        length = st.received - max(item.start, st.buf_start)
        if length < st.rate * MIN_PARTIAL_MS / 1000:
            return
        if length - item.partial_len < st.partial_interval:
            return
        item.partial_len = length
        audio = st._slice(item.start, st.received)
        options = replace(st.options, temperature=0.0, word_timestamps=False)
        item.partial_task = asyncio.get_running_loop().create_task(
            self._partial(item, audio, options)
        )

    async def _partial(self, item: _Item, audio: np.ndarray, options: DecodingOptions) -> None:
        try:
            t = await self._transcribe(audio, options)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - interim results are best effort
            item.partial_task = None
            log.debug("interim transcription skipped: %s", exc)
            return
        item.partial_task = None
        if item.committed:
            return
        tokens = _tokens(t.text)
        stable: list[str] = []
        for a, b in zip(item.prev_tokens, tokens, strict=False):
            if a != b:
                break
            stable.append(a)
        item.prev_tokens = tokens
        self.stream._interim(item, t.text, "".join(stable))
        if item is self.stream.item and not self.stream._closed:
            self.advance(item)  # audio that arrived meanwhile may make the next one due

    def final(self, item: _Item, start: int, end: int) -> Awaitable[Transcript]:
        self.discard(item)
        return self._final(item, self.stream._slice(start, end), self.stream.options)

    async def _final(self, item: _Item, audio: np.ndarray, options: DecodingOptions) -> Transcript:
        """The committed turn's transcription. A model that streams its tokens (the engine's
        token-streaming partials: Qwen2-Audio) sends each decoded piece on as an interim
        hypothesis of the turn while it decodes, so it reaches the client as a delta (realtime)
        or an interim result (gRPC) through the same path as re-transcription interims; other
        models send nothing until the transcript."""
        state = self.stream.state
        _, worker = state.require_ready()
        deadline = time.monotonic() + state.config.request_timeout
        pieces = state.transcribe_pieces(worker, audio, options, deadline)
        text = ""
        try:
            async for piece in pieces:
                if not isinstance(piece, str):
                    return piece
                text += piece
                self.stream._interim(item, text, text)
        finally:
            await pieces.aclose()
        raise AssertionError("transcribe_pieces ended without a transcript")  # pragma: no cover

    def discard(self, item: _Item) -> None:
        if item.partial_task is not None:
            item.partial_task.cancel()

    def close(self) -> list[asyncio.Task[Any]]:
        item = self.stream.item
        if item is None or item.partial_task is None:
            return []
        item.partial_task.cancel()
        return [item.partial_task]


class EngineStreaming:
    """Streaming engines: each turn is one engine streaming request, fed as its audio arrives;
    the model's partial hypotheses are the interim results (each one is stable: it is the
    model's own incremental output), its final result is the transcript."""

    incremental = True

    def __init__(self, stream: TurnStream, engines: StreamingEngineLoop) -> None:
        self.stream = stream
        self.engines = engines
        #: engine streams of this TurnStream not answered yet
        self._open: set[EngineStream] = set()

    def _feed(self, item: _Item, upto: int, is_last: bool) -> None:
        st = self.stream
        if item.engine is None:
            item.engine = self.engines.open(st.options, partial(self._on_partial, item))
            self._open.add(item.engine)
            item.engine.final.add_done_callback(lambda _f, e=item.engine: self._open.discard(e))
        if upto > item.fed:
            self.engines.feed(item.engine, st._slice(item.fed, upto, view=True), is_last)
            item.fed = upto
        elif is_last:
            self.engines.feed(item.engine, None, True)

    def _on_partial(self, item: _Item, text: str) -> None:
        if text != item.hypothesis:
            self.stream._interim(item, text, text)

    def advance(self, item: _Item) -> None:
        self._feed(item, self.stream.turn_safe_end(), False)

    def final(self, item: _Item, start: int, end: int) -> Awaitable[Transcript]:
        self._feed(item, end, True)
        assert item.engine is not None
        return self._await_final(item.engine)

    async def _await_final(self, engine_stream: EngineStream) -> Transcript:
        timeout = self.stream.state.config.request_timeout
        try:
            return await asyncio.wait_for(asyncio.shield(engine_stream.final), timeout)
        except asyncio.TimeoutError:
            from oasr_server.errors import RequestTimeoutError

            raise RequestTimeoutError(
                f"the turn's final result did not come within {timeout:g} s "
                "(--request-timeout); the server is overloaded"
            ) from None
        finally:
            if not engine_stream.final.done():  # cancelled or timed out
                self.engines.abort(engine_stream)

    def discard(self, item: _Item) -> None:
        if item.engine is not None:
            self._open.discard(item.engine)
            self.engines.abort(item.engine)

    def close(self) -> list[asyncio.Task[Any]]:
        for engine_stream in list(self._open):
            self.engines.abort(engine_stream)
        self._open.clear()
        return []
