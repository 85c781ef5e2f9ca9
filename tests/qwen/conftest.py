"""Qwen2-Audio fixtures: a tiny random-weight Qwen2AudioForConditionalGeneration written by
``transformers.save_pretrained`` (sharded safetensors with an index), a small real byte-level BPE
tokenizer trained here with ``tokenizers`` (Qwen2's pre-tokenizer, Qwen2-Audio's special tokens),
and the processor's files (WhisperFeatureExtractor with 128 mel bins, the chat template)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
CORPUS = [
    "Detect the language and recognize the speech: <|en|>",
    "Transcribe the speech. Translate the speech into English.",
    "You are a helpful assistant. Audio 1: system user assistant",
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun",
    "Generate the caption in English: glass is breaking, a man speaks, music plays",
    "Der schnelle braune Fuchs springt über den faulen Hund. El zorro marrón rápido.",
    "speech recognition with a large language model reads audio tokens and writes text",
] * 20


def build_tokenizer():  # noqa: ANN201
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def default_chat_template() -> str:
    from transformers import Qwen2AudioProcessor

    return Qwen2AudioProcessor.default_chat_template.fget(None)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_positions" in name or "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.12 * noise)
        # a decisive output head: varied greedy tokens with clear margins
        model.lm_head.weight.mul_(12.0)


def _write(path: Path, *, chat: bool, seed: int) -> Path:
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fe = WhisperFeatureExtractor(feature_size=128)
    processor = Qwen2AudioProcessor(feature_extractor=fe, tokenizer=hf_tok,
                                    chat_template=default_chat_template() if chat else None)  # fmt: skip
    config = Qwen2AudioConfig(
        audio_config={"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2,
                      "encoder_ffn_dim": 64, "num_mel_bins": 128, "max_source_positions": 1500},
        text_config={"model_type": "qwen2", "vocab_size": vocab, "hidden_size": 48, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                     "eos_token_id": tok.token_to_id("<|im_end|>"),
                     "pad_token_id": tok.token_to_id("<|endoftext|>")},
        audio_token_index=tok.token_to_id("<|AUDIO|>"),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    _randomize(model, seed)
    model.generation_config.eos_token_id = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    model.generation_config.pad_token_id = tok.token_to_id("<|endoftext|>")
    model.save_pretrained(path, max_shard_size="100KB")
    processor.save_pretrained(path)
    if not chat:  # the processor writes its default template anyway; the base repo has none
        for name in ("chat_template.jinja", "chat_template.json"):
            (path / name).unlink(missing_ok=True)
    return path


@pytest.fixture(scope="session")
def qwen_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Instruct layout: a chat template travels with the tokenizer."""
    return _write(tmp_path_factory.mktemp("qwen_chat"), chat=True, seed=0)


@pytest.fixture(scope="session")
def qwen_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base layout: no chat template (the base prompt)."""
    return _write(tmp_path_factory.mktemp("qwen_base"), chat=False, seed=1)


@pytest.fixture(scope="session")
def clips() -> list[np.ndarray]:
    """Three inputs of different lengths (different numbers of audio tokens)."""
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 3) / 16000
    out = []
    for n, f in ((16000 * 1 + 333, 220.0), (16000 * 2 + 4000, 440.0), (12345, 330.0)):
        out.append((0.3 * np.sin(2 * np.pi * f * t[:n]) + 0.05 * rng.standard_normal(n)).astype(np.float32))
    return out
