"""Hotwords (context biasing): oasr.decoders.context_graph against icefall's ContextGraph (the
copy the ``zipformer`` PyPI package ships), and the biased CTC prefix beam searches (host and
batched tensor) against a compact restatement of WeNet's biased prefix beam search driven by
icefall's graph: identical n-best and scores; a hotword the plain beam misses is found; no
hotword changes nothing."""

from __future__ import annotations

import importlib.util
import math
import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from oasr.decoders.context_graph import ContextGraph, parse_hotwords
from oasr.decoders.ctc import ctc_prefix_beam_search, log_add
from oasr.decoders.ctc_gpu import GPUCTCPrefixBeamSearch, ctc_prefix_beam_search_gpu, step_streams
from oasr.errors import InvalidRequestError


def _icefall_graph_module():
    """icefall's context_graph.py as the zipformer package ships it, loaded by path (the
    package's __init__ imports training-only dependencies)."""
    spec = importlib.util.find_spec("zipformer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the zipformer package (icefall's ContextGraph) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "decode" / "context_graph.py"
    mod_spec = importlib.util.spec_from_file_location("_icefall_context_graph", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _random_phrases(rng, vocab, n):
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 4))] for _ in range(n)]


def test_graph_matches_icefall() -> None:
    ref_mod = _icefall_graph_module()
    rng = random.Random(0)
    for _ in range(150):
        vocab = rng.randint(3, 7)
        phrases = _random_phrases(rng, vocab, rng.randint(1, 6))
        boosts = [rng.choice([1.5, 0.5, 2.0, 3.0]) for _ in phrases]
        ref = ref_mod.ContextGraph(1.5)
        ref.build(phrases, scores=boosts)
        mine = ContextGraph(phrases, 1.5, boosts)
        assert mine.num_states == ref.num_nodes + 1
        for _ in range(10):
            rs, ms = ref.root, 0
            for _ in range(8):
                u = rng.randrange(1, vocab)
                want, rs, _ = ref.forward_one_step(rs, u, strict_mode=False)
                got, ms = mine.step(ms, u)
                assert got == pytest.approx(want, abs=1e-12) and ms == rs.id
                assert mine.finalize(ms) == pytest.approx(ref.finalize(rs)[0], abs=1e-12)


def test_tables_reproduce_steps() -> None:
    """The flat tables the tensor search gathers from give ContextGraph.step exactly."""
    rng = random.Random(1)
    for _ in range(60):
        vocab = rng.randint(3, 8)
        g = ContextGraph(_random_phrases(rng, vocab, rng.randint(1, 5)), 1.0,
                         None)
        t = g.tables(vocab)
        index = {k: n for n, k in enumerate(t.keys)}
        for s in range(g.num_states):
            for u in range(vocab):
                if s * vocab + u in index and s:
                    n = index[s * vocab + u]
                    got = (t.bonus[n], t.next[n])
                elif u in index:
                    n = index[u]
                    got = (t.bonus[n] - t.node_score[s], t.next[n])
                else:
                    got = (-t.node_score[s], 0)
                want = g.step(s, u)
                assert got[1] == want[1] and got[0] == pytest.approx(want[0], abs=1e-12)


def test_parse_hotwords() -> None:
    assert parse_hotwords(["OASR", " new york :3", "", "a:b"], 1.5) == [
        ("OASR", 1.5), ("new york", 3.0), ("a:b", 1.5)]
    with pytest.raises(InvalidRequestError):
        parse_hotwords(["x :0"])
    g = ContextGraph.from_hotwords(["ab", "c :2"], lambda s: [ord(ch) - 96 for ch in s], 1.0)
    assert g.num_phrases == 2 and g.step(0, 3) == (2.0, 0)


# -- biased CTC prefix beam search: the reference ------------------------------------------------


def _oracle_biased_prefix_beam(lp, beam, graph, root):
    """WeNet's biased CTC prefix beam search restated (scores only): a prefix's context
    (icefall graph state, bonus) is set once from the prefix it came from, extended by
    ``forward_one_step`` (non-strict) for a new token; beams ranked by acoustic + bonus; the
    result ranked after ``finalize``."""
    cur = {(): [0.0, -math.inf, root, 0.0]}  # s, ns, context state, bonus
    for row in lp.tolist():
        top = sorted(range(len(row)), key=lambda u: -row[u])[:beam]
        nxt = defaultdict(lambda: [-math.inf, -math.inf, None, 0.0])
        for u in top:
            p = row[u]
            for prefix, (s, ns, cs, bonus) in cur.items():
                total = log_add(s, ns)
                last = prefix[-1] if prefix else None
                targets = []
                if u == 0:
                    targets.append((prefix, "s", total + p, False))
                elif u == last:
                    targets.append((prefix, "ns", ns + p, False))
                    targets.append((prefix + (u,), "ns", s + p, True))
                else:
                    targets.append((prefix + (u,), "ns", total + p, True))
                for key, part, value, extends in targets:
                    n = nxt[key]
                    n[0 if part == "s" else 1] = log_add(n[0 if part == "s" else 1], value)
                    if n[2] is None:
                        if extends:
                            add, state, _ = graph.forward_one_step(cs, u, strict_mode=False)
                            n[2], n[3] = state, bonus + add
                        else:
                            n[2], n[3] = cs, bonus
        ranked = sorted(nxt.items(), key=lambda kv: log_add(kv[1][0], kv[1][1]) + kv[1][3], reverse=True)
        cur = dict(ranked[:beam])
    out = [(list(k), log_add(v[0], v[1]) + v[3] + graph.finalize(v[2])[0]) for k, v in cur.items()]
    return sorted(out, key=lambda x: x[1], reverse=True)


def _logp(t, v, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, v, generator=g) * 2.5).log_softmax(-1)


def _check_biased(device: str, cases: int) -> None:
    ref_mod = _icefall_graph_module()
    rng = random.Random(2)
    for case in range(cases):
        vocab, t, beam = rng.randint(4, 9), rng.randint(3, 25), rng.randint(2, 6)
        phrases = _random_phrases(rng, vocab, rng.randint(1, 5))
        boosts = [rng.choice([1.0, 2.0, 3.5]) for _ in phrases]
        lp = _logp(t, vocab, case)
        ref_graph = ref_mod.ContextGraph(1.0)
        ref_graph.build(phrases, scores=boosts)
        want = _oracle_biased_prefix_beam(lp, beam, ref_graph, ref_graph.root)
        want = [w for w in want if w[1] > -math.inf]
        graph = ContextGraph(phrases, 1.0, boosts)
        host = [h for h in ctc_prefix_beam_search(lp, beam_size=beam, context_graphs=[graph])[0]
                if h.score > -math.inf]
        dev = ctc_prefix_beam_search_gpu(lp.to(device), beam_size=beam, context_graphs=[graph])[0]
        for got in (host, dev):
            assert [h.tokens for h in got] == [w[0] for w in want], case
            assert [h.score for h in got] == pytest.approx([w[1] for w in want], abs=1e-9)
        assert [h.times for h in dev] == [h.times for h in host]


def test_biased_ctc_matches_reference() -> None:
    _check_biased("cpu", 30)


def _two_paths(v=6):
    """Frames where the plain beam prefers tokens 1 2 but 3 4 is close behind."""
    lp = torch.full((6, v), -9.0)
    for t, (a, b) in enumerate([(1, 3), (0, 0), (2, 4), (0, 0), (0, 0), (0, 0)]):
        lp[t, a] = -0.3
        if b != a:
            lp[t, b] = -1.5
        lp[t, 0] = max(lp[t, 0].item(), -2.5)
    return lp.log_softmax(-1)


def test_hotword_the_plain_beam_misses_is_found() -> None:
    lp = _two_paths()
    plain = ctc_prefix_beam_search(lp, beam_size=4)[0][0].tokens
    assert plain == [1, 2]
    graph = ContextGraph([[3, 4]], 2.0)
    for search in (ctc_prefix_beam_search, ctc_prefix_beam_search_gpu):
        assert search(lp, beam_size=4, context_graphs=[graph])[0][0].tokens == [3, 4]
    # a partial match is taken back at the end: [3] alone earns nothing in the final score
    weak = ContextGraph([[3, 5]], 2.0)
    best = ctc_prefix_beam_search(lp, beam_size=4, context_graphs=[weak])[0]
    assert best[0].tokens == [1, 2]


def test_no_hotword_changes_nothing() -> None:
    lp = _logp(30, 8, 9)
    plain = ctc_prefix_beam_search(lp, beam_size=5)[0]
    unmatched = ContextGraph([[50, 51]], 3.0)  # tokens the model never emits
    empty = ContextGraph([], 3.0)
    for g in (None, unmatched, empty):
        for search in (ctc_prefix_beam_search, ctc_prefix_beam_search_gpu):
            got = search(lp, beam_size=5, context_graphs=[g])[0]
            assert [h.tokens for h in got] == [h.tokens for h in plain]
            assert [h.score for h in got] == pytest.approx([h.score for h in plain], abs=1e-9)


def test_biased_streams_equal_offline() -> None:
    graph = ContextGraph([[2, 3], [4]], 1.5)
    lps = [_logp(25, 7, 40), _logp(18, 7, 41)]
    streams = [GPUCTCPrefixBeamSearch(4, context_graph=graph), GPUCTCPrefixBeamSearch(3)]
    for a, b in ((0, 7), (7, 8), (8, 25)):
        step_streams(streams, [lps[0][a:b], lps[1][a:b]])
    for s, lp, g, beam in zip(streams, lps, (graph, None), (4, 3), strict=True):
        ref = ctc_prefix_beam_search(lp, beam_size=beam, context_graphs=[g])[0]
        assert [h.tokens for h in s.nbest()] == [h.tokens for h in ref]
        assert [h.score for h in s.nbest()] == pytest.approx([h.score for h in ref], abs=1e-9)


@pytest.mark.gpu
def test_gpu_biased_ctc_matches_reference() -> None:
    _check_biased("cuda", 40)


def test_rows_sharing_a_graph() -> None:
    """One graph object for several rows of a batch (the families pass the request's graph to
    every row) and rows without one: each row equals its own host search."""
    graph = ContextGraph([[2, 3], [4]], 2.0)
    lp = torch.stack([_logp(30, 8, s) for s in range(4)])
    graphs = [graph, graph, None, graph]
    got = ctc_prefix_beam_search_gpu(lp, beam_size=4, context_graphs=graphs)
    want = ctc_prefix_beam_search(lp, beam_size=4, context_graphs=graphs)
    for g, w in zip(got, want, strict=True):
        assert [h.tokens for h in g] == [h.tokens for h in w]
        assert [h.score for h in g] == pytest.approx([h.score for h in w], abs=1e-9)
