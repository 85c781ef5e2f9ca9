"""The tokenizer reader: the real Parakeet SentencePiece model (tests/data/nemo, 8192 pieces),
and a ``tokenizer.json`` written by the ``tokenizers`` library from the same pieces, decoded by
that library as the reference; a checkpoint with only ``tokenizer.json`` gives the same text."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from oasr.types import DecodingOptions

from .conftest import TOKENIZER  # noqa: TID252


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from oasr_models_nemo.tokenizer import read_sentencepiece_model

    pieces, _ = read_sentencepiece_model(TOKENIZER)
    tok = tokenizers.Tokenizer(tokenizers.models.Unigram([(p, 0.0) for p in pieces], unk_id=0))
    tok.decoder = tokenizers.decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def test_sentencepiece_model_and_tokenizer_json_agree_with_tokenizers(hf_tokenizer_json) -> None:
    from oasr_models_nemo.tokenizer import (
        SentencePieceDecoder,
        read_sentencepiece_model,
        read_tokenizer_json,
    )

    path, reference = hf_tokenizer_json
    spm = SentencePieceDecoder(*read_sentencepiece_model(TOKENIZER))
    js = SentencePieceDecoder(*read_tokenizer_json(path))
    assert len(spm) == len(js) == 8192
    assert spm.pieces == js.pieces
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(274, 8192, size=int(rng.integers(1, 30))).tolist()  # normal pieces
        expected = reference.decode(ids)
        assert spm.decode(ids) == expected == js.decode(ids)


def test_checkpoint_with_tokenizer_json_only(hf_checkpoints, hf_tokenizer_json, waves, tmp_path) -> None:
    from oasr_models_nemo.model import NemoASR

    src = hf_checkpoints["ctc"].path
    dst = tmp_path / "json_only"
    shutil.copytree(src, dst)
    (dst / "tokenizer.model").unlink()
    shutil.copy(hf_tokenizer_json[0], dst / "tokenizer.json")
    a = NemoASR.from_hf(src).transcribe(waves, DecodingOptions())
    b = NemoASR.from_hf(dst).transcribe(waves, DecodingOptions())
    assert [t.text for t in a] == [t.text for t in b] and a[0].text


def test_hub_id_resolves_through_the_hub_cache(hf_checkpoints, waves, tmp_path, monkeypatch) -> None:
    """``ckpt_dir="org/name"`` loads the snapshot the Hugging Face cache holds (offline)."""
    import huggingface_hub.constants as hub

    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--nvidia--tiny-parakeet-tdt"
    shutil.copytree(hf_checkpoints["tdt"].path, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    model = load_model(EngineConfig(ckpt_dir="nvidia/tiny-parakeet-tdt"))
    local = load_model(EngineConfig(ckpt_dir=str(hf_checkpoints["tdt"].path)))
    assert type(model).__name__ == "ParakeetTDT"
    assert [t.text for t in model.transcribe(waves, DecodingOptions())] == \
        [t.text for t in local.transcribe(waves, DecodingOptions())]
