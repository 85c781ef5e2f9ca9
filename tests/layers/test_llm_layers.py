"""oasr.layers.llm against transformers' Qwen2 pieces: RMSNorm, rotary embeddings (positions per
row, as a paged decode step has them) and the gated SiLU MLP."""

from __future__ import annotations

import pytest
import torch

import oasr.layers as L

qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_is_qwen2s(dtype, tol):
    ref = qwen2.Qwen2RMSNorm(24, eps=1e-6)
    ours = L.RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
        ours.weight.copy_(ref.weight)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = torch.randn(3, 5, 24).to(dtype) * 4
    torch.testing.assert_close(ours(x), ref(x), atol=tol, rtol=tol)
    assert "rms_norm" in L.KNOWN_OPS


def test_rotary_is_qwen2s_at_any_positions():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    ref = qwen2.Qwen2RotaryEmbedding(cfg)
    rope = L.RotaryEmbedding(16, 10000.0)
    positions = torch.tensor([[0, 1, 2, 3], [7, 40, 41, 300]])  # rows at different positions
    q = torch.randn(2, 4, 4, 16)
    cos_r, sin_r = ref(q, positions)
    cos, sin = rope(positions, q.dtype)
    torch.testing.assert_close(cos, cos_r)
    torch.testing.assert_close(sin, sin_r)
    want, _ = qwen2.apply_rotary_pos_emb(q, q, cos_r, sin_r)
    torch.testing.assert_close(L.apply_rotary(q, cos, sin), want)


def test_gated_mlp_is_qwen2s():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=16, intermediate_size=40)
    ref = qwen2.Qwen2MLP(cfg)
    ours = L.SiLUGatedMLP(16, 40)
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
        ours.down_proj.weight.copy_(ref.down_proj.weight)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ours(x), ref(x))


def test_rotary_qk_is_qwen2s_on_a_fused_projection():
    """rotary_qk over the q/k view of a fused q/k/v output: transformers' rotated queries and
    keys (bf16: the same rounded products), the keys flat for the cache."""
    from transformers import Qwen2Config

    from oasr.layers.llm import rotary_qk, signed_rotary_sin

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    positions = torch.tensor([[0, 1, 2], [7, 40, 300]])
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 16).to(torch.bfloat16)
    cos_r, sin_r = qwen2.Qwen2RotaryEmbedding(cfg)(qkv, positions)
    q_ref, k_ref = qwen2.apply_rotary_pos_emb(qkv[..., :64].view(2, 3, 4, 16).transpose(1, 2),
                                              qkv[..., 64:96].view(2, 3, 2, 16).transpose(1, 2), cos_r, sin_r)  # fmt: skip
    cos, sin = L.RotaryEmbedding(16, 10000.0)(positions, torch.bfloat16)
    q, k = rotary_qk(qkv[..., :96].view(2, 3, 6, 16), cos[:, :, None], signed_rotary_sin(sin)[:, :, None], 4)
    assert "rotary_qk" in L.KNOWN_OPS and k.shape == (2, 3, 32)
    torch.testing.assert_close(q.transpose(1, 2), q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k.view(2, 3, 2, 16).transpose(1, 2), k_ref, atol=1e-2, rtol=1e-2)


def test_silu_mul_is_the_gated_silu():
    from oasr.layers.llm import silu_mul

    x = torch.randn(3, 2, 10, dtype=torch.float64)
    want = torch.nn.functional.silu(x[..., :5]) * x[..., 5:]
    torch.testing.assert_close(silu_mul(x, 5), want, atol=0, rtol=0)
    assert "silu_mul" in L.KNOWN_OPS
