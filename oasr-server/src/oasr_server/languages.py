"""Language names for OpenAI's ``verbose_json``: :mod:`oasr.languages` (the client reads them
back to codes with the same table)."""

from __future__ import annotations

from oasr.languages import NAMES, language_code, language_name

__all__ = ["NAMES", "language_code", "language_name"]
