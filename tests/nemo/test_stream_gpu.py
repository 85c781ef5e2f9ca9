"""Nemotron streaming on CUDA (``pytest -m gpu tests/nemo``) with its CUDA graphs (the default
there; ``OASR_NEMO_STREAM_GRAPHS=0`` turns them off): the chunk step replayed as CUDA
graphs per batch bucket gives the eager step's tokens and encoder output (float32, TF32 off),
streams of different ages and lookaheads share steps, the greedy search's device loop (one and
several symbols per frame) agrees, finals equal offline decoding on the device; in float16 the
graphs replay exactly what the same padded steps give eagerly; a capture that fails in the
middle of serving runs that step eagerly and loses no stream. Small on purpose (a fresh H200
with a 45 s per-test limit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasr.types import DecodingOptions, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32"), pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(hf_checkpoints, dtype: str):  # noqa: ANN202
    from oasr.checkpoint import load_model

    model = load_model(EngineConfig(ckpt_dir=str(hf_checkpoints["nemotron"].path), device="cuda", dtype=dtype))
    model.keep_encoder_output = True
    assert model.stream_cuda_graphs  # the default on CUDA (unless OASR_NEMO_STREAM_GRAPHS=0)
    return model


def _clips(waves) -> list[np.ndarray]:
    return [waves[0], waves[1], waves[2], np.concatenate([waves[2], waves[0]]), waves[1][:5000]]


def _run(model, clips, options):  # noqa: ANN001, ANN202
    """Streams of different ages (joining at different steps, pieces of different sizes)."""
    states = [model.new_stream(o) for o in options]
    pos, finals, step = [0] * len(clips), [None] * len(clips), 0
    starts = [0, 1, 1, 3, 4]
    while any(f is None for f in finals):
        rows = [i for i in range(len(clips)) if finals[i] is None and step >= starts[i]]
        chunks, lasts = [], []
        for i in rows:
            n = 1700 + 900 * i
            chunks.append(clips[i][pos[i]: pos[i] + n])
            pos[i] += n
            lasts.append(pos[i] >= len(clips[i]))
        if rows:
            for i, up in zip(rows, model.stream_step([states[i] for i in rows], chunks, lasts), strict=True):
                if up.is_final:
                    finals[i] = up
        step += 1
    return finals, [torch.cat(s.encoder_output).float() for s in states]


def _tokens(update) -> list[int]:
    return update.transcript.segments[0].tokens if update.transcript.segments else []


def test_graph_steps_equal_eager_and_offline(hf_checkpoints, waves) -> None:
    model = _model(hf_checkpoints, "float32")
    clips = _clips(waves)
    options = [DecodingOptions(model_options={"lookahead": la, "max_symbols_per_frame": ms})
               for la, ms in ((2, 1), (2, 3), (0, 3), (2, 3), (2, 1))]
    rt = model.stream_runtime
    assert rt.graphs is not None
    graph_finals, graph_enc = _run(model, clips, options)
    # a failed capture warns and drops the graphs (eager from then on)
    assert rt.graphs is not None and rt.graphs.stats["replays"] >= 6
    saved, rt.graphs = rt.graphs, None
    try:
        eager_finals, eager_enc = _run(model, clips, options)
    finally:
        rt.graphs = saved
    for g, e, ge, ee in zip(graph_finals, eager_finals, graph_enc, eager_enc, strict=True):
        assert _tokens(g) == _tokens(e)
        assert ge.shape == ee.shape and (ge - ee).abs().max().item() < 1e-4
    offline = [model.transcribe([c], o)[0].text for c, o in zip(clips, options, strict=True)]
    assert [f.text for f in graph_finals] == offline
    assert model.stream_occupancy()["streams"] == 0


def test_float16_graphs_replay_the_padded_eager_step(hf_checkpoints, waves) -> None:
    from oasr.stream_cache import GraphSteps

    model = _model(hf_checkpoints, "float16")
    clips = _clips(waves)
    # one symbol per frame: both runs search with the same device frame loop over the same rows
    # (several symbols: the graph run's label-looping loop joins other row sets than the host
    # frame loop, and float16 near-ties could then differ; test_graph_steps_... covers it in fp32)
    options = [DecodingOptions(model_options={"max_symbols_per_frame": 1})] * len(clips)
    rt = model.stream_runtime
    assert model.capture_stream_graphs(max_batch=8, max_symbols=1) == 4  # buckets 1, 2, 4, 8
    captures = rt.graphs.stats["captures"]
    graph_finals, graph_enc = _run(model, clips, options)
    assert rt.graphs.stats["captures"] == captures  # captured ahead: serving captures nothing
    saved = rt.graphs
    rt.graphs = GraphSteps(rt.compute, rt.dummy_inputs, simulate=True)  # same shapes, no graph
    try:
        eager_finals, eager_enc = _run(model, clips, options)
    finally:
        rt.graphs = saved
    for g, e, ge, ee in zip(graph_finals, eager_finals, graph_enc, eager_enc, strict=True):
        assert _tokens(g) == _tokens(e)
        assert ge.shape == ee.shape and (ge - ee).abs().max().item() < 1e-2
    assert sum(bool(f.text) for f in graph_finals) >= 3


def test_capture_failing_mid_serving_runs_the_step_eagerly(hf_checkpoints, waves) -> None:
    """A real capture that cannot finish (a host read inside it, as an op that reads a scale
    back would do) while streams are being served: that step runs eagerly on the thread's own
    stream, graphs turn off with a warning, and every stream still ends with offline
    decoding's text (none advanced twice, none dropped, every slot returned)."""
    model = _model(hf_checkpoints, "float32")
    clips = _clips(waves)
    options = [DecodingOptions(model_options={"max_symbols_per_frame": 1})] * len(clips)
    rt = model.stream_runtime
    assert rt.graphs is not None
    compute, seen = rt.graphs.fn, []

    def failing(*args):  # noqa: ANN002, ANN202
        out = compute(*args)
        if torch.cuda.is_current_stream_capturing():
            seen.append(args[0].shape[0])
            if len(seen) == 2:  # the second bucket's capture: streams are in flight by then
                out[0].sum().item()
        return out

    rt.graphs.fn = failing
    stream = torch.cuda.current_stream()
    with pytest.warns(RuntimeWarning, match="capture failed"):
        finals, _ = _run(model, clips, options)
    assert rt.graphs is None and len(seen) == 2
    assert torch.cuda.current_stream() == stream
    offline = [model.transcribe([c], o)[0].text for c, o in zip(clips, options, strict=True)]
    assert [f.text for f in finals] == offline
    assert model.stream_occupancy()["streams"] == 0
