"""Throughput of OASR on Ray Serve: N engine replicas beside 1, the same call.

    python -m benchmarks.raybench --shape large-v3 --dtype float16 --replicas 2 \\
        --requests 64 --concurrency 32 --tokens 32 --json raybench.json      # 2 GPUs (x2 machine)
    python -m benchmarks.raybench --shape smoke --replicas 2 --requests 8     # CPU smoke run

A local Ray cluster is started (``--address`` joins one instead) and the application of
``oasr_server.ray_serve`` is deployed twice, first with 1 replica then with ``--replicas``, each
replica holding Whisper of the ``--shape`` shapes with random weights (``benchmarks.synthetic``;
the same seed, so every replica has the same weights) on its GPU (``--gpus-per-replica``, 1 by
default when the cluster has GPUs) or the CPU. Each run: one warm-up request per replica, then
``--requests`` uploads of ``--seconds`` s of noise (16 kHz WAV) to Serve's proxy,
``/v1/audio/transcriptions``, ``--concurrency`` at a time, every request decoding exactly
``--tokens`` tokens (``max_new_tokens``, end-of-text suppressed, no temperature fallback).

Reported per run: wall time, requests/s, RTFx (audio seconds per wall second), latency p50/p90;
and the speed-up of N replicas over 1 (target on 2 GPUs: >= 1.8x). Every answer must be 200 and
the texts of the two runs equal request by request (same weights, same inputs, greedy; on GPU in
reduced precision a different batch composition may flip a near-tie, so the match fraction is
reported rather than asserted).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Whisper's multilingual end-of-text id (suppressed, so every request decodes --tokens tokens)
EOT = 50257


class SyntheticEngine:
    """Picklable engine factory, called in each replica: random-weight Whisper of ``shape`` on
    the replica's GPU (Ray's ``CUDA_VISIBLE_DEVICES``) or the CPU, inside an ``ASREngine``."""

    def __init__(self, shape: str, dtype: str, max_batch_size: int, seed: int = 0) -> None:
        self.shape, self.dtype, self.max_batch_size, self.seed = shape, dtype, max_batch_size, seed

    def __call__(self) -> Any:
        import torch

        from benchmarks.synthetic import build_models
        from oasr.engine import ASREngine
        from oasr.types import EngineConfig

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype if device == "cuda" else "float32"
        _hf, asr = build_models(self.shape, device, dtype, self.max_batch_size, self.seed)
        del _hf
        config = EngineConfig(device=device, dtype=dtype, max_batch_size=self.max_batch_size)
        return ASREngine(config, model=asr)


@dataclass
class Run:
    replicas: int
    requests: int
    wall_s: float
    requests_per_s: float
    rtfx: float
    latency_p50_s: float
    latency_p90_s: float


def _wav(seconds: float, seed: int) -> bytes:
    import numpy as np

    rng = np.random.default_rng(seed)
    pcm = (0.1 * rng.standard_normal(int(seconds * 16000)) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _post(base: str, body: bytes, tokens: int) -> tuple[int, str, float]:
    import httpx

    fields = {
        "language": "en",
        "max_new_tokens": str(tokens),
        "suppress_tokens[]": ["-1", str(EOT)],
        "no_speech_threshold": "none",
        "logprob_threshold": "none",
        "compression_ratio_threshold": "none",
        "condition_on_previous_text": "false",
    }
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/audio/transcriptions", files={"file": ("noise.wav", body)},
                   data=fields, timeout=1800)  # fmt: skip
    took = time.perf_counter() - t0
    return r.status_code, r.json().get("text", r.text) if r.status_code == 200 else r.text, took


def _pct(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def run_once(
    args: argparse.Namespace, replicas: int, base: str, bodies: list[bytes]
) -> tuple[Run, list[str]]:
    from ray import serve

    from oasr.types import EngineConfig
    from oasr_server import ray_serve as rs
    from oasr_server.config import ServerConfig

    options = rs.RayOptions(replicas=replicas, gpus_per_replica=args.gpus_per_replica,
                            cpus_per_replica=args.cpus_per_replica)  # fmt: skip
    layout = rs.plan_layout(options, rs.cluster_gpus(), max_batch_size=args.batch_size)
    server = ServerConfig(served_model_name="synthetic", max_batch_size=args.batch_size,
                          max_queue=max(64, args.requests), decode_processes=0, demo=False,
                          max_tokens_per_second=0, warmup=False)  # fmt: skip
    factory = SyntheticEngine(args.shape, args.dtype, args.batch_size, args.seed)
    app = rs.build_application(server, EngineConfig(device=layout.device), options, layout,
                               engine_factory=factory)  # fmt: skip
    serve.run(app, name=rs.APP_NAME, route_prefix="/", blocking=False)
    try:
        if not rs.wait_running(rs.APP_NAME, 1800):
            raise SystemExit(f"deploy failed: {rs.app_message(rs.APP_NAME)}")
        with ThreadPoolExecutor(max(replicas, 1)) as pool:  # warm-up: each replica at least once
            list(pool.map(lambda b: _post(base, b, args.tokens), bodies[: 2 * replicas]))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            out = list(pool.map(lambda b: _post(base, b, args.tokens), bodies))
        wall = time.perf_counter() - t0
    finally:
        serve.delete(rs.APP_NAME)
    bad = [(code, text[:200]) for code, text, _ in out if code != 200]
    if bad:
        raise SystemExit(f"{len(bad)} request(s) failed, first: {bad[0]}")
    lat = [t for _, _, t in out]
    run = Run(replicas=replicas, requests=len(bodies), wall_s=round(wall, 3),
              requests_per_s=round(len(bodies) / wall, 3),
              rtfx=round(len(bodies) * args.seconds / wall, 2),
              latency_p50_s=round(_pct(lat, 50), 3), latency_p90_s=round(_pct(lat, 90), 3))  # fmt: skip
    return run, [text for _, text, _ in out]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="large-v3", help="benchmarks.synthetic.SHAPES key")
    p.add_argument("--dtype", default="float16", help="on GPU (CPU runs float32)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--gpus-per-replica", type=float, default=None)
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local cluster")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from oasr_server import ray_serve as rs

    # replicas import benchmarks.synthetic: the repo on their path (a local cluster inherits it)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    rs.init_ray(args.address, num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    gpus = rs.cluster_gpus()
    base = f"http://127.0.0.1:{args.port}"
    bodies = [_wav(args.seconds, args.seed + i) for i in range(args.requests)]
    runs: list[Run] = []
    texts: list[list[str]] = []
    try:
        for n in (1, args.replicas) if args.replicas > 1 else (1,):
            run, out = run_once(args, n, base, bodies)
            runs.append(run)
            texts.append(out)
            print(json.dumps(asdict(run)), flush=True)
    finally:
        serve.shutdown()
        if args.address is None:
            ray.shutdown()
    report: dict[str, Any] = {
        "shape": args.shape,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "seconds": args.seconds,
        "gpus": gpus,
        "runs": [asdict(r) for r in runs],
    }
    if len(runs) == 2:
        report["speedup"] = round(runs[1].requests_per_s / runs[0].requests_per_s, 3)
        same = sum(a == b for a, b in zip(texts[0], texts[1], strict=True))
        report["texts_equal"] = f"{same}/{len(texts[0])}"
        print(f"{args.replicas} replicas vs 1: {report['speedup']:.2f}x throughput; "
              f"texts equal {report['texts_equal']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
