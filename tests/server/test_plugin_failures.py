"""A broken third-party plugin next to the one the server needs: the server logs one warning
naming it and serves."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest


def test_server_warns_about_a_broken_plugin_and_serves(
    kit, example_installed: Path, example_ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from oasr.plugins import temporary_plugin
    from oasr.types import EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    async def scenario() -> None:
        app = create_app(
            ServerConfig(served_model_name="example", decode_processes=0, warmup=False),
            engine_config=EngineConfig(ckpt_dir=str(example_ckpt)),
        )
        async with kit.serving(app) as client:
            response = await kit.post_audio(client, fields={"response_format": "json"})
            assert response.status_code == 200, response.text
            assert response.json()["text"] == "[speech]"

    # an installed plugin whose hook module does not import (registered in memory)
    with (
        caplog.at_level(logging.WARNING),
        temporary_plugin("oasr_broken_for_server.plugin", name="oasr-broken"),
    ):
        kit.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "oasr-broken" in w]) == 1, warnings
    assert any(
        "ModuleNotFoundError" in w and "OASR_DISABLE_PLUGINS=oasr-broken" in w for w in warnings
    )
