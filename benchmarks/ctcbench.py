"""CTC prefix beam search: the batched tensor search (``oasr.decoders.ctc_gpu``) beside the host
search (``oasr.decoders.ctc``) and WeNet's Python search (restated below), on the same
log-posteriors, in one call.

    python -m benchmarks.ctcbench --device cuda --out ctc_h200.json   # issue #21's workload
    python -m benchmarks.ctcbench --quick                             # CPU, seconds: a check
    python -m benchmarks.ctcbench --device cuda --conformer --out x.json   # + the decoder's share

Workload (defaults): beam 10, vocabulary 5000, batch 64, 30 s at 25 frames/s (750 frames),
realistic CTC posteriors (mostly blank, a few confident tokens, a long tail; seeded). Every
search decodes the whole batch; the host searches run one utterance after another as the CTC
families call them. Reported: median seconds of each (``--repeats``, the host searches once
unless ``--host-repeats``), frames per second, the ratios, and whether the n-best lists
(tokens and times) agree exactly. The host searches run on the first ``--host-rows`` (16)
utterances and are scaled to the batch (``extrapolated``; ``--host-rows 0`` runs them all, about
100 s on the H200's host). ``--fused-kernel``: also oasr-kernels' fused frame loop
(``csrc/ctc_prefix_beam.cu``, one launch per chunk; CUDA with oasr-kernels and CuPy; not yet
verified on a GPU), ``fused_kernel_*``. ``--host-rows N`` times the host searches on the first N
utterances and scales to the batch (reported as ``extrapolated``).

``--conformer`` also times a WeNet Conformer (12 blocks, 256 wide, random weights, the model's
dtype on the device) encoding the same batch of 30 s fbank features into CTC log-probs, and the
search on those, and reports the search's share of encoder + search (issue #21: under 10 %).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from oasr.decoders import ctc_gpu
from oasr.decoders.ctc import ctc_prefix_beam_search
from oasr.decoders.ctc_gpu import ctc_prefix_beam_search_gpu


def peaky_log_probs(batch: int, frames: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    """Posteriors shaped like a trained CTC model's: blank wins ~70 % of frames, ~30 % of
    frames have one confident token, every frame has a long low tail."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, frames, vocab, generator=g) * 2.5
    x[:, :, 0] += 9 * (torch.rand(batch, frames, generator=g) < 0.7)
    pick = torch.randint(1, vocab, (batch, frames), generator=g)
    boost = torch.full((batch, frames, 1), 10.0) * (torch.rand(batch, frames, 1, generator=g) < 0.3)
    x.scatter_add_(2, pick[..., None], boost)
    return x.log_softmax(-1).to(device)


# -- WeNet's Python prefix beam search (wenet/transformer/search.py), restated -------------------


class _WeNetPrefix:
    def __init__(self) -> None:
        self.s = -math.inf
        self.ns = -math.inf
        self.v_s = -math.inf
        self.v_ns = -math.inf
        self.cur_token_prob = -math.inf
        self.times_s: list[int] = []
        self.times_ns: list[int] = []

    def score(self) -> float:
        return _log_add(self.s, self.ns)

    def viterbi_score(self) -> float:
        return self.v_s if self.v_s > self.v_ns else self.v_ns

    def times(self) -> list[int]:
        return self.times_s if self.v_s > self.v_ns else self.times_ns


def _log_add(*args: float) -> float:
    if all(a == -math.inf for a in args):
        return -math.inf
    m = max(args)
    return m + math.log(sum(math.exp(a - m) for a in args))


def wenet_prefix_beam_search(logp: torch.Tensor, beam: int) -> list[tuple[tuple[int, ...], float, list[int]]]:
    """WeNet's algorithm as its Python code runs it: per frame the ``beam`` best tokens, a
    ``defaultdict`` of next prefixes, a full sort. Returns (prefix, score, times), best first."""
    first = _WeNetPrefix()
    first.s, first.v_s, first.v_ns = 0.0, 0.0, 0.0
    cur: list[tuple[tuple[int, ...], _WeNetPrefix]] = [((), first)]
    top_v, top_i = logp.topk(beam, dim=-1)
    for t, (vals, idxs) in enumerate(zip(top_v.tolist(), top_i.tolist(), strict=True)):
        nxt: dict[tuple[int, ...], _WeNetPrefix] = defaultdict(_WeNetPrefix)
        for prob, u in zip(vals, idxs, strict=True):
            for prefix, ps in cur:
                last = prefix[-1] if prefix else None
                if u == 0:
                    n = nxt[prefix]
                    n.s = _log_add(n.s, ps.score() + prob)
                    n.v_s = ps.viterbi_score() + prob
                    n.times_s = ps.times().copy()
                elif u == last:
                    n1 = nxt[prefix]
                    n1.ns = _log_add(n1.ns, ps.ns + prob)
                    if n1.v_ns < ps.v_ns + prob:
                        n1.v_ns = ps.v_ns + prob
                        if n1.cur_token_prob < prob:
                            n1.cur_token_prob = prob
                            n1.times_ns = ps.times_ns.copy()
                            n1.times_ns[-1] = t
                    n2 = nxt[prefix + (u,)]
                    n2.ns = _log_add(n2.ns, ps.s + prob)
                    if n2.v_ns < ps.v_s + prob:
                        n2.v_ns = ps.v_s + prob
                        n2.cur_token_prob = prob
                        n2.times_ns = ps.times_s.copy()
                        n2.times_ns.append(t)
                else:
                    n = nxt[prefix + (u,)]
                    n.ns = _log_add(n.ns, ps.score() + prob)
                    if n.v_ns < ps.viterbi_score() + prob:
                        n.v_ns = ps.viterbi_score() + prob
                        n.cur_token_prob = prob
                        n.times_ns = ps.times().copy()
                        n.times_ns.append(t)
        cur = sorted(nxt.items(), key=lambda x: x[1].score(), reverse=True)[:beam]
    return [(p, s.score(), s.times()) for p, s in cur]


# -- the benchmark -----------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    lp = peaky_log_probs(args.batch, args.frames, args.vocab, args.seed, args.device)
    lens = [args.frames] * args.batch
    # warm-up (CUDA context, allocator, first kernels)
    ctc_prefix_beam_search_gpu(lp[:2, :50], beam_size=args.beam)
    _sync(args.device)
    dev_times = []
    got = None
    for _ in range(args.repeats):
        _sync(args.device)
        t0 = time.perf_counter()
        got = ctc_prefix_beam_search_gpu(lp, lens, beam_size=args.beam)
        _sync(args.device)
        dev_times.append(time.perf_counter() - t0)
    rows = min(args.host_rows or args.batch, args.batch)  # 0: every row
    host_lp = lp[:rows].cpu()
    host_times, wenet_times = [], []
    ref = wen = None
    for _ in range(args.host_repeats):
        t0 = time.perf_counter()
        ref = ctc_prefix_beam_search(host_lp, beam_size=args.beam)
        host_times.append(time.perf_counter() - t0)
        if not args.skip_wenet:
            t0 = time.perf_counter()
            wen = [wenet_prefix_beam_search(host_lp[b], args.beam) for b in range(rows)]
            wenet_times.append(time.perf_counter() - t0)
    scale = args.batch / rows
    dev = statistics.median(dev_times)
    host = statistics.median(host_times) * scale
    assert got is not None and ref is not None
    same_host = all([h.tokens for h in got[b]] == [h.tokens for h in ref[b]]
                    and [h.times for h in got[b]] == [h.times for h in ref[b]] for b in range(rows))
    max_score_diff = max(abs(x.score - y.score) for b in range(rows)
                         for x, y in zip(got[b], ref[b], strict=False))
    report: dict[str, Any] = {
        "workload": {"batch": args.batch, "frames": args.frames, "vocab": args.vocab,
                     "beam": args.beam, "seed": args.seed, "device": args.device,
                     "host_rows": rows, "extrapolated": rows < args.batch},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                    "host_threads": args.threads},
        "device_search_s": dev,
        "device_search_runs_s": dev_times,
        "device_frames_per_s": args.batch * args.frames / dev,
        "host_search_s": host,
        "host_frames_per_s": args.batch * args.frames / host,
        "speedup_vs_host": host / dev,
        "nbest_identical_to_host": same_host,
        "cuda_graph_failures": list(ctc_gpu._GRAPH_FAILED),
        "max_score_difference": max_score_diff,
    }
    if args.fused_kernel:
        report |= fused_kernel(args, lp, lens, got)
    if wenet_times:
        wenet = statistics.median(wenet_times) * scale
        assert wen is not None
        same_wenet = all([list(p) for p, _, _ in wen[b]] == [h.tokens for h in got[b]] for b in range(rows))
        report |= {"wenet_search_s": wenet, "speedup_vs_wenet": wenet / dev,
                   "nbest_identical_to_wenet": same_wenet}
    return report


def fused_kernel(args: argparse.Namespace, lp: torch.Tensor, lens: list[int], ref: Any) -> dict[str, Any]:
    """oasr-kernels' fused frame loop (one launch per chunk, ``OASR_CTC_KERNEL=1``) on the same
    batch, when it can run here (CUDA, oasr-kernels and CuPy installed)."""
    if not args.device.startswith("cuda"):
        return {}
    try:
        import cupy  # noqa: F401

        from oasr_kernels import ctc_beam
    except ImportError as exc:
        return {"fused_kernel": f"not run: {exc}"}
    import os

    import oasr.layers as L
    from oasr.layers._dispatch import declare_op

    declare_op(ctc_gpu.FRAMES_OP)
    os.environ["OASR_CTC_KERNEL"] = "1"
    times = []
    try:
        with L.override(ctc_gpu.FRAMES_OP, "cuda", ctc_beam.ctc_prefix_beam_frames_cuda):
            ctc_prefix_beam_search_gpu(lp[:2, :50], beam_size=args.beam)  # compile, warm up
            for _ in range(args.repeats):
                _sync(args.device)
                t0 = time.perf_counter()
                got = ctc_prefix_beam_search_gpu(lp, lens, beam_size=args.beam)
                _sync(args.device)
                times.append(time.perf_counter() - t0)
    finally:
        os.environ.pop("OASR_CTC_KERNEL", None)
    if ctc_beam.MODULE.disabled:
        return {"fused_kernel": f"not run: {ctc_beam.MODULE.disabled[0]}"}
    same = all([h.tokens for h in got[b]] == [h.tokens for h in ref[b]]
               and [h.times for h in got[b]] == [h.times for h in ref[b]] for b in range(len(ref)))
    return {"fused_kernel_search_s": statistics.median(times), "fused_kernel_runs_s": times,
            "fused_kernel_nbest_identical_to_tensor_search": same}


def conformer_share(args: argparse.Namespace, search_s: float) -> dict[str, Any]:
    """Encoder + CTC head of a random-weight WeNet Conformer on the batch, and the search's
    share of the whole."""
    from oasr_models_wenet.config import WenetConfig
    from oasr_models_wenet.nn import WenetNet, build_network

    cfg = WenetConfig(input_dim=80, vocab_size=args.vocab)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in WenetNet(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.ones(s) if k.endswith("running_var") else torch.randn(s, generator=g) * 0.02)
             for k, s in shapes.items() if not k.endswith("num_batches_tracked")}
    net = build_network(cfg, state, args.device).eval()
    n_feats = args.frames * 4 + 3  # x4 conv2d subsampling: args.frames encoder frames
    feats = torch.randn(args.batch, n_feats, 80, generator=g).to(args.device, net.dtype)
    lens = torch.full((args.batch,), n_feats, dtype=torch.long, device=args.device)
    times = []
    for _ in range(args.repeats + 1):
        _sync(args.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            enc, enc_lens = net.encoder(feats, lens, -1, -1)
            lp = net.ctc_log_probs(enc)
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    encode = statistics.median(times[1:])
    t0 = time.perf_counter()
    ctc_prefix_beam_search_gpu(lp, enc_lens.tolist(), beam_size=args.beam)
    _sync(args.device)
    on_model = time.perf_counter() - t0
    return {"conformer_encode_s": encode, "conformer_frames": int(lp.shape[1]),
            "search_on_conformer_output_s": on_model,
            "decoder_share": on_model / (encode + on_model),
            "decoder_share_synthetic": search_s / (encode + search_s)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--frames", type=int, default=750)
    p.add_argument("--vocab", type=int, default=5000)
    p.add_argument("--beam", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--host-repeats", type=int, default=1)
    p.add_argument("--host-rows", type=int, default=16,
                   help="time the host searches on N rows and scale to the batch (0: all rows)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the host searches")
    p.add_argument("--skip-wenet", action="store_true")
    p.add_argument("--fused-kernel", action="store_true",
                   help="also time oasr-kernels' fused frame loop (unverified on a GPU)")
    p.add_argument("--conformer", action="store_true",
                   help="also time a random-weight WeNet Conformer encoder: the decoder's share")
    p.add_argument("--quick", action="store_true", help="a small CPU check (seconds)")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.frames, args.vocab, args.repeats = 4, 100, 500, 1
    report = run(args)
    if args.conformer:
        report |= conformer_share(args, report["device_search_s"])
        if "fused_kernel_search_s" in report:
            k = report["fused_kernel_search_s"]
            report["decoder_share_fused_kernel"] = k / (report["conformer_encode_s"] + k)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
