"""icefall Zipformer benchmark: OASR beside the ``zipformer`` package's own PyTorch code.

    python -m benchmarks.icefallbench --device cuda                       # H200: < 3 minutes
    python -m benchmarks.icefallbench --device cpu --shape tiny --batch 4 --seconds 5   # a check

Offline: the LibriSpeech zipformer recipe's shape (``--shape full``, ~65M parameters, the
defaults of icefall's ``egs/librispeech/ASR/zipformer/train.py``; random weights, saved in
icefall's release layout and loaded by OASR as released) on ``--batch`` inputs of ``--seconds``
seconds: OASR's ``model.transcribe`` (fbank on the device, encoder, greedy search; the engine's
dtype, fp16 on CUDA) against the package's ``AsrModel.forward_encoder`` + ``greedy_search`` (batched)
(as icefall decodes: fp32, features given, so its fbank time is not even counted; its Swoosh
activations through ``torch.compile`` as the package does by default, on CUDA) in the same
process. RTFx = audio seconds / wall seconds, best of ``--repeats`` after a warm-up.

Streaming (causal variant of the same shape): N concurrent streams each fed 320 ms of audio per
tick (icefall's chunk 16 at 50 Hz) through a streaming ``ASREngine``; the latency of the engine
step that serves all of them, p50 / p99, for each N in ``--streams`` (steady-state chunk steps:
the streams' last steps, with the padded tail windows and the final transcripts, run untimed in
``engine.run()`` after the ticks). A count is *held* when its
p99 is at most ``--p99-target-ms`` (100); ``--find-max`` doubles N from the first ``--streams``
value until a count is not held, bisects twice, and reports the most streams held.
``--profile`` adds the host seconds per phase of the timed steps (features, gather, encoder
launch, wait for the device, search, results). On CUDA the step runs as CUDA graphs (the model's
default), its one bucket captured before the timed steps; ``--no-stream-graphs`` (or
``OASR_ICEFALL_STREAM_GRAPHS=0``) times the eager step (an H200, 320 ms chunks: 64 / 128 / 256
streams at p99 16.5 / 14.7 / 32.5 ms with graphs, 241 / 231 / 582 ms eagerly).

    python -m benchmarks.icefallbench --device cuda --skip-offline --find-max --streams 32
    python -m benchmarks.icefallbench --device cuda --skip-offline --find-max --streams 32 --no-stream-graphs

Prints one JSON object. The reference is the PyPI package ``zipformer`` (installed with
``--no-deps``; its training-only imports are faked as in ``tests/icefall/_reference.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

FULL = dict(  # icefall egs/librispeech/ASR/zipformer/train.py defaults
    downsampling_factor="1,2,4,8,4,2", num_encoder_layers="2,2,3,4,3,2",
    feedforward_dim="512,768,1024,1536,1024,768", num_heads="4,4,4,8,4,4",
    encoder_dim="192,256,384,512,384,256", query_head_dim="32", value_head_dim="12",
    pos_head_dim="4", pos_dim=48, encoder_unmasked_dim="192,192,256,256,256,192",
    cnn_module_kernel="31,31,15,15,15,31", decoder_dim=512, joiner_dim=512, vocab_size=500,
)  # fmt: skip
TINY = dict(
    downsampling_factor="1,2,4", num_encoder_layers="1,2,1", feedforward_dim="64,96,80",
    num_heads="2,2,4", encoder_dim="32,48,40", query_head_dim="8", value_head_dim="6",
    pos_head_dim="4", pos_dim=16, encoder_unmasked_dim="16,16,16", cnn_module_kernel="15,7,7",
    decoder_dim=16, joiner_dim=24, vocab_size=500,
)  # fmt: skip


def _reference_module():
    spec = importlib.util.spec_from_file_location("icefall_reference", REPO / "tests" / "icefall" / "_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _waves(n: int, seconds: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    length = int(seconds * 16000)
    t = np.arange(length) / 16000
    out = []
    for k in range(n):
        x = 0.05 * rng.standard_normal(length) + 0.2 * np.sin(2 * math.pi * (150 + 7 * k) * t) * (np.sin(3 * t + k) > 0)
        out.append(x.astype(np.float32))
    return out


def _write_release(root: Path, model, vocab: int) -> Path:
    import torch

    (root / "exp").mkdir(parents=True)
    torch.save({"model": model.state_dict()}, root / "exp" / "pretrained.pt")
    (root / "data" / "lang_bpe_500").mkdir(parents=True)
    pieces = ["<blk>", "<sos/eos>", "<unk>"] + [f"\u2581T{i}" for i in range(vocab - 3)]
    (root / "data" / "lang_bpe_500" / "tokens.txt").write_text("".join(f"{p} {i}\n" for i, p in enumerate(pieces)))
    return root


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(fn, repeats: int, device: str) -> float:
    fn()  # warm-up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


#: the network's parts a --profile run times separately (disjoint: none contains another but the
#: front end, whose output BiasNorm counts in both)
MODULE_PARTS = ("Conv2dSubsampling", "AttentionWeights", "SelfAttention", "NonlinAttention", "FeedForward",
                "ConvolutionModule", "BiasNorm", "Bypass", "SimpleDownsample", "Decoder", "Joiner")  # fmt: skip


def module_times(model, fn, device: str) -> dict:
    """Seconds of one ``fn()`` call spent in each kind of module (device time on CUDA, from
    events around each call; wall time on the CPU), plus the call's total. Modules run inside a
    CUDA-graph replay (the greedy search's frames) are not seen: the search's share is
    ``oasr_search_s``."""
    import torch

    cuda = device.startswith("cuda")
    spans: dict[str, list] = {k: [] for k in MODULE_PARTS}
    handles = []

    def stamp():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    for mod in model.net.modules():
        kind = type(mod).__name__
        if kind in spans:
            def pre(_m, _a, kind=kind):  # not inside a CUDA-graph capture (the greedy search's)
                capturing = cuda and torch.cuda.is_current_stream_capturing()
                spans[kind].append(None if capturing else [stamp(), None])

            def post(_m, _a, _o, kind=kind):
                if spans[kind][-1] is not None:
                    spans[kind][-1][1] = stamp()

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        total = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    out = {}
    for kind, pairs in spans.items():
        done = [(a, b) for a, b in (p for p in pairs if p is not None) if b is not None]
        sec = sum(a.elapsed_time(b) / 1000 for a, b in done) if cuda else sum(b - a for a, b in done)
        if done:
            out[kind] = {"s": round(sec, 4), "calls": len(done)}
    out["call_s"] = round(total, 4)
    print(json.dumps({"modules_s": out}), file=sys.stderr)
    return out


def offline(args, ref, shape: dict) -> dict:
    import torch

    from oasr.checkpoint import load_model
    from oasr.types import DecodingOptions, EngineConfig

    torch.manual_seed(0)
    m = ref.model.AsrModel(feature_dim=80, causal=False, use_ctc=False, chunk_size="-1",
                           left_context_frames="-1", **shape).eval()  # fmt: skip
    params = sum(p.numel() for p in m.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_release(Path(tmp), m, shape["vocab_size"])
        model = load_model(EngineConfig(ckpt_dir=str(path), device=args.device, dtype=args.dtype))
    waves = _waves(args.batch, args.seconds)
    audio = args.batch * args.seconds
    opts = DecodingOptions()
    with torch.no_grad():
        ours_s = _best(lambda: model.transcribe(waves, opts), args.repeats, args.device)
        # where the time goes: fbank alone, fbank + encoder, the rest is the search
        resolved = model._check(opts)
        feats_s = _best(lambda: model.features(waves), args.repeats, args.device)
        uniform = len({len(w) for w in waves}) == 1  # as transcribe decides
        encode_s = _best(lambda: model.encode_features(*model.features(waves), resolved, uniform),
                         args.repeats, args.device)  # fmt: skip
        stages = {"oasr_features_s": round(feats_s, 4), "oasr_encoder_s": round(encode_s - feats_s, 4),
                  "oasr_search_s": round(ours_s - encode_s, 4)}  # fmt: skip
        if args.profile:
            from benchmarks.profiling import profile_call

            stages["profile"] = profile_call(lambda: model.transcribe(waves, opts), args.device)
            stages["modules_s"] = module_times(model, lambda: model.transcribe(waves, opts), args.device)
        feats, lens = model.features(waves)  # the same features for the reference
        m = m.to(args.device)
        feats32, lens_d = feats.float(), lens.to(args.device)

        def reference():
            enc, enc_lens = m.forward_encoder(feats32, lens_d)
            return ref.search.greedy_search(m, enc, enc_lens, max_sym_per_frame=1)

        compiled = args.reference_compile
        try:
            ref_s = _best(reference, args.repeats, args.device)
        except Exception as exc:  # noqa: BLE001 - torch.compile unavailable here: eager
            if not compiled:
                raise
            print(f"reference with torch.compile failed ({type(exc).__name__}: {exc}); eager",
                  file=sys.stderr)
            import torch._dynamo

            torch._dynamo.config.disable = True
            compiled = False
            ref_s = _best(reference, args.repeats, args.device)
    return {
        "shape": args.shape, "parameters": params, "batch": args.batch, "seconds": args.seconds,
        "oasr_dtype": str(model.dtype).replace("torch.", ""), "reference_dtype": "float32",
        "reference_compiled_activations": compiled,
        "oasr_s": round(ours_s, 4), "reference_s": round(ref_s, 4),
        "oasr_rtfx": round(audio / ours_s, 1), "reference_rtfx": round(audio / ref_s, 1),
        "speedup": round(ref_s / ours_s, 2),
        **stages,
    }  # fmt: skip


def _stream_run(args, path: Path, n: int) -> dict:
    """``n`` streams fed one chunk each per tick in lockstep (``--chunk-frames`` 50 Hz frames:
    16 = 320 ms, 32 = 640 ms); the engine step serving all of them."""
    import torch

    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig

    engine = ASREngine(EngineConfig(ckpt_dir=str(path), device=args.device, dtype=args.dtype,
                                    service_mode="streaming", max_batch_size=max(n, 1)))  # fmt: skip
    model = engine.model
    chunk_frames = args.chunk_frames
    chunk = chunk_frames * 320  # samples: 20 ms per 50 Hz frame
    try:
        waves = _waves(n, args.stream_seconds, seed=n)
        options = DecodingOptions.build(chunk_size=chunk_frames)
        rids = [engine.add_streaming_request(options) for _ in range(n)]
        captured = 0
        if args.stream_graphs is not None:  # else the model's default: on with CUDA
            model.stream_cuda_graphs = args.stream_graphs
        graphs = bool(model.stream_cuda_graphs) and model.device.type == "cuda"
        if graphs:  # the one bucket a lockstep run replays, captured before timing
            with torch.no_grad():
                captured = model.capture_stream_graphs(n, chunk_frames, 128, streams=n, buckets=[n])
        profile = None
        if args.profile:  # host seconds per phase of the timed steps
            from oasr.stream_cache import StepProfile

            profile = StepProfile()
        lat = []
        ticks = int(args.stream_seconds * 16000) // chunk
        for k in range(ticks):
            model.stream_profile = profile if k >= 2 else None
            for r, w in zip(rids, waves, strict=True):
                engine.feed_chunk(r, w[k * chunk : (k + 1) * chunk], is_last=k == ticks - 1)
            t0 = time.perf_counter()
            engine.step()
            _sync(args.device)
            if k >= 2:  # warm-up steps excluded
                lat.append(time.perf_counter() - t0)
        model.stream_profile = None
        engine.run()  # the finals
        stats = model.stream_occupancy()
    finally:
        engine.shutdown()
    lat_ms = np.array(lat) * 1000
    p99 = float(np.percentile(lat_ms, 99))
    return {"streams": n, "steps": len(lat), "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
            "p99_ms": round(p99, 2), "real_time": bool(p99 <= args.p99_target_ms),
            "cuda_graphs": graphs and bool(model.stream_cuda_graphs),  # (False after a failed capture)
            "graphs_captured": captured, "graph_replays": int(stats.get("graph_replays", 0)),
            **({"phases": profile.as_dict()} if profile is not None else {})}  # fmt: skip


def streaming(args, ref, shape: dict) -> dict:
    import torch

    torch.manual_seed(0)
    m = ref.model.AsrModel(feature_dim=80, causal=True, use_ctc=False, chunk_size=str(args.chunk_frames),
                           left_context_frames="128", **shape).eval()  # fmt: skip
    out = {"chunk_ms": 20 * args.chunk_frames, "p99_target_ms": args.p99_target_ms, "find_max": bool(args.find_max), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_release(Path(tmp), m, shape["vocab_size"])
        runs: dict[int, dict] = {}

        def held(n: int) -> bool:
            if n not in runs:
                runs[n] = _stream_run(args, path, n)
                print(json.dumps(runs[n]), file=sys.stderr)
            return runs[n]["real_time"]

        if args.find_max:  # double until a count is not held, then bisect twice
            lo, hi = 0, args.streams[0]
            while held(hi) and hi < args.max_streams:
                lo, hi = hi, min(2 * hi, args.max_streams)
            if held(hi):
                lo = hi
            else:
                for _ in range(2):
                    if hi - lo <= 1:
                        break
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if held(mid) else (lo, mid)
        else:
            for n in args.streams:
                held(n)
        out["runs"] = [runs[n] for n in sorted(runs)]
    out["cuda_graphs"] = bool(out["runs"]) and all(r["cuda_graphs"] for r in out["runs"])
    ok = [r["streams"] for r in out["runs"] if r["real_time"]]
    out["max_streams_held"] = max(ok) if ok else 0
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--shape", choices=["full", "tiny"], default="full")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 128, 256])
    p.add_argument("--stream-seconds", type=float, default=6.4)
    p.add_argument("--chunk-frames", type=int, default=16,
                   help="streaming chunk in 50 Hz frames, as icefall's --chunk-size: 16 (320 ms, the "
                        "default) or 32 (640 ms, the chunk of issue #20's WeNet target); the model is "
                        "trained with chunk 16, and both sizes run through the same streaming step")
    p.add_argument("--skip-streaming", action="store_true")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--find-max", action="store_true",
                   help="streaming: double the stream count from the first --streams value until p99 "
                        "exceeds --p99-target-ms, bisect twice; report the most streams held")
    p.add_argument("--max-streams", type=int, default=2048)
    p.add_argument("--p99-target-ms", type=float, default=100.0)
    p.add_argument("--stream-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the streaming step as CUDA graphs (default: on with CUDA, unless "
                        "OASR_ICEFALL_STREAM_GRAPHS=0); --no-stream-graphs times the eager step")
    p.add_argument("--profile", action="store_true",
                   help="also profile one OASR call (top operators, and seconds per kind of module: "
                        "attention weights, feed-forward, convolution, norms, front end, search; to "
                        "stderr and in the JSON)")
    p.add_argument("--reference-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the package's Swoosh activations through torch.compile, as it does by "
                        "default (default: on CUDA)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    import torch

    torch.set_grad_enabled(False)  # PyTorch's default TF32 settings for both sides
    if args.reference_compile is None:
        args.reference_compile = args.device.startswith("cuda")
    shape = FULL if args.shape == "full" else TINY
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    with _reference_module().icefall_reference(compile_activations=args.reference_compile) as ref:
        if not args.skip_offline:
            result["offline"] = offline(args, ref, shape)
        if not args.skip_streaming:
            result["streaming"] = streaming(args, ref, shape)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
