"""WeNet's per-request options (decoding_method, ctc_weight, reverse_weight, chunk options): one
engine serves requests with different options, each as a model built with those defaults would;
bad values are typed errors before any work."""

from __future__ import annotations

import copy

import pytest

from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.types import DecodingOptions, EngineConfig

from .conftest import load  # noqa: TID252

CLIP = "zh_aishell_BAC009S0764W0121.wav"
OTHER = "zh_aishell_BAC009S0724W0121.wav"


def _built_with(**defaults):
    """The test model with other model-level defaults (a shallow copy: the cached model keeps
    its own defaults; the network is shared)."""
    model = copy.copy(load("u2pp_conformer"))
    for name, value in defaults.items():
        setattr(model, name, value)
    return model


def test_one_engine_two_methods_match_models_built_with_them(speech) -> None:
    from oasr.engine import ASREngine

    audio = [speech[CLIP], speech[OTHER]]
    engine = ASREngine(EngineConfig(max_batch_size=4), model=load("u2pp_conformer"))
    try:
        methods = ("ctc_prefix_beam_search", "attention_rescoring", "attention")
        futures = {
            m: [engine.submit(a, DecodingOptions.build(beam_size=4, decoding_method=m)) for a in audio]
            for m in methods
        }
        for method, futs in futures.items():
            got = [f.result(timeout=120) for f in futs]
            ref = _built_with(decoding_method=method).transcribe(audio, DecodingOptions(beam_size=4))
            assert [t.text for t in got] == [t.text for t in ref], method
            assert [t.segments[0].tokens for t in got] == [t.segments[0].tokens for t in ref]
        # the methods really differ here (else this test would prove nothing)
        rescored = [f.result().segments[0].tokens for f in futures["attention_rescoring"]]
        prefix = [f.result().segments[0].tokens for f in futures["ctc_prefix_beam_search"]]
        attention = [f.result().segments[0].tokens for f in futures["attention"]]
        assert rescored != prefix or rescored != attention
    finally:
        engine.shutdown()


def test_rescoring_weights_per_request(speech) -> None:
    audio = [speech[CLIP]]
    for weights in ({"ctc_weight": 0.0, "reverse_weight": 0.0}, {"ctc_weight": 2.0, "reverse_weight": 1.0}):
        got = load("u2pp_conformer").transcribe(audio, DecodingOptions.build(beam_size=4, **weights))
        ref = _built_with(**weights).transcribe(audio, DecodingOptions(beam_size=4))
        assert got[0].segments[0].tokens == ref[0].segments[0].tokens


def test_engine_refuses_bad_options_at_submit(speech) -> None:
    from oasr.engine import ASREngine

    engine = ASREngine(EngineConfig(), model=load("u2pp_conformer"))
    try:
        with pytest.raises(UnsupportedOptionError, match="no option 'no_speech_threshold'") as info:
            engine.submit(speech[CLIP], DecodingOptions.build(no_speech_threshold=0.5))
        assert info.value.param == "no_speech_threshold" and "decoding_method" in info.value.message
        with pytest.raises(InvalidRequestError) as info:
            engine.submit(speech[CLIP], DecodingOptions.build(ctc_weight=-1))
        assert info.value.param == "ctc_weight"
        with pytest.raises(UnsupportedOptionError, match="hotwords"):  # greedy cannot bias
            engine.submit(speech[CLIP], DecodingOptions.build(hotwords=("北京",),
                                                              decoding_method="ctc_greedy_search"))
        assert engine.scheduler is None or engine.scheduler.step_count == 0  # no work started
    finally:
        engine.shutdown()


def test_model_dependent_refusals(speech) -> None:
    u2 = load("u2_conformer_conv2d6")  # no right-to-left decoder
    with pytest.raises(UnsupportedOptionError, match="reverse_weight") as info:
        u2.transcribe([speech[CLIP]], DecodingOptions.build(beam_size=3, reverse_weight=0.5))
    assert info.value.param == "reverse_weight"
    with pytest.raises(UnsupportedOptionError, match="offline only"):
        load("u2pp_conformer").new_stream(DecodingOptions.build(decoding_method="attention"))


def test_stream_chunk_options_per_request(speech) -> None:
    model = load("u2pp_conformer")
    st = model.new_stream(DecodingOptions.build(chunk_size="8", num_left_chunks=2))
    assert (st.chunk_size, st.num_left_chunks) == (8, 2)
    st = model.new_stream(DecodingOptions())
    assert (st.chunk_size, st.num_left_chunks) == (model.chunk_size, model.num_left_chunks)


def test_offline_chunk_mask_per_request(speech) -> None:
    audio = [speech[CLIP]]
    got = load("u2pp_conformer").transcribe(audio, DecodingOptions.build(decoding_chunk_size=4,
                                                                         num_decoding_left_chunks=1))
    ref = _built_with(offline_chunk_size=4, offline_left_chunks=1).transcribe(audio, DecodingOptions())
    assert got[0].text == ref[0].text
    full = load("u2pp_conformer").transcribe(audio, DecodingOptions())
    assert got[0].segments[0].tokens != full[0].segments[0].tokens or got[0].text == full[0].text


def test_cli_option_flag(speech, tmp_path) -> None:
    """``oasr transcribe -O NAME=VALUE`` sets family options; an unknown one fails naming the
    valid ones, and Whisper's --long-form is refused by WeNet only when it is given."""
    from typer.testing import CliRunner

    from oasr.cli.main import app

    from .conftest import DATA  # noqa: TID252

    clip = str(DATA.parents[1] / "data" / "speech" / CLIP)
    base = ["transcribe", "--threads", "1", "--ckpt-dir", str(DATA / "u2pp_conformer"), "-f", "json"]
    ok = CliRunner().invoke(app, [*base, "--beam-size", "4", "-O", "decoding_method=attention", clip])
    assert ok.exit_code == 0, ok.output
    ref = _built_with(decoding_method="attention").transcribe([speech[CLIP]], DecodingOptions(beam_size=4))
    assert ref[0].text in ok.output
    bad = CliRunner().invoke(app, [*base, "-O", "decoding_methd=attention", clip])
    assert bad.exit_code == 1 and "no option 'decoding_methd'" in bad.output
    assert "decoding_method" in bad.output
    whisper_only = CliRunner().invoke(app, [*base, "--long-form", "vad", clip])
    assert whisper_only.exit_code == 1 and "long_form" in whisper_only.output
    malformed = CliRunner().invoke(app, [*base, "-O", "decoding_method", clip])
    assert malformed.exit_code == 1 and "NAME=VALUE" in malformed.output
