"""gRPC ``oasr.speech.v1.Speech/StreamingRecognize`` over a real channel: VAD utterances on real
speech, interim results, end-of-stream finals, errors and the stream limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from oasr_server.grpc_api import speech_pb2 as pb  # noqa: E402
from oasr_server.grpc_api import speech_pb2_grpc  # noqa: E402

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"


def _speech(rate: int) -> np.ndarray:
    from oasr.audio import load_audio

    a = load_audio(str(SPEECH / "en_ls_2830-3980-0043.wav"), rate)
    b = load_audio(str(SPEECH / "en_ls_4507-16021-0012.wav"), rate)
    z = lambda s: np.zeros(int(s * rate), np.float32)  # noqa: E731
    return np.concatenate([z(0.5), a, z(1.5), b, z(0.3)])


def _pcm(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def _requests(config: pb.StreamingRecognitionConfig | None, audio: bytes, step: int):
    async def gen():
        if config is not None:
            yield pb.StreamingRecognizeRequest(streaming_config=config)
        for i in range(0, len(audio), step):
            yield pb.StreamingRecognizeRequest(audio_content=audio[i : i + step])

    return gen()


async def _collect(call) -> list[pb.StreamingRecognizeResponse]:
    return [r async for r in call]


async def _error(call) -> tuple[grpc.StatusCode, dict[str, str]]:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        return err.code(), dict(err.trailing_metadata() or ())
    raise AssertionError("the stream did not fail")


def test_streaming_recognize(kit, app_factory) -> None:
    app, model = app_factory(grpc_bind="127.0.0.1:0", partial_interval_ms=700)
    pcm16k = _pcm(_speech(16000))
    tone = _pcm(0.3 * np.sin(2 * np.pi * 300 * np.arange(24000) / 8000))  # 3 s at 8 kHz

    async def go():
        async with kit.serving(app) as c:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{app.state.grpc_server.oasr_port}"
            ) as channel:
                stub = speech_pb2_grpc.SpeechStub(channel)
                vad = await _collect(
                    stub.StreamingRecognize(
                        _requests(
                            pb.StreamingRecognitionConfig(
                                config=pb.RecognitionConfig(
                                    encoding=pb.PCM_S16LE,
                                    sample_rate_hertz=16000,
                                    word_timestamps=True,
                                    language="en",
                                ),
                                voice_activity=pb.VoiceActivityConfig(enabled=True),
                            ),
                            pcm16k,
                            3200,
                        )
                    )
                )
                # the client waits for each interim result before sending more audio, so two
                # interim results come before the end of the stream whatever the machine's load
                seen = asyncio.Queue()

                async def paced():
                    yield pb.StreamingRecognizeRequest(
                        streaming_config=pb.StreamingRecognitionConfig(
                            config=pb.RecognitionConfig(
                                encoding=pb.PCM_S16LE, sample_rate_hertz=8000
                            ),
                            interim_results=True,
                            interim_interval_ms=1000,
                        )
                    )
                    for part in (tone[:19200], tone[19200:38400]):  # 1.2 s each
                        yield pb.StreamingRecognizeRequest(audio_content=part)
                        await seen.get()
                    yield pb.StreamingRecognizeRequest(audio_content=tone[38400:])

                interim = []
                async for r in stub.StreamingRecognize(paced()):
                    interim.append(r)
                    if not r.result.is_final:
                        seen.put_nowait(r)
                # (refused calls send one message: a client still writing when the server ends
                # the call may see grpc's own INTERNAL instead of the status)
                no_config = await _error(
                    stub.StreamingRecognize(_requests(None, tone[:3200], 3200))
                )
                container = await _error(
                    stub.StreamingRecognize(_requests(pb.StreamingRecognitionConfig(), b"", 1))
                )
                bad_vad = await _error(
                    stub.StreamingRecognize(
                        _requests(
                            pb.StreamingRecognitionConfig(
                                config=pb.RecognitionConfig(
                                    encoding=pb.MULAW, sample_rate_hertz=8000
                                ),
                                voice_activity=pb.VoiceActivityConfig(enabled=True, threshold=3),
                            ),
                            b"",
                            1,
                        )
                    )
                )
            metrics = (await c.get("/metrics")).text
            return vad, interim, no_config, container, bad_vad, metrics

    vad, interim, no_config, container, bad_vad, metrics = kit.run(go())
    events = [
        (r.speech_event_type, round(r.speech_event_time, 1)) for r in vad if r.speech_event_type
    ]
    assert [e[0] for e in events] == [
        pb.SPEECH_ACTIVITY_BEGIN,
        pb.SPEECH_ACTIVITY_END,
        pb.SPEECH_ACTIVITY_BEGIN,
        pb.SPEECH_ACTIVITY_END,
    ]
    finals = [r.result for r in vad if r.HasField("result") and r.result.is_final]
    assert [f.utterance_index for f in finals] == [0, 1]
    assert not [r for r in vad if r.HasField("result") and not r.result.is_final]  # not asked
    # clip 1 is at 0.5-2.5 s, clip 2 at 4.0-6.7 s (its speech starts ~0.6 s in); stream times
    assert 0.1 <= finals[0].start <= 0.6 and 2.0 <= finals[0].end <= 2.9
    assert 3.5 <= finals[1].start <= 4.7 and 6.0 <= finals[1].end <= 7.1
    for f in finals:
        dur = float(f.text.split()[-1])
        assert dur == pytest.approx(f.end - f.start, abs=0.011)
        assert f.segments[0].start == pytest.approx(f.start)
        assert f.segments[-1].end == pytest.approx(f.end, abs=0.011)
        assert f.words[0].start == pytest.approx(f.start) and f.language == "en"
    # no VAD: interim hypotheses while the audio grows, one final at the end of the stream
    results = [r.result for r in interim]
    assert results[-1].is_final and results[-1].text == "hello world 3.00"
    partials = results[:-1]
    assert len(partials) >= 2 and not any(p.is_final for p in partials)
    assert all(p.text.startswith("hello world") for p in partials)
    assert partials[-1].stable_text == "hello world"
    assert no_config[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert no_config[1]["oasr-error-param"] == "streaming_config"
    assert container[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert container[1]["oasr-error-param"] == "encoding"
    assert bad_vad[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert 'route="/oasr.speech.v1.Speech/StreamingRecognize",status="OK"} 2.0' in metrics
    assert 'oasr_streams_total{api="grpc",outcome="closed"} 2.0' in metrics
    assert 'oasr_streams_active{api="grpc"} 0.0' in metrics


def test_streaming_limit_and_auth(kit, app_factory) -> None:
    app, model = app_factory(grpc_bind="127.0.0.1:0", max_streams=1, api_key="k")
    meta = (("authorization", "Bearer k"),)
    config = pb.StreamingRecognitionConfig(
        config=pb.RecognitionConfig(encoding=pb.PCM_S16LE, sample_rate_hertz=16000)
    )
    second_second = _pcm(np.zeros(16000, np.float32))

    async def go():
        async with kit.serving(app):
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{app.state.grpc_server.oasr_port}"
            ) as channel:
                stub = speech_pb2_grpc.SpeechStub(channel)
                unauth = await _error(stub.StreamingRecognize(_requests(config, b"", 1)))
                hold = asyncio.Event()

                async def slow():
                    yield pb.StreamingRecognizeRequest(streaming_config=config)
                    yield pb.StreamingRecognizeRequest(audio_content=second_second)
                    await hold.wait()

                first = stub.StreamingRecognize(slow(), metadata=meta)
                while app.state.oasr.streams < 1:
                    await asyncio.sleep(0.01)
                refused = await _error(
                    stub.StreamingRecognize(_requests(config, b"", 1), metadata=meta)
                )
                hold.set()
                answers = await _collect(first)
                again = await _collect(
                    stub.StreamingRecognize(_requests(config, second_second, 3200), metadata=meta)
                )
                return unauth, refused, answers, again

    unauth, refused, answers, again = kit.run(go())
    assert unauth[0] == grpc.StatusCode.UNAUTHENTICATED
    # one "busy" answer for every limit: a full --max-streams is a full queue (UNAVAILABLE, retry)
    assert refused[0] == grpc.StatusCode.UNAVAILABLE
    assert refused[1]["oasr-error-code"] == "overloaded"
    assert int(refused[1]["retry-after"]) >= 1
    assert [r.result.text for r in answers] == ["hello world 1.00"]
    assert [r.result.text for r in again] == ["hello world 1.00"]
