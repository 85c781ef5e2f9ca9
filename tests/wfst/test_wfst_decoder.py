"""WFST decoding: graph building, the graph image, and the batched token-passing search held to
kaldi-decoder's FasterDecoder (one-best words and word frames) on the same graph and log-probs;
streaming equals offline."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.errors import InvalidRequestError
from oasr_decoders_wfst.build import build_tlg, read_arpa
from oasr_decoders_wfst.decoder import INT32_MAX, WfstDecoder, WfstSearchOptions
from oasr_decoders_wfst.graph import load_graph, save_graph
from oasr_decoders_wfst.synthetic import peaky_log_probs

sys.path.insert(0, str(Path(__file__).parent))
from _kaldi_reference import kaldi_decode, to_kaldifst  # noqa: E402

TOY_ARPA = """
\\data\\
ngram 1=8
ngram 2=9
ngram 3=3

\\1-grams:
-1.0 </s>
-99 <s> -0.5
-0.7 a -0.3
-0.8 ab -0.2
-0.9 b -0.1
-1.1 ba -0.25
-1.2 bab 0.1
-1.3 c -0.4

\\2-grams:
-0.2 <s> a -0.1
-0.3 a b -0.2
-0.4 b </s>
-0.5 ab ba
-0.6 ba </s>
-0.3 c a
-0.9 <s> c
-0.4 bab c
-0.2 ba bab

\\3-grams:
-0.1 <s> a b
-0.2 a b </s>
-0.15 c a b

\\end\\
"""
TOY_LEXICON = [("a", ["A"]), ("ab", ["A", "B"]), ("b", ["B"]), ("ba", ["B", "A"]),
               ("bab", ["B", "A", "B"]), ("c", ["C"]), ("c", ["C", "C"]), ("aa", ["A", "A"])]


@pytest.fixture(autouse=True)
def _one_thread():
    # many tiny ops: intra-op threads only contend on a small CI box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def toy_graph():
    return build_tlg(TOY_LEXICON, read_arpa(TOY_ARPA.splitlines()))


def _inputs(graph, batch, frames, seed, peaky):
    rng = np.random.default_rng(seed)
    V = graph.num_tokens
    if peaky:
        prons = [[graph.tokens.index(u) for u in p] for _, p in TOY_LEXICON]
        lp = np.stack([peaky_log_probs(prons, frames, V, rng, peak=3.0) for _ in range(batch)])
    else:
        lp = rng.normal(0, 2.5, size=(batch, frames, V))
        lp = (lp - np.log(np.exp(lp).sum(-1, keepdims=True))).astype(np.float32)
    lengths = rng.integers(frames // 2, frames + 1, size=batch)
    lengths[0] = frames
    return torch.from_numpy(lp), lengths.tolist()


# Where max_active binds, Kaldi's result depends on the order its hash list visits tokens (a
# token created under the running cutoff of that frame survives into the next frame's
# max_active count); the batched search keeps exactly the tokens under the final cutoff. The
# settings below are those where the FasterDecoder is order-independent (docs/wfst_decoder_gpu.md).
SETTINGS = [
    WfstSearchOptions(beam=16.0),
    WfstSearchOptions(beam=7.0, max_active=30, min_active=2, acoustic_scale=0.7),
    WfstSearchOptions(beam=4.0, max_active=INT32_MAX, min_active=0, acoustic_scale=1.5),
]


@pytest.mark.parametrize("opts", SETTINGS, ids=["default", "max_active", "narrow"])
@pytest.mark.parametrize("peaky", [False, True], ids=["random", "peaky"])
def test_toy_graph_matches_kaldi_faster_decoder(toy_graph, opts, peaky):
    pytest.importorskip("kaldi_decoder")
    lp, lengths = _inputs(toy_graph, 8, 60, seed=1 + peaky, peaky=peaky)
    hyps = WfstDecoder(toy_graph, "cpu", opts).decode(lp, lengths)
    fst = to_kaldifst(toy_graph)
    for b, hyp in enumerate(hyps):
        scaled = lp[b, : lengths[b]].numpy() * np.float32(opts.acoustic_scale)
        words, frames, cost = kaldi_decode(fst, scaled, opts.beam, opts.max_active,
                                           opts.min_active, opts.beam_delta)
        assert hyp.word_ids == words, b
        assert hyp.word_frames == frames, b
        assert hyp.cost == pytest.approx(cost, abs=1e-3)
        assert hyp.num_frames == lengths[b]


def test_streaming_equals_offline(toy_graph):
    lp, lengths = _inputs(toy_graph, 5, 50, seed=3, peaky=True)
    dec = WfstDecoder(toy_graph, "cpu", WfstSearchOptions(beam=9.0, max_active=12, min_active=3))
    offline = dec.decode(lp, lengths)
    state = dec.init_state(5)
    rng = np.random.default_rng(0)
    done = np.zeros(5, dtype=int)
    while (done < lengths).any():
        step = rng.integers(1, 9)
        take = np.minimum(np.asarray(lengths) - done, rng.integers(0, step + 1, size=5))
        chunk = torch.zeros(5, int(take.max()), toy_graph.num_tokens)
        for b in range(5):
            chunk[b, : take[b]] = lp[b, done[b]: done[b] + take[b]]
        dec.advance(state, chunk, take.tolist())
        done += take
    streamed = dec.finalize(state)
    assert [h.word_ids for h in streamed] == [h.word_ids for h in offline]
    assert [h.word_frames for h in streamed] == [h.word_frames for h in offline]
    assert [h.cost for h in streamed] == [h.cost for h in offline]


def test_graph_image_round_trip(toy_graph, tmp_path):
    path = save_graph(toy_graph, tmp_path / "toy.graph")
    again = load_graph(path)
    assert again.words == toy_graph.words and again.tokens == toy_graph.tokens
    assert again.start == toy_graph.start
    for name in ("state_offsets", "next_states", "ilabels", "olabels", "weights", "final_weights"):
        np.testing.assert_array_equal(getattr(again, name), getattr(toy_graph, name))
    assert toy_graph.tokens[0] == "<blk>" and toy_graph.words[0] == "<eps>"
    assert "aa" not in toy_graph.words  # not in the LM
    (tmp_path / "bad.npz").write_bytes(b"not a graph")
    with pytest.raises(InvalidRequestError, match="not a WFST graph image"):
        load_graph(tmp_path / "bad.npz")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_graph(tmp_path / "missing.npz")


def test_bad_input_is_a_typed_error(toy_graph):
    dec = WfstDecoder(toy_graph, "cpu")
    with pytest.raises(InvalidRequestError, match="tokens"):
        dec.decode(torch.zeros(1, 5, toy_graph.num_tokens + 1))
    with pytest.raises(InvalidRequestError, match="beam"):
        WfstSearchOptions(beam=0)


@pytest.fixture(scope="module")
def realistic_graph():
    from benchmarks.wfstbench import build_realistic_graph, pocketsphinx_model_dir

    if pocketsphinx_model_dir() is None:
        pytest.skip("needs the pocketsphinx-en-us LM and dictionary: `apt-get install "
                    "pocketsphinx-en-us` (scripts/setup.sh does it where apt-get runs as root)")
    return build_realistic_graph(1000, min_log10_prob=-1.5)


def test_realistic_graph_matches_kaldi_faster_decoder(realistic_graph):
    """TLG over 39 CMU phones and 1000 words of pocketsphinx's US English trigram LM."""
    pytest.importorskip("kaldi_decoder")
    from benchmarks.wfstbench import synthetic_batch

    g = realistic_graph
    assert g.num_tokens == 40 and len(g.words) - 1 >= 900 and g.num_arcs > 100_000
    lp = synthetic_batch(g, 4, 100, seed=5)
    lengths = [100, 80, 100, 63]
    opts = WfstSearchOptions(beam=10.0, acoustic_scale=0.8)
    hyps = WfstDecoder(g, "cpu", opts).decode(torch.from_numpy(lp), lengths)
    fst = to_kaldifst(g)
    for b, hyp in enumerate(hyps):
        scaled = lp[b, : lengths[b]] * np.float32(opts.acoustic_scale)
        words, frames, cost = kaldi_decode(fst, scaled, opts.beam, opts.max_active,
                                           opts.min_active, opts.beam_delta)
        assert len(words) >= 3
        assert hyp.word_ids == words and hyp.word_frames == frames, b
        assert hyp.cost == pytest.approx(cost, abs=1e-3)


def test_oasr_graph_build_command(toy_graph, tmp_path):
    import subprocess

    (tmp_path / "lexicon.txt").write_text("".join(f"{w} {' '.join(p)}\n" for w, p in TOY_LEXICON))
    (tmp_path / "lm.arpa").write_text(TOY_ARPA)
    out = tmp_path / "TLG.npz"
    cmd = [sys.executable, "-m", "oasr.cli.main", "graph"]
    run = subprocess.run([*cmd, "build", "--lexicon", str(tmp_path / "lexicon.txt"), "--lm",
                          str(tmp_path / "lm.arpa"), "-o", str(out)], capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"{toy_graph.num_states} states, {toy_graph.num_arcs} arcs" in run.stdout
    built = load_graph(out)
    np.testing.assert_array_equal(built.ilabels, toy_graph.ilabels)
    np.testing.assert_array_equal(built.weights, toy_graph.weights)
    info = subprocess.run([*cmd, "info", str(out), "--json"], capture_output=True, text=True)
    assert info.returncode == 0 and f'"states": {toy_graph.num_states}' in info.stdout
    bad = subprocess.run([*cmd, "build", "--lexicon", str(tmp_path / "nope.txt"), "--lm",
                          str(tmp_path / "lm.arpa"), "-o", str(out)], capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 1 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
