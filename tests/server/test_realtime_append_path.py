"""The realtime append's cheap path on the event loop: an ``input_audio_buffer.append`` read
without parsing its JSON, pcm16 kept as int16 in the stream's buffer and scaled where it is read
(the slices, the streaming engine loop's thread). Each must give exactly what the full path
gave: the same bytes, the same float32 samples (``decode_raw_pcm``'s)."""

from __future__ import annotations

import base64
import binascii
import json

import numpy as np
import pytest

from oasr.audio import RawPCMFormat, decode_raw_pcm

APPEND = "input_audio_buffer.append"


def _json_path(text: str) -> bytes | None:
    """What the JSON path makes of ``text``: the append's bytes, or None (another event, or an
    error event)."""
    try:
        event = json.loads(text)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("type") != APPEND:
        return None
    audio = event.get("audio")
    if not isinstance(audio, str):
        return None
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        return None


def test_plain_append_is_what_the_json_path_reads() -> None:
    from oasr_server.realtime import _plain_append

    blob = bytes(range(256)) * 13
    b64 = base64.b64encode(blob).decode()
    taken = [
        json.dumps({"type": APPEND, "audio": b64}),  # Python's separators
        json.dumps({"type": APPEND, "audio": b64}, separators=(",", ":")),  # compact
        json.dumps({"type": APPEND, "audio": base64.b64encode(b"\x01").decode()}),  # padding
        json.dumps({"type": APPEND, "audio": ""}),  # empty: nothing appended
    ]
    for text in taken:
        assert _plain_append(text) == _json_path(text), text[:80]
    assert _plain_append(taken[0]) == blob
    head = '{"type":"input_audio_buffer.append","audio":"'
    refused = [  # parsed as JSON: the same bytes, or the same error as before
        json.dumps({"type": APPEND, "audio": b64, "event_id": "e1"}),  # another field
        json.dumps({"audio": b64, "type": APPEND}),  # another order
        head + b64.replace("/", "\\/", 1) + '"}',  # an escape JSON resolves (valid)
        head[:-1] + '"}',  # '..."audio":"}': the head's quote is the closing one, not JSON
        head + "}",
        head + "AAAA" + '", "x": "BBBB"}',
        head + "AA\u00e9A" + '"}',  # not ASCII
        head + "AA\nA" + '"}',  # a control character JSON refuses
        head + "AAA" + '"}',  # bad padding
        head + "AA=A" + '"}',
        json.dumps({"type": APPEND, "audio": b64}) + " ",
        json.dumps({"type": "input_audio_buffer.commit"}),
        "[]",
        "",
    ]
    for text in refused:
        assert _plain_append(text) is None, text[:80]
    assert _plain_append(head + '"}') == b"" == _json_path(head + '"}')  # an empty append
    assert _json_path(refused[2]) == blob  # the JSON path still takes that one


def test_pcm16_scaling_is_decode_raw_pcm() -> None:
    """Every int16 value scales to decode_raw_pcm's float32, in the stream's slices and in the
    streaming engine loop's batched conversion of a wake-up's feeds, which merges each stream's
    successive feeds (up to its last, or another command of it) in order."""
    from oasr_server.stream_worker import _merge_feeds
    from oasr_server.streaming import pcm16_as_float

    every = np.arange(-32768, 32768, dtype="<i2")
    expected = decode_raw_pcm(every.tobytes(), RawPCMFormat(sample_rate=16000))[0]
    got = pcm16_as_float(every)
    assert got.dtype == np.float32 and np.array_equal(got, expected)
    floats = np.linspace(-1, 1, 7, dtype=np.float32)
    assert pcm16_as_float(floats) is floats

    s1, s2, s3 = object(), object(), object()
    commands = [
        ("open", s1, None),
        ("feed", s1, every[:1000], False),
        ("feed", s2, floats, False),
        ("feed", s1, every[1000:1500], False),
        ("feed", s3, [0.5, 0.25], False),  # not an ndarray: goes as it came
        ("feed", s1, None, True),
        ("feed", s1, every[1500:1600], False),  # after its last: not merged (the engine refuses)
        ("feed", s2, every[2000:3000], False),
        ("abort", s2),
        ("feed", s2, every[3000:], True),
    ]
    out = _merge_feeds(commands)
    kinds = [(c[0], c[1], c[3] if c[0] == "feed" else None) for c in out]
    assert kinds == [("open", s1, None), ("feed", s1, True), ("feed", s2, False), ("feed", s3, False),
                     ("feed", s1, False), ("abort", s2, None), ("feed", s2, True)]  # fmt: skip
    assert np.array_equal(out[1][2], expected[:1500]) and out[1][2].dtype == np.float32
    assert np.array_equal(out[2][2], np.concatenate([floats, expected[2000:3000]]))
    assert out[3] is commands[4]
    assert np.array_equal(out[4][2], expected[1500:1600])
    assert np.array_equal(out[6][2], expected[3000:])
    assert _merge_feeds([("feed", s1, None, True)]) == [("feed", s1, None, True)]


@pytest.mark.parametrize("with_float_chunk", [False, True])
def test_int16_buffer_slices_are_float32(with_float_chunk: bool) -> None:
    """A TurnStream's buffer of pcm16 appends (int16 views of the received bytes, maybe beside
    float32 chunks decoded in a thread) reads back as the float32 samples decode_raw_pcm gives,
    whatever the slice; dropping its head keeps the rest."""
    from oasr_server.streaming import TurnStream, pcm16_as_float

    rng = np.random.default_rng(0)
    pcm = rng.integers(-32768, 32768, 4000).astype("<i2")
    expected = decode_raw_pcm(pcm.tobytes(), RawPCMFormat(sample_rate=16000))[0]
    st = TurnStream.__new__(TurnStream)  # the buffer only: no server state needed
    st._chunks, st.buf_start, st.received = [], 0, 0
    for a, b in ((0, 1600), (1600, 1700), (1700, 3300), (3300, 4000)):
        chunk = np.frombuffer(pcm[a:b].tobytes(), "<i2")
        if with_float_chunk and a == 1600:
            chunk = expected[a:b].copy()
        st._chunks.append(chunk)
        st.received += len(chunk)
    for start, end in ((0, 4000), (10, 1600), (1500, 1800), (1650, 1690), (3999, 5000)):
        got = st._slice(start, end)
        assert got.dtype == np.float32 and np.array_equal(got, expected[start:end])
    view = st._slice(1700, 3300, view=True)
    assert view.dtype == np.int16 and np.array_equal(pcm16_as_float(view), expected[1700:3300])
    st._drop_before(1650)
    assert np.array_equal(st._slice(0, 4000), expected[1650:])



def test_websocket_protocol_pauses_reading_only_when_messages_queue_up() -> None:
    """oasr-server's uvicorn WebSocket protocol: a received message no longer pauses the socket
    (uvicorn's own pauses at each one, two epoll_ctl calls per message on an asyncio loop); it
    pauses once ``ws_max_queue`` messages wait and resumes when the application took them all."""
    import asyncio

    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from oasr_server.realtime import websocket_protocol

    cls = websocket_protocol()
    assert cls != "auto"

    class Transport:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def pause_reading(self) -> None:
            self.calls.append("pause")

        def resume_reading(self) -> None:
            self.calls.append("resume")

    async def app(scope: object, receive: object, send: object) -> None:  # never called
        raise AssertionError

    async def scenario() -> None:
        config = Config(app, ws=cls, ws_max_queue=3)
        config.load()
        proto = cls(config, ServerState(), {}, _loop=asyncio.get_running_loop())
        proto.transport = transport = Transport()

        def message(text: str) -> None:
            proto.handle_text(type("Frame", (), {"data": text.encode(), "fin": True})())

        message("a")
        assert (await proto.receive())["text"] == "a"
        message("b")
        message("c")
        assert transport.calls == []  # uvicorn's own: pause, resume, pause
        message("d")
        assert transport.calls == ["pause"] and proto.read_paused
        message("e")  # what the last socket read still held
        assert transport.calls == ["pause"]
        got = [(await proto.receive())["text"] for _ in range(4)]
        assert got == ["b", "c", "d", "e"] and transport.calls == ["pause", "resume"]
        assert not proto.read_paused

    asyncio.run(scenario())
