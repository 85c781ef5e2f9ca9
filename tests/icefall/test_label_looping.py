"""icefall's stateless decoder on the core greedy search's device loop for several symbols per
frame (``sync_free``: RNN-T greedy as the TDT loop with the one duration 0): the frame loop's
hypotheses, with and without ``blank_penalty``; with ``unk_id`` (treated like blank) the frame
loop is kept."""

from __future__ import annotations

import pytest
import torch

from oasr.checkpoint import load_model
from oasr.decoders import TransducerGreedySearch
from oasr.types import DecodingOptions, EngineConfig


@pytest.mark.parametrize("max_symbols,blank_penalty", [(3, 0.0), (2, 0.7)])
def test_device_loop_equals_frame_loop(offline_release, helpers, monkeypatch, max_symbols,
                                       blank_penalty) -> None:
    model = load_model(EngineConfig(ckpt_dir=str(offline_release[1])))
    feats, lens = model.features(helpers.waves(3))
    enc, enc_lens = model.encode_features(feats, lens, model._check(DecodingOptions()))
    lens = [int(n) for n in enc_lens.tolist()]
    assert max(lens) >= TransducerGreedySearch.label_looping_min_frames
    with torch.no_grad():
        proj = model.net.joiner.encoder_proj(enc)
    calls = []
    step = TransducerGreedySearch._step_label_looping
    monkeypatch.setattr(TransducerGreedySearch, "_step_label_looping",
                        lambda self, *a: (calls.append(1), step(self, *a)))

    def run(sync_free, unk_id=None):  # noqa: ANN001, ANN202
        s = TransducerGreedySearch(model.decoder_network, len(lens), blank_id=model.blank_id,
                                   max_symbols_per_frame=max_symbols, unk_id=unk_id,
                                   blank_penalty=blank_penalty, sync_free=sync_free)
        s.step(proj, lens)
        return s.results()

    loop = run(False)
    assert sum(len(h.tokens) for h in loop) >= 15
    device = run(True)
    assert calls == [1]
    for a, b in zip(loop, device, strict=True):
        assert (a.tokens, a.times) == (b.tokens, b.times)
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
        assert a.score == pytest.approx(b.score, rel=1e-6, abs=1e-4)
    run(True, unk_id=2)  # unk treated like blank: not the duration loop
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_device_loop_equals_frame_loop(offline_release, helpers, monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = load_model(EngineConfig(ckpt_dir=str(offline_release[1]), device="cuda", dtype="float32"))
    feats, lens = model.features(helpers.waves(3) * 3)
    enc, enc_lens = model.encode_features(feats, lens, model._check(DecodingOptions()))
    lens = [int(n) for n in enc_lens.tolist()]
    with torch.no_grad():
        proj = model.net.joiner.encoder_proj(enc)
    out = []
    for sync_free, graph in ((False, False), (True, False), (True, True)):
        s = TransducerGreedySearch(model.decoder_network, len(lens), blank_id=model.blank_id,
                                   max_symbols_per_frame=3, sync_free=sync_free, cuda_graph=graph)
        s.step(proj, lens)
        out.append(s.results())
    for other in out[1:]:
        for a, b in zip(out[0], other, strict=True):
            assert (a.tokens, a.times) == (b.tokens, b.times)
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
