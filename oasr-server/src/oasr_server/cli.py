"""``oasr-server`` and ``oasr serve``: load one model and serve it over HTTP.

This module imports only typer at module level (the ``oasr`` CLI imports it through the plugin
hook, and ``oasr --help`` must stay fast); uvicorn, FastAPI and the engine load when the command
runs.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated, Any, Optional

import typer

from oasr.errors import OASRError


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6, ``:8000`` for all interfaces)."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise typer.BadParameter(f"expected HOST:PORT, not {bind!r}", param_hint="--http-bind")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def serve_command(
    ckpt_dir: Annotated[
        Optional[str],  # noqa: UP045 - typer reads annotations at run time
        typer.Option(
            "--ckpt-dir",
            help="Checkpoint directory or Hugging Face Hub id. Default: the bundled Whisper tiny.en.",
        ),
    ] = None,
    http_bind: Annotated[
        str, typer.Option("--http-bind", help="HOST:PORT to listen on.")
    ] = "127.0.0.1:8000",
    max_upload_bytes: Annotated[
        int, typer.Option("--max-upload-bytes", min=1, help="Largest request body (413 above).")
    ] = 25 * 1024 * 1024,
    max_audio_seconds: Annotated[
        float, typer.Option("--max-audio-seconds", min=0.001, help="Longest audio (413 above).")
    ] = 3600.0,
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue",
            min=1,
            help="Requests that may wait for the engine (503 overloaded above).",
        ),
    ] = 64,
    request_timeout: Annotated[
        float,
        typer.Option(
            "--request-timeout", min=0.001, help="Seconds before a request is answered 504."
        ),
    ] = 600.0,
    keep_alive_timeout: Annotated[
        float,
        typer.Option(
            "--keep-alive-timeout",
            min=0.1,
            help="Seconds an idle HTTP/1.1 connection stays open. Longer than the idle expiry "
            "of common clients (httpx 5 s, aiohttp 15 s), so the client drops an idle "
            "connection first instead of sending a request onto one the server is closing.",
        ),
    ] = 75.0,
    api_key: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--api-key",
            envvar="OASR_API_KEY",
            help="Require 'Authorization: Bearer KEY' on every route but /healthz and /readyz.",
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")] = "cpu",
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            metavar="auto|float32|float16|bfloat16",
            help="The model's compute dtype (auto: float32 on CPU, float16 on CUDA).",
        ),
    ] = "auto",
    quantization: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--quantization",
            metavar="int8_w8a8|fp8_w8a8",
            help="Quantize the model's linear layers on load (fp8: CUDA compute capability "
            ">= 8.9). A checkpoint written by `oasr quantize` needs no flag.",
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--kv-cache-dtype",
            metavar="auto|fp8",
            help="Whisper / Qwen2-Audio decoders: keep the KV cache in fp8.",
        ),
    ] = None,
    max_batch_size: Annotated[
        int, typer.Option("--max-batch-size", min=1, help="Most requests in one engine call.")
    ] = 16,
    threads: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option("--threads", help="CPU threads for torch."),
    ] = None,
    decode_processes: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(
            "--decode-processes",
            min=0,
            help="Worker processes that decode uploads (0: threads in the server process). "
            "Default: half the cores, at most 8; 0 below 4 cores.",
        ),
    ] = None,
    grpc_bind: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--grpc-bind",
            help="HOST:PORT for the gRPC API (oasr.speech.v1.Speech, health, reflection). Off by default.",
        ),
    ] = None,
    max_streams: Annotated[
        int,
        typer.Option(
            "--max-streams",
            min=0,
            help="Live streams (/v1/realtime WebSockets + gRPC StreamingRecognize); more are refused.",
        ),
    ] = 64,
    partial_interval_ms: Annotated[
        int,
        typer.Option(
            "--partial-interval-ms",
            min=0,
            help="Streams: re-transcribe a growing turn after this much new audio for interim "
            "results (offline mode; in streaming mode they follow the model's chunks). "
            "0: finals only.",
        ),
    ] = 1000,
    service_mode: Annotated[
        str,
        typer.Option(
            "--service-mode",
            help="offline: requests join the engine scheduler's continuous batch (models with an "
            "executor); streaming: pin the engine to streaming mode and feed realtime / gRPC "
            "streams to it as audio arrives (models that can stream only).",
        ),
    ] = "offline",
    max_concurrency: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(
            "--max-concurrency",
            min=1,
            help="Most requests in the engine at once (the rest wait in the queue). "
            "Default: --max-batch-size (twice that for models without a continuous-batching "
            "executor, so the next batch gathers while one runs).",
        ),
    ] = None,
    realtime_idle_timeout: Annotated[
        float,
        typer.Option(
            "--realtime-idle-timeout",
            min=0,
            help="Close a /v1/realtime WebSocket after this many seconds without a client event "
            "(0: never).",
        ),
    ] = 300.0,
    upload_idle_timeout: Annotated[
        float,
        typer.Option(
            "--upload-idle-timeout",
            min=0,
            help="Seconds an upload may send nothing before a 408 (0: no limit); also the grace "
            "before --upload-min-rate applies.",
        ),
    ] = 15.0,
    upload_min_rate: Annotated[
        int,
        typer.Option(
            "--upload-min-rate",
            min=0,
            help="Slowest accepted upload, in average bytes per second (408 below; 0: none).",
        ),
    ] = 4096,
    max_receiving_bytes: Annotated[
        int,
        typer.Option(
            "--max-receiving-bytes",
            min=1,
            help="Most request-body bytes being received at once across connections (503 above).",
        ),
    ] = 512 * 1024 * 1024,
    max_pending_audio_seconds: Annotated[
        float,
        typer.Option(
            "--max-pending-audio-seconds",
            min=1,
            help="Most decoded upload audio held at once, summed over requests (503 above).",
        ),
    ] = 14400.0,
    max_tokens_per_second: Annotated[
        float,
        typer.Option(
            "--max-tokens-per-second",
            min=0,
            help="Autoregressive models: max_new_tokens per window defaults to 32 + this x the "
            "audio's seconds for clips under ~10 s (0: the model's own budget).",
        ),
    ] = 20.0,
    max_fallback_rounds: Annotated[
        int,
        typer.Option(
            "--max-fallback-rounds",
            min=-1,
            help="Temperature-fallback rounds per window after the first decoding: a request's "
            "temperature schedule is cut to its first 1 + N temperatures (-1: no cap).",
        ),
    ] = 2,
    gate_seconds_per_step: Annotated[
        Optional[float],  # noqa: UP045
        typer.Option(
            "--gate-seconds-per-step",
            min=0.001,
            help="Seconds of audio Whisper's VAD gate scans per scheduler step, over all the "
            "requests being gated (default: 30 on CPU, 3600 on CUDA).",
        ),
    ] = None,
    stream_batch_wait_ms: Annotated[
        float,
        typer.Option(
            "--stream-batch-wait-ms",
            min=0,
            help="--service-mode streaming: a model step may wait up to this many ms (from the "
            "oldest ready chunk) for more streams to become ready, to batch them (0: never "
            "waits; a few ms pay off on a GPU).",
        ),
    ] = 0.0,
    stream_buffer_seconds: Annotated[
        float,
        typer.Option(
            "--stream-buffer-seconds",
            min=0.1,
            help="Most uncommitted audio a live stream (realtime, gRPC) buffers, in seconds.",
        ),
    ] = 600.0,
    stream_buffer_bytes: Annotated[
        int,
        typer.Option(
            "--stream-buffer-bytes",
            min=4096,
            help="Most uncommitted audio a live stream buffers, in bytes (float32 at the "
            "model's rate: 64 KB per second at 16 kHz).",
        ),
    ] = 64 * 1024 * 1024,
    allowed_origins: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-origin",
            help="A browser origin (scheme://host[:port]) allowed to call the API and open "
            "/v1/realtime, with CORS; repeatable; '*' for any. Default: same origin only.",
        ),
    ] = None,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo/--no-demo",
            help="Serve the browser demo page (examples/web) at /demo: microphone or file into "
            "/v1/realtime, uploads to /v1/audio/transcriptions.",
        ),
    ] = True,
    served_model_name: Annotated[
        str,
        typer.Option("--served-model-name", help="Model id in /v1/models and the 'model' field."),
    ] = "oasr",
    no_warmup: Annotated[
        bool, typer.Option("--no-warmup", help="Report ready without a warm-up run.")
    ] = False,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Serve on a Ray cluster with Ray Serve: one engine replica per GPU (CPU replicas "
            "without GPUs) behind Serve's HTTP proxy on --http-bind (needs oasr-server[ray]).",
        ),
    ] = False,
    ray_address: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--ray-address",
            help="--ray: join this cluster (auto, or the head's HOST:PORT) instead of starting "
            "a local one.",
        ),
    ] = None,
    ray_replicas: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(
            "--ray-replicas", min=1, help="--ray: engine replicas (default: one per GPU, else 1)."
        ),
    ] = None,
    ray_gpus_per_replica: Annotated[
        Optional[float],  # noqa: UP045
        typer.Option(
            "--ray-gpus-per-replica",
            min=0,
            help="--ray: GPUs per replica (fractions share a GPU; default 1 when the cluster has "
            "GPUs, else 0).",
        ),
    ] = None,
    ray_cpus_per_replica: Annotated[
        float, typer.Option("--ray-cpus-per-replica", min=0, help="--ray: CPUs per replica.")
    ] = 1.0,
    ray_min_replicas: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(
            "--ray-min-replicas", min=0, help="--ray: autoscaling lower bound (turns it on)."
        ),
    ] = None,
    ray_max_replicas: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(
            "--ray-max-replicas", min=1, help="--ray: autoscaling upper bound (turns it on)."
        ),
    ] = None,
    log_level: Annotated[
        str, typer.Option("--log-level", help="debug, info, warning, error.")
    ] = "info",
) -> None:
    """Serve one model over HTTP: OpenAI-compatible /v1/audio/transcriptions and translations,
    the /v1/realtime WebSocket, /v1/models, /v1/speech:recognize, /healthz, /readyz and
    /metrics."""
    import uvicorn

    from oasr.types import EngineConfig
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig
    from oasr_server.realtime import websocket_protocol

    host, port = parse_bind(http_bind)
    if service_mode not in ("offline", "streaming"):
        raise typer.BadParameter(
            f"expected offline or streaming, not {service_mode!r}", param_hint="--service-mode"
        )
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if ckpt_dir is None:
            from oasr.defaults import default_checkpoint

            ckpt_dir = str(default_checkpoint())
        engine_config = EngineConfig(
            ckpt_dir=ckpt_dir,
            device=device,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_audio_seconds=max_audio_seconds,
            num_threads=threads,
            service_mode=service_mode,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
        )
        config = ServerConfig(
            max_upload_bytes=max_upload_bytes,
            max_audio_seconds=max_audio_seconds,
            max_queue=max_queue,
            request_timeout=request_timeout,
            api_key=api_key,
            served_model_name=served_model_name,
            # OpenAI clients send "whisper-1"; others name the checkpoint they asked for
            model_aliases=("whisper-1", ckpt_dir),
            max_batch_size=max_batch_size,
            warmup=not no_warmup,
            grpc_bind=grpc_bind,
            max_streams=max_streams,
            partial_interval_ms=partial_interval_ms,
            max_concurrency=max_concurrency,
            realtime_idle_timeout=realtime_idle_timeout,
            stream_buffer_seconds=stream_buffer_seconds,
            max_tokens_per_second=max_tokens_per_second,
            max_fallback_rounds=None if max_fallback_rounds < 0 else max_fallback_rounds,
            gate_seconds_per_step=gate_seconds_per_step,
            stream_batch_wait_ms=stream_batch_wait_ms,
            max_pending_audio_seconds=max_pending_audio_seconds,
            upload_idle_timeout=upload_idle_timeout,
            upload_min_rate=upload_min_rate,
            max_receiving_bytes=max_receiving_bytes,
            stream_buffer_bytes=stream_buffer_bytes,
            allowed_origins=tuple(o.rstrip("/") for o in allowed_origins or ()),
            demo=demo,
            decode_processes=decode_processes,
        )
        if ray:
            from oasr_server.ray_serve import RayOptions

            ray_options = RayOptions(
                address=ray_address,
                replicas=ray_replicas,
                gpus_per_replica=ray_gpus_per_replica,
                cpus_per_replica=ray_cpus_per_replica,
                min_replicas=ray_min_replicas,
                max_replicas=ray_max_replicas,
            )
    except OASRError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    if ray:
        from oasr_server.ray_serve import run_command

        raise typer.Exit(run_command(config, engine_config, ray_options, host, port, grpc_bind))

    server: uvicorn.Server | None = None
    failed: list[BaseException] = []

    def on_load_failure(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(config, engine_config=engine_config, on_load_failure=on_load_failure)
    app.state.oasr.freeze_after_warmup = True  # this process is the server: see ServerState
    server = _draining_server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level.lower(),
            lifespan="on",
            timeout_graceful_shutdown=max(5, int(request_timeout)),
            timeout_keep_alive=keep_alive_timeout,
            ws=websocket_protocol(),  # pauses reading a socket only when messages queue up
        )
    )
    _run_until_stopped(server)
    if failed:
        exc = failed[0]
        if getattr(exc, "param", None) == "service_mode":
            typer.echo(
                f"error: --service-mode {service_mode}: "
                f"{exc.message.split(';')[0]}; serve it with --service-mode offline",  # type: ignore[attr-defined]
                err=True,
            )
            raise typer.Exit(2)
        message = exc.message if isinstance(exc, OASRError) else f"{type(exc).__name__}: {exc}"
        typer.echo(f"error: the model failed to load: {message}", err=True)
        raise typer.Exit(1)


def _draining_server(config: Any) -> Any:
    """uvicorn's server with OASR's drain first (:meth:`ServerState.drain`: gRPC stops taking
    calls, realtime sessions get their committed turns answered), then uvicorn's own (HTTP
    requests in flight finish, sockets close)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        stopped_by_signal = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.stopped_by_signal = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            state = getattr(getattr(self.config.app, "state", None), "oasr", None)
            if state is not None:
                timeout = min(30.0, float(self.config.timeout_graceful_shutdown or 30))
                try:
                    await state.drain(timeout)
                except Exception:  # noqa: BLE001 - the rest of the shutdown must still run
                    logging.getLogger("oasr_server").exception("drain failed")
            await super().shutdown(sockets=sockets)

    return DrainingServer(config)


def _run_until_stopped(server: Any) -> None:
    """Serve until SIGTERM / SIGINT. uvicorn drains in-flight requests, then re-raises the signal
    it caught; SIGTERM is how orchestrators ask a server to stop, so after a graceful drain it
    ends with status 0 (not 143). While uvicorn runs, its own handlers apply (a second Ctrl-C
    forces an exit). Once a signal has stopped the server, SIGTERM stays ignored: orchestrators
    repeat it, and one landing while the drained process tears down would otherwise kill it
    with status 143."""
    import signal

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        stopping = getattr(server, "stopped_by_signal", False)
        signal.signal(signal.SIGTERM, signal.SIG_IGN if stopping else previous)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(name="oasr-server")(serve_command)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point ``oasr-server``."""
    from oasr.openmp import choose_openmp_wait_policy

    choose_openmp_wait_policy()  # before anything imports torch: no spin-waiting on a busy core
    app(args=argv if argv is not None else sys.argv[1:], prog_name="oasr-server")


if __name__ == "__main__":  # pragma: no cover
    main()
