"""``session.update`` with values of the wrong JSON type in every field gets an ``error`` event
naming the field, and the session stays open and usable (a list where a format name belongs used
to raise TypeError inside the server and end the session without a close frame)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

JUNK = [[], ["pcm16"], {}, {"type": ["audio/pcm"]}, {"type": "audio/pcm", "rate": [24000]},
        {"type": "audio/pcm", "rate": True}, 5, 1.5, True, None, "x" * 300]  # fmt: skip
FIELDS = ["input_audio_format", "turn_detection", "input_audio_transcription", "language",
          "include", "input_audio_noise_reduction"]  # fmt: skip


@pytest.mark.parametrize("field", FIELDS)
def test_junk_session_values_are_refused_and_the_session_stays(app_factory, field) -> None:
    app, _ = app_factory()
    with TestClient(app) as client:
        assert app.state.oasr.wait_loaded(10)
        with client.websocket_connect("/v1/realtime") as ws:
            assert ws.receive_json()["type"] == "session.created"
            for value in JUNK:
                ws.send_text(json.dumps({"type": "session.update", "session": {field: value}}))
                event = ws.receive_json()
                assert event["type"] in ("error", "session.updated"), event
                if event["type"] == "error":
                    assert event["error"]["message"] and event["error"]["code"], event
            # still a working session
            ws.send_text(
                json.dumps({"type": "session.update", "session": {"turn_detection": None}})
            )
            assert ws.receive_json()["type"] == "session.updated"
