"""Core contracts: option validation, capability checks, response formats, checkpoint resolution."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from oasr.checkpoint import detect_format, resolve_checkpoint_dir
from oasr.errors import (
    InvalidRequestError,
    OASRError,
    UnknownModelError,
    UnsupportedOptionError,
)
from oasr.formats import render, to_srt, to_vtt
from oasr.types import (
    DecodeFamily,
    DecodingOptions,
    EngineConfig,
    ModelCapabilities,
    Segment,
    Transcript,
    Word,
)

CTC_STREAMING = ModelCapabilities(decode_family=DecodeFamily.CTC, streaming=True)
WHISPER_EN = ModelCapabilities(decode_family=DecodeFamily.AED, word_timestamps=True)


def test_decoding_options_validate() -> None:
    with pytest.raises(InvalidRequestError, match="beam_size"):
        DecodingOptions(beam_size=0)
    with pytest.raises(InvalidRequestError, match="task"):
        DecodingOptions(task="summarize")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="temperature"):
        DecodingOptions(temperature=(0.0, -0.2))
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        DecodingOptions(max_new_tokens=0)
    assert DecodingOptions(temperature=0.4).temperatures == (0.4,)
    assert DecodingOptions(temperature=(0.0, 0.5)).temperatures == (0.0, 0.5)


def test_unsupported_options_are_refused_per_family() -> None:
    with pytest.raises(UnsupportedOptionError) as info:
        DecodingOptions(word_timestamps=True).check_supported(CTC_STREAMING, "toy ctc")
    assert info.value.param == "timestamp_granularities" and info.value.http_status == 400
    with pytest.raises(UnsupportedOptionError, match="cannot translate"):
        DecodingOptions(task="translate").check_supported(WHISPER_EN, "whisper tiny.en")
    DecodingOptions(word_timestamps=True).check_supported(WHISPER_EN, "whisper tiny.en")
    # hotwords: refused by a family that cannot bias, accepted by one that declares it can
    with pytest.raises(UnsupportedOptionError, match="hotwords") as info:
        DecodingOptions(hotwords=("OASR",)).check_supported(CTC_STREAMING, "toy ctc")
    assert info.value.param == "hotwords"
    biasing = ModelCapabilities(decode_family=DecodeFamily.CIF, hotwords=True)
    DecodingOptions(hotwords=("OASR",)).check_supported(biasing, "toy paraformer")


def test_engine_config_validates() -> None:
    with pytest.raises(InvalidRequestError, match="service_mode"):
        EngineConfig(service_mode="batch")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedOptionError, match="quantization"):
        EngineConfig(quantization="int4")


def test_every_error_is_typed_with_a_status() -> None:
    import oasr.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, OASRError)]
    assert len(classes) >= 10
    for cls in classes:
        assert 400 <= cls.http_status < 600 and cls.code and cls.error_type


def _transcript() -> Transcript:
    return Transcript(
        text=" Hello world. How are you?",
        language="en",
        duration=4.2,
        segments=[
            Segment(0, 0.0, 1.5, " Hello world.", tokens=[1, 2], words=[
                Word(" Hello", 0.0, 0.6, 0.9), Word(" world.", 0.6, 1.5, 0.8)]),
            Segment(1, 1.5, 3661.25, " How are you?", tokens=[3]),
        ],
    )


def test_srt_parses_back() -> None:
    srt = to_srt(_transcript())
    blocks = [b for b in srt.strip().split("\n\n")]
    assert len(blocks) == 2
    pattern = re.compile(r"^(\d+)\n(\d\d):(\d\d):(\d\d),(\d{3}) --> (\d\d):(\d\d):(\d\d),(\d{3})\n(.+)$")
    parsed = []
    for block in blocks:
        m = pattern.match(block)
        assert m, block
        start = int(m[2]) * 3600 + int(m[3]) * 60 + int(m[4]) + int(m[5]) / 1000
        end = int(m[6]) * 3600 + int(m[7]) * 60 + int(m[8]) + int(m[9]) / 1000
        parsed.append((int(m[1]), start, end, m[10]))
    assert parsed == [(1, 0.0, 1.5, "Hello world."), (2, 1.5, 3661.25, "How are you?")]


def test_vtt_parses_back() -> None:
    vtt = to_vtt(_transcript())
    assert vtt.startswith("WEBVTT\n\n")
    cues = re.findall(r"(\d\d:\d\d:\d\d\.\d{3}) --> (\d\d:\d\d:\d\d\.\d{3})\n(.+)\n", vtt)
    assert cues == [
        ("00:00:00.000", "00:00:01.500", "Hello world."),
        ("00:00:01.500", "01:01:01.250", "How are you?"),
    ]


def test_json_and_verbose_json_match_openai_shapes() -> None:
    t = _transcript()
    assert json.loads(render(t, "json")) == {"text": t.text}
    body = json.loads(render(t, "verbose_json", granularities=("word", "segment")))
    assert set(body) == {"task", "language", "duration", "text", "segments", "words"}
    assert set(body["segments"][0]) == {
        "id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
        "compression_ratio", "no_speech_prob",
    }
    assert body["words"][1] == {"word": " world.", "start": 0.6, "end": 1.5, "probability": 0.8}
    assert "words" not in json.loads(render(t, "verbose_json"))
    assert render(t, "text") == "Hello world. How are you?\n"
    with pytest.raises(InvalidRequestError, match="response_format"):
        render(t, "docx")


def test_hub_id_resolves_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub id is resolved by huggingface_hub itself, here offline from a cache layout."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-asr"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert resolve_checkpoint_dir("acme/tiny-asr") == snapshot
    with pytest.raises(UnknownModelError, match="huggingface-cli download acme/missing"):
        resolve_checkpoint_dir("acme/missing")


def test_unknown_paths_and_formats_are_clear(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="neither an existing local path"):
        resolve_checkpoint_dir("./no/such/dir/")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(UnknownModelError, match="no installed plugin recognises"):
        detect_format(tmp_path)
