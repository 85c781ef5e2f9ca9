"""End to end through ``oasr.streaming.StreamingScheduler``: several concurrent streams fed from
threads, batched model steps, results equal to each stream decoded alone; abort; errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.streaming import StreamingScheduler
from oasr.types import DecodingOptions


def _solo(model, audio, opts):
    s = model.new_stream(opts)
    return model.stream_step([s], [audio], [True])[0].transcript


def test_concurrent_streams_threads(u2pp, speech) -> None:
    calls = []
    orig = u2pp.stream_step

    def spy(states, chunks, is_last):
        calls.append(len(states))
        return orig(states, chunks, is_last)

    u2pp.stream_step = spy
    try:
        sched = StreamingScheduler(u2pp, max_batch_size=8)
        audios = list(speech.values())
        opts = [DecodingOptions(beam_size=1 + 3 * (i % 2)) for i in range(len(audios))]
        rids = [sched.add_request(o) for o in opts]
        partial: dict[str, list[str]] = {r: [] for r in rids}
        finals: dict = {}

        def feeder(rid, audio, piece):
            for s in range(0, len(audio), piece):
                sched.feed_chunk(rid, audio[s : s + piece], is_last=s + piece >= len(audio))

        threads = [threading.Thread(target=feeder, args=(r, a, 700 + 300 * i))
                   for i, (r, a) in enumerate(zip(rids, audios, strict=True))]
        for t in threads:
            t.start()
        while len(finals) < len(rids):
            for rid, up in sched.step():
                (finals.__setitem__(rid, up.transcript) if up.is_final else partial[rid].append(up.text))
        for t in threads:
            t.join()
    finally:
        u2pp.stream_step = orig
    assert max(calls) > 1  # streams were batched together
    for rid, audio, o in zip(rids, audios, opts, strict=True):
        assert finals[rid].text == _solo(u2pp, audio, o).text
        assert sched.result(rid) is finals[rid]
    assert sched.num_active == 0


def test_run_and_abort(u2pp, speech) -> None:
    sched = StreamingScheduler(u2pp, max_batch_size=2)
    a = speech["zh_aishell_BAC009S0764W0121.wav"]
    r1, r2, r3 = (sched.add_request(DecodingOptions()) for _ in range(3))
    for r in (r1, r2, r3):
        sched.feed_chunk(r, a, is_last=True)
    assert sched.abort(r2)
    seen = []
    finals = sched.run(callback=lambda rid, up: seen.append(rid))
    assert set(finals) == {r1, r3}
    assert r2 not in seen
    assert finals[r1].text == finals[r3].text == _solo(u2pp, a, DecodingOptions()).text
    assert not sched.abort(r2)
    with pytest.raises(InvalidRequestError):
        sched.feed_chunk(r1, a)  # finished
    with pytest.raises(InvalidRequestError):
        sched.feed_chunk("nope", a)


def test_waits_for_audio_and_limits(u2pp, speech) -> None:
    sched = StreamingScheduler(u2pp, max_streams=1)
    rid = sched.add_request()
    with pytest.raises(InvalidRequestError):
        sched.add_request()
    sched.feed_chunk(rid, np.zeros(1000, np.float32))
    assert sched.step() == []  # not a full chunk yet
    sched.feed_chunk(rid, speech["zh_aishell_BAC009S0764W0121.wav"][:20000])
    out = sched.step()
    assert len(out) == 1 and not out[0][1].is_final
    sched.feed_chunk(rid, None, is_last=True)
    assert sched.run()[rid] is not None
    with pytest.raises(InvalidRequestError):
        sched.feed_chunk(rid, np.full(3, np.nan, np.float32))


def test_refuses_offline_models() -> None:
    class Offline:
        name = "x"

        class capabilities:  # noqa: N801
            streaming = False

    with pytest.raises(UnsupportedOptionError):
        StreamingScheduler(Offline())
