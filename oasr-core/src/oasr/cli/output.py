"""Where ``oasr transcribe`` writes and in what shape, shared by the in-process and the
``--server`` paths so that both give the same bytes.

Targets (:func:`plan_targets`), checked before any model loads:

* no ``-o`` / ``--output-dir``: standard output; ``json`` / ``verbose_json`` print one JSON
  object per line, each with a ``file`` field (one input or many: the same shape); several inputs
  of the other formats are separated by a ``==> FILE <==`` line before each body;
* ``-o PATH`` is a **directory** when it ends with ``/`` or is an existing directory, else a
  **file**; several inputs need a directory; a file's folder must exist;
* ``--output-dir DIR`` is always a directory (created if missing);
* in a directory each input writes ``STEM.EXT``; inputs that share a stem (``a.flac``,
  ``a.mp3``) keep their whole name (``a.flac.srt``, ``a.mp3.srt``), then a counter.

Formats: OpenAI's ``text``, ``json``, ``verbose_json``, ``srt``, ``vtt``, plus the Whisper tools'
``txt`` (= text), ``tsv`` (start and end in integer milliseconds) and ``all`` (txt, vtt, srt, tsv
and json (verbose) files into a directory). Subtitles can be re-cut at word times:
``max_line_width`` characters per line, ``max_words_per_line`` words per line (one line per
cue, as whisper.cpp and faster-whisper's tools do)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oasr.errors import InvalidRequestError
from oasr.types import Segment, Transcript, Word

#: file extension of each format
EXTENSIONS = {
    "text": "txt",
    "txt": "txt",
    "json": "json",
    "verbose_json": "json",
    "srt": "srt",
    "vtt": "vtt",
    "tsv": "tsv",
}
#: the formats ``all`` writes (json: the verbose body)
ALL_FORMATS = ("txt", "vtt", "srt", "tsv", "verbose_json")
JSON_FORMATS = ("json", "verbose_json")


class OutputError(InvalidRequestError):
    """An output target that cannot work (checked before any model loads)."""


@dataclass
class Targets:
    """Where each input's output goes: ``directory`` (one file per input and format) or
    ``file`` (one input) or neither (standard output)."""

    directory: Path | None
    file: Path | None
    #: per input: the file name stem used in ``directory``
    stems: list[str]

    @property
    def stdout(self) -> bool:
        return self.directory is None and self.file is None

    def paths(self, index: int, formats: Sequence[str]) -> list[Path]:
        if self.file is not None:
            return [self.file]
        assert self.directory is not None
        return [self.directory / f"{self.stems[index]}.{EXTENSIONS[f]}" for f in formats]


def unique_stems(files: Sequence[Path]) -> list[str]:
    """``STEM`` per input; inputs sharing a stem keep their whole name, then get ``-2``..."""
    stems = [f.stem or f.name for f in files]
    counts: dict[str, int] = {}
    for s in stems:
        counts[s] = counts.get(s, 0) + 1
    out = [f.name if counts[s] > 1 else s for f, s in zip(files, stems, strict=True)]
    seen: dict[str, int] = {}
    final = []
    for name in out:
        n = seen.get(name, 0) + 1
        seen[name] = n
        final.append(name if n == 1 else f"{name}-{n}")
    return final


def _is_dir_spelling(text: str) -> bool:
    return text.endswith(("/", os.sep)) or (os.altsep is not None and text.endswith(os.altsep))


def plan_targets(files: Sequence[Path], output: str | None, output_dir: str | None,
                 formats: Sequence[str]) -> Targets:  # fmt: skip
    """Check ``-o`` / ``--output-dir`` against the inputs and formats (see the module doc);
    directories are created here, before any work. Raises :class:`OutputError`."""
    if output is not None and output_dir is not None:
        raise OutputError("give -o/--output or --output-dir, not both", param="--output")
    if output is None and output_dir is None:
        if len(formats) > 1:
            raise OutputError(
                "--output-format all writes one file per format: add --output-dir DIR",
                param="--output-format",
            )
        return Targets(None, None, [])
    if output_dir is not None:
        directory: Path | None = Path(output_dir)
        file = None
    else:
        assert output is not None
        path = Path(output)
        if _is_dir_spelling(output) or path.is_dir():
            directory, file = path, None
        else:
            directory, file = None, path
    if file is not None:
        if len(files) > 1:
            raise OutputError(
                f"-o {output}: {len(files)} inputs need a directory (end it with '/', e.g. "
                f"-o {output}/, or use --output-dir)",
                param="--output",
            )
        if len(formats) > 1:
            raise OutputError(
                f"-o {output}: --output-format all writes one file per format: give a "
                f"directory (-o {output}/)",
                param="--output",
            )
        parent = file.parent if str(file.parent) else Path(".")
        if not parent.is_dir():
            raise OutputError(
                f"-o {output}: the folder {parent} does not exist (create it, or end the "
                f"path with '/' to write into a new directory)",
                param="--output",
            )
        if not os.access(parent, os.W_OK):
            raise OutputError(f"-o {output}: cannot write to the folder {parent}", param="--output")
        return Targets(None, file, [])
    assert directory is not None
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"{directory} exists and is not a directory", param="--output")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"cannot create the output directory {directory}: {exc.strerror or exc}",
            param="--output",
        ) from None
    if not os.access(directory, os.W_OK):
        raise OutputError(f"cannot write to the output directory {directory}", param="--output")
    return Targets(directory, None, unique_stems(files))


# -- rendering -----------------------------------------------------------------------------------


def to_tsv(transcript: Transcript) -> str:
    """openai-whisper's TSV: ``start<TAB>end<TAB>text`` in integer milliseconds."""
    lines = ["start\tend\ttext"]
    for s in transcript.segments:
        text = s.text.strip().replace("\t", " ")
        if text:
            lines.append(f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{text}")
    return "\n".join(lines) + "\n"


def _cue_text(words: Sequence[Word]) -> str:
    return "".join(w.word for w in words).strip()


def recut(transcript: Transcript, max_line_width: int | None,
          max_words_per_line: int | None) -> Transcript:  # fmt: skip
    """Subtitle cues cut at word times: a cue ends before its text would pass
    ``max_line_width`` characters or ``max_words_per_line`` words. Needs word times; a segment
    without them stays as it is."""
    if not max_line_width and not max_words_per_line:
        return transcript
    cues: list[Segment] = []
    for s in transcript.segments:
        if not s.words:
            cues.append(s)
            continue
        cur: list[Word] = []
        for w in s.words:
            trial = [*cur, w]
            too_wide = max_line_width and len(_cue_text(trial)) > max_line_width
            too_many = max_words_per_line and len(trial) > max_words_per_line
            if cur and (too_wide or too_many):
                cues.append(Segment(id=len(cues), start=cur[0].start, end=cur[-1].end,
                                    text=" " + _cue_text(cur), words=list(cur)))  # fmt: skip
                cur = [w]
            else:
                cur = trial
        if cur:
            cues.append(Segment(id=len(cues), start=cur[0].start, end=cur[-1].end,
                                text=" " + _cue_text(cur), words=list(cur)))  # fmt: skip
    return Transcript(text=transcript.text, language=transcript.language,
                      duration=transcript.duration, segments=cues, task=transcript.task)  # fmt: skip


def render_one(transcript: Transcript, fmt: str, granularities: tuple[str, ...],
               max_line_width: int | None = None,
               max_words_per_line: int | None = None) -> str:  # fmt: skip
    """The body of one input in ``fmt``, ending with a newline."""
    from oasr.formats import render

    if fmt == "txt":
        fmt = "text"
    if fmt == "tsv":
        body = to_tsv(transcript)
    elif fmt in ("srt", "vtt"):
        body = render(recut(transcript, max_line_width, max_words_per_line), fmt)
    else:
        body = render(transcript, fmt, granularities=granularities)
    return body if body.endswith("\n") else body + "\n"


def transcript_from_verbose_json(body: dict[str, Any]) -> Transcript:
    """A server's ``verbose_json`` answer back to a :class:`Transcript` (for rendering the
    formats a server does not speak, and identical output to the in-process path)."""
    words = [
        Word(word=w.get("word", ""), start=float(w.get("start", 0.0)), end=float(w.get("end", 0.0)),
             confidence=float(w.get("probability", w.get("confidence", 0.0)) or 0.0))
        for w in body.get("words") or []
    ]  # fmt: skip
    segments = []
    for k, s in enumerate(body.get("segments") or []):
        seg = Segment(
            id=int(s.get("id", k)),
            start=float(s.get("start", 0.0)),
            end=float(s.get("end", 0.0)),
            text=s.get("text", ""),
            tokens=list(s.get("tokens") or []),
            avg_logprob=float(s.get("avg_logprob", 0.0) or 0.0),
            compression_ratio=float(s.get("compression_ratio", 0.0) or 0.0),
            no_speech_prob=float(s.get("no_speech_prob", 0.0) or 0.0),
            temperature=float(s.get("temperature", 0.0) or 0.0),
            seek=int(s.get("seek", 0) or 0),
        )
        seg.words = [w for w in words if seg.start - 1e-3 <= w.start < seg.end + 1e-3]
        segments.append(seg)
    if not segments and words:
        segments = [Segment(id=0, start=words[0].start, end=words[-1].end,
                            text=body.get("text", ""), words=words)]  # fmt: skip
    from oasr.languages import language_code

    return Transcript(
        text=body.get("text", ""),
        language=language_code(body.get("language")),  # OpenAI's "english": back to "en"
        duration=float(body.get("duration", 0.0) or 0.0),
        segments=segments,
        task=body.get("task", "transcribe"),
    )


def join_stdout(files: Sequence[Path], bodies: Sequence[str | None], fmt: str,
                many: bool | None = None) -> str:  # fmt: skip
    """The outputs on standard output: for the JSON formats one JSON object per line, each with
    its ``file`` (whatever the number of inputs); for the others, with several inputs
    (``many``, default: more than one file), each body after a ``==> FILE <==`` line. ``None``
    bodies (failed inputs) are left out."""
    many = len(files) > 1 if many is None else many
    if not many and fmt not in JSON_FORMATS:
        return "".join(b for b in bodies if b is not None)
    parts = []
    for f, body in zip(files, bodies, strict=True):
        if body is None:
            continue
        if fmt in JSON_FORMATS:
            parts.append(
                json.dumps({"file": str(f), **json.loads(body)}, ensure_ascii=False) + "\n"
            )
        else:
            parts.append(f"==> {f} <==\n{body}")
    return "".join(parts)


__all__ = [
    "ALL_FORMATS",
    "EXTENSIONS",
    "OutputError",
    "Targets",
    "join_stdout",
    "plan_targets",
    "recut",
    "render_one",
    "to_tsv",
    "transcript_from_verbose_json",
    "unique_stems",
]
