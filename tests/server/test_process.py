"""The real ``oasr-server`` process on a free port, over real HTTP, with the example plugin."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command() -> list[str]:
    script = Path(sys.executable).parent / "oasr-server"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from oasr_server.cli import main; main()"]


def _env(paths: list[Path]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OASR_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in paths] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


def _speech_wav(kit) -> bytes:
    import io
    import wave

    t = np.arange(16000) / 16000
    audio = np.concatenate([np.zeros(8000), 0.5 * np.sin(2 * np.pi * 440 * t), np.zeros(8000)])
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((audio * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _realtime(port: int) -> None:
    import base64

    from websockets.sync.client import connect

    from oasr.audio import load_audio

    speech = load_audio(
        str(Path(__file__).resolve().parents[1] / "data/speech/en_ls_2830-3980-0043.wav"), 24000
    )
    audio = np.concatenate([np.zeros(12000, np.float32), speech, np.zeros(24000, np.float32)])
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    with connect(
        f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription",
        subprotocols=["realtime", "openai-insecure-api-key.k3y"],
        open_timeout=10,
    ) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        for i in range(0, len(pcm), 9600):
            chunk = base64.b64encode(pcm[i : i + 9600]).decode()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        kinds = []
        while not kinds or kinds[-1]["type"] != (
            "conversation.item.input_audio_transcription.completed"
        ):
            kinds.append(json.loads(ws.recv(timeout=20)))
    types = [e["type"] for e in kinds if not e["type"].endswith(".delta")]
    assert types == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.created",
        "conversation.item.input_audio_transcription.completed",
    ], types
    assert kinds[-1]["transcript"].startswith("[speech]")  # one per energy segment


@pytest.mark.slow  # a real server process, every route over sockets
def test_real_server_process(kit, example_installed: Path, example_ckpt: Path) -> None:
    port, grpc_port = _free_port(), _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            *_command(),
            "--ckpt-dir",
            str(example_ckpt),
            "--http-bind",
            f"127.0.0.1:{port}",
            "--api-key",
            "k3y",
            "--max-queue",
            "8",
            "--request-timeout",
            "30",
            "--max-upload-bytes",
            "1000000",
            "--max-audio-seconds",
            "60",
            "--device",
            "cpu",
            "--served-model-name",
            "energy",
            "--grpc-bind",
            f"127.0.0.1:{grpc_port}",
            # uploads decoded in a worker process (forkserver) of the real server process
            "--decode-processes",
            "1",
        ],
        env=_env([kit.EXAMPLE / "src", example_installed]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    auth = {"Authorization": "Bearer k3y"}
    try:
        with httpx.Client(base_url=base, timeout=10) as c:
            deadline = time.monotonic() + 40
            while True:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                try:
                    if c.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "server never became ready"
                time.sleep(0.1)
            assert c.get("/healthz").json() == {"status": "ok"}
            wav = _speech_wav(kit)
            files = {"file": ("speech.wav", wav, "audio/wav")}
            r = c.post(
                "/v1/audio/transcriptions", files=files, data={"model": "energy"}, headers=auth
            )
            assert r.status_code == 200, r.text
            assert r.json()["text"] == "[speech]"
            if sys.platform.startswith("linux"):  # the decode pool's forkserver is a child
                tasks = Path(f"/proc/{proc.pid}/task").glob("*/children")
                kids = [pid for t in tasks for pid in t.read_text().split()]
                assert kids, "no decode worker process was started"
            by_ckpt = c.post(
                "/v1/audio/transcriptions",
                files=files,
                data={"model": str(example_ckpt)},
                headers=auth,
            )
            assert by_ckpt.status_code == 200, by_ckpt.text
            denied = c.post("/v1/audio/transcriptions", files=files)
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            # SSE over a real socket
            with c.stream(
                "POST",
                "/v1/audio/transcriptions",
                files=files,
                data={"stream": "true"},
                headers=auth,
            ) as s:
                assert s.status_code == 200
                assert s.headers["content-type"].startswith("text/event-stream")
                events = [
                    json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")
                ]
            assert events[-1] == {
                "type": "transcript.text.done",
                "text": "[speech]",
                "usage": {"type": "duration", "seconds": 2.0},
            }
            rec = c.post("/v1/speech:recognize", content=wav, headers=auth)
            assert rec.status_code == 200 and rec.json()["segments"][0]["text"] == "[speech]"
            models = c.get("/v1/models", headers=auth).json()
            assert models["data"][0]["id"] == "energy"
            assert models["data"][0]["oasr"]["name"] == "example_energy"
            # gRPC on the same process and engine
            import grpc

            from oasr_server.grpc_api import speech_pb2, speech_pb2_grpc

            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                reply = speech_pb2_grpc.SpeechStub(channel).Recognize(
                    speech_pb2.RecognizeRequest(audio=wav),
                    metadata=(("authorization", "Bearer k3y"),),
                    timeout=10,
                )
            assert reply.text == "[speech]" and reply.model == "energy"
            # the realtime WebSocket over a real socket (uvicorn + websockets): server VAD on
            # real speech, the key sent as OpenAI's browser subprotocol
            _realtime(port)
            metrics = c.get("/metrics", headers=auth).text
            assert (
                'oasr_requests_total{method="POST",route="/v1/audio/transcriptions",status="200"} 3.0'
                in metrics
            )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    # uvicorn shuts down gracefully, then re-raises the signal (exit status 130 for SIGINT)
    assert proc.returncode in (0, 130, -signal.SIGINT), out
    assert "Application shutdown complete" in out


def test_real_server_exits_when_the_model_cannot_load(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *_command(),
            "--ckpt-dir",
            str(tmp_path / "missing"),
            "--http-bind",
            f"127.0.0.1:{_free_port()}",
        ],
        env=_env([]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "the model failed to load" in proc.stderr and "missing" in proc.stderr


def test_oasr_serve_is_registered() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from oasr.cli.main import main; main(['serve', '--help'])"],
        env={**_env([]), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for option in (
        "--ckpt-dir",
        "--http-bind",
        "--max-upload-bytes",
        "--max-audio-seconds",
        "--max-queue",
        "--request-timeout",
        "--api-key",
        "--device",
        "--max-streams",
        "--partial-interval-ms",
    ):
        assert option in proc.stdout
    plugins = subprocess.run(
        [sys.executable, "-c", "from oasr.cli.main import main; main(['plugins', '--json'])"],
        env=_env([]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    server = next(
        p for p in json.loads(plugins.stdout)["plugins"] if p["distribution"] == "oasr-server"
    )
    assert server["hooks"] == ["register_commands"]
