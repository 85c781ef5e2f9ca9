"""A CTC family decoding over a WFST graph through the model option ``wfst_graph`` (core's
``oasr.decoders.graph_search`` routing to this plugin): WeNet's random-weight test checkpoint,
a graph over its own unit table, the same words as the decoder run directly on the model's CTC
log-probs; streaming and bad graphs are refused with typed errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.types import DecodingOptions
from oasr_decoders_wfst.build import build_tlg, read_arpa
from oasr_decoders_wfst.decoder import WfstDecoder, WfstSearchOptions
from oasr_decoders_wfst.graph import save_graph

REPO = Path(__file__).resolve().parents[2]
CKPT = REPO / "tests" / "data" / "wenet" / "u2pp_conformer"

pytest.importorskip("kaldifst")


@pytest.fixture(scope="module")
def model():
    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(EngineConfig(ckpt_dir=str(CKPT)))
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def graph_path(model, tmp_path_factory):
    units = list(model.units.pieces)
    singles = units[2:]
    lexicon = [(u, [u]) for u in singles] + [(a + b, [a, b]) for a, b in zip(singles[::2], singles[1::2], strict=False)]
    words = sorted({w for w, _ in lexicon})
    arpa = ["\\data\\", f"ngram 1={len(words) + 2}", "ngram 2=3", "", "\\1-grams:",
            "-1.0 </s>", "-99 <s> -0.3"]
    arpa += [f"{-1.0 - 0.05 * (i % 7):.2f} {w} -0.2" for i, w in enumerate(words)]
    arpa += ["", "\\2-grams:", f"-0.3 <s> {words[0]}", f"-0.4 {words[0]} {words[1]}",
             f"-0.2 {words[1]} </s>", "", "\\end\\"]
    graph = build_tlg(lexicon, read_arpa(arpa), tokens=units)
    return str(save_graph(graph, tmp_path_factory.mktemp("graph") / "tlg.npz")), graph


def test_wfst_graph_option_decodes_over_the_graph(model, graph_path):
    path, graph = graph_path
    rng = np.random.default_rng(0)
    audios = [rng.normal(0, 0.1, 16000 * 2).astype(np.float32),
              rng.normal(0, 0.1, 16000 * 3).astype(np.float32)]  # fmt: skip
    opts = DecodingOptions.build(wfst_graph=path, wfst_beam=12.0, acoustic_scale=0.5)
    out = model.transcribe(audios, opts)
    # the same search run directly on the model's CTC log-probs
    enc, lens = model.encode(audios)
    with torch.no_grad():
        logp = model.net.ctc_log_probs(enc)
    direct = WfstDecoder(graph, "cpu", WfstSearchOptions(beam=12.0, max_active=7000, acoustic_scale=0.5))
    hyps = direct.decode(logp, lens.tolist())
    for tr, hyp, audio in zip(out, hyps, audios, strict=True):
        assert tr.text == "".join(hyp.words)  # WeNet's test units are Chinese: no spaces
        assert hyp.words and all(w in graph.words for w in hyp.words)
        words = tr.segments[0].words
        assert [w.word for w in words] == hyp.words
        assert [round(f * model.frame_shift, 3) for f in hyp.word_frames] == [w.start for w in words]
        assert all(a.start <= a.end <= len(audio) / 16000 for a in words)
        assert all(0 < w.confidence <= 1 for w in words)


def test_streaming_and_bad_graphs_are_refused(model, graph_path, tmp_path):
    path, graph = graph_path
    with pytest.raises(UnsupportedOptionError, match="offline"):
        model.new_stream(DecodingOptions.build(wfst_graph=path))
    with pytest.raises(InvalidRequestError, match="does not exist"):
        model.transcribe([np.zeros(16000, np.float32)], DecodingOptions.build(wfst_graph=str(tmp_path / "x.npz")))
    with pytest.raises(InvalidRequestError):
        model.transcribe([np.zeros(16000, np.float32)], DecodingOptions.build(wfst_graph=path, wfst_beam=-1))
    small = build_tlg([("a", ["A"])], read_arpa(["\\data\\", "ngram 1=3", "", "\\1-grams:", "-1 </s>",
                                                   "-99 <s>", "-1 a", "", "\\end\\"]))  # fmt: skip
    other = str(save_graph(small, tmp_path / "small.npz"))
    with pytest.raises(InvalidRequestError, match="tokens"):
        model.transcribe([np.zeros(16000, np.float32)], DecodingOptions.build(wfst_graph=other))
