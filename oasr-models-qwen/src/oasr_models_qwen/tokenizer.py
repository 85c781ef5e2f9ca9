"""Qwen2-Audio's tokenizer through Hugging Face ``tokenizers`` and its prompts.

The tokenizer is the checkpoint's ``tokenizer.json`` (or, when only ``vocab.json`` and
``merges.txt`` are there, the same byte-level BPE rebuilt with Qwen2's pre-tokenizer and the
added tokens of ``tokenizer_config.json``). Prompts follow the model card: the Instruct model's
chat template (rendered with jinja2 from the checkpoint; the template ``transformers`` ships as
Qwen2-Audio's default when the checkpoint has none) and the base model's
``<|audio_bos|><|AUDIO|><|audio_eos|>Detect the language and recognize the speech:`` prompt."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from oasr.errors import CheckpointError, InvalidRequestError

__all__ = ["AUDIO", "LANGUAGE_NAMES", "QwenTokenizer", "build_prompt", "split_language_tag"]

AUDIO, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

#: Qwen2's pre-tokenizer split (the ``Qwen2TokenizerFast`` regex)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip

#: the chat template transformers' Qwen2AudioProcessor uses when a checkpoint has none
DEFAULT_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LANGUAGE_NAMES = {
    "en": "English", "zh": "Chinese", "de": "German", "es": "Spanish", "fr": "French",
    "it": "Italian", "ja": "Japanese", "ko": "Korean", "ru": "Russian", "pt": "Portuguese",
    "nl": "Dutch", "ar": "Arabic", "tr": "Turkish", "pl": "Polish", "sv": "Swedish",
    "vi": "Vietnamese", "th": "Thai", "id": "Indonesian", "hi": "Hindi", "yue": "Cantonese",
}  # fmt: skip

_LANG_TAG = re.compile(r"^\s*<\|([a-z]{2,3}(?:-[A-Za-z]+)?)\|>\s*")


def split_language_tag(text: str) -> tuple[str | None, str]:
    """The base model answers ``<|en|>text``: (language code or None, text)."""
    m = _LANG_TAG.match(text)
    if m is None:
        return None, text.strip()
    return m.group(1), text[m.end() :].strip()


class QwenTokenizer:
    """Encode/decode with the checkpoint's byte-level BPE; special tokens by name."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        missing = [t for t in (AUDIO, AUDIO_BOS, AUDIO_EOS) if tokenizer.token_to_id(t) is None]
        if missing:
            raise CheckpointError(f"the tokenizer has no {missing[0]} token (not a Qwen2-Audio tokenizer)")
        self.audio_id = tokenizer.token_to_id(AUDIO)

    @classmethod
    def from_files(cls, files: dict[str, Path]) -> QwenTokenizer:
        from tokenizers import Tokenizer

        if "tokenizer.json" in files:
            return cls(Tokenizer.from_file(str(files["tokenizer.json"])))
        return cls(_from_vocab_merges(files))

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _from_vocab_merges(files: dict[str, Path]) -> Any:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    tok = Tokenizer(models.BPE.from_file(str(files["vocab.json"]), str(files["merges.txt"])))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    cfg = files.get("tokenizer_config.json")
    added = json.loads(cfg.read_text()).get("added_tokens_decoder", {}) if cfg else {}
    for _, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
        tok.add_special_tokens([AddedToken(spec["content"], special=bool(spec.get("special", True)),
                                           normalized=False)])  # fmt: skip
    return tok


def _instruction(task: str, language: str | None, prompt: str | None) -> str:
    if prompt:
        return prompt
    name = LANGUAGE_NAMES.get(language or "", language)
    if task == "translate":
        return f"Translate the {name} speech into English." if name else "Translate the speech into English."
    return f"Transcribe the {name} speech." if name else "Transcribe the speech."


def build_prompt(*, chat: bool, task: str, language: str | None, prompt: str | None,
                 system_prompt: str | None = None, chat_template: str | None = None) -> str:  # fmt: skip
    """The prompt text, with one ``<|AUDIO|>`` placeholder (expanded to the audio's tokens by
    the caller)."""
    if not chat:
        if prompt:
            return f"{AUDIO_BOS}{AUDIO}{AUDIO_EOS}{prompt}"
        if task == "translate":
            return f"{AUDIO_BOS}{AUDIO}{AUDIO_EOS}Translate the speech into English:"
        tag = f" <|{language}|>" if language else ""
        return f"{AUDIO_BOS}{AUDIO}{AUDIO_EOS}Detect the language and recognize the speech:{tag}"
    messages: list[dict[str, Any]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": [
        {"type": "audio", "audio_url": "input"},
        {"type": "text", "text": _instruction(task, language, prompt)},
    ]})  # fmt: skip
    return _compiled(chat_template or DEFAULT_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"the checkpoint's chat template refused the prompt: {message}", param="prompt")


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    """``template`` compiled once (Jinja compiles a template to Python: tens of milliseconds,
    which per request would hold every batch of requests at admission), in the environment
    transformers' ``apply_chat_template`` renders templates in."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)
