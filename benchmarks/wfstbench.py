"""WFST decoding: the batched token-passing search of ``oasr-decoders-wfst`` beside kaldi-decoder's
FasterDecoder (one process per CPU core) on the same realistic graph and log-probs, in one call.

    python -m benchmarks.wfstbench --device cuda --out wfst_h200.json   # issue #21's workload
    python -m benchmarks.wfstbench --quick                              # CPU, a check

Graph: TLG over the CMU dictionary's 39 phones (+ blank) and the top ``--words`` words of the
US English trigram LM that Debian's ``pocketsphinx-en-us`` ships (the pocketsphinx wheel ships
the same files); built with kaldifst by ``oasr graph build``'s code, or read from ``--graph``.
Input: batch 64 of 30 s at 25 frames/s (750 frames) of synthetic peaky CTC log-probs that spell
random vocabulary words (seeded). Reported: median seconds of each decoder over the batch,
real-time factor inverse (audio seconds / decode seconds), the ratio, and how many utterances
give the same words.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

FRAME_RATE = 25.0
DEBIAN_MODEL = Path("/usr/share/pocketsphinx/model/en-us")


def pocketsphinx_model_dir() -> Path | None:
    """The en-us model folder of Debian's pocketsphinx-en-us, else of the pocketsphinx wheel
    (found without importing it); None when neither is installed."""
    candidates = [DEBIAN_MODEL]
    spec = importlib.util.find_spec("pocketsphinx")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc) / "model" / "en-us")
    for c in candidates:
        if (c / "en-us.lm.bin").is_file() and (c / "cmudict-en-us.dict").is_file():
            return c
    return None


def realistic_lexicon_and_lm(num_words: int, min_log10_prob: float | None = None,
                             model_dir: Path | None = None):  # fmt: skip
    """(lexicon, ArpaLM): the ``num_words`` most probable plain words of the pocketsphinx
    trigram LM that the CMU dictionary spells, with every pronunciation, and the LM's n-grams
    over them (bigrams and trigrams at least ``min_log10_prob`` probable)."""
    from oasr_decoders_wfst.build import read_lexicon
    from oasr_decoders_wfst.sphinx_lm import read_sphinx_trie

    model_dir = model_dir or pocketsphinx_model_dir()
    if model_dir is None:
        raise FileNotFoundError("pocketsphinx-en-us (apt) or pocketsphinx (pip) is not installed")
    lexicon = read_lexicon((model_dir / "cmudict-en-us.dict").read_text(encoding="utf-8").splitlines())
    plain = re.compile(r"[a-z][a-z']*")
    spelt = {w for w, _ in lexicon if plain.fullmatch(w)}
    unigrams = read_sphinx_trie(model_dir / "en-us.lm.bin", vocabulary=spelt, max_order=1).ngrams[0]
    ranked = sorted((p for (w,), (p, _) in unigrams.items() if w in spelt), reverse=True)
    cut = ranked[min(num_words, len(ranked)) - 1]
    vocab = {w for (w,), (p, _) in unigrams.items() if w in spelt and p >= cut}
    lm = read_sphinx_trie(model_dir / "en-us.lm.bin", vocabulary=vocab, min_log10_prob=min_log10_prob)
    return [(w, p) for w, p in lexicon if w in vocab], lm


def build_realistic_graph(num_words: int, min_log10_prob: float | None = None,
                          model_dir: Path | None = None):  # fmt: skip
    from oasr_decoders_wfst.build import build_tlg

    lexicon, lm = realistic_lexicon_and_lm(num_words, min_log10_prob, model_dir)
    graph = build_tlg(lexicon, lm)
    graph.info["lexicon"] = [p for _, p in lexicon]  # for synthetic_batch
    return graph


def synthetic_batch(graph, batch: int, frames: int, seed: int) -> np.ndarray:
    """[batch, frames, tokens] float32 peaky log-probs spelling random words of the graph."""
    from oasr_decoders_wfst.synthetic import peaky_log_probs

    lexicon = graph.info.get("lexicon")
    rng = np.random.default_rng(seed)
    tok = {u: i for i, u in enumerate(graph.tokens)}
    prons = [[tok[u] for u in p] for p in lexicon] if lexicon else [[i] for i in range(1, graph.num_tokens)]
    return np.stack([peaky_log_probs(prons, frames, graph.num_tokens, rng) for _ in range(batch)])


# -- kaldi-decoder in worker processes ---------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _worker_init(fst_path: str, opts: dict[str, Any]) -> None:
    import sys

    import kaldifst

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "wfst"))
    _WORKER["fst"] = kaldifst.StdVectorFst.read(fst_path)  # the graph image, converted once
    _WORKER["opts"] = opts


def _worker_decode(scaled: np.ndarray) -> list[int]:
    from _kaldi_reference import kaldi_decode

    o = _WORKER["opts"]
    return kaldi_decode(_WORKER["fst"], scaled, o["beam"], o["max_active"], o["min_active"],
                        o["beam_delta"])[0]  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch

    from oasr_decoders_wfst.decoder import WfstDecoder, WfstSearchOptions
    from oasr_decoders_wfst.graph import load_graph, save_graph

    tmp = tempfile.TemporaryDirectory()
    if args.graph:
        graph_path = args.graph
        graph = load_graph(graph_path)
        build_s = None
    else:
        t0 = time.perf_counter()
        graph = build_realistic_graph(args.words, args.min_log10_prob)
        build_s = time.perf_counter() - t0
        graph_path = str(Path(tmp.name) / "tlg.npz")
        save_graph(graph, graph_path)
        if args.save_graph:
            save_graph(graph, args.save_graph)
    frames = int(round(args.seconds * FRAME_RATE))
    lp = synthetic_batch(graph, args.batch, frames, args.seed)
    opts = WfstSearchOptions(beam=args.beam, max_active=args.max_active, min_active=args.min_active,
                             acoustic_scale=args.acoustic_scale)  # fmt: skip
    if args.device == "cpu":
        torch.set_num_threads(1)  # many small ops: intra-op threads only contend
    dec = WfstDecoder(graph, args.device, opts)
    x = torch.from_numpy(lp).to(args.device)

    def sync() -> None:
        if x.is_cuda:
            torch.cuda.synchronize()

    def timed(fused: bool, threads: int | None = None, variant: str | None = None) -> tuple[list[float], Any]:  # fmt: skip
        if threads is not None:
            os.environ["OASR_WFST_FUSED_THREADS"] = str(threads)
        if variant is not None:
            os.environ["OASR_WFST_FUSED_VARIANT"] = variant
        try:
            dec.decode(x[: min(2, args.batch)], fused=fused)  # warm-up (and the kernel's JIT)
            sync()
            runs, out = [], None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = dec.decode(x, fused=fused)
                sync()
                runs.append(time.perf_counter() - t0)
        finally:
            if threads is not None:
                os.environ.pop("OASR_WFST_FUSED_THREADS", None)
            if variant is not None:
                os.environ.pop("OASR_WFST_FUSED_VARIANT", None)
        return runs, out

    variants: dict[str, Any] = {}
    if x.is_cuda and args.fused:
        try:
            variants["fused"] = timed(True)
            print(f"fused: {statistics.median(variants['fused'][0]):.4f} s", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the tensor search still runs
            variants["fused_error"] = repr(exc)
        # the other kernel variants (fused.VARIANTS), each also at the other block sizes
        for entry in [None, *args.fused_variants]:
            # "variant@threads": that one block size only, not each of --fused-threads
            variant, _, only = (entry or "").partition("@")
            variant = variant or None
            name = "fused" if variant is None else f"fused_{variant}"
            for threads in [int(only)] if only else [None, *args.fused_threads]:
                key = name if threads is None else f"{name}_{threads}_threads"
                if key == "fused":
                    continue
                try:
                    variants[key] = timed(True, threads, variant)
                    # as each is timed: a run cut short still says something
                    print(f"{key}: {statistics.median(variants[key][0]):.4f} s", file=sys.stderr, flush=True)
                except Exception as exc:  # noqa: BLE001 - reported
                    variants[f"{key}_error"] = repr(exc)
    if not args.no_tensor:
        variants["tensor"] = timed(False)
    main_key = "fused" if "fused" in variants else "tensor"
    times, hyps = variants[main_key]
    ours_s = statistics.median(times)

    scaled = [lp[b] * np.float32(args.acoustic_scale) for b in range(args.batch)]
    workers = args.threads or os.cpu_count() or 1
    kd = dict(beam=opts.beam, max_active=opts.max_active, min_active=opts.min_active,
              beam_delta=opts.beam_delta)  # fmt: skip
    # spawn: the workers must not inherit this process's CUDA context
    ctx = multiprocessing.get_context("spawn")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "wfst"))
    from _kaldi_reference import to_kaldifst

    fst_path = str(Path(tmp.name) / "tlg.fst")
    to_kaldifst(graph).write(fst_path)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(fst_path, kd)) as pool:  # fmt: skip
        list(pool.map(_worker_decode, scaled[:workers]))  # every worker has its graph
        ktimes = []
        ref = None
        for _ in range(args.ref_repeats):
            t0 = time.perf_counter()
            ref = list(pool.map(_worker_decode, scaled, chunksize=1))
            ktimes.append(time.perf_counter() - t0)
    kaldi_s = statistics.median(ktimes)
    same = sum(h.word_ids == r for h, r in zip(hyps, ref, strict=True))
    audio_s = args.batch * args.seconds
    report = {
        "workload": {"batch": args.batch, "seconds": args.seconds, "frames": frames,
                     "tokens": graph.num_tokens, "seed": args.seed},
        "graph": {"states": graph.num_states, "arcs": graph.num_arcs, "words": len(graph.words) - 1,
                  "build_s": build_s, "source": args.graph or f"pocketsphinx en-us top {args.words} words, "
                                            f"n-grams >= 10^{args.min_log10_prob}"},
        "options": {"beam": opts.beam, "max_active": opts.max_active, "min_active": opts.min_active,
                    "acoustic_scale": opts.acoustic_scale},
        "oasr": {"device": str(x.device), "search": main_key, "seconds": ours_s,
                 "rtfx": audio_s / ours_s, "runs": times},
        "oasr_variants": {
            k: ({"seconds": statistics.median(v[0]), "rtfx": audio_s / statistics.median(v[0]),
                 "same_words_as_kaldi": f"{sum(h.word_ids == r for h, r in zip(v[1], ref, strict=True))}/{args.batch}"}
                if isinstance(v, tuple) else v)
            for k, v in variants.items()
        },
        "kaldi_decoder": {"processes": workers, "seconds": kaldi_s, "rtfx": audio_s / kaldi_s,
                          "runs": ktimes},
        "speedup": kaldi_s / ours_s,
        "same_words": f"{same}/{args.batch}",
        "words_per_utt": statistics.mean(len(h.word_ids) for h in hyps),
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "cpu_count": os.cpu_count(),
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }  # fmt: skip
    tmp.cleanup()
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--graph", help="a graph image to use instead of building one")
    p.add_argument("--save-graph", help="also write the built graph image here")
    p.add_argument("--words", type=int, default=5000, help="vocabulary of the built graph")
    p.add_argument("--min-log10-prob", type=float, default=-2.0,
                   help="drop bigrams/trigrams less probable than this (graph size)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--beam", type=float, default=12.0)
    p.add_argument("--max-active", type=int, default=7000)
    p.add_argument("--min-active", type=int, default=20)
    p.add_argument("--acoustic-scale", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="kaldi-decoder processes (default: all cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ref-repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fused-threads", type=lambda v: [int(t) for t in v.split(",") if t], default=[],
                   help="with --fused: also time each kernel variant at these threads per block (e.g. 256,1024)")
    p.add_argument("--fused-variants", type=lambda v: [t for t in v.split(",") if t], default=[],
                   help="with --fused: also time these kernel variants (oasr_decoders_wfst.fused.VARIANTS), "
                        "each as fused_<variant>; <variant>@<threads> times that block size only")
    p.add_argument("--fused", action="store_true",
                   help="also time the fused CUDA kernel (the default variant, as \"fused\")")
    p.add_argument("--no-tensor", action="store_true", help="skip the tensor search")
    p.add_argument("--quick", action="store_true", help="CPU, 300 words, batch 4 of 4 s: a check")
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.words, args.batch, args.seconds, args.repeats = "cpu", 300, 4, 4.0, 1
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
