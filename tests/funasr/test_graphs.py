"""What the CUDA graphs rely on, checked on the CPU: at a graph's bucketed shapes (rows and
frames / tokens zero-padded, padded rows one frame long) the encoder + predictor and the decoder
give each real row what they give it unpadded. The captures themselves: tests/funasr/test_gpu.py."""

from __future__ import annotations

import torch

from oasr.types import EngineConfig
from oasr_models_funasr.graphs import ParaformerGraphs, batch_bucket, round_up

from .conftest import EN_CLIPS, ZH_CLIPS  # noqa: TID252


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 64)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        24,
        64,
    ]
    assert [round_up(n, 16) for n in (1, 16, 17, 150)] == [16, 16, 32, 160]


def _padded(g: ParaformerGraphs, shapes, args, real):  # noqa: ANN001, ANN202
    static = tuple(
        torch.ones(s, dtype=a.dtype) if len(s) == 1 else torch.full(s, 7.0, dtype=a.dtype)
        for s, a in zip(shapes, args, strict=True)
    )  # stale values: _fill must overwrite every element
    g._fill(static, args, real[0])
    return static


def test_padded_shapes_give_the_unpadded_rows(releases, clips) -> None:
    from oasr.checkpoint import load_model

    m = load_model(EngineConfig(ckpt_dir=str(releases["bicif"])))
    g = ParaformerGraphs(m.net)
    waves = [clips[n] for n in ZH_CLIPS + EN_CLIPS[:2]]
    feats, lens = m.features(waves)
    b, t, d = feats.shape
    with torch.no_grad():
        eager = g._encode_predict(feats, lens)
        bb, tb = batch_bucket(b) + 3, round_up(t, 16) + 5  # also past the buckets
        static = _padded(g, ((bb, tb, d), (bb,)), (feats, lens), (b, t))
        padded = g._encode_predict(*static)
        enc_h, enc, conv, alphas = padded
        padded = (enc_h[:b, :t], enc[:b, :t], conv[:b, :, :t], alphas[:b, :t])
        for e, p in zip(eager, padded, strict=True):
            assert p.shape == e.shape
            assert (e - p).abs().max().item() <= 1e-5 * max(1.0, e.abs().max().item())
        enc_h = eager[0]
        n = 9
        ntok = torch.tensor([9, 4, 7, 1, 6])
        embeds = torch.randn(b, n, enc_h.shape[2]) * (
            torch.arange(n)[None, :, None] < ntok[:, None, None]
        )
        best, ids, hidden = g._decode(enc_h, lens, embeds, ntok)
        nb = round_up(n, 8) + 3
        static = _padded(g, ((bb, tb, enc_h.shape[2]), (bb,), (bb, nb, embeds.shape[2]), (bb,)),
                         (enc_h, lens, embeds, ntok), (b, t, n))  # fmt: skip
        pbest, pids, phidden = g._decode(*static)
        for r in range(b):
            k = int(ntok[r])
            assert torch.equal(ids[r, :k], pids[r, :k])
            assert torch.allclose(best[r, :k], pbest[r, :k], atol=1e-5)
            assert torch.allclose(hidden[r, :k], phidden[r, :k], atol=1e-4)
