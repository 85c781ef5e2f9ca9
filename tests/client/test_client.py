"""``OASRClient`` and ``oasr transcribe --server`` against a real, default ``oasr-server``
(issue #14, item 1): the client's default ``model`` is accepted, and every output format
through ``--server`` is byte-for-byte the in-process output, one input or several."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oasr.client import OASRClient
from oasr.errors import OASRError

from .conftest import SPEECH  # noqa: TID252

JFK = SPEECH / "en_jfk_inaugural.flac"
LS = SPEECH / "en_ls_1995-1837-0001.wav"
#: 2 s ("experience proves this"), for the checks about plumbing rather than the words
SHORT = SPEECH / "en_ls_2830-3980-0043.wav"


def _oasr(*args: str | Path):  # noqa: ANN202
    from oasr.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _same_report(remote: str, local: str) -> bool:
    """JSON lines equal except floats, which may differ by 0.02 (the decoder's float reports
    move in the last digits with the batch an input shares; rounding both sides instead fails
    whenever a value sits on a rounding boundary)."""

    def same(a, b) -> bool:  # noqa: ANN001
        if isinstance(a, float) or isinstance(b, float):
            return (
                isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 0.02
            )
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    rows = (
        [json.loads(line) for line in remote.splitlines()],
        [json.loads(line) for line in local.splitlines()],
    )
    return same(*rows)


def test_client_default_model_is_the_served_one(server_url: str) -> None:
    client = OASRClient(server_url)
    body = client.transcribe(JFK)
    assert "ask not what your country can do for you" in body["text"].lower()
    assert client.transcribe(SHORT, model="whisper-1", response_format="text").strip()
    assert [m["id"] for m in client.models()] == ["oasr"]
    with pytest.raises(OASRError, match="not served here"):
        client.transcribe(JFK, model="no-such-model")


@pytest.mark.usefixtures("local_cli_shares_the_model")
def test_server_outputs_equal_local(server_url: str, tmp_path: Path) -> None:
    # every format, as files: --output-format all into a directory
    for where, extra in (("remote", ["--server", server_url]), ("local", [])):
        r = _oasr("transcribe", JFK, LS, "-f", "all", "--output-dir", tmp_path / where, *extra)
        assert r.exit_code == 0, r.stderr
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "remote").iterdir())
    assert len(names) == 10  # 2 inputs x txt, vtt, srt, tsv, json
    for name in names:
        remote, local = ((tmp_path / w / name).read_text() for w in ("remote", "local"))
        if name.endswith(".json"):  # the decoder's float reports differ in the last digits
            # with the batch an input shares (two inputs here, one at a time on the server)
            assert _same_report(remote, local), (name, remote, local)
        else:
            assert remote == local, name
    # several inputs on stdout: each SRT numbered from 1 after its file's name; JSON lines
    remote = _oasr("transcribe", JFK, LS, "-f", "srt", "--server", server_url)
    local = _oasr("transcribe", JFK, LS, "-f", "srt")
    assert remote.stdout == local.stdout
    assert remote.stdout.count("==> ") == 2 and remote.stdout.count("\n1\n") == 2
    remote = _oasr("transcribe", SHORT, "-f", "json", "--server", server_url)
    assert json.loads(remote.stdout)["file"] == str(SHORT)


def test_server_output_dir_and_errors_name_the_file(server_url: str, tmp_path: Path) -> None:
    bad = tmp_path / "noise.wav"
    bad.write_bytes(b"RIFF" + b"\0" * 636)  # 640 bytes that are no audio
    out = tmp_path / "out"
    r = _oasr("transcribe", JFK, bad, LS, "-f", "srt", "-o", f"{out}/", "--server", server_url)
    assert r.exit_code == 1
    assert sorted(p.name for p in out.iterdir()) == [
        "en_jfk_inaugural.srt",
        "en_ls_1995-1837-0001.srt",
    ]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "Traceback" not in r.stderr
