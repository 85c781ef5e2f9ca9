"""``chunking_strategy`` of ``/v1/audio/transcriptions``: split the upload into speech segments
with the VAD, transcribe the segments as one batch, put the pieces back on the original time
line.

OpenAI's field is ``"auto"`` or ``{"type": "server_vad", "threshold", "prefix_padding_ms",
"silence_duration_ms"}``. Multipart clients send the object as a JSON string or as bracketed
fields (``chunking_strategy[type]=server_vad``, ``chunking_strategy[threshold]=0.4``, which is
what the ``openai`` SDK sends); both are read.

Mapping onto :class:`oasr.vad.SegmentationOptions`: ``threshold`` -> ``threshold``,
``silence_duration_ms`` -> ``min_silence_ms`` (a silence this long splits two segments),
``prefix_padding_ms`` -> ``speech_pad_ms`` (audio kept on each side of a segment). Segments are
also cut at ``max_speech_s`` = 30 s so each fits one Whisper window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oasr.errors import InvalidRequestError
from oasr_server import jsonsafe

if TYPE_CHECKING:
    import numpy as np

    from oasr.types import DecodingOptions, Transcript
    from oasr_server.app import ServerState
    from oasr_server.worker import EngineWorker

PARAM = "chunking_strategy"
#: OpenAI's defaults for ``server_vad`` chunking (also what ``"auto"`` means here)
DEFAULT_THRESHOLD = 0.5
DEFAULT_PREFIX_PADDING_MS = 300
DEFAULT_SILENCE_DURATION_MS = 200
MAX_SEGMENT_S = 30.0


@dataclass(frozen=True)
class ChunkingStrategy:
    threshold: float = DEFAULT_THRESHOLD
    prefix_padding_ms: float = DEFAULT_PREFIX_PADDING_MS
    silence_duration_ms: float = DEFAULT_SILENCE_DURATION_MS

    def segmentation_options(self) -> Any:
        from oasr.vad import SegmentationOptions

        return SegmentationOptions(
            threshold=self.threshold,
            min_silence_ms=self.silence_duration_ms,
            speech_pad_ms=self.prefix_padding_ms,
            max_speech_s=MAX_SEGMENT_S,
        )


def _number(obj: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    value = obj.get(key)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        value = None
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"{PARAM}.{key} must be a number, not {obj.get(key)!r}", param=PARAM
        ) from None
    if not (math.isfinite(x) and lo <= x <= hi):
        raise InvalidRequestError(
            f"{PARAM}.{key} must be between {lo:g} and {hi:g}, not {x:g}", param=PARAM
        )
    return x


def parse_chunking_strategy(
    value: str | None, bracketed: dict[str, str] | None = None
) -> ChunkingStrategy | None:
    """``value``: the ``chunking_strategy`` field (``"auto"`` or a JSON object); ``bracketed``:
    the ``chunking_strategy[KEY]`` fields. None when chunking was not asked for."""
    obj: Any
    if bracketed:
        if value is not None:
            raise InvalidRequestError(
                f"send {PARAM} either as one field or as {PARAM}[...] fields, not both",
                param=PARAM,
            )
        obj = dict(bracketed)
    elif value is None:
        return None
    else:
        text = value.strip()
        if text == "auto":
            return ChunkingStrategy()
        if not text.startswith("{"):
            raise InvalidRequestError(
                f'{PARAM} must be "auto" or an object {{"type": "server_vad", ...}}, not {value!r}',
                param=PARAM,
            )
        try:
            obj = jsonsafe.loads(text)
        except jsonsafe.JSONTooDeepError as exc:
            raise InvalidRequestError(f"{PARAM}: {exc}", param=PARAM) from None
        except ValueError:
            raise InvalidRequestError(f"{PARAM} is not valid JSON", param=PARAM) from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f'{PARAM} must be "auto" or an object', param=PARAM)
    if obj.get("type") != "server_vad":
        raise InvalidRequestError(
            f"{PARAM}.type must be 'server_vad', not {obj.get('type')!r}", param=PARAM
        )
    unknown = set(obj) - {"type", "threshold", "prefix_padding_ms", "silence_duration_ms"}
    if unknown:
        raise InvalidRequestError(
            f"{PARAM} has unknown field(s): {', '.join(sorted(unknown))}", param=PARAM
        )
    return ChunkingStrategy(
        threshold=_number(obj, "threshold", 0.0, 1.0, DEFAULT_THRESHOLD),
        prefix_padding_ms=_number(obj, "prefix_padding_ms", 0, 10_000, DEFAULT_PREFIX_PADDING_MS),
        silence_duration_ms=_number(
            obj, "silence_duration_ms", 0, 10_000, DEFAULT_SILENCE_DURATION_MS
        ),
    )


def merge_transcripts(
    pieces: list[Transcript],
    offsets_s: list[float],
    duration: float,
    options: DecodingOptions,
) -> Transcript:
    """One transcript on the original time line from per-segment transcripts: segment and word
    times shifted by each piece's offset, segments renumbered, texts joined by one space."""
    from dataclasses import replace

    from oasr.types import Transcript

    segments = []
    texts = []
    language = None
    for piece, off in zip(pieces, offsets_s, strict=True):
        text = piece.text.strip()
        if text:
            texts.append(text)
        if language is None and piece.language:
            language = piece.language
        for seg in piece.segments:
            words = [replace(w, start=w.start + off, end=w.end + off) for w in seg.words]
            segments.append(
                replace(
                    seg, id=len(segments), start=seg.start + off, end=seg.end + off, words=words
                )
            )
    return Transcript(
        text=" ".join(texts),
        language=language or options.language,
        duration=duration,
        segments=segments,
        task=options.task,
    )


async def transcribe_chunked(
    state: ServerState,
    worker: EngineWorker,
    audio: np.ndarray,
    sample_rate: int,
    options: DecodingOptions,
    strategy: ChunkingStrategy,
    deadline: float,
    is_disconnected: Any = None,
) -> Transcript:
    """VAD segments of ``audio`` -> one engine call over all of them -> one transcript."""
    from oasr.vad import get_speech_segments

    detector = await state.vad_detector()
    segs = await state.run_vad(
        get_speech_segments, audio, sample_rate, detector, strategy.segmentation_options()
    )
    duration = audio.shape[-1] / sample_rate
    if not segs:
        return merge_transcripts([], [], duration, options)
    pieces = await state.transcribe(
        worker,
        [audio[s.start : s.end] for s in segs],
        options,
        deadline,
        is_disconnected,
        multi=True,
    )
    return merge_transcripts(pieces, [s.start_s for s in segs], duration, options)
