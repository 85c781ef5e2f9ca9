"""Streaming at scale on the CPU (issue #20): the paged stream cache pool, batched chunk steps over
streams of different ages, and the streaming scheduler's policy.

* the pool returns exactly what each stream wrote, whatever the interleaving of opens, appends,
  history trims and releases, and frees every block and slot (hypothesis);
* a stream's encoder output and tokens do not depend on the batch it shares (streams of other
  ages, chunk sizes and histories, rows in any order) nor on which slots and blocks it got
  (other streams opened and released before it) (hypothesis, few examples);
* finishing, aborting (also while its chunk is in the model) and failing give every slot and
  block back;
* the scheduler serves ready streams first come first served and holds a step to fill its batch
  only within ``max_batch_wait_s``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from oasr.errors import InvalidRequestError
from oasr.stream_cache import StreamCachePool
from oasr.streaming import StreamingScheduler
from oasr.types import DecodingOptions

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
CLIPS = ("zh_aishell_BAC009S0764W0121.wav", "zh_aishell_BAC009S0724W0121.wav", "en_sr_one_two_three.wav")
FEW = settings(max_examples=4, deadline=None, derandomize=True, phases=[Phase.generate],
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def u2pp():
    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    torch.set_num_threads(1)
    return load_model(EngineConfig(ckpt_dir=str(DATA / "wenet" / "u2pp_conformer")))


@pytest.fixture(scope="module")
def speech() -> list[np.ndarray]:
    from oasr.audio import load_audio

    return [load_audio(DATA / "speech" / n, 16000) for n in CLIPS]


# -- the pool ----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["open", "append", "release"]), st.integers(0, 7),
                              st.integers(0, 40), st.sampled_from([-1, 5, 16, 33])),
                    min_size=1, max_size=40))
def test_pool_reads_back_what_each_stream_wrote(ops) -> None:
    pool = StreamCachePool(slots={"state": ((2,), torch.float32)}, frame_shape=(1,),
                           frame_dtype=torch.float32, block_size=4, max_frames=48, max_chunk_frames=40,
                           capacity=2)  # fmt: skip
    live: dict[int, tuple] = {}  # stream id -> (ctx, frames written, keep)
    ids = iter(range(10**6))
    for op, which, n, keep in ops:
        if op == "open" or not live:
            sid = next(ids)
            live[sid] = (pool.open(), [], keep)
            continue
        sid = sorted(live)[which % len(live)]
        ctx, frames, k = live[sid]
        if op == "release":
            pool.release(ctx)
            del live[sid]
            continue
        pool.reserve([ctx], [n])
        values = [sid * 1000.0 + len(frames) + j for j in range(n)]
        write = pool.write_index([ctx], [n], max(n, 1))
        src = torch.tensor(values + [0.0] * (max(n, 1) - n)).view(-1, 1)
        pool.frames.index_copy_(0, torch.from_numpy(write.reshape(-1)), src)
        slot = torch.tensor([ctx.slot])
        pool.slot_tensors["state"].index_copy_(0, slot, torch.tensor([[float(sid), float(len(frames) + n)]]))
        pool.advance([ctx], [n], [k])
        frames.extend(values)
        # every live stream reads back its own last ``cached`` frames and its own slot row
        ctxs = [c for c, _, _ in live.values()]
        width = max(c.cached for c in ctxs) or 1
        idx, count = pool.read_index(ctxs, width)
        got = pool.frames[torch.from_numpy(idx.reshape(-1))].view(len(ctxs), width)
        for r, (c, fr, kk) in enumerate(live.values()):
            bound = pool.max_frames if kk < 0 else min(kk, pool.max_frames)
            assert count[r] == c.cached == min(len(fr), bound)
            assert got[r, : count[r]].tolist() == fr[len(fr) - count[r] :]
            row = pool.slot_tensors["state"][c.slot].tolist()
            assert row == ([0.0, 0.0] if not fr else [float(next(s for s, v in live.items() if v[0] is c)), len(fr)])
        spanned = sum(((c.length - 1) // 4 - c.start // 4 + 1) if c.length > c.start else 0 for c in ctxs)
        assert pool.blocks_in_use == spanned
    for ctx, _, _ in live.values():
        pool.release(ctx)
    pool.reserve([], [])  # applies the releases
    assert pool.num_streams == 0 and pool.blocks_in_use == 0


def test_pool_is_freed_when_its_owner_is_collected() -> None:
    import gc

    pool = StreamCachePool(frame_shape=(1,), frame_dtype=torch.float32, block_size=4, capacity=1)

    class Owner:
        pass

    owner = Owner()
    ctx = pool.open(owner=owner)
    pool.reserve([ctx], [9])
    pool.advance([ctx], [9])
    assert pool.blocks_in_use == 3
    del owner
    gc.collect()
    pool.reserve([], [])
    assert pool.num_streams == 0 and pool.blocks_in_use == 0


# -- batched steps over streams of different ages --------------------------------------------
def _feed(model, streams, *, order_seed: int | None = None, starts=None):
    """Run ``streams`` = [(state, audio, piece)] through ``stream_step`` in shared batches:
    stream i joins at step ``starts[i]``; rows shuffled with ``order_seed``. Returns per stream
    (final update, encoder output)."""
    rng = random.Random(order_seed)
    pos = [0] * len(streams)
    finals: list = [None] * len(streams)
    step = 0
    while any(f is None for f in finals):
        rows = [i for i in range(len(streams)) if finals[i] is None and (starts is None or starts[i] <= step)]
        if order_seed is not None:
            rng.shuffle(rows)
        step += 1
        if not rows:
            continue
        chunks, lasts = [], []
        for i in rows:
            state, audio, piece = streams[i]
            chunks.append(audio[pos[i] : pos[i] + piece])
            pos[i] += piece
            lasts.append(pos[i] >= len(audio))
        ups = model.stream_step([streams[i][0] for i in rows], chunks, lasts)
        for i, up in zip(rows, ups, strict=True):
            if up.is_final:
                finals[i] = up
    return [(f, torch.cat(s[0].enc) if s[0].enc else None) for f, s in zip(finals, streams, strict=True)]


@FEW
@given(specs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30000), st.sampled_from([2, 4, 8]),
                                st.sampled_from([-1, 1, 3]), st.integers(1, 3), st.integers(0, 4)),
                      min_size=2, max_size=4),
       noise=st.integers(0, 5), seed=st.integers(0, 99))
def test_results_do_not_depend_on_batch_or_slots(u2pp, speech, specs, noise, seed) -> None:
    """Each stream alone vs all of them together: joining at different steps (different cache
    ages in one batch), rows shuffled, after other streams took and returned slots and blocks."""
    opts = DecodingOptions(beam_size=1)

    def make():
        out = []
        for clip, start, chunk, left, pieces, _ in specs:
            audio = speech[clip][start : start + 24000]
            state = u2pp.new_stream(opts, chunk_size=chunk, num_left_chunks=left, keep_encoder_output=True)
            out.append((state, audio, 1600 * pieces))
        return out

    solo = [_feed(u2pp, [s])[0] for s in make()]
    # perturb the pool: streams that take slots and blocks, some released, some kept open
    others = [(u2pp.new_stream(opts), speech[0][:20000], 3200) for _ in range(noise)]
    _feed(u2pp, others[: noise // 2])  # these finish: their slots go back, in a different order
    together = _feed(u2pp, make(), order_seed=seed, starts=[s[5] for s in specs])
    for (f1, e1), (f2, e2) in zip(solo, together, strict=True):
        assert f1.text == f2.text
        for a, b in zip(f1.transcript.segments, f2.transcript.segments, strict=True):
            assert a.tokens == b.tokens  # sums of log-probabilities round with the batch
            assert a.avg_logprob == pytest.approx(b.avg_logprob, abs=1e-4)
        if e1 is None:
            assert e2 is None
        else:
            assert e1.shape == e2.shape and (e1 - e2).abs().max().item() < 1e-4
    for s, _, _ in others[noise // 2 :]:
        u2pp.release_stream(s)


def _pool_idle(model) -> bool:
    model.stream_pool.reserve([], [])  # apply pending releases
    occ = model.stream_occupancy()
    return occ["streams"] == 0 and occ["blocks_used"] == 0


def test_finish_abort_and_failure_free_every_slot(u2pp, speech) -> None:
    for s in list(u2pp.stream_pool._live.values()):  # streams other tests left open
        u2pp.stream_pool.release(s)
    sched = StreamingScheduler(u2pp, max_batch_size=4)
    rids = [sched.add_request(DecodingOptions(beam_size=1 + (i % 2) * 3)) for i in range(7)]
    for i, rid in enumerate(rids):
        sched.feed_chunk(rid, speech[i % 3][: 12000 + 4000 * i])
    sched.step()
    sched.step()
    assert u2pp.stream_occupancy()["blocks_used"] > 0
    assert sched.abort(rids[0]) and sched.abort(rids[1])  # between steps
    # aborted while its chunk is in the model: dropped and released when the step returns
    orig = u2pp.stream_step

    def abort_inside(states, chunks, lasts):
        sched.abort(rids[2])
        return orig(states, chunks, lasts)

    u2pp.stream_step = abort_inside
    try:
        sched.feed_chunk(rids[2], speech[0][:20000])
        out = sched.step()
    finally:
        u2pp.stream_step = orig
    assert rids[2] not in [r for r, _ in out]
    # a failing step ends (and frees) the streams of its batch
    u2pp.stream_step = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    sched.feed_chunk(rids[3], speech[1][:20000])
    try:
        with pytest.raises(RuntimeError):
            while True:
                sched.step()
    finally:
        u2pp.stream_step = orig
    for rid in rids[3:]:  # the streams the failed step did not end finish normally
        try:
            sched.feed_chunk(rid, speech[2][:8000], is_last=True)
        except InvalidRequestError:
            pass
    sched.run()
    assert sched.num_active == 0
    assert _pool_idle(u2pp)


# -- policy ------------------------------------------------------------------------------------
@dataclass
class _State:
    samples_needed: int = 100
    done: int = 0


class _Toy:
    """A streaming model with no network: it counts chunks."""

    name = "toy"
    feature_spec = None

    def __init__(self) -> None:
        from oasr.types import ModelCapabilities

        self.capabilities = ModelCapabilities(decode_family="ctc", streaming=True)
        self.calls: list[list[int]] = []
        self.released: list[_State] = []

    def transcribe(self, audios, options, progress=None):  # pragma: no cover - unused
        return []

    def new_stream(self, options):
        return _State()

    def release_stream(self, state) -> None:
        self.released.append(state)

    def stream_step(self, states, chunks, is_last):
        from oasr.model import StreamingUpdate

        self.calls.append([id(s) for s in states])
        out = []
        for s, last in zip(states, is_last, strict=True):
            s.done += 1
            out.append(StreamingUpdate(str(s.done), bool(last)))
        return out


def test_fifo_by_ready_time_and_bounded_hold(monkeypatch) -> None:
    import oasr.streaming as streaming

    clock = [100.0]
    monkeypatch.setattr(streaming.time, "monotonic", lambda: clock[0])
    model = _Toy()
    sched = StreamingScheduler(model, max_batch_size=2)
    a, b, c, d = (sched.add_request() for _ in range(4))
    for rid in (c, a, d, b):  # ready in this order, whatever the order they were opened in
        clock[0] += 0.001
        sched.feed_chunk(rid, np.zeros(100, np.float32))
    order = [rid for rid, _ in sched.step()] + [rid for rid, _ in sched.step()]
    assert order == [c, a, d, b]
    # a stream fed two chunks is ready again at once, but behind those already waiting
    clock[0] += 0.001
    sched.feed_chunk(a, np.zeros(200, np.float32))
    clock[0] += 0.001
    sched.feed_chunk(b, np.zeros(100, np.float32))
    clock[0] += 0.001
    sched.feed_chunk(c, np.zeros(100, np.float32))
    clock[0] += 0.001  # a is ready again after this step, later than c
    assert [r for r, _ in sched.step()] == [a, b]
    assert [r for r, _ in sched.step()] == [c, a]

    # holding: one ready stream, others may become ready -> wait, at most max_batch_wait_s
    sched.max_batch_wait_s = 0.010
    sched.feed_chunk(d, np.zeros(100, np.float32))
    assert sched.step() == [] and sched.hold_remaining() == pytest.approx(0.010)
    clock[0] += 0.004
    sched.feed_chunk(a, np.zeros(100, np.float32))  # the batch is full: no more holding
    assert sorted(r for r, _ in sched.step()) == sorted([d, a])
    sched.feed_chunk(b, np.zeros(100, np.float32))
    assert sched.step() == []
    clock[0] += 0.0101  # the bound passed: it runs with what it has
    assert [r for r, _ in sched.step()] == [b]
    # run() never holds; finished streams are released
    for rid in (a, b, c, d):
        sched.feed_chunk(rid, np.zeros(10, np.float32), is_last=True)
    assert set(sched.run()) == {a, b, c, d}
    assert len(model.released) == 4
    assert sched.stats["holds"] == 2 and sched.stats["max_batch"] == 2


def test_bucketed_padded_steps_equal_eager(u2pp, speech, monkeypatch) -> None:
    """The CUDA-graph path's bucketing on the CPU (``GraphSteps(simulate=True)``: static
    buffers, batch padded to its bucket with scratch rows, history padded to its bucket,
    captured on scratch inputs first) gives the eager step's outputs."""
    from oasr.stream_cache import GraphSteps

    audios = [speech[i % 3][(i * 1700) % 8000 :][: 20000 + 2500 * i] for i in range(7)]
    starts = [0, 0, 1, 2, 2, 4, 5]  # streams of different ages share the batches

    def run():
        streams = [(u2pp.new_stream(DecodingOptions(), chunk_size=4, num_left_chunks=-1 if i % 2 else 2,
                                    keep_encoder_output=True), a, 3200) for i, a in enumerate(audios)]
        return _feed(u2pp, streams, starts=starts)

    eager = run()
    sim = GraphSteps(u2pp._chunk_compute, u2pp._graph_inputs, simulate=True)
    monkeypatch.setattr(u2pp, "_stream_graphs", lambda: sim)
    assert u2pp.capture_stream_graphs(max_batch=4, chunk_size=4, max_history=64) == 3 * 4  # 1,2,4 x 0..64
    graphed = run()
    assert sim.stats["replays"] > 10 and sim.stats["captures"] > 12  # 7 streams: bucket 8 met later
    for (f1, e1), (f2, e2) in zip(eager, graphed, strict=True):
        assert f1.transcript.segments[0].tokens == f2.transcript.segments[0].tokens
        assert e1.shape == e2.shape and (e1 - e2).abs().max().item() < 1e-4
    assert _pool_idle(u2pp)


def test_device_prefix_beam_streams_equal_host(u2pp, speech) -> None:
    """Streams whose prefix beam runs as tensors (``oasr.decoders.ctc_gpu``, all of a step's
    streams in one batched search step, partials read back at once; on CUDA by default, here on
    the CPU) give the host search's partials and final tokens."""
    from oasr.decoders.ctc_gpu import GPUCTCPrefixBeamSearch

    def run(device_search: bool):
        states = [u2pp.new_stream(DecodingOptions(beam_size=4), chunk_size=4) for _ in range(3)]
        if device_search:
            for s in states:
                s.search = GPUCTCPrefixBeamSearch(4, u2pp.config.blank_id, torch.device("cpu"))
        partials: list[str] = []
        finals = []
        pos, live = 0, list(range(3))
        while live:
            ups = u2pp.stream_step([states[i] for i in live], [speech[i][pos : pos + 6400] for i in live],
                                   [pos + 6400 >= len(speech[i]) for i in live])  # fmt: skip
            pos += 6400
            partials += [u.text for u in ups if not u.is_final]
            finals += [(i, u.transcript.segments[0].tokens if u.transcript.segments else [])
                       for i, u in zip(live, ups, strict=True) if u.is_final]  # fmt: skip
            live = [i for i in live if pos < len(speech[i])]
        return sorted(finals), partials

    assert run(True) == run(False)
