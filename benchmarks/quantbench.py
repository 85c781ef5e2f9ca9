"""Quantization benchmark (issue #22): quantized OASR beside float OASR and the reference
implementations, in one call.

    python -m benchmarks.quantbench cpu                     # int8 vs faster-whisper int8
    python -m benchmarks.quantbench cpu --repeats 3 --threads 2 --json out.json
    python -m benchmarks.quantbench device                  # large-v3 shapes, batch 64, H200
    python -m benchmarks.quantbench device --shape tiny --requests 16 --batch 8   # a quick look
    python -m benchmarks.asrbench --workload quant --device cuda   # the same as "device"

``cpu``: the whole ``oasr transcribe`` process (``--compute-type int8``: int8_w8a8 linears, the
int8 tied output projection and bfloat16 encoder self-attention where the CPU has native
bfloat16; ``OASR_INT8_TIED_OUTPUT=0`` / ``OASR_INT8_BF16_ATTENTION=0`` in the environment keep
those float32) and the whole faster-whisper process (``compute_type="int8"``), in turn, on the
same CTranslate2 tiny.en weights (the CLI's default model), the same files (``--inputs short``:
benchmarks/cpubench.py's nine English files; ``english``: every English recording of
tests/data/speech once, for a WER on more words; ``startup``: one 2 s file, what a process
costs before its audio), the same thread count and the same decoding,
set explicitly on both sides (:data:`DECODING`): greedy at temperature 0, the fallback
temperatures 0.2 ... 1.0 with one sample each (faster-whisper's default ``best_of=5`` is set to
1, what OASR's fallback draws), the compression-ratio / log-probability / no-speech thresholds
2.4 / -1.0 / 0.6, conditioned on the previous text, timestamps on (first one <= 1 s), blank and
non-speech tokens suppressed, no prompt, no VAD (``oasr --no-vad-gate``: OASR's default scan
for speech-free inputs is work faster-whisper does not do; ``--oasr-vad-gate`` keeps it),
English (both .en). Optionally the float sides too (``--float``), the int8 side with float32 attention
(``--fp32-attention``, what it was before bfloat16 attention) and the int8 side with switches of
``--before-env`` set. Both sides run with OASR's bytecode compiled beforehand
(``cpubench.compiled_env``: what an installed wheel has; faster-whisper's is in site-packages). The report gives median wall
seconds, CPU seconds of the process tree (and each side's fastest round: other jobs on a shared
machine only add time), peak RSS, corpus and per-file WER (Whisper's English
normaliser) and the ratios OASR / faster-whisper.

``device``: random weights of Whisper's shapes (``--shape``, default large-v3), ``--requests``
30-second inputs decoded greedily to exactly ``--tokens`` tokens each (benchmarks/synthetic.py's
forced decode), through the continuous-batching engine at ``--batch`` rows:

  oasr_fp16        fp16 weights and KV cache
  oasr_fp8         fp8_w8a8 linears (weights and activations) and the fp8 KV cache
  oasr_fp8_w       fp8_w8a8 linears, fp16 KV cache (what the KV cache adds)
  oasr_int8        int8_w8a8 linears, fp16 KV cache
  transformers     WhisperForConditionalGeneration fp16 (sdpa), generate() in batches of --batch

``--profile``: each OASR side runs one more pass under torch.profiler and its kernel table
(names, counts, device ms, benchmarks/profiling.py) goes into the JSON; ``<side>_before`` with
``--before-env NAME=VALUE`` runs a side again with switches set (e.g. ``oasr_fp8_before
--before-env OASR_FP8_FUSED_QUANT=0``: the W8A8 path without the one-launch quantization, the
bias in the GEMM and the fused self-attention projections).

Targets (issue #22): oasr_fp8 >= 1.4x oasr_fp16 and >= 4x transformers in throughput.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- CPU
#: the decoding both CPU sides run, as faster-whisper's ``transcribe`` arguments; OASR's
#: ``oasr transcribe`` defaults are the same (greedy, Whisper's fallback) with ``--no-vad-gate``
DECODING: dict[str, Any] = {
    "language": "en", "task": "transcribe", "beam_size": 1, "best_of": 1,
    "temperature": [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], "compression_ratio_threshold": 2.4,
    "log_prob_threshold": -1.0, "no_speech_threshold": 0.6, "condition_on_previous_text": True,
    "prompt_reset_on_temperature": 0.5, "initial_prompt": None, "without_timestamps": False,
    "max_initial_timestamp": 1.0, "suppress_blank": True, "suppress_tokens": [-1],
    "word_timestamps": False, "vad_filter": False,
}  # fmt: skip
#: OASR's side of :data:`DECODING` (its defaults otherwise)
OASR_DECODING = ["--language", "en", "--beam-size", "1", "--no-vad-gate"]


def english_set() -> tuple[list[Path], list[str], float]:
    """Every English recording of tests/data/speech once (one container per recording)."""
    rows = [json.loads(line) for line in (REPO / "tests/data/speech/manifest.jsonl").read_text().splitlines()
            if line.strip()]  # fmt: skip
    seen: dict[str, dict] = {}
    for r in rows:
        if r["language"] == "en":
            seen.setdefault(Path(r["audio"]).stem, r)
    files = [REPO / "tests/data/speech" / r["audio"] for r in seen.values()]
    return files, [r["text"] for r in seen.values()], sum(float(r["duration_s"]) for r in seen.values())


def fw_worker(argv: list[str]) -> None:
    """faster-whisper in its own process: load, transcribe each file, print the texts (JSON)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--compute-type", default="int8")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    from faster_whisper import WhisperModel

    model = WhisperModel(args.ckpt, device="cpu", compute_type=args.compute_type, cpu_threads=args.threads)
    texts = []
    for f in args.files:
        segments, _ = model.transcribe(f, **DECODING)
        texts.append("".join(s.text for s in segments).strip())
    print(json.dumps(texts))


def bench_cpu(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.asrbench import corpus_wer, english_normalizer
    from benchmarks.cpubench import compiled_env, input_set, measure, oasr_cmd
    from oasr.defaults import default_checkpoint

    ckpt = args.ckpt_dir or str(default_checkpoint())
    threads = ["--threads", str(args.threads)] if args.threads else []
    dec = OASR_DECODING if not args.oasr_vad_gate else OASR_DECODING[:-1]
    sides: dict[str, Any] = {
        "oasr_int8": ("oasr", ["--compute-type", "int8", *threads, *dec]),
        "faster_whisper_int8": ("fw", "int8"),
    }
    side_env: dict[str, dict[str, str]] = {}
    if args.fp32_attention:  # the int8 side as before bfloat16 attention: a before / after pair
        sides["oasr_int8_fp32_attention"] = ("oasr", ["--compute-type", "int8", *threads, *dec])
        side_env["oasr_int8_fp32_attention"] = {"OASR_INT8_BF16_ATTENTION": "0"}
    if args.before_env:  # the int8 side with switches set (e.g. a new step turned off): before / after
        sides["oasr_int8_before"] = ("oasr", ["--compute-type", "int8", *threads, *dec])
        side_env["oasr_int8_before"] = dict(kv.split("=", 1) for kv in args.before_env)
    if args.float:
        sides["oasr_float32"] = ("oasr", [*threads, *dec])
        sides["faster_whisper_float32"] = ("fw", "float32")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base_env = compiled_env()  # OASR's bytecode compiled first, as installed (cpubench)
        files, refs, audio_s = english_set() if args.inputs == "english" else input_set(args.inputs, tmp)
        for _ in range(args.repeats):
            for name, (kind, extra) in sides.items():
                if kind == "oasr":
                    out = Path(tempfile.mkdtemp(dir=tmp))
                    env = {**base_env, **side_env.get(name, {})}
                    wall, cpu, peak, _ = measure(oasr_cmd(files, out, list(extra)), env=env)
                    texts = [(out / f"{f.stem}.txt").read_text().strip() for f in files]
                else:
                    cmd = [sys.executable, "-m", "benchmarks.quantbench", "fw-worker", "--ckpt", ckpt,
                           "--threads", str(args.threads), "--compute-type", extra, *map(str, files)]  # fmt: skip
                    wall, cpu, peak, stdout = measure(cmd, env=base_env)
                    texts = json.loads(stdout.strip().splitlines()[-1])
                runs[name].append({"wall_s": wall, "cpu_s": cpu, "peak_mb": peak, "texts": texts})
    table = {}
    for name, rs in runs.items():
        table[name] = {k: round(statistics.median(r[k] for r in rs), 3) for k in ("wall_s", "cpu_s", "peak_mb")}
        # the fastest round too: on a shared machine other jobs only ever add time
        table[name].update({f"min_{k}": round(min(r[k] for r in rs), 3) for k in ("wall_s", "cpu_s")})
        table[name]["wer"] = round(corpus_wer(refs, rs[-1]["texts"]), 2)
    ratio = {k: round(table["oasr_int8"][k] / table["faster_whisper_int8"][k], 3)
             for k in ("wall_s", "cpu_s", "peak_mb", "min_wall_s", "min_cpu_s")}  # fmt: skip
    report = {
        "workload": "quant-cpu", "files": len(files), "audio_s": round(audio_s, 2),
        "repeats": args.repeats, "threads": args.threads or "default", "cpus": os.cpu_count(),
        "normalizer": english_normalizer()[1], "loadavg_after": os.getloadavg(),
        "decoding": DECODING, "oasr_args": dec, "inputs": args.inputs,
        "results": table, "ratio_oasr_int8_over_faster_whisper_int8": ratio,
        "runs": {name: [{k: r[k] for k in ("wall_s", "cpu_s", "peak_mb")} for r in rs] for name, rs in runs.items()},
        "per_file_wer": {f.name: {name: round(corpus_wer([ref], [rs[-1]["texts"][k]]), 2) for name, rs in runs.items()}
                         for k, (f, ref) in enumerate(zip(files, refs, strict=True))},
        "texts": {name: rs[-1]["texts"] for name, rs in runs.items()},
    }  # fmt: skip
    print(f"quant cpu: {len(files)} English files, {audio_s:.1f} s of audio, {args.repeats} run(s) each, "
          f"threads {args.threads or 'default'}")  # fmt: skip
    print(f"{'side':<26}{'wall s':>8}{'cpu s':>8}{'min wall':>9}{'min cpu':>8}{'peak MB':>9}{'WER %':>7}")
    for name, row in table.items():
        print(f"{name:<26}{row['wall_s']:>8.2f}{row['cpu_s']:>8.2f}{row['min_wall_s']:>9.2f}{row['min_cpu_s']:>8.2f}"
              f"{row['peak_mb']:>9.0f}{row['wer']:>7.2f}")  # fmt: skip
    print("per-file WER %: " + "  ".join(f"{f}: " + "/".join(f"{w:.1f}" for w in row.values())
                                         for f, row in report["per_file_wer"].items()))  # fmt: skip
    print(f"oasr int8 / faster-whisper int8: wall {ratio['wall_s']:.2f}x  cpu {ratio['cpu_s']:.2f}x  "
          f"(fastest rounds: {ratio['min_wall_s']:.2f}x, {ratio['min_cpu_s']:.2f}x)  "
          f"memory {ratio['peak_mb']:.2f}x (target: wall <= 1.0x, WER no worse)")  # fmt: skip
    return report


# --------------------------------------------------------------------------- device
def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine_run(asr: Any, audios: list, options: Any, batch: int, kv: str | None, warm: int,
                device: str = "cuda", profile: bool = False) -> dict[str, Any]:  # fmt: skip

    from oasr.engine import ASREngine
    from oasr.scheduler import SchedulerConfig
    from oasr.types import EngineConfig

    sc = SchedulerConfig(max_batch_size=batch, max_wait_steps=10**6, kv_cache_dtype=kv)
    engine = ASREngine(EngineConfig(device=device, dtype=str(asr.network.dtype).replace("torch.", ""),
                                    max_batch_size=batch, kv_cache_dtype=kv),
                       model=asr, scheduler_config=sc)  # fmt: skip
    try:
        for _ in range(warm):  # every CUDA-graph bucket this workload meets
            [f.result() for f in [engine.submit(a, options) for a in audios]]
        _sync(device)
        ex = engine.scheduler.executor
        before = ex.stats.get("tokens", 0)
        t0 = time.perf_counter()
        outs = [f.result() for f in [engine.submit(a, options) for a in audios]]
        _sync(device)
        wall = time.perf_counter() - t0
        tokens = ex.stats.get("tokens", 0) - before
        mem = ex.memory_bytes / 2**30
        prof = None
        if profile:  # one more timed pass under the profiler: kernel names, counts, device ms
            from benchmarks.profiling import profile_call

            keys = ("steps", "graph_replays", "eager_steps")
            counts = {k: ex.stats.get(k, 0) for k in keys}
            prof = profile_call(lambda: [f.result() for f in [engine.submit(a, options) for a in audios]],
                                device, rows=40, all_threads=True)  # fmt: skip
            # decode steps replayed from CUDA graphs vs run eagerly in the profiled pass
            prof["engine"] = {k: ex.stats.get(k, 0) - counts[k] for k in keys}
    finally:
        engine.shutdown()
    out = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "kv_and_cross_gib": round(mem, 2),
           "texts": [o.text for o in outs]}  # fmt: skip
    if prof is not None:
        out["profile"] = prof
    return out


def _hf_run(hf: Any, asr: Any, audios: list, tokens: int, batch: int) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, WhisperFeatureExtractor
    from transformers.generation.utils import GenerationMixin

    from oasr_models_whisper.decoding import resolve_suppress_tokens

    tok = asr.tokenizer
    fe = WhisperFeatureExtractor(feature_size=asr.network.dims.n_mels)
    init = [*tok.sot_sequence("en", "transcribe", multilingual=True), tok.no_timestamps]
    hf.generation_config = GenerationConfig(
        max_new_tokens=tokens, do_sample=False, num_beams=1,
        suppress_tokens=list(resolve_suppress_tokens(tok, (tok.eot,), None)),
        eos_token_id=tok.eot, pad_token_id=tok.eot, decoder_start_token_id=tok.sot, use_cache=True,
    )  # fmt: skip

    def run(xs: list) -> tuple[list[str], int]:
        texts, n = [], 0
        for k in range(0, len(xs), batch):
            chunk = xs[k : k + batch]
            feats = fe(chunk, sampling_rate=16000, return_tensors="pt", device="cuda").input_features
            feats = feats.to(device="cuda", dtype=hf.dtype)
            dec = torch.tensor([init] * len(chunk), device="cuda")
            with torch.inference_mode():
                out = GenerationMixin.generate(hf, input_features=feats, decoder_input_ids=dec,
                                               decoder_attention_mask=torch.ones_like(dec),
                                               generation_config=hf.generation_config)  # fmt: skip
            for row in out[:, len(init) :].tolist():
                body = row[: row.index(tok.eot)] if tok.eot in row else row
                n += len(body)
                texts.append(tok.decode(body).strip())
        return texts, n

    run(audios[:batch])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    texts, n = run(audios)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": n, "tokens_per_s": n / wall, "texts": texts}


def _device_side(side: str, args: argparse.Namespace, asr: Any, hf: Any, float_net: Any, audios: list,
                 options: Any, device: str) -> dict[str, Any]:  # fmt: skip
    from oasr.quantization import quantize_model

    run = {"batch": args.batch, "warm": args.warmup, "device": device, "profile": args.profile}
    if side == "transformers":
        return _hf_run(hf, asr, audios, args.tokens, args.batch)
    if side == "oasr_fp16":
        return _engine_run(asr, audios, options, kv=None, **run)
    if side in ("oasr_fp8", "oasr_fp8_w"):
        if getattr(asr, "quantization", None) is None:
            quantize_model(asr, "fp8_w8a8")
        return _engine_run(asr, audios, options, kv="fp8" if side == "oasr_fp8" else None, **run)
    if side == "oasr_int8":
        q = copy.copy(asr)
        q.network = copy.deepcopy(float_net)
        q.quantization = None
        quantize_model(q, "int8_w8a8")
        return _engine_run(q, audios, options, kv=None, **run)
    raise SystemExit(f"unknown side {side!r}")


def bench_device(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from benchmarks.synthetic import build_models
    from oasr.types import DecodingOptions

    device = args.device
    dtype = "float16" if device.startswith("cuda") else "float32"
    hf, asr = build_models(args.shape, device, dtype, args.batch, seed=0)
    tok = asr.tokenizer
    rng = np.random.default_rng(0)
    audios = [(0.1 * rng.standard_normal(30 * 16000)).astype(np.float32) for _ in range(args.requests)]
    options = DecodingOptions.build(
        language="en", without_timestamps=True, max_new_tokens=args.tokens, suppress_tokens=(tok.eot,),
        suppress_blank=False, no_speech_threshold=None, logprob_threshold=None,
        compression_ratio_threshold=None, condition_on_previous_text=False, temperature=0.0,
        vad_gate=False,
    )  # fmt: skip
    sides = [s for s in args.sides.split(",") if s]
    results: dict[str, dict[str, Any]] = {}
    float_net = copy.deepcopy(asr.network) if any(s.startswith("oasr_int8") for s in sides) else None
    before_env = dict(kv.split("=", 1) for kv in args.before_env)
    for side in sides:
        # "<side>_before": that side with --before-env set (the path a switch turns back on)
        saved = {k: os.environ.get(k) for k in before_env} if side.endswith("_before") else {}
        os.environ.update({k: before_env[k] for k in saved})
        try:
            results[side] = _device_side(side.removesuffix("_before"), args, asr, hf, float_net, audios, options,
                                         device)  # fmt: skip
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        r = results[side]
        print(f"{side:<14} {r['wall_s']:8.2f} s  {r['tokens_per_s']:9.1f} tokens/s", flush=True)

    base = results.get("oasr_fp16")
    ref = results.get("transformers")
    speed: dict[str, float] = {}
    for side, r in results.items():
        if base and side != "oasr_fp16":
            speed[f"{side}_over_oasr_fp16"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        if ref and side != "transformers":
            speed[f"{side}_over_transformers"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3)
    agree = {}
    if base:
        for side, r in results.items():
            if side != "oasr_fp16":
                agree[side] = round(sum(a == b for a, b in zip(r["texts"], base["texts"], strict=True))
                                    / max(1, len(base["texts"])), 3)  # fmt: skip
    report = {
        "workload": "quant-device", "shape": args.shape, "batch": args.batch, "requests": args.requests,
        "tokens_each": args.tokens, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "results": {s: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "texts"}
                    for s, r in results.items()},
        "speedups": speed, "text_agreement_with_oasr_fp16": agree,
    }  # fmt: skip
    print(json.dumps({"speedups": speed, "text_agreement_with_oasr_fp16": agree}, indent=2))
    print("targets: oasr_fp8 >= 1.4x oasr_fp16, >= 4x transformers")
    return report


# --------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fw-worker"]:
        fw_worker(argv[1:])
        return None
    if argv[:1] not in (["cpu"], ["device"], ["-h"], ["--help"]):
        # ``asrbench --workload quant [--device cuda] ...``: the device names the subcommand
        where = "cpu"
        for k, arg in enumerate(argv):
            value = arg.split("=", 1)[1] if arg.startswith("--device=") else (
                argv[k + 1] if arg == "--device" and k + 1 < len(argv) else None)  # fmt: skip
            if value is not None:
                where = "cpu" if value == "cpu" else "device"
        if where == "cpu":  # the cpu subcommand has no --device
            drop = {k for k, a in enumerate(argv) if a == "--device" or a.startswith("--device=")}
            drop |= {k + 1 for k in drop if argv[k] == "--device"}
            argv = [a for k, a in enumerate(argv) if k not in drop]
        argv = [where, *argv]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="where", required=True)
    cpu = sub.add_parser("cpu", help="oasr int8 vs faster-whisper int8 on the English clips")
    cpu.add_argument("--ckpt-dir", default=None, help="CTranslate2 Whisper (default: the CLI's tiny.en)")
    cpu.add_argument("--threads", type=int, default=2, help="both sides' threads (0: each one's default)")
    cpu.add_argument("--repeats", type=int, default=1)
    cpu.add_argument("--float", action="store_true", help="also both float32 sides")
    cpu.add_argument("--inputs", choices=("short", "english", "startup"), default="short",
                     help="short: the nine files; english: every English recording once; "
                          "startup: one 2 s file (the fixed cost: imports, model load)")
    cpu.add_argument("--fp32-attention", action="store_true",
                     help="also the int8 side with OASR_INT8_BF16_ATTENTION=0 (before / after)")
    cpu.add_argument("--before-env", action="append", default=[], metavar="NAME=VALUE",
                     help="also the int8 side with this environment variable set (repeatable), "
                          "e.g. OASR_QUANT_CACHE=0 OASR_INT8_PREPACK_THREAD=0: before / after")
    cpu.add_argument("--oasr-vad-gate", action="store_true",
                     help="OASR keeps its default VAD gate (faster-whisper has none)")
    dev = sub.add_parser("device", help="fp8/int8 vs fp16 vs transformers on a CUDA GPU")
    dev.add_argument("--shape", default="large-v3", help="benchmarks/synthetic.py SHAPES key")
    dev.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run of the OASR sides)")
    dev.add_argument("--batch", type=int, default=64)
    dev.add_argument("--requests", type=int, default=128)
    dev.add_argument("--tokens", type=int, default=64)
    dev.add_argument("--warmup", type=int, default=1)
    dev.add_argument("--sides", default="oasr_fp16,oasr_int8,oasr_fp8_w,oasr_fp8,transformers",
                     help="also <side>_before: that side with --before-env set")  # fmt: skip
    dev.add_argument("--profile", action="store_true",
                     help="one more pass of each OASR side under torch.profiler (benchmarks/profiling.py): "
                          "its kernel table (names, counts, device ms) in the JSON's results")  # fmt: skip
    dev.add_argument("--before-env", action="append", default=[], metavar="NAME=VALUE",
                     help="the environment of the <side>_before sides (repeatable), e.g. "
                          "OASR_FP8_FUSED_QUANT=0: the W8A8 path without the fused kernels")  # fmt: skip
    for p in (cpu, dev):
        p.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    report = bench_cpu(args) if args.where == "cpu" else bench_device(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
