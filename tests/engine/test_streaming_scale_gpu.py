"""Streaming at scale on CUDA (``pytest -m gpu``): the captured chunk step gives the eager step's
results, streams of different ages share a captured batch, and the pool is empty afterwards."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.types import DecodingOptions, EngineConfig
from tests.streaming_helpers import feed_streams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DATA = Path(__file__).resolve().parents[1] / "data"
CLIPS = ("zh_aishell_BAC009S0764W0121.wav", "zh_aishell_BAC009S0724W0121.wav", "en_ls_1089-134686-0001.wav")


def _read(name: str) -> np.ndarray:  # 16 kHz PCM16 WAVs, read without PyAV
    with wave.open(str(DATA / "speech" / name)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


def _run(model, audios, chunk: int, piece: int, starts: list[int]):
    """All streams through ``stream_step`` in shared batches, stream i joining at step
    ``starts[i]``: (final texts, tokens, encoder outputs)."""
    opts = DecodingOptions(beam_size=1)
    states = [model.new_stream(opts, chunk_size=chunk, keep_encoder_output=True) for _ in audios]
    finals = feed_streams(model, states, audios, piece, starts)
    return ([f.text for f in finals], [f.transcript.segments[0].tokens if f.transcript.segments else [] for f in finals],
            [torch.cat(s.enc).float().cpu() for s in states])  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_graph_step_equals_eager(dtype) -> None:
    from oasr.checkpoint import load_model

    model = load_model(EngineConfig(ckpt_dir=str(DATA / "wenet" / "u2pp_conformer"), device="cuda", dtype=dtype))
    base = [_read(n) for n in CLIPS]
    audios = [base[i % 3][(i * 1700) % 8000 :][: 40000 + 3000 * i] for i in range(10)]
    starts = [0, 0, 1, 1, 2, 3, 3, 5, 6, 8]  # streams of different ages share every batch
    model.stream_cuda_graphs = False
    eager = _run(model, audios, 8, 5120, starts)
    model.stream_cuda_graphs = True
    captured = model.capture_stream_graphs(max_batch=16, chunk_size=8, max_history=256)
    assert captured > 0
    graphs = model._stream_graphs()
    replays = graphs.stats["replays"]
    graphed = _run(model, audios, 8, 5120, starts)
    assert graphs.stats["replays"] > replays + 10
    assert graphs.stats["captures"] == captured  # everything was captured ahead
    tol = 1e-3 if dtype == "float32" else 2e-2
    for e1, e2 in zip(eager[2], graphed[2], strict=True):
        assert e1.shape == e2.shape
        assert (e1 - e2).abs().max().item() < tol * max(1.0, e1.abs().max().item())
    same = sum(a == b for a, b in zip(eager[1], graphed[1], strict=True))
    if dtype == "float32":
        assert same == len(audios)
    else:  # fp16 with random weights: near-tied CTC argmaxes may flip with the batch's shapes
        assert same >= len(audios) - 2
    pool = model.stream_pool
    pool.reserve([], [])
    assert pool.num_streams == 0 and pool.blocks_in_use == 0


def test_gpu_streams_match_cpu_streams() -> None:
    from oasr.checkpoint import load_model

    ckpt = str(DATA / "wenet" / "u2pp_conformer")
    cpu = load_model(EngineConfig(ckpt_dir=ckpt))
    gpu = load_model(EngineConfig(ckpt_dir=ckpt, device="cuda", dtype="float32"))
    base = [_read(n) for n in CLIPS]
    audios = [base[i % 3][: 30000 + 5000 * i] for i in range(6)]
    starts = [0, 1, 1, 2, 4, 4]
    c = _run(cpu, audios, 16, 10240, starts)
    g = _run(gpu, audios, 16, 10240, starts)
    assert c[0] == g[0]
    for e1, e2 in zip(c[2], g[2], strict=True):  # cuDNN TF32 convolutions: ~1e-3 (tests/wenet)
        assert (e1 - e2).abs().max().item() < 2e-3 * max(1.0, e1.abs().max().item())


def test_many_streams_one_step_medium_shape() -> None:
    """512 streams of the benchmark's medium shape (fp16) in one captured step: every row's
    output equals the same stream run in a batch of one (eager)."""
    from benchmarks.streambench import load_stream_model, stream_audio

    model = load_stream_model(None, "medium", "cuda", "float16")
    model.chunk_size = 16
    n = 512
    audios = [stream_audio(i, 1.0) for i in range(n)]
    opts = DecodingOptions(beam_size=1)
    states = [model.new_stream(opts, keep_encoder_output=True) for _ in range(n)]
    model.stream_step(states, [a[:10960] for a in audios], [False] * n)  # captures (512, 67, 0) once
    assert model._stream_graphs().stats == {"captures": 1, "replays": 1}
    batched = [s.enc[0].float().cpu() for s in states]
    for s in states:
        model.release_stream(s)
    model.stream_cuda_graphs = False
    for i in (0, 1, 255, 511):
        s = model.new_stream(opts, keep_encoder_output=True)
        model.stream_step([s], [audios[i][:10960]], [False])
        one = s.enc[0].float().cpu()
        assert (one - batched[i]).abs().max().item() < 3e-2 * max(1.0, one.abs().max().item())
        model.release_stream(s)
