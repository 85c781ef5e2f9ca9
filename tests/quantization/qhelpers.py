"""Helpers of the quantization tests: small random-weight networks of three families, built
directly from their configurations (no checkpoint on disk), and the relative error."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def quantized_and_reference(net: torch.nn.Module, method: str, keep=()) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(q, ref)``: ``net`` with its linears quantized (float32), and a float64 copy of ``q``
    whose quantized linears run the float64 fake-quantized reference with the same weights."""
    from oasr.quantization.apply import quantize_module

    q = copy.deepcopy(net)
    quantize_module(q, method, keep)
    ref = copy.deepcopy(q).double()
    return q.eval(), ref.eval()


def whisper_net(seed: int = 0, d: int = 64, vocab: int = 96):
    from oasr_models_whisper.network import WhisperDims
    from oasr_models_whisper.nn import WhisperNet

    torch.manual_seed(seed)
    dims = WhisperDims(n_mels=80, n_audio_ctx=1500, n_audio_state=d, n_audio_head=4, n_audio_layer=2,
                       n_vocab=vocab, n_text_ctx=64, n_text_state=d, n_text_head=4, n_text_layer=2)  # fmt: skip
    net = WhisperNet(dims, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        net.decoder.positional_embedding.normal_(0, 0.1)
    return net.eval()


def whisper_logits(net, mel: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced decoder logits (float64 when the network is float64)."""
    feats = net.encode(mel.to(net.dtype))
    cache = net.new_cache(feats)
    dec = net.decoder
    # WhisperNet.decode returns .float(); recompute the last step to keep float64 in the reference
    x = dec.embed_tokens(tokens) + dec.positional_embedding[: tokens.shape[1]]
    for i, block in enumerate(dec.layers):
        x = x + block.self_attn(block.self_attn_norm(x), cache=cache.self_kv[i], causal=True)
        x = x + block.cross_attn(block.cross_attn_norm(x), static_kv=cache.cross_kv[i])
        x = x + block.mlp(block.mlp_norm(x))
    return dec.logits(dec.final_norm(x))  # the tied projection: int8 on the CPU


def nemo_net(seed: int = 0, head: str = "ctc"):
    from oasr_models_nemo.config import NemoConfig
    from oasr_models_nemo.nn import FastConformerNet

    torch.manual_seed(seed)
    cfg = NemoConfig(head=head, vocab_size=40, blank_id=39, hidden_size=64, num_layers=2, num_heads=4,
                     intermediate_size=128, subsampling_channels=16, decoder_hidden_size=32,
                     durations=(0, 1, 2) if head == "tdt" else ())  # fmt: skip
    net = FastConformerNet(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return net.eval()
