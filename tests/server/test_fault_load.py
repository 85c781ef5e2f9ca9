"""Load with faults and graceful shutdown, against a real ``oasr-server`` process.

The served model is a test plugin written below (``fault_slow``): its text is the input's
duration, so every answer can be matched to the request that asked, and it sleeps a configurable
time per batch, so requests are really in flight when clients misbehave or SIGTERM arrives."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

PLUGIN = """
import json, time
from pathlib import Path
from oasr import hookimpl
from oasr.types import (DecodeFamily, FeatureSpec, ModelCapabilities, Segment, Transcript)

CAPS = ModelCapabilities(decode_family=DecodeFamily.CTC, offline=True, streaming=False)


class SlowModel:
    capabilities = CAPS

    def __init__(self, delay_s):
        self.name = "fault_slow"
        self.delay_s = delay_s
        self.feature_spec = FeatureSpec(kind="none", sample_rate=16000)

    def transcribe(self, audios, options, progress=None):
        time.sleep(self.delay_s)
        out = []
        for audio in audios:
            dur = len(audio) / 16000
            text = f"{dur:.2f}"
            out.append(Transcript(text=text, language=None, duration=dur,
                                  segments=[Segment(0, 0.0, dur, text)]))
        return out


class SlowFormat:
    @staticmethod
    def detect(path):
        return Path(path, "fault_slow.json").is_file()

    @staticmethod
    def load(path, config):
        return SlowModel(json.loads(Path(path, "fault_slow.json").read_text())["delay_s"])


@hookimpl
def register_architectures(register):
    register("fault_slow", "fault_plugin:SlowModel", capabilities=CAPS,
             source_formats=["fault-slow"], description="test model: sleeps, says the duration")


@hookimpl
def register_checkpoint_formats(register):
    register("fault-slow", "fault_plugin:SlowFormat", architecture="fault_slow")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wav(seconds: float) -> bytes:
    import io
    import wave

    import numpy as np

    n = int(round(seconds * 16000))
    pcm = (0.2 * np.sin(np.arange(n) * 0.07) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


class Server:
    """``oasr-server`` in a subprocess serving the ``fault_slow`` test plugin."""

    def __init__(self, tmp: Path, delay_s: float, *extra: str) -> None:
        site = tmp / "site"
        site.mkdir()
        (site / "fault_plugin.py").write_text(PLUGIN)
        info = site / "oasr_fault_plugin-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: oasr-fault-plugin\nVersion: 0.0.1\n"
        )
        (info / "entry_points.txt").write_text("[oasr]\nfault = fault_plugin\n")
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        (ckpt / "fault_slow.json").write_text(json.dumps({"delay_s": delay_s}))
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OASR_")}
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        # temp files and shared memory the server leaves behind are checked in its own TMPDIR
        self.tmpdir = tmp / "server-tmp"
        self.tmpdir.mkdir()
        env["TMPDIR"] = str(self.tmpdir)
        script = Path(sys.executable).parent / "oasr-server"
        cmd = [str(script)] if script.exists() else [
            sys.executable, "-c", "from oasr_server.cli import main; main()"]  # fmt: skip
        cmd += ["--ckpt-dir", str(ckpt), "--http-bind", f"127.0.0.1:{self.port}", "--device", "cpu",
                "--request-timeout", "60", *extra]  # fmt: skip
        self.shm_before = _shm()
        # the log goes to a file: an undrained pipe fills up and blocks the server's event loop
        self.log_path = tmp / "server.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.1)

    def log_tail(self, lines: int = 60) -> str:
        """The server's log without its 200 access lines: what to read when a request failed."""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join([line for line in text if '" 200 OK' not in line][-lines:])

    def gauges(self) -> dict[str, float]:
        text = httpx.get(f"{self.base}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(
                ("oasr_queue_depth", "oasr_engine_in_flight", "oasr_streams_active")
            ):
                name = line.split("{")[0].split(" ")[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def settle(self) -> None:
        deadline = time.monotonic() + 15
        while any(self.gauges().values()):
            assert time.monotonic() < deadline, self.gauges()
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def leftovers(self) -> list[str]:
        left = [p.name for p in self.tmpdir.iterdir()]
        left += sorted(n for n in _shm() - self.shm_before if n.startswith(("psm_", "oasr")))
        return left


def _shm() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def _multipart(body: bytes) -> tuple[bytes, str]:
    boundary = "faultboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    return (
        head + body + f"\r\n--{boundary}--\r\n".encode(),
        f"multipart/form-data; boundary={boundary}",
    )


async def _rude_client(port: int, audio: bytes, *, mid_upload: bool) -> None:
    """Send a request and hang up: halfway through the body, or right after the whole request
    (before the answer)."""
    body, ctype = _multipart(audio)
    head = (
        f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + (body[: len(body) // 2] if mid_upload else body))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()  # no FIN handshake politeness: a reset, as a crashed client


@pytest.mark.slow  # a real server process under 296 concurrent clients
def test_load_with_faults_loses_nothing(tmp_path: Path) -> None:
    server = Server(tmp_path, 0.02, "--max-queue", "512", "--decode-processes", "1")
    try:
        durations = [round(0.5 + 0.01 * i, 2) for i in range(256)]
        rude = _wav(3.0)

        async def go() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=server.base, timeout=60, limits=limits) as c:
                good = [
                    c.post(
                        "/v1/audio/transcriptions", files={"file": ("a.wav", _wav(d), "audio/wav")}
                    )
                    for d in durations
                ]
                bad = [_rude_client(server.port, rude, mid_upload=i < 20) for i in range(40)]
                results = await asyncio.gather(*good, *bad, return_exceptions=True)
                rude_errors = [r for r in results[len(good) :] if r is not None]
                assert not rude_errors, (rude_errors[:5], server.log_tail())
                return list(results[: len(good)])

        answers = asyncio.run(go())
        # a transport error is a lost request too; report them all, with what the server logged
        failed = [
            (d, a) for d, a in zip(durations, answers, strict=True) if isinstance(a, BaseException)
        ]
        assert not failed, (failed[:5], server.log_tail())
        texts = []
        for r in answers:
            assert r.status_code == 200, r.text
            texts.append(r.json()["text"])
        # every request got its own answer: none lost, wrong or duplicated
        assert texts == [f"{d:.2f}" for d in durations]
        server.settle()
        after = httpx.post(
            f"{server.base}/v1/audio/transcriptions",
            files={"file": ("a.wav", _wav(1.23), "audio/wav")},
        )
        assert after.json()["text"] == "1.23"
    finally:
        code = server.stop()
    assert code == 0
    assert server.leftovers() == []


@pytest.mark.slow  # a real server process, SIGTERM while requests run
def test_sigterm_finishes_requests_in_flight(tmp_path: Path) -> None:
    server = Server(tmp_path, 1.5, "--max-batch-size", "4")
    try:
        durations = [round(1.0 + 0.1 * i, 2) for i in range(16)]

        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base, timeout=60) as c:
                tasks = [
                    asyncio.create_task(
                        c.post(
                            "/v1/audio/transcriptions",
                            files={"file": ("a.wav", _wav(d), "audio/wav")},
                        )
                    )
                    for d in durations
                ]
                # all 16 accepted (queued or running) before the signal
                deadline = time.monotonic() + 20
                while sum((await asyncio.to_thread(server.gauges)).values()) < 16:
                    assert time.monotonic() < deadline, server.gauges()
                    await asyncio.sleep(0.05)
                server.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        answers = asyncio.run(go())
        assert [r.status_code for r in answers] == [200] * 16, [r.text for r in answers]
        assert [r.json()["text"] for r in answers] == [f"{d:.2f}" for d in durations]
        # Orchestrators repeat SIGTERM; one arriving while the drained server tears down must
        # not turn its clean exit into status 143 (a CI run once caught that window).
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.005)
    finally:
        code = server.stop()
    assert code == 0, server.log_path.read_text()[-3000:]
    assert server.leftovers() == []
