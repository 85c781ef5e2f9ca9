"""A real ``oasr-server`` process (the example plugin's energy model: fast, no weights) for the
operations tests: the dashboard against Prometheus and the browser demo."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "oasr-plugin-example"
SPEECH = REPO / "tests" / "data" / "speech"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command() -> list[str]:
    script = Path(sys.executable).parent / "oasr-server"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from oasr_server.cli import main; main()"]


def server_env(paths: list[Path]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OASR_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in paths] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def write_example_site(site: Path) -> Path:
    """The example plugin as pip would install it (a dist-info with its entry point)."""
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


@dataclass
class Server:
    port: int
    base: str
    key: str | None
    log: Path
    proc: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def start_server(
    tmp: Path,
    args: list[str],
    *,
    key: str | None = None,
    paths: list[Path] | None = None,
    ready_timeout: float = 60.0,
) -> Server:
    """Start ``oasr-server`` with ``args`` on a free port, its output in a log file (never an
    undrained pipe), and wait for ``/readyz``."""
    port = free_port()
    log = tmp / f"oasr-server-{port}.log"
    command = [*server_command(), "--http-bind", f"127.0.0.1:{port}", "--device", "cpu", *args]
    if key is not None:
        command += ["--api-key", key]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=server_env(paths or []), stdout=out, stderr=subprocess.STDOUT
        )
    server = Server(port, f"http://127.0.0.1:{port}", key, log, proc)
    deadline = time.monotonic() + ready_timeout
    with httpx.Client(base_url=server.base, timeout=5) as c:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"oasr-server exited: {server.log_text()}")
            try:
                if c.get("/readyz").status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                stop_server(server)
                raise AssertionError(f"oasr-server never became ready: {server.log_text()}")
            time.sleep(0.1)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="module")
def energy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The example plugin's energy model behind a real server with an API key."""
    tmp = tmp_path_factory.mktemp("energy-server")
    site = write_example_site(tmp / "site")
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "example_energy.json").write_text(json.dumps({"threshold_db": -30}))
    server = start_server(
        tmp,
        ["--ckpt-dir", str(ckpt), "--served-model-name", "energy", "--decode-processes", "0"],
        key="k3y",
        paths=[EXAMPLE / "src", site],
    )
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def ops():
    """The helpers above, for test modules (``--import-mode=importlib`` cannot import conftest)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        free_port=free_port,
        start_server=start_server,
        stop_server=stop_server,
        write_example_site=write_example_site,
        require_program=require_program,
        REPO=REPO,
        EXAMPLE=EXAMPLE,
        SPEECH=SPEECH,
    )


def require_program(names: tuple[str, ...], package: str) -> str:
    """The first of ``names`` on PATH. Missing where scripts/setup.sh could have installed it
    (apt-get present and running as root): a failure; elsewhere a skip that says why."""
    import shutil

    for name in names:
        found = shutil.which(name)
        if found:
            return found
    if shutil.which("apt-get") is not None and os.geteuid() == 0:
        pytest.fail(f"Debian's {package} is not installed: apt-get install {package}")
    pytest.skip(
        f"{package} is not installed and cannot be installed here (needs apt-get as root: "
        f"apt-get install {package})"
    )
