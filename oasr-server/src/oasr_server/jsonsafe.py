"""JSON from clients, parsed with a nesting bound.

``json.loads`` recurses once per nesting level: a 2 KB string of ``[`` reaches Python's
recursion limit (``RecursionError``, a 500 or a dead WebSocket), and an object nested a few hundred
levels deep that does parse can still blow the stack of whatever walks it next. Every JSON a client
sends (``chunking_strategy``, realtime events) goes through :func:`loads`: deeper than
:data:`MAX_JSON_DEPTH` is a plain ``ValueError`` like any other malformed JSON."""

from __future__ import annotations

import json
from typing import Any

#: deepest nesting accepted in client JSON (OpenAI's shapes need 3 or 4 levels)
MAX_JSON_DEPTH = 32


class JSONTooDeepError(ValueError):
    """Client JSON nested deeper than :data:`MAX_JSON_DEPTH` levels."""


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` that raises :class:`JSONTooDeepError` (a ``ValueError``) for input nested
    deeper than ``max_depth``, never ``RecursionError``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONTooDeepError(f"JSON nested deeper than {max_depth} levels") from None
    # walk without recursion; containers only
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise JSONTooDeepError(f"JSON nested deeper than {max_depth} levels")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value
