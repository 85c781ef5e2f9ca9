"""Issue #26 against a real ``oasr-server`` process: hang-ups, hostile JSON, OpenAI gaps,
origins, buffer and upload bounds. The server serves the ``fault_slow`` test plugin of
``test_fault_load.py`` (its text is the input's duration)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
from pathlib import Path

import httpx
import pytest

_spec = importlib.util.spec_from_file_location(
    "oasr_test_fault_load", Path(__file__).with_name("test_fault_load.py")
)
fault = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fault)  # type: ignore[union-attr]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow  # a real server process
def test_hang_up_mid_upload_is_499_with_one_log_line(tmp_path: Path) -> None:
    server = fault.Server(tmp_path, 0.0)
    try:
        audio = fault._wav(2.0)
        for _ in range(3):
            asyncio.run(fault._rude_client(server.port, audio, mid_upload=True))
        deadline = time.monotonic() + 10
        route = "/v1/audio/transcriptions"
        while True:
            text = httpx.get(f"{server.base}/metrics").text
            if _metric(text, "oasr_requests_total", route=route, status="499") >= 3:
                break
            assert time.monotonic() < deadline, re.findall(r"oasr_requests_total\{.*", text)
            time.sleep(0.1)
        assert _metric(text, "oasr_requests_total", route=route, status="500") == 0
        assert _metric(text, "oasr_errors_total", code="client_closed_request") == 3
    finally:
        code = server.stop()
    log = server.log_path.read_text()
    assert code == 0
    assert "Traceback" not in log, log[-3000:]
    assert len([ln for ln in log.splitlines() if "mid-upload" in ln]) == 3, log[-3000:]


def _ws_events(ws, until: str, timeout: float = 10) -> list[dict]:
    events = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = json.loads(ws.recv(timeout=deadline - time.monotonic()))
        events.append(event)
        if event["type"] == until:
            return events
    raise AssertionError(f"no {until}: {events}")


@pytest.mark.slow  # a real server process
def test_deep_json_is_a_400_and_an_error_event(tmp_path: Path) -> None:
    from websockets.sync.client import connect

    server = fault.Server(tmp_path, 0.0)
    try:
        deep = '{"a": ' * 1000 + "1" + "}" * 1000
        r = httpx.post(
            f"{server.base}/v1/audio/transcriptions",
            files={"file": ("a.wav", fault._wav(1.0), "audio/wav")},
            data={"chunking_strategy": deep},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chunking_strategy"
        assert "nested deeper" in r.json()["error"]["message"]
        with connect(f"ws://127.0.0.1:{server.port}/v1/realtime", open_timeout=10) as ws:
            _ws_events(ws, "session.created")
            for depth in (40, 2000, 100_000):
                ws.send('{"type": "session.update", "session": ' + "[" * depth + "]" * depth + "}")
                (err,) = _ws_events(ws, "error")
                assert err["error"]["code"] == "invalid_json", err
            # the session is still open and answers
            ws.send(json.dumps({"type": "session.update", "session": {}}))
            _ws_events(ws, "session.updated")
        text = httpx.get(f"{server.base}/metrics").text
        assert _metric(text, "oasr_requests_total", status="500") == 0
    finally:
        code = server.stop()
    assert code == 0
    assert "Traceback" not in server.log_path.read_text()
