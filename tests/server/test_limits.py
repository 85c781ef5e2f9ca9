"""Bounds on what a client controls (issue: hold under abuse). Each absurd field is a 400 naming
the field, answered before any decoding work; values at the bound still work."""

from __future__ import annotations

import time

import pytest

from oasr.errors import InvalidRequestError
from oasr.types import (
    MAX_BEAM_SIZE,
    MAX_HOTWORDS,
    MAX_MODEL_OPTIONS,
    MAX_PROMPT_CHARS,
    DecodingOptions,
)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
        ({"beam_size": MAX_BEAM_SIZE + 1}, "beam_size"),
        ({"language": "e" * 100}, "language"),
        ({"temperature": tuple([0.1] * 100)}, "temperature"),
        ({"max_new_tokens": 10**9}, "max_new_tokens"),
        ({"hotwords": ["w"] * (MAX_HOTWORDS + 1)}, "hotwords"),
        ({"hotwords": ["w" * 1000]}, "hotwords"),
        ({f"opt{i}": "1" for i in range(MAX_MODEL_OPTIONS + 1)}, "model_options"),
        ({"some_option": "v" * 20000}, "some_option"),
    ],
)
def test_decoding_options_refuse_absurd_sizes(fields, param) -> None:
    with pytest.raises(InvalidRequestError) as err:
        DecodingOptions.build(**fields)
    assert err.value.param == param


def test_values_at_the_bounds_are_accepted() -> None:
    opts = DecodingOptions.build(prompt="y" * MAX_PROMPT_CHARS, beam_size=MAX_BEAM_SIZE)
    assert len(opts.prompt) == MAX_PROMPT_CHARS


def test_http_refuses_a_huge_prompt_fast_and_keeps_serving(kit, app_factory) -> None:
    """A megabyte prompt used to tie up the engine for minutes and answer 200."""
    app, model = app_factory()

    async def go():
        async with kit.serving(app) as c:
            t0 = time.monotonic()
            huge = await kit.post_audio(c, fields={"prompt": "word " * 200_000})
            took = time.monotonic() - t0
            long_ok = await kit.post_audio(c, fields={"prompt": "z" * 8000})
            query = await c.post(
                "/v1/speech:recognize",
                params={"prompt": "q" * (MAX_PROMPT_CHARS + 1)},
                content=kit.wav_bytes(),
            )
            beam = await c.post(
                "/v1/speech:recognize", params={"beam_size": "1000"}, content=kit.wav_bytes()
            )
            after = await kit.post_audio(c)
            return huge, took, long_ok, query, beam, after

    huge, took, long_ok, query, beam, after = kit.run(go())
    # the multipart field bound (64 KiB) refuses it while parsing, before the options
    assert huge.status_code == 400, huge.text
    assert huge.json()["error"]["param"] == "prompt"
    assert took < 5
    assert long_ok.status_code == 200, long_ok.text
    # an accepted prompt reaches the model intact
    assert any(o.prompt == "z" * 8000 for o in model.options)
    for r in (query, beam):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert query.json()["error"]["param"] == "prompt"
    assert beam.json()["error"]["param"] == "beam_size"
    assert after.status_code == 200
    # refused requests never reached the engine
    assert all(o.prompt is None or len(o.prompt) <= MAX_PROMPT_CHARS for o in model.options)


def test_a_prompt_just_over_the_bound_names_the_field(kit, app_factory) -> None:
    app, _ = app_factory()

    async def go():
        async with kit.serving(app) as c:
            return await kit.post_audio(c, fields={"prompt": "p" * (MAX_PROMPT_CHARS + 1)})

    r = kit.run(go())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and str(MAX_PROMPT_CHARS) in err["message"]
