"""FunASR Paraformer benchmark: OASR beside FunASR's own ``AutoModel`` on the same device.

    python -m benchmarks.funasrbench --device cuda                        # H200: < 3 minutes
    python -m benchmarks.funasrbench --device cpu --shape tiny --batch 4 --repeats 1   # a check

paraformer-large's shape (``--shape large``: SANM encoder 50 x 512, decoder 16 x 512, vocabulary
8404, about 220M parameters; random weights) is written in FunASR's release layout
(``config.yaml``, ``model.pt``, ``am.mvn``, ``tokens.json`` ...) and loaded as released by both.
Inputs: the repository's real 16 kHz speech clips (Mandarin AISHELL and English LibriSpeech,
2-9 s), repeated to ``--batch`` inputs of their real lengths. One batch of ``--batch`` inputs per
call, from float waveforms to text, both sides:

* OASR: ``model.transcribe(waves)`` (fbank + LFR + CMVN on the device, encoder, CIF, decoder;
  the engine's dtype: fp16 on CUDA), and the same batch through an ``ASREngine`` (its scheduler
  and batch executor: what ``oasr transcribe`` and the server run);
* FunASR: ``AutoModel(model=DIR, device=...).generate(input=waves, batch_size=--batch)`` (its
  default fp32; its frontend runs on the CPU per input, as FunASR does).

On CUDA OASR replays the encoder and the decoder from CUDA graphs (the model's default); the
report then also times the same call eagerly (an H200, batch 64 at paraformer-large's shape, fp16:
0.0357 s with graphs, 0.0463 s eager); ``--no-graphs`` (or ``OASR_FUNASR_GRAPHS=0``) times the
eager call alone.

RTFx = audio seconds / wall seconds, best of ``--repeats`` after a warm-up. Prints one JSON
object with both RTFx values and their ratio. Needs ``funasr`` (``pip install --no-deps
funasr==1.4.16 omegaconf kaldiio librosa lazy_loader six``); ``--no-funasr`` runs OASR alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SPEECH = REPO / "tests" / "data" / "speech"
CLIPS = [
    "zh_aishell_BAC009S0724W0121.wav", "zh_aishell_BAC009S0764W0121.wav",
    "zh_aishell_BAC009S0764W0122.wav", "en_ls_1089-134686-0001.wav",
    "en_ls_1221-135766-0002.wav", "en_ls_1272-128104-0000.wav", "en_ls_1995-1837-0001.wav",
    "en_ls_2830-3980-0043.wav", "en_ls_4507-16021-0012.wav",
]  # fmt: skip


def read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _best(fn, repeats: int, device: str) -> float:  # noqa: ANN001
    fn()  # warm-up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=["large", "tiny"], default="large")
    ap.add_argument("--model", choices=["Paraformer", "BiCifParaformer"], default="Paraformer")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="OASR dtype (auto: fp16 on CUDA, fp32 on CPU)")
    ap.add_argument("--timestamps", action="store_true",
                    help="word timestamps on both sides (FunASR: output_timestamp=True)")  # fmt: skip
    ap.add_argument("--no-funasr", action="store_true", help="OASR only")
    ap.add_argument("--ckpt-dir", default=None, help="an existing release instead of a random one")
    ap.add_argument("--profile", action="store_true",
                    help="also time the stages and profile one OASR call (top operators to "
                         "stderr and in the JSON)")  # fmt: skip
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="CUDA graphs for the encoder and decoder (default: on with CUDA, unless "
                         "OASR_FUNASR_GRAPHS=0); with them the report also times the eager call "
                         "and compares texts; --no-graphs times the eager call alone")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args(argv)

    import torch

    from oasr.checkpoint import load_model
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig
    from oasr_models_funasr.nn import num_parameters
    from oasr_models_funasr.testing import LARGE, TINY, write_release, zh_tokens

    waves = [read_wav(SPEECH / CLIPS[i % len(CLIPS)]) for i in range(args.batch)]
    audio_s = sum(len(w) for w in waves) / 16000
    out: dict = {"device": args.device, "shape": args.shape, "model": args.model,
                 "batch": args.batch, "audio_seconds": round(audio_s, 2)}  # fmt: skip
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if args.ckpt_dir:
            ckpt = Path(args.ckpt_dir)
        else:
            dims = LARGE if args.shape == "large" else TINY
            ckpt = write_release(Path(tmp) / "release", model=args.model, dims=dims,
                                 tokens=zh_tokens(8400 if args.shape == "large" else 200),
                                 cmvn_audio=waves[: len(CLIPS)])  # fmt: skip
        out["write_release_s"] = round(time.perf_counter() - t0, 2)
        cfg = EngineConfig(ckpt_dir=str(ckpt), device=args.device, dtype=args.dtype,
                           max_batch_size=args.batch)  # fmt: skip
        model = load_model(cfg)
        if args.graphs is not None:
            model.cuda_graphs = args.graphs
        out["parameters_m"] = round(num_parameters(model.net) / 1e6, 1)
        out["oasr_dtype"] = str(model.net.dtype).removeprefix("torch.")
        opts = DecodingOptions(word_timestamps=args.timestamps)
        out["timestamps"] = args.timestamps
        texts: list[str] = []

        def oasr_call() -> None:
            texts[:] = [t.text for t in model.transcribe(waves, opts)]

        t = _best(oasr_call, args.repeats, args.device)
        out["oasr_seconds"] = round(t, 4)
        out["oasr_rtfx"] = round(audio_s / t, 1)
        out["oasr_chars"] = sum(len(x) for x in texts)
        if model.cuda_graphs and args.device.startswith("cuda"):
            # the same call without CUDA graphs: what the graphs win, and that they agree
            eager_texts: list[str] = []
            model.cuda_graphs = False
            try:
                t = _best(lambda: eager_texts.__setitem__(slice(None), [
                    x.text for x in model.transcribe(waves, opts)]), args.repeats, args.device)  # fmt: skip
            finally:
                model.cuda_graphs = True
            out["oasr_eager_seconds"] = round(t, 4)
            out["texts_equal_eager"] = sum(a == b for a, b in zip(texts, eager_texts, strict=True))
            out["cuda_graphs"] = dict(model._graphs.stats, disabled=model._graphs.disabled)
        if args.profile:
            out["stages"] = stages(model, waves, args)
        engine = ASREngine(cfg, model=model)
        try:
            t = _best(lambda: engine.transcribe_arrays(waves, opts), args.repeats, args.device)
        finally:
            engine.shutdown()
        out["oasr_engine_seconds"] = round(t, 4)
        out["oasr_engine_rtfx"] = round(audio_s / t, 1)
        if not args.no_funasr:
            if importlib.util.find_spec("funasr") is None:
                out["funasr_error"] = "funasr is not installed"
            else:
                import logging

                from funasr import AutoModel

                ref = AutoModel(model=str(ckpt), device=args.device, disable_update=True,
                                disable_pbar=True, disable_log=True, log_level="ERROR",
                                ncpu=torch.get_num_threads())  # fmt: skip
                logging.getLogger().setLevel(logging.WARNING)
                ref_texts: list[str] = []

                def funasr_call() -> None:
                    res = ref.generate(input=waves, batch_size=args.batch, disable_pbar=True,
                                       output_timestamp=args.timestamps)  # fmt: skip
                    ref_texts[:] = [r["text"] for r in res]

                t = _best(funasr_call, args.repeats, args.device)
                out["funasr_seconds"] = round(t, 4)
                out["funasr_rtfx"] = round(audio_s / t, 1)
                out["speedup_vs_funasr"] = round(out["funasr_seconds"] / out["oasr_seconds"], 2)
                out["engine_speedup_vs_funasr"] = round(
                    out["funasr_seconds"] / out["oasr_engine_seconds"], 2
                )
                if out["oasr_dtype"] == "float32":
                    # with timestamps FunASR's text is its timestamp words joined by spaces
                    def norm(x: str) -> str:
                        return x.replace(" ", "") if args.timestamps else x

                    out["texts_equal_funasr"] = sum(
                        norm(a) == norm(b) for a, b in zip(texts, ref_texts, strict=False)
                    )
    text = json.dumps(out, indent=2, ensure_ascii=False)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n", encoding="utf-8")
    return out


def stages(model, waves: list[np.ndarray], args: argparse.Namespace) -> dict:  # noqa: ANN001
    """Where one call's time goes: features alone, features + encoder + CIF predictor, the
    whole call; and a torch-profiler breakdown of one call."""
    import torch

    from benchmarks.profiling import profile_call
    from oasr.types import DecodingOptions

    opts = DecodingOptions(word_timestamps=args.timestamps)
    with torch.no_grad():
        feats_s = _best(lambda: model.features(waves), args.repeats, args.device)
        enc_s = _best(lambda: model.encode_and_predict(*model.features(waves)), args.repeats,
                      args.device)  # fmt: skip
        whole_s = _best(lambda: model.transcribe(waves, opts), args.repeats, args.device)
        prof = profile_call(lambda: model.transcribe(waves, opts), args.device)
    out = {"features_s": round(feats_s, 4), "encoder_predictor_s": round(enc_s - feats_s, 4),
           "cif_decoder_rest_s": round(whole_s - enc_s, 4), "profile": prof}  # fmt: skip
    return out


if __name__ == "__main__":
    main()
