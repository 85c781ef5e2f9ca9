"""icefall Zipformer (CTC head) decoding over a WFST graph through ``wfst_graph``: the same
words as the decoder run directly on the model's CTC log-probs; a model without a CTC head
refuses. Uses tests/icefall's tiny random-weight checkpoints (icefall's own AsrModel from the
``zipformer`` package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.errors import UnsupportedOptionError
from oasr.types import DecodingOptions

pytest.importorskip("kaldifst")
if importlib.util.find_spec("zipformer") is None:  # imported with fakes by tests/icefall's helpers
    pytest.skip("needs the icefall reference: pip install --no-deps zipformer==0.1.3",
                allow_module_level=True)  # fmt: skip

ICEFALL_TESTS = Path(__file__).resolve().parents[1] / "icefall"


def _icefall_helpers():
    spec = importlib.util.spec_from_file_location("wfst_icefall_helpers", ICEFALL_TESTS / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("wfst_icefall_helpers", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def icefall(tmp_path_factory):
    h = _icefall_helpers()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with h.reference.icefall_reference() as ref:
        m = h.build_reference(ref, causal=False, seed=1)
        path = h.write_release(tmp_path_factory.mktemp("icefall_wfst"), m)
        no_ctc = h.build_reference(ref, causal=False, seed=3, use_ctc=False)
        path_no_ctc = h.write_release(tmp_path_factory.mktemp("icefall_wfst_noctc"), no_ctc)
    yield h, path, path_no_ctc
    torch.set_num_threads(n)


def test_zipformer_ctc_over_a_graph(icefall, tmp_path):
    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig
    from oasr_decoders_wfst.build import build_tlg, read_arpa
    from oasr_decoders_wfst.decoder import WfstDecoder, WfstSearchOptions
    from oasr_decoders_wfst.graph import save_graph

    h, path, path_no_ctc = icefall
    model = load_model(EngineConfig(ckpt_dir=str(path)))
    units = h.tokens_table()
    plain = [u.replace("\u2581", "") for u in units[3:]]
    lexicon = [(p.lower() + str(i), [u]) for i, (p, u) in enumerate(zip(plain, units[3:], strict=True))]
    words = [w for w, _ in lexicon]
    arpa = ["\\data\\", f"ngram 1={len(words) + 2}", "", "\\1-grams:", "-1.0 </s>", "-99 <s>"]
    arpa += [f"{-1.2 - 0.03 * i:.2f} {w}" for i, w in enumerate(words)] + ["", "\\end\\"]
    graph = build_tlg(lexicon, read_arpa(arpa), tokens=units)
    gpath = str(save_graph(graph, tmp_path / "tlg.npz"))
    audios = h.waves(2, seed=4)
    out = model.transcribe(audios, DecodingOptions.build(wfst_graph=gpath, wfst_beam=10.0))
    o = model._check(DecodingOptions())
    feats, lens = model.features(audios)
    enc, enc_lens = model.encode_features(feats, lens, o)
    with torch.no_grad():
        logp = model.net.ctc_log_probs(enc)
    hyps = WfstDecoder(graph, "cpu", WfstSearchOptions(beam=10.0, max_active=7000)).decode(
        logp, enc_lens.tolist())
    for tr, hyp in zip(out, hyps, strict=True):
        assert hyp.words and tr.text == " ".join(hyp.words)
        assert [w.word for w in tr.segments[0].words] == hyp.words
        assert [round(f * model.frame_shift, 3) for f in hyp.word_frames] == [
            w.start for w in tr.segments[0].words]
    no_ctc = load_model(EngineConfig(ckpt_dir=str(path_no_ctc)))
    with pytest.raises(UnsupportedOptionError, match="no CTC head"):
        no_ctc.transcribe([np.zeros(16000, np.float32)], DecodingOptions.build(wfst_graph=gpath))
