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

Samples come back through shared memory where the machine has it (``/dev/shm``): a worker
writes them to a file there and returns its name, and the caller reads them into its array and
deletes the file. Through the result pipe instead, every result is pickled and pushed through
one pipe that :class:`concurrent.futures.ProcessPoolExecutor` shares among all its workers
behind one lock, 64 KiB at a time: with many workers and many files the pipe is the limit
(measured on 2 cores: 1000 results of 8.8 s of audio took 1.0 s of the caller's CPU through the
pipe). Results under :data:`SHARED_MIN_BYTES`, errors, and any write that fails (a full or
missing ``/dev/shm``) take the pipe; the samples are the same bytes either way.

Workers are started with ``forkserver`` on Linux (not ``fork``: the parent may already hold
CUDA state and threads) and ``spawn`` elsewhere; they import numpy and PyAV, never torch. A
caller that has imported neither torch nor started a thread may ask for ``fork``
(:func:`fork_is_safe`; ``oasr transcribe`` does, before it imports torch): the workers then
start in milliseconds with what the caller imported. A pool replaced after a worker died is
never forked (the caller has threads by then): it uses the default method.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import multiprocessing
import os
import secrets
import sys
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from oasr.errors import BadAudioError, InvalidRequestError

log = logging.getLogger("oasr")

#: Tries per input when workers die under it (the first try and one retry in a fresh pool).
ATTEMPTS = 2

#: results of at least this many bytes come back through shared memory (0.5 s of 16 kHz audio);
#: smaller ones through the result pipe, where a file would cost more than it saves
SHARED_MIN_BYTES = 32 * 1024

#: where results are handed over, when it exists and is writable (Linux's shared memory)
SHARED_DIR = "/dev/shm"


def default_decode_processes(cpu_count: int | None = None) -> int:
    """Worker processes a server uses when not told: half the cores, at most 8; none (decode in
    threads) on machines with fewer than 4 cores, where the extra processes cost more memory
    than the parallelism is worth."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return 0 if cores < 4 else min(8, cores // 2)


def default_start_method() -> str:
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


def fork_is_safe() -> bool:
    """Whether this process may ``fork`` decode workers now: a POSIX system, torch not imported
    (no CUDA or OpenMP state) and no thread but this one (no lock another thread could hold)."""
    return (
        "fork" in multiprocessing.get_all_start_methods()
        and "torch" not in sys.modules
        and threading.active_count() == 1
    )


def _warm_worker() -> int:
    # import the decoder once per worker, before the first real request pays for it
    import av  # noqa: F401

    import oasr.audio  # noqa: F401

    return os.getpid()


def _shared_dir() -> str | None:
    return SHARED_DIR if os.path.isdir(SHARED_DIR) and os.access(SHARED_DIR, os.W_OK) else None


@dataclass(frozen=True)
class _Handoff:
    """Samples a worker left in a file in shared memory for the caller (who deletes it)."""

    path: str
    dtype: str
    shape: tuple[int, ...]


def _hand_off(out: Any, directory: str | None) -> Any:
    """``out`` as a :class:`_Handoff` when it is a large array and the file can be written;
    else ``out`` itself (it then travels through the result pipe)."""
    import numpy as np

    if directory is None or not isinstance(out, np.ndarray) or out.nbytes < SHARED_MIN_BYTES:
        return out
    path = os.path.join(directory, f"oasr-decode-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return out
    try:
        data = memoryview(np.ascontiguousarray(out)).cast("B")
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
    except OSError:  # a full /dev/shm (containers often give it 64 MB): the pipe instead
        os.close(fd)
        _unlink(path)
        return out
    os.close(fd)
    return _Handoff(path, out.dtype.str, tuple(out.shape))


def _take(handoff: _Handoff) -> Any:
    """The samples of a :class:`_Handoff`, read into a new array; the file is deleted."""
    import numpy as np

    try:
        out = np.empty(handoff.shape, dtype=np.dtype(handoff.dtype))
        with open(handoff.path, "rb", buffering=0) as f:
            got = f.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise OSError(f"{handoff.path}: {got} of {out.nbytes} bytes of decoded audio")
        return out
    finally:
        _unlink(handoff.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _decode(
    decoder: Callable[..., Any] | None,
    data: bytes | str,
    sample_rate: int,
    kwargs: dict,
    shared_dir: str | None = None,
) -> Any:
    if decoder is None:
        from oasr.audio import load_audio

        decoder = load_audio
    return _hand_off(decoder(data, sample_rate, **kwargs), shared_dir)


class AudioDecodePool:
    """``processes`` worker processes decoding audio bytes with :func:`oasr.audio.load_audio`.

    ``decoder`` replaces ``load_audio`` (a picklable top-level function with its signature);
    tests use it to crash a worker on purpose. ``shared_memory=False`` returns every result
    through the result pipe (see the module docstring).
    """

    def __init__(
        self,
        processes: int,
        *,
        start_method: str | None = None,
        decoder: Callable[..., Any] | None = None,
        shared_memory: bool = True,
    ) -> None:
        if processes < 1:
            raise InvalidRequestError("an audio decode pool needs >= 1 process", param="processes")
        self.processes = int(processes)
        if start_method is None:
            start_method = default_start_method()
        self._context = multiprocessing.get_context(start_method)
        self._decoder = decoder
        #: where workers hand their results over (None: through the result pipe)
        self.shared_dir = _shared_dir() if shared_memory else None
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

    def start(self, timeout: float | None = 120.0, wait: bool = True) -> None:
        """Start the workers and import the decoder in them, so the first requests do not pay
        for process start-up. ``wait=False`` returns at once: the workers start beside the
        caller's first decodes (the executor starts a worker only when none is idle, so without
        this a first call of two files would start two workers, and the next call the rest)."""
        executor = self._current()
        futures = [executor.submit(_warm_worker) for _ in range(self.processes)]
        if not wait:
            return
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
                if self._context.get_start_method() == "fork":  # threads by now: never fork again
                    self._context = multiprocessing.get_context(default_start_method())
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
            inner = executor.submit(_decode, self._decoder, data, sample_rate, kwargs, self.shared_dir)
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
                result = fut.result()
                if isinstance(result, _Handoff):
                    try:
                        result = _take(result)
                    except Exception as read_exc:  # noqa: BLE001 - reported on the future
                        outer.set_exception(read_exc)
                        return
                outer.set_result(result)

        inner.add_done_callback(done)

    def call(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """``fn(*args)`` in a worker (a picklable top-level function): small side work beside
        the decodes, such as reading a file's header. Not retried when a worker dies."""
        return self._current().submit(fn, *args)

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
