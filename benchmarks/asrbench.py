"""ASR benchmark: OASR beside reference engines on the same machine, weights and audio.

    python -m benchmarks.asrbench                       # English clips, tiny.en, CPU, 2 threads
    python -m benchmarks.asrbench run --profile smoke --backend oasr_engine   # seconds: a check
    python -m benchmarks.asrbench --profile smoke       # two short clips, for a quick check
    python -m benchmarks.asrbench --json out.json
    python -m benchmarks.asrbench --backends oasr_engine,transformers_pipeline \
        --device cuda --ckpt-dir DIR                                      # GPU, vs the HF pipeline
    python -m benchmarks.asrbench --backends oasr_engine,transformers_pipeline --device cuda \
        --ckpt-dir DIR --copies 50 --decode-processes 8 --batch-size 128  # many files: 1000 inputs
    python -m benchmarks.asrbench --workload synthetic --profile smoke        # CPU, < 2 min
    python -m benchmarks.asrbench --workload synthetic --shape large-v3 --device cuda \
        --dtype float16 --batch-size 64 --requests 128 --tokens 100             # GPU

    python -m benchmarks.asrbench --workload streaming --profile smoke        # CPU, < 30 s
    python -m benchmarks.asrbench --workload streaming --find-max --json out.json

    python -m benchmarks.asrbench --backend oasr_server --profile smoke      # server, < 20 s
    python -m benchmarks.asrbench --workload cpu [--busy]   # whole `oasr transcribe` process vs
                                                            # faster-whisper (benchmarks/cpubench.py)
    python -m benchmarks.asrbench --backend oasr_server    # 64 uploads at c=16 + 2 realtime streams
    python -m benchmarks.asrbench --workload ctc --device cuda   # ctc | wfst | quant | kernels |
                                  # icefall | nemo | funasr | qwen | ray | serverstream: that
                                  # benchmark module

The synthetic workload (``benchmarks/synthetic.py``) compares OASR's engine with
``transformers`` on random weights and a forced decode length, so both sides do identical work:
RTFx, latency p50/p90/p99, tokens/s and peak GPU memory. The streaming workload
(``benchmarks/streambench.py``) feeds N WeNet streams at real time into a streaming engine.

``run`` is the one sub-command and may be left out (``asrbench run ...`` = ``asrbench ...``).
``--backend NAME`` runs that one backend (``--backends`` takes a comma-separated list).

Backends:
  oasr_engine            OASR's in-process ASREngine (the same path `oasr transcribe` takes)
  faster_whisper         faster-whisper (CTranslate2) on the same CTranslate2 weights
  transformers_pipeline  transformers' ASR pipeline on the same weights, converted in memory
                         (benchmarks/hf_pipeline.py; files decoded by OASR's PyAV loader)
Each backend transcribes every clip from its file (decode + resample + recognise), greedy,
temperature 0, no VAD (OASR: ``vad_gate=False``), after one warm-up clip. Reported: wall
seconds, RTFx (audio seconds per second), corpus WER (Whisper English normalisation) and each
backend's time relative to OASR. ``--dtype`` (default: fp32 on CPU, fp16 on CUDA) and
``--batch-size`` (default 16) apply to every backend that has them.

Many files: ``--copies N`` lists every clip N times (20 clips x 50 = 1000 inputs, 8777 s of
audio); each input is read and decoded from its file again (nothing decoded is reused across
copies, on either side). OASR decodes in ``--decode-processes`` worker processes and queues each
input into its engine as it arrives; the pipeline gets ``--readers`` DataLoader worker
processes decoding with the same loader (default: as many as ``--decode-processes`` when
``--copies`` > 1, else none, the single-list run as before). WER is over all inputs;
``copies_differing`` counts the clips whose copies did not all get the same text. The warm-up
is one full batch of inputs (``--batch-size``) on every backend.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.hf_pipeline import transformers_pipeline_backend  # imports transformers lazily

REPO = Path(__file__).resolve().parents[1]
SPEECH = REPO / "tests" / "data" / "speech"


@dataclass
class Clip:
    path: Path
    text: str
    seconds: float


@dataclass
class Result:
    backend: str
    wall_s: float
    audio_s: float
    rtfx: float
    wer: float | None
    hypotheses: list[str]
    #: files transcribed in the timed run (clips x copies)
    inputs: int = 0
    #: with --copies > 1: clips whose copies did not all get the same text
    copies_differing: int | None = None


def english_clips(profile: str) -> list[Clip]:
    rows = [json.loads(line) for line in (SPEECH / "manifest.jsonl").read_text().splitlines() if line]
    clips = [Clip(SPEECH / r["audio"], r["text"], float(r["duration_s"])) for r in rows if r["language"] == "en"]
    if profile == "smoke":
        clips = sorted(clips, key=lambda c: c.seconds)[:2]
    return clips


def english_normalizer() -> tuple[Callable[[str], str], str]:
    """Whisper's English normaliser and where it came from. openai-whisper's when installed; else
    the copy in transformers, without openai's British->American spelling table (the GPU image
    has transformers but not openai-whisper)."""
    try:
        from whisper.normalizers import EnglishTextNormalizer

        return EnglishTextNormalizer(), "openai-whisper"
    except ImportError:
        from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

        return EnglishTextNormalizer({}), "transformers (no spelling map)"


def _word_errors(ref: list[str], hyp: list[str]) -> int:
    """Levenshtein distance over words (substitutions + deletions + insertions)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def corpus_wer(refs: list[str], hyps: list[str]) -> float:
    """Corpus WER in %: all word errors over all reference words (what jiwer.wer gives for lists;
    computed here so the GPU image needs no jiwer). Repeated (reference, hypothesis) pairs (the
    many-files workload's copies) are scored once and counted as often as they occur."""
    norm, _ = english_normalizer()
    counts: dict[tuple[str, str], int] = {}
    for pair in zip(refs, hyps, strict=True):
        counts[pair] = counts.get(pair, 0) + 1
    errors = words = 0
    for (ref, hyp), n in counts.items():
        r, h = norm(ref).split(), norm(hyp).split()
        if r:
            errors += n * _word_errors(r, h)
            words += n * len(r)
    return 100.0 * errors / words


def copies_differing(hyps: list[str], clips: int) -> int:
    """Clips (of ``clips``, listed ``len(hyps) // clips`` times in a row) whose copies did not
    all get the same text."""
    return sum(len({hyps[k] for k in range(c, len(hyps), clips)}) > 1 for c in range(clips))


def oasr_backend(ckpt: str, device: str, threads: int, dtype: str | None = None,
                 batch_size: int | None = None,
                 decode_processes: int = 0) -> Callable[[list[Path]], list[str]]:  # fmt: skip
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig

    # transcribe_offline decodes the files (one by one, or in decode_processes worker processes),
    # then runs them through the engine's scheduler (shortest first: batches of max_batch_size
    # with BatchExecutor, continuous batching where the model offers an executor)
    engine = ASREngine(EngineConfig(ckpt_dir=ckpt, device=device, num_threads=threads,
                                    dtype=dtype or "auto", max_batch_size=batch_size or 16,
                                    decode_processes=decode_processes))  # fmt: skip
    # faster-whisper runs without VAD (vad_filter=False): OASR's VAD gate is off too, so both
    # sides run the same decoding (on these speech clips the gate would pass everything anyway)
    options = DecodingOptions.build(beam_size=1, temperature=0.0, vad_gate=False)

    def run(paths: list[Path]) -> list[str]:
        return [t.text for t in engine.transcribe_offline(paths, options)]

    return run


def faster_whisper_backend(ckpt: str, device: str, threads: int, dtype: str | None = None,
                           batch_size: int | None = None) -> Callable[[list[Path]], list[str]]:  # fmt: skip
    from faster_whisper import WhisperModel

    # same precision as the other backends (fp16 on CUDA); one file at a time (batch_size unused)
    compute = dtype if dtype not in (None, "auto") else None
    compute = compute or ("float16" if device.startswith("cuda") else "float32")
    model = WhisperModel(ckpt, device=device, compute_type=compute, cpu_threads=threads)

    def run(paths: list[Path]) -> list[str]:
        out = []
        for p in paths:
            segments, _ = model.transcribe(
                str(p), beam_size=1, temperature=0.0, vad_filter=False, language="en"
            )
            out.append("".join(s.text for s in segments))
        return out

    return run


BACKENDS = {
    "oasr_engine": oasr_backend,
    "faster_whisper": faster_whisper_backend,
    "transformers_pipeline": transformers_pipeline_backend,
}


#: workloads with a benchmark module of their own: ``asrbench --workload NAME ARGS`` runs
#: ``python -m benchmarks.MODULE ARGS`` (each module's --help lists its arguments)
DELEGATED_WORKLOADS = {
    "ctc": "ctcbench",  # GPU CTC prefix beam vs the host search and WeNet's (issue #21)
    "wfst": "wfstbench",  # WFST beam search vs kaldi-decoder (issue #21)
    "quant": "quantbench",  # int8 / fp8 vs fp16 and faster-whisper int8 (issue #22)
    "kernels": "kernelbench",  # each oasr-kernels op vs its native op (issue #23)
    "icefall": "icefallbench",
    "nemo": "nemobench",
    "funasr": "funasrbench",
    "qwen": "qwenbench",
    "ray": "raybench",  # N Ray Serve replicas vs 1 (issue #25)
    "serverstream": "serverstreambench",  # N realtime streams + uploads through oasr-server (#20)
}


def _delegated_workload(argv: list[str]) -> tuple[str, list[str]] | None:
    for i, arg in enumerate(argv):
        name = None
        if arg == "--workload" and i + 1 < len(argv):
            name, drop = argv[i + 1], 2
        elif arg.startswith("--workload="):
            name, drop = arg.split("=", 1)[1], 1
        if name in DELEGATED_WORKLOADS:
            return DELEGATED_WORKLOADS[name], argv[:i] + argv[i + drop :]
    return None


def main(argv: list[str] | None = None) -> dict:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # the seed's spelling: ``asrbench run --profile smoke ...``
        argv = argv[1:]
    delegated = _delegated_workload(argv)
    if delegated is not None:
        module, rest = delegated
        return importlib.import_module(f"benchmarks.{module}").main(rest)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.asrbench [run]", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=["smoke", "english"], default="english")
    parser.add_argument("--backends", default="oasr_engine,faster_whisper")
    parser.add_argument("--ckpt-dir", default=None, help="CTranslate2 Whisper dir (default: tiny.en)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--workload", default="speech",
                        choices=["speech", "synthetic", "streaming", "cpu", *DELEGATED_WORKLOADS],
                        help="speech | synthetic | streaming | cpu here; the others run their own "
                             "benchmark module with the remaining arguments (DELEGATED_WORKLOADS)")
    parser.add_argument("--shape", default=None,
                        help="synthetic: smoke | tiny | large-v3 | large-v3-turbo; streaming: small | medium")
    parser.add_argument("--dtype", default=None,
                        help="float32 | float16 | bfloat16 (default: float32 on CPU, float16 on CUDA)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="speech: inputs per batch for oasr_engine and transformers_pipeline (16)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="synthetic: forced tokens per request")
    parser.add_argument("--decode-processes", type=int, default=0,
                        help="speech: oasr_engine decodes the files in this many worker processes "
                             "(EngineConfig.decode_processes; the other backends decode one by one "
                             "unless --readers)")
    parser.add_argument("--copies", type=int, default=1,
                        help="speech: list every clip this many times (many files: 50 -> 1000 "
                             "inputs), each decoded from its file again")
    parser.add_argument("--readers", type=int, default=None,
                        help="speech: transformers_pipeline decodes the files in this many "
                             "DataLoader worker processes (default: --decode-processes when "
                             "--copies > 1, else 0: one by one)")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--encoder-lookahead", type=int, default=None,
                        help="synthetic: SchedulerConfig.encoder_lookahead (default: the engine's)")
    parser.add_argument("--torch-profile", action="store_true",
                        help="synthetic: one more run per backend under torch.profiler (top device ops)")
    parser.add_argument("--varied", action="store_true",
                        help="synthetic: per-request decode lengths in [tokens/4, 7*tokens/4]")
    stream = parser.add_argument_group("streaming workload (benchmarks/streambench.py)")
    stream.add_argument("--streams", default=None, help="comma-separated stream counts (default 1,2,4,8)")
    stream.add_argument("--chunk-ms", type=float, default=640.0)
    stream.add_argument("--seconds", type=float, default=None, help="audio per stream (default 10)")
    stream.add_argument("--find-max", action="store_true", help="double N until streams fall behind")
    stream.add_argument("--beam", type=int, default=1, help="1: CTC greedy; > 1: prefix beam + rescoring")
    stream.add_argument("--left-chunks", type=int, default=-1, help="attention history in chunks (-1: all)")
    stream.add_argument("--aligned", action="store_true", help="all streams release chunks at once")
    from benchmarks.cpubench import add_arguments as add_cpu_arguments

    add_cpu_arguments(parser)
    server = parser.add_argument_group("server load test (benchmarks/serverbench.py)")
    parser.add_argument("--backend", choices=[*BACKENDS, "oasr_server"], default=None,
                        help="one backend (instead of --backends); oasr_server: load-test the real "
                             "oasr-server process (--requests, --concurrency, --streams N)")
    server.add_argument("--concurrency", type=int, default=None, help="oasr_server: uploads in flight")
    args = parser.parse_args(argv)
    if args.backend not in (None, "oasr_server"):
        args.backends = args.backend
    if args.backend == "oasr_server":
        from benchmarks.serverbench import main as server_main

        return server_main(args)
    if args.workload == "streaming":
        from benchmarks.streambench import main_streaming

        return main_streaming(args)
    if args.workload == "synthetic":
        return _synthetic(args)
    if args.workload == "cpu":
        from benchmarks.cpubench import bench, resolve

        return bench(resolve(args))

    import torch

    torch.set_num_threads(args.threads)
    from oasr.defaults import default_checkpoint

    ckpt = args.ckpt_dir or str(default_checkpoint())
    if args.copies < 1:
        parser.error("--copies must be >= 1")
    clips = english_clips(args.profile)
    paths = [c.path for c in clips] * args.copies  # copy k of every clip, then copy k + 1
    refs = [c.text for c in clips] * args.copies
    audio_s = sum(c.seconds for c in clips) * args.copies
    readers = args.readers if args.readers is not None else (args.decode_processes if args.copies > 1 else 0)
    results: list[Result] = []
    for name in args.backends.split(","):
        extra: dict = {}
        if name == "oasr_engine":
            extra = {"decode_processes": args.decode_processes}
        elif name == "transformers_pipeline":
            extra = {"readers": readers}
        run = BACKENDS[name](ckpt, args.device, args.threads, dtype=args.dtype,
                             batch_size=args.batch_size, **extra)  # fmt: skip
        # warm-up (two files: a decode pool starts here, not in the timed runs; many files: a
        # full batch, so the large batches' CUDA graphs and kernels are not first met timed)
        run(paths[: min(len(paths), args.batch_size or 16)] if args.copies > 1 else paths[:2])
        best = float("inf")
        hyps: list[str] = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            hyps = run(paths)
            best = min(best, time.perf_counter() - start)
        differing = copies_differing(hyps, len(clips)) if args.copies > 1 else None
        results.append(Result(name, best, audio_s, audio_s / best, corpus_wer(refs, hyps), hyps,
                              len(paths), differing))  # fmt: skip
        if args.copies > 1:  # each backend's line as it finishes (a long run may be cut short)
            print(f"{name}: {len(paths)} inputs in {best:.2f} s, RTFx {audio_s / best:.0f}, "
                  f"WER {results[-1].wer:.2f} %, copies differing {differing}", flush=True)

    base = results[0].wall_s
    if args.copies > 1:
        print(f"{len(paths)} inputs ({len(clips)} clips x {args.copies}), {audio_s:.0f} s of audio; "
              f"oasr_engine decode processes {args.decode_processes}, pipeline readers {readers}")  # fmt: skip
    print(f"{'backend':22} {'wall s':>8} {'RTFx':>8} {'WER %':>7} {'time / ' + results[0].backend:>22}")
    for r in results:
        wer = f"{r.wer:7.2f}" if r.wer is not None else "      -"
        print(f"{r.backend:22} {r.wall_s:8.2f} {r.rtfx:8.1f} {wer} {r.wall_s / base:22.2f}")
    report = {
        "profile": args.profile,
        "device": args.device,
        "dtype": args.dtype or ("float16" if args.device.startswith("cuda") else "float32"),
        "batch_size": args.batch_size or 16,
        "oasr_decode_processes": args.decode_processes,
        "threads": args.threads,
        "normalizer": english_normalizer()[1],
        "clips": [str(p.name) for p in paths[: len(clips)]],
        "results": [asdict(r) for r in results],
    }
    if args.copies > 1:
        report.update(copies=args.copies, inputs=len(paths), pipeline_readers=readers)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def _synthetic(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.synthetic import print_table, run_synthetic

    torch.set_num_threads(args.threads)
    smoke = args.profile == "smoke"
    backends = args.backends if args.backends != "oasr_engine,faster_whisper" else "oasr_engine,transformers"
    report = run_synthetic(
        shape=args.shape or ("smoke" if smoke else "large-v3"),
        device=args.device,
        dtype=args.dtype or ("float32" if args.device == "cpu" else "float16"),
        requests=args.requests or (6 if smoke else 128),
        batch_size=args.batch_size or (4 if smoke else 64),
        tokens=args.tokens or (12 if smoke else 100),
        backends=tuple(backends.split(",")),
        cuda_graphs=False if args.no_cuda_graphs else None,
        varied=args.varied,
        encoder_lookahead=args.encoder_lookahead,
        repeats=args.repeats,
        profile=args.torch_profile,
    )
    print_table(report)
    if smoke:  # every backend ran, produced the forced number of tokens and comparable text
        for r in report["results"]:
            assert r["tokens"] == report["tokens_total"], r["backend"]
            assert len(r["texts"]) == report["requests"], r["backend"]
        assert report["text_agreement_with_transformers"] in (None,) or report["text_agreement_with_transformers"] >= 0.5
    for r in report["results"]:
        r.pop("texts", None) if not smoke else None
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
