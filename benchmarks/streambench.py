"""Streaming workload: N live streams fed at real time into one streaming ``ASREngine``.

    python -m benchmarks.asrbench --workload streaming --profile smoke          # CPU, < 30 s
    python -m benchmarks.asrbench --workload streaming --streams 1,2,4,8 --seconds 10
    python -m benchmarks.asrbench --workload streaming --find-max --json out.json
    python -m benchmarks.asrbench --workload streaming --shape medium --device cuda --find-max
    python -m benchmarks.streambench --shape medium --device cuda --find-max --streams 64 \
        --seconds 6 --chunk-ms 160 --batch-wait-ms 5 --p99-target-ms 50

Model: a WeNet Conformer trained with chunk masks (causal convolution, dynamic chunk). ``small``
is the bundled random-weight ``tests/data/wenet/u2pp_conformer`` (d=48, 2 blocks), loaded from
WeNet's released layout exactly as the tests load it; ``medium`` scales that config to WeNet's
usual recipe size (d=256, 4 heads, FFN 2048, 12 blocks, decoders 3 + 3 blocks) and fills it with
seeded random weights (same recipe as the test checkpoints: uniform fan-in weights, LayerNorm
gains 1 + 0.2 N, peaky CTC). ``--ckpt-dir`` loads any streaming-capable WeNet directory instead.

Workload: every stream gets its own stretch of real speech (``tests/data/speech`` clips,
resampled to 16 kHz, concatenated and looped to ``--seconds``). One thread runs the loop: it
releases each stream's next ``--chunk-ms`` chunk when its wall-clock time comes (chunk k of a
stream is released at ``start + (k + 1) * chunk``; streams start at evenly spread phases of one
chunk unless ``--aligned``), and calls ``engine.step()`` whenever a stream is ready, which
batches every ready stream into one model call. Chunks due during a step are released right
after it, but their latency still counts from their scheduled time, so a loop that falls behind
shows it.

Reported per stream count:
  chunk latency   release of chunk k -> the update whose consumed audio covers the chunk's last
                  sample (WeNet's chunk needs ``right_context`` frames (~65 ms at x4) past its
                  end, so with chunk-sized feeding a mid-stream chunk is covered one chunk later:
                  about one chunk duration + queueing + compute)
  step latency    release of the chunk that made the stream ready -> its update (queueing +
                  compute only)
  last latency    release of the last chunk -> the final transcript (max over streams)
  held            every stream's last latency < 2 x chunk duration (the lag did not grow) and
                  step latency p99 <= the target (``--p99-target-ms``; default issue #20's:
                  100 ms at 640 ms chunks, 50 ms below)
  rtf             engine busy time (sum of non-empty ``step()`` calls) / audio seconds of all
                  streams; ``load`` = busy time / wall time of one stream
  mean batch      streams per non-empty step
  text = offline  share of streams whose final text equals ``model.transcribe`` of the same
                  audio (full attention, the model's offline default), and with the same chunk
                  mask as the stream (``offline_chunk_size = chunk``), which a causal model must
                  reproduce
``--find-max`` doubles N from the first ``--streams`` count until a count is not held, then
bisects twice between the largest held and the smallest not held, and reports the largest held.
On CUDA every step is a CUDA-graph replay: the graphs for up to N streams per step are captured
and the cache pool sized before each measured run (``capture_stream_graphs``), and a step may hold
``--batch-wait-ms`` (default 5 on CUDA, 0 on CPU) to fill its batch (``max_batch_wait_s``). The
text checks run on the first 8 streams.

Where the time goes: ``--phases`` times each phase of the model's step (features, gather,
encoder, wait, search, scatter, results, finals; :class:`oasr.stream_cache.StepProfile`) plus the
scheduler around it and the loop's own feeding and bookkeeping, and prints host ms per step and
us per stream row; every run also reports the non-empty steps' duration (p50 / p99 / max), the
final updates' step latency alone, and Python's garbage collections (count, pauses). The objects
that exist after the warm-up are frozen (``gc.freeze``) so that a collection during the run only
walks new ones (``--gc default`` leaves the collector alone). ``--lockstep`` drops the pacing:
every round feeds all N streams a chunk and steps until none is ready, so one step carries the
whole ready set (``--max-batch`` caps it): the cost of a step as the ready set grows.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SPEECH = REPO / "tests" / "data" / "speech"
DEFAULT_CKPT = REPO / "tests" / "data" / "wenet" / "u2pp_conformer"
CLIPS = (
    "zh_aishell_BAC009S0764W0121.wav", "zh_aishell_BAC009S0724W0121.wav",
    "zh_aishell_BAC009S0764W0122.wav", "en_ls_1089-134686-0001.wav",
    "en_ls_1221-135766-0002.wav", "en_ls_1272-128104-0000.wav",
)  # fmt: skip
MEDIUM = {"output_size": 256, "attention_heads": 4, "linear_units": 2048, "num_blocks": 12,
          "decoder_heads": 4, "decoder_linear_units": 2048, "decoder_blocks": 3}  # fmt: skip


@dataclass
class StreamResult:
    streams: int
    seconds: float
    chunk_ms: float
    wall_s: float
    busy_s: float
    rtf: float
    load: float
    steps: int
    mean_batch: float
    chunk_latency_p50_ms: float
    chunk_latency_p90_ms: float
    chunk_latency_p99_ms: float
    step_latency_p50_ms: float
    step_latency_p90_ms: float
    step_latency_p99_ms: float
    last_latency_max_ms: float
    held: bool
    finished: int
    text_equal_offline: float
    text_equal_offline_chunked: float
    texts: list[str] = field(default_factory=list)
    #: the lag did not grow (every last chunk answered within 2 chunks); ``held`` also needs
    #: step p99 <= ``p99_target_ms``
    lag_held: bool = True
    p99_target_ms: float = 0.0
    batch_wait_ms: float = 0.0
    graph_replays: int = 0
    graph_captures_during_run: int = 0
    pool: dict = field(default_factory=dict)
    #: host seconds by phase (``--phases``): the model's ``stream_step`` phases
    #: (:class:`oasr.stream_cache.StepProfile`), ``scheduler`` (engine.step minus the model's
    #: step), and the benchmark loop's own ``feed`` / ``bookkeeping`` / ``poll`` time
    phases: dict = field(default_factory=dict)
    #: Python garbage collections during the run: count per generation, total and longest pause
    gc: dict = field(default_factory=dict)
    #: duration of the non-empty ``engine.step()`` calls (p50 / p99 / max ms) and the largest batch
    step_time: dict = field(default_factory=dict)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


class GCPauses:
    """Python garbage collections while it is installed (``with GCPauses() as g``): count by
    generation, total and longest pause. A full collection walks every tracked object of the
    process (torch, the model, the streams): tens to hundreds of ms in one step, which is what a
    p99 latency sees; the benchmark freezes the objects that exist after its warm-up
    (``gc.freeze``), as a server does after loading, so that collections only walk new ones."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.pauses: list[float] = []
        self._t = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._t)
            self.count[int(info.get("generation", 0))] += 1

    def __enter__(self) -> GCPauses:
        import gc

        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._cb)

    def report(self) -> dict:
        import gc

        return {"collections": list(self.count), "pause_total_ms": round(1e3 * sum(self.pauses), 3),
                "pause_max_ms": round(1e3 * max(self.pauses, default=0.0), 3),
                "frozen_objects": gc.get_freeze_count()}  # fmt: skip


# -- model -----------------------------------------------------------------------------------------
def _init_state(
    expected: dict[str, Any], cmvn: dict[str, Any], blank: int, seed: int
) -> dict[str, Any]:
    """Seeded random weights for every tensor of a WeNet network (OASR names)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, meta in expected.items():
        shape = tuple(meta.shape)
        if name.endswith("num_batches_tracked"):
            continue
        if name.startswith("encoder.global_cmvn."):
            state[name] = cmvn[name].clone()
            continue
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 1)[0]
        if leaf == "running_mean":
            t = 0.1 * torch.randn(shape, generator=g)
        elif leaf == "running_var":
            t = 0.5 + torch.rand(shape, generator=g)
        elif "pos_bias" in leaf:
            t = 0.3 * torch.randn(shape, generator=g)
        elif "norm" in parent.rsplit(".", 1)[-1] and leaf == "weight":
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif "norm" in parent.rsplit(".", 1)[-1] and leaf == "bias":
            t = 0.1 * torch.randn(shape, generator=g)
        elif leaf == "bias":
            t = 0.05 * torch.randn(shape, generator=g)
        elif parent.endswith("decoder.embed"):
            t = torch.randn(shape, generator=g)
        else:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
            bound = 1.0 / math.sqrt(max(fan_in, 1))
            t = (torch.rand(shape, generator=g) * 2 - 1) * bound
        if name == "ctc_lo.weight":
            t = t * 6.0
        elif name == "ctc_lo.bias":
            t[blank] += 2.0
        elif name.endswith("output_layer.weight"):
            t = t * 4.0
        state[name] = t.to(meta.dtype)
    return state


def load_stream_model(
    ckpt_dir: str | None, shape: str, device: str, dtype: str | None, seed: int = 1234
):
    """A streaming-capable WeNet model: a checkpoint directory, the bundled ``small`` one, or the
    ``medium`` random-weight scale-up of it."""
    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    ec = EngineConfig(ckpt_dir=str(ckpt_dir or DEFAULT_CKPT), device=device, dtype=dtype or "auto")
    if ckpt_dir or shape == "small":
        return load_model(ec)
    if shape != "medium":
        raise ValueError(f"--shape must be small or medium, not {shape!r}")
    import copy

    import torch

    from oasr_models_wenet.checkpoints import load_wenet
    from oasr_models_wenet.config import WenetConfig
    from oasr_models_wenet.model import WenetASR
    from oasr_models_wenet.nn import WenetNet

    _, small_state, units = load_wenet(DEFAULT_CKPT)
    raw = copy.deepcopy(read_train_yaml(DEFAULT_CKPT))
    enc, dec = raw["encoder_conf"], raw["decoder_conf"]
    enc.update(
        output_size=MEDIUM["output_size"],
        attention_heads=MEDIUM["attention_heads"],
        linear_units=MEDIUM["linear_units"],
        num_blocks=MEDIUM["num_blocks"],
    )
    dec.update(
        attention_heads=MEDIUM["decoder_heads"],
        linear_units=MEDIUM["decoder_linear_units"],
        num_blocks=MEDIUM["decoder_blocks"],
        r_num_blocks=MEDIUM["decoder_blocks"],
    )
    cfg = WenetConfig.from_yaml_dict(raw, vocab_size=len(units))
    with torch.device("meta"):
        expected = WenetNet(cfg).state_dict()
    state = _init_state(expected, small_state, cfg.blank_id, seed)
    return WenetASR._build(cfg, state, units, ec, "wenet", None)


def read_train_yaml(path: Path) -> dict:
    from oasr_models_wenet.config import read_yaml

    return read_yaml(path / "train.yaml")


# -- audio -----------------------------------------------------------------------------------------
_POOL: np.ndarray | None = None


def speech_pool(sr: int = 16000) -> np.ndarray:
    """The speech clips, resampled to ``sr`` and concatenated (cached)."""
    global _POOL
    if _POOL is None:
        _POOL = np.concatenate([_load(SPEECH / n, sr) for n in CLIPS]).astype(np.float32)
    return _POOL


def _load(path: Path, sr: int) -> np.ndarray:
    from oasr.audio import load_audio
    from oasr.errors import BadAudioError

    try:
        return load_audio(path, sr)
    except BadAudioError:  # no decoder installed (bare GPU hosts): 16-bit mono WAV at ``sr`` only
        import wave

        with wave.open(str(path), "rb") as w:
            if w.getframerate() != sr or w.getnchannels() != 1 or w.getsampwidth() != 2:
                raise
            return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0


def stream_audio(i: int, seconds: float, sr: int = 16000) -> np.ndarray:
    """Stream ``i``'s audio: ``seconds`` of the looped pool from its own offset."""
    pool = speech_pool(sr)
    n = int(round(seconds * sr))
    start = int((i * 3.7 * sr) % len(pool))
    idx = (start + np.arange(n)) % len(pool)
    return pool[idx]


# -- one run ---------------------------------------------------------------------------------------
def latency_target_ms(chunk_ms: float) -> float:
    """Issue #20's p99 step-latency targets: 100 ms at 640 ms chunks, 50 ms at 160 ms (and any
    chunk shorter than 640 ms)."""
    return 100.0 if chunk_ms >= 639 else 50.0


def history_frames(model, seconds: float, left_chunks: int) -> int:
    """Attention history a stream of ``seconds`` reaches (encoder frames)."""
    if left_chunks >= 0:
        return model.chunk_size * left_chunks
    return int(seconds / model.frame_shift) + model.chunk_size


def run_streams(
    model,
    n: int,
    seconds: float,
    chunk_ms: float,
    *,
    device: str,
    threads: int,
    beam: int = 1,
    aligned: bool = False,
    keep_texts: bool = False,
    batch_wait_ms: float = 0.0,
    target_ms: float | None = None,
    check_texts: int = 8,
    phases: bool = False,
) -> StreamResult:
    import heapq

    from oasr.engine import ASREngine
    from oasr.stream_cache import StepProfile
    from oasr.types import DecodingOptions, EngineConfig

    sr = model.feature_spec.sample_rate
    engine = ASREngine(
        EngineConfig(
            service_mode="streaming", device=device, max_batch_size=max(n, 1), num_threads=threads
        ),
        model=model,
    )
    sched = engine.streaming
    sched.max_batch_wait_s = batch_wait_ms / 1000.0
    options = DecodingOptions(beam_size=beam)
    audios = [stream_audio(i, seconds, sr) for i in range(n)]
    csz = int(round(chunk_ms * sr / 1000))
    d = csz / sr
    # per stream: chunk boundaries (end sample) and scheduled release offsets
    ends = [list(range(csz, len(a), csz)) + [len(a)] for a in audios]
    phase = [0.0 if aligned else d * i / max(n, 1) for i in range(n)]
    rids = [engine.add_streaming_request(options, request_id=f"s{i}") for i in range(n)]
    nxt = [0] * n  # next chunk to release
    covered = [0] * n  # chunks whose latency is recorded
    k_ready = [0] * n  # first chunk whose end reaches the consumed audio
    rel: list[list[float]] = [[0.0] * len(e) for e in ends]
    chunk_lat: list[float] = []
    step_lat: list[float] = []
    final_lat: list[float] = []  # step latency of the final updates alone
    last_lat = [float("nan")] * n
    finals: list[str | None] = [None] * n
    batch_sizes: list[int] = []
    step_times: list[float] = []  # engine.step() of each non-empty step
    busy = 0.0
    graphs = getattr(model, "_stream_graphs", lambda: None)() if device.startswith("cuda") else None
    replays0 = graphs.stats["replays"] if graphs is not None else 0
    captures0 = graphs.stats["captures"] if graphs is not None else 0
    peak_pool: dict = {}
    profile = StepProfile() if phases and hasattr(model, "stream_profile") else None
    model_profile = getattr(model, "stream_profile", None)
    if profile is not None:
        model.stream_profile = profile
    feed_s = book_s = poll_s = 0.0
    gc_pauses = GCPauses()
    t0 = time.perf_counter() + 0.01
    due_heap = [(t0 + phase[i] + ends[i][0] / sr, i) for i in range(n)]
    heapq.heapify(due_heap)
    left = n
    with gc_pauses:  # collections during the measured loop
        while left:
            now = time.perf_counter()
            while due_heap and due_heap[0][0] <= now:
                due, i = heapq.heappop(due_heap)
                k = nxt[i]
                lo = ends[i][k - 1] if k else 0
                last = k == len(ends[i]) - 1
                engine.feed_chunk(rids[i], audios[i][lo : ends[i][k]], is_last=last)
                rel[i][k] = due
                nxt[i] += 1
                if not last:
                    heapq.heappush(due_heap, (t0 + phase[i] + ends[i][k + 1] / sr, i))
            ts = time.perf_counter()
            feed_s += ts - now
            outs = engine.step()
            te = time.perf_counter()
            if not outs:
                wait = sched.hold_remaining()
                pending = due_heap[0][0] - time.perf_counter() if due_heap else 0.005
                pause = min(pending, wait) if wait > 0 else pending
                time.sleep(max(0.0, min(pause, 0.005)))
                poll_s += time.perf_counter() - ts
                continue
            busy += te - ts
            step_times.append(te - ts)
            batch_sizes.append(len(outs))
            for o in outs:
                i = int(o.request_id[1:])
                if o.is_final:
                    consumed = len(audios[i])
                    finals[i] = o.text
                    last_lat[i] = te - rel[i][-1]
                    left -= 1
                else:
                    info = sched.info(o.request_id)
                    consumed = info.samples_in - info.buffered_samples
                # the chunk that made the stream ready: the first whose end reaches the consumed audio
                while k_ready[i] < nxt[i] - 1 and ends[i][k_ready[i]] < consumed:
                    k_ready[i] += 1
                step_lat.append(te - rel[i][k_ready[i]])
                if o.is_final:  # the final step (last window + the remainder, then the transcript)
                    final_lat.append(step_lat[-1])
                while covered[i] < nxt[i] and ends[i][covered[i]] <= consumed:
                    chunk_lat.append(te - rel[i][covered[i]])
                    covered[i] += 1
            if len(batch_sizes) % 64 == 1:
                occ = sched.occupancy()
                if occ.get("pool_blocks_used", 0) >= peak_pool.get("pool_blocks_used", -1):
                    peak_pool = occ
            book_s += time.perf_counter() - te
    wall = time.perf_counter() - t0
    for rid in rids:
        sched.release(rid)
    phase_report: dict = {}
    if profile is not None:
        model.stream_profile = model_profile
        phase_report = profile.as_dict()
        host = {"scheduler": max(0.0, busy - profile.total), "feed": feed_s, "bookkeeping": book_s,
                "poll": poll_s}  # fmt: skip
        phase_report["loop_seconds"] = {k: round(v, 6) for k, v in host.items()}
        phase_report["scheduler_ms_per_step"] = round(1e3 * host["scheduler"] / max(1, len(batch_sizes)), 4)
    step_time = {"p50_ms": round(_pct(step_times, 50) * 1e3, 3), "p99_ms": round(_pct(step_times, 99) * 1e3, 3),
                 "max_ms": round(max(step_times, default=0.0) * 1e3, 3),
                 "max_batch": max(batch_sizes, default=0),
                 "final_latency_p50_ms": round(_pct(final_lat, 50) * 1e3, 3),
                 "final_latency_p99_ms": round(_pct(final_lat, 99) * 1e3, 3)}  # fmt: skip

    # offline references (the first ``check_texts`` streams): full attention (the model's
    # default) and the stream's chunk mask
    m = min(n, check_texts)
    offline = [t.text for t in model.transcribe(audios[:m], options)]
    saved = (model.offline_chunk_size, model.offline_left_chunks)
    model.offline_chunk_size, model.offline_left_chunks = model.chunk_size, model.num_left_chunks
    try:
        chunked = [t.text for t in model.transcribe(audios[:m], options)]
    finally:
        model.offline_chunk_size, model.offline_left_chunks = saved
    texts = [f or "" for f in finals]
    ms = 1000.0
    p99 = _pct(step_lat, 99) * ms
    target = latency_target_ms(d * 1000) if target_ms is None else target_ms
    lag_held = bool(np.max(last_lat) < 2 * d)
    return StreamResult(
        streams=n, seconds=seconds, chunk_ms=d * 1000, wall_s=wall, busy_s=busy,
        rtf=busy / (n * seconds), load=busy / seconds, steps=len(batch_sizes),
        mean_batch=float(np.mean(batch_sizes)) if batch_sizes else 0.0,
        chunk_latency_p50_ms=_pct(chunk_lat, 50) * ms, chunk_latency_p90_ms=_pct(chunk_lat, 90) * ms,
        chunk_latency_p99_ms=_pct(chunk_lat, 99) * ms,
        step_latency_p50_ms=_pct(step_lat, 50) * ms, step_latency_p90_ms=_pct(step_lat, 90) * ms,
        step_latency_p99_ms=p99,
        last_latency_max_ms=float(np.max(last_lat)) * ms,
        held=lag_held and p99 <= target,
        finished=sum(f is not None for f in finals),
        text_equal_offline=float(np.mean([a == b for a, b in zip(texts[:m], offline, strict=True)])),
        text_equal_offline_chunked=float(np.mean([a == b for a, b in zip(texts[:m], chunked, strict=True)])),
        texts=texts if keep_texts else [],
        lag_held=lag_held, p99_target_ms=target, batch_wait_ms=batch_wait_ms,
        graph_replays=(graphs.stats["replays"] - replays0) if graphs is not None else 0,
        graph_captures_during_run=(graphs.stats["captures"] - captures0) if graphs is not None else 0,
        pool=peak_pool, phases=phase_report, gc=gc_pauses.report(), step_time=step_time,
    )  # fmt: skip


def run_lockstep(model, n: int, seconds: float, chunk_ms: float, *, device: str, threads: int,
                 beam: int = 1, max_batch: int | None = None, phases: bool = False) -> dict:
    """``--lockstep``: no real-time pacing. Every round feeds all ``n`` streams their next chunk
    and steps the engine until nothing is ready (batches of up to ``max_batch``, default all n),
    so each step carries the whole ready set: the cost of a step as the ready set grows, host
    and compute, with ``phases`` split as in the paced runs."""
    from oasr.engine import ASREngine
    from oasr.stream_cache import StepProfile
    from oasr.types import DecodingOptions, EngineConfig

    sr = model.feature_spec.sample_rate
    engine = ASREngine(EngineConfig(service_mode="streaming", device=device, max_batch_size=max_batch or n,
                                    num_threads=threads), model=model)  # fmt: skip
    audios = [stream_audio(i, seconds, sr) for i in range(n)]
    csz = int(round(chunk_ms * sr / 1000))
    rids = [engine.add_streaming_request(DecodingOptions(beam_size=beam), request_id=f"s{i}") for i in range(n)]
    profile = StepProfile() if phases and hasattr(model, "stream_profile") else None
    saved = getattr(model, "stream_profile", None)
    if profile is not None:
        model.stream_profile = profile
    step_s, round_s, steps, rows, finals = [], [], 0, 0, 0
    k = 0
    with GCPauses() as gc_pauses:
        while finals < n:
            lo, hi = k * csz, (k + 1) * csz
            for i, a in enumerate(audios):
                if lo < len(a):
                    engine.feed_chunk(rids[i], a[lo:hi], is_last=hi >= len(a))
            t_round = time.perf_counter()
            while True:
                t = time.perf_counter()
                outs = engine.step()
                if not outs:
                    break
                step_s.append(time.perf_counter() - t)
                steps += 1
                rows += len(outs)
                finals += sum(o.is_final for o in outs)
            round_s.append(time.perf_counter() - t_round)
            k += 1
    for rid in rids:
        engine.streaming.release(rid)
    out = {"streams": n, "rounds": k, "steps": steps, "rows": rows, "max_batch": max_batch or n,
           "step_s": round(sum(step_s), 6), "ms_per_step": round(1e3 * sum(step_s) / max(steps, 1), 4),
           "us_per_row": round(1e6 * sum(step_s) / max(rows, 1), 3),
           "round_ms_median": round(1e3 * float(np.median(round_s)), 3),
           "last_round_ms": round(1e3 * round_s[-1], 3), "gc": gc_pauses.report()}  # fmt: skip
    if profile is not None:
        model.stream_profile = saved
        out["phases"] = profile.as_dict()
        out["phases"]["scheduler_s"] = round(max(0.0, sum(step_s) - profile.total), 6)
    return out


def run_streaming(
    *,
    ckpt_dir: str | None = None,
    shape: str = "small",
    streams: list[int] = (1,),
    chunk_ms: float = 640.0,
    seconds: float = 10.0,
    device: str = "cpu",
    dtype: str | None = None,
    threads: int = 2,
    beam: int = 1,
    left_chunks: int = -1,
    find_max: bool = False,
    max_streams: int = 2048,
    aligned: bool = False,
    keep_texts: bool = False,
    batch_wait_ms: float | None = None,
    target_ms: float | None = None,
    refine: int = 2,
    phases: bool = False,
    gc_freeze: bool = True,
    lockstep: bool = False,
    max_batch: int | None = None,
) -> dict:
    import gc

    import torch

    torch.set_num_threads(threads)
    model = load_stream_model(ckpt_dir, shape, device, dtype)
    if not model.capabilities.streaming:
        raise SystemExit(f"{model.name} was not trained with chunk masks; it cannot stream")
    sr = model.feature_spec.sample_rate
    frame_ms = model.frame_shift * 1000  # encoder frame (subsampling x hop)
    frames = max(1, round(chunk_ms / frame_ms))
    model.chunk_size, model.num_left_chunks = frames, left_chunks
    chunk_ms = frames * frame_ms
    cuda = device.startswith("cuda")
    if batch_wait_ms is None:  # hold a step a few ms to fill it where a step has a fixed cost
        batch_wait_ms = 5.0 if cuda else 0.0
    target = latency_target_ms(chunk_ms) if target_ms is None else target_ms
    t_start = time.perf_counter()
    capture_s = 0.0

    most = max_streams if find_max else max(streams)

    def prepare(n: int) -> None:
        """Capture the CUDA graphs for up to n streams per step before measuring; the cache pool
        is sized once for the most streams of the whole run (growing it would drop the graphs)."""
        nonlocal capture_s
        capture = getattr(model, "capture_stream_graphs", None)
        if cuda and capture is not None:
            t = time.perf_counter()
            capture(max_batch=n, chunk_size=frames, max_history=history_frames(model, seconds, left_chunks),
                    streams=most)  # fmt: skip
            torch.cuda.synchronize()
            capture_s += time.perf_counter() - t

    if lockstep:  # host + compute cost of steps that carry the whole ready set (no pacing)
        prepare(1)
        run_lockstep(model, 2, 2 * chunk_ms / 1000 + 0.2, chunk_ms, device=device, threads=threads, beam=beam)
        runs = []
        for n in streams:
            prepare(n if max_batch is None else min(n, max_batch))
            gc.collect()
            if gc_freeze:
                gc.freeze()
            r = run_lockstep(model, n, seconds, chunk_ms, device=device, threads=threads, beam=beam,
                             max_batch=max_batch, phases=phases)  # fmt: skip
            runs.append(r)
            _print_lockstep(r)
        return {"workload": "streaming-lockstep", "model": model.name, "shape": "ckpt" if ckpt_dir else shape,
                "device": device, "dtype": str(model.net.dtype).replace("torch.", ""), "threads": threads,
                "chunk_ms": chunk_ms, "seconds": seconds, "beam_size": beam, "gc_freeze": gc_freeze,
                "phases": phases, "results": runs}  # fmt: skip

    # warm-up: one short stream through the same path
    prepare(1)
    run_streams(model, 1, min(seconds, 2 * chunk_ms / 1000 + 0.2), chunk_ms, device=device,
                threads=threads, beam=beam, batch_wait_ms=batch_wait_ms)  # fmt: skip
    results: list[StreamResult] = []
    max_held = None
    print(HEADER, flush=True)

    def measure(n: int) -> StreamResult:
        prepare(n)
        gc.collect()  # the previous run's garbage is not this run's pause
        if gc_freeze:  # what exists now (torch, the model, graphs) is never walked by a collection
            gc.freeze()
        r = run_streams(model, n, seconds, chunk_ms, device=device, threads=threads, beam=beam,
                        aligned=aligned, keep_texts=keep_texts, batch_wait_ms=batch_wait_ms,
                        target_ms=target, phases=phases)  # fmt: skip
        results.append(r)
        _print_row(r)
        if phases:
            _print_phases(r)
        return r

    if find_max:
        # doubling from the first --streams count, then ``refine`` bisection steps between the
        # largest count held and the smallest not held
        n = max(1, streams[0]) if streams else 1
        failed = None
        while n <= max_streams:
            if measure(n).held:
                max_held = n
                n *= 2
            else:
                failed = n
                break
        lo = max_held
        for _ in range(refine if failed is not None and lo is not None else 0):
            mid = (lo + failed) // 2
            if mid <= lo or mid >= failed:
                break
            if measure(mid).held:
                lo = max_held = max(max_held, mid)
            else:
                failed = mid
    else:
        for n in streams:
            measure(n)
        held = [r.streams for r in results if r.held]
        max_held = max(held) if held else None
    params = sum(p.numel() for p in model.net.parameters())
    graphs = getattr(model, "_stream_graphs", lambda: None)() if cuda else None
    return {
        "workload": "streaming", "model": model.name, "shape": "ckpt" if ckpt_dir else shape,
        "ckpt_dir": str(ckpt_dir or (DEFAULT_CKPT if shape == "small" else "")), "params": params,
        "device": device, "dtype": str(model.net.dtype).replace("torch.", ""), "threads": threads,
        "chunk_ms": chunk_ms, "chunk_frames": frames, "left_chunks": left_chunks, "seconds": seconds,
        "beam_size": beam, "sample_rate": sr, "aligned": aligned, "find_max": find_max,
        "batch_wait_ms": batch_wait_ms, "p99_target_ms": target,
        "cuda_graphs": graphs is not None, "graph_capture_s": capture_s,
        "graph_captures": graphs.stats["captures"] if graphs is not None else 0,
        "total_s": time.perf_counter() - t_start, "gc_freeze": gc_freeze, "phases": phases,
        "max_streams_held": max_held, "results": [asdict(r) for r in results],
    }  # fmt: skip


HEADER = (
    f"{'N':>5} {'chunk p50':>9} {'p90':>7} {'p99':>7} {'step p50':>9} {'p99':>7} {'last max':>9} "
    f"{'RTF':>6} {'load':>6} {'batch':>6} {'held':>5} {'=off':>5} {'=chunk':>6}"
)


def _print_row(r: StreamResult) -> None:
    print(
        f"{r.streams:5d} {r.chunk_latency_p50_ms:9.0f} {r.chunk_latency_p90_ms:7.0f} "
        f"{r.chunk_latency_p99_ms:7.0f} {r.step_latency_p50_ms:9.1f} {r.step_latency_p99_ms:7.1f} "
        f"{r.last_latency_max_ms:9.0f} {r.rtf:6.3f} {r.load:6.2f} {r.mean_batch:6.2f} "
        f"{'yes' if r.held else 'NO':>5} {r.text_equal_offline:5.2f} {r.text_equal_offline_chunked:6.2f}",
        flush=True,
    )


def _print_lockstep(r: dict) -> None:
    print(f"lockstep N={r['streams']}: {r['steps']} steps, {r['rows']} rows, {r['ms_per_step']:.2f} ms/step, "
          f"{r['us_per_row']:.1f} us/row, round median {r['round_ms_median']:.1f} ms, last round "
          f"{r['last_round_ms']:.1f} ms; gc {r['gc']['collections']} {r['gc']['pause_total_ms']:.0f} ms", flush=True)
    ph = r.get("phases")
    if ph:
        print("      us/row: " + " ".join(f"{k} {v:.1f}" for k, v in ph["us_per_row"].items())
              + f" scheduler {1e6 * ph['scheduler_s'] / max(ph['rows'], 1):.1f}", flush=True)


def _print_phases(r: StreamResult) -> None:
    """One line per run: host time per step (ms) of each phase of the model's step, the
    scheduler around it, and per stream row (us); GC pauses; step durations."""
    ph, g, st = r.phases, r.gc, r.step_time
    if ph:
        per_step = " ".join(f"{k} {v:.2f}" for k, v in ph["ms_per_step"].items())
        per_row = " ".join(f"{k} {v:.0f}" for k, v in ph["us_per_row"].items())
        print(f"      phases N={r.streams} ({ph['steps']} steps, {ph['rows']} rows, {ph['encoder_calls']} "
              f"encoder calls, {ph['finals']} finals at {ph['us_per_final']:.0f} us each) ms/step: {per_step} "
              f"scheduler {ph['scheduler_ms_per_step']:.2f} | us/row: "
              f"{per_row} | loop s: " + " ".join(f"{k} {v:.2f}" for k, v in ph["loop_seconds"].items()),
              flush=True)  # fmt: skip
    if st:
        print(f"      step time p50 {st['p50_ms']:.1f} p99 {st['p99_ms']:.1f} max {st['max_ms']:.1f} ms "
              f"(max batch {st['max_batch']}); final updates' step latency p50 "
              f"{st.get('final_latency_p50_ms', 0):.1f} p99 {st.get('final_latency_p99_ms', 0):.1f} ms; gc collections {g.get('collections')} pauses "
              f"{g.get('pause_total_ms', 0):.0f} ms total, {g.get('pause_max_ms', 0):.0f} ms max "
              f"({g.get('frozen_objects', 0)} objects frozen)", flush=True)  # fmt: skip


def print_table(report: dict) -> None:
    print(
        f"\n{report['model']} ({report['params'] / 1e6:.2f} M params), {report['device']} "
        f"{report['dtype']}, {report['threads']} threads, chunk {report['chunk_ms']:.0f} ms, "
        f"{report['seconds']:.0f} s per stream, beam {report['beam_size']}; latencies in ms"
    )
    print(HEADER)
    for r in report["results"]:
        _print_row(StreamResult(**r))
    if report.get("phases"):
        for r in report["results"]:
            _print_phases(StreamResult(**r))
    print(f"max streams held at real time (lag bounded, step p99 <= {report['p99_target_ms']:.0f} ms): "
          f"{report['max_streams_held']}  [batch wait {report['batch_wait_ms']:.0f} ms, CUDA graphs "
          f"{'on' if report['cuda_graphs'] else 'off'} ({report['graph_captures']} captured in "
          f"{report['graph_capture_s']:.1f} s), whole run {report['total_s']:.0f} s]")


def main_streaming(args) -> dict:  # noqa: ANN001 - argparse namespace from asrbench
    smoke = args.profile == "smoke"
    streams = [int(x) for x in (args.streams or ("1,2" if smoke else "1,2,4,8")).split(",")]
    report = run_streaming(
        ckpt_dir=args.ckpt_dir, shape=args.shape or "small", streams=streams,
        chunk_ms=args.chunk_ms, seconds=args.seconds or (3.0 if smoke else 10.0), device=args.device,
        dtype=args.dtype, threads=args.threads, beam=args.beam, left_chunks=args.left_chunks,
        find_max=args.find_max, aligned=args.aligned, keep_texts=smoke,
        batch_wait_ms=getattr(args, "batch_wait_ms", None), target_ms=getattr(args, "p99_target_ms", None),
        phases=bool(getattr(args, "phases", False)), gc_freeze=getattr(args, "gc", "freeze") == "freeze",
        lockstep=bool(getattr(args, "lockstep", False)), max_batch=getattr(args, "max_batch", None),
    )  # fmt: skip
    if report["workload"] == "streaming":
        print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return report


def main(argv: list[str] | None = None) -> dict:
    """``python -m benchmarks.streambench``: the streaming workload with its own flags (the same as
    ``asrbench --workload streaming`` plus ``--batch-wait-ms`` and ``--p99-target-ms``)."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=None)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--shape", default=None, help="small | medium")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", default=None, help="stream counts; with --find-max the first is the start")
    p.add_argument("--chunk-ms", type=float, default=640.0)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--find-max", action="store_true")
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--left-chunks", type=int, default=-1)
    p.add_argument("--aligned", action="store_true")
    p.add_argument("--batch-wait-ms", type=float, default=None,
                   help="StreamingScheduler.max_batch_wait_s in ms (default 5 on CUDA, 0 on CPU)")
    p.add_argument("--p99-target-ms", type=float, default=None,
                   help="step p99 a held count must meet (default 100 ms at >= 640 ms chunks, else 50)")
    p.add_argument("--phases", action="store_true",
                   help="time each phase of a step (features, gather, encoder, wait, search, scatter, "
                        "results, scheduler) and print the host time per step and per stream row")
    p.add_argument("--gc", choices=("freeze", "default"), default="freeze",
                   help="freeze: gc.freeze() after warm-up so collections skip the objects that exist "
                        "then (default); default: leave Python's collector as it is")
    p.add_argument("--lockstep", action="store_true",
                   help="no real-time pacing: every round feeds all streams a chunk and steps until none "
                        "is ready; reports ms per step and us per stream row (host + compute)")
    p.add_argument("--max-batch", type=int, default=None, help="--lockstep: most streams per step (default all)")
    p.add_argument("--json", default=None)
    return main_streaming(p.parse_args(argv))


if __name__ == "__main__":
    main()
