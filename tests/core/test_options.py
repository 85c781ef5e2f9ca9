"""Family options (oasr.options): declared once per family, parsed from strings (CLI, HTTP, gRPC)
or typed values, validated with typed errors, resolved per request against a model's defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest

from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.options import ModelOptions, option, parse_assignments, resolve_options
from oasr.types import DecodeFamily, DecodingOptions, ModelCapabilities


@dataclass(frozen=True)
class ToyOptions(ModelOptions):
    family = "toy"

    method: Literal["greedy", "beam"] = option("greedy", doc="search")
    weight: float = option(0.3, ge=0, le=1, doc="a weight in [0, 1]")
    chunk: int | None = option(None, gt=0, doc="frames per chunk; none: whole input")
    verbose: bool = option(False, doc="talk")
    banned: tuple[int, ...] = option((), doc="ids never emitted")

    def validate(self) -> None:
        if self.method == "greedy" and self.banned:
            raise InvalidRequestError("banned needs method=beam", param="banned")


class ToyModel:
    name = "toy model"
    capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)

    def __init__(self, defaults: ToyOptions | None = None) -> None:
        self.default_options = defaults or ToyOptions()


class PlainModel:
    name = "plain model"
    capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)


def test_strings_are_parsed_into_declared_types() -> None:
    got = ToyOptions().override(
        {"method": "beam", "weight": "0.5", "chunk": "16", "verbose": "yes", "banned": "1, 2,3"}
    )
    assert got == ToyOptions(method="beam", weight=0.5, chunk=16, verbose=True, banned=(1, 2, 3))
    assert ToyOptions().override({"chunk": "none"}).chunk is None
    assert ToyOptions().override({"method": "beam", "banned": "[4, 5]"}).banned == (4, 5)
    assert ToyOptions(weight=1).weight == 1.0 and isinstance(ToyOptions(weight=1).weight, float)


@pytest.mark.parametrize(
    "values,param,message",
    [
        ({"weight": "heavy"}, "weight", "weight must be a number"),
        ({"weight": 1.5}, "weight", "at most 1"),
        ({"chunk": 0}, "chunk", "greater than 0"),
        ({"verbose": "maybe"}, "verbose", "true or false"),
        ({"method": "sample"}, "method", "one of greedy, beam"),
        ({"banned": "1,x"}, "banned", "list of integers"),
        ({"banned": "1"}, "banned", "needs method=beam"),  # the family's cross-option check
    ],
)
def test_bad_values_are_typed_errors_naming_the_option(values, param, message) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        ToyOptions().override(values)
    assert info.value.param == param and info.value.http_status == 400


def test_unknown_option_lists_the_valid_names() -> None:
    with pytest.raises(UnsupportedOptionError) as info:
        ToyOptions().override({"beem": 3})
    err = info.value
    assert err.param == "beem" and err.http_status == 400
    assert "toy models have no option 'beem'" in err.message
    assert "method, weight, chunk, verbose, banned" in err.message


def test_specs_carry_types_defaults_bounds_and_docs() -> None:
    spec = ToyOptions.specs()["weight"]
    assert (spec.default, spec.ge, spec.le, spec.doc) == (0.3, 0, 1, "a weight in [0, 1]")
    assert ToyOptions.specs()["chunk"].type_name == "an integer or none"
    assert ToyOptions.names() == ("method", "weight", "chunk", "verbose", "banned")


def test_a_family_option_may_not_shadow_a_common_one() -> None:
    @dataclass(frozen=True)
    class Shadowing(ModelOptions):
        beam_size: int = option(3, doc="clash")

    with pytest.raises(TypeError, match="beam_size"):
        Shadowing.specs()


def test_decoding_options_split_common_and_family_names() -> None:
    built = DecodingOptions.build(beam_size="4", language="de", weight="0.5", chunk=None)
    assert built == DecodingOptions(beam_size=4, language="de",
                                    model_options={"weight": "0.5", "chunk": None})  # fmt: skip
    assert built.updated(verbose=True, beam_size=2).model_options == {
        "weight": "0.5", "chunk": None, "verbose": True
    }
    # equal options compare equal (the scheduler batches them together); different do not
    assert DecodingOptions.build(weight=0.5) == DecodingOptions.build(weight=0.5)
    assert DecodingOptions.build(weight=0.5) != DecodingOptions.build(weight=0.6)
    # the mapping is copied: changing the caller's dict later changes nothing
    mine = {"weight": 0.5}
    opts = DecodingOptions(model_options=mine)
    mine["weight"] = 0.9
    assert opts.model_options == {"weight": 0.5}
    with pytest.raises(InvalidRequestError, match="common option") as info:
        DecodingOptions(model_options={"beam_size": 3})
    assert info.value.param == "beam_size"
    with pytest.raises(InvalidRequestError, match="beam_size must be an integer"):
        DecodingOptions.build(beam_size="wide")


def test_common_names_match_the_fields() -> None:
    from oasr.types import _COMMON_OPTIONS

    fields = {f.name for f in dataclasses.fields(DecodingOptions)} - {"model_options"}
    assert fields == _COMMON_OPTIONS


def test_resolve_against_model_defaults() -> None:
    model = ToyModel(ToyOptions(method="beam", weight=0.1))
    resolved = DecodingOptions.build(beam_size=3, weight="0.7").validate_for(model)
    # common and family options read as attributes of one object
    assert (resolved.beam_size, resolved.method, resolved.weight) == (3, "beam", 0.7)
    assert resolved.temperatures == (0.0,)
    assert resolve_options(model, DecodingOptions()).weight == 0.1  # the model's default
    # resolving is idempotent, and equal requests resolve equal
    assert resolve_options(model, resolved) == resolved
    assert DecodingOptions.build(weight=0.7, beam_size=3).validate_for(model) == resolved
    with pytest.raises(UnsupportedOptionError, match="no option 'nope'"):
        DecodingOptions.build(nope=1).validate_for(model)
    # a request's options survive copying and pickling (dataclasses.asdict deep-copies them)
    import copy
    import pickle

    assert copy.deepcopy(resolved) == resolved == pickle.loads(pickle.dumps(resolved))


def test_a_model_without_options_refuses_any() -> None:
    assert resolve_options(PlainModel(), DecodingOptions()).family is None
    with pytest.raises(UnsupportedOptionError, match="takes no model options") as info:
        DecodingOptions.build(weight=1).validate_for(PlainModel())
    assert info.value.param == "weight"


def test_parse_assignments() -> None:
    assert parse_assignments(["weight=0.5", "long-form=vad", "prompt=a=b"]) == {
        "weight": "0.5", "long_form": "vad", "prompt": "a=b"
    }
    with pytest.raises(InvalidRequestError, match="NAME=VALUE"):
        parse_assignments(["weight"])
