"""``GET /demo``: the browser demo page (``examples/web/index.html``) served by the server, so it
talks to ``/v1/realtime`` and ``/v1/audio/transcriptions`` on its own origin. ``--no-demo`` turns
it off. The page is static and public (browsers cannot send a bearer token on navigation); it
holds no key: the user types the server's ``--api-key`` into it, and every API call it makes
is checked as any other."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

#: Where the page is looked for: ``OASR_DEMO_PAGE`` (a file), a copy packaged beside this module
#: (``oasr_server/web/index.html``, where a wheel build puts one), else the source tree's
#: ``examples/web/index.html`` (an editable or source install).
DEMO_ENV = "OASR_DEMO_PAGE"
DEMO_PATH = "/demo"
#: The page runs only its own inline script (and the AudioWorklet it makes from a blob) and talks
#: only to its own origin.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline' blob:; style-src 'unsafe-inline'; "
    "connect-src 'self' blob:; media-src 'self' blob:; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def demo_page() -> Path | None:
    override = os.environ.get(DEMO_ENV)
    if override:
        return Path(override)
    here = Path(__file__).resolve()
    packaged = here.parent / "web" / "index.html"
    if packaged.is_file():
        return packaged
    for parent in here.parents:
        candidate = parent / "examples" / "web" / "index.html"
        if candidate.is_file():
            return candidate
    return None


def add_demo_routes(app: FastAPI) -> None:
    @app.get(DEMO_PATH, include_in_schema=False)
    def demo() -> HTMLResponse:
        page = demo_page()
        if page is None or not page.is_file():
            from oasr_server.errors import NotFoundError

            raise NotFoundError(
                "the demo page is not installed with this server (it ships in the source tree as "
                f"examples/web/index.html; set {DEMO_ENV} to its path)"
            )
        # no-store: the page is small and a stale copy after an upgrade confuses more than it saves
        return HTMLResponse(
            page.read_text(encoding="utf-8"),
            headers={
                "Cache-Control": "no-store",
                "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                "Referrer-Policy": "no-referrer",
            },
        )
