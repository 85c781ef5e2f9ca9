"""``oasr convert`` of a Hugging Face Qwen2-Audio directory (the tiny random checkpoints of
conftest.py, Instruct and base layouts): the native checkpoint holds every tensor bit for bit,
the same tokenizer, prompt and stop tokens, and gives the same tokens and text."""

from __future__ import annotations

import json

import pytest
import torch

from oasr.checkpoint import convert_checkpoint, detect_format, load_model
from oasr.types import DecodingOptions, EngineConfig


def _load(path):  # noqa: ANN001, ANN202
    return load_model(EngineConfig(ckpt_dir=str(path), device="cpu", dtype="float32"))


@pytest.mark.parametrize("layout", ["chat", "base"])
def test_native_round_trip(request, clips, tmp_path, layout) -> None:
    src = request.getfixturevalue(f"qwen_{layout}_dir")
    dst = tmp_path / "native"
    if layout == "chat":  # through the CLI once
        from typer.testing import CliRunner

        from oasr.cli.main import app

        out = CliRunner().invoke(app, ["convert", str(src), str(dst)])
        assert out.exit_code == 0, out.output
    else:
        assert convert_checkpoint(src, dst, EngineConfig(ckpt_dir=str(src), dtype="float32")) == "speech_llm"
    assert detect_format(dst) == "oasr"
    body = json.loads((dst / "oasr_model.json").read_text())
    assert body["architecture"] == "speech_llm" and body["feature_spec"]["num_bins"] == 128
    a, b = _load(src), _load(dst)
    assert type(a) is type(b) and a.network.config == b.network.config
    sa, sb = a.network.state_dict(), b.network.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert (a.chat_template, a.stop_tokens, a.name) == (b.chat_template, b.stop_tokens, b.name)
    assert (b.chat_template is None) == (layout == "base")
    opts = DecodingOptions(max_new_tokens=8)
    assert a.prompt_ids(a.check(opts)) == b.prompt_ids(b.check(opts))
    ta, tb = a.transcribe(clips[:2], opts), b.transcribe(clips[:2], opts)
    assert [t.segments[0].tokens if t.segments else [] for t in ta] == \
        [t.segments[0].tokens if t.segments else [] for t in tb]
    assert [t.text for t in ta] == [t.text for t in tb] and any(t.text for t in ta)


def test_incomplete_native_checkpoint_is_a_clear_error(qwen_base_dir, tmp_path) -> None:
    from oasr.errors import CheckpointError

    dst = tmp_path / "native"
    convert_checkpoint(qwen_base_dir, dst)
    (dst / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        _load(dst)
