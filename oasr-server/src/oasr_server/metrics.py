"""Prometheus metrics. Each app owns its own registry, so several apps (tests) never collide."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
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
        self.stream_turns = Counter(
            "oasr_stream_turns",
            "Turns (utterances) committed on streams, by API.",
            ["api"],
            registry=r,
        )
        self.ready = Gauge(
            "oasr_model_ready", "1 once the model is loaded and warmed up.", registry=r
        )

    def bind_worker(self, depth: Callable[[], float], in_flight: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)
        self.in_flight.set_function(in_flight)

    def bind_engine_streams(self, count: Callable[[], float]) -> None:
        self.engine_streams.set_function(count)

    def on_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_duration.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
