"""Issue #26 item 10: the realtime server events are named and shaped as the current Realtime API
(GA) names them for a transcription session, so the ``openai`` SDK parses each one into its own
model: every event of a session (created, updated, VAD, committed, item, deltas, completed,
cleared, error) is checked against the SDK's own parser (what ``conn.recv()`` runs) and strictly
validated with its pydantic models. The beta client event names are still accepted."""

from __future__ import annotations

from typing import Any

import pytest

from tests.server import test_realtime
from tests.server.test_realtime import append, pcm16, receive_until, two_utterances

openai = pytest.importorskip("openai")
pytest.importorskip("openai.types.realtime")

#: our event type -> the SDK's model for it
EXPECTED = {
    "session.created": "SessionCreatedEvent",
    "session.updated": "SessionUpdatedEvent",
    "input_audio_buffer.speech_started": "InputAudioBufferSpeechStartedEvent",
    "input_audio_buffer.speech_stopped": "InputAudioBufferSpeechStoppedEvent",
    "input_audio_buffer.committed": "InputAudioBufferCommittedEvent",
    "input_audio_buffer.cleared": "InputAudioBufferClearedEvent",
    "conversation.item.created": "ConversationItemCreatedEvent",
    "conversation.item.input_audio_transcription.delta": "ConversationItemInputAudioTranscriptionDeltaEvent",
    "conversation.item.input_audio_transcription.completed": "ConversationItemInputAudioTranscriptionCompletedEvent",
    "conversation.item.input_audio_transcription.failed": "ConversationItemInputAudioTranscriptionFailedEvent",
    "error": "RealtimeErrorEvent",
}


client_for = test_realtime.client_for  # the fixture


def check(event: dict[str, Any]) -> Any:
    """Parse ``event`` as the SDK does and validate it strictly; returns the parsed model."""
    import pydantic
    from openai._models import construct_type_unchecked
    from openai.types.realtime import RealtimeServerEvent

    parsed = construct_type_unchecked(value=event, type_=RealtimeServerEvent)
    assert type(parsed).__name__ == EXPECTED[event["type"]], (event["type"], type(parsed))
    strict = pydantic.TypeAdapter(RealtimeServerEvent).validate_python(event)
    assert type(strict).__name__ == EXPECTED[event["type"]]
    return strict


def test_every_event_parses_as_its_sdk_model(client_for) -> None:
    from openai.types.realtime import RealtimeTranscriptionSessionCreateRequest

    client, _, _ = client_for(partial_interval_ms=500)
    with client.websocket_connect("/v1/realtime?intent=transcription") as ws:
        created = check(ws.receive_json())
        assert isinstance(created.session, RealtimeTranscriptionSessionCreateRequest)
        assert created.session.audio.input.format.type == "audio/pcm"
        assert created.session.audio.input.format.rate == 24000
        assert created.session.audio.input.turn_detection.type == "server_vad"
        # the GA update (what the SDK sends) and the beta one are both answered session.updated
        ws.send_json(
            {
                "type": "session.update",
                "session": {
                    "type": "transcription",
                    "audio": {
                        "input": {"transcription": {"model": "gpt-4o-transcribe", "language": "en"}}
                    },
                },
            }
        )
        updated = check(ws.receive_json())
        assert updated.session.audio.input.transcription.language == "en"
        ws.send_json(
            {
                "type": "transcription_session.update",
                "session": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 400}},
            }
        )
        updated = check(ws.receive_json())
        assert updated.session.audio.input.turn_detection.silence_duration_ms == 400
        append(ws, pcm16(two_utterances(24000)), 9600)
        events = receive_until(ws, "conversation.item.input_audio_transcription.completed", 2)
        ws.send_json({"type": "no.such.event"})  # answered at once
        ws.send_json({"type": "input_audio_buffer.clear"})  # queued behind the audio
        events += receive_until(ws, "input_audio_buffer.cleared")
    kinds = [e["type"] for e in events]
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "conversation.item.created",
                 "conversation.item.input_audio_transcription.delta",
                 "input_audio_buffer.cleared", "error"):  # fmt: skip
        assert kind in kinds, (kind, kinds)
    for event in events:
        parsed = check(event)
        if event["type"].endswith(".completed"):
            assert parsed.usage.type == "duration" and parsed.transcript


def test_failed_turn_parses(client_for, kit) -> None:
    """``...input_audio_transcription.failed`` (the model raised on the turn: 1.5 s of audio)."""
    client, _, _ = client_for(model=kit.FakeModel(fail_seconds=1.5), partial_interval_ms=0)
    with client.websocket_connect("/v1/realtime") as ws:
        check(ws.receive_json())
        ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
        check(ws.receive_json())
        append(ws, pcm16(two_utterances(24000)[:36000] + 0.1), 9600)
        ws.send_json({"type": "input_audio_buffer.commit"})
        events = receive_until(ws, "conversation.item.input_audio_transcription.failed")
    for event in events:
        check(event)
