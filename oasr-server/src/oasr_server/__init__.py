"""OASR server: an OpenAI-compatible HTTP API over one in-process :class:`oasr.engine.ASREngine`.

Importing this package is cheap (no torch, no FastAPI); :func:`oasr_server.app.create_app` builds
the ASGI application and ``oasr-server`` / ``oasr serve`` run it under uvicorn.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
