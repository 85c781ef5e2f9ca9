"""Qwen2-Audio's tokenizer from tokenizer.json and, for checkpoints without one, from vocab.json
+ merges.txt + tokenizer_config.json (Qwen2's pre-tokenizer rebuilt): the same ids both ways,
and the ids transformers' tokenizer gives."""

from __future__ import annotations

import json

import pytest

from oasr_models_qwen.tokenizer import QwenTokenizer, split_language_tag

TEXTS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nAudio 1: "
    "<|audio_bos|><|AUDIO|><|audio_eos|>\nTranscribe the speech.<|im_end|>\n<|im_start|>assistant\n",
    "Der schnelle braune Fuchs springt über den faulen Hund's 1234 tail!!\n\n  spaces",
]


def test_vocab_merges_equals_tokenizer_json(qwen_chat_dir, tmp_path):
    body = json.loads((qwen_chat_dir / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(body["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in body["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    added = {str(t["id"]): {"content": t["content"], "special": t["special"]} for t in body["added_tokens"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    full = QwenTokenizer.from_files({"tokenizer.json": qwen_chat_dir / "tokenizer.json"})
    rebuilt = QwenTokenizer.from_files({n: tmp_path / n for n in ("vocab.json", "merges.txt", "tokenizer_config.json")})
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(qwen_chat_dir)
    for text in TEXTS:
        ids = full.encode(text)
        assert rebuilt.encode(text) == ids == hf(text, add_special_tokens=False)["input_ids"]
        assert full.decode(ids) == rebuilt.decode(ids)
    assert rebuilt.audio_id == full.audio_id == full.token_id("<|AUDIO|>")


def test_language_tag():
    assert split_language_tag("<|en|>hello world") == ("en", "hello world")
    assert split_language_tag(" plain text ") == (None, "plain text")


def test_chat_template_compiled_once_and_its_refusal_is_typed():
    pytest.importorskip("jinja2")
    from oasr.errors import InvalidRequestError
    from oasr_models_qwen.tokenizer import _compiled, build_prompt

    kw = {"chat": True, "task": "transcribe", "language": None, "prompt": None}
    first = build_prompt(**kw)
    hits = _compiled.cache_info().hits
    assert build_prompt(**kw) == first and _compiled.cache_info().hits == hits + 1
    assert "<|AUDIO|>" in first and first.endswith("<|im_start|>assistant\n")
    refusing = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system turn') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="needs a system turn"):
        build_prompt(**kw, chat_template=refusing)
