"""Fixtures for the server tests: a small in-test model (no real weights), WAV bytes, and an
in-process client that runs the app's lifespan (model load, warm-up, worker) over ASGI."""

from __future__ import annotations

import asyncio
import io
import threading
import time
import wave
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import numpy as np
import pytest

from oasr.types import (
    DecodeFamily,
    DecodingOptions,
    FeatureSpec,
    ModelCapabilities,
    Segment,
    Transcript,
    Word,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "oasr-plugin-example"
RATE = 16000
T = TypeVar("T")


class FakeModel:
    """Implements :class:`oasr.model.ASRModel`. The text names the input's duration, so a test can
    check each answer went back to the request that asked. ``gate`` (an Event) holds every engine
    call until it is set; ``fail_seconds`` makes inputs of that length raise."""

    def __init__(
        self,
        *,
        word_timestamps: bool = True,
        translation: bool = True,
        delay: float = 0.0,
        gate: threading.Event | None = None,
        fail_seconds: float | None = None,
    ) -> None:
        self.name = "fake-model"
        self.capabilities = ModelCapabilities(
            decode_family=DecodeFamily.AED,
            word_timestamps=word_timestamps,
            translation=translation,
        )
        self.feature_spec = FeatureSpec(kind="none", sample_rate=RATE)
        self.delay = delay
        self.gate = gate
        self.fail_seconds = fail_seconds
        self.batches: list[int] = []
        self.options: list[DecodingOptions] = []
        self.calls_started = threading.Semaphore(0)

    def transcribe(
        self, audios: Sequence[np.ndarray], options: DecodingOptions, progress: Any = None
    ) -> list[Transcript]:
        self.batches.append(len(audios))
        self.options.append(options)
        self.calls_started.release()
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "test gate never opened"
        if self.delay:
            time.sleep(self.delay)
        out = []
        for audio in audios:
            dur = len(audio) / RATE
            if self.fail_seconds is not None and abs(dur - self.fail_seconds) < 1e-3:
                raise RuntimeError("model failure on this input")
            words = (
                [Word(" hello", 0.0, dur / 2, 0.9), Word(" world", dur / 2, dur, 0.8)]
                if options.word_timestamps
                else []
            )
            said = "hello world" if options.task == "transcribe" else "translated words"
            text = f"{said} {dur:.2f}"
            half = dur / 2
            segments = [
                Segment(0, 0.0, half, f" {said}", tokens=[1, 2], words=words, avg_logprob=-0.1),
                Segment(1, half, dur, f" {dur:.2f}", tokens=[3], avg_logprob=-0.2),
            ]
            out.append(
                Transcript(
                    text=text,
                    language=options.language or "en",
                    duration=dur,
                    segments=segments,
                    task=options.task,
                )
            )
        return out


def wav_bytes(seconds: float = 1.0, rate: int = RATE, freq: float = 440.0) -> bytes:
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    pcm = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@asynccontextmanager
async def serving(app: Any, *, wait_ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """Run ``app``'s lifespan and give an httpx client talking to it over ASGI."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://oasr.test", timeout=30
        ) as client:
            if wait_ready:
                ok = await anyio.to_thread.run_sync(app.state.oasr.wait_loaded, 10)
                assert ok, app.state.oasr.load_error
            yield client


def make_engine(model: Any, **engine_kw: Any) -> Any:
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    return ASREngine(EngineConfig(**engine_kw), model=model)


@pytest.fixture
def app_factory() -> Callable[..., tuple[Any, FakeModel]]:
    """``app_factory(model=None, engine_kw=None, **server_config)`` -> (app, model)."""
    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    def build(model: FakeModel | None = None, engine_kw: dict[str, Any] | None = None, **cfg: Any):
        model = model or FakeModel()
        cfg.setdefault("served_model_name", "fake")
        app = create_app(ServerConfig(**cfg), engine=make_engine(model, **(engine_kw or {})))
        return app, model

    return build


def post_audio(
    client: httpx.AsyncClient,
    path: str = "/v1/audio/transcriptions",
    *,
    audio: bytes | None = None,
    fields: dict[str, Any] | list[tuple[str, str]] | None = None,
    headers: dict[str, str] | None = None,
) -> Any:
    files = {"file": ("audio.wav", audio if audio is not None else wav_bytes(), "audio/wav")}
    data: dict[str, Any] = {}
    if isinstance(fields, list):  # repeated fields (timestamp_granularities[])
        for key, value in fields:
            data.setdefault(key, []).append(value)
    else:
        data = dict(fields or {})
    return client.post(path, files=files, data=data, headers=headers)


def write_example_distribution(site: Path) -> Path:
    """The example plugin as pip would install it (a dist-info with its entry point)."""
    import tomllib

    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    dist_info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    eps = project["entry-points"]["oasr"]
    (dist_info / "entry_points.txt").write_text(
        "[oasr]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
    )
    return site


@pytest.fixture
def example_ckpt(tmp_path: Path) -> Path:
    import json

    ckpt = tmp_path / "example-ckpt"
    ckpt.mkdir()
    (ckpt / "example_energy.json").write_text(json.dumps({"threshold_db": -30}))
    return ckpt


@pytest.fixture
def example_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The example plugin installed in this process (source tree + dist-info on sys.path)."""
    import sys

    from oasr.plugins import reset_plugin_manager

    site = write_example_distribution(tmp_path / "site-example")
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m.startswith("oasr_plugin_example")]:
        monkeypatch.delitem(sys.modules, name)
    reset_plugin_manager()
    yield site
    reset_plugin_manager()


@pytest.fixture
def kit() -> Any:
    """The helpers above, for test modules (``--import-mode=importlib`` cannot import conftest)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        FakeModel=FakeModel,
        wav_bytes=wav_bytes,
        run=run,
        serving=serving,
        post_audio=post_audio,
        make_engine=make_engine,
        RATE=RATE,
        EXAMPLE=EXAMPLE,
    )
