"""``oasr.decode_pool``: decoding in worker processes gives exactly ``load_audio``'s samples and
errors, survives a worker that dies, and refuses work once shut down."""

from __future__ import annotations

import asyncio
import io
import wave
from pathlib import Path

import numpy as np
import pytest

from oasr.audio import load_audio
from oasr.decode_pool import AudioDecodePool, default_decode_processes
from oasr.errors import AudioTooLongError, BadAudioError, InvalidRequestError

HERE = Path(__file__).resolve().parent
SPEECH = HERE.parent / "data" / "speech"


def _wav(seconds: float, rate: int, channels: int = 1, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pcm = rng.integers(-32768, 32767, size=(int(seconds * rate), channels), dtype=np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def pool():
    # the production start method (forkserver on Linux) with the real load_audio
    p = AudioDecodePool(2)
    p.start()
    yield p
    p.shutdown()


def test_samples_equal_in_process_decoding(pool: AudioDecodePool) -> None:
    inputs = [
        (_wav(1.0, 16000), {}),
        (_wav(0.7, 44100, channels=2, seed=1), {}),  # resampled and mixed down
        ((SPEECH / "en_ls_1272-141231-0002.mp3").read_bytes(), {}),
        ((SPEECH / "en_fleurs_000.ogg").read_bytes(), {"max_seconds": 60}),
    ]
    futures = [pool.submit(data, 16000, **kw) for data, kw in inputs]
    for (data, kw), fut in zip(inputs, futures, strict=True):
        got = fut.result(timeout=60)
        want = load_audio(data, 16000, **kw)
        assert got.dtype == np.float32 and np.array_equal(got, want)


def test_errors_come_back_as_themselves(pool: AudioDecodePool) -> None:
    garbage = b"this is not audio at all" * 20
    with pytest.raises(BadAudioError) as remote:
        pool.submit(garbage, 16000).result(timeout=60)
    with pytest.raises(BadAudioError) as local:
        load_audio(garbage, 16000)
    assert remote.value.message == local.value.message
    assert remote.value.http_status == 400 and remote.value.code == local.value.code

    with pytest.raises(AudioTooLongError, match="limit of 0.5 s"):
        pool.submit(_wav(2.0, 16000), 16000, max_seconds=0.5).result(timeout=60)
    with pytest.raises(InvalidRequestError) as bad_rate:
        pool.submit(_wav(0.1, 16000), 3).result(timeout=60)
    assert bad_rate.value.param == "sample_rate"


def test_async_decode(pool: AudioDecodePool) -> None:
    data = _wav(0.5, 16000)

    async def main() -> list[np.ndarray]:
        return await asyncio.gather(*(pool.decode(data, 16000) for _ in range(4)))

    for got in asyncio.run(main()):
        assert np.array_equal(got, load_audio(data, 16000))


def test_a_dying_worker_is_replaced_and_its_input_retried(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    from _decode_pool_helpers import crash_once_then_decode  # noqa: PLC0415

    pool = AudioDecodePool(1, start_method="spawn", decoder=crash_once_then_decode)
    try:
        data = _wav(0.3, 16000)
        got = pool.submit(data, 16000, marker=str(tmp_path / "crashed")).result(timeout=60)
        assert np.array_equal(got, load_audio(data, 16000))
        assert (tmp_path / "crashed").exists() and pool.restarts == 1
    finally:
        pool.shutdown()


def test_an_input_that_kills_workers_twice_is_bad_audio(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    from _decode_pool_helpers import always_crash  # noqa: PLC0415

    pool = AudioDecodePool(1, start_method="spawn", decoder=always_crash)
    try:
        with pytest.raises(BadAudioError, match="died while decoding"):
            pool.submit(b"poison", 16000).result(timeout=60)
        assert pool.restarts == 2
    finally:
        pool.shutdown()


def test_shut_down_pool_refuses_work() -> None:
    pool = AudioDecodePool(1)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(b"x", 16000).result(timeout=5)
    with pytest.raises(InvalidRequestError):
        AudioDecodePool(0)


def test_default_process_count() -> None:
    assert default_decode_processes(2) == 0
    assert default_decode_processes(4) == 2
    assert default_decode_processes(16) == 8
    assert default_decode_processes(128) == 8
