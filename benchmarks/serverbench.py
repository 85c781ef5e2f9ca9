"""Bounded load test of the real ``oasr-server`` process, beside the in-process engine.

    python -m benchmarks.asrbench --backend oasr_server                    # 64 uploads, c=16
    python -m benchmarks.asrbench --backend oasr_server --profile smoke    # 8 uploads, c=4
    python -m benchmarks.serverbench --requests 64 --concurrency 16 --streams 2 --json out.json

1. The in-process engine (``ASREngine.submit``, the same continuous-batching scheduler the server
   uses) transcribes the same list of requests (the English clips of ``tests/data/speech``,
   repeated to ``--requests``), all submitted at once: its wall time and texts are the reference.
2. ``oasr-server`` starts as a separate process on a free loopback port with the same checkpoint
   (default ``oasr.defaults.default_checkpoint()``, Whisper tiny.en) and thread count.
3. ``--requests`` multipart uploads go to ``/v1/audio/transcriptions`` at ``--concurrency`` at a
   time, while ``--streams`` realtime WebSockets each stream one clip (pcm16, 24 kHz, as fast as
   the socket takes it) and wait for the turn's transcript.
4. Checks: every upload answered 200 exactly once (client side and the server's
   ``oasr_requests`` counter), every text equal to the engine's text for that file, every stream
   completed with a non-empty transcript, no stream slot or queue entry left over (``/metrics``).

Reported: client latency p50/p99, server throughput (RTFx: audio seconds per wall second), the
engine's RTFx on the same work and their ratio (server / engine). The engine is also timed on
audio decoded before its clock starts, the model's own throughput, and the server is compared
with that too: the server may decode uploads in parallel worker processes (``--decode-processes``)
while the in-process engine's caller decodes one file after another.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEECH = REPO / "tests" / "data" / "speech"
STREAM_CLIP = SPEECH / "en_ls_2830-3980-0043.wav"


@dataclass
class Report:
    requests: int
    concurrency: int
    streams: int
    threads: int
    device: str
    audio_s: float
    engine_wall_s: float
    engine_rtfx: float
    server_wall_s: float
    server_rtfx: float
    ratio: float
    latency_p50_s: float
    latency_p99_s: float
    mixed_wall_s: float = 0.0
    #: the engine on audio decoded before the clock starts (no decoding timed)
    engine_arrays_wall_s: float = 0.0
    engine_arrays_rtfx: float = 0.0
    ratio_vs_arrays: float = 0.0
    #: the server's --decode-processes (None: its default)
    decode_processes: int | None = None
    stream_latency_s: list[float] = field(default_factory=list)
    stream_texts: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    server_counted: int = 0
    leftover: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def english_files(exclude: tuple[str, ...] = (".m4a",)) -> list[Path]:
    rows = [json.loads(x) for x in (SPEECH / "manifest.jsonl").read_text().splitlines() if x]
    return [SPEECH / r["audio"] for r in rows if r["language"] == "en" and not r["audio"].endswith(exclude)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    if not xs:
        return 0.0
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def engine_reference(ckpt: str, device: str, threads: int, work: list[Path]) -> tuple[dict[Path, str], float, float, float]:
    """Texts per file, wall seconds of the in-process engine on ``work`` (all submitted at once,
    each file decoded by the caller), its audio seconds, and the wall seconds of the same work on
    audio decoded beforehand (the model's own throughput, no decoding in the timed part)."""
    import torch

    torch.set_num_threads(threads)
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    engine = ASREngine(EngineConfig(ckpt_dir=ckpt, device=device, num_threads=threads))
    try:
        waves = {p: engine.load_audio(str(p)) for p in set(work)}
        # warm-up: the whole work once, untimed, as the server gets it (CUDA graphs are captured
        # per batch size the first time each size runs)
        for f in [engine.submit(waves[p]) for p in work]:
            f.result()
        start = time.perf_counter()
        # the server decodes each upload too: decode here as well, so both sides do the same work
        futures = [engine.submit(str(p)) for p in work]
        texts = [f.result().text for f in futures]
        wall = time.perf_counter() - start
        start = time.perf_counter()
        array_texts = [f.result().text for f in [engine.submit(waves[p]) for p in work]]
        arrays_wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    ref: dict[Path, str] = {}
    for p, t in zip(work + work, texts + array_texts, strict=True):
        if ref.setdefault(p, t) != t:
            raise AssertionError(f"the engine gave two texts for {p.name}: {ref[p]!r} / {t!r}")
    audio_s = sum(waves[p].shape[-1] for p in work) / engine.sample_rate
    return ref, wall, audio_s, arrays_wall


def start_server(
    ckpt: str, device: str, threads: int, port: int, concurrency: int, queue: int,
    decode_processes: int | None = None,
) -> subprocess.Popen:  # fmt: skip
    cmd = [
        sys.executable, "-c", "from oasr_server.cli import main; main()",
        "--ckpt-dir", ckpt, "--device", device, "--threads", str(threads),
        "--http-bind", f"127.0.0.1:{port}", "--max-concurrency", str(concurrency),
        "--max-queue", str(queue), "--log-level", "warning",
    ]  # fmt: skip
    if decode_processes is not None:
        cmd += ["--decode-processes", str(decode_processes)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OASR_")}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Poll ``/readyz`` until 200; the server's stderr tail if it exits first. (The standard
    library's client: the GPU machine has no httpx.)"""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"oasr-server exited with {proc.returncode}: {err[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError("oasr-server did not become ready")


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"([a-zA-Z_:]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        if labels and not all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            continue
        total += float(m.group(3))
    return total


async def upload_all(base: str, work: list[Path], concurrency: int) -> tuple[list[tuple[int, int, str]], list[float]]:
    import httpx

    blobs = {p: p.read_bytes() for p in set(work)}
    sem = asyncio.Semaphore(concurrency)
    answers: list[tuple[int, int, str]] = []
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(i: int, p: Path) -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(
                    "/v1/audio/transcriptions",
                    files={"file": (p.name, blobs[p])},
                    data={"model": "whisper-1", "response_format": "json"},
                )
                latencies.append(time.perf_counter() - t0)
                text = r.json().get("text", "") if r.status_code == 200 else r.text
                answers.append((i, r.status_code, text))

        await asyncio.gather(*(one(i, p) for i, p in enumerate(work)))
    return answers, latencies


async def realtime_stream(port: int) -> tuple[str, float]:
    """Stream one clip through /v1/realtime; return the turn's transcript and the time from the
    end of the audio to the transcript."""
    import numpy as np
    from websockets.asyncio.client import connect

    from oasr.audio import load_audio

    speech = load_audio(str(STREAM_CLIP), 24000)
    audio = np.concatenate([np.zeros(12000, np.float32), speech, np.zeros(24000, np.float32)])
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    async with connect(
        f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription", subprotocols=["realtime"],
        open_timeout=30, max_size=None,
    ) as ws:  # fmt: skip
        assert json.loads(await ws.recv())["type"] == "session.created"
        for i in range(0, len(pcm), 9600):
            chunk = base64.b64encode(pcm[i : i + 9600]).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        sent = time.perf_counter()
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 300))
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                return event["transcript"], time.perf_counter() - sent
            if event["type"] == "error":
                raise RuntimeError(f"realtime error: {event['error']}")


def run(
    *, requests: int = 64, concurrency: int = 16, streams: int = 2, threads: int = 2,
    device: str = "cpu", ckpt: str | None = None, shortest: bool = False,
    decode_processes: int | None = None,
) -> Report:  # fmt: skip
    import httpx

    if ckpt is None:
        from oasr.defaults import default_checkpoint

        ckpt = str(default_checkpoint())
    files = english_files()
    if shortest:
        rows = [json.loads(x) for x in (SPEECH / "manifest.jsonl").read_text().splitlines() if x]
        seconds = {SPEECH / r["audio"]: float(r["duration_s"]) for r in rows}
        files = sorted(files, key=lambda p: seconds[p])[:requests]
    work = [files[i % len(files)] for i in range(requests)]
    ref, engine_wall, audio_s, arrays_wall = engine_reference(ckpt, device, threads, work)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(ckpt, device, threads, port, concurrency, queue=max(64, requests),
                        decode_processes=decode_processes)  # fmt: skip
    try:
        wait_ready(base, proc)

        async def uploads_only() -> tuple[list, list, float]:
            t0 = time.perf_counter()
            answers, lat = await upload_all(base, work, concurrency)
            return answers, lat, time.perf_counter() - t0

        async def mixed() -> tuple[list, list, float, list]:
            t0 = time.perf_counter()
            stream_tasks = [asyncio.create_task(realtime_stream(port)) for _ in range(streams)]
            answers, lat = await upload_all(base, work, concurrency)
            wall = time.perf_counter() - t0
            return answers, lat, wall, list(await asyncio.gather(*stream_tasks))

        # warm-up, untimed: the whole work once, like the engine's
        warm_answers, _ = asyncio.run(upload_all(base, work, concurrency))
        # phase A: the uploads alone (throughput beside the engine); phase B: the same uploads
        # again while realtime streams run (correctness under mixed load)
        answers, latencies, server_wall = asyncio.run(uploads_only())
        stream_results: list = []
        mixed_wall = 0.0
        if streams:
            answers_b, _, mixed_wall, stream_results = asyncio.run(mixed())
            answers = answers + [(i + requests, st, t) for i, st, t in answers_b]
        time.sleep(0.5)
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    mismatches: list[str] = []
    total = requests * (2 if streams else 1)
    seen = sorted(i for i, _, _ in answers)
    if seen != list(range(total)):
        mismatches.append(f"answers for {len(seen)} requests ({len(set(seen))} distinct), expected {total}")
    for j, status, text in sorted(answers):
        i = j % requests
        if status != 200:
            mismatches.append(f"request {i} ({work[i].name}): HTTP {status}: {text[:200]}")
        elif text != ref[work[i]]:
            mismatches.append(f"request {i} ({work[i].name}): {text!r} != engine {ref[work[i]]!r}")
    counted = int(metric(metrics, "oasr_requests_total", {"route": "/v1/audio/transcriptions", "status": "200"}))
    for i, status, text in warm_answers:
        if status != 200 or text != ref[work[i]]:
            mismatches.append(f"warm-up request {i} ({work[i].name}): HTTP {status}: {text[:200]!r}")
    if counted != total + requests:  # + the warm-up
        mismatches.append(f"the server counted {counted} answered uploads, expected {total + requests}")
    for text, _ in stream_results:
        if not text.strip():
            mismatches.append("a realtime stream ended with an empty transcript")
    leftover = {
        "oasr_queue_depth": metric(metrics, "oasr_queue_depth"),
        "oasr_engine_in_flight": metric(metrics, "oasr_engine_in_flight"),
        "oasr_streams_active": metric(metrics, "oasr_streams_active"),
    }
    for name, value in leftover.items():
        if value:
            mismatches.append(f"{name} is {value:g} after the run, expected 0")
    server_rtfx = audio_s / server_wall
    engine_rtfx = audio_s / engine_wall
    return Report(
        requests=requests, concurrency=concurrency, streams=streams, threads=threads, device=device,
        audio_s=round(audio_s, 2), engine_wall_s=round(engine_wall, 3), engine_rtfx=round(engine_rtfx, 2),
        server_wall_s=round(server_wall, 3), server_rtfx=round(server_rtfx, 2),
        ratio=round(server_rtfx / engine_rtfx, 3),
        engine_arrays_wall_s=round(arrays_wall, 3), engine_arrays_rtfx=round(audio_s / arrays_wall, 2),
        ratio_vs_arrays=round(server_rtfx / (audio_s / arrays_wall), 3), decode_processes=decode_processes,
        latency_p50_s=round(percentile(latencies, 50), 3), latency_p99_s=round(percentile(latencies, 99), 3),
        mixed_wall_s=round(mixed_wall, 3), stream_latency_s=[round(s, 3) for _, s in stream_results], stream_texts=[t for t, _ in stream_results],
        mismatches=mismatches, server_counted=counted, leftover=leftover,
    )  # fmt: skip


def print_report(r: Report) -> None:
    print(f"oasr_server: {r.requests} uploads at concurrency {r.concurrency} + {r.streams} realtime streams, "
          f"{r.audio_s:.1f} s of audio, {r.device}, {r.threads} threads")  # fmt: skip
    print(f"  engine (in-process submit)  wall {r.engine_wall_s:8.2f} s   RTFx {r.engine_rtfx:7.1f}")
    print(f"  engine on decoded arrays    wall {r.engine_arrays_wall_s:8.2f} s   RTFx {r.engine_arrays_rtfx:7.1f}")
    print(f"  server (HTTP, real process) wall {r.server_wall_s:8.2f} s   RTFx {r.server_rtfx:7.1f}   "
          f"ratio {r.ratio:.2f} (vs decoded arrays {r.ratio_vs_arrays:.2f})")  # fmt: skip
    print(f"  upload latency p50 {r.latency_p50_s:.2f} s  p99 {r.latency_p99_s:.2f} s")
    if r.streams:
        print(f"  mixed: the same uploads + {r.streams} realtime streams: wall {r.mixed_wall_s:.2f} s; "
              f"stream end-of-audio to transcript {r.stream_latency_s} s")  # fmt: skip
    print(f"  correct: {'yes' if r.ok else 'NO'} (server counted {r.server_counted} answers)")
    for m in r.mismatches[:20]:
        print(f"    {m}")


def main(args: argparse.Namespace | None = None, argv: list[str] | None = None) -> dict:
    """Entry point for ``asrbench --backend oasr_server`` (``args`` from its parser) and for
    ``python -m benchmarks.serverbench``."""
    if args is None:
        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--profile", choices=["smoke", "english"], default="english")
        parser.add_argument("--requests", type=int, default=None)
        parser.add_argument("--concurrency", type=int, default=None)
        parser.add_argument("--streams", default=None)
        parser.add_argument("--threads", type=int, default=2)
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--server-ckpt", default=None)
        parser.add_argument("--decode-processes", type=int, default=None,
                            help="the server's --decode-processes (default: the server's own default)")
        parser.add_argument("--json", type=Path, default=None)
        args = parser.parse_args(argv)
    smoke = getattr(args, "profile", "english") == "smoke"
    requests = getattr(args, "requests", None) or (4 if smoke else 64)
    concurrency = getattr(args, "concurrency", None) or (4 if smoke else 16)
    streams_arg = getattr(args, "streams", None)
    streams = int(str(streams_arg).split(",")[0]) if streams_arg else (1 if smoke else 2)
    report = run(
        requests=requests, concurrency=concurrency, streams=streams, threads=args.threads,
        device=args.device, ckpt=getattr(args, "server_ckpt", None), shortest=smoke,
        decode_processes=getattr(args, "decode_processes", None),
    )  # fmt: skip
    print_report(report)
    out = asdict(report)
    out["ok"] = report.ok
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(out, indent=2, ensure_ascii=False))
    if not report.ok:
        raise SystemExit("serverbench: the server's answers did not match the engine's")
    return out


if __name__ == "__main__":
    main()
