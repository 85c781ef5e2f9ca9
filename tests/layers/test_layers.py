"""oasr.layers: ops against torch.nn references, attention masks/caches/weights, op overrides."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import oasr.layers as L


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_layers_linear_layernorm_conv_embedding_match_torch():
    x = torch.randn(2, 5, 8)
    lin = L.Linear(8, 6)
    assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias))
    nobias = L.Linear(8, 6, bias=False)
    assert nobias.bias is None and torch.allclose(nobias(x), x @ nobias.weight.T)

    ln = L.LayerNorm(8)
    ref = nn.LayerNorm(8)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
        ref.weight.copy_(ln.weight)
        ref.bias.copy_(ln.bias)
    assert torch.allclose(ln(x), ref(x), atol=1e-6)

    conv = L.Conv1d(8, 4, kernel_size=3, stride=2, padding=1)
    tconv = nn.Conv1d(8, 4, 3, stride=2, padding=1)
    tconv.load_state_dict(conv.state_dict())
    xc = torch.randn(2, 8, 11)
    assert torch.allclose(conv(xc), tconv(xc), atol=1e-6)

    emb = L.Embedding(10, 8)
    ids = torch.tensor([[1, 2, 9]])
    assert torch.equal(emb(ids), emb.weight[ids])
    h = torch.randn(1, 3, 8)
    assert torch.allclose(emb.unembed(h), h @ emb.weight.T, atol=1e-6)


def test_layers_mlp_and_gelu():
    mlp = L.GELUMLP(8, 32)
    x = torch.randn(3, 8)
    ref = mlp.fc2(F.gelu(mlp.fc1(x)))
    assert torch.allclose(mlp(x), ref)
    assert set(dict(mlp.named_parameters())) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_layers_sinusoids_match_whisper_formula():
    table = L.sinusoids(7, 6)
    half = 3
    inc = math.log(10000) / (half - 1)
    inv = torch.exp(-inc * torch.arange(half, dtype=torch.float64))
    t = torch.arange(7, dtype=torch.float64)[:, None] * inv
    assert torch.allclose(table, torch.cat([t.sin(), t.cos()], 1).float())
    pe = L.SinusoidalPositionalEmbedding(7, 6)
    x = torch.zeros(1, 3, 6)
    assert torch.allclose(pe(x, offset=2), table[2:5][None])
    assert "weight" in pe.state_dict()
    with pytest.raises(ValueError):
        pe(torch.zeros(1, 6, 6), offset=2)


def _mha_pair(embed: int = 16, heads: int = 4):
    ours = L.MultiHeadAttention(embed, heads)
    ref = nn.MultiheadAttention(embed, heads, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ours, ref


def test_layers_attention_matches_torch_with_padding_and_causal_masks():
    ours, ref = _mha_pair()
    x = torch.randn(2, 6, 16)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    out = ours(x, key_padding_mask=pad)
    exp, _ = ref(x, x, x, key_padding_mask=pad)
    assert torch.allclose(out, exp, atol=1e-5)
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)  # torch: True = masked
    out = ours(x, causal=True)
    exp, _ = ref(x, x, x, attn_mask=causal)
    assert torch.allclose(out, exp, atol=1e-5)
    out, w = ours(x, causal=True, key_padding_mask=pad, need_weights=True)
    exp, exp_w = ref(x, x, x, attn_mask=causal, key_padding_mask=pad, average_attn_weights=False)
    assert torch.allclose(out, exp, atol=1e-5) and torch.allclose(w, exp_w, atol=1e-6)
    assert w.dtype == torch.float32 and w.shape == (2, 4, 6, 6)
    # additive float mask equals the bool mask
    add = torch.zeros(6, 6).masked_fill(causal, float("-inf"))
    assert torch.allclose(ours(x, attn_mask=add), ours(x, causal=True), atol=1e-6)


def test_layers_attention_incremental_cache_equals_full_causal():
    attn = L.MultiHeadAttention(16, 4, key_bias=False)
    assert attn.k_proj.bias is None
    x = torch.randn(3, 7, 16)
    full = attn(x, causal=True)
    cache = L.KVCache(initial_capacity=2)  # forces growth
    steps = [attn(x[:, :3], causal=True, cache=cache)]
    for i in range(3, 5):
        steps.append(attn(x[:, i : i + 1], causal=True, cache=cache))
    steps.append(attn(x[:, 5:], causal=True, cache=cache))  # 2 tokens after a cached prefix
    assert cache.length == 7
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_layers_kv_cache_reorder():
    attn = L.MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    cache = L.KVCache()
    attn(x[:, :4], causal=True, cache=cache)
    index = torch.tensor([1, 1, 0])
    cache.reorder(index)
    assert cache.k.shape[0] == 3 and cache.length == 4
    step = attn(x[index, 4:5], causal=True, cache=cache)
    ref = attn(x[index], causal=True)[:, 4:5]
    assert torch.allclose(step, ref, atol=1e-5)
    cache.clear()
    assert cache.length == 0 and cache.k is None


def test_layers_cross_attention_static_kv_and_weights():
    attn = L.MultiHeadAttention(16, 4, kv_dim=12)
    q = torch.randn(2, 3, 16)
    mem = torch.randn(2, 9, 12)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 7:] = True
    kv = attn.project_kv(mem)
    a = attn(q, static_kv=kv, key_padding_mask=pad)
    b, w = attn(q, mem, key_padding_mask=pad, need_weights=True)
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 3), atol=1e-6)
    assert float(w[1, :, :, 7:].detach().abs().max()) == 0.0


def test_layers_build_mask_combinations():
    mask, is_causal = L.build_mask(4, 4, causal=True, device=torch.device("cpu"), dtype=torch.float32)
    assert mask is None and is_causal
    mask, is_causal = L.build_mask(1, 5, past=4, causal=True, device=torch.device("cpu"), dtype=torch.float32)
    assert mask is None and not is_causal
    mask, _ = L.build_mask(2, 5, past=3, causal=True, device=torch.device("cpu"), dtype=torch.float32)
    assert mask.shape == (1, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, True, True, False], [True] * 5]


# -- op overrides -----------------------------------------------------------------------------


def test_layers_override_replaces_and_restores():
    lin = L.Linear(4, 3)
    x = torch.randn(2, 4)
    calls = []

    def fake_linear(module, inp):
        calls.append(module)
        return torch.zeros(inp.shape[0], module.out_features)

    native = lin(x)
    with L.override("linear", "cpu", fake_linear):
        assert torch.equal(lin(x), torch.zeros(2, 3))
        assert calls == [lin]
        assert ("linear", "cpu") in L.list_overrides()
        # another device type is unaffected
        assert L.get_override("linear", "cuda") is None
    assert L.get_override("linear", "cpu") is None
    assert torch.equal(lin(x), native)


def test_layers_override_not_implemented_falls_back_and_disable():
    ln = L.LayerNorm(4)
    x = torch.randn(2, 4)
    seen = []

    def picky(module, inp):
        seen.append(inp.dtype)
        return NotImplemented

    with L.override("layer_norm", "cpu", picky):
        assert torch.allclose(ln(x), ln.forward_native(x))
        assert seen == [torch.float32]
    with L.override("gelu", "cpu", lambda t: t * 0):
        assert torch.equal(L.gelu(x), torch.zeros_like(x))
        with L.native_ops():
            assert torch.allclose(L.gelu(x), F.gelu(x))


def test_layers_override_attention_functional_and_replacement():
    attn = L.MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    args_seen = []

    def my_attention(q, k, v, mask, is_causal, scale):
        args_seen.append((q.shape, is_causal))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)

    native = attn(x, causal=True)
    first = L.register_override("attention", "cpu", my_attention)
    try:
        assert first is None
        assert torch.allclose(attn(x, causal=True), native)
        assert args_seen == [((1, 2, 3, 4), True)]
        replaced = L.register_override("attention", "cpu", my_attention)
        assert replaced is my_attention
    finally:
        assert L.unregister_override("attention", "cpu") is my_attention
    assert L.unregister_override("attention", "cpu") is None


def test_layers_override_rejects_unknown_ops():
    with pytest.raises(KeyError, match="unknown oasr.layers op"):
        L.register_override("lnear", "cuda", lambda m, x: x)
    with pytest.raises(TypeError):
        L.register_override("linear", "cuda", "not callable")
    assert {"linear", "layer_norm", "conv1d", "embedding", "gelu", "attention"} <= L.KNOWN_OPS


def test_layers_env_disables_overrides():
    code = (
        "import torch, oasr.layers as L\n"
        "L.register_override('gelu', 'cpu', lambda t: t * 0)\n"
        "x = torch.ones(3)\n"
        "assert torch.allclose(L.gelu(x), torch.nn.functional.gelu(x))\n"
    )
    env = {"OASR_DISABLE_OVERRIDES": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_layers_meta_construction_and_dtype():
    lin = L.Linear(4, 3, device="meta")
    assert lin.weight.is_meta
    attn = L.MultiHeadAttention(8, 2, dtype=torch.float64)
    assert attn.q_proj.weight.dtype == torch.float64
    with pytest.raises(ValueError):
        L.MultiHeadAttention(10, 4)


@pytest.mark.gpu
def test_layers_cuda_attention_half():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    attn = L.MultiHeadAttention(64, 4)
    x = torch.randn(2, 9, 64)
    ref = attn(x, causal=True)
    attn_gpu = attn.to("cuda", torch.float16)
    cache = L.KVCache()
    out = torch.cat(
        [attn_gpu(x[:, :5].cuda().half(), causal=True, cache=cache),
         attn_gpu(x[:, 5:].cuda().half(), causal=True, cache=cache)], 1
    )
    assert torch.allclose(out.float().cpu(), ref, atol=2e-2)


@pytest.mark.gpu
def test_cuda_layout_paths_and_position_bias_equal_the_plain_ops():
    """The CUDA fast paths for frames held as (B, T, C) (pointwise Conv1d as a GEMM, depthwise
    Conv1d through cuDNN's NHWC kernel) and position_bias give what the plain convolutions / the
    CPU give, in float32."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import torch.nn.functional as F

    from oasr.layers import Conv1d, position_bias
    from oasr.layers.conformer import DepthwiseConv1d

    torch.manual_seed(0)
    dev = torch.device("cuda")
    frames = torch.randn(3, 37, 64, device=dev)  # (B, T, C)
    x = frames.transpose(1, 2)  # (B, C, T) with (B, T, C) memory
    pw = Conv1d(64, 96, 1).to(dev)
    want = F.conv1d(x.contiguous(), pw.weight, pw.bias)
    got = pw(x)
    assert got.stride(1) == 1 and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    dw = DepthwiseConv1d(64, 9, padding=4).to(dev)
    want = F.conv1d(x.contiguous(), dw.weight, dw.bias, padding=4, groups=64)
    assert torch.allclose(dw(x), want, atol=1e-5, rtol=1e-5)
    q, pos = torch.randn(2, 5, 4, 8), torch.randn(2 * 9 - 1, 4, 8)
    mask = torch.rand(2, 1, 5, 9) > 0.3
    cpu = position_bias(q, pos, 0.3, shift_keys=9, mask=mask, fill=-1e4)
    cuda = position_bias(q.to(dev), pos.to(dev), 0.3, shift_keys=9, mask=mask.to(dev), fill=-1e4)
    assert torch.allclose(cuda.cpu(), cpu, atol=1e-4)
