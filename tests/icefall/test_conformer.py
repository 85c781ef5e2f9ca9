"""icefall's reworked Conformer transducer (pruned_transducer_stateless2 layout) against golden
outputs of icefall's own code (tests/data/icefall/make_conformer_golden.py: the recipe's
conformer.py / decoder.py / joiner.py built the model; icefall's greedy and modified beam search
from the zipformer package decoded it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.checkpoint import load_model
from oasr.types import DecodingOptions, EngineConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "icefall" / "conformer_stateless2"


@pytest.fixture(scope="module")
def model():
    return load_model(EngineConfig(ckpt_dir=str(DATA)))


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(DATA / "golden.npz")), json.loads((DATA / "golden.json").read_text())["runs"]


def test_loads_as_transducer_with_inferred_shape(model) -> None:
    from oasr_models_icefall.model import ZipformerTransducer

    assert isinstance(model, ZipformerTransducer)
    cfg = model.cfg
    assert (cfg.encoder, cfg.d_model, cfg.nhead, cfg.num_layers, cfg.kernel) == ("conformer", 32, 4, 2, 7)
    assert (cfg.vocab_size, cfg.context_size, cfg.decoder_dim, cfg.joiner_dim) == (40, 2, 16, 24)
    assert not model.capabilities.streaming and "conformer" in model.name


def test_encoder_equals_icefall(model, golden, helpers) -> None:
    arrays, _ = golden
    ws = helpers.waves(3)
    feats, lens = model.features(ws)
    with torch.no_grad():
        batch, batch_lens = model.net.encode(feats, lens)
        for b, n in enumerate(lens.tolist()):
            ref = torch.from_numpy(arrays[f"encoder_out_{b}"])
            alone, _ = model.net.encode(feats[b : b + 1, :n], lens[b : b + 1])
            assert alone.shape[1] == ref.shape[0] == int(batch_lens[b])
            assert (alone[0] - ref).abs().max() < 1e-4
            assert (batch[b, : ref.shape[0]] - ref).abs().max() < 1e-4


@pytest.mark.parametrize("beam,key", [(1, "greedy_search"), (4, "modified_beam_search_4")])
def test_tokens_equal_icefall(model, golden, helpers, beam, key) -> None:
    _, runs = golden
    out = model.transcribe(helpers.waves(3), DecodingOptions(beam_size=beam, word_timestamps=True))
    assert [t.segments[0].tokens for t in out] == runs[key]
    assert all(t.segments[0].words for t in out)


def test_native_round_trip(model, helpers, tmp_path) -> None:
    from oasr.checkpoint import convert_checkpoint

    assert convert_checkpoint(DATA, tmp_path / "native") == "transducer"
    again = load_model(EngineConfig(ckpt_dir=str(tmp_path / "native")))
    assert again.cfg == model.cfg and again.source_format == "oasr"
    ws = helpers.waves(2)
    assert [t.text for t in again.transcribe(ws, DecodingOptions())] == \
        [t.text for t in model.transcribe(ws, DecodingOptions())]


def test_unknown_variant_refused(tmp_path) -> None:
    """Tensors the stateless2 layout lacks (another recipe's variant) are named, not ignored."""
    import shutil

    from oasr.errors import CheckpointError

    shutil.copytree(DATA, tmp_path / "variant")
    sd = torch.load(DATA / "exp" / "pretrained.pt", weights_only=True)["model"]
    sd["encoder.encoder.combiner.linear.weight"] = torch.zeros(2, 2)
    torch.save({"model": sd}, tmp_path / "variant" / "exp" / "pretrained.pt")
    with pytest.raises(CheckpointError, match="encoder.encoder.combiner.linear.weight"):
        load_model(EngineConfig(ckpt_dir=str(tmp_path / "variant")))
