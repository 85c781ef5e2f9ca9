"""``/demo`` serves the page without a key; ``--no-demo`` removes it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from oasr_server.app import create_app
from oasr_server.config import ServerConfig

PAGE = Path(__file__).resolve().parents[2] / "examples" / "web" / "index.html"


class _NoEngine:
    """Never used: the app starts loading only in its lifespan, which these requests skip."""


@pytest.mark.parametrize("demo", [True, False])
def test_demo_route(demo: bool) -> None:
    import anyio

    app = create_app(ServerConfig(api_key="k3y", demo=demo), engine_factory=_NoEngine)

    async def get(path: str, **kw) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get(path, **kw)

    r = anyio.run(get, "/demo")
    if demo:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/html")
        assert r.text == PAGE.read_text(encoding="utf-8")
        assert "connect-src 'self'" in r.headers["content-security-policy"]
        # the page is public; the API it calls is not
        assert anyio.run(get, "/v1/models").status_code == 401
    else:
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found"


def test_the_cli_has_the_flag() -> None:
    from typer.testing import CliRunner

    from oasr_server.cli import app

    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    assert "--demo" in out and "--no-demo" in out
