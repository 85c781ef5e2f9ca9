"""Synthetic Whisper workload: OASR's engine beside ``transformers`` on identical work.

Both backends get the same random weights (a ``WhisperForConditionalGeneration`` of the chosen
shapes, converted in memory to OASR's naming), the same dtype, the same 30-second noise inputs and
the same forced decode: initial tokens ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``
then exactly ``--tokens`` greedy tokens each, with ``<|endoftext|>`` suppressed on both sides (the
same suppress-token list goes to both). All requests arrive at t=0; a request's latency is the
time until its result is available.

Backends:
  oasr_engine    ASREngine.submit from the caller thread, the scheduler thread batching with
                 continuous batching of the decoder (paged KV cache; CUDA graphs on GPU)
  oasr_batch     WhisperASR.transcribe: the model's per-batch path (batches of --batch-size)
  transformers   WhisperForConditionalGeneration (attn_implementation="sdpa"),
                 GenerationMixin.generate greedy, batches of --batch-size in arrival order,
                 features by WhisperFeatureExtractor on the same device
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SHAPES: dict[str, dict[str, int]] = {
    # d_model, layers, heads, mels, vocab (multilingual vocabularies need the real tokenizer ids)
    "smoke": {"d": 64, "enc": 2, "dec": 2, "heads": 4, "mels": 80, "vocab": 51865},
    "tiny": {"d": 384, "enc": 4, "dec": 4, "heads": 6, "mels": 80, "vocab": 51865},
    "large-v3": {"d": 1280, "enc": 32, "dec": 32, "heads": 20, "mels": 128, "vocab": 51866},
    "large-v3-turbo": {"d": 1280, "enc": 32, "dec": 4, "heads": 20, "mels": 128, "vocab": 51866},
}


@dataclass
class SynthResult:
    backend: str
    requests: int
    batch_size: int
    wall_s: float
    audio_s: float
    rtfx: float
    tokens: int
    tokens_per_s: float
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    peak_gpu_mem_gib: float | None
    texts: list[str] = field(repr=False, default_factory=list)
    #: every measured run's wall seconds (``wall_s`` is the best of them)
    walls_s: list[float] = field(default_factory=list)
    #: ``benchmarks.profiling.profile_call`` of one more run (``profile=True``)
    profile: dict[str, Any] | None = None


def _pct(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def _tokenizer_asset() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("whisper")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / "assets" / "multilingual.tiktoken"
            if p.is_file():
                return p
    p = REPO / ".devcarry" / "engine" / "multilingual.tiktoken"
    if p.is_file():
        return p
    raise FileNotFoundError("multilingual.tiktoken not found (install openai-whisper)")


def build_models(shape: str, device: str, dtype_name: str, max_batch_size: int, seed: int = 0):
    """(hf_model, WhisperASR) sharing one set of random weights."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from oasr.types import EngineConfig
    from oasr_models_whisper.checkpoints import LoadedWhisper, _default_heads, _hf_name
    from oasr_models_whisper.model import WhisperASR
    from oasr_models_whisper.network import WhisperDims

    s = SHAPES[shape]
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype_name]
    cfg = WhisperConfig(
        vocab_size=s["vocab"], num_mel_bins=s["mels"], d_model=s["d"],
        encoder_layers=s["enc"], decoder_layers=s["dec"],
        encoder_attention_heads=s["heads"], decoder_attention_heads=s["heads"],
        encoder_ffn_dim=4 * s["d"], decoder_ffn_dim=4 * s["d"],
        max_source_positions=1500, max_target_positions=448,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        hf = WhisperForConditionalGeneration(cfg)
    hf = hf.to(dtype).eval().requires_grad_(False)
    # the default init gives near-uniform logits; spread the output layer for decisive argmaxes
    with torch.no_grad():
        emb = hf.model.decoder.embed_tokens.weight
        emb.normal_(0.0, 1.0, generator=None)
    state = {}
    for k, v in hf.state_dict().items():
        new = _hf_name(k)
        if new is not None:
            state[new] = v
    dims = WhisperDims(
        n_mels=s["mels"], n_audio_ctx=1500, n_audio_state=s["d"], n_audio_head=s["heads"],
        n_audio_layer=s["enc"], n_vocab=s["vocab"], n_text_ctx=448, n_text_state=s["d"],
        n_text_head=s["heads"], n_text_layer=s["dec"],
    )  # fmt: skip
    n_lang = s["vocab"] - 51765 - 1
    loaded = LoadedWhisper(
        dims=dims, state_dict=state, alignment_heads=_default_heads(dims),
        tokenizer_files={"multilingual.tiktoken": _tokenizer_asset()}, is_multilingual=True,
        num_languages=n_lang, source_format="hf",
    )  # fmt: skip
    asr = WhisperASR.from_loaded(
        loaded, EngineConfig(device=device, dtype=dtype_name, max_batch_size=max_batch_size)
    )
    return hf, asr


def run_synthetic(shape: str = "smoke", device: str = "cpu", dtype: str = "float32",
                  requests: int = 4, batch_size: int = 2, tokens: int = 10,
                  backends: tuple[str, ...] = ("oasr_engine", "transformers"),
                  seconds: float = 30.0, cuda_graphs: bool | None = None, seed: int = 0,
                  warmup: bool = True, varied: bool = False,
                  encoder_lookahead: int | None = None, repeats: int = 1,
                  profile: bool = False) -> dict[str, Any]:  # fmt: skip
    """``repeats``: measured runs per backend after the warm-up; the best wall counts (the
    others are reported), since one run of either side varies by 10-25 % between calls on the
    device. ``profile``: one more run per backend under ``torch.profiler``, its top device
    operators in the report (benchmarks/profiling.py). ``varied``: request ``i`` decodes ``targets[i]`` tokens, drawn uniformly from
    [tokens/4, 7*tokens/4] (mean ``tokens``), instead of ``tokens`` each. ``transformers`` then
    stops each row at its length (a per-row stopping criterion) but keeps the batch until its
    longest row ends; OASR refills finished rows."""
    import numpy as np
    import torch

    from oasr.engine import ASREngine
    from oasr.scheduler import SchedulerConfig
    from oasr.types import DecodingOptions, EngineConfig
    from oasr_models_whisper.decoding import resolve_suppress_tokens

    hf, asr = build_models(shape, device, dtype, batch_size, seed)
    tok = asr.tokenizer
    rng = np.random.default_rng(seed)
    n_samples = int(seconds * 16000)
    audios = [(0.1 * rng.standard_normal(n_samples)).astype(np.float32) for _ in range(requests)]
    audio_s = requests * seconds
    if varied:
        lo, hi = max(1, tokens // 4), min(224, 7 * tokens // 4)
        targets = [int(x) for x in rng.integers(lo, hi + 1, size=requests)]
    else:
        targets = [tokens] * requests
    suppress = resolve_suppress_tokens(tok, (tok.eot,), None)
    options = DecodingOptions.build(
        language="en", without_timestamps=True, max_new_tokens=tokens, suppress_tokens=(tok.eot,),
        suppress_blank=False, no_speech_threshold=None, logprob_threshold=None,
        compression_ratio_threshold=None, condition_on_previous_text=False, temperature=0.0,
    )  # fmt: skip
    init = [*tok.sot_sequence("en", "transcribe", multilingual=True), tok.no_timestamps]
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    results: list[SynthResult] = []
    engine = None

    def mem_start() -> int:
        if not cuda:
            return 0
        sync()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def mem_peak(base: int) -> float | None:
        if not cuda:
            return None
        sync()
        return (torch.cuda.max_memory_allocated() - base) / 2**30

    for name in backends:
        if name in ("oasr_engine", "oasr_batch"):
            if engine is None:
                sc = SchedulerConfig(max_batch_size=batch_size, cuda_graphs=cuda_graphs,
                                     max_wait_steps=10**6, encoder_lookahead=encoder_lookahead)  # fmt: skip
                engine = ASREngine(EngineConfig(device=device, dtype=dtype, max_batch_size=batch_size),
                                   model=asr, scheduler_config=sc)  # fmt: skip

            def run_engine(xs: list, name: str = name, engine: Any = engine) -> tuple[list[str], list[float], int]:
                t0 = time.perf_counter()
                if name == "oasr_batch":
                    if varied:
                        raise ValueError("oasr_batch needs one options set per call: not with varied")
                    # the model's own per-batch path, beside the engine's scheduler: whole
                    # batches of batch_size, one WhisperASR.transcribe call each
                    outs = [o for s in range(0, len(xs), batch_size)
                            for o in asr.transcribe([audios[i] for i in xs[s:s + batch_size]], options)]
                    sync()
                    t1 = time.perf_counter() - t0
                    return [o.text for o in outs], [t1] * len(xs), len(xs) * tokens  # forced length
                ex = engine.scheduler.executor
                before = ex.stats.get("tokens", 0)
                lat: list[float] = [0.0] * len(xs)
                futs = []
                for k, i in enumerate(xs):
                    o = options if not varied else dataclasses.replace(options, max_new_tokens=targets[i])
                    f = engine.submit(audios[i], o)
                    f.add_done_callback(lambda _f, k=k: lat.__setitem__(k, time.perf_counter() - t0))
                    futs.append(f)
                outs = [f.result() for f in futs]
                return [o.text for o in outs], lat, ex.stats.get("tokens", 0) - before

            runner = run_engine
        elif name == "transformers":
            from transformers import GenerationConfig, StoppingCriteriaList, WhisperFeatureExtractor
            from transformers.generation.utils import GenerationMixin

            fe = WhisperFeatureExtractor(feature_size=asr.network.dims.n_mels)
            gen = GenerationConfig(
                max_new_tokens=max(targets), do_sample=False, num_beams=1, suppress_tokens=list(suppress),
                eos_token_id=tok.eot, pad_token_id=tok.eot, decoder_start_token_id=tok.sot,
                use_cache=True,
            )  # fmt: skip
            hf.generation_config = gen

            def run_hf(xs: list, fe: Any = fe, gen: Any = gen) -> tuple[list[str], list[float], int]:
                t0 = time.perf_counter()
                lat: list[float] = []
                texts: list[str] = []
                ntok = 0
                for k in range(0, len(xs), batch_size):
                    ids = xs[k : k + batch_size]
                    chunk = [audios[i] for i in ids]
                    want = [targets[i] for i in ids]
                    kw = {"device": device} if cuda else {}
                    extra = {}
                    if varied:
                        extra["stopping_criteria"] = StoppingCriteriaList([_RowLength(want, len(init), device)])
                        extra["max_new_tokens"] = max(want)
                    feats = fe(chunk, sampling_rate=16000, return_tensors="pt", **kw).input_features
                    feats = feats.to(device=device, dtype=hf.dtype)
                    dec = torch.tensor([init] * len(chunk), device=device)
                    with torch.inference_mode():
                        out = GenerationMixin.generate(hf, input_features=feats, decoder_input_ids=dec,
                                                       decoder_attention_mask=torch.ones_like(dec),
                                                       generation_config=gen, **extra)  # fmt: skip
                    rows = out[:, len(init) :].tolist()
                    sync()
                    now = time.perf_counter() - t0
                    for row, n in zip(rows, want, strict=True):
                        body = row[: row.index(tok.eot)] if tok.eot in row else row
                        body = body[:n]
                        ntok += len(body)
                        texts.append(tok.decode(body).strip())
                        lat.append(now)
                return texts, lat, ntok

            runner = run_hf
        else:
            raise ValueError(f"unknown synthetic backend {name!r}")

        base = mem_start()  # peak over warm-up and run, above the weights: caches, graphs, activations
        everything = list(range(requests))
        if warmup:
            runner(everything[:batch_size])
            if name == "oasr_engine":
                runner(everything)  # every graph bucket this workload meets
        sync()
        walls: list[float] = []
        best: tuple[list[str], list[float], int] | None = None
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            run = runner(everything)
            sync()
            walls.append(time.perf_counter() - start)
            if best is None or walls[-1] <= min(walls):
                best = run
        texts, lat, ntok = best
        wall = min(walls)
        report_profile = None
        if profile:
            from benchmarks.profiling import profile_call

            report_profile = profile_call(functools.partial(runner, everything), device)
        results.append(SynthResult(
            name, requests, batch_size, wall, audio_s, audio_s / wall, ntok, ntok / wall,
            _pct(lat, 50), _pct(lat, 90), _pct(lat, 99), mem_peak(base), texts,
            [round(w, 4) for w in walls], report_profile,
        ))  # fmt: skip
        if engine is not None:  # free the engine's caches before the next backend
            engine.shutdown()
            engine = None
            import gc

            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    agreement = None
    names = [r.backend for r in results]
    if "transformers" in names and len(results) > 1:
        ref = results[names.index("transformers")].texts
        other = results[0].texts
        agreement = sum(a == b for a, b in zip(ref, other, strict=True)) / max(1, len(ref))
    return {
        "workload": "synthetic",
        "shape": shape,
        "device": device,
        "dtype": dtype,
        "requests": requests,
        "batch_size": batch_size,
        "tokens_per_request": tokens,
        "varied": varied,
        "tokens_total": sum(targets),
        "audio_seconds_each": seconds,
        "text_agreement_with_transformers": agreement,
        "results": [asdict(r) for r in results],
    }


def _RowLength(want: list[int], start: int, device: str):  # noqa: N802 - a class factory
    """transformers StoppingCriteria: row i is done once it has ``want[i]`` new tokens."""
    import torch
    from transformers import StoppingCriteria

    class RowLength(StoppingCriteria):
        def __init__(self) -> None:
            self.want = torch.tensor(want, device=device)

        def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001
            return (input_ids.shape[1] - start) >= self.want

    return RowLength()


def print_table(report: dict[str, Any]) -> None:
    rows = report["results"]
    base = rows[0]["wall_s"] if rows else 1.0
    print(f"synthetic {report['shape']} {report['device']} {report['dtype']}: {report['requests']} x "
          f"{report['audio_seconds_each']:.0f} s, "
          f"{'varied lengths, mean ' if report.get('varied') else ''}{report['tokens_per_request']} tokens each, "
          f"batch {report['batch_size']}")  # fmt: skip
    print(f"{'backend':14} {'wall s':>8} {'RTFx':>8} {'tok/s':>9} {'p50 s':>7} {'p90 s':>7} "
          f"{'p99 s':>7} {'peak GiB':>9} {'time/' + rows[0]['backend']:>18}")  # fmt: skip
    for r in rows:
        mem = f"{r['peak_gpu_mem_gib']:9.2f}" if r["peak_gpu_mem_gib"] is not None else "        -"
        print(f"{r['backend']:14} {r['wall_s']:8.2f} {r['rtfx']:8.1f} {r['tokens_per_s']:9.1f} "
              f"{r['latency_p50_s']:7.2f} {r['latency_p90_s']:7.2f} {r['latency_p99_s']:7.2f} {mem} "
              f"{r['wall_s'] / base:18.2f}")  # fmt: skip
    if report.get("text_agreement_with_transformers") is not None:
        print(f"outputs identical to transformers: {100 * report['text_agreement_with_transformers']:.0f}%")
