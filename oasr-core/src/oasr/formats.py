"""Render a :class:`~oasr.types.Transcript` in the response formats OpenAI's API defines:
``text``, ``json``, ``verbose_json``, ``srt`` and ``vtt``. Shared by the CLI and the server."""

from __future__ import annotations

import json
from typing import Any, Literal

from oasr.errors import InvalidRequestError
from oasr.types import Transcript

ResponseFormat = Literal["text", "json", "verbose_json", "srt", "vtt"]
RESPONSE_FORMATS: tuple[str, ...] = ("text", "json", "verbose_json", "srt", "vtt")
CONTENT_TYPES: dict[str, str] = {
    "text": "text/plain; charset=utf-8",
    "json": "application/json",
    "verbose_json": "application/json",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}
FILE_EXTENSIONS: dict[str, str] = {
    "text": "txt",
    "json": "json",
    "verbose_json": "json",
    "srt": "srt",
    "vtt": "vtt",
}


def _clock(seconds: float, decimal: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def to_srt(transcript: Transcript) -> str:
    blocks = []
    for index, seg in enumerate((s for s in transcript.segments if s.text.strip()), start=1):
        start, end = _clock(seg.start, ","), _clock(max(seg.end, seg.start), ",")
        blocks.append(f"{index}\n{start} --> {end}\n{seg.text.strip()}\n")
    return "\n".join(blocks)


def to_vtt(transcript: Transcript) -> str:
    lines = ["WEBVTT", ""]
    for seg in transcript.segments:
        if not seg.text.strip():
            continue
        lines.append(f"{_clock(seg.start, '.')} --> {_clock(max(seg.end, seg.start), '.')}")
        lines.append(seg.text.strip())
        lines.append("")
    return "\n".join(lines)


def to_verbose_json(
    transcript: Transcript, *, include_words: bool = False, include_segments: bool = True
) -> dict[str, Any]:
    """OpenAI's ``verbose_json`` body."""
    body: dict[str, Any] = {
        "task": transcript.task,
        "language": transcript.language,
        "duration": round(transcript.duration, 3),
        "text": transcript.text,
    }
    if include_segments:
        body["segments"] = [
            {
                "id": s.id,
                "seek": s.seek,
                "start": round(s.start, 3),
                "end": round(s.end, 3),
                "text": s.text,
                "tokens": list(s.tokens),
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in transcript.segments
        ]
    if include_words:
        body["words"] = [
            {
                "word": w.word,
                "start": round(w.start, 3),
                "end": round(w.end, 3),
                "probability": w.confidence,
            }
            for w in transcript.words
        ]
    return body


def render(
    transcript: Transcript,
    response_format: str,
    *,
    granularities: tuple[str, ...] = ("segment",),
) -> str:
    """Render one transcript as the body text of ``response_format``."""
    if response_format == "text":
        return transcript.text.strip() + "\n"
    if response_format == "json":
        return json.dumps({"text": transcript.text}, ensure_ascii=False)
    if response_format == "verbose_json":
        body = to_verbose_json(
            transcript,
            include_words="word" in granularities,
            include_segments="segment" in granularities or "word" not in granularities,
        )
        return json.dumps(body, ensure_ascii=False)
    if response_format == "srt":
        return to_srt(transcript)
    if response_format == "vtt":
        return to_vtt(transcript)
    raise InvalidRequestError(
        f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, not {response_format!r}",
        param="response_format",
    )
