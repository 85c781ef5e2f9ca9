"""Qwen2-Audio benchmark: OASR's engine beside ``transformers``' ``generate`` on the same random
weights (shared in memory), the same audio and a forced decode length (both sides generate
exactly ``--tokens`` tokens per request: end-of-sequence is never sampled), greedy.

    python -m benchmarks.qwenbench                          # GPU: the 7B shapes, bf16, 30 s inputs
    python -m benchmarks.qwenbench --profile smoke          # CPU, tiny shapes, seconds
    python -m benchmarks.qwenbench --batch-sizes 1,32 --tokens 100 --json out.json
    python -m benchmarks.qwenbench --batch-sizes 32 --repeats 3       # medians of 3 runs a side
    python -m benchmarks.qwenbench --batch-sizes 32 --torch-profile --json out.json   # where time goes

Per batch size: wall seconds of the whole batch (features + encoder + prefill + decode), tokens
per second, time to first token (batch 1: the first streamed text for OASR, a one-token
``generate`` for transformers), peak GPU memory, and OASR's speed-up (transformers' time / OASR's).
transformers' side includes its processor (log-mel on the CPU), OASR's its own features (on the
device); ``hf_generate_only_s`` is transformers' ``generate`` alone. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2-Audio-7B(-Instruct): Whisper-large-v3-sized encoder, Qwen-7B decoder
    "7b": {"audio": {"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
                     "encoder_ffn_dim": 5120},
           "text": {"vocab_size": 156032, "hidden_size": 4096, "intermediate_size": 11008,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}},
    # CPU before/after checks at the real prompt length (750 audio tokens per 30 s): small widths
    "small": {"audio": {"d_model": 256, "encoder_layers": 4, "encoder_attention_heads": 4,
                        "encoder_ffn_dim": 1024},
              "text": {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376,
                       "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8}},
    "tiny": {"audio": {"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2,
                       "encoder_ffn_dim": 128},
             "text": {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}},
}  # fmt: skip
PROFILES = {
    "default": {"shape": "7b", "device": "cuda", "dtype": "bfloat16", "batch_sizes": "1,32", "tokens": 100,
                "seconds": 30.0},
    "smoke": {"shape": "tiny", "device": "cpu", "dtype": "float32", "batch_sizes": "1,2", "tokens": 8,
              "seconds": 3.0},
}  # fmt: skip


def bench_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE with ``vocab_size`` entries (no merges: one token per byte, the rest are
    placeholders random weights may pick) and Qwen2-Audio's special tokens at the top."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for i in range(len(vocab), vocab_size - len(SPECIALS)):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def build(shape: str, device: str, dtype_name: str, workdir: Path, max_batch: int) -> tuple[Any, Any, Any]:
    """transformers' model + processor and OASR's model over the same weight tensors."""
    import torch
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    from oasr.types import EngineConfig
    from oasr_models_qwen.checkpoints import LoadedQwenAudio, normalize_name
    from oasr_models_qwen.config import parse_config
    from oasr_models_qwen.model import Qwen2AudioASR
    from oasr_models_qwen.tokenizer import DEFAULT_CHAT_TEMPLATE

    dims = SHAPES[shape]
    tok = bench_tokenizer(dims["text"]["vocab_size"])
    tok.save(str(workdir / "tokenizer.json"))
    config = Qwen2AudioConfig(
        audio_config={**dims["audio"], "num_mel_bins": 128, "max_source_positions": 1500},
        text_config={"model_type": "qwen2", **dims["text"], "max_position_embeddings": 8192,
                     "tie_word_embeddings": False},
        audio_token_index=tok.token_to_id("<|AUDIO|>"),
    )  # fmt: skip
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen2AudioForConditionalGeneration._from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)  # decisive logits: both sides pick the same greedy tokens
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )
    weights = {}
    for name, tensor in hf.state_dict().items():
        key = normalize_name(name)
        if key is not None:
            weights[key] = tensor
    loaded = LoadedQwenAudio(workdir, parse_config(config.to_dict()), weights,
                             {"tokenizer.json": workdir / "tokenizer.json"}, DEFAULT_CHAT_TEMPLATE)  # fmt: skip
    ours = Qwen2AudioASR.from_loaded(loaded, EngineConfig(device=device, dtype=dtype_name, max_batch_size=max_batch))
    ours.stop_tokens = (-1,)  # never sampled: every request generates exactly its budget
    return hf, processor, ours


def size_context(ours: Any, tokens: int) -> None:
    """The decoder context the executor reserves per row: this workload's (a 30 s window's
    audio tokens, the prompt text, the generated tokens), so the paged KV pool is sized to
    what the requests use rather than to the model's default context."""
    ours.context = ours.network.config.audio.max_audio_tokens + 160 + tokens


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak(device: str, reset: bool = False) -> float:
    import torch

    if not device.startswith("cuda"):
        return 0.0
    if reset:
        torch.cuda.reset_peak_memory_stats()
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**30


def run_hf(hf: Any, processor: Any, waves: list[np.ndarray], tokens: int, device: str) -> dict[str, Any]:
    import torch

    conversation = [{"role": "user", "content": [{"type": "audio", "audio_url": "x"},
                                                 {"type": "text", "text": "Transcribe the speech."}]}]  # fmt: skip
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    _peak(device, reset=True)
    _sync(device)
    t0 = time.perf_counter()
    inputs = processor(text=[prompt] * len(waves), audio=waves, sampling_rate=16000, return_tensors="pt",
                       padding=True).to(device)  # fmt: skip
    inputs["input_features"] = inputs["input_features"].to(hf.dtype)
    t1 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    _sync(device)
    t2 = time.perf_counter()
    new = out[:, inputs["input_ids"].shape[1] :]
    return {"wall_s": t2 - t0, "hf_generate_only_s": t2 - t1, "tokens": int(new.numel()),
            "peak_gib": _peak(device), "token_ids": new.tolist()}  # fmt: skip


def run_oasr(engine: Any, waves: list[np.ndarray], tokens: int, device: str) -> dict[str, Any]:
    from oasr.types import DecodingOptions

    opts = DecodingOptions(max_new_tokens=tokens)
    _peak(device, reset=True)
    _sync(device)
    t0 = time.perf_counter()
    out = engine.transcribe_offline(list(waves), opts)
    _sync(device)
    wall = time.perf_counter() - t0
    ids = [t.segments[0].tokens for t in out]
    return {"wall_s": wall, "tokens": sum(len(i) for i in ids), "peak_gib": _peak(device), "token_ids": ids}


def run_oasr_here(engine: Any, waves: list[np.ndarray], tokens: int) -> None:
    """:func:`run_oasr` with the scheduler's steps driven in this thread (the profiler records
    the host operators of the thread it runs in; the engine's own thread is stopped for it)."""
    from oasr.types import DecodingOptions

    sched = engine.scheduler
    sched.stop()
    options = DecodingOptions(max_new_tokens=tokens).validate_for(engine.model)
    futures = sched.submit_many(list(waves), options)
    sched.run_until_idle()
    for f in futures:
        f.result()


#: the executor's and the driver's methods timed per phase by ``--torch-profile`` (nested:
#: ``decode_steps`` and ``prefill`` include the ``sampling`` inside them)
PHASES = (("executor", "_begin", "begin"), ("driver", "encoder_inputs", "features"),
          ("step_model", "encode", "encoder"), ("executor", "_start_ready", "prefill"),
          ("executor", "_decode_step", "decode_steps"), ("executor", "_sample", "sampling"))  # fmt: skip


def phase_split(engine: Any, waves: list[np.ndarray], tokens: int, device: str) -> dict[str, Any]:
    """One OASR call with its phases timed (synchronised before and after each): seconds and
    calls per phase (``PHASES``) and the call's wall time."""
    ex = engine.scheduler.executor
    owners = {"executor": ex, "driver": ex.driver, "step_model": ex.step_model}
    totals: dict[str, list[float]] = {name: [0.0, 0] for _, _, name in PHASES}
    saved = []

    def timed(fn: Any, name: str) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            _sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(device)
                totals[name][0] += time.perf_counter() - t0
                totals[name][1] += 1

        return run

    for owner, attr, name in PHASES:
        obj = owners[owner]
        saved.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timed(getattr(obj, attr), name))
    try:
        wall = run_oasr(engine, waves, tokens, device)["wall_s"]
    finally:
        for obj, attr, old in saved:
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
    out: dict[str, Any] = {"batch": len(waves), "wall_s": round(wall, 4)}
    for name, (secs, calls) in totals.items():
        out[f"{name}_s"], out[f"{name}_calls"] = round(secs, 4), int(calls)
    out["decode_per_step_ms"] = round(1e3 * totals["decode_steps"][0] / max(1, totals["decode_steps"][1]), 3)
    return out


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]


def ttft(engine: Any, hf: Any, processor: Any, wave: np.ndarray, device: str) -> tuple[float, float]:
    from oasr.types import DecodingOptions

    _sync(device)
    t0 = time.perf_counter()
    it = engine.transcribe_partials(wave, DecodingOptions(max_new_tokens=4))
    next(it)
    oasr_s = time.perf_counter() - t0
    for _ in it:
        pass
    hf_s = run_hf(hf, processor, [wave], 1, device)["wall_s"]
    return oasr_s, hf_s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qwenbench", description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="default")
    p.add_argument("--shape", choices=sorted(SHAPES))
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--batch-sizes", help="comma-separated, e.g. 1,32")
    p.add_argument("--tokens", type=int, help="generated tokens per request")
    p.add_argument("--seconds", type=float, help="audio seconds per request (<= 30)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per side and batch size, alternating; the report gives the medians "
                        "(and every run): transformers' own time moves by ~25%% between runs")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--torch-profile", action="store_true",
                   help="also split one OASR call at the largest batch size by phase and profile one")
    args = p.parse_args(argv)
    prof = PROFILES[args.profile]
    shape, device = args.shape or prof["shape"], args.device or prof["device"]
    dtype, tokens = args.dtype or prof["dtype"], args.tokens or prof["tokens"]
    seconds = min(30.0, args.seconds or prof["seconds"])
    sizes = [int(b) for b in (args.batch_sizes or prof["batch_sizes"]).split(",")]

    from oasr.engine import ASREngine
    from oasr.scheduler import SchedulerConfig
    from oasr.types import EngineConfig

    rng = np.random.default_rng(0)
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    waves = [(0.2 * np.sin(2 * np.pi * (150 + 10 * k) * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)
             for k in range(max(sizes))]  # fmt: skip
    report: dict[str, Any] = {"benchmark": "qwenbench", "shape": shape, "device": device, "dtype": dtype,
                              "audio_seconds": seconds, "tokens_per_request": tokens, "results": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        t_build = time.perf_counter()
        hf, processor, ours = build(shape, device, dtype, Path(tmp), max(sizes))
        size_context(ours, tokens)
        report["build_s"] = round(time.perf_counter() - t_build, 2)
        engine = ASREngine(EngineConfig(device=device, dtype=dtype, max_batch_size=max(sizes)), model=ours,
                           scheduler_config=SchedulerConfig(max_batch_size=max(sizes)))  # fmt: skip
        try:
            for b in sizes:
                batch = waves[:b]
                run_oasr(engine, batch, tokens, device)  # warm-up: CUDA graphs for this batch
                run_hf(hf, processor, batch[:1], 2, device)
                runs = []
                for _ in range(max(1, args.repeats)):  # alternating, so drift hits both sides alike
                    o = run_oasr(engine, batch, tokens, device)
                    runs.append((o, run_hf(hf, processor, batch, tokens, device)))
                o, h = _median_run([r[0] for r in runs]), _median_run([r[1] for r in runs])
                agree = np.mean([a == b2 for x, y in zip(o["token_ids"], h["token_ids"], strict=True)
                                 for a, b2 in zip(x, y, strict=False)])  # fmt: skip
                row = {
                    "batch": b,
                    "oasr_s": round(o["wall_s"], 4), "transformers_s": round(h["wall_s"], 4),
                    "hf_generate_only_s": round(h["hf_generate_only_s"], 4),
                    "speedup": round(h["wall_s"] / o["wall_s"], 2),
                    "oasr_tokens_per_s": round(o["tokens"] / o["wall_s"], 1),
                    "transformers_tokens_per_s": round(h["tokens"] / h["wall_s"], 1),
                    "oasr_peak_gib": round(o["peak_gib"], 2), "transformers_peak_gib": round(h["peak_gib"], 2),
                    "tokens": o["tokens"], "token_agreement": round(float(agree), 3),
                }  # fmt: skip
                if len(runs) > 1:
                    row["oasr_runs_s"] = [round(r[0]["wall_s"], 4) for r in runs]
                    row["transformers_runs_s"] = [round(r[1]["wall_s"], 4) for r in runs]
                if b == 1:
                    o_ttft, h_ttft = ttft(engine, hf, processor, batch[0], device)
                    row["oasr_ttft_s"], row["transformers_ttft_s"] = round(o_ttft, 4), round(h_ttft, 4)
                report["results"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            if args.torch_profile:
                from benchmarks.profiling import profile_call

                batch = waves[: max(sizes)]
                report["phases"] = phase_split(engine, batch, tokens, device)
                print(json.dumps(report["phases"]), file=sys.stderr, flush=True)
                report["torch_profile"] = profile_call(lambda: run_oasr_here(engine, batch, tokens), device,
                                                       rows=25)  # fmt: skip
            ex = engine.scheduler.executor
            report["graph_replays"] = ex.stats["graph_replays"]
            report["oasr_kv_pool_gib"] = round(ex.memory_bytes / 2**30, 2)
        finally:
            engine.shutdown()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return report


if __name__ == "__main__":
    main()
