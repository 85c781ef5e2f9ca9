"""Prometheus metrics. Each app owns its own registry, so several apps (tests) never collide."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest

LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
AUDIO_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
RTFX_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
#: The window of the ``oasr_rtfx`` gauge (seconds).
RTFX_WINDOW_S = 60.0


class ThroughputWindow:
    """Audio seconds finished in the last ``window`` seconds, per wall second: the server's
    real-time factor right now (0 when idle)."""

    def __init__(self, window: float = RTFX_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window = window
        self.clock = clock
        self._done: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, audio_seconds: float) -> None:
        with self._lock:
            self._done.append((self.clock(), audio_seconds))

    def rtfx(self) -> float:
        horizon = self.clock() - self.window
        with self._lock:
            while self._done and self._done[0][0] < horizon:
                self._done.popleft()
            return sum(a for _, a in self._done) / self.window


class GPUMemoryCollector:
    """``oasr_gpu_memory_bytes{device, kind}`` read at scrape time: ``allocated`` and ``reserved``
    by this process's torch allocator, ``used`` and ``total`` on the whole device (other processes
    included). Reads nothing unless torch is already imported and the model is on a CUDA device,
    so a CPU server never imports torch or touches a GPU for it."""

    def __init__(self) -> None:
        self.device: str | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "oasr_gpu_memory_bytes",
            "GPU memory of the model's device: allocated/reserved by this process's torch "
            "allocator, used/total on the device.",
            labels=["device", "kind"],
        )
        torch = sys.modules.get("torch")
        device = self.device
        if torch is not None and device is not None and device.startswith("cuda"):
            try:
                index = torch.device(device).index
                index = torch.cuda.current_device() if index is None else index
                free, total = torch.cuda.mem_get_info(index)
                name = f"cuda:{index}"
                family.add_metric([name, "allocated"], torch.cuda.memory_allocated(index))
                family.add_metric([name, "reserved"], torch.cuda.memory_reserved(index))
                family.add_metric([name, "used"], total - free)
                family.add_metric([name, "total"], total)
            except Exception:  # noqa: BLE001 - a scrape must never fail on a device query
                pass
        yield family


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "oasr_requests",
            "HTTP requests answered, by route and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "oasr_request_duration_seconds",
            "Time from request start to last response byte.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter(
            "oasr_audio_seconds",
            "Seconds of decoded audio accepted, by route.",
            ["route"],
            registry=r,
        )
        self.audio_duration = Histogram(
            "oasr_audio_duration_seconds",
            "Length of each accepted audio input.",
            buckets=AUDIO_BUCKETS,
            registry=r,
        )
        self.decode_in_flight = Gauge(
            "oasr_decode_in_flight",
            "Uploads being decoded now (in the decode worker processes, or threads without them).",
            registry=r,
        )
        self.decode_duration = Histogram(
            "oasr_decode_duration_seconds",
            "Time to decode and resample one upload, by outcome (ok, or the error code).",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("oasr_queue_depth", "Requests waiting for the engine.", registry=r)
        self.in_flight = Gauge(
            "oasr_engine_in_flight", "Requests the engine is working on now.", registry=r
        )
        self.batch_size = Histogram(
            "oasr_batch_size",
            "Requests merged into one engine call.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.batch_duration = Histogram(
            "oasr_batch_duration_seconds",
            "Wall time of one engine call.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "oasr_queue_wait_seconds",
            "Time a request waited before its engine call ended.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "oasr_errors",
            "Error answers, by error code (overloaded, timeout, bad_audio, ...).",
            ["code"],
            registry=r,
        )
        self.streams_active = Gauge(
            "oasr_streams_active",
            "Live streams (realtime WebSockets, gRPC StreamingRecognize), by API.",
            ["api"],
            registry=r,
        )
        self.streams_total = Counter(
            "oasr_streams",
            "Streams ended, by API and outcome (closed, error, rejected).",
            ["api", "outcome"],
            registry=r,
        )
        self.engine_streams = Gauge(
            "oasr_engine_streams",
            "Streaming requests the engine holds (--service-mode streaming: one per turn being "
            "recognised).",
            registry=r,
        )
        self.stream_cache = Gauge(
            "oasr_stream_cache",
            "Streaming cache pool of the engine's model (--service-mode streaming): live streams, "
            "slots, blocks_used, blocks (allocated), bytes; graph_captures / graph_replays: its "
            "streaming steps' CUDA graphs captured and replayed so far.",
            ["kind"],
            registry=r,
        )
        self.stream_turns = Counter(
            "oasr_stream_turns",
            "Turns (utterances) committed on streams, by API.",
            ["api"],
            registry=r,
        )
        self.ready = Gauge(
            "oasr_model_ready", "1 once the model is loaded and warmed up.", registry=r
        )
        self.request_rtfx = Histogram(
            "oasr_request_rtfx",
            "Real-time factor of each request through the engine: its audio seconds per second "
            "from entering the engine queue to its result.",
            buckets=RTFX_BUCKETS,
            registry=r,
        )
        self.throughput = ThroughputWindow()
        self.rtfx = Gauge(
            "oasr_rtfx",
            f"Audio seconds transcribed per wall second over the last {RTFX_WINDOW_S:g} s "
            "(requests through the engine queue).",
            registry=r,
        )
        self.rtfx.set_function(self.throughput.rtfx)
        self.gpu_memory = GPUMemoryCollector()
        r.register(self.gpu_memory)

    def bind_worker(self, depth: Callable[[], float], in_flight: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)
        self.in_flight.set_function(in_flight)

    def bind_engine_streams(self, count: Callable[[], float]) -> None:
        self.engine_streams.set_function(count)

    def bind_stream_cache(self, occupancy: Callable[[], dict]) -> None:
        """``occupancy()``: the streaming scheduler's gauges (``pool_*`` keys, see
        docs/cache_manager.md); models without a pool report zeros."""
        for kind in ("streams", "slots", "blocks_used", "blocks", "bytes", "graph_captures",
                     "graph_replays"):  # fmt: skip
            self.stream_cache.labels(kind).set_function(
                lambda kind=kind: float(occupancy().get(f"pool_{kind}", 0))
            )

    def on_transcribed(self, audio_seconds: float, engine_seconds: float) -> None:
        """A request's result came back from the engine queue after ``engine_seconds``."""
        self.throughput.add(audio_seconds)
        if engine_seconds > 0:
            self.request_rtfx.observe(audio_seconds / engine_seconds)

    def bind_gpu(self, device: str) -> None:
        """Report GPU memory for the model's ``device`` (ignored unless it is a CUDA device)."""
        self.gpu_memory.device = device

    def on_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_duration.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
