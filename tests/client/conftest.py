"""A real ``oasr-server`` (uvicorn on a free local port, in a thread of this process) serving the
real default model (Whisper tiny.en) with its default settings (served as ``oasr``, alias
``whisper-1``), for ``OASRClient`` and ``oasr transcribe --server``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "tests" / "data" / "speech"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def served_engine():  # noqa: ANN201
    from oasr.defaults import default_checkpoint
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    engine = ASREngine(EngineConfig(ckpt_dir=str(default_checkpoint())))
    yield engine
    engine.shutdown()


@pytest.fixture
def local_cli_shares_the_model(served_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """In-process ``oasr transcribe`` runs get the server's loaded model (no second load)."""
    import oasr.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "load_model", lambda config: served_engine.model)


@pytest.fixture(scope="session")
def server_url(served_engine) -> Iterator[str]:  # noqa: ANN001
    import uvicorn

    from oasr_server.app import create_app
    from oasr_server.config import ServerConfig

    app = create_app(ServerConfig(decode_processes=0, warmup=False), engine=served_engine)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    from oasr.client import OASRClient

    client = OASRClient(url, timeout=10)
    deadline = time.monotonic() + 120
    while not client.ready():
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)
    yield url
    server.should_exit = True
    thread.join(timeout=30)
