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
