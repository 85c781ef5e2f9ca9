"""The batched tensor CTC prefix beam search (oasr.decoders.ctc_gpu) against the host search
(WeNet's algorithm, itself checked against WeNet in tests/wenet/test_golden.py) and against
WeNet's recorded n-best: identical n-best tokens, times and token log-probs, scores to float
rounding; per-request beams; chunked streams batched at different positions equal offline. The
same checks run on CUDA under ``-m gpu``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.decoders.ctc import CTCPrefixBeamSearch, ctc_prefix_beam_search
from oasr.decoders.ctc_gpu import GPUCTCPrefixBeamSearch, ctc_prefix_beam_search_gpu, step_streams

WENET = Path(__file__).resolve().parents[1] / "data" / "wenet"


def _same(ref, got, abs_tol=1e-9) -> None:
    ref = [h for h in ref if h.score > -math.inf]  # the device search drops impossible prefixes
    assert [h.tokens for h in got] == [h.tokens for h in ref]
    assert [h.times for h in got] == [h.times for h in ref]
    assert [h.token_logprobs for h in got] == [h.token_logprobs for h in ref]
    assert [h.score for h in got] == pytest.approx([h.score for h in ref], abs=abs_tol)


def _random(b, t, v, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, v, generator=g) * scale).log_softmax(-1)


def _peaky(b, t, v, seed):
    """Realistic CTC posteriors: mostly blank, a few confident tokens, a long low tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, v, generator=g) * 2.5
    x[:, :, 0] += 9 * (torch.rand(b, t, generator=g) < 0.7)
    pick = torch.randint(1, v, (b, t), generator=g)
    x.scatter_add_(2, pick[..., None], torch.full((b, t, 1), 10.0) * (torch.rand(b, t, 1, generator=g) < 0.3))
    return x.log_softmax(-1)


def _check_random(device: str, cases: int) -> None:
    for seed in range(cases):
        t, v = 1 + seed % 23, 2 + seed % 9
        lp = _random(3, t, v, seed)
        lens = [t, max(1, t - 3), max(1, t // 2)]
        beams = [1 + seed % 6, 1 + (seed + 2) % 7, 1 + (seed + 4) % 5]
        got = ctc_prefix_beam_search_gpu(lp.to(device), lens, beam_size=beams)
        for b in range(3):
            _same(ctc_prefix_beam_search(lp[b, : lens[b]], beam_size=beams[b])[0], got[b])


def test_random_matches_host_search() -> None:
    _check_random("cpu", 40)


def test_peaky_vocab_5000_matches_host_search() -> None:
    lp = _peaky(2, 90, 5000, 7)
    got = ctc_prefix_beam_search_gpu(lp, [90, 61], beam_size=10)
    ref = ctc_prefix_beam_search(lp, [90, 61], beam_size=10)
    for r, g in zip(ref, got, strict=True):
        _same(r, g)
        assert len(g) == 10 and len(g[0].tokens) > 5


def _check_streams(device: str) -> None:
    """Three streams of different beams and lengths, fed in chunks of different sizes, batched
    together whatever position each has reached, equal their offline n-best."""
    lps = [_random(1, t, 12, 100 + t, 2.5)[0] for t in (37, 20, 29)]
    beams = [4, 8, 1]
    streams = [GPUCTCPrefixBeamSearch(b, device=device) for b in beams]
    host = [CTCPrefixBeamSearch(b) for b in beams]
    cuts = [[0, 5, 6, 19, 37], [0, 1, 13, 20], [0, 11, 12, 29]]
    for step in range(4):
        chunks = []
        for k, c in enumerate(cuts):
            a, b = (c[step], c[step + 1]) if step + 1 < len(c) else (c[-1], c[-1])
            chunks.append(lps[k][a:b].to(device))
            host[k].step(lps[k][a:b])
        step_streams(streams, chunks)
        for s, h in zip(streams, host, strict=True):  # partial results too
            _same(h.nbest(), s.nbest())
    for k, s in enumerate(streams):
        _same(ctc_prefix_beam_search(lps[k], beam_size=beams[k])[0], s.nbest())
        assert s.frame == lps[k].shape[0]


def test_streaming_equals_offline() -> None:
    _check_streams("cpu")


def test_matches_wenet_recorded_nbest() -> None:
    """WeNet's own prefix beam search output (recorded with its CTC log-posteriors)."""
    checked = 0
    for variant in sorted(p.name for p in WENET.iterdir() if (p / "golden.json").exists()):
        arrays = np.load(WENET / variant / "golden.npz")
        meta = json.loads((WENET / variant / "golden.json").read_text())
        for run in meta["runs"][:1]:  # one run per variant keeps this cheap
            for b, r in enumerate(run["results"]):
                key = f"{run['key']}_ctc_{b}"
                if key not in arrays:
                    continue
                nbest = ctc_prefix_beam_search_gpu(torch.from_numpy(arrays[key]),
                                                   beam_size=run["beam"])[0]
                assert [h.tokens for h in nbest] == r["prefix_nbest"]
                assert [h.times for h in nbest] == r["prefix_times"]
                assert [h.score for h in nbest] == pytest.approx(r["prefix_scores"], abs=1e-9)
                checked += 1
    assert checked >= 3


def test_empty_inputs() -> None:
    assert [h.tokens for h in ctc_prefix_beam_search_gpu(torch.zeros(2, 0, 5))[0]] == [[]]
    s = GPUCTCPrefixBeamSearch(3)
    s.step(torch.zeros(0, 5))
    assert s.best().tokens == [] and s.frame == 0
    with pytest.raises(ValueError):
        GPUCTCPrefixBeamSearch(0)


# -- on the device ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_random_matches_host_search() -> None:
    _check_random("cuda", 120)


@pytest.mark.gpu
def test_gpu_peaky_batch_matches_host_search() -> None:
    lp = _peaky(8, 200, 5000, 11)
    lens = [200 - 17 * b for b in range(8)]
    got = ctc_prefix_beam_search_gpu(lp.cuda(), lens, beam_size=10)
    from oasr.decoders import ctc_gpu

    assert not ctc_gpu._GRAPH_FAILED  # 200 frames: the captured-graph path ran
    for b, ref in enumerate(ctc_prefix_beam_search(lp, lens, beam_size=10)):
        _same(ref, got[b])


@pytest.mark.gpu
def test_gpu_graph_equals_eager(monkeypatch) -> None:
    lp = _peaky(4, 120, 1000, 12).cuda()
    graphed = ctc_prefix_beam_search_gpu(lp, [120, 100, 64, 1], beam_size=[10, 4, 7, 2])
    monkeypatch.setenv("OASR_CTC_CUDA_GRAPHS", "0")
    eager = ctc_prefix_beam_search_gpu(lp, [120, 100, 64, 1], beam_size=[10, 4, 7, 2])
    for g, e in zip(graphed, eager, strict=True):
        _same(e, g, abs_tol=0)


@pytest.mark.gpu
def test_gpu_streaming_equals_offline() -> None:
    _check_streams("cuda")


@pytest.mark.gpu
def test_gpu_half_precision_input() -> None:
    """fp16 log-probs (a model's output on CUDA) decode as their float values do; the values here
    are distinct multiples of 1/16, exact in fp16, so no tie makes the top-k order device-bound."""
    g = torch.Generator().manual_seed(3)
    lp = torch.stack([torch.stack([-torch.randperm(500, generator=g).float() / 16 for _ in range(60)])
                      for _ in range(2)])
    got = ctc_prefix_beam_search_gpu(lp.cuda().half(), beam_size=5)
    ref = ctc_prefix_beam_search(lp, beam_size=5)
    for r, h in zip(ref, got, strict=True):
        _same(r, h)


def test_device_indexed_frame_loop_equals_eager(monkeypatch) -> None:
    """The frame function a CUDA graph replays (device-side frame index, fixed buffers) gives
    the eager loop's result; run here without a graph, call by call."""
    from oasr.decoders import ctc_gpu

    def looped(c, tv, ti, kmask, f, i, valid, frame0, lens_t, ctx, tok_par, node_lp):
        body, state = ctc_gpu._device_loop(c, tv, ti, kmask, f, i, valid, frame0, lens_t, ctx,
                                           tok_par, node_lp)
        for _ in range(tv.shape[1]):
            body()
        return state

    lp = _random(3, 40, 30, 5)
    lens = [40, 33, 7]
    ref = ctc_prefix_beam_search_gpu(lp, lens, beam_size=[5, 3, 4])
    monkeypatch.setattr(ctc_gpu, "_use_graph", lambda device, frames: True)
    monkeypatch.setattr(ctc_gpu, "_advance_graphed", looped)
    got = ctc_prefix_beam_search_gpu(lp, lens, beam_size=[5, 3, 4])
    for r, g in zip(ref, got, strict=True):
        _same(r, g, abs_tol=0)


def test_registered_on_the_decoder_axis() -> None:
    from oasr.plugins import resolve

    assert resolve("decoder", "ctc_prefix_beam_batched") is ctc_prefix_beam_search_gpu
    assert resolve("decoder", "ctc_prefix_beam_stream") is GPUCTCPrefixBeamSearch
