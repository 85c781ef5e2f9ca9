"""Decoding options beyond OpenAI's fields, on every server surface: extra form fields of the
OpenAI routes, query parameters of /v1/speech:recognize, the gRPC ``model_options`` map and the
realtime session; an option the served model does not understand is a 400 naming it."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import pytest

from oasr.options import ModelOptions, option


@dataclass(frozen=True)
class GreetOptions(ModelOptions):
    family = "greeting"

    greeting: Literal["hello", "hi"] = option("hello", doc="first word")
    loudness: float = option(0.5, ge=0, le=1, doc="how loud")


def _greeting_model(kit):
    class GreetingModel(kit.FakeModel):
        default_options = GreetOptions()

    return GreetingModel()


def _error(resp, code: str, param: str) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")
    return err["message"]


def test_extra_form_fields_are_decoding_options(kit, app_factory) -> None:
    app, model = app_factory(model=_greeting_model(kit))

    async def go():
        async with kit.serving(app) as c:
            ok = await kit.post_audio(c, fields={"greeting": "hi", "loudness": "0.9", "beam_size": "3",
                                                  "max_new_tokens": "7"})  # fmt: skip
            assert ok.status_code == 200, ok.text
            got = model.options[-1]
            assert (got.greeting, got.loudness, got.beam_size, got.max_new_tokens) == (
                "hi",
                0.9,
                3,
                7,
            )
            plain = await kit.post_audio(c, path="/v1/audio/translations")
            assert plain.status_code == 200, plain.text
            assert model.options[-1].greeting == "hello"  # the model's default
            calls = len(model.options)
            msg = _error(
                await kit.post_audio(c, fields={"greting": "hi"}), "unsupported_option", "greting"
            )
            assert "no option 'greting'" in msg and "greeting, loudness" in msg
            _error(
                await kit.post_audio(c, fields={"loudness": "11"}), "invalid_request", "loudness"
            )
            _error(
                await kit.post_audio(c, fields={"greeting": "hey"}), "invalid_request", "greeting"
            )
            _error(
                await kit.post_audio(c, fields={"beam_size": "wide"}),
                "invalid_request",
                "beam_size",
            )
            _error(await kit.post_audio(c, fields={"task": "translate"}), "invalid_request", "task")
            # the family cannot bias: hotwords are refused by it
            _error(await kit.post_audio(c, fields=[("hotwords[]", "OASR"), ("hotwords[]", "WeNet")]),
                   "unsupported_option", "hotwords")  # fmt: skip
            # include[]=logprobs is refused, not silently ignored (no model here returns them)
            _error(await kit.post_audio(c, fields={"include[]": "logprobs"}),
                   "unsupported_option", "include")  # fmt: skip
            _error(await kit.post_audio(c, fields={"include[]": "x"}), "invalid_request", "include")
            # OpenAI fields this server does not offer are still accepted and ignored
            assert (
                await kit.post_audio(c, fields={"known_speaker_names[]": "a"})
            ).status_code == 200
            assert len(model.options) == calls + 1  # refused requests never reached the model

    kit.run(go())


def test_models_lists_the_family_options(kit, app_factory) -> None:
    app, _ = app_factory(model=_greeting_model(kit))

    async def go():
        async with kit.serving(app) as c:
            entry = (await c.get("/v1/models")).json()["data"][0]["oasr"]
            assert entry["model_options"]["loudness"] == {
                "type": "a number",
                "default": 0.5,
                "description": "how loud",
            }
            assert list(entry["model_options"]) == ["greeting", "loudness"]

    kit.run(go())


def test_a_model_without_options_refuses_extra_fields(kit, app_factory) -> None:
    app, _ = app_factory()

    async def go():
        async with kit.serving(app) as c:
            assert (await c.get("/v1/models")).json()["data"][0]["oasr"]["model_options"] == {}
            msg = _error(await kit.post_audio(c, fields={"no_speech_threshold": "none"}),
                         "unsupported_option", "no_speech_threshold")  # fmt: skip
            assert "takes no model options" in msg

    kit.run(go())


def test_recognize_query_options(kit, app_factory) -> None:
    app, model = app_factory(model=_greeting_model(kit))

    async def go():
        async with kit.serving(app) as c:
            r = await c.post(
                "/v1/speech:recognize?greeting=hi&beam_size=2", content=kit.wav_bytes()
            )
            assert r.status_code == 200, r.text
            assert (model.options[-1].greeting, model.options[-1].beam_size) == ("hi", 2)
            r = await c.post("/v1/speech:recognize?shout=1", content=kit.wav_bytes())
            _error(r, "unsupported_option", "shout")

    kit.run(go())


def test_grpc_model_options_map(kit, app_factory) -> None:
    grpc = pytest.importorskip("grpc")
    from oasr_server.grpc_api import speech_pb2, speech_pb2_grpc

    app, model = app_factory(model=_greeting_model(kit), grpc_bind="127.0.0.1:0")

    async def go():
        async with kit.serving(app):
            port = app.state.grpc_server.oasr_port
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                speech = speech_pb2_grpc.SpeechStub(channel)
                cfg = speech_pb2.RecognitionConfig(
                    model_options={"greeting": "hi", "max_new_tokens": "5"}
                )
                await speech.Recognize(
                    speech_pb2.RecognizeRequest(config=cfg, audio=kit.wav_bytes())
                )
                assert (model.options[-1].greeting, model.options[-1].max_new_tokens) == ("hi", 5)
                bad = speech_pb2.RecognitionConfig(model_options={"loudness": "loud"})
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await speech.Recognize(
                        speech_pb2.RecognizeRequest(config=bad, audio=kit.wav_bytes())
                    )
                err = info.value
                meta = dict(err.trailing_metadata() or ())
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert meta["oasr-error-param"] == "loudness" and "loudness" in err.details()

    kit.run(go())


def test_realtime_session_model_options(kit) -> None:
    from oasr.errors import UnsupportedOptionError
    from oasr_server.realtime import SessionConfig, apply_update, session_options

    engine = kit.make_engine(_greeting_model(kit))
    state = SimpleNamespace(
        engine=engine, config=SimpleNamespace(served_model_name="fake", model_aliases=())
    )
    cfg = apply_update(
        state,
        SessionConfig("fake"),
        {"input_audio_transcription": {"language": "en", "model_options": {"greeting": "hi"}}},
    )
    opts = session_options(cfg)
    assert (
        opts.model_options == {"greeting": "hi"}
        and opts.validate_for(engine.model).greeting == "hi"
    )
    assert cfg.to_json("s")["input_audio_transcription"]["model_options"] == {
        "greeting": "hi"
    }
    with pytest.raises(UnsupportedOptionError) as info:
        apply_update(state, cfg, {"input_audio_transcription": {"model_options": {"volume": 1}}})
    assert info.value.param == "volume"


def test_client_sends_options_as_form_fields() -> None:
    from oasr.client import OASRClient

    fields = OASRClient._option_fields(
        {"no_speech_threshold": None, "vad_gate": False, "beam_size": 5, "hotwords": ["a, b", "c"]}
    )
    assert fields == [("no_speech_threshold", "none"), ("vad_gate", "false"), ("beam_size", "5"),
                      ("hotwords", '["a, b", "c"]')]  # fmt: skip
