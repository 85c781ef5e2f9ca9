"""Qwen2-Audio dimensions read from a ``transformers`` ``config.json``.

Fields a config leaves out take ``transformers``' defaults (the Hub's Qwen2-Audio configs are
sparse: their ``text_config`` relies on ``Qwen2Config``'s defaults, their ``audio_config`` on
``Qwen2AudioConfig``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oasr.errors import CheckpointError

__all__ = ["AudioDims", "QwenAudioConfig", "TextDims", "parse_config"]


@dataclass(frozen=True)
class AudioDims:
    n_mels: int = 128
    d_model: int = 1280
    layers: int = 32
    heads: int = 20
    ffn: int = 5120
    max_source_positions: int = 1500
    activation: str = "gelu"
    scale_embedding: bool = False

    @property
    def mel_frames(self) -> int:  # the encoder's fixed input length (30 s)
        return self.max_source_positions * 2

    @property
    def max_audio_tokens(self) -> int:  # after the stride-2 conv and the pooling
        return self.max_source_positions // 2


@dataclass(frozen=True)
class TextDims:
    hidden: int = 4096
    intermediate: int = 22016
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    vocab: int = 151936
    max_positions: int = 32768
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    hidden_act: str = "silu"


@dataclass(frozen=True)
class QwenAudioConfig:
    audio: AudioDims
    text: TextDims
    audio_token_id: int = 151646
    eos_token_ids: tuple[int, ...] = ()


def _audio(cfg: dict[str, Any]) -> AudioDims:
    d = AudioDims()
    return AudioDims(
        n_mels=int(cfg.get("num_mel_bins", d.n_mels)),
        d_model=int(cfg.get("d_model", d.d_model)),
        layers=int(cfg.get("encoder_layers", d.layers)),
        heads=int(cfg.get("encoder_attention_heads", d.heads)),
        ffn=int(cfg.get("encoder_ffn_dim", d.ffn)),
        max_source_positions=int(cfg.get("max_source_positions", d.max_source_positions)),
        activation=str(cfg.get("activation_function", d.activation)),
        scale_embedding=bool(cfg.get("scale_embedding", d.scale_embedding)),
    )


def _text(cfg: dict[str, Any], top: dict[str, Any]) -> TextDims:
    d = TextDims()
    hidden = int(cfg.get("hidden_size", d.hidden))
    heads = int(cfg.get("num_attention_heads", d.heads))
    kv = cfg.get("num_key_value_heads")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", d.rope_theta) if isinstance(rope, dict) else d.rope_theta)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise CheckpointError(f"Qwen2-Audio with rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
    tie = cfg.get("tie_word_embeddings", top.get("tie_word_embeddings", d.tie_embeddings))
    return TextDims(
        hidden=hidden,
        intermediate=int(cfg.get("intermediate_size", d.intermediate)),
        layers=int(cfg.get("num_hidden_layers", d.layers)),
        heads=heads,
        kv_heads=int(kv) if kv is not None else heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab=int(cfg.get("vocab_size", d.vocab)),
        max_positions=int(cfg.get("max_position_embeddings", d.max_positions)),
        rms_eps=float(cfg.get("rms_norm_eps", d.rms_eps)),
        rope_theta=float(theta),
        tie_embeddings=bool(tie),
        hidden_act=str(cfg.get("hidden_act", d.hidden_act)),
    )


def parse_config(cfg: dict[str, Any]) -> QwenAudioConfig:
    """The dimensions of a ``Qwen2AudioForConditionalGeneration`` ``config.json``."""
    if cfg.get("model_type") != "qwen2_audio":
        raise CheckpointError(f"config.json has model_type {cfg.get('model_type')!r}, not 'qwen2_audio'")
    audio = _audio(cfg.get("audio_config") or {})
    text_cfg = cfg.get("text_config") or {}
    text = _text(text_cfg, cfg)
    if text.heads % text.kv_heads:
        raise CheckpointError(f"{text.heads} attention heads cannot share {text.kv_heads} key/value heads")
    if audio.activation != "gelu" or text.hidden_act != "silu":
        raise CheckpointError(
            f"unsupported activations: audio {audio.activation!r} (gelu expected), text {text.hidden_act!r} (silu)"
        )
    token = cfg.get("audio_token_index", cfg.get("audio_token_id", 151646))
    eos = text_cfg.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    return QwenAudioConfig(audio, text, int(token), eos_ids)
