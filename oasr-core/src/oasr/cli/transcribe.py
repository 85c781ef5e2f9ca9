"""``oasr transcribe``, ``oasr translate`` and ``oasr convert``. Torch is imported only when a
command runs."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from oasr.errors import OASRError

err_console = Console(stderr=True)
#: From this many files on, ``--decode-processes`` defaults to a pool: below, starting the
#: worker processes costs more than decoding the files one after another.
PARALLEL_DECODE_FILES = 8


class Format(str, Enum):
    text = "text"
    json = "json"
    verbose_json = "verbose_json"
    srt = "srt"
    vtt = "vtt"


class LongForm(str, Enum):
    sequential = "sequential"
    vad = "vad"


class Granularity(str, Enum):
    word = "word"
    segment = "segment"


def _run(
    files: list[Path],
    *,
    task: str,
    ckpt_dir: str | None,
    language: str | None,
    response_format: Format,
    granularities: list[Granularity] | None,
    output: Path | None,
    beam_size: int,
    temperature: float,
    prompt: str | None,
    device: str,
    threads: int | None,
    server: str | None = None,
    api_key: str | None = None,
    long_form: str | None = None,
    vad_gate: bool | None = None,
    model_options: list[str] | None = None,
    decode_processes: int | None = None,
) -> None:
    from oasr.options import parse_assignments

    try:
        # options of the model family; --long-form / --vad-gate are Whisper's, sent only when
        # given so that other families do not refuse them
        family: dict[str, object] = {}
        if long_form is not None:
            family["long_form"] = long_form
        if vad_gate is not None:
            family["vad_gate"] = vad_gate
        family.update(parse_assignments(model_options or (), param="--option"))
    except OASRError as exc:
        err_console.print(f"[red]error:[/red] {exc.message}", highlight=False)
        raise typer.Exit(1) from None
    if server:
        if beam_size != 1:
            family.setdefault("beam_size", beam_size)
        _run_remote(files, task=task, server=server, api_key=api_key, language=language,
                    response_format=response_format, granularities=granularities,
                    output=output, temperature=temperature, prompt=prompt, options=family)
        return
    from oasr.defaults import default_checkpoint
    from oasr.engine import ASREngine
    from oasr.formats import FILE_EXTENSIONS, render
    from oasr.types import FALLBACK_TEMPERATURES, DecodingOptions, EngineConfig

    grains = tuple(g.value for g in (granularities or [Granularity.segment]))
    fmt = response_format.value
    engine = None
    try:
        for f in files:
            if not f.is_file():
                raise typer.BadParameter(f"no such file: {f}", param_hint="FILE")
        options = DecodingOptions.build(
            beam_size=beam_size,
            language=language,
            task=task,
            temperature=temperature if temperature > 0 else FALLBACK_TEMPERATURES,
            prompt=prompt,
            word_timestamps="word" in grains,
            **family,
        )
        ckpt = ckpt_dir or str(default_checkpoint())
        if decode_processes is None:
            from oasr.decode_pool import default_decode_processes

            many = len(files) >= PARALLEL_DECODE_FILES
            decode_processes = default_decode_processes() if many else 0
        with err_console.status(f"loading model from {ckpt}"):
            engine = ASREngine(EngineConfig(ckpt_dir=ckpt, device=device, num_threads=threads,
                                            decode_processes=decode_processes))  # fmt: skip
        with err_console.status(f"decoding {len(files)} file(s)"):
            audios = engine.load_audios(files)
        for audio in audios:
            if isinstance(audio, BaseException):
                raise audio
        total = sum(a.shape[-1] for a in audios) / engine.sample_rate
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
            job = bar.add_task(f"{task} {len(files)} file(s)", total=total)
            transcripts = engine.transcribe_arrays(
                audios, options, lambda done, tot: bar.update(job, completed=done)
            )
    except OASRError as exc:
        err_console.print(f"[red]error:[/red] {exc.message}", highlight=False)
        raise typer.Exit(1) from None
    finally:
        if engine is not None:
            engine.shutdown()  # the scheduler thread and any decode processes

    if output is not None and (len(files) > 1 or output.is_dir()):
        output.mkdir(parents=True, exist_ok=True)
        for f, t in zip(files, transcripts, strict=True):
            target = output / f"{f.stem}.{FILE_EXTENSIONS[fmt]}"
            target.write_text(render(t, fmt, granularities=grains), encoding="utf-8")
            err_console.print(f"wrote {target}")
        return
    if len(files) > 1 and fmt in ("json", "verbose_json"):
        # JSON lines: one object per input, each naming its file.
        lines = []
        for f, t in zip(files, transcripts, strict=True):
            body = json.loads(render(t, fmt, granularities=grains))
            lines.append(json.dumps({"file": str(f), **body}, ensure_ascii=False))
        text = "\n".join(lines) + "\n"
    else:
        parts = []
        for f, t in zip(files, transcripts, strict=True):
            body = render(t, fmt, granularities=grains)
            if len(files) > 1:
                body = f"==> {f} <==\n{body}"
            parts.append(body if body.endswith("\n") else body + "\n")
        text = "".join(parts)
    if output is not None:
        output.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


def _run_remote(
    files: list[Path],
    *,
    task: str,
    server: str,
    api_key: str | None,
    language: str | None,
    response_format: Format,
    granularities: list[Granularity] | None,
    output: Path | None,
    temperature: float,
    prompt: str | None,
    options: dict[str, object] | None = None,
) -> None:
    """Send each file to an OASR (or OpenAI-compatible) server instead of running in-process;
    ``options`` (beam size, family options) travel as extra form fields."""
    from oasr.client import OASRClient

    client = OASRClient(server, api_key=api_key)
    fmt = response_format.value
    grains = [g.value for g in granularities] if granularities else None
    outputs: list[str] = []
    try:
        for f in files:
            if task == "translate":
                body = client.translate(f, prompt=prompt, response_format=fmt, temperature=temperature,
                                        options=options)
            else:
                body = client.transcribe(
                    f, language=language, prompt=prompt, response_format=fmt,
                    temperature=temperature, timestamp_granularities=grains, options=options,
                )
            if isinstance(body, dict):
                body = json.dumps({"file": str(f), **body} if len(files) > 1 else body, ensure_ascii=False)
            outputs.append(body if body.endswith("\n") else body + "\n")
    except OASRError as exc:
        err_console.print(f"[red]error:[/red] {exc.message}", highlight=False)
        raise typer.Exit(1) from None
    text = "".join(outputs)
    if output is not None:
        output.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


FilesArg = Annotated[list[Path], typer.Argument(help="Audio files (any common container).")]
CkptOpt = Annotated[
    Optional[str],  # noqa: UP045 - typer reads annotations at run time
    typer.Option("--ckpt-dir", help="Checkpoint directory or Hugging Face Hub id. Default: the bundled Whisper tiny.en."),
]
LangOpt = Annotated[Optional[str], typer.Option("--language", help="Spoken language code, e.g. en.")]  # noqa: UP045
FormatOpt = Annotated[Format, typer.Option("--response-format", "-f", help="Output format.")]
GrainOpt = Annotated[
    Optional[list[Granularity]],  # noqa: UP045
    typer.Option("--timestamp-granularity", help="word and/or segment (repeatable)."),
]
OutOpt = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--output", "-o", help="Output file, or a directory for one output per input."),
]
BeamOpt = Annotated[int, typer.Option("--beam-size", min=1, help="1 = greedy.")]
TempOpt = Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy with fallback.")]
PromptOpt = Annotated[Optional[str], typer.Option("--prompt", help="Initial prompt text.")]  # noqa: UP045
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
ServerOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--server", help="Send the audio to this OASR server URL instead of running in-process."),
]
ApiKeyOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--api-key", envvar="OASR_API_KEY", help="Bearer token for --server."),
]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads for torch.")]  # noqa: UP045
LongFormOpt = Annotated[
    Optional[LongForm],  # noqa: UP045
    typer.Option("--long-form", help="Whisper, audio over 30 s: sequential (window by window, "
                 "conditioned on previous text; the default) or vad (VAD speech chunks decoded as "
                 "one batch)."),
]
VadGateOpt = Annotated[
    Optional[bool],  # noqa: UP045
    typer.Option("--vad-gate/--no-vad-gate", help="Whisper, sequential long-form: give an input "
                 "in which the VAD finds no speech an empty transcript instead of decoding it "
                 "(on by default)."),
]
ModelOptionOpt = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Option("--option", "-O", metavar="NAME=VALUE",
                 help="A decoding option of the model family, e.g. -O no_speech_threshold=none "
                 "or -O decoding_method=ctc_prefix_beam_search (repeatable; docs/decoding.md "
                 "lists them)."),
]
DecodeProcsOpt = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option("--decode-processes", min=0, help="Worker processes that decode the files "
                 f"in parallel (0: one after another here). Default: 0 below {PARALLEL_DECODE_FILES} "
                 "files, else half the cores up to 8 (none below 4 cores)."),
]


def register(app: typer.Typer) -> None:
    @app.command("transcribe")
    def transcribe(
        files: FilesArg,
        ckpt_dir: CkptOpt = None,
        language: LangOpt = None,
        task: Annotated[str, typer.Option("--task", help="transcribe or translate.")] = "transcribe",
        response_format: FormatOpt = Format.text,
        timestamp_granularity: GrainOpt = None,
        output: OutOpt = None,
        beam_size: BeamOpt = 1,
        temperature: TempOpt = 0.0,
        prompt: PromptOpt = None,
        device: DeviceOpt = "cpu",
        threads: ThreadsOpt = None,
        server: ServerOpt = None,
        api_key: ApiKeyOpt = None,
        long_form: LongFormOpt = None,
        vad_gate: VadGateOpt = None,
        option: ModelOptionOpt = None,
        decode_processes: DecodeProcsOpt = None,
    ) -> None:
        """Transcribe audio files (in-process, or on a server with --server)."""
        if task not in ("transcribe", "translate"):
            raise typer.BadParameter("must be 'transcribe' or 'translate'", param_hint="--task")
        _run(files, task=task, ckpt_dir=ckpt_dir, language=language,
             response_format=response_format, granularities=timestamp_granularity,
             output=output, beam_size=beam_size, temperature=temperature, prompt=prompt,
             device=device, threads=threads, server=server, api_key=api_key,
             long_form=long_form.value if long_form else None, vad_gate=vad_gate,
             model_options=option, decode_processes=decode_processes)

    @app.command("translate")
    def translate(
        files: FilesArg,
        ckpt_dir: CkptOpt = None,
        language: LangOpt = None,
        response_format: FormatOpt = Format.text,
        timestamp_granularity: GrainOpt = None,
        output: OutOpt = None,
        beam_size: BeamOpt = 1,
        temperature: TempOpt = 0.0,
        prompt: PromptOpt = None,
        device: DeviceOpt = "cpu",
        threads: ThreadsOpt = None,
        server: ServerOpt = None,
        api_key: ApiKeyOpt = None,
        long_form: LongFormOpt = None,
        vad_gate: VadGateOpt = None,
        option: ModelOptionOpt = None,
        decode_processes: DecodeProcsOpt = None,
    ) -> None:
        """Translate speech in audio files into English text."""
        _run(files, task="translate", ckpt_dir=ckpt_dir, language=language,
             response_format=response_format, granularities=timestamp_granularity,
             output=output, beam_size=beam_size, temperature=temperature, prompt=prompt,
             device=device, threads=threads, server=server, api_key=api_key,
             long_form=long_form.value if long_form else None, vad_gate=vad_gate,
             model_options=option, decode_processes=decode_processes)

    from oasr.cli.convert import convert  # the same function as the ``oasr-convert`` command

    app.command("convert")(convert)
