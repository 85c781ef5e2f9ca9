"""Audio decoding in worker processes: a busy server's decoding never holds its GIL.

PyAV decodes and resamples while holding the GIL, about 20-30 ms of it for a few seconds of
compressed audio. In one process that serves many uploads, decoding in threads starves the
engine's scheduler thread and the event loop of the GIL (measured on the H200: decoding held the
GIL four times longer than the scheduler). :class:`AudioDecodePool` runs
:func:`oasr.audio.load_audio` in a pool of worker processes instead: the encoded bytes go in,
the float32 samples come back, and errors (:class:`~oasr.errors.BadAudioError`,
:class:`~oasr.errors.AudioTooLongError`, ...) come back as themselves.

A worker that dies (a decoder crash, the OOM killer) breaks the whole pool in
:mod:`concurrent.futures`; the pool is then replaced and every decode that was in it is tried
once more. An input that kills a worker twice is answered with :class:`BadAudioError`, so one
poisonous file cannot take the server down, and no other request is lost.

Workers are started with ``forkserver`` on Linux (never ``fork``: the parent may already hold
CUDA state and threads) and ``spawn`` elsewhere; they import numpy and PyAV, never torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from oasr.errors import BadAudioError, InvalidRequestError

log = logging.getLogger("oasr")

#: Tries per input when workers die under it (the first try and one retry in a fresh pool).
ATTEMPTS = 2


def default_decode_processes(cpu_count: int | None = None) -> int:
    """Worker processes a server uses when not told: half the cores, at most 8; none (decode in
    threads) on machines with fewer than 4 cores, where the extra processes cost more memory
    than the parallelism is worth."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return 0 if cores < 4 else min(8, cores // 2)


def _warm_worker() -> int:
    # import the decoder once per worker, before the first real request pays for it
    import av  # noqa: F401

    import oasr.audio  # noqa: F401

    return os.getpid()


def _decode(
    decoder: Callable[..., Any] | None, data: bytes | str, sample_rate: int, kwargs: dict
) -> Any:
    if decoder is None:
        from oasr.audio import load_audio

        decoder = load_audio
    return decoder(data, sample_rate, **kwargs)


class AudioDecodePool:
    """``processes`` worker processes decoding audio bytes with :func:`oasr.audio.load_audio`.

    ``decoder`` replaces ``load_audio`` (a picklable top-level function with its signature);
    tests use it to crash a worker on purpose.
    """

    def __init__(
        self,
        processes: int,
        *,
        start_method: str | None = None,
        decoder: Callable[..., Any] | None = None,
    ) -> None:
        if processes < 1:
            raise InvalidRequestError("an audio decode pool needs >= 1 process", param="processes")
        self.processes = int(processes)
        if start_method is None:
            start_method = "forkserver" if sys.platform.startswith("linux") else "spawn"
        self._context = multiprocessing.get_context(start_method)
        self._decoder = decoder
        self._lock = threading.Lock()
        self._executor: cf.ProcessPoolExecutor | None = None
        self._closed = False
        #: pools replaced after a worker died (for logs and tests)
        self.restarts = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def _new_executor(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(max_workers=self.processes, mp_context=self._context)

    def _current(self) -> cf.ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the audio decode pool is shut down")
            if self._executor is None:
                self._executor = self._new_executor()
            return self._executor

    def start(self, timeout: float | None = 120.0) -> None:
        """Start the workers and import the decoder in them (blocking), so the first requests
        do not pay for process start-up."""
        executor = self._current()
        futures = [executor.submit(_warm_worker) for _ in range(self.processes)]
        pids = {f.result(timeout=timeout) for f in futures}
        log.info("audio decode pool: %d worker processes (%d warmed)", self.processes, len(pids))

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=not wait)

    def _replace(self, broken: cf.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is broken and not self._closed:
                self._executor = self._new_executor()
                self.restarts += 1
                log.warning("an audio decode worker died; the decode pool was restarted")
        broken.shutdown(wait=False, cancel_futures=True)

    # -- decoding ----------------------------------------------------------------------------
    def submit(
        self,
        data: bytes | bytearray | memoryview | str | os.PathLike,
        sample_rate: int = 16000,
        **kwargs: Any,
    ) -> cf.Future:
        """Decode ``data`` as ``load_audio(data, sample_rate, **kwargs)`` would, in a worker.
        ``data`` is the encoded bytes, or a file path that the worker reads itself.

        Returns a :class:`concurrent.futures.Future` of the float32 array; its exception is the
        one ``load_audio`` raised, or :class:`BadAudioError` when the input killed a worker
        ``ATTEMPTS`` times.
        """
        payload = os.fspath(data) if isinstance(data, (str, os.PathLike)) else bytes(data)
        outer: cf.Future = cf.Future()
        self._attempt(outer, payload, int(sample_rate), kwargs, ATTEMPTS)
        return outer

    def _attempt(
        self, outer: cf.Future, data: bytes | str, sample_rate: int, kwargs: dict, tries_left: int
    ) -> None:
        try:
            executor = self._current()
        except BaseException as exc:  # noqa: BLE001 - the pool is shut down
            outer.set_exception(exc)
            return
        try:
            inner = executor.submit(_decode, self._decoder, data, sample_rate, kwargs)
        except BrokenProcessPool:
            # the pool broke before this submit: replace it and go again
            self._replace(executor)
            if tries_left > 1:
                self._attempt(outer, data, sample_rate, kwargs, tries_left - 1)
            else:
                outer.set_exception(_crashed())
            return
        except BaseException as exc:  # noqa: BLE001 - shut down meanwhile
            outer.set_exception(exc)
            return

        def done(fut: cf.Future) -> None:
            if fut.cancelled():
                outer.set_exception(RuntimeError("the audio decode pool was shut down"))
                return
            exc = fut.exception()
            if isinstance(exc, BrokenProcessPool):
                self._replace(executor)
                if tries_left > 1 and not self._closed:
                    self._attempt(outer, data, sample_rate, kwargs, tries_left - 1)
                else:
                    outer.set_exception(_crashed())
            elif exc is not None:
                outer.set_exception(exc)
            else:
                outer.set_result(fut.result())

        inner.add_done_callback(done)

    async def decode(
        self, data: bytes | bytearray | memoryview, sample_rate: int = 16000, **kwargs: Any
    ) -> Any:
        """``await`` form of :meth:`submit` for event loops."""
        return await asyncio.wrap_future(self.submit(data, sample_rate, **kwargs))


def _crashed() -> BadAudioError:
    return BadAudioError(
        "the audio decoder process died while decoding this input, also on a second try; the "
        "file is probably corrupt (re-encode it, e.g. to WAV or FLAC)"
    )
