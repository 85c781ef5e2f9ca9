"""Audio decode + resample + Whisper log-mel throughput, beside transformers' WhisperFeatureExtractor.

    python -m benchmarks.featbench [--quick] [--repeats N] [--device cpu|cuda|all] [--json]

Throughput is seconds of real audio processed per wall-clock second (x real time). The corpus in
tests/data/speech is decoded with ``oasr.audio.load_audio`` (any container, resampled to 16 kHz),
cut into Whisper's 30 s windows (last one zero-padded) and turned into 80-bin log-mel by

* OASR: ``oasr.features.whisper.log_mel_spectrogram`` on the batch of windows (on the device);
* transformers: ``WhisperFeatureExtractor`` on the same windows (``device=`` for its torch path).

Reported: decode+resample alone, each feature extractor alone, the whole OASR pipeline, and the
ratio OASR / transformers (features alone and decode + features). ``--quick`` uses 6 clips and one
repeat so it finishes in well under 20 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from oasr.audio import load_audio
from oasr.features.whisper import N_SAMPLES, log_mel_spectrogram

SPEECH = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"
QUICK = [
    "en_jfk_inaugural.flac",
    "en_jfk_inaugural.mp3",
    "en_jfk_inaugural.m4a",
    "en_fleurs_000.ogg",
    "en_osr_us_000_0034_8k.wav",
    "en_ljspeech_LJ002-0020.wav",
]


def _files(quick: bool) -> list[Path]:
    if quick:
        return [SPEECH / f for f in QUICK]
    return sorted(p for p in SPEECH.iterdir() if p.suffix in {".wav", ".flac", ".mp3", ".m4a", ".ogg"})


def _windows(x: np.ndarray) -> np.ndarray:
    n = max(1, -(-len(x) // N_SAMPLES))
    out = np.zeros((n, N_SAMPLES), np.float32)
    for i in range(n):
        seg = x[i * N_SAMPLES : (i + 1) * N_SAMPLES]
        out[i, : len(seg)] = seg
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(quick: bool, repeats: int, devices: list[str]) -> dict:
    from transformers import WhisperFeatureExtractor

    files = _files(quick)
    blobs = [p.read_bytes() for p in files]
    decoded: list[np.ndarray] = []

    def decode() -> None:
        decoded.clear()
        for b in blobs:
            decoded.append(load_audio(b, 16000))

    t_decode = _best(decode, repeats)
    audio_s = sum(len(x) for x in decoded) / 16000
    windows = [_windows(x) for x in decoded]
    hf = WhisperFeatureExtractor(feature_size=80)
    result: dict = {
        "files": len(files),
        "audio_seconds": round(audio_s, 2),
        "torch_threads": torch.get_num_threads(),
        "decode_resample_xrt": round(audio_s / t_decode, 1),
        "devices": {},
    }
    for dev in devices:
        def oasr_feats(dev: str = dev) -> None:
            for w in windows:
                log_mel_spectrogram(torch.from_numpy(w).to(dev), 80)
            _sync(dev)

        def hf_feats(dev: str = dev) -> None:
            for w in windows:
                hf(list(w), sampling_rate=16000, return_tensors="np", device=dev)
            _sync(dev)

        oasr_feats()  # warm-up (kernels, filter caches)
        hf_feats()
        t_oasr = _best(oasr_feats, repeats)
        t_hf = _best(hf_feats, repeats)
        result["devices"][dev] = {
            "oasr_logmel_xrt": round(audio_s / t_oasr, 1),
            "transformers_logmel_xrt": round(audio_s / t_hf, 1),
            "logmel_ratio_oasr_over_transformers": round(t_hf / t_oasr, 2),
            "pipeline_oasr_xrt": round(audio_s / (t_decode + t_oasr), 1),
            "pipeline_transformers_xrt": round(audio_s / (t_decode + t_hf), 1),
            "pipeline_ratio": round((t_decode + t_hf) / (t_decode + t_oasr), 2),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 clips, 1 repeat (< 20 s)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="all", help="cpu, cuda or all (cuda when available)")
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    if args.device == "all":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    else:
        devices = [args.device]
    res = run(args.quick, repeats, devices)
    if args.json:
        print(json.dumps(res))
        return
    print(f"{res['files']} files, {res['audio_seconds']} s of audio, "
          f"torch threads {res['torch_threads']}, best of {repeats}")
    print(f"decode + resample to 16 kHz (PyAV):      {res['decode_resample_xrt']:>9.1f} x real time")
    for dev, r in res["devices"].items():
        print(f"[{dev}] OASR Whisper log-mel:              {r['oasr_logmel_xrt']:>9.1f} x real time")
        print(f"[{dev}] transformers WhisperFeatureExtractor: {r['transformers_logmel_xrt']:>6.1f} "
              f"x real time")
        print(f"[{dev}] log-mel ratio OASR / transformers: {r['logmel_ratio_oasr_over_transformers']:>8.2f}")
        print(f"[{dev}] decode+log-mel: OASR {r['pipeline_oasr_xrt']:.1f} x, with transformers "
              f"{r['pipeline_transformers_xrt']:.1f} x, ratio {r['pipeline_ratio']:.2f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
