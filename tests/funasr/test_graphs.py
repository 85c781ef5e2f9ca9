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
        12,
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
        best, ids = g._decode(enc_h, lens, embeds, ntok)
        hidden = m.net.decoder(enc_h, lens, embeds, ntok)[1]
        nb = round_up(n, 8) + 3
        static = _padded(g, ((bb, tb, enc_h.shape[2]), (bb,), (bb, nb, embeds.shape[2]), (bb,)),
                         (enc_h, lens, embeds, ntok), (b, t, n))  # fmt: skip
        pbest, pids = g._decode(*static)
        phidden = m.net.decoder(*static)[1]  # what the SeACo bias reads
        for r in range(b):
            k = int(ntok[r])
            assert torch.equal(ids[r, :k], pids[r, :k])
            assert torch.allclose(best[r, :k], pbest[r, :k], atol=1e-5)
            assert torch.allclose(hidden[r, :k], phidden[r, :k], atol=1e-4)


class _Rerun:
    """A stand-in for a captured graph on the CPU: ``replay`` recomputes the function on the
    static inputs into the same output tensors, as a CUDA graph replay does."""

    def __init__(self, fn, static, outputs) -> None:  # noqa: ANN001
        self.fn, self.static, self.outputs = fn, static, outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn(*self.static), strict=True):
            out.copy_(new)


class _CPUGraphs(ParaformerGraphs):
    fail = False

    def _record(self, fn, static):  # noqa: ANN001, ANN202
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        outputs = fn(*static)
        return _Rerun(fn, static, outputs), outputs


def test_graph_bookkeeping_through_transcribe(releases, clips) -> None:
    """The model's graph path end to end, with the capture replaced by a recomputation: eager
    on a shape's first use, captured on its second, replayed after; rows of a smaller batch in
    the same bucket; the least recently used graph dropped past ``max_graphs``; a failed
    capture turns graphs off and the call runs eagerly. Transcripts and timestamps == eager."""
    import pytest

    from oasr.checkpoint import load_model
    from oasr.types import DecodingOptions

    m = load_model(EngineConfig(ckpt_dir=str(releases["bicif"])))
    # short pieces: the bookkeeping is under test here, not the audio
    names = ZH_CLIPS[:2] + EN_CLIPS[:1]
    waves = [clips[n][: 16000 * k] for n, k in zip(names, (2, 1, 2), strict=True)]
    opts = DecodingOptions(word_timestamps=True)

    def run(ws):  # noqa: ANN001, ANN202
        return [
            (t.text, [(w.word, w.start, w.end) for w in t.words]) for t in m.transcribe(ws, opts)
        ]

    assert m._cuda_graphs() is None  # the CPU: eager whatever the default (on)
    eager, eager_sub = run(waves), run(waves[1:])
    assert all(text and words for text, words in eager + eager_sub)
    g = m._graphs = _CPUGraphs(m.net, max_graphs=3)
    m.cuda_graphs = True
    for _ in range(3):
        assert run(waves) == eager
    assert g.stats == {"captures": 2, "replays": 4, "eager": 2}, g.stats
    for _ in range(2):  # 2 rows: batch bucket 2, its own graphs
        assert run(waves[1:]) == eager_sub
    assert len(g._graphs) == 3 and g.stats["captures"] == 4  # one dropped
    g.fail, g._graphs, g._uses = True, type(g._graphs)(), {}
    run(waves)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert run(waves) == eager
    assert g.disabled is not None


def test_a_pool_whose_graphs_are_all_dropped_is_renewed() -> None:
    """Past ``max_graphs`` the least recently used graph goes; once none is left the next
    capture gets a new memory pool (torch refuses to capture into a pool whose graphs are all
    gone), and while one is left the pool is shared."""
    g = _CPUGraphs(torch.nn.Module(), max_graphs=2)
    args, shapes = (torch.ones(2, 3),), ((2, 3),)

    def capture(key):  # noqa: ANN001, ANN202
        return g._capture(key, lambda a: (2 * a,), args, shapes)

    capture("a")
    g._pool = pool = object()  # what the first real capture sets
    capture("b")
    assert g._pool is pool and list(g._graphs) == ["a", "b"]
    capture("c")  # drops "a", "b" still holds the pool
    assert g._pool is pool and list(g._graphs) == ["b", "c"]
    g.max_graphs = 1
    capture("d")  # drops both: a new pool
    assert g._pool is None and list(g._graphs) == ["d"]
    d = g._graphs["d"]
    g._fill(d.inputs, args, 2)
    d.graph.replay()
    assert torch.equal(d.outputs[0], torch.full((2, 3), 2.0))
