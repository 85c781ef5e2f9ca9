"""Uploads decoded in worker processes (``decode_processes``): same answers and errors as
decoding in threads, the pool lives exactly as long as the app, and a bad upload leaves the
server serving."""

from __future__ import annotations

from typing import Any

import pytest


def test_uploads_decoded_in_processes(app_factory: Any, kit: Any) -> None:
    app, model = app_factory(decode_processes=1)

    async def main() -> None:
        async with kit.serving(app) as client:
            state = app.state.oasr
            assert state.decode_pool is not None and state.decode_pool.processes == 1
            ok = await kit.post_audio(client, audio=kit.wav_bytes(1.5))
            assert ok.status_code == 200 and ok.json()["text"] == "hello world 1.50"
            bad = await kit.post_audio(client, audio=b"RIFF\x00\x00\x00\x00WAVEnonsense" * 8)
            assert bad.status_code == 400
            err = bad.json()["error"]
            assert err["code"] == "bad_audio" and err["type"] == "invalid_request_error"
            assert "Traceback" not in err["message"]
            again = await kit.post_audio(client, audio=kit.wav_bytes(0.5))
            assert again.status_code == 200 and again.json()["text"] == "hello world 0.50"
            raw = await client.post(
                "/v1/speech:recognize?encoding=pcm_s16le&sample_rate=16000",
                content=b"\x00\x01" * 8000,
            )
            assert raw.status_code == 200, raw.text
        assert app.state.oasr.decode_pool is None  # shut down with the app

    kit.run(main())


def test_too_long_upload_refused_from_a_decode_process(app_factory: Any, kit: Any) -> None:
    app, _ = app_factory(decode_processes=1, max_audio_seconds=1.0)

    async def main() -> None:
        async with kit.serving(app) as client:
            r = await kit.post_audio(client, audio=kit.wav_bytes(3.0))
            assert r.status_code == 413 and r.json()["error"]["code"] == "audio_too_long"

    kit.run(main())


def test_zero_processes_decodes_in_threads(app_factory: Any, kit: Any) -> None:
    app, _ = app_factory(decode_processes=0)

    async def main() -> None:
        async with kit.serving(app) as client:
            assert app.state.oasr.decode_pool is None
            r = await kit.post_audio(client)
            assert r.status_code == 200 and r.json()["text"] == "hello world 1.00"

    kit.run(main())


def test_config_and_flag() -> None:
    from typer.testing import CliRunner

    from oasr.errors import InvalidRequestError
    from oasr_server.cli import app
    from oasr_server.config import ServerConfig

    with pytest.raises(InvalidRequestError):
        ServerConfig(decode_processes=-1)
    assert (
        "--decode-processes" in CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    )
    assert CliRunner().invoke(app, ["--decode-processes", "-1"]).exit_code == 2
