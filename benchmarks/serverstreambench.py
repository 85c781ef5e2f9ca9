"""Realtime streams at scale through the real ``oasr-server`` process, beside the in-process
streaming engine (issue #20, the server part).

    python -m benchmarks.serverstreambench --profile smoke                  # CPU, < 60 s
    python -m benchmarks.asrbench --workload serverstream --streams 16 --uploads 4
    python -m benchmarks.serverstreambench --shape medium --device cuda --streams 500 \
        --seconds 10 --uploads 32 --batch-wait-ms 5 --clients 4 --json out.json

Model: a streaming WeNet Conformer, as ``benchmarks/streambench.py`` builds it (``--shape small``:
the bundled random-weight ``tests/data/wenet/u2pp_conformer``; ``medium``: WeNet's usual recipe
size with seeded random weights) or any streaming WeNet directory (``--ckpt-dir``). When the
shape is built here or ``--model-chunk-ms`` changes the model's chunk, the model is written in
OASR's native format to a temporary directory (its streaming chunk travels in the saved decoding
defaults), and the server and the reference engine both load that directory.

1. Audio: stream ``i`` gets ``--seconds`` of real speech (``streambench.stream_audio``: the
   ``tests/data/speech`` clips looped from its own offset) at the model's rate, quantised to
   pcm16 as it travels; each upload is a 16-bit WAV of another stretch (``--upload-seconds``).
2. Reference: one in-process ``ASREngine(service_mode="streaming")`` on the same checkpoint and
   device is fed every stream's audio in the client's chunks (``--chunk-ms``), stepping after each
   chunk until nothing is ready: the chunk after which each model step happens, the step's text
   (the partial hypotheses) and the final text, per stream. Uploads: ``engine.submit`` of the
   same samples (the server's upload path).
3. ``oasr-server --service-mode streaming`` starts as a separate process on a free loopback port
   (``--max-streams`` N, ``--max-batch-size`` N so one step may serve every stream,
   ``--stream-batch-wait-ms``).
4. ``--clients`` client processes (spawned; one asyncio loop and the ``websockets`` client each)
   open N ``/v1/realtime`` sessions (manual turns: ``turn_detection`` null, pcm16 at the model's
   rate), then all start at one instant: stream ``i`` sends chunk ``k`` (base64 in an
   ``input_audio_buffer.append``) when its audio has "happened" (``t0 + phase_i + (k+1) x
   chunk``; phases spread evenly over one *model* chunk, as independent streams' would be),
   then commits the turn and waits for its
   ``...transcription.completed``. One second in, ``--uploads`` WAV uploads go to
   ``/v1/audio/transcriptions`` all at once (threads, ``oasr.client.OASRClient``).
   With ``--warmup-rounds`` (default 1 on CUDA: the streaming CUDA graphs and the cache pool
   are made on first use) the whole workload runs that many times first, unmeasured.

Reported:
  partial latency  a delta event's arrival - the send of the chunk after which the reference
                   made the step whose text the delta completes (the delta's text so far equals
                   that step's text); p50 / p90 / p99 / max over all deltas of all streams
  final latency    the transcript's arrival - the commit (sent right after the last chunk)
  send lag         how late the clients sent chunks against their schedule (p99, max): a large
                   lag means the client side, not the server, was the limit
  checks           every stream's final transcript == the reference's, every delta's text a
                   reference partial, in order; every upload 200 with the reference's text; no
                   stream, engine stream, cache block, queue entry or request left over
                   (``/metrics``). A final that differs passes only when it differs at near-tied
                   frames (below)
  ties             the server steps ~10-30 streams at a time, the reference all of them: GEMMs
                   and convolutions of other shapes sum in another order, which moves the logits
                   by rounding (CPU fp32: <= 3.4e-6 of their spread; more with the GPU's TF32
                   convolutions or half precision) and flips a frame whose two best tokens are
                   that close. Random weights have many such frames (medium shape: 0.4 % of
                   frames within 1e-3 of the spread). Other random CTC heads do not remove them:
                   a sharper one scales the noise with the logits; one that emits blank on most
                   frames cut the near ties 3.6 x but raised the noise 4.6 x (a random encoder's
                   output is mostly its mean); one on the output's few slow principal directions
                   has ~10 x fewer, but its tokens come in long runs and a dropped 100 ms piece
                   of audio then left 9 of 24 finals unchanged (today's head: 0 of 24). So the
                   check stays exact and sharp, and each differing stream is stepped again
                   in-process with its per-frame CTC logits kept: its server final passes only
                   when some choice among each frame's tokens within ``--tie-tolerance`` x the
                   logits' spread of its best one collapses to it (``tie_margin``: the smallest
                   such tolerance, reported per stream). A dropped, repeated or misplaced piece
                   of audio moves whole stretches of frames: it needs margins of 0.10-0.35 of
                   the spread, 20 x the float32 tolerance, and fails. A differing upload is
                   checked the same way on its offline encoder's logits
  held             checks pass and partial p99 <= ``--p99-target-ms`` (default 150: issue #20)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serverbench import metric, wait_ready
from benchmarks.streambench import _pct

REPO = Path(__file__).resolve().parents[1]
COMPLETED = "conversation.item.input_audio_transcription.completed"
DELTA = "conversation.item.input_audio_transcription.delta"
COMMIT = json.dumps({"type": "input_audio_buffer.commit"})


@dataclass
class Report:
    streams: int
    seconds: float
    chunk_ms: float
    model_chunk_ms: float
    uploads: int
    clients: int
    device: str
    batch_wait_ms: float
    wall_s: float
    partial_latency_p50_ms: float
    partial_latency_p90_ms: float
    partial_latency_p99_ms: float
    partial_latency_max_ms: float
    final_latency_p50_ms: float
    final_latency_p99_ms: float
    final_latency_max_ms: float
    send_lag_p99_ms: float
    send_lag_max_ms: float
    upload_latency_p50_s: float
    upload_latency_max_s: float
    partials_measured: int
    finals_equal: int
    uploads_equal: int
    p99_target_ms: float
    held: bool
    #: CPU seconds of the server process (all its threads) during the measured round, and per
    #: append event received (model host work included): what one core must keep up with
    #: streams whose final differs and whose reference changes when the in-process engine runs
    #: them alone (a model that depends on its batch mates, not a server fault)
    finals_engine_batch_variant: int = 0
    #: the deltas whose chunk was sent while the uploads were in flight (from their send to the
    #: last answer), their p99 latency, and the others' p99: do the uploads hold up the streams?
    partials_during_uploads: int = 0
    partial_latency_p99_during_uploads_ms: float = 0.0
    partial_latency_p99_outside_uploads_ms: float = 0.0
    #: streams whose final differs from the reference's only at near-tied frames: the model's
    #: CTC logits (the streams stepped again in-process) reach the server's final when each frame
    #: may take any token within ``tie_tolerance`` x the logits' spread of its best one. Counted
    #: as equal (a batch of another shape rounds otherwise); ``tie_margins``: per differing
    #: stream, the smallest such tolerance (None: not reachable within 0.2, a real difference)
    finals_tied: int = 0
    tie_tolerance: float = 0.0
    tie_margins: dict[str, float | None] = field(default_factory=dict)
    #: the same for the uploads (their logits from the model's offline encoder)
    uploads_tied: int = 0
    upload_tie_margins: dict[str, float | None] = field(default_factory=dict)
    server_switch_interval_ms: float | None = None
    server_cpu_s: float | None = None
    #: of which the main thread: uvicorn's event loop (a share near ``wall_s`` means the event
    #: loop, one core, is the limit)
    server_loop_cpu_s: float | None = None
    server_cpu_per_append_us: float | None = None
    #: the measured round's engine steps: batches, mean batch, CUDA graphs captured (0 expected:
    #: the server captures them all while it warms up) and replayed
    server_steps: dict[str, float] = field(default_factory=dict)
    dtype: str = "auto"
    #: the server's event loop: ``uvloop`` (installed, uvicorn's pick) or ``asyncio`` (not
    #: installed, or hidden by ``--server-event-loop asyncio``)
    server_event_loop: str = "auto"
    #: the server's full garbage collections during the measured round, each one's length (ms):
    #: the whole process stops for them (a p99 outlier told apart)
    server_full_gc_ms: list[float] = field(default_factory=list)
    #: ``--server-profile``: :func:`profile_summary` of the measured round
    server_profile: dict[str, Any] = field(default_factory=dict)
    #: warnings and errors the server logged (its stderr; with ``--log-level info`` also its
    #: warm-up lines), the last 20
    server_warnings: list[str] = field(default_factory=list)
    leftover: dict[str, float] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


# -- checkpoint and audio --------------------------------------------------------------------------
def prepare_checkpoint(ckpt_dir: str | None, shape: str, model_chunk_ms: float | None,
                       dst: Path) -> str:  # fmt: skip
    """The directory the server and the reference load: ``ckpt_dir`` itself when nothing changes,
    else the model (``streambench.load_stream_model``) with its streaming chunk set to
    ``model_chunk_ms`` written in the native format under ``dst``."""
    if ckpt_dir and model_chunk_ms is None:
        return ckpt_dir
    from benchmarks.streambench import DEFAULT_CKPT, load_stream_model

    if shape == "small" and not ckpt_dir and model_chunk_ms is None:
        return str(DEFAULT_CKPT)
    model = load_stream_model(ckpt_dir, shape, "cpu", "float32")
    if model_chunk_ms is not None:
        model.chunk_size = max(1, round(model_chunk_ms / (model.frame_shift * 1000)))
    model.save_native(dst)
    return str(dst)


def stream_pcm(i: int, seconds: float, sr: int) -> np.ndarray:
    """Stream ``i``'s audio as pcm16 samples (what travels)."""
    from benchmarks.streambench import stream_audio

    x = stream_audio(i, seconds, sr)
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2")


def wav_bytes(pcm: np.ndarray, sr: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def upload_pcm(k: int, seconds: float, sr: int) -> np.ndarray:
    return stream_pcm(100_000 + 7 * k, seconds, sr)


# -- the in-process reference ----------------------------------------------------------------------
@dataclass
class StreamRef:
    #: per model step before the final: (chunk index after which it ran, its text)
    partials: list[tuple[int, str]]
    final: str


def reference(ckpt: str, device: str, threads: int, streams: list[np.ndarray], chunk: int,
              uploads: list[np.ndarray], max_batch: int | None = None, dtype: str = "auto",
              ) -> tuple[list[StreamRef], list[str], int]:  # fmt: skip
    """The in-process streaming engine on the same audio, fed in the client's chunks; returns the
    per-stream references, the upload texts and the model's sample rate. ``max_batch`` (default:
    every stream in one step) bounds the streams per step (1: each stream alone)."""
    import torch

    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig

    torch.set_num_threads(threads)
    engine = ASREngine(EngineConfig(ckpt_dir=ckpt, device=device, service_mode="streaming",
                                    max_batch_size=max_batch or max(1, len(streams)),
                                    num_threads=threads, dtype=dtype))  # fmt: skip
    try:
        waves = [s.astype(np.float32) / 32768.0 for s in streams]
        rids = [
            engine.add_streaming_request(DecodingOptions(), request_id=f"s{i}")
            for i in range(len(waves))
        ]
        refs = [StreamRef([], "") for _ in waves]
        chunks = max(-(-len(w) // chunk) for w in waves)

        def drain(k: int) -> None:
            while True:
                outs = engine.step()
                if not outs:
                    return
                for o in outs:
                    r = refs[int(o.request_id[1:])]
                    if o.is_final:
                        r.final = o.text
                    else:
                        r.partials.append((k, o.text))

        for k in range(chunks):
            for i, w in enumerate(waves):
                if k * chunk < len(w):
                    engine.feed_chunk(rids[i], w[k * chunk : (k + 1) * chunk])
            drain(k)
            for i, w in enumerate(waves):  # the commit follows the last chunk
                if (k + 1) * chunk >= len(w) > k * chunk:
                    engine.feed_chunk(rids[i], None, is_last=True)
            drain(k)
        for rid in rids:
            engine.streaming.release(rid)
        futures = [engine.submit(u.astype(np.float32) / 32768.0) for u in uploads]
        upload_texts = [f.result().text for f in futures]
        sr = engine.sample_rate
    finally:
        engine.shutdown()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return refs, upload_texts, sr


# -- near-tied frames ------------------------------------------------------------------------------
#: the default tie tolerance (``--tie-tolerance``): a fraction of the CTC logits' spread within
#: which two tokens of a frame count as tied. Another batch shape sums the same GEMMs in another
#: order (other kernels, tiles, split-K, cuDNN algorithms): on the CPU (fp32, medium shape, 32
#: streams all in one step against one at a time) the logits moved by at most 3.4e-6 of their
#: spread; the H200's fp32 steps flipped a tenth of the medium shape's 500 finals, which at its
#: margin density (0.4 % of frames within 1e-3 of the spread) means ~5e-5 typically. cuDNN's
#: convolutions run in TF32 by default on the GPU (inputs rounded to 10 mantissa bits, 4.9e-4)
#: and may pick another algorithm for another batch, hence 5e-3 for float32. Half precision
#: rounds each logit to 3 significant digits (bfloat16: 2; CPU bfloat16 through the server:
#: 0.008-0.031, 0.5-2 ulps). A dropped 100 ms piece of audio, by contrast, needs 0.10-0.35
#: (medium, 12 streams; the typical margin is 0.17): 20 x the float32 tolerance, 3 x the
#: float16 one, 2 x the bfloat16 one.
TIE_TOLERANCE = {"float32": 5e-3, "float16": 3e-2, "bfloat16": 5e-2}


def model_logits(ckpt: str, device: str, dtype: str, streams: list[np.ndarray], chunk: int,
                 uploads: list[np.ndarray] = ()) -> tuple[list[np.ndarray], list[np.ndarray], list[str], int]:  # fmt: skip
    """Every frame's CTC logits (float32, (frames, vocab)) of each stream, the streams stepped
    together in the client's chunks (the composition moves them only by rounding), and of each
    upload, encoded offline as the engine's upload path does (the model's offline chunk mask);
    with the model's unit pieces and blank id."""
    import torch

    from oasr.checkpoint import load_model
    from oasr.types import DecodingOptions, EngineConfig

    model = load_model(EngineConfig(ckpt_dir=ckpt, device=device, dtype=dtype))
    model.stream_cuda_graphs = False  # eager: the same kernels, no captures for one pass
    ctc_lo = model.net.ctc_lo
    out: list[np.ndarray] = []
    with torch.no_grad():
        if streams:
            states = [model.new_stream(DecodingOptions(), keep_encoder_output=True) for _ in streams]
            empty = np.zeros(0, np.float32)
            for k in range(max(-(-len(w) // chunk) for w in streams)):
                model.stream_step(states, [w[k * chunk : (k + 1) * chunk] for w in streams],
                                  [False] * len(streams))  # fmt: skip
            model.stream_step(states, [empty] * len(streams), [True] * len(streams))
            vocab = len(model.units.pieces)
            out = [ctc_lo(s.enc[0]).float().cpu().numpy() if s.enc else np.zeros((0, vocab), np.float32)
                   for s in states]  # fmt: skip
        offline = []
        for w in uploads:
            enc, lens = model.encode([w], model.offline_chunk_size, model.offline_left_chunks)
            offline.append(ctc_lo(enc[0, : int(lens[0])]).float().cpu().numpy())
    return out, offline, list(model.units.pieces), int(model.config.blank_id)


def ctc_reachable(logits: np.ndarray, pieces: list[str], blank: int, text: str,
                  tolerance: float) -> bool:  # fmt: skip
    """Whether some frame-by-frame choice among each frame's tokens within ``tolerance`` of its
    best logit collapses (CTC greedy: repeats merged, blanks dropped) to ``text`` as the model
    spells it (pieces joined, word boundaries to spaces, stripped). A dynamic programme over
    (characters of ``text`` matched, last frame's token): no enumeration of the choices."""
    spelled = [p.replace("\u2581", " ") for p in pieces]
    end = len(text)
    states = {(0, blank)}
    top = logits.max(axis=1, keepdims=True) if len(logits) else logits
    for t in range(len(logits)):
        cands = np.flatnonzero(logits[t] >= top[t, 0] - tolerance).tolist()
        nxt = set()
        for pos, prev in states:
            for c in cands:
                if c == blank or c == prev:
                    nxt.add((pos, c))
                    continue
                piece = spelled[c].lstrip() if pos == 0 else spelled[c]
                if text.startswith(piece, pos):
                    nxt.add((pos + len(piece), c))
                elif text.startswith(piece[: end - pos], pos) and not piece[end - pos :].strip():
                    nxt.add((end, c))  # the text's end, then only what strip() removes
        states = nxt
        if not states:
            return False
    return any(pos == end for pos, _ in states)


def tie_margin(logits: np.ndarray, pieces: list[str], blank: int, text: str,
               cap: float) -> float | None:  # fmt: skip
    """The smallest tolerance, as a fraction of the logits' spread (their standard deviation
    over frames and tokens), at which :func:`ctc_reachable` reaches ``text``; None above
    ``cap``."""
    if not len(logits):
        return 0.0 if text == "" else None
    spread = float(logits.std()) or 1.0
    gaps = (logits.max(axis=1, keepdims=True) - logits) / spread
    levels = np.unique(gaps[gaps <= cap])  # 0 first: every frame's best token
    if not ctc_reachable(logits, pieces, blank, text, float(levels[-1]) * spread):
        return None
    lo, hi = 0, len(levels) - 1  # reachable at levels[hi]; find the first level that is
    while lo < hi:
        mid = (lo + hi) // 2
        if ctc_reachable(logits, pieces, blank, text, float(levels[mid]) * spread):
            hi = mid
        else:
            lo = mid + 1
    return float(levels[lo])


# -- the server ------------------------------------------------------------------------------------
#: run first in the server process: each full garbage collection (generation 2) is written to its
#: stderr with its end (``time.monotonic()``) and length, for :func:`full_collections`
_GC_WATCH = (
    "import gc, sys, time\n"
    "def _bench_gc(phase, info, _t=[0.0]):\n"
    "    if phase == 'start':\n"
    "        _t[0] = time.perf_counter()\n"
    "    elif info['generation'] == 2:\n"
    "        ms = 1000.0 * (time.perf_counter() - _t[0])\n"
    "        sys.stderr.write(f'serverstreambench-gc {time.monotonic():.4f} {ms:.2f}\\n')\n"
    "gc.callbacks.append(_bench_gc)\n"
)
GC_MARK = "serverstreambench-gc "


def full_collections(log: Path, start: float, end: float) -> list[float]:
    """The lengths (ms) of the server's full garbage collections that ended in [start, end]."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if line.startswith(GC_MARK):
            at, ms = (float(x) for x in line[len(GC_MARK) :].split()[:2])
            if start <= at <= end:
                out.append(round(ms, 2))
    return out


def start_server(ckpt: str, *, device: str, threads: int, port: int, streams: int, uploads: int,
                 batch_wait_ms: float, log_level: str = "warning",
                 switch_interval_ms: float | None = None, dtype: str = "auto",
                 event_loop: str = "auto", log: Any = subprocess.PIPE) -> subprocess.Popen:  # fmt: skip
    """``switch_interval_ms``: the server process's ``sys.setswitchinterval`` (an experiment:
    how long a thread waiting for the GIL, e.g. the event loop after a socket call, may wait
    while the stream loop thread runs Python; None: the server's own, 1 ms once its streaming
    loop runs, ``oasr_server.stream_worker.SWITCH_INTERVAL_S``). ``event_loop``: ``asyncio``
    hides uvloop and httptools from the server, so uvicorn runs the standard asyncio loop and
    h11, as on a machine without them (the GPU machine: they are not among the wheels
    ``scripts/fetch_gpu_wheels.sh`` carries); ``auto``: whatever uvicorn picks. ``log``: where
    the server's stderr goes (a file: a pipe nobody reads would stall the server once it
    fills)."""
    boot = _GC_WATCH + "from oasr_server.cli import main; main()"
    if switch_interval_ms is not None:
        boot = f"import sys; sys.setswitchinterval({switch_interval_ms / 1000.0!r})\n{boot}"
    if event_loop == "asyncio":  # a None entry makes `import uvloop` raise ImportError
        boot = f"import sys; sys.modules.update(uvloop=None, httptools=None)\n{boot}"
    cmd = [
        sys.executable, "-c", boot,
        "--ckpt-dir", ckpt, "--device", device, "--threads", str(threads),
        "--service-mode", "streaming", "--http-bind", f"127.0.0.1:{port}", "--dtype", dtype,
        "--max-streams", str(streams + 8), "--max-batch-size", str(max(16, streams)),
        "--max-queue", str(max(64, 2 * uploads)), "--stream-batch-wait-ms", str(batch_wait_ms),
        "--no-demo", "--log-level", log_level,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("OASR_")}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)


def start_profiler(pid: int, path: Path, rate: int = 250) -> subprocess.Popen:
    """py-spy sampling process ``pid`` (every thread, on-CPU samples only) into ``path`` in
    its raw (collapsed stacks) format until :func:`stop_profiler`."""
    import shutil

    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise RuntimeError("--server-profile needs py-spy (pip install py-spy)")
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
           "--threads", "--gil", "--nonblocking", "--output", str(path)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_profiler(prof: subprocess.Popen) -> None:
    prof.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        prof.wait(60)
    except subprocess.TimeoutExpired:
        prof.kill()


def profile_summary(path: Path, top: int = 25) -> dict[str, Any]:
    """What a raw py-spy profile says: samples per thread, and for the event loop's thread
    (``MainThread``: uvicorn's loop) the share of its samples in each function (self: the
    function's own code, or the C code it called; inclusive: with what it called)."""
    import re
    from collections import Counter

    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    loop_total = 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        name = frames[0].split(": ", 1)[-1]
        threads[name] += n
        if name != "MainThread":
            continue
        loop_total += n
        own[frames[-1]] += n
        for f in set(frames[1:]):
            incl[f] += n

    def shares(c: Counter[str]) -> dict[str, float]:
        return {k: round(100.0 * v / max(1, loop_total), 1) for k, v in c.most_common(top)}

    return {"samples_by_thread": dict(threads.most_common()),
            "event_loop_self_pct": shares(own), "event_loop_inclusive_pct": shares(incl)}  # fmt: skip


def _raise_open_files(need: int) -> None:
    """Raise this process's soft open-file limit towards ``need`` (a socket per stream on each
    side; 1024 is a common default), within the hard limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < need:
            target = need if hard == resource.RLIM_INFINITY else min(need, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


def cpu_seconds(pid: int, thread: int | None = None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, all its threads, or of its thread
    ``thread`` only (Linux ``/proc``; None elsewhere)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _progress(t0: float, what: str) -> None:
    """One line of progress (a run cut short by ``timeout`` still shows where its time went)."""
    print(f"[{time.monotonic() - t0:6.1f} s] {what}", flush=True)


def _warnings(log: Path) -> list[str]:
    """The warning and error lines of the server's log and its warm-up lines (``--log-level
    info``: how long the warm-up took, the CUDA graphs captured ahead), the last 20."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    marks = ("Warning", "WARNING", "ERROR", "Error", "warm-up done", "captured ahead")
    keep = [ln for ln in lines if any(w in ln for w in marks)]
    return [ln[:300] for ln in keep[-20:]]


def read_metrics(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        return r.read().decode()


# -- clients (spawned processes) -------------------------------------------------------------------
def _client_main(conn: Any, port: int, ids: list[int], seconds: float, sr: int, chunk: int,
                 n_total: int, spread_s: float) -> None:  # fmt: skip
    """One client process: builds its streams' messages, then runs the rounds the parent asks
    for (``("connect",)``, ``("go", t0)``, ``("stop",)``) and sends back each round's results."""
    try:
        asyncio.run(_client(conn, port, ids, seconds, sr, chunk, n_total, spread_s))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        conn.close()


async def _client(conn: Any, port: int, ids: list[int], seconds: float, sr: int, chunk: int,
                  n_total: int, spread_s: float) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    messages = {}
    for i in ids:  # every append event is built before the clock starts
        raw = stream_pcm(i, seconds, sr).tobytes()
        messages[i] = [
            json.dumps({"type": "input_audio_buffer.append",
                        "audio": base64.b64encode(raw[o : o + 2 * chunk]).decode()})
            for o in range(0, len(raw), 2 * chunk)
        ]  # fmt: skip
    chunk_s = chunk / sr
    sem = asyncio.Semaphore(32)  # connections being opened at once
    conn.send(("prepared", len(ids)))
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command[0] == "stop":
            return

        async def open_one(i: int) -> Any:
            async with sem:
                return await _open_session(port, sr)

        sockets = await asyncio.gather(*(open_one(i) for i in ids), return_exceptions=True)
        failed = [f"stream {i}: {type(s).__name__}: {s}" for i, s in zip(ids, sockets, strict=True)
                  if isinstance(s, BaseException)]  # fmt: skip
        conn.send(("connected", failed))
        command = await loop.run_in_executor(None, conn.recv)
        if command[0] != "go":
            for ws in sockets:
                if not isinstance(ws, BaseException):
                    await ws.close()
            return
        t0 = command[1]
        results = await asyncio.gather(*(
            _run_session(ws, i, messages[i], t0 + spread_s * i / n_total, chunk_s)
            for i, ws in zip(ids, sockets, strict=True) if not isinstance(ws, BaseException)
        ))  # fmt: skip
        conn.send(("results", results))


async def _open_session(port: int, sr: int) -> Any:
    """A realtime session in manual-turn mode taking pcm16 at ``sr``, configured."""
    from websockets.asyncio.client import connect

    ws = await connect(f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription",
                       subprotocols=["realtime"], open_timeout=120, max_size=None,
                       compression=None, ping_interval=None, close_timeout=5)  # fmt: skip
    try:
        first = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if first.get("type") != "session.created":
            raise RuntimeError(f"first event {first.get('type')!r}: {first}")
        update = {
            "input_audio_format": "pcm16",
            "input_audio_sample_rate": sr,
            "turn_detection": None,
        }
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        while True:  # the default session's server VAD may be unavailable: an error, then ours
            event = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if event.get("type") == "session.updated":
                if (event["session"].get("turn_detection") is None
                        and event["session"].get("input_audio_sample_rate") == sr):  # fmt: skip
                    return ws
            elif event.get("type") == "error" and event["error"].get("code") != "vad_unavailable":
                raise RuntimeError(f"session.update refused: {event['error']}")
    except BaseException:
        await ws.close()
        raise


async def _run_session(ws: Any, i: int, messages: list[str], start: float, chunk_s: float) -> dict:
    """Send chunk k at ``start + (k + 1) x chunk_s``, commit, collect the events until the
    transcript. Times are ``time.monotonic()`` (one clock for every process of the host)."""
    out: dict[str, Any] = {"i": i, "due": [], "sent": [], "deltas": [], "final": None,
                           "final_at": None, "commit": None, "errors": []}  # fmt: skip

    async def receive() -> None:
        text = ""
        async for raw in ws:
            now = time.monotonic()
            event = json.loads(raw)
            kind = event.get("type")
            if kind == DELTA:
                text += event["delta"]
                out["deltas"].append((now, text))
            elif kind == COMPLETED:
                out["final"], out["final_at"] = event["transcript"], now
                return
            elif kind in ("error", "conversation.item.input_audio_transcription.failed"):
                out["errors"].append(json.dumps(event.get("error"))[:300])
                if kind != "error":
                    return

    receiver = asyncio.get_running_loop().create_task(receive())
    try:
        for k, message in enumerate(messages):
            due = start + (k + 1) * chunk_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            out["due"].append(due)
            out["sent"].append(time.monotonic())
            await ws.send(message)
        await ws.send(COMMIT)
        out["commit"] = time.monotonic()
        await asyncio.wait_for(asyncio.shield(receiver), 300)
    except BaseException as exc:  # noqa: BLE001 - the stream is reported as failed
        out["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        receiver.cancel()
        try:
            await ws.close()
        except Exception:  # noqa: BLE001
            pass
    return out


class Clients:
    """``n`` spawned client processes sharing the streams round-robin; stream ``i`` starts
    ``spread_s x i / streams`` after the others' common start."""

    def __init__(
        self, n: int, port: int, streams: int, seconds: float, sr: int, chunk: int, spread_s: float
    ) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that holds torch / CUDA
        self.conns, self.procs = [], []
        for c in range(n):
            ids = list(range(c, streams, n))
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_client_main, args=(child, port, ids, seconds, sr, chunk, streams, spread_s),
                            daemon=True)  # fmt: skip
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for conn in self.conns:
            self._expect(conn, "prepared", 300)

    @staticmethod
    def _expect(conn: Any, kind: str, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise RuntimeError(f"a client process sent no {kind!r} within {timeout:g} s")
        message = conn.recv()
        if message[0] != kind:
            raise RuntimeError(
                f"a client process failed: {message[1] if len(message) > 1 else message}"
            )
        return message[1]

    def round(self, timeout: float, on_go: Any = None) -> tuple[list[dict], list[str]]:
        """Connect every session, start them all at once, return every stream's record.
        ``on_go(t0)``: called once every session is open, with the instant they all start."""
        for conn in self.conns:
            conn.send(("connect",))
        failed = [f for conn in self.conns for f in self._expect(conn, "connected", 300)]
        t0 = time.monotonic() + 0.5
        if on_go is not None:
            on_go(t0)
        for conn in self.conns:
            conn.send(("go", t0))
        results = [r for conn in self.conns for r in self._expect(conn, "results", timeout)]
        return sorted(results, key=lambda r: r["i"]), failed

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()


# -- one run ---------------------------------------------------------------------------------------
def uploads_in_threads(base: str, blobs: list[bytes], delay: float) -> tuple[list, Any]:
    """Start the uploads ``delay`` seconds from now, all at once, in threads; returns the list
    that fills with ``(k, status, text, seconds)`` and the executor (shut it down to wait)."""
    from concurrent.futures import ThreadPoolExecutor

    from oasr.client import OASRClient

    answers: list[tuple[int, int, str, float]] = []
    client = OASRClient(base, timeout=600)
    start = time.monotonic() + delay

    def one(k: int, blob: bytes) -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        t = time.monotonic()
        try:
            body = client.transcribe(blob, filename=f"upload{k}.wav", response_format="json")
            answers.append((k, 200, body["text"], time.monotonic() - t))
        except Exception as exc:  # noqa: BLE001 - reported as a mismatch
            answers.append(
                (k, int(getattr(exc, "http_status", 0) or 0), str(exc)[:300], time.monotonic() - t)
            )

    pool = ThreadPoolExecutor(max(1, len(blobs)))
    for k, blob in enumerate(blobs):
        pool.submit(one, k, blob)
    return answers, pool


def check_stream(ref: StreamRef, rec: dict, tied: bool = False,
                 sent_at: list[float] | None = None) -> tuple[list[float], list[str]]:  # fmt: skip
    """Partial latencies of one stream's deltas and what did not match its reference. ``tied``:
    the stream's final differs from the reference's only at near-tied frames (``tie_margin``):
    not a problem, and its deltas need only be prefixes of its own final (after the tied frame
    they are no reference partial). ``sent_at``: gets, for each latency, when its chunk was
    sent."""
    problems: list[str] = []
    i = rec["i"]
    if rec["errors"]:
        problems.append(f"stream {i}: {rec['errors'][:3]}")
    if rec["final"] is None:
        problems.append(f"stream {i}: no transcript")
    elif rec["final"] != ref.final and not tied:
        problems.append(f"stream {i}: final {rec['final'][:80]!r} != engine {ref.final[:80]!r}")
    lat: list[float] = []
    k = 0  # next reference step that may match
    for n, (at, text) in enumerate(rec["deltas"]):
        j = next((m for m in range(k, len(ref.partials)) if ref.partials[m][1] == text), None)
        if j is None:
            if tied and rec["final"].startswith(text):
                continue
            last = n == len(rec["deltas"]) - 1
            if not (last and text == ref.final and rec["final"] is not None):  # the final's rest
                problems.append(
                    f"stream {i}: delta text {text[:60]!r} is no partial of the engine's"
                )
            continue
        k = j + 1
        chunk = ref.partials[j][0]
        if chunk < len(rec["sent"]):
            lat.append(at - rec["sent"][chunk])
            if sent_at is not None:
                sent_at.append(rec["sent"][chunk])
    return lat, problems


def run(*, ckpt_dir: str | None = None, shape: str = "small", device: str = "cpu",
        streams: int = 16, seconds: float = 6.0, chunk_ms: float = 100.0,
        model_chunk_ms: float | None = None, uploads: int = 4, upload_seconds: float = 4.0,
        clients: int = 1, threads: int = 2, batch_wait_ms: float = 0.0, warmup_rounds: int = 0,
        p99_target_ms: float = 150.0, log_level: str = "warning",
        switch_interval_ms: float | None = None, dtype: str = "auto",
        tie_tolerance: float | None = None, event_loop: str = "auto",
        server_profile: Path | None = None) -> Report:  # fmt: skip
    from benchmarks.serverbench import free_port

    _raise_open_files(2 * streams + 256)  # the server and the clients inherit it
    if tie_tolerance is None:
        cuda = device.startswith("cuda")
        resolved = dtype if dtype != "auto" else ("float16" if cuda else "float32")
        tie_tolerance = TIE_TOLERANCE.get(resolved, TIE_TOLERANCE["float32"])
    with tempfile.TemporaryDirectory(prefix="oasr-serverstream-") as tmp:
        ckpt = prepare_checkpoint(ckpt_dir, shape, model_chunk_ms, Path(tmp) / "model")
        from oasr.checkpoint import load_model
        from oasr.types import EngineConfig

        probe = load_model(EngineConfig(ckpt_dir=ckpt))  # the model's rate and chunk (CPU)
        sr = probe.feature_spec.sample_rate
        model_chunk_s = probe.chunk_size * probe.frame_shift
        del probe
        chunk = max(1, int(round(chunk_ms * sr / 1000)))
        pcm = [stream_pcm(i, seconds, sr) for i in range(streams)]
        up_pcm = [upload_pcm(k, upload_seconds, sr) for k in range(uploads)]
        t_start = time.monotonic()
        refs, up_ref, _ = reference(ckpt, device, threads, pcm, chunk, up_pcm, dtype=dtype)
        _progress(t_start, "in-process reference done")
        blobs = [wav_bytes(u, sr) for u in up_pcm]

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        server_log = Path(tmp) / "server.log"
        log_file = server_log.open("wb")
        proc = start_server(ckpt, device=device, threads=threads, port=port, streams=streams,
                            uploads=uploads, batch_wait_ms=batch_wait_ms, log_level=log_level,
                            switch_interval_ms=switch_interval_ms, dtype=dtype,
                            event_loop=event_loop, log=log_file)  # fmt: skip
        group = prof = None
        try:
            try:
                wait_ready(base, proc, timeout=180.0)
                _progress(t_start, "server ready (loaded, warmed up, graphs captured)")
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; its log: {_warnings(server_log)}") from None
            # phases spread over one model chunk: independent streams' chunks become ready
            # evenly over time, not all in the same client chunk
            group = Clients(clients, port, streams, seconds, sr, chunk, model_chunk_s)
            _progress(t_start, f"{clients} client processes prepared")
            timeout = 60 + 2 * seconds
            up: dict[str, Any] = {}

            def start_uploads(t0: float) -> None:
                # one second after the streams start (not after the connects began: opening
                # hundreds of sessions takes longer than that, and the uploads were over then)
                up["at"] = t0 + 1.0
                up["answers"], up["pool"] = uploads_in_threads(base, blobs, up["at"] - time.monotonic())

            for _ in range(warmup_rounds):
                group.round(timeout, on_go=start_uploads)
                up.pop("pool").shutdown(wait=True)
                _progress(t_start, "warm-up round done")
            before = read_metrics(base)
            if server_profile is not None:  # the measured round only
                prof = start_profiler(proc.pid, server_profile)
            # the main thread runs uvicorn's event loop (every socket, every event)
            t, cpu0, loop0 = (
                time.monotonic(),
                cpu_seconds(proc.pid),
                cpu_seconds(proc.pid, proc.pid),
            )
            round_start = time.monotonic()
            records, failed = group.round(timeout, on_go=start_uploads)
            round_end = time.monotonic()
            _progress(t_start, "measured round done")
            if prof is not None:
                stop_profiler(prof)
                prof = None
            up.pop("pool").shutdown(wait=True)
            answers, uploads_at = up["answers"], up["at"]
            wall, cpu1, loop1 = (
                time.monotonic() - t,
                cpu_seconds(proc.pid),
                cpu_seconds(proc.pid, proc.pid),
            )
            time.sleep(0.5)  # the server releases the sessions after their sockets close
            after = read_metrics(base)
        except BaseException:  # cut short (timeout's SIGTERM, a failed round): what the server said
            log_file.flush()
            for line in _warnings(server_log):
                print(f"  server log: {line}", flush=True)
            raise
        finally:
            if prof is not None:
                stop_profiler(prof)
            if group is not None:
                group.close()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log_file.close()
        server_warnings = _warnings(server_log)
        gcs = full_collections(server_log, round_start, round_end)
        # a final that differs: does the in-process engine itself change it with the batch?
        differing = [
            r["i"] for r in records if r["final"] is not None and r["final"] != refs[r["i"]].final
        ]
        alone: dict[int, str] = {}
        if differing:
            solo, _, _ = reference(ckpt, device, threads, [pcm[i] for i in differing[:8]], chunk,
                                   [], max_batch=1, dtype=dtype)  # fmt: skip
            alone = {i: r.final for i, r in zip(differing, solo, strict=False)}
        # ... and is a differing text one the model's logits allow within the tolerance?
        up_text = {k: text for k, status, text, _ in answers if status == 200}
        up_differing = [k for k, text in sorted(up_text.items()) if text != up_ref[k]]
        margins: dict[int, float | None] = {}
        up_margins: dict[int, float | None] = {}
        if differing or up_differing:
            logits, up_logits, pieces, blank = model_logits(
                ckpt, device, dtype, [pcm[i].astype(np.float32) / 32768.0 for i in differing],
                chunk, [up_pcm[k].astype(np.float32) / 32768.0 for k in up_differing],
            )  # fmt: skip
            finals = {r["i"]: r["final"] for r in records}
            cap = max(0.2, tie_tolerance)
            margins = {i: tie_margin(lg, pieces, blank, finals[i], cap)
                       for i, lg in zip(differing, logits, strict=True)}  # fmt: skip
            up_margins = {k: tie_margin(lg, pieces, blank, up_text[k], cap)
                          for k, lg in zip(up_differing, up_logits, strict=True)}  # fmt: skip

    mismatches = list(failed)
    if len(records) != streams:
        mismatches.append(f"{len(records)} streams ran, expected {streams}")
    partial_lat: list[float] = []
    final_lat: list[float] = []
    lags: list[float] = []
    finals_equal = 0
    engine_variant = 0
    def within(m: float | None) -> bool:
        return tie_tolerance > 0 and m is not None and m <= tie_tolerance

    tied = {i for i, m in margins.items() if within(m)}
    sent_at: list[float] = []
    for rec in records:
        i = rec["i"]
        lat, problems = check_stream(refs[i], rec, tied=i in tied, sent_at=sent_at)
        partial_lat += lat
        mismatches += problems
        if i in alone:
            variant = alone[i] != refs[i].final
            engine_variant += variant
            if i in tied:
                continue
            mismatches.append(
                f"stream {i}: the in-process engine with one stream per step gives "
                + (f"{alone[i][:80]!r} ({'equal to' if alone[i] == rec['final'] else 'unlike'} the "
                   "server's): the engine itself depends on its batch here" if variant else
                   "the reference's text: not explained by the batch size alone")
            )  # fmt: skip
        finals_equal += rec["final"] == refs[rec["i"]].final
        if rec["final_at"] is not None and rec["commit"] is not None:
            final_lat.append(rec["final_at"] - rec["commit"])
        lags += [s - d for s, d in zip(rec["sent"], rec["due"], strict=True)]
    uploads_equal = 0
    if sorted(k for k, *_ in answers) != list(range(uploads)):
        mismatches.append(f"{len(answers)} upload answers, expected {uploads}")
    for k, status, text, _ in sorted(answers):
        if status != 200:
            mismatches.append(f"upload {k}: HTTP {status}: {text}")
        elif text == up_ref[k]:
            uploads_equal += 1
        elif not within(up_margins.get(k)):
            mismatches.append(f"upload {k}: {text[:80]!r} != engine {up_ref[k][:80]!r}")
    leftover = {
        "oasr_streams_active": metric(after, "oasr_streams_active"),
        "oasr_engine_streams": metric(after, "oasr_engine_streams"),
        "oasr_stream_cache_streams": metric(after, "oasr_stream_cache", {"kind": "streams"}),
        "oasr_stream_cache_blocks_used": metric(
            after, "oasr_stream_cache", {"kind": "blocks_used"}
        ),
        "oasr_queue_depth": metric(after, "oasr_queue_depth"),
        "oasr_engine_in_flight": metric(after, "oasr_engine_in_flight"),
    }
    for name, value in leftover.items():
        if value:
            mismatches.append(f"{name} is {value:g} after the run, expected 0")
    turns = metric(after, "oasr_stream_turns_total") - metric(before, "oasr_stream_turns_total")
    if turns != streams:
        mismatches.append(f"the server counted {turns:g} committed turns, expected {streams}")
    graphs = {
        f"{kind}_measured": metric(after, "oasr_stream_cache", {"kind": kind})
        - metric(before, "oasr_stream_cache", {"kind": kind})
        for kind in ("graph_captures", "graph_replays")
    }
    graphs["graph_captures_before"] = metric(before, "oasr_stream_cache", {"kind": "graph_captures"})
    batches = metric(after, "oasr_batch_size_count") - metric(before, "oasr_batch_size_count")
    rows = metric(after, "oasr_batch_size_sum") - metric(before, "oasr_batch_size_sum")
    ms = 1000.0
    p99 = _pct(partial_lat, 99) * ms
    if not partial_lat:
        mismatches.append("no delta event could be timed (the model's text never grew)")
    up_lat = [s for *_, s in answers]
    # the deltas whose chunk was sent while the uploads were in flight, and the others
    busy = (uploads_at, uploads_at + max(up_lat, default=0.0))
    during = [x for x, t in zip(partial_lat, sent_at, strict=True) if busy[0] <= t <= busy[1]]
    outside = [x for x, t in zip(partial_lat, sent_at, strict=True) if not busy[0] <= t <= busy[1]]
    appends = sum(len(rec["sent"]) for rec in records)
    cpu = None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 2)
    return Report(
        streams=streams, seconds=seconds, chunk_ms=chunk / sr * ms, model_chunk_ms=model_chunk_s * ms,
        uploads=uploads, clients=clients, device=device, batch_wait_ms=batch_wait_ms, wall_s=round(wall, 2),
        partial_latency_p50_ms=_pct(partial_lat, 50) * ms, partial_latency_p90_ms=_pct(partial_lat, 90) * ms,
        partial_latency_p99_ms=p99, partial_latency_max_ms=max(partial_lat, default=0.0) * ms,
        final_latency_p50_ms=_pct(final_lat, 50) * ms, final_latency_p99_ms=_pct(final_lat, 99) * ms,
        final_latency_max_ms=max(final_lat, default=0.0) * ms,
        send_lag_p99_ms=_pct(lags, 99) * ms, send_lag_max_ms=max(lags, default=0.0) * ms,
        upload_latency_p50_s=_pct(up_lat, 50), upload_latency_max_s=max(up_lat, default=0.0),
        partials_measured=len(partial_lat), finals_equal=finals_equal, uploads_equal=uploads_equal,
        partials_during_uploads=len(during),
        partial_latency_p99_during_uploads_ms=_pct(during, 99) * ms,
        partial_latency_p99_outside_uploads_ms=_pct(outside, 99) * ms,
        p99_target_ms=p99_target_ms, held=not mismatches and p99 <= p99_target_ms,
        finals_engine_batch_variant=engine_variant, finals_tied=len(tied),
        uploads_tied=sum(map(within, up_margins.values())), tie_tolerance=tie_tolerance,
        tie_margins={str(i): None if m is None else round(m, 6) for i, m in sorted(margins.items())},
        upload_tie_margins={str(k): None if m is None else round(m, 6)
                            for k, m in sorted(up_margins.items())},
        server_switch_interval_ms=switch_interval_ms,
        server_cpu_s=cpu,
        server_loop_cpu_s=None if loop0 is None or loop1 is None else round(loop1 - loop0, 2),
        server_cpu_per_append_us=round(cpu / appends * 1e6, 1) if cpu is not None and appends else None,
        server_steps={"batches": batches, "mean_batch": round(rows / batches, 2) if batches else 0.0,
                      **graphs},
        dtype=dtype, server_warnings=server_warnings, server_event_loop=_loop_used(event_loop),
        server_full_gc_ms=gcs,
        server_profile=profile_summary(server_profile) if server_profile is not None else {},
        leftover=leftover, mismatches=mismatches,
    )  # fmt: skip


def _loop_used(event_loop: str) -> str:
    """The event loop uvicorn runs in the server (same interpreter as this process)."""
    import importlib.util

    if event_loop != "auto":
        return event_loop
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def print_report(r: Report) -> None:
    print(
        f"oasr-server --service-mode streaming: {r.streams} realtime streams x {r.seconds:g} s "
        f"(client chunks {r.chunk_ms:.0f} ms, model chunk {r.model_chunk_ms:.0f} ms) + {r.uploads} "
        f"uploads, {r.device}, batch wait {r.batch_wait_ms:g} ms, {r.clients} client processes, "
        f"server event loop {r.server_event_loop}"
    )
    print(
        f"  partial latency ms  p50 {r.partial_latency_p50_ms:7.1f}  p90 {r.partial_latency_p90_ms:7.1f}  "
        f"p99 {r.partial_latency_p99_ms:7.1f}  max {r.partial_latency_max_ms:7.1f}  "
        f"({r.partials_measured} deltas)"
    )
    print(
        f"  partial p99 ms while uploads ran {r.partial_latency_p99_during_uploads_ms:7.1f} "
        f"({r.partials_during_uploads} deltas), at other times "
        f"{r.partial_latency_p99_outside_uploads_ms:7.1f}"
    )
    print(
        f"  final latency ms    p50 {r.final_latency_p50_ms:7.1f}  p99 {r.final_latency_p99_ms:7.1f}  "
        f"max {r.final_latency_max_ms:7.1f}"
    )
    print(
        f"  client send lag ms  p99 {r.send_lag_p99_ms:7.1f}  max {r.send_lag_max_ms:7.1f};  "
        f"uploads p50 {r.upload_latency_p50_s:.2f} s max {r.upload_latency_max_s:.2f} s;  "
        f"server batches {r.server_steps.get('batches', 0):g} (mean {r.server_steps.get('mean_batch', 0)}; "
        f"CUDA graphs captured {r.server_steps.get('graph_captures_measured', 0):g}, replayed "
        f"{r.server_steps.get('graph_replays_measured', 0):g})"
    )
    print(
        f"  server process CPU {r.server_cpu_s} s (event loop {r.server_loop_cpu_s} s) in {r.wall_s} s "
        f"({r.server_cpu_per_append_us} us per append event, model host work included); "
        f"{len(r.server_full_gc_ms)} full garbage collections "
        f"(max {max(r.server_full_gc_ms, default=0):g} ms)"
    )
    print(
        f"  finals equal to the engine's {r.finals_equal}/{r.streams} (+ {r.finals_tied} differing only at "
        f"frames tied within {r.tie_tolerance:g} of the logits' spread), uploads {r.uploads_equal}/{r.uploads} "
        f"(+ {r.uploads_tied} tied); "
        f"held (checks pass, p99 <= {r.p99_target_ms:g} ms): {'yes' if r.held else 'NO'}"
    )
    if r.server_profile:
        print(f"  profile samples by thread: {r.server_profile['samples_by_thread']}")
        print("  event loop (MainThread) self %: " + ", ".join(
            f"{k} {v}" for k, v in list(r.server_profile["event_loop_self_pct"].items())[:12]))  # fmt: skip
    for w in r.server_warnings:
        print(f"  server log: {w}")
    for m in r.mismatches[:20]:
        print(f"    {m}")
    if len(r.mismatches) > 20:
        print(f"    ... {len(r.mismatches) - 20} more")


#: the smoke profile's model: its random weights emit a growing text at every 0.96 s chunk
SMOKE_CKPT = REPO / "tests" / "data" / "wenet" / "u2_conformer_conv2d6"


def main(argv: list[str] | None = None) -> dict:
    """``python -m benchmarks.serverstreambench`` and ``asrbench --workload serverstream``."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--profile",
        choices=["smoke", "default"],
        default="default",
        help="smoke: 8 streams x 4 s + 2 uploads of the bundled conv2d6 WeNet (CPU)",
    )
    p.add_argument(
        "--ckpt-dir", default=None, help="a streaming WeNet directory (default: --shape)"
    )
    p.add_argument("--shape", default=None, help="small | medium (streambench's models)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--streams", type=int, default=None, help="realtime sessions (default 16; smoke 8)"
    )
    p.add_argument(
        "--seconds", type=float, default=None, help="audio per stream (default 10; smoke 4)"
    )
    p.add_argument("--chunk-ms", type=float, default=100.0, help="audio per append event")
    p.add_argument(
        "--model-chunk-ms",
        type=float,
        default=None,
        help="the model's streaming chunk (default: the checkpoint's)",
    )
    p.add_argument(
        "--uploads",
        type=int,
        default=None,
        help="HTTP uploads during the streams (default 8; smoke 2)",
    )
    p.add_argument("--upload-seconds", type=float, default=6.0)
    p.add_argument(
        "--clients", type=int, default=None, help="client processes (default: one per 128 streams)"
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=None,
        help="the server's --stream-batch-wait-ms (default 5 on CUDA, 0 on CPU)",
    )
    p.add_argument(
        "--warmup-rounds",
        type=int,
        default=None,
        help="unmeasured runs of the whole workload first (default 1 on CUDA, 0 on CPU)",
    )
    p.add_argument("--p99-target-ms", type=float, default=150.0)
    p.add_argument(
        "--dtype",
        default="auto",
        help="the model's dtype in the server and the reference (auto: float16 on CUDA)",
    )
    p.add_argument(
        "--server-switch-interval-ms",
        type=float,
        default=None,
        help="experiment: the server's sys.setswitchinterval (default: the server's, 1 ms)",
    )
    p.add_argument(
        "--tie-tolerance",
        type=float,
        default=None,
        help="a differing final passes when it differs only at frames whose best tokens lie "
        "within this fraction of the CTC logits' spread (default: 5e-3 float32, 3e-2 float16, "
        "5e-2 bfloat16; 0: exact equality only)",
    )
    p.add_argument(
        "--server-event-loop",
        choices=["auto", "asyncio"],
        default="auto",
        help="asyncio: the server runs without uvloop and httptools (as where they are not "
        "installed, e.g. the GPU machine); auto: what uvicorn picks",
    )
    p.add_argument(
        "--server-profile",
        type=Path,
        default=None,
        help="py-spy the server during the measured round into this file (raw collapsed "
        "stacks; summarised in the report)",
    )
    p.add_argument("--log-level", default="warning", help="the server's --log-level")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    # a SIGTERM (``timeout``) unwinds like an exception: the server and the clients are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    smoke = args.profile == "smoke"
    cuda = args.device.startswith("cuda")
    ckpt = args.ckpt_dir or (str(SMOKE_CKPT) if smoke and args.shape is None else None)
    streams = args.streams or (8 if smoke else 16)
    report = run(
        ckpt_dir=ckpt, shape=args.shape or "small", device=args.device, streams=streams,
        seconds=args.seconds or (4.0 if smoke else 10.0), chunk_ms=args.chunk_ms,
        model_chunk_ms=args.model_chunk_ms,
        uploads=args.uploads if args.uploads is not None else (2 if smoke else 8),
        upload_seconds=min(args.upload_seconds, 3.0) if smoke else args.upload_seconds,
        clients=args.clients or max(1, -(-streams // 128)), threads=args.threads,
        batch_wait_ms=args.batch_wait_ms if args.batch_wait_ms is not None else (5.0 if cuda else 0.0),
        warmup_rounds=args.warmup_rounds if args.warmup_rounds is not None else (1 if cuda else 0),
        p99_target_ms=args.p99_target_ms, log_level=args.log_level,
        switch_interval_ms=args.server_switch_interval_ms, dtype=args.dtype,
        tie_tolerance=args.tie_tolerance, event_loop=args.server_event_loop,
        server_profile=args.server_profile,
    )  # fmt: skip
    print_report(report)
    out = asdict(report)
    out["ok"] = report.ok
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, ensure_ascii=False))
    if not report.ok:
        raise SystemExit("serverstreambench: the server's results did not match the engine's")
    return out


if __name__ == "__main__":
    main()
