"""The server's streaming CUDA graphs on a GPU (``pytest -m gpu``): after the cache pool grows
(every graph dropped) the steps capture again instead of failing torch's graph-pool assertion
(the H200 server run fell back to eager there), and a capture succeeds while another thread
allocates and synchronises on the device (a server's uploads beside its stream loop)."""

from __future__ import annotations

import threading
import warnings
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.types import DecodingOptions, EngineConfig
from tests.streaming_helpers import feed_streams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DATA = Path(__file__).resolve().parents[1] / "data"
CLIPS = ("zh_aishell_BAC009S0764W0121.wav", "en_ls_1089-134686-0001.wav")


def _read(name: str) -> np.ndarray:
    with wave.open(str(DATA / "speech" / name)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


def _run(model, audios: list[np.ndarray], piece: int = 5120) -> list[list[int]]:
    states = [model.new_stream(DecodingOptions(beam_size=1), chunk_size=8) for _ in audios]
    return [up.transcript.segments[0].tokens if up.transcript.segments else []
            for up in feed_streams(model, states, audios, piece)]


def test_graphs_recaptured_after_the_pool_grows_and_beside_another_thread() -> None:
    from oasr.checkpoint import load_model

    model = load_model(EngineConfig(ckpt_dir=str(DATA / "wenet" / "u2pp_conformer"), device="cuda",
                                    dtype="float32"))  # fmt: skip
    base = [_read(n) for n in CLIPS]
    audios = [base[i % 2][(i * 1700) % 8000 :][: 40000 + 3000 * i] for i in range(4)]
    model.stream_cuda_graphs = False
    eager = _run(model, audios)
    model.stream_cuda_graphs = True
    assert model.capture_stream_graphs(max_batch=4, chunk_size=8, max_history=64) > 0
    graphs = model._stream_graphs()
    # another thread allocates and copies to the host all along (uploads beside the streams)
    stop, errors = threading.Event(), []

    def busy() -> None:
        try:
            while not stop.is_set():
                x = torch.full((256, 1024), 0.5, device="cuda") @ torch.ones(
                    1024, 64, device="cuda"
                )
                x.sum().item()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    other = threading.Thread(target=busy)
    other.start()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*capture failed")  # no eager fallback
            generation = model.stream_pool.generation
            model.stream_pool.ensure(4 * model.stream_pool.capacity + 8, 512)  # drops every graph
            assert model.stream_pool.generation != generation
            captures = graphs.stats["captures"]
            graphed = _run(model, audios)  # captures again, beside the other thread
            assert graphs.stats["captures"] > captures and model.stream_cuda_graphs
            again = _run(model, audios)
    finally:
        stop.set()
        other.join()
    assert not errors, errors
    assert graphed == eager and again == eager
    assert graphs.stats.get("failures", 0) == 0
