"""``chunking_strategy`` on ``/v1/audio/transcriptions``: VAD segments of real speech, one engine
call over all segments, timestamps on the original time line, silence -> empty text."""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path

import numpy as np
import pytest

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"


def _wav(x: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _two_utterances() -> np.ndarray:
    from oasr.audio import load_audio

    a = load_audio(str(SPEECH / "en_ls_2830-3980-0043.wav"), 16000)
    b = load_audio(str(SPEECH / "en_ls_4507-16021-0012.wav"), 16000)
    z = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    return np.concatenate([z(1.0), a, z(2.0), b, z(1.0)])


def test_chunking_maps_timestamps_and_batches(kit, app_factory) -> None:
    from oasr.vad import SegmentationOptions, default_detector, get_speech_segments

    app, model = app_factory()
    audio = _two_utterances()
    wav = _wav(audio)
    segs = get_speech_segments(
        audio,
        16000,
        default_detector(),
        SegmentationOptions(threshold=0.5, min_silence_ms=200, speech_pad_ms=300, max_speech_s=30),
    )
    assert len(segs) == 2

    async def go():
        async with kit.serving(app) as c:
            fields = {
                "chunking_strategy": "auto",
                "response_format": "verbose_json",
                "timestamp_granularities[]": ["word", "segment"],
            }
            auto = await kit.post_audio(c, audio=wav, fields=fields)
            calls = list(model.batches)
            as_json = await kit.post_audio(
                c,
                audio=wav,
                fields={
                    "chunking_strategy": json.dumps(
                        {
                            "type": "server_vad",
                            "threshold": 0.5,
                            "prefix_padding_ms": 100,
                            "silence_duration_ms": 500,
                        }
                    )
                },
            )
            bracketed = await kit.post_audio(
                c,
                audio=wav,
                fields={
                    "chunking_strategy[type]": "server_vad",
                    "chunking_strategy[prefix_padding_ms]": "0",
                },
            )
            plain = await kit.post_audio(c, audio=wav)
            return auto, calls, as_json, bracketed, plain

    auto, calls, as_json, bracketed, plain = kit.run(go())
    assert auto.status_code == 200, auto.text
    body = auto.json()
    assert calls[-1] == 2  # both segments in one engine call
    d0, d1 = (s.duration_s for s in segs)
    assert body["text"] == f"hello world {d0:.2f} hello world {d1:.2f}"
    assert body["duration"] == pytest.approx(len(audio) / 16000, abs=1e-3)
    # the in-test model puts its two segments at [0, d/2] and [d/2, d] of each input
    starts = [round(s["start"], 3) for s in body["segments"]]
    ends = [round(s["end"], 3) for s in body["segments"]]
    assert starts == pytest.approx(
        [segs[0].start_s, segs[0].start_s + d0 / 2, segs[1].start_s, segs[1].start_s + d1 / 2],
        abs=2e-3,
    )
    assert ends == pytest.approx(
        [segs[0].start_s + d0 / 2, segs[0].end_s, segs[1].start_s + d1 / 2, segs[1].end_s],
        abs=2e-3,
    )
    assert [s["id"] for s in body["segments"]] == [0, 1, 2, 3]
    assert body["words"][0]["start"] == pytest.approx(segs[0].start_s, abs=2e-3)
    assert body["words"][-1]["end"] == pytest.approx(segs[1].end_s, abs=2e-3)
    assert 0.5 <= segs[0].start_s <= 1.3 and 3.5 <= segs[1].start_s <= 5.3
    for r in (as_json, bracketed):
        assert r.status_code == 200, r.text
        texts = r.json()["text"].split(" hello world ")
        assert len(texts) == 2 and texts[0].startswith("hello world ")
    # less padding, shorter pieces
    pad0 = [float(x) for x in bracketed.json()["text"].replace("hello world ", "").split()]
    assert pad0[0] < d0 and pad0[1] < d1
    assert plain.json()["text"] == f"hello world {len(audio) / 16000:.2f}"


def test_chunking_silence_and_invalid_values(kit, app_factory) -> None:
    app, model = app_factory()
    silence = _wav(np.zeros(3 * 16000, np.float32))

    async def go():
        async with kit.serving(app) as c:
            empty = await kit.post_audio(c, audio=silence, fields={"chunking_strategy": "auto"})
            verbose = await kit.post_audio(
                c,
                audio=silence,
                fields={"chunking_strategy": "auto", "response_format": "verbose_json"},
            )
            calls = len(model.batches)
            bad = []
            for fields in (
                {"chunking_strategy": "sometimes"},
                {"chunking_strategy": "{not json"},
                {"chunking_strategy": '"auto"'},
                {"chunking_strategy": json.dumps({"type": "semantic"})},
                {"chunking_strategy": json.dumps({"type": "server_vad", "threshold": 1.5})},
                {"chunking_strategy": json.dumps({"type": "server_vad", "threshold": "x"})},
                {
                    "chunking_strategy": json.dumps(
                        {"type": "server_vad", "silence_duration_ms": -1}
                    )
                },
                {"chunking_strategy": json.dumps({"type": "server_vad", "extra": 1})},
                {"chunking_strategy[type]": "nope"},
                {"chunking_strategy": "auto", "chunking_strategy[type]": "server_vad"},
            ):
                bad.append(await kit.post_audio(c, audio=silence, fields=fields))
            return empty, verbose, calls, bad

    empty, verbose, calls, bad = kit.run(go())
    assert empty.status_code == 200 and empty.json()["text"] == ""
    v = verbose.json()
    assert v["text"] == "" and v["segments"] == [] and v["duration"] == pytest.approx(3.0)
    assert calls == 1  # only the warm-up: silence never reached the engine
    for r in bad:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chunking_strategy"
        assert r.json()["error"]["code"] == "invalid_request"


def test_chunking_without_a_vad_plugin(kit, app_factory, monkeypatch) -> None:
    import oasr.vad
    from oasr.errors import MissingPluginError

    def missing():
        raise MissingPluginError("vad_detector", "silero", "oasr-vad-silero")

    monkeypatch.setattr(oasr.vad, "default_detector", missing)
    app, model = app_factory()

    async def go():
        async with kit.serving(app) as c:
            return await kit.post_audio(c, fields={"chunking_strategy": "auto"})

    r = kit.run(go())
    assert r.status_code == 400 and r.json()["error"]["code"] == "vad_unavailable"
    assert "pip install oasr-vad-silero" in r.json()["error"]["message"]
