"""``oasr transcribe``, ``oasr translate``, ``oasr convert`` and ``oasr quantize``. Torch is imported only when a
command runs.

Everything a command line can get wrong is checked before the model loads (inputs, ``-o``
targets, ``--device``, ``--dtype``, ``--language``, ``--task``, option values), each as one
line. Then every input gets its output or its own one-line error; the exit status is 1 when any
input failed. ``--server URL`` sends the same inputs to an ``oasr-server`` and writes the same
bytes (the server answers ``verbose_json``; the formats are rendered here, as in-process)."""

from __future__ import annotations

import gc
import inspect
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from oasr.cli.output import ALL_FORMATS, OutputError, join_stdout, plan_targets, render_one
from oasr.errors import InvalidRequestError, OASRError

#: stderr: messages are never wrapped (a ``pip install`` line stays one line when piped)
err_console = Console(stderr=True, soft_wrap=True)
#: From this many files on, ``--decode-processes`` defaults to the server's pool size (half the
#: cores up to 8); below it, and on machines under 4 cores, to one worker (:class:`EarlyDecode`).
PARALLEL_DECODE_FILES = 8
#: a decoded input this much shorter than its header declares is reported as truncated
TRUNCATION_TOLERANCE_S = 0.5


class Format(str, Enum):
    text = "text"
    txt = "txt"
    json = "json"
    verbose_json = "verbose_json"
    srt = "srt"
    vtt = "vtt"
    tsv = "tsv"
    all = "all"


class LongForm(str, Enum):
    sequential = "sequential"
    vad = "vad"


class Granularity(str, Enum):
    word = "word"
    segment = "segment"


# ISO 639-1 codes (two letters); longer codes and language names are left to the model
_ISO_639_1 = frozenset(
    """
aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce ch co cr cs cu cv cy da
de dv dz ee el en eo es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho hr ht hu hy hz ia
id ie ig ii ik io is it iu ja jv jw ka kg ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo
lt lu lv mg mh mi mk ml mn mr ms mt my na nb nd ne ng nl nn no nr nv ny oc oj om or os pa pi pl ps
pt qu rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr ss st su sv sw ta te tg th ti tk tl tn
to tr ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za zh zu
""".split()
)


class UsageError(InvalidRequestError):
    """A command-line value that cannot work, found before any model loads."""


def _error(message: str) -> None:
    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False)


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False)


# -- checks before the model loads ---------------------------------------------------------------


def check_language(language: str | None) -> None:
    if language is None:
        return
    code = language.strip().lower().replace("_", "-").split("-")[0]
    if not code.isalpha() or (len(code) == 2 and code not in _ISO_639_1) or len(code) < 2:
        raise UsageError(
            f"--language {language}: not a language code (use an ISO 639-1 code such as en, "
            f"de, zh, or omit it to detect the language)",
            param="--language",
        )


def check_device(device: str) -> None:
    """``--device``: cpu, cuda, cuda:N or mps, and present in this torch."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(
            f"--device {device}: not a device; use cpu, cuda, cuda:N or mps", param="--device"
        ) from None
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise UsageError(
                f"--device {device}: this torch ({torch.__version__}) is built without CUDA; "
                f"use --device cpu, or install a CUDA build of torch",
                param="--device",
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(
                f"--device {device}: no CUDA device is visible (check the driver and "
                f"CUDA_VISIBLE_DEVICES), or use --device cpu",
                param="--device",
            )
        if dev.index is not None and dev.index >= count:
            raise UsageError(
                f"--device {device}: there are {count} CUDA device(s) (cuda:0..cuda:{count - 1})",
                param="--device",
            )
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"--device {device}: MPS is not available here", param="--device")
    elif dev.type != "cpu":
        raise UsageError(
            f"--device {device}: not supported; use cpu, cuda, cuda:N or mps", param="--device"
        )


def check_dtype(dtype: str) -> str:
    """``--compute-type`` / ``--dtype`` -> the EngineConfig spelling of its float part.
    faster-whisper's names: ``default`` is auto; ``int8`` / ``int8_float32`` /
    ``int8_float16`` / ``int8_bfloat16`` are the float type around int8 linears (see
    :func:`check_compute`)."""
    from oasr.quantization import compute_type_method

    name = dtype.strip().lower()
    if name == "default":
        return "auto"
    if name.startswith("int16"):
        raise UsageError(
            f"--compute-type {dtype}: int16 is not supported; use auto, float32, float16, "
            f"bfloat16, int8, int8_float16 or int8_float32",
            param="--compute-type",
        )
    name, _method = compute_type_method(name)
    if name in ("auto", "default"):
        return "auto"
    from oasr.layers.dtypes import DTYPE_NAMES

    if name not in DTYPE_NAMES:
        raise UsageError(
            f"--compute-type {dtype}: use auto, float32, float16, bfloat16, int8, int8_float16, "
            f"int8_bfloat16 or int8_float32",
            param="--compute-type",
        )
    return name


def check_compute(compute_type: str, quantization: str | None) -> tuple[str, str | None]:
    """``(dtype, quantization method)`` from ``--compute-type`` and ``--quantization``: an int8
    compute type means ``int8_w8a8``; naming both a method and a compute type of another method
    is a usage error."""
    from oasr.errors import UnsupportedOptionError
    from oasr.quantization import check_method, compute_type_method

    dtype = check_dtype(compute_type)
    implied = compute_type_method(compute_type)[1]
    try:
        method = check_method(quantization)
    except UnsupportedOptionError as exc:
        raise UsageError(f"--quantization {quantization}: {exc.message}", param="--quantization") from None
    if method and implied and method != implied:
        raise UsageError(
            f"--compute-type {compute_type} means {implied}; it contradicts --quantization {quantization}",
            param="--quantization",
        )
    return dtype, method or implied


def check_input(f: Path) -> str | None:
    """Why ``f`` cannot be an input (missing, a directory, unreadable, empty), or None."""
    if not f.exists():
        return f"{f}: no such file"
    if f.is_dir():
        return f"{f}: is a directory, not an audio file"
    if not os.access(f, os.R_OK):
        return f"{f}: permission denied (cannot read it)"
    try:
        if f.stat().st_size == 0:
            return f"{f}: the file is empty (0 bytes)"
    except OSError as exc:
        return f"{f}: {exc.strerror or exc}"
    return None


def _named(f: Path, exc: BaseException) -> str:
    """An input's error, naming the input once."""
    message = exc.message if isinstance(exc, OASRError) else f"{type(exc).__name__}: {exc}"
    return message if str(f) in message or f.name in message else f"{f}: {message}"


def declared_seconds(path: Path) -> float | None:
    """The duration a file's header declares (WAV data chunk, FLAC/MP4/MP3-with-header stream
    duration), or None when the header does not say (FFmpeg then estimates it from the size)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16)
        if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            import struct

            pos, rate_bytes, data_size = 12, 0, None
            while pos + 8 <= len(head):
                tag, size = struct.unpack_from("<4sI", head, pos)
                if tag == b"fmt " and pos + 16 <= len(head):
                    rate_bytes = struct.unpack_from("<I", head, pos + 16)[0]
                elif tag == b"data":
                    data_size = size
                    break
                pos += 8 + size + (size & 1)
            if rate_bytes and data_size not in (None, 0, 0xFFFFFFFF):
                return data_size / rate_bytes
            return None
        if head[:4] == b"OggS" or head[:3] == b"ID3" or head[:2] in (b"\xff\xfb", b"\xff\xf3"):
            return None  # estimated from the size by FFmpeg (or, for MP3 with ID3, unknown)
        import av

        from oasr.audio import _open_container

        container = _open_container(av, str(path))
        try:
            stream = container.streams.audio[0] if container.streams.audio else None
            if stream is not None and stream.duration and stream.time_base:
                return float(stream.duration * stream.time_base)
        finally:
            container.close()
    except Exception:  # noqa: BLE001 - only a warning hangs on it
        return None
    return None


# -- the run -------------------------------------------------------------------------------------


@dataclass
class Run:
    """One ``oasr transcribe`` / ``translate`` command line, as parsed."""

    files: list[Path]
    task: str = "transcribe"
    model: str | None = None
    language: str | None = None
    fmt: str = "text"
    granularities: tuple[str, ...] = ("segment",)
    output: str | None = None
    output_dir: str | None = None
    beam_size: int = 1
    temperature: float = 0.0
    temperature_increment: float | None = None
    prompt: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    threads: int | None = None
    server: str | None = None
    api_key: str | None = None
    verbose: bool = False
    max_line_width: int | None = None
    max_words_per_line: int | None = None
    family: dict[str, object] = field(default_factory=dict)
    decode_processes: int | None = None

    @property
    def formats(self) -> tuple[str, ...]:
        return ALL_FORMATS if self.fmt == "all" else (self.fmt,)

    def temperatures(self) -> float | tuple[float, ...]:
        from oasr.types import FALLBACK_TEMPERATURES

        if self.temperature_increment is not None:
            if self.temperature_increment <= 0:
                return self.temperature
            out, t = [], self.temperature
            while t <= 1.0 + 1e-6:
                out.append(round(t, 6))
                t += self.temperature_increment
            return tuple(out)
        return self.temperature if self.temperature > 0 else FALLBACK_TEMPERATURES


def _check_task(run: Run) -> None:
    from oasr.defaults import english_only

    if run.task not in ("transcribe", "translate"):
        raise UsageError(f"--task {run.task}: use transcribe or translate", param="--task")
    check_language(run.language)
    if run.server:
        return
    english = english_only(run.model)
    shown = run.model or "the default model (tiny.en)"
    if english and run.task == "translate":
        raise UsageError(
            f"{shown} is English-only and cannot translate; use a multilingual model "
            f"(e.g. --model small)",
            param="--task",
        )
    if english and run.language and run.language.lower() not in ("en", "english"):
        raise UsageError(
            f"{shown} is English-only; --language {run.language} needs a multilingual model "
            f"(e.g. --model small)",
            param="--language",
        )


def run_command(run: Run) -> None:
    """Check everything, transcribe the good inputs, write each output; exit 1 if any input
    failed (every good input still gets its output)."""
    early: EarlyDecode | None = None
    startup_gc = StartupGC()
    try:
        try:
            _check_task(run)
            targets = plan_targets(run.files, run.output, run.output_dir, run.formats)
            if not run.server:
                early = EarlyDecode.start(run)  # before check_device imports torch
                startup_gc.pause()  # until the model is loaded
                check_device(run.device)
                run.dtype, run.quantization = check_compute(run.dtype, run.quantization)
                if run.kv_cache_dtype not in (None, "auto", "fp8"):
                    raise UsageError(f"--kv-cache-dtype {run.kv_cache_dtype}: use auto or fp8",
                                     param="--kv-cache-dtype")  # fmt: skip
            options = _decoding_options(run)
        except (OASRError, typer.BadParameter) as exc:
            _error(exc.message if isinstance(exc, OASRError) else str(exc))
            raise typer.Exit(2 if isinstance(exc, UsageError | OutputError) else 1) from None

        failed = 0
        good: list[int] = []
        for k, f in enumerate(run.files):
            problem = check_input(f)
            if problem:
                _error(problem)
                failed += 1
            else:
                good.append(k)
        results: dict[int, Any] = {}
        if good:
            if run.server:
                results = _transcribe_remote(run, good)
            else:
                results = _transcribe_local(run, good, options, early, startup_gc)
    finally:
        startup_gc.settle()
        if early is not None:
            early.close()
    failed += _write(run, targets, results)
    if failed:
        raise typer.Exit(1)


class StartupGC:
    """Python's cyclic garbage collector paused while torch is imported and the model loads,
    then what exists frozen (``gc.freeze``) and the collector on again. ``import torch`` makes
    ~250k objects that live as long as the process, and the collections its allocations set off
    walk them again and again: 0.4-0.5 s of CPU in a 2.5 s import here (2-core AVX2 EPYC); a
    pause alone only moves that work to the first full collection after it, so the survivors
    are frozen, which later collections skip. The imports' own cyclic garbage (~7k objects)
    stays: not worth a full collection (~0.3 s). ``OASR_STARTUP_GC_FREEZE=0`` leaves the
    collector alone."""

    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        if os.environ.get("OASR_STARTUP_GC_FREEZE") == "0" or not gc.isenabled():
            return
        gc.disable()
        self.paused = True

    def settle(self) -> None:
        """Freeze and collect again (once; a no-op when not paused)."""
        if self.paused:
            self.paused = False
            gc.freeze()
            gc.enable()


class EarlyDecode:
    """The inputs' audio decoding, started before torch is imported: worker processes decode the
    files (and read their headers' durations) while this process imports torch and loads the
    model, which on a 2-core machine took the decoding (about 0.6 s for the nine English
    files of benchmarks/cpubench.py, plus PyAV's import) off the serial start-up. Forked where
    that is safe (no torch, no thread yet: :func:`oasr.decode_pool.fork_is_safe`), so a worker
    starts with this process's imports; numpy is imported first (torch imports it anyway), so
    the workers have it too. The samples are the same as decoding here: the same
    :func:`oasr.audio.load_audio` at the same rate, then the engine's own length check."""

    #: the rate decoded to before the model is known (every model family here is 16 kHz; an
    #: engine of another rate decodes again, see :meth:`audios`)
    sample_rate = 16000

    def __init__(self, pool: Any, files: list[Path], max_seconds: float) -> None:
        self.pool = pool
        self.decoded = {f: pool.submit(f, self.sample_rate, max_seconds=max_seconds) for f in files}
        self.declared = {f: pool.call(declared_seconds, f) for f in files}

    @classmethod
    def start(cls, run: Run) -> EarlyDecode | None:
        """Start decoding ``run``'s readable inputs; None with ``--decode-processes 0``."""
        processes = run.decode_processes
        if processes is None:
            from oasr.decode_pool import default_decode_processes

            many = len(run.files) >= PARALLEL_DECODE_FILES
            processes = max(1, default_decode_processes() if many else 1)
        files = [f for f in run.files if check_input(f) is None]
        if processes < 1 or not files:
            return None
        import numpy  # noqa: F401 - before the fork: the workers then have it

        from oasr.decode_pool import AudioDecodePool, fork_is_safe
        from oasr.types import EngineConfig

        start_method = "fork" if fork_is_safe() else None
        pool = AudioDecodePool(min(processes, len(files)), start_method=start_method)
        return cls(pool, files, EngineConfig().max_audio_seconds)

    def audios(self, engine: Any, files: list[Path]) -> list[Any]:
        """``engine.load_audios(files)``: each input's samples (through the engine's length
        check) or its error, in order; decoded again here when the engine's rate differs."""
        if engine.sample_rate != self.sample_rate or any(f not in self.decoded for f in files):
            return engine.load_audios(files)
        out: list[Any] = []
        for f in files:
            try:
                out.append(engine.load_audio(self.decoded[f].result()))
            except Exception as exc:  # noqa: BLE001 - this input fails alone
                out.append(exc)
        return out

    def declared_seconds(self, f: Path) -> float | None:
        try:
            return self.declared[f].result() if f in self.declared else declared_seconds(f)
        except Exception:  # noqa: BLE001 - only a warning hangs on it (a dead worker)
            return declared_seconds(f)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _decoding_options(run: Run) -> Any:
    from oasr.types import DecodingOptions

    return DecodingOptions.build(
        beam_size=run.beam_size,
        language=run.language,
        task=run.task,
        temperature=run.temperatures(),
        prompt=run.prompt,
        word_timestamps="word" in run.granularities,
        **run.family,
    )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(max(0.0, seconds), 60)
    return f"{int(minutes):02d}:{secs:06.3f}"


def _print_verbose(f: Path, transcript: Any, many: bool) -> None:
    """``--verbose``: an input's segments on stderr as soon as it is transcribed."""
    if many:
        err_console.print(f"==> {escape(str(f))} <==", highlight=False)
    for s in transcript.segments:
        if s.text.strip():
            err_console.print(f"[{_clock(s.start)} --> {_clock(s.end)}] {escape(s.text.strip())}",
                              highlight=False)  # fmt: skip


def _vad_available() -> bool:
    from oasr.plugins import get_plugin_manager

    try:
        return any(True for _ in get_plugin_manager().registry("vad_detector"))
    except Exception:  # noqa: BLE001
        return False


def _transcribe_local(
    run: Run, good: list[int], options: Any, early: EarlyDecode | None = None,
    startup_gc: StartupGC | None = None,
) -> dict[int, Any]:  # fmt: skip
    """In-process: load the model once, decode and transcribe the good inputs (decoded by
    ``early`` where given: started before the model load; ``startup_gc`` settled once the
    model is loaded). Returns, per input index, its Transcript or its error."""
    from oasr.defaults import install_hint, resolve_model_name
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    results: dict[int, Any] = {}
    engine = None
    files = [run.files[k] for k in good]
    try:
        try:
            ckpt = resolve_model_name(run.model)
            decode_processes = run.decode_processes
            if early is not None:
                decode_processes = 0  # decoded by ``early`` already
            elif decode_processes is None:
                from oasr.decode_pool import default_decode_processes

                many = len(files) >= PARALLEL_DECODE_FILES
                decode_processes = default_decode_processes() if many else 0
            with err_console.status(
                f"loading model {escape(run.model or 'tiny.en')} ({escape(ckpt)})"
            ):
                engine = ASREngine(EngineConfig(ckpt_dir=ckpt, device=run.device, dtype=run.dtype,
                                                num_threads=run.threads, quantization=run.quantization,
                                                kv_cache_dtype=run.kv_cache_dtype,
                                                decode_processes=decode_processes))  # fmt: skip
            if startup_gc is not None:
                startup_gc.settle()  # the model and torch live as long as the process
            model = engine.model
            declared = getattr(model, "default_options", None)
            wants_gate = "vad_gate" not in run.family and hasattr(declared, "vad_gate")
            if wants_gate and not _vad_available():
                _warn(
                    "no voice activity detector is installed, so silence and noise may get "
                    f"invented text; install one with: {install_hint('oasr-vad-silero')} "
                    "(or pass --no-vad-gate to decode every input as it is)"
                )
                options = options.updated(vad_gate=False)
            options.validate_for(model)
        except OASRError as exc:
            _error(exc.message)
            raise typer.Exit(1) from None

        with err_console.status(f"decoding {len(files)} file(s)"):
            audios = early.audios(engine, files) if early is not None else engine.load_audios(files)
        arrays, order = [], []
        for k, f, audio in zip(good, files, audios, strict=True):
            if isinstance(audio, BaseException):
                results[k] = audio
                continue
            declared = early.declared_seconds(f) if early is not None else declared_seconds(f)
            got = audio.shape[-1] / engine.sample_rate
            if declared is not None and got < declared - TRUNCATION_TOLERANCE_S:
                _warn(f"{f}: decoded {got:.1f} s of the {declared:.1f} s its header declares "
                      f"(truncated or corrupt); transcribing what decoded")  # fmt: skip
            arrays.append(audio)
            order.append(k)
        if early is not None:
            early.close()  # decoded: the workers' memory back before the transcription
        if not arrays:
            return results
        total = sum(a.shape[-1] for a in arrays) / engine.sample_rate
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} s of audio"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err_console,
            transient=True,
            disable=not err_console.is_terminal,
        ) as bar:
            job = bar.add_task(f"{run.task} {len(arrays)} file(s)", total=total)
            try:
                outcomes: list[Any] = engine.transcribe_arrays(
                    arrays, options, lambda done, tot: bar.update(job, completed=done)
                )
            except Exception:  # noqa: BLE001 - an input failed in the model: find which
                outcomes = [o.error if o.error is not None else o.transcript
                            for o in engine.transcribe_outputs(arrays, decoding=options)]  # fmt: skip
        for k, outcome in zip(order, outcomes, strict=True):
            results[k] = outcome
            if run.verbose and not isinstance(outcome, BaseException):
                _print_verbose(run.files[k], outcome, len(run.files) > 1)
    finally:
        if engine is not None:
            engine.shutdown()  # the scheduler thread and any decode processes
    return results


def _transcribe_remote(run: Run, good: list[int]) -> dict[int, Any]:
    """Each good input through ``--server``: asked for ``verbose_json`` (with the granularities
    the output needs) and turned back into a Transcript, so the output equals the in-process
    one."""
    from oasr.cli.output import transcript_from_verbose_json
    from oasr.client import OASRClient

    client = OASRClient(run.server, api_key=run.api_key)  # type: ignore[arg-type]
    grains = list(run.granularities)
    if (run.max_line_width or run.max_words_per_line) and "word" not in grains:
        grains.append("word")
    options: dict[str, object] = dict(run.family)
    if run.beam_size != 1:
        options.setdefault("beam_size", run.beam_size)
    # the server reads 0 as greedy with fallback, as the CLI does; a custom fallback schedule
    # (--temperature-increment-on-fallback) travels as the family option of the same meaning
    temperature = run.temperature
    if run.temperature_increment is not None:
        raise_usage = UsageError(
            "--temperature-increment-on-fallback is not sent to a server; leave it out with "
            "--server", param="--temperature-increment-on-fallback",
        )  # fmt: skip
        _error(raise_usage.message)
        raise typer.Exit(2)
    results: dict[int, Any] = {}
    for k in good:
        f = run.files[k]
        try:
            if run.task == "translate":
                body = client.translate(f, model=run.model, prompt=run.prompt,
                                        response_format="verbose_json",
                                        temperature=temperature, options=options)  # fmt: skip
            else:
                body = client.transcribe(
                    f, model=run.model, language=run.language, prompt=run.prompt,
                    response_format="verbose_json", temperature=temperature,
                    timestamp_granularities=grains, options=options,
                )  # fmt: skip
            if not isinstance(body, dict):
                raise InvalidRequestError(f"the server answered {body[:80]!r}, not verbose_json")
            results[k] = transcript_from_verbose_json(body)
        except OASRError as exc:
            from oasr.client import ServerError

            if isinstance(exc, ServerError) and "cannot reach" in exc.message:
                _error(exc.message)
                raise typer.Exit(1) from None
            results[k] = exc
            continue
        if run.verbose:
            _print_verbose(f, results[k], len(run.files) > 1)
    return results


def _write(run: Run, targets: Any, results: dict[int, Any]) -> int:
    """Write every transcribed input (in input order); print each failed one's error. Returns
    the number of inputs that failed here."""
    failed = 0
    bodies: list[str | None] = []
    kept: list[Path] = []
    for k, f in enumerate(run.files):
        if k not in results:
            continue  # failed its checks (already reported)
        r = results[k]
        if isinstance(r, BaseException):
            _error(_named(f, r))
            failed += 1
            continue
        rendered = {
            fmt: render_one(r, fmt, run.granularities, run.max_line_width, run.max_words_per_line)
            for fmt in run.formats
        }
        if targets.stdout:
            kept.append(f)
            bodies.append(rendered[run.formats[0]])
            continue
        for path, fmt in zip(targets.paths(k, run.formats), run.formats, strict=True):
            try:
                path.write_text(rendered[fmt], encoding="utf-8")
            except OSError as exc:
                _error(f"cannot write {path}: {exc.strerror or exc}")
                failed += 1
                continue
            err_console.print(f"wrote {escape(str(path))}", highlight=False)
    if targets.stdout and kept:
        text = join_stdout(kept, bodies, run.formats[0], many=len(run.files) > 1)
        sys.stdout.write(text)
        sys.stdout.flush()
    return failed


# -- the commands --------------------------------------------------------------------------------

FilesArg = Annotated[list[Path], typer.Argument(help="Audio files (any common container).",
                                                metavar="FILE", show_default=False)]  # fmt: skip
ModelOpt = Annotated[
    Optional[str],  # noqa: UP045 - typer reads annotations at run time
    typer.Option("--model", "-m", "--ckpt-dir", metavar="NAME|PATH|HUB_ID",
                 help="Model: a short Whisper name (tiny.en, base, small, medium, large-v3, "
                 "turbo, ...), a checkpoint directory or a Hugging Face Hub id. Default: the "
                 "installed Whisper tiny.en."),
]  # fmt: skip
LangOpt = Annotated[Optional[str], typer.Option("--language", metavar="CODE",  # noqa: UP045
                    help="Spoken language code, e.g. en (default: detected).")]  # fmt: skip
FormatOpt = Annotated[
    Format,
    typer.Option("--response-format", "-f", "--output-format", metavar="FORMAT",
                 help="text (or txt), json, verbose_json, srt, vtt, tsv, or all (txt, vtt, srt, "
                 "tsv and json files; needs --output-dir)."),
]  # fmt: skip
GrainOpt = Annotated[
    Optional[list[Granularity]],  # noqa: UP045
    typer.Option("--timestamp-granularity", metavar="word|segment",
                 help="word and/or segment (repeatable)."),
]  # fmt: skip
WordTsOpt = Annotated[bool, typer.Option("--word-timestamps", help="Word times (same as "
                      "--timestamp-granularity word --timestamp-granularity segment).")]  # fmt: skip
OutOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--output", "-o", metavar="PATH",
                 help="A file, or a directory (ending in '/', or existing) for one file per "
                 "input; several inputs need a directory."),
]  # fmt: skip
OutDirOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--output-dir", metavar="DIR", help="Write one file per input (and format) "
                 "into DIR (created if missing)."),
]  # fmt: skip
BeamOpt = Annotated[int, typer.Option("--beam-size", min=1, help="1 = greedy.")]
PatienceOpt = Annotated[Optional[float], typer.Option("--patience", min=0.0,  # noqa: UP045
                        help="Whisper beam search patience.")]  # fmt: skip
TempOpt = Annotated[float, typer.Option("--temperature", min=0.0,
                    help="0 = greedy, falling back to higher temperatures when a window fails "
                    "the thresholds.")]  # fmt: skip
TempIncOpt = Annotated[
    Optional[float],  # noqa: UP045
    typer.Option("--temperature-increment-on-fallback", min=0.0,
                 help="Fallback temperatures from --temperature to 1 in these steps (0: none)."),
]  # fmt: skip
PromptOpt = Annotated[Optional[str], typer.Option("--prompt", "--initial-prompt",  # noqa: UP045
                      metavar="TEXT", help="Initial prompt text.")]  # fmt: skip
CondOpt = Annotated[
    Optional[bool],  # noqa: UP045
    typer.Option("--condition-on-previous-text/--no-condition-on-previous-text",
                 show_default=False,
                 help="Whisper, sequential long-form: prompt each window with the text before "
                 "it (on by default)."),
]  # fmt: skip
NoSpeechOpt = Annotated[Optional[str], typer.Option("--no-speech-threshold",  # noqa: UP045
                        metavar="P|none", help="Whisper: silence above this no-speech "
                        "probability (default 0.6).")]  # fmt: skip
LogprobOpt = Annotated[Optional[str], typer.Option("--logprob-threshold",  # noqa: UP045
                       metavar="X|none", help="Whisper: fall back below this average log "
                       "probability (default -1).")]  # fmt: skip
CompressOpt = Annotated[Optional[str], typer.Option("--compression-ratio-threshold",  # noqa: UP045
                        metavar="X|none", help="Whisper: fall back above this gzip compression "
                        "ratio (default 2.4).")]  # fmt: skip
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE",
                      help="cpu, cuda, cuda:N or mps.")]  # fmt: skip
DtypeOpt = Annotated[str, typer.Option("--compute-type", "--dtype", metavar="TYPE",
                     help="auto (float32 on CPU, float16 on CUDA), float32, float16, "
                     "bfloat16, or int8 / int8_float32 / int8_float16 / int8_bfloat16 (int8 "
                     "linears around that float type: --quantization int8_w8a8).")]  # fmt: skip
QuantOpt = Annotated[Optional[str], typer.Option("--quantization", metavar="int8_w8a8|fp8_w8a8",  # noqa: UP045
                     help="Quantize the model's linear layers on load: int8_w8a8 (CPU, CUDA) or "
                     "fp8_w8a8 (CUDA, compute capability >= 8.9). A checkpoint written by "
                     "`oasr quantize` needs no flag.")]  # fmt: skip
KVCacheOpt = Annotated[Optional[str], typer.Option("--kv-cache-dtype", metavar="auto|fp8",  # noqa: UP045
                       help="Autoregressive decoders (Whisper, Qwen2-Audio): keep the KV cache "
                       "in fp8 (e4m3, per-token scales).")]  # fmt: skip
ServerOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--server", metavar="URL",
                 help="Send the audio to this OASR server instead of running in-process."),
]  # fmt: skip
ApiKeyOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--api-key", envvar="OASR_API_KEY", metavar="KEY", help="Bearer token for --server."),
]  # fmt: skip
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", metavar="N",  # noqa: UP045
                       help="CPU threads for torch.")]  # fmt: skip
LongFormOpt = Annotated[
    Optional[LongForm],  # noqa: UP045
    typer.Option("--long-form", metavar="sequential|vad",
                 help="Whisper, audio over 30 s: sequential (window by window, conditioned on "
                 "previous text; the default) or vad (VAD speech chunks decoded as one batch)."),
]  # fmt: skip
VadFilterOpt = Annotated[bool, typer.Option("--vad-filter", help="Decode only the speech the "
                         "VAD finds (same as --long-form vad).")]  # fmt: skip
VadGateOpt = Annotated[
    Optional[bool],  # noqa: UP045
    typer.Option("--vad-gate/--no-vad-gate", show_default=False,
                 help="Whisper, sequential long-form: give an input in which the VAD finds no "
                 "speech an empty transcript instead of decoding it (on by default)."),
]  # fmt: skip
ModelOptionOpt = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Option("--option", "-O", metavar="NAME=VALUE",
                 help="A decoding option of the model family, e.g. -O no_speech_threshold=none "
                 "or -O decoding_method=ctc_prefix_beam_search (repeatable; docs/decoding.md "
                 "lists them)."),
]  # fmt: skip
DecodeProcsOpt = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option("--decode-processes", min=0, metavar="N",
                 help="Worker processes that decode the files, started before the model loads "
                 "so decoding overlaps it (0: one after another here, after the model loads). "
                 f"Default: 1 below {PARALLEL_DECODE_FILES} files, else half the cores up to 8 "
                 "(1 below 4 cores)."),
]  # fmt: skip
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Print each input's segments "
                       "with their times on stderr as soon as it is transcribed.")]  # fmt: skip
LineWidthOpt = Annotated[Optional[int], typer.Option("--max-line-width", min=1,  # noqa: UP045
                         metavar="N", help="srt/vtt: at most N characters per cue (cut at "
                         "word times; turns on word timestamps).")]  # fmt: skip
WordsPerLineOpt = Annotated[Optional[int], typer.Option("--max-words-per-line", min=1,  # noqa: UP045
                            metavar="N", help="srt/vtt: at most N words per cue (turns on word "
                            "timestamps).")]  # fmt: skip


def transcribe(
    files: FilesArg,
    model: ModelOpt = None,
    language: LangOpt = None,
    task: Annotated[
        str,
        typer.Option(
            "--task", metavar="transcribe|translate", help="transcribe or translate (into English)."
        ),
    ] = "transcribe",
    response_format: FormatOpt = Format.text,
    output: OutOpt = None,
    output_dir: OutDirOpt = None,
    timestamp_granularity: GrainOpt = None,
    word_timestamps: WordTsOpt = False,
    max_line_width: LineWidthOpt = None,
    max_words_per_line: WordsPerLineOpt = None,
    verbose: VerboseOpt = False,
    beam_size: BeamOpt = 1,
    patience: PatienceOpt = None,
    temperature: TempOpt = 0.0,
    temperature_increment_on_fallback: TempIncOpt = None,
    prompt: PromptOpt = None,
    condition_on_previous_text: CondOpt = None,
    no_speech_threshold: NoSpeechOpt = None,
    logprob_threshold: LogprobOpt = None,
    compression_ratio_threshold: CompressOpt = None,
    long_form: LongFormOpt = None,
    vad_filter: VadFilterOpt = False,
    vad_gate: VadGateOpt = None,
    option: ModelOptionOpt = None,
    device: DeviceOpt = "cpu",
    compute_type: DtypeOpt = "auto",
    quantization: QuantOpt = None,
    kv_cache_dtype: KVCacheOpt = None,
    threads: ThreadsOpt = None,
    decode_processes: DecodeProcsOpt = None,
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Transcribe audio files (in-process, or on a server with --server)."""
    from oasr.options import parse_assignments

    grains = [g.value for g in (timestamp_granularity or [])] or ["segment"]
    if word_timestamps or max_line_width or max_words_per_line:
        grains = list(dict.fromkeys([*grains, "word", "segment"]))
    fmt = "text" if response_format is Format.txt else response_format.value
    try:
        if vad_filter and long_form is LongForm.sequential:
            raise UsageError("--vad-filter is --long-form vad; drop --long-form sequential")
        # options of the model family, sent only when given (other families refuse them)
        family: dict[str, object] = {}
        if long_form is not None or vad_filter:
            family["long_form"] = "vad" if vad_filter else long_form.value  # type: ignore[union-attr]
        if vad_gate is not None:
            family["vad_gate"] = vad_gate
        if condition_on_previous_text is not None:
            family["condition_on_previous_text"] = condition_on_previous_text
        if patience is not None:
            family["patience"] = patience
        for name, value in (("no_speech_threshold", no_speech_threshold),
                            ("logprob_threshold", logprob_threshold),
                            ("compression_ratio_threshold", compression_ratio_threshold)):  # fmt: skip
            if value is not None:
                family[name] = value
        family.update(parse_assignments(option or (), param="--option"))
    except OASRError as exc:
        _error(exc.message)
        raise typer.Exit(2 if isinstance(exc, UsageError) else 1) from None
    run_command(Run(
        files=list(files), task=task, model=model, language=language, fmt=fmt,
        granularities=tuple(grains), output=output, output_dir=output_dir, beam_size=beam_size,
        temperature=temperature, temperature_increment=temperature_increment_on_fallback,
        prompt=prompt, device=device, dtype=compute_type, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype, threads=threads, server=server,
        api_key=api_key, verbose=verbose, max_line_width=max_line_width,
        max_words_per_line=max_words_per_line, family=family, decode_processes=decode_processes,
    ))  # fmt: skip


def _translate_command() -> Any:
    """``oasr translate``: ``transcribe`` with ``--task translate`` fixed."""
    import typing

    hints = typing.get_type_hints(transcribe, include_extras=True)
    sig = inspect.signature(transcribe)
    sig = sig.replace(parameters=[p.replace(annotation=hints[p.name])
                                  for p in sig.parameters.values()])  # fmt: skip

    def translate(**kwargs: Any) -> None:
        transcribe(task="translate", **kwargs)

    translate.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[p for name, p in sig.parameters.items() if name != "task"]
    )
    translate.__annotations__ = {k: v for k, v in transcribe.__annotations__.items() if k != "task"}
    translate.__doc__ = "Translate speech in audio files into English text."
    return translate


def register(app: typer.Typer) -> None:
    app.command("transcribe")(transcribe)
    app.command("translate")(_translate_command())

    from oasr.cli.convert import convert  # the same function as the ``oasr-convert`` command

    app.command("convert")(convert)

    from oasr.cli.quantize import quantize  # torch-free until it runs

    app.command("quantize")(quantize)
