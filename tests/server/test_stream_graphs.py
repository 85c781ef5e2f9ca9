"""The streaming CUDA graphs behind ``oasr-server --service-mode streaming`` (issue #20), on the
CPU:

* :class:`oasr.stream_cache.GraphSteps` re-captures after dropping its graphs (a cache-pool growth
  changes the generation): torch's allocator forgets a graph pool whose graphs are all gone, and
  a capture into that dead handle failed its ``use_count > 0`` assertion on the H200 (the server
  then ran eagerly and 172 of 500 finals differed). A fake of the allocator's pool bookkeeping
  stands in for CUDA here.
* A capture that fails leaves every stream's state as it was: that step runs eagerly, the
  finals are those of a run without the failure.
* The server captures every graph its streams will use while it warms up, before it reports
  ready (``GraphSteps(simulate=True)`` on the CPU: static buffers, padded batches): serving
  captures nothing, and its finals equal the in-process engine's.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("oasr_models_wenet")
torch = pytest.importorskip("torch")

from oasr.types import DecodingOptions  # noqa: E402
from tests.server.test_streaming_engine import (  # noqa: E402
    COMPLETED,
    append,
    open_session,
    receive_until,
    speech,
)
from tests.streaming_helpers import feed_streams  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
U2PP = REPO / "tests" / "data" / "wenet" / "u2pp_conformer"


# -- GraphSteps against a fake of torch's graph-pool bookkeeping ---------------------------------
class _Allocator:
    """Use counts of graph pools, as ``CUDACachingAllocator`` keeps them: a capture into an
    existing pool needs a live one (``use_count > 0``); a destroyed graph decrements its pool."""

    def __init__(self) -> None:
        self.use_count: dict[int, int] = {}
        self.handles = 0

    def handle(self) -> int:
        self.handles += 1
        return self.handles


class _FakeCUDA:
    def __init__(self, alloc: _Allocator) -> None:
        alloc_ = alloc

        class Graph:
            def __init__(self) -> None:
                self.pool: int | None = None
                self.fn: Any = None

            def begin(self, pool: int) -> None:
                if pool in alloc_.use_count:
                    if alloc_.use_count[pool] <= 0:
                        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
                    alloc_.use_count[pool] += 1
                else:
                    alloc_.use_count[pool] = 1
                self.pool = pool

            def replay(self) -> None:
                pass

            def __del__(self) -> None:
                if self.pool is not None:
                    alloc_.use_count[self.pool] -= 1

        self.CUDAGraph = Graph
        self.graph_pool_handle = alloc.handle

    @staticmethod
    @contextlib.contextmanager
    def graph(g: Any, pool: int, capture_error_mode: str = "global") -> Any:
        assert capture_error_mode == "thread_local"  # other threads' device work is allowed
        g.begin(pool)
        yield

    class Stream:
        def wait_stream(self, other: Any) -> None:
            pass

    @staticmethod
    def stream(s: Any) -> Any:
        return contextlib.nullcontext()

    @staticmethod
    def current_stream() -> Any:
        return _FakeCUDA.Stream()

    @staticmethod
    def set_stream(s: Any) -> None:  # GraphSteps puts the caller's stream back after a failure
        assert isinstance(s, _FakeCUDA.Stream)


def test_graph_steps_recapture_after_dropping_every_graph(monkeypatch) -> None:
    from oasr.stream_cache import GraphSteps

    alloc = _Allocator()
    fake = _FakeCUDA(alloc)
    for name in ("CUDAGraph", "graph_pool_handle", "graph", "Stream", "stream", "current_stream", "set_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))

    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + 1,)

    graphs = GraphSteps(fn, lambda key: (torch.zeros(key),), max_graphs=3)
    for key in (1, 2, 4):
        graphs.capture(key, 0)
    assert graphs.stats["captures"] == 3 and len(set(alloc.use_count)) == 1  # one shared pool
    # the cache pool grew: every graph holds dead addresses and is dropped, its pool with it
    graphs.capture(1, 1)
    graphs.capture(8, 1)
    assert graphs.stats["captures"] == 5
    # past max_graphs all are dropped too
    graphs.capture(16, 1)
    graphs.capture(32, 1)
    assert graphs.stats["captures"] == 7
    out = graphs.run(32, 1, torch.ones(32))
    assert graphs.stats["replays"] == 1 and len(out) == 1
    # a capture that raises (after its eager warm-up ran) keeps no graph, and the next capture
    # starts a fresh pool rather than one the failed capture may have left half-counted
    calls = []

    def fails_when_captured(x: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append(x.shape[0])
        if len(calls) == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        return (x,)

    graphs.fn = fails_when_captured
    handles = alloc.handles
    with pytest.raises(RuntimeError, match="capturing"):
        graphs.capture(64, 1)
    assert 64 not in graphs._graphs and graphs.stats["failures"] == 1
    graphs.capture(64, 1)
    assert 64 in graphs._graphs and alloc.handles == handles + 1


# -- a failed capture in the middle of a run -----------------------------------------------------
def _feed(model: Any, audios: list[np.ndarray], starts: list[int], piece: int = 3200) -> list[Any]:
    """All streams in shared batches, stream i joining at step ``starts[i]``; the final updates."""
    states = [model.new_stream(DecodingOptions(), chunk_size=4) for _ in audios]
    return feed_streams(model, states, audios, piece, starts)


def test_failed_capture_runs_the_step_from_unchanged_state(monkeypatch) -> None:
    """The capture of the 4-row bucket raises after the run has started: that step runs
    eagerly, the rest of the run too; every token equals the run where nothing failed."""
    from oasr.checkpoint import load_model
    from oasr.stream_cache import GraphSteps
    from oasr.types import EngineConfig

    model = load_model(EngineConfig(ckpt_dir=str(U2PP)))
    clips = [
        "zh_aishell_BAC009S0764W0121.wav",
        "en_ls_2830-3980-0043.wav",
        "en_ls_4507-16021-0012.wav",
    ]
    base = [speech(n) for n in clips]
    audios = [base[i % 3][(i * 1700) % 8000 :][: 20000 + 2500 * i] for i in range(5)]
    starts = [0, 0, 1, 2, 2]

    class FailsAtFour(GraphSteps):
        def capture(self, key: Any, generation: Any) -> None:
            if key[0] == 4 and key not in self._graphs:
                self.stats["failures"] = self.stats.get("failures", 0) + 1
                raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
            super().capture(key, generation)

    def run(graphs: GraphSteps) -> list[Any]:
        model.stream_cuda_graphs = True
        monkeypatch.setattr(
            model, "_stream_graphs", lambda: graphs if model.stream_cuda_graphs else None
        )
        return _feed(model, audios, starts)

    good = GraphSteps(model._chunk_compute, model._graph_inputs, simulate=True)
    expected = run(good)
    bad = FailsAtFour(model._chunk_compute, model._graph_inputs, simulate=True)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        got = run(bad)
    assert bad.stats["failures"] == 1 and not model.stream_cuda_graphs  # eager from then on
    assert bad.stats["replays"] > 0  # graphs ran before the failure
    for e, g in zip(expected, got, strict=True):
        assert e.text == g.text
        assert e.transcript.segments[0].tokens == g.transcript.segments[0].tokens
    assert model.stream_pool.num_streams == 0


# -- the server captures ahead -------------------------------------------------------------------
def test_server_captures_stream_graphs_before_ready(monkeypatch) -> None:
    """Streaming mode with a warm-up: every batch bucket up to min(max_batch_size, max_streams)
    x every history bucket is captured (simulated) before ready; three concurrent realtime turns
    then replay graphs and capture none, and each final is the in-process engine's."""
    from starlette.testclient import TestClient

    from oasr.engine import ASREngine
    from oasr.types import EngineConfig
    from oasr_models_wenet.model import WenetASR
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    made: list[Any] = []

    def simulated(self: WenetASR) -> Any:
        from oasr.stream_cache import GraphSteps

        graphs = self.__dict__.get("_graphs")
        if graphs is None:
            graphs = self.__dict__["_graphs"] = GraphSteps(
                self._chunk_compute, self._graph_inputs, simulate=True
            )
            made.append(graphs)
        return graphs

    monkeypatch.setattr(WenetASR, "_stream_graphs", simulated)
    monkeypatch.setattr(WenetASR, "stream_warm_history", 128)  # history buckets 0, 16, ..., 128
    config = EngineConfig(ckpt_dir=str(U2PP), service_mode="streaming", max_batch_size=16)
    app = create_app(
        ServerConfig(warmup=True, max_streams=3, max_batch_size=16), engine_config=config
    )
    clips = [speech(n) for n in ("en_ls_2830-3980-0043.wav", "en_ls_4507-16021-0012.wav")]
    audios = [clips[0], clips[1], clips[1][9000:]]
    with TestClient(app) as client:
        assert app.state.oasr.wait_loaded(60), app.state.oasr.load_error
        (graphs,) = made
        model = app.state.oasr.engine.model
        window = (model.chunk_size - 1) * 4 + 7  # conv2d subsampling: 4x, 6 frames of context
        ahead = {(r, window, s) for r in (1, 2, 4) for s in (0, 16, 32, 64, 128)}  # <= 3 streams
        assert set(graphs._graphs) == ahead
        assert model.stream_pool.capacity >= 3
        captured = graphs.stats["captures"]
        sockets = [open_session(client) for _ in audios]
        try:
            for ws, audio in zip(sockets, audios, strict=True):
                append(ws, audio)
            for ws in sockets:
                ws.send_json({"type": "input_audio_buffer.commit"})
            finals = [[e for e in receive_until(ws, COMPLETED) if e["type"] == COMPLETED][0]["transcript"]
                      for ws in sockets]  # fmt: skip
        finally:
            for ws in sockets:
                ws.__exit__(None, None, None)
        assert graphs.stats["replays"] > 0
        assert graphs.stats["captures"] == captured  # nothing captured while serving
    reference = ASREngine(EngineConfig(ckpt_dir=str(U2PP), service_mode="streaming"))
    expected = []
    for audio in audios:
        rid = reference.add_streaming_request(DecodingOptions())
        for i in range(0, len(audio), 1600):
            reference.feed_chunk(rid, audio[i : i + 1600], is_last=i + 1600 >= len(audio))
        expected.append(reference.run()[rid].text)
    assert finals == expected
    assert any(finals)
