"""gRPC ``oasr.speech.v1.Speech/Recognize``, health and reflection, beside the HTTP app."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from oasr_server.grpc_api import speech_pb2, speech_pb2_grpc  # noqa: E402


def _channel(app):
    return grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_server.oasr_port}")


async def _code(call) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        meta = {k: v for k, v in (err.trailing_metadata() or ())}
        return err.code(), err.details(), meta
    raise AssertionError("the call did not fail")


def test_recognize_health_reflection(kit, app_factory) -> None:
    app, model = app_factory(grpc_bind="127.0.0.1:0", max_upload_bytes=200_000)
    rate = 8000
    pcm = (0.2 * np.sin(2 * np.pi * 300 * np.arange(rate) / rate) * 32767).astype("<i2").tobytes()

    async def go():
        async with kit.serving(app) as c:
            async with _channel(app) as channel:
                speech = speech_pb2_grpc.SpeechStub(channel)
                ok = await speech.Recognize(
                    speech_pb2.RecognizeRequest(
                        config=speech_pb2.RecognitionConfig(language="fr", word_timestamps=True),
                        audio=kit.wav_bytes(1.0),
                    )
                )
                raw = await speech.Recognize(
                    speech_pb2.RecognizeRequest(
                        config=speech_pb2.RecognitionConfig(
                            encoding=speech_pb2.PCM_S16LE,
                            sample_rate_hertz=rate,
                            task=speech_pb2.TRANSLATE,
                        ),
                        audio=pcm,
                    )
                )
                bad = await _code(
                    speech.Recognize(speech_pb2.RecognizeRequest(audio=b"not audio" * 20))
                )
                no_rate = await _code(
                    speech.Recognize(
                        speech_pb2.RecognizeRequest(
                            config=speech_pb2.RecognitionConfig(encoding=speech_pb2.PCM_S16LE),
                            audio=pcm,
                        )
                    )
                )
                model_404 = await _code(
                    speech.Recognize(
                        speech_pb2.RecognizeRequest(
                            config=speech_pb2.RecognitionConfig(model="nope"), audio=pcm
                        )
                    )
                )
                too_big = await _code(
                    speech.Recognize(speech_pb2.RecognizeRequest(audio=b"\0" * 300_000))
                )
                health = health_pb2_grpc.HealthStub(channel)
                served = await health.Check(
                    health_pb2.HealthCheckRequest(service="oasr.speech.v1.Speech")
                )
                overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
                refl = reflection_pb2_grpc.ServerReflectionStub(channel)
                names = []
                async for resp in refl.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                ):
                    names = [s.name for s in resp.list_services_response.service]
            metrics = (await c.get("/metrics")).text
            return ok, raw, bad, no_rate, model_404, too_big, served, overall, names, metrics

    ok, raw, bad, no_rate, model_404, too_big, served, overall, names, metrics = kit.run(go())
    assert ok.text == "hello world 1.00" and ok.language == "fr" and ok.model == "fake"
    assert len(ok.segments) == 2 and [w.word for w in ok.words] == [" hello", " world"]
    assert ok.duration == pytest.approx(1.0)
    assert raw.text == "translated words 1.00" and raw.task == "translate"
    assert bad[0] == grpc.StatusCode.INVALID_ARGUMENT and bad[2]["oasr-error-code"] == "bad_audio"
    assert no_rate[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert no_rate[2]["oasr-error-param"] == "sample_rate_hertz"
    assert model_404[0] == grpc.StatusCode.NOT_FOUND
    assert too_big[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert served.status == overall.status == health_pb2.HealthCheckResponse.SERVING
    assert {"oasr.speech.v1.Speech", "grpc.health.v1.Health"} <= set(names)
    assert 'route="/oasr.speech.v1.Speech/Recognize",status="OK"} 2.0' in metrics
    assert 'route="/oasr.speech.v1.Speech/Recognize",status="INVALID_ARGUMENT"} 2.0' in metrics


def test_grpc_errors_auth_unsupported_overload_not_ready(kit, app_factory) -> None:
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    release = threading.Event()
    gate = threading.Event()
    model = kit.FakeModel(translation=False)

    def factory():
        assert release.wait(10)
        return kit.make_engine(model)

    app = create_app(
        ServerConfig(grpc_bind="127.0.0.1:0", api_key="k", max_queue=1), engine_factory=factory
    )
    meta = (("authorization", "Bearer k"),)
    req = speech_pb2.RecognizeRequest(audio=kit.wav_bytes(0.5))

    async def go():
        async with kit.serving(app, wait_ready=False):
            async with _channel(app) as channel:
                speech = speech_pb2_grpc.SpeechStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                before = await health.Check(health_pb2.HealthCheckRequest(service=""))
                loading = await _code(speech.Recognize(req, metadata=meta))
                release.set()
                await asyncio.to_thread(app.state.oasr.wait_loaded, 10)
                await asyncio.sleep(0.1)
                after = await health.Check(health_pb2.HealthCheckRequest(service=""))
                unauth = await _code(speech.Recognize(req))
                wrong = await _code(
                    speech.Recognize(req, metadata=(("authorization", "Bearer x"),))
                )
                unsupported = await _code(
                    speech.Recognize(
                        speech_pb2.RecognizeRequest(
                            config=speech_pb2.RecognitionConfig(task=speech_pb2.TRANSLATE),
                            audio=kit.wav_bytes(0.5),
                        ),
                        metadata=meta,
                    )
                )
                # hold the engine, fill the one-slot queue, then one more is refused
                model.gate = gate
                model.calls_started = threading.Semaphore(0)
                first = asyncio.ensure_future(speech.Recognize(req, metadata=meta))
                assert await asyncio.to_thread(model.calls_started.acquire, True, 10)
                second = asyncio.ensure_future(speech.Recognize(req, metadata=meta))
                while app.state.oasr.worker.depth < 1:
                    await asyncio.sleep(0.01)
                full = await _code(speech.Recognize(req, metadata=meta))
                gate.set()
                answers = await asyncio.gather(first, second)
                return before, loading, after, unauth, wrong, unsupported, full, answers

    before, loading, after, unauth, wrong, unsupported, full, answers = kit.run(go())
    assert before.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert (
        loading[0] == grpc.StatusCode.UNAVAILABLE
        and loading[2]["oasr-error-code"] == "model_not_ready"
    )
    assert after.status == health_pb2.HealthCheckResponse.SERVING
    assert unauth[0] == wrong[0] == grpc.StatusCode.UNAUTHENTICATED
    assert unsupported[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        unsupported[2]["oasr-error-code"] == "unsupported_option" and "translate" in unsupported[1]
    )
    assert full[0] == grpc.StatusCode.UNAVAILABLE and full[2]["oasr-error-code"] == "overloaded"
    assert full[2]["retry-after"] == "1"  # as HTTP's Retry-After
    assert [a.text for a in answers] == ["hello world 0.50"] * 2


def test_error_metadata_stays_valid_for_any_option_name(kit, app_factory) -> None:
    """An option name with control characters or emoji comes back in ``oasr-error-param``
    percent-encoded: raw, grpc would refuse the whole reply as INTERNAL "Invalid metadata"."""
    app, _ = app_factory(grpc_bind="127.0.0.1:0")

    async def go():
        async with kit.serving(app):
            async with _channel(app) as channel:
                speech = speech_pb2_grpc.SpeechStub(channel)
                return await _code(
                    speech.Recognize(
                        speech_pb2.RecognizeRequest(
                            config=speech_pb2.RecognitionConfig(
                                model_options={"\x00\x01\U0001f600": "1"}
                            ),
                            audio=kit.wav_bytes(1.0),
                        )
                    )
                )

    code, _, meta = kit.run(go())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert meta["oasr-error-param"] == "%00%01%F0%9F%98%80"
