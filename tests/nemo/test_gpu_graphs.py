"""CUDA graphs of the greedy TDT and RNN-T device loops (``pytest -m gpu tests/nemo``): on the
GPU, the captured loop gives exactly the eager device loop's and the row loop's hypotheses
(tokens, frames, durations; log-probabilities and scores within float32 rounding), whole and in
chunks, with the emission buffers grown (a second capture) too, and the capture really happens
(no fall-back warning). Through the model: cuda_graphs on and off transcribe alike."""

from __future__ import annotations

import logging

import pytest
import torch

from oasr.types import DecodingOptions, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(hf_checkpoints, kind):  # noqa: ANN001, ANN202
    from oasr.checkpoint import load_model

    return load_model(EngineConfig(ckpt_dir=str(hf_checkpoints[kind].path), device="cuda",
                                   dtype="float32"))


def _projected(model, waves):  # noqa: ANN001, ANN202
    enc, lens = model.encode(waves * 3)  # nine rows of three lengths
    with torch.no_grad():
        return model.net.encoder_projector(enc), [int(n) for n in lens.tolist()]


class _ZeroHeavy:
    """The duration-0 logit raised: many tokens per frame (the symbol limit, buffer growth)."""

    def __init__(self, net) -> None:  # noqa: ANN001
        self.net = net

    def __getattr__(self, name):  # noqa: ANN001, ANN204
        return getattr(self.net, name)

    def join(self, frames, decoder_out):  # noqa: ANN001, ANN201
        logits = self.net.join(frames, decoder_out).clone()
        logits[:, -5] += 60.0
        return logits


def _search(kind, network, model, proj, lens, mode, chunk=None, max_symbols=10):  # noqa: ANN001, ANN202
    from oasr.decoders.transducer import TDTGreedySearch, TransducerGreedySearch

    c = model.config
    sync_free, graph = {"loop": (False, False), "eager": (True, False), "graph": (True, True)}[mode]
    if kind == "tdt":
        s = TDTGreedySearch(network, c.durations, proj.shape[0], blank_id=c.blank_id,
                            max_symbols_per_frame=max_symbols, sync_free=sync_free, cuda_graph=graph)
    else:
        s = TransducerGreedySearch(network, proj.shape[0], blank_id=c.blank_id,
                                   max_symbols_per_frame=max_symbols, sync_free=sync_free,
                                   cuda_graph=graph)
    n = chunk or proj.shape[1]
    for a in range(0, proj.shape[1], n):
        s.step(proj[:, a : a + n], [max(0, min(n, L - a)) for L in lens])
    return s.results()


def _same(expected, got) -> None:  # noqa: ANN001
    for a, b in zip(expected, got, strict=True):
        assert (a.tokens, a.times, a.durations) == (b.tokens, b.times, b.durations)
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
        assert a.score == pytest.approx(b.score, rel=1e-5, abs=1e-3)


@pytest.mark.parametrize("kind,zero_heavy,max_symbols", [("tdt", False, 10), ("tdt", True, 4),
                                                         ("rnnt", False, 10), ("rnnt", False, 2)])
def test_graph_equals_eager_and_row_loop(hf_checkpoints, waves, caplog, kind, zero_heavy,
                                         max_symbols) -> None:
    model = _model(hf_checkpoints, kind)
    proj, lens = _projected(model, waves)
    network = _ZeroHeavy(model.transducer) if zero_heavy else model.transducer
    loop = _search(kind, network, model, proj, lens, "loop", max_symbols=max_symbols)
    assert sum(len(h.tokens) for h in loop) > 20
    with caplog.at_level(logging.WARNING, logger="oasr.decoders.transducer"):
        for chunk in (None, 6):
            eager = _search(kind, network, model, proj, lens, "eager", chunk, max_symbols)
            graph = _search(kind, network, model, proj, lens, "graph", chunk, max_symbols)
            _same(loop, eager)
            _same(loop, graph)
    assert "capture failed" not in caplog.text


def test_graph_with_buffer_growth(hf_checkpoints, waves, caplog, monkeypatch) -> None:
    """Two steps per replay: many status reads, and the emission buffers grow mid-loop (the
    graph captured again over the new buffers)."""
    import oasr.decoders.transducer as tr

    grown = []
    grow = tr._DeviceTDT._grow
    monkeypatch.setattr(tr, "TDT_STEPS_PER_CHECK", 2)
    monkeypatch.setattr(tr._DeviceTDT, "_grow", lambda self: (grown.append(self.cap), grow(self)))
    model = _model(hf_checkpoints, "tdt")
    proj, lens = _projected(model, waves)
    network = _ZeroHeavy(model.transducer)
    loop = _search("tdt", network, model, proj, lens, "loop", max_symbols=4)
    with caplog.at_level(logging.WARNING, logger="oasr.decoders.transducer"):
        graph = _search("tdt", network, model, proj, lens, "graph", max_symbols=4)
    assert grown and "capture failed" not in caplog.text
    _same(loop, graph)


@pytest.mark.parametrize("kind", ["tdt", "rnnt"])
def test_model_with_and_without_graphs(hf_checkpoints, waves, kind) -> None:
    model = _model(hf_checkpoints, kind)
    opts = DecodingOptions(word_timestamps=True)
    with_graphs = model.transcribe(waves * 3, opts)
    model.cuda_graphs = False
    eager = model.transcribe(waves * 3, opts)
    assert [t.text for t in with_graphs] == [t.text for t in eager]
    assert [[(w.start, w.end) for w in t.words] for t in with_graphs] == \
        [[(w.start, w.end) for w in t.words] for t in eager]
