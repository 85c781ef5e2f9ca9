"""Generic CTC decoders (oasr.decoders.ctc): exactness against brute force, incremental ==
offline, rescoring arithmetic, timestamps and word grouping. WeNet parity of the same functions
is in tests/wenet/test_golden.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasr.decoders.ctc import (
    CTCGreedySearch,
    CTCPrefixBeamSearch,
    attention_rescoring,
    build_rescoring_inputs,
    ctc_greedy_search,
    ctc_prefix_beam_search,
    group_words,
    log_add,
    token_timestamps,
)


def _collapse(path, blank=0):
    out, prev = [], None
    for u in path:
        if u != blank and u != prev:
            out.append(u)
        prev = u
    return tuple(out)


def _random_logp(t, v, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(t, v, generator=g) * 2, dim=-1)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(t=st.integers(1, 5), v=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_full_beam_is_exact_prefix_probability(t, v, seed) -> None:
    lp = _random_logp(t, v, seed)
    exact: dict[tuple, float] = {}
    for path in itertools.product(range(v), repeat=t):
        s = sum(lp[i, u].item() for i, u in enumerate(path))
        key = _collapse(path)
        exact[key] = log_add(exact.get(key, -math.inf), s)
    nbest = ctc_prefix_beam_search(lp, beam_size=10_000)[0]
    # like WeNet, prefixes that no path reaches may stay in the beam with score -inf
    nbest = [h for h in nbest if h.score > -math.inf]
    assert len(nbest) == len(exact)
    for h in nbest:
        assert h.score == pytest.approx(exact[tuple(h.tokens)], abs=1e-9)
    best = max(exact.items(), key=lambda kv: kv[1])
    assert tuple(nbest[0].tokens) == best[0]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(t=st.integers(1, 40), seed=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 40), max_size=5),
       beam=st.integers(1, 6))
def test_incremental_equals_offline(t, seed, cuts, beam) -> None:
    lp = _random_logp(t, 6, seed)
    ref = ctc_prefix_beam_search(lp, beam_size=beam)[0]
    inc = CTCPrefixBeamSearch(beam)
    g = CTCGreedySearch()
    bounds = sorted({0, t, *[c for c in cuts if c <= t]})
    for a, b in zip(bounds, bounds[1:], strict=False):
        inc.step(lp[a:b])
        g.step(lp[a:b])
    got = inc.nbest()
    assert [h.tokens for h in got] == [h.tokens for h in ref]
    assert [h.times for h in got] == [h.times for h in ref]
    assert [h.score for h in got] == [h.score for h in ref]
    assert g.result().tokens == ctc_greedy_search(lp)[0].tokens


def test_greedy_times_and_confidence() -> None:
    # frames: a a - b b - b ; blank = 0, a = 1, b = 2
    ids = [1, 1, 0, 2, 2, 0, 2]
    probs = [0.6, 0.9, 0.8, 0.7, 0.95, 0.5, 0.55]
    lp = torch.full((7, 3), -10.0)
    for t, (u, p) in enumerate(zip(ids, probs, strict=True)):
        lp[t, u] = math.log(p)
    h = ctc_greedy_search(lp)[0]
    assert h.tokens == [1, 2, 2]
    assert h.times == [0, 3, 6]
    assert h.confidences == pytest.approx([0.9, 0.95, 0.55], abs=1e-6)
    # batched with lengths
    hs = ctc_greedy_search(torch.stack([lp, lp]), [7, 2])
    assert hs[1].tokens == [1]
    # prefix beam times are the Viterbi peaks
    pb = ctc_prefix_beam_search(lp, beam_size=3)[0][0]
    assert pb.tokens == [1, 2, 2] and pb.times == [1, 4, 6]
    assert pb.confidences == pytest.approx([0.9, 0.95, 0.55], abs=1e-6)


def test_rescoring_arithmetic() -> None:
    hyps = [[3, 4], [3]]
    l2r_in, r2l_in, lens = build_rescoring_inputs(hyps, sos=5, eos=5)
    assert l2r_in.tolist() == [[5, 3, 4], [5, 3, 5]]
    assert r2l_in.tolist() == [[5, 4, 3], [5, 3, 5]]
    assert lens.tolist() == [3, 2]
    g = torch.Generator().manual_seed(0)
    lo = torch.log_softmax(torch.randn(2, 3, 6, generator=g), -1)
    ro = torch.log_softmax(torch.randn(2, 3, 6, generator=g), -1)
    ctc = [-1.0, -0.5]
    res = attention_rescoring(hyps, ctc, lo, ro, eos=5, ctc_weight=0.3, reverse_weight=0.4)
    for i, h in enumerate(hyps):
        n = len(h)
        att = sum(lo[i, j, w].item() for j, w in enumerate(h)) + lo[i, n, 5].item()
        r = sum(ro[i, n - 1 - j, w].item() for j, w in enumerate(h)) + ro[i, n, 5].item()
        s = 0.6 * att + 0.4 * r
        assert res.confidences[i] == pytest.approx(math.exp(s / (n + 1)))
        assert res.scores[i] == pytest.approx(s + 0.3 * ctc[i])
        tc = [(math.exp(lo[i, j, w].item()) + math.exp(ro[i, n - 1 - j, w].item())) / 2 for j, w in enumerate(h)]
        assert res.token_confidences[i] == pytest.approx(tc)
    assert res.best_index == max(range(2), key=lambda i: res.scores[i])
    only_l2r = attention_rescoring(hyps, ctc, lo, None, eos=5, ctc_weight=0.0)
    assert only_l2r.scores[1] == pytest.approx(lo[1, 0, 3].item() + lo[1, 1, 5].item())


def test_timestamps_and_words() -> None:
    tm = token_timestamps([1, 2, 3], [2, 5, 30], [0.9, 0.8, 0.7], frame_shift=0.04, num_frames=40,
                          max_token_duration=0.4)
    assert [t.token for t in tm] == [1, 2, 3]
    for a, b in zip(tm, tm[1:], strict=False):
        assert a.end <= b.start + 1e-9
    assert tm[0].start == pytest.approx(0.0)  # (2 + .5) * .04 - .2 < 0 -> 0
    assert tm[2].start == pytest.approx(30.5 * 0.04 - 0.2)  # long gap: clipped to half the max
    assert tm[2].end == pytest.approx(1.42)
    words = group_words(["\u2581HE", "LLO", "\u2581WOR", "LD", "中", "文"], token_timestamps(
        list(range(6)), [0, 2, 4, 6, 8, 10], [1.0, 0.5, 1.0, 1.0, 0.8, 0.6], frame_shift=0.04))
    assert [w[0] for w in words] == ["HELLO", "WORLD", "中", "文"]
    assert words[0][3] == pytest.approx(0.75)
    assert words[0][1] < words[0][2] <= words[1][1] + 1e-9


def test_registry_resolves_decoders() -> None:
    from oasr.plugins import resolve

    assert resolve("decoder", "ctc_prefix_beam") is ctc_prefix_beam_search


def test_batched_greedy_equals_stepwise_search_on_ragged_rows():
    """ctc_greedy_search (numpy over whole rows) gives what CTCGreedySearch gives stepping each
    row: tokens, times, run-maximum log-probs and the score, exactly."""
    import torch

    from oasr.decoders.ctc import CTCGreedySearch, ctc_greedy_search

    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        b, t, v = 4, int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(2, 6, (1,), generator=g))
        lp = torch.randn(b, t, v, generator=g).log_softmax(-1)
        lens = [int(n) for n in torch.randint(0, t + 1, (b,), generator=g)]
        blank = int(torch.randint(0, v, (1,), generator=g))
        batched = ctc_greedy_search(lp, lens, blank)
        for row, hyp in enumerate(batched):
            step = CTCGreedySearch(blank)
            step.step(lp[row, : lens[row]])
            want = step.result()
            assert (hyp.tokens, hyp.times, hyp.token_logprobs, hyp.score) == (
                want.tokens, want.times, want.token_logprobs, want.score)
