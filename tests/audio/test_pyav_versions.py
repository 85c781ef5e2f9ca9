"""Container decoding on the PyAV releases we support: PyAV 19 (what pip serves Python 3.12)
dropped ``av.open(..., metadata_errors=...)``, which PyAV 18 and older take."""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")

from _audio_helpers import SPEECH  # noqa: E402

from oasr import audio as oasr_audio  # noqa: E402


def test_decodes_where_av_open_refuses_metadata_errors(monkeypatch):
    real_open = av.open
    calls = []

    def open_like_pyav19(source, mode="r", **kw):  # noqa: ANN001, ANN202
        calls.append(sorted(kw))
        if "metadata_errors" in kw:
            raise TypeError("open() got an unexpected keyword argument 'metadata_errors'")
        return real_open(source, mode=mode, **kw)

    expected = oasr_audio.load_audio(SPEECH / "en_jfk_inaugural.flac", 16000)
    monkeypatch.setattr(av, "open", open_like_pyav19)
    monkeypatch.setattr(oasr_audio, "_AV_METADATA_ERRORS", [True])
    got = oasr_audio.load_audio(SPEECH / "en_jfk_inaugural.flac", 16000)
    again = oasr_audio.load_audio(SPEECH / "en_jfk_inaugural.flac", 16000)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(again, expected)
    # the argument is dropped after the first refusal, not retried on every file
    assert calls == [["metadata_errors"], [], []]


def test_other_type_errors_still_surface_as_bad_audio(monkeypatch):
    def broken_open(source, mode="r", **kw):  # noqa: ANN001, ANN202
        raise TypeError("something else entirely")

    monkeypatch.setattr(av, "open", broken_open)
    monkeypatch.setattr(oasr_audio, "_AV_METADATA_ERRORS", [True])
    from oasr.errors import BadAudioError

    with pytest.raises(BadAudioError, match="something else"):
        oasr_audio.load_audio(SPEECH / "en_jfk_inaugural.flac", 16000)
