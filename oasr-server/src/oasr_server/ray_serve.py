"""OASR on Ray Serve: one engine replica per GPU (or CPU replicas), behind Serve's HTTP proxy.

``oasr serve --ray`` (:func:`serve_on_ray`), or Serve's own tools through the application builder
``oasr_server.ray_serve:build_app`` (``serve run oasr_server.ray_serve:build_app replicas=2``).

Shape of the application (one Serve application, two deployments):

- ``OASRServer``: the ingress. Each replica is one complete oasr-server app
  (:func:`oasr_server.app.create_app`: the same routes, limits, queue and metrics, no second copy)
  over its own in-process :class:`~oasr.engine.ASREngine`, reached through Serve's FastAPI
  ingress. A replica is only marked running once its model has loaded and warmed up (the app's
  lifespan waits for it), so the proxy never routes to a replica that would answer
  ``model_not_ready``. A WebSocket (``/v1/realtime``) is one Serve request: it stays on the
  replica that accepted it for its lifetime. gRPC is served by each replica on its own port
  (``--grpc-bind HOST:PORT`` gives the first replica of a node ``PORT``, the next ``PORT+1``, ...),
  listed in ``/v1/models``; a call to that port is that replica's for its lifetime.
- ``OASRRegistry``: one small replica (no CPU reserved) that every engine replica reports to once
  a second (readiness, model entry, Prometheus text). ``/v1/models``, ``/healthz``, ``/readyz``
  and ``/metrics`` answer from it, whichever replica the proxy picked: the whole deployment.

Replica failures: Serve restarts a replica that dies (or fails its health check: a model that
failed to load). Requests that had reached a dying replica are not lost: the proxy-side
:class:`ReplicaFailoverMiddleware` (installed through Serve's
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` hook, :func:`proxy_middlewares`) buffers each HTTP
request's body and sends it again (transcription has no side effects) when the replica died
before its answer began, and answers 503 ``replica_unavailable`` with ``Retry-After`` when every
try failed.

Importing this module imports Ray; ``oasr_server`` and the CLI import it only for ``--ray``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from oasr.errors import EngineOverloadedError, InvalidRequestError
from oasr.errors import OASRError as OASRErrorBase

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from oasr.types import EngineConfig
    from oasr_server.config import ServerConfig

log = logging.getLogger("oasr_server.ray")

#: the Serve application's default name, and its deployments'
APP_NAME = "oasr"
SERVER_DEPLOYMENT = "OASRServer"
REGISTRY_DEPLOYMENT = "OASRRegistry"
#: how often each replica reports to the registry, and when a report is too old to count (a
#: replica that died stops reporting; its entry leaves the aggregate after this long)
REPORT_INTERVAL_S = 1.0
STALE_AFTER_S = 4.0
#: the proxy hook Serve reads in its proxy processes (see :func:`proxy_middlewares`)
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "oasr_server.ray_serve:proxy_middlewares"
#: response header of a request the proxy sent more than once: how many tries it took
ATTEMPTS_HEADER = b"x-oasr-attempts"


class ReplicaUnavailableError(EngineOverloadedError):
    """No replica could answer (the one holding the request died and the retries found none
    ready): HTTP 503 with ``Retry-After``."""

    code = "replica_unavailable"


# -- layout ------------------------------------------------------------------------------------


@dataclasses.dataclass
class RayOptions:
    """How the deployment is laid out on the Ray cluster (the ``--ray-*`` flags)."""

    #: ``ray.init`` address: None starts a local cluster (or joins the one ``RAY_ADDRESS``
    #: names), ``auto`` joins the cluster of this machine, ``HOST:PORT`` a head node
    address: str | None = None
    #: fixed number of engine replicas; None: one per GPU (``gpus_per_replica`` each), or 1
    #: without GPUs
    replicas: int | None = None
    #: GPUs each replica reserves (fractions share a GPU); None: 1 when the cluster has GPUs,
    #: else 0 (CPU replicas)
    gpus_per_replica: float | None = None
    #: CPUs each replica reserves
    cpus_per_replica: float = 1.0
    #: autoscaling bounds; setting either turns autoscaling on (``replicas`` is then the
    #: initial count)
    min_replicas: int | None = None
    max_replicas: int | None = None
    #: requests Serve sends one replica at once (WebSockets count for their lifetime); None:
    #: twice the batch plus ``max_streams``
    max_ongoing_requests: int | None = None
    #: the Serve application's name
    app_name: str = APP_NAME

    def __post_init__(self) -> None:
        for name in ("replicas", "min_replicas", "max_replicas", "max_ongoing_requests"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "min_replicas" else 1):
                raise InvalidRequestError(f"--ray-{name.replace('_', '-')} must be >= 1",
                                          param=name)  # fmt: skip
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise InvalidRequestError(
                "--ray-gpus-per-replica must be >= 0", param="gpus_per_replica"
            )
        if self.cpus_per_replica < 0:
            raise InvalidRequestError(
                "--ray-cpus-per-replica must be >= 0", param="cpus_per_replica"
            )
        if (
            self.min_replicas is not None
            and self.max_replicas is not None
            and self.min_replicas > self.max_replicas
        ):
            raise InvalidRequestError(
                "--ray-min-replicas must not exceed --ray-max-replicas", param="min_replicas"
            )


@dataclasses.dataclass
class Layout:
    """What :func:`plan_layout` decided: the deployment options and the engine's device."""

    gpus_per_replica: float
    num_replicas: int
    autoscaling: dict[str, Any] | None
    device: str
    max_ongoing_requests: int

    def deployment_options(self, cpus_per_replica: float) -> dict[str, Any]:
        actor: dict[str, Any] = {"num_cpus": cpus_per_replica}
        if self.gpus_per_replica:
            actor["num_gpus"] = self.gpus_per_replica
        options: dict[str, Any] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests,
            # a model that failed to load answers its health check with the failure: restarted
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
            "graceful_shutdown_timeout_s": 30.0,
        }
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling
        else:
            options["num_replicas"] = self.num_replicas
        return options


def plan_layout(
    options: RayOptions,
    cluster_gpus: float,
    *,
    device: str = "cpu",
    max_batch_size: int = 16,
    max_streams: int = 64,
) -> Layout:
    """Replicas, GPUs and device from the flags and the cluster's GPU count. One replica per GPU
    by default; a replica with GPUs runs its engine on ``cuda`` (Ray sets
    ``CUDA_VISIBLE_DEVICES`` to the GPUs it reserved, so ``cuda:N`` makes no sense there)."""
    gpus = options.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if cluster_gpus >= 1 else 0.0
    if gpus > 0:
        device = "cuda"
    elif device.startswith("cuda"):
        raise InvalidRequestError(
            f"--device {device} needs GPUs per replica (--ray-gpus-per-replica > 0)",
            param="device",
        )
    replicas = options.replicas
    if replicas is None:
        replicas = max(1, int(cluster_gpus // gpus)) if gpus > 0 else 1
    autoscaling = None
    if options.min_replicas is not None or options.max_replicas is not None:
        lo = options.min_replicas if options.min_replicas is not None else 1
        hi = options.max_replicas if options.max_replicas is not None else max(lo, replicas)
        autoscaling = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": min(max(replicas, lo), hi) if options.replicas else max(lo, 1),
            # a replica is busy once it holds a full batch
            "target_ongoing_requests": max_batch_size,
        }
    ongoing = options.max_ongoing_requests or (2 * max_batch_size + max_streams)
    return Layout(gpus, replicas, autoscaling, device, ongoing)


# -- metrics -----------------------------------------------------------------------------------


def merge_metrics(reports: list[tuple[str, str]]) -> bytes:
    """One Prometheus exposition from each replica's: every sample gets a ``replica`` label
    (the Serve replica id), families keep one HELP/TYPE each; plus ``oasr_ray_replicas`` (the
    replicas that reported). ``reports``: ``(replica, text)`` pairs."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import GaugeMetricFamily, Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    for replica, text in reports:
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                out.add_sample(s.name, {"replica": replica, **s.labels}, s.value, s.timestamp)
    count = GaugeMetricFamily("oasr_ray_replicas", "Engine replicas reporting to the registry.")
    count.add_metric([], len(reports))
    families = [count, *merged.values()]

    class _Collector:
        def collect(self) -> list[Metric]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    return generate_latest(registry)


# -- the aggregated routes ----------------------------------------------------------------------


def aggregate_models(served: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``/v1/models``' one entry for the whole deployment from the replicas' reports: ready when
    any replica is; ``oasr.replicas`` lists each (id, node, device, ready, gRPC address)."""
    ready = [e for e in entries if e.get("ready")]
    base = dict((ready or entries or [{}])[0].get("model") or {})
    base.update({"id": served, "object": "model", "owned_by": "oasr", "ready": bool(ready)})
    base.setdefault("created", int(time.time()))
    oasr = dict(base.get("oasr") or {})
    oasr["replicas"] = [
        {k: e.get(k) for k in ("replica", "actor", "node", "device", "ready", "grpc", "load_error")}
        for e in entries
    ]
    base["oasr"] = oasr
    return base


def _add_aggregate_routes(
    app: FastAPI, served: str, entries: Callable[[], Any], check_model: Callable[[str], None]
) -> None:
    """``/v1/models`` (and ``/v1/models/{id}``), ``/healthz``, ``/readyz`` and ``/metrics`` over
    all replicas, placed in front of the replica's own routes of the same paths (FastAPI
    answers the first match)."""
    from fastapi.responses import JSONResponse, Response
    from starlette.routing import Route

    from oasr_server.errors import NotReadyError, error_body

    async def models(request: Any) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [aggregate_models(served, await entries())]})

    async def retrieve_model(request: Any) -> JSONResponse:
        check_model(request.path_params["model_id"] or "?")  # 404 model_not_found otherwise
        return JSONResponse(aggregate_models(served, await entries()))

    async def healthz(request: Any) -> JSONResponse:
        found = await entries()
        return JSONResponse({"status": "ok", "replicas": len(found)})

    async def readyz(request: Any) -> JSONResponse:
        found = await entries()
        ready = [e["replica"] for e in found if e.get("ready")]
        if ready:
            return JSONResponse(
                {"status": "ready", "model": served, "replicas": len(found), "ready": len(ready)}
            )
        errors = [e["load_error"] for e in found if e.get("load_error")]
        why = f"the model failed to load: {errors[0]}" if errors else "no replica is ready yet"
        return JSONResponse(error_body(NotReadyError(why)), status_code=503)

    async def metrics(request: Any) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        found = await entries()
        body = merge_metrics([(e["replica"], e.get("metrics") or "") for e in found])
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app.router.routes[0:0] = routes


# -- deployments -------------------------------------------------------------------------------


class Registry:
    """The replicas' latest reports (``OASRRegistry``, one replica)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}

    def report(self, replica: str, report: dict[str, Any]) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def leave(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def entries(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._reports.items() if now - t > STALE_AFTER_S]:
            del self._reports[replica]
        return [dict(report, replica=r) for r, (_, report) in sorted(self._reports.items())]


class OASRServer:
    """One engine replica: the oasr-server app over an in-process engine (``OASRServer``)."""

    def __init__(
        self,
        server_config: ServerConfig,
        engine_config: EngineConfig,
        registry: Any,
        grpc_base: str | None = None,
        engine_factory: Callable[[], Any] | None = None,
    ) -> None:
        from ray import serve

        ctx = serve.get_replica_context()
        self.replica = ctx.replica_tag
        #: the replica's Ray actor (``ray.get_actor(name, namespace="serve")``)
        self.actor = ctx.replica_id.to_full_id_str()
        self.server_config = dataclasses.replace(server_config)
        if grpc_base:
            host, _, port = grpc_base.rpartition(":")
            local_rank = getattr(getattr(ctx, "rank", None), "local_rank", 0) or 0
            self.server_config.grpc_bind = f"{host}:{int(port) + local_rank if int(port) else 0}"
        self.engine_config = engine_config
        self.engine_factory = engine_factory
        self.registry = registry
        self.state: Any = None
        self._own_models: Any = None
        self.node = _node_ip()

    def __serve_build_asgi_app__(self) -> ASGIApp:  # noqa: N807 - Serve's hook name
        from oasr_server.app import create_app

        app = create_app(
            self.server_config, engine_config=self.engine_config, engine_factory=self.engine_factory
        )
        self.state = state = app.state.oasr
        original = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(a: Any) -> AsyncIterator[Any]:
            async with original(a) as value:
                # Serve routes to a replica once this returns: only when the model is ready
                loaded = await asyncio.get_running_loop().run_in_executor(None, state.wait_loaded)
                if not loaded:
                    raise RuntimeError(f"the model failed to load: {state.load_error}")
                reporter = asyncio.ensure_future(self._report_forever())
                try:
                    yield value
                finally:
                    reporter.cancel()
                    try:
                        await self.registry.leave.remote(self.replica)
                    except Exception:  # noqa: BLE001 - the registry may be gone first
                        pass

        app.router.lifespan_context = lifespan
        # this replica's own /v1/models answer (routes.py), reported to the registry
        self._own_models = next(
            r.endpoint for r in app.router.routes if getattr(r, "path", None) == "/v1/models"
        )
        _add_aggregate_routes(
            app, self.server_config.served_model_name, self._entries, state.check_model
        )
        return app

    async def _entries(self) -> list[dict[str, Any]]:
        try:
            return await self.registry.entries.remote()
        except Exception:  # noqa: BLE001 - registry restarting: this replica alone
            log.warning("the replica registry did not answer; reporting this replica alone")
            return [dict(await self._report(), replica=self.replica)]

    async def _report(self) -> dict[str, Any]:
        state = self.state
        grpc = getattr(state.grpc_server, "oasr_port", None) if state is not None else None
        host = (self.server_config.grpc_bind or "").rpartition(":")[0].strip("[]")
        if host in ("", "0.0.0.0", "::"):  # all interfaces: the node's address
            host = self.node
        own = await self._own_models()
        model = json.loads(bytes(own.body))["data"][0]
        return {
            "ready": bool(state is not None and state.ready and not state.draining),
            "load_error": state.load_error if state is not None else None,
            "node": self.node,
            "actor": self.actor,
            "device": str(getattr(self.engine_config, "device", "cpu")),
            "grpc": f"{host}:{grpc}" if grpc else None,
            "model": model,
            "metrics": state.metrics.render().decode() if state is not None else "",
        }

    async def _report_forever(self) -> None:
        while True:
            try:
                await self.registry.report.remote(self.replica, await self._report())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the registry is restarting; next round
                log.debug("report to the registry failed", exc_info=True)
            await asyncio.sleep(REPORT_INTERVAL_S)

    def check_health(self) -> None:
        """Serve's health check: a replica whose model failed to load is replaced."""
        state = self.state
        if state is not None and state.load_error:
            raise RuntimeError(f"the model failed to load: {state.load_error}")


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return "127.0.0.1"


def build_application(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    options: RayOptions,
    layout: Layout,
    *,
    grpc_bind: str | None = None,
    engine_factory: Callable[[], Any] | None = None,
) -> Any:
    """The Serve application (``serve.run`` it): the registry and the engine replicas.
    ``engine_factory`` (picklable; called in each replica) builds the engine instead of
    ``engine_config`` (benchmarks: random weights of a given shape)."""
    from ray import serve

    engine_config = dataclasses.replace(engine_config, device=layout.device)
    registry = serve.deployment(
        Registry,
        name=REGISTRY_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        logging_config={"log_level": "WARNING"},  # no access-log line per report
    ).bind()
    server = serve.deployment(
        serve.ingress()(OASRServer),
        name=SERVER_DEPLOYMENT,
        **layout.deployment_options(options.cpus_per_replica),
    )
    return server.bind(server_config, engine_config, registry, grpc_bind, engine_factory)


# -- proxy failover ----------------------------------------------------------------------------


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class ReplicaFailoverMiddleware:
    """Serve's HTTP proxy, one step earlier: each HTTP request's body is kept (up to
    ``max_body`` bytes) so that a request whose replica died before its answer began is sent
    again, up to ``retries`` times with a growing pause; when every try failed the client gets
    503 ``replica_unavailable`` with ``Retry-After``. An answer that had begun when its replica
    died cannot be taken back: an event stream gets a final ``error`` event, other bodies end
    short. WebSockets pass through (a stream lives on one replica; if it dies the socket
    closes). The body is read here, so an upload that stalls for ``idle_timeout`` seconds is
    answered 408 here."""

    def __init__(
        self,
        app: ASGIApp,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_body: int = 64 * 1024 * 1024,
        idle_timeout: float = 15.0,
    ) -> None:
        self.app = app
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_body = max_body
        self.idle_timeout = idle_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith("/-/"):
            await self.app(scope, receive, send)  # WebSockets, lifespan, Serve's own routes
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self.app(scope, receive, send)  # too large to keep: one try
            return
        body = bytearray()
        more = True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout or None)
            except asyncio.TimeoutError:
                await _send_error(send, 408, "upload_timeout",
                                  f"the upload sent nothing for {self.idle_timeout:g} s")  # fmt: skip
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                # past what we keep: forward what came and the rest as it comes; one try
                await self.app(scope, _Replay(bytes(body), receive, more), send)
                return
        data = bytes(body)
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * attempt)
            outcome = _Outcome(send, attempt + 1)
            replay = _Replay(data, receive, False)
            await self.app(scope, replay, outcome.send)
            if outcome.started:
                if not outcome.finished:
                    await outcome.end_short()
                return
            if replay.disconnected:  # the client left: nothing to answer, nothing to retry
                return
            log.warning(
                "%s %s: no answer from the replica (try %d of %d)",
                scope.get("method"), scope.get("path"), attempt + 1, self.retries + 1,
            )  # fmt: skip
        err = ReplicaUnavailableError(
            f"no replica answered after {self.retries + 1} tries (a replica died and none could "
            "take the request yet); retry later"
        )
        await _send_error(
            send, 503, err.code, err.message, retry_after=max(1, int(self.backoff_s * 4))
        )


class _Replay:
    """A ``receive`` that gives ``data`` first, then the client's own messages (the rest of the
    body when ``more``, else only its disconnect, noted in ``disconnected``)."""

    def __init__(self, data: bytes, receive: Receive, more: bool) -> None:
        self.data: bytes | None = data
        self.receive = receive
        self.more = more
        self.disconnected = False

    async def __call__(self) -> Message:
        if self.data is not None:
            data, self.data = self.data, None
            return {"type": "http.request", "body": data, "more_body": self.more}
        message = await self.receive()
        if message["type"] == "http.disconnect":
            self.disconnected = True
        return message


class _Outcome:
    """Watches what the proxy sends: whether the answer began and whether it ended."""

    def __init__(self, send: Send, attempt: int = 1) -> None:
        self._send = send
        self.attempt = attempt
        self.started = False
        self.finished = False
        self.event_stream = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            if self.attempt > 1:  # a retried request says so (operators, tests)
                headers = [*(message.get("headers") or ()), (ATTEMPTS_HEADER, b"%d" % self.attempt)]
                message = {**message, "headers": headers}
            for name, value in message.get("headers") or ():
                if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                    self.event_stream = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def end_short(self) -> None:
        """The replica died mid-answer: end the body (an SSE stream with an ``error`` event)."""
        tail = b""
        if self.event_stream:
            event = {"type": "error", "error": {
                "message": "the replica serving this request stopped mid-answer; retry the request",
                "type": "server_error", "param": None, "code": "replica_unavailable"}}  # fmt: skip
            tail = f"data: {json.dumps(event)}\n\n".encode()
        try:
            await self._send({"type": "http.response.body", "body": tail, "more_body": False})
        except Exception:  # noqa: BLE001 - the client is gone too
            pass


async def _send_error(
    send: Send, status: int, code: str, message: str, *, retry_after: int | None = None
) -> None:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None, "code": code}})  # fmt: skip
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode(), "more_body": False})


def proxy_middlewares() -> list[Any]:
    """Serve's proxy hook (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=
    oasr_server.ray_serve:proxy_middlewares``, set in the environment of every Ray node's
    processes): the :class:`ReplicaFailoverMiddleware`, tuned by ``OASR_RAY_RETRIES`` (3),
    ``OASR_RAY_RETRY_BACKOFF_S`` (0.5), ``OASR_RAY_MAX_RETRY_BODY`` (64 MiB) and
    ``OASR_RAY_UPLOAD_IDLE_TIMEOUT`` (15 s)."""
    from starlette.middleware import Middleware

    return [
        Middleware(
            ReplicaFailoverMiddleware,
            retries=int(_env_float("OASR_RAY_RETRIES", 3)),
            backoff_s=_env_float("OASR_RAY_RETRY_BACKOFF_S", 0.5),
            max_body=int(_env_float("OASR_RAY_MAX_RETRY_BODY", 64 * 1024 * 1024)),
            idle_timeout=_env_float("OASR_RAY_UPLOAD_IDLE_TIMEOUT", 15.0),
        )
    ]


# -- entry points ------------------------------------------------------------------------------


def init_ray(address: str | None, **kwargs: Any) -> None:
    """``ray.init`` with the proxy hook in the environment its processes inherit (a cluster this
    call starts; one that runs already needs it set where its nodes were started)."""
    import ray

    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    if not ray.is_initialized():
        ray.init(address=address, **kwargs)


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def deploy(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    options: RayOptions,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_bind: str | None = None,
    wait: bool = True,
) -> Layout:
    """Start Serve's proxy on ``host:port`` and run the application; returns once every replica
    is running (its model loaded), or raises when the deployment failed. ``wait=False``: returns
    once the deployment is submitted (:func:`wait_running` then)."""
    from ray import serve

    layout = plan_layout(
        options,
        cluster_gpus(),
        device=str(engine_config.device or "cpu"),
        max_batch_size=server_config.max_batch_size or engine_config.max_batch_size,
        max_streams=server_config.max_streams,
    )
    serve.start(http_options={"host": host, "port": port}, proxy_location="EveryNode")
    app = build_application(server_config, engine_config, options, layout, grpc_bind=grpc_bind)
    if wait:
        serve.run(app, name=options.app_name, route_prefix="/", blocking=False)
    else:
        from ray.serve.api import RunTarget, run_many

        target = RunTarget(target=app, name=options.app_name, route_prefix="/")
        run_many([target], wait_for_applications_running=False)
    return layout


def _parse_args(args: dict[str, Any]) -> tuple[ServerConfig, EngineConfig, RayOptions, str | None]:
    from oasr.types import EngineConfig
    from oasr_server.config import ServerConfig

    args = dict(args)
    ray_fields = {f.name for f in dataclasses.fields(RayOptions)}
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}
    grpc = args.pop("grpc_bind", None)
    ray_kw = {k: args.pop(k) for k in list(args) if k in ray_fields}
    engine_kw = {k: args.pop(k) for k in list(args) if k in engine_fields}
    server_kw = {k: args.pop(k) for k in list(args) if k in server_fields}
    if args:
        raise InvalidRequestError(f"unknown build_app arguments: {', '.join(sorted(args))}")
    ray_kw = {k: _coerce(v, RayOptions, k) for k, v in ray_kw.items()}
    engine_kw = {k: _coerce(v, EngineConfig, k) for k, v in engine_kw.items()}
    server_kw = {k: _coerce(v, ServerConfig, k) for k, v in server_kw.items()}
    if engine_kw.get("ckpt_dir") is None:
        from oasr.defaults import default_checkpoint

        engine_kw["ckpt_dir"] = str(default_checkpoint())
    if "max_batch_size" in engine_kw:
        server_kw.setdefault("max_batch_size", engine_kw["max_batch_size"])
    server_kw.setdefault("model_aliases", ("whisper-1", engine_kw["ckpt_dir"]))
    return ServerConfig(**server_kw), EngineConfig(**engine_kw), RayOptions(**ray_kw), grpc


def _coerce(value: Any, cls: type, name: str) -> Any:
    """``serve run ... key=value`` passes text: numbers and booleans by the field's default."""
    if not isinstance(value, str):
        return value
    default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int) or name in ("replicas", "min_replicas", "max_replicas",
                                            "max_ongoing_requests", "max_concurrency",
                                            "decode_processes", "num_threads"):  # fmt: skip
        return int(value)
    if isinstance(default, float) or name in ("gpus_per_replica",):
        return float(value)
    return value


def build_app(args: dict[str, Any]) -> Any:
    """Serve's application builder: ``serve run oasr_server.ray_serve:build_app replicas=2
    ckpt_dir=/models/large-v3`` or ``import_path: oasr_server.ray_serve:build_app`` with ``args``
    in a Serve config file. Keys: :class:`RayOptions`' (``replicas``, ``gpus_per_replica``,
    ``min_replicas``, ...), :class:`~oasr.types.EngineConfig`'s (``ckpt_dir``, ``device``,
    ``max_batch_size``, ...), :class:`~oasr_server.config.ServerConfig`'s (``max_queue``,
    ``api_key``, ...) and ``grpc_bind``. Run on a node of the cluster (it reads its GPU count)."""
    import ray

    server_config, engine_config, options, grpc = _parse_args(args)
    gpus = float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else 0.0
    layout = plan_layout(
        options,
        gpus,
        device=str(engine_config.device or "cpu"),
        max_batch_size=server_config.max_batch_size or engine_config.max_batch_size,
        max_streams=server_config.max_streams,
    )
    return build_application(server_config, engine_config, options, layout, grpc_bind=grpc)


def run_command(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    options: RayOptions,
    host: str,
    port: int,
    grpc_bind: str | None,
) -> int:
    """``oasr serve --ray``: :func:`serve_on_ray` with its failures as one line on stderr and
    an exit status (2: Ray is not installed; 1: the deployment failed)."""
    import importlib.util
    import sys

    def err(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        err("error: --ray needs Ray Serve; install it with: pip install 'oasr-server[ray]'")
        return 2
    try:
        return serve_on_ray(server_config, engine_config, options, host=host, port=port,
                            grpc_bind=grpc_bind, log=err)  # fmt: skip
    except OASRErrorBase as exc:
        err(f"error: {exc.message}")
        return 2
    except Exception as exc:  # noqa: BLE001 - Ray's own failures (cluster, deployment)
        err(f"error: Ray Serve: {type(exc).__name__}: {exc}")
        return 1


def serve_on_ray(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    options: RayOptions,
    *,
    host: str,
    port: int,
    grpc_bind: str | None = None,
    log: Callable[[str], None] = print,
) -> int:
    """``oasr serve --ray``: start or join the cluster, deploy, wait until every replica is
    running, then serve until SIGINT / SIGTERM (the application is deleted on the way out).
    Returns the exit status."""
    import signal
    import threading

    from ray import serve

    init_ray(options.address, include_dashboard=False, log_to_driver=True)
    try:
        layout = deploy(server_config, engine_config, options, host=host, port=port,
                        grpc_bind=grpc_bind, wait=False)  # fmt: skip
        if not wait_running(options.app_name, 3600):
            log(f"error: the {options.app_name!r} application did not start: "
                f"{app_message(options.app_name)}")  # fmt: skip
            return 1
        scale = (
            f"autoscaling {layout.autoscaling['min_replicas']}-{layout.autoscaling['max_replicas']}"
            if layout.autoscaling
            else f"{layout.num_replicas} replica(s)"
        )
        log(f"oasr on Ray Serve: {scale}, {layout.gpus_per_replica:g} GPU(s) each, engine on "
            f"{layout.device}; http://{host}:{port}/v1")  # fmt: skip
        stop = threading.Event()
        previous = {
            s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            while not stop.wait(0.5):
                pass
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if stop.is_set():
                # as in oasr_server.cli._run_until_stopped: a repeated SIGTERM must not kill
                # the process before the application is deleted below
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return 0
    finally:
        try:
            serve.delete(options.app_name)
        except Exception:  # noqa: BLE001 - the cluster may be gone
            pass
        if options.address is None:
            serve.shutdown()


def wait_running(app_name: str, timeout: float) -> bool:
    """Whether the application reached RUNNING within ``timeout`` seconds (False: it failed or
    is still deploying; :func:`app_message` says why)."""
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app_name)
        if status is not None:
            if status.status == "RUNNING":
                return True
            if status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                return False
        time.sleep(0.5)
    return False


def app_message(app_name: str) -> str:
    from ray import serve

    status = serve.status().applications.get(app_name)
    if status is None:
        return "not found"
    details = [status.message] + [d.message for d in status.deployments.values() if d.message]
    return "; ".join(m for m in details if m) or str(status.status)
