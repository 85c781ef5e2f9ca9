"""The fused ops' native paths (CPU): each equals the sequence of ops the models ran before it
existed, bit for bit, overrides dispatch and fall back, and the models that call the fused ops
give unchanged outputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import oasr.layers as L
from oasr.layers.conformer import ConformerConvModule, DepthwiseConv1d
from oasr.layers.llm import RMSNorm


def _ln(d, seed=0, dtype=torch.float32):
    norm = L.LayerNorm(d, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g))
        norm.bias.copy_(torch.randn(d, generator=g))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_native_is_add_then_norm(dtype) -> None:
    x, r = torch.randn(3, 5, 64).to(dtype), torch.randn(3, 5, 64).to(dtype)
    norm = _ln(64, dtype=dtype)
    s, y = L.add_norm(x, r, norm)
    assert torch.equal(s, x + r)
    assert torch.equal(y, F.layer_norm(x + r, (64,), norm.weight, norm.bias, norm.eps))
    s, y = L.add_norm(x, None, norm)
    assert s is x and torch.equal(y, norm(x))
    rms = RMSNorm(64, dtype=dtype)
    s, y = L.add_norm(x, r, rms)
    assert torch.equal(y, rms(x + r))


def test_add_norm_goes_through_the_norm_op_override() -> None:
    """The native path calls the norm module, so a ``layer_norm`` override still applies."""
    seen = []

    def fake_ln(module, x):
        seen.append(x.shape)
        return NotImplemented

    with L.override("layer_norm", "cpu", fake_ln):
        L.add_norm(torch.ones(2, 8), torch.ones(2, 8), L.LayerNorm(8))
    assert seen == [(2, 8)]


def test_fused_ops_dispatch_to_overrides_and_fall_back() -> None:
    calls = []

    def fake(*args):
        calls.append(len(args))
        return "kernel" if len(calls) == 1 else NotImplemented

    x = torch.randn(4, 8)
    with L.override("bias_act", "cpu", fake):
        assert L.bias_act(x, None, "gelu") == "kernel"
        torch.testing.assert_close(L.bias_act(x, None, "gelu"), F.gelu(x), atol=0, rtol=0)
    assert calls == [3, 3]
    with L.override("bias_act", "cpu", fake):
        with L.native_ops():
            assert torch.equal(L.bias_act(x, None, "silu"), F.silu(x))
    assert calls == [3, 3]


def test_bias_act_native_and_errors() -> None:
    x, b = torch.randn(3, 7, 16), torch.randn(16)
    assert torch.equal(L.bias_act(x, b, "gelu"), F.gelu(x + b))
    assert torch.equal(L.bias_act(x, b, "silu"), F.silu(x + b))
    assert torch.equal(L.bias_act(x, b, "swish"), F.silu(x + b))
    with pytest.raises(ValueError, match="relu"):
        L.bias_act(x, b, "relu")


@pytest.mark.parametrize("padding", [0, 7])
def test_glu_depthwise_conv1d_native(padding) -> None:
    conv = DepthwiseConv1d(12, 15, padding=padding)
    x = torch.randn(2, 24, 40)
    expect = F.conv1d(F.glu(x, dim=1), conv.weight, conv.bias, padding=padding, groups=12)
    assert torch.equal(L.glu_depthwise_conv1d(x, conv), expect)


@pytest.mark.parametrize("causal", [False, True])
def test_conformer_conv_module_unchanged(causal) -> None:
    torch.manual_seed(0)
    mod = ConformerConvModule(16, 7, causal=causal).eval()
    with torch.no_grad():
        mod.norm.running_mean.normal_()
        mod.norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(3, 20, 16)
    valid = torch.arange(20)[None, :] < torch.tensor([20, 13, 5])[:, None]
    out, _ = mod(x, valid=valid)
    # the module's computation written out as it was before the fused op
    h = x.transpose(1, 2).masked_fill(~valid[:, None, :], 0.0)
    if causal:
        h = torch.cat([h.new_zeros(3, 16, 6), h], dim=2)
    h = F.glu(F.conv1d(h, mod.pointwise_conv1.weight, mod.pointwise_conv1.bias), dim=1)
    h = F.conv1d(h, mod.depthwise_conv.weight, mod.depthwise_conv.bias, padding=mod.depthwise_conv.padding, groups=16)
    h = F.batch_norm(h, mod.norm.running_mean, mod.norm.running_var, mod.norm.weight, mod.norm.bias, False, 0.0, 1e-5)
    h = F.conv1d(F.silu(h), mod.pointwise_conv2.weight, mod.pointwise_conv2.bias)
    expect = h.masked_fill(~valid[:, None, :], 0.0).transpose(1, 2)
    assert torch.equal(out, expect)


def test_log_mel_power_native_and_whisper_frontend_unchanged() -> None:
    from oasr.features.whisper import HOP_LENGTH, N_FFT, log_mel_spectrogram, mel_filters

    audio = torch.randn(2, 16000) * 0.1
    audio[1, :4000] = 0
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
    filt = torch.from_numpy(mel_filters(80))
    mags = (stft[..., :-1].abs() ** 2).contiguous()
    old = torch.clamp(filt @ mags, min=1e-10).log10()
    assert torch.equal(L.log_mel_power(stft, filt, stft.shape[-1] - 1), old)
    peak = old.amax(dim=(-2, -1), keepdim=True)
    assert torch.equal(log_mel_spectrogram(audio, 80), (torch.maximum(old, peak - 8.0) + 4.0) / 4.0)


# ------------------------------------------------------------------ paged prefill attention
def _paged_case(b=3, h=4, hkv=2, t=5, d=8, bs=4, extra=(0, 3, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    n = [e + t for e in extra]
    nb = -(-max(n) // bs) + 1
    num_blocks = b * nb + 1
    kp = torch.randn(num_blocks, bs, hkv, d, generator=g)
    vp = torch.randn(num_blocks, bs, hkv, d, generator=g)
    q = torch.randn(b, h, t, d, generator=g)
    tables = (torch.randperm(num_blocks - 1, generator=g) + 1)[: b * nb].view(b, nb)
    return q, kp, vp, tables, torch.tensor(n)


def _reference(q, kp, vp, tables, lengths, scale=None):
    """Float64 loops: query i of row b at position lengths[b] - T + i sees keys 0..position."""
    b, h, t, d = q.shape
    bs, hkv = kp.shape[1], kp.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    for r in range(b):
        n = int(lengths[r])
        slots = [(int(tables[r, j // bs]), j % bs) for j in range(n)]
        for hh in range(h):
            kv = hh // (h // hkv)
            k = torch.stack([kp[s, o, kv] for s, o in slots]).double()
            v = torch.stack([vp[s, o, kv] for s, o in slots]).double()
            for i in range(t):
                pos = n - t + i
                w = torch.softmax((k[: pos + 1] @ q[r, hh, i].double()) * scale, dim=0)
                out[r, hh, i] = w @ v[: pos + 1]
    return out


def test_paged_prefill_attention_native_matches_reference() -> None:
    args = _paged_case()
    out = L.paged_prefill_attention(*args)
    assert out.shape == (3, 4, 5, 8)
    torch.testing.assert_close(out.double(), _reference(*args), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(L.paged_prefill_attention(*args, 0.7).double(), _reference(*args, 0.7),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_paged_prefill_attention_equals_the_executors_former_prefill() -> None:
    """A prefill (positions 0..t-1, lengths t) gives exactly what the executor computed before
    the op: gathered keys, a causal mask by position, grouped attention."""
    q, kp, vp, tables, _ = _paged_case(extra=(0, 0, 0))
    t = q.shape[2]
    lengths = torch.full((3,), t)
    b, nb = tables.shape
    bs = kp.shape[1]
    kk = kp.index_select(0, tables.reshape(-1)).view(b, nb * bs, 2, 8).transpose(1, 2)
    vv = vp.index_select(0, tables.reshape(-1)).view(b, nb * bs, 2, 8).transpose(1, 2)
    positions = torch.arange(t).expand(b, t)
    keys = torch.arange(nb * bs)
    mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
    from oasr.layers.attention import grouped_attention

    assert torch.equal(L.paged_prefill_attention(q, kp, vp, tables, lengths), grouped_attention(q, kk, vv, mask))


# ------------------------------------------------------------------ Whisper with add_norm
def _tiny_whisper():
    from oasr_models_whisper.network import WhisperDims
    from oasr_models_whisper.nn import WhisperNet

    dims = WhisperDims(n_mels=16, n_audio_ctx=20, n_audio_state=32, n_audio_head=4, n_audio_layer=2,
                       n_vocab=50, n_text_ctx=12, n_text_state=32, n_text_head=4, n_text_layer=2)  # fmt: skip
    torch.manual_seed(0)
    net = WhisperNet(dims)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    return net.eval()


def test_whisper_encoder_and_decoder_unchanged() -> None:
    from oasr.layers import gelu

    net = _tiny_whisper()
    mel = torch.randn(2, 16, 40)
    enc = net.encoder
    # the encoder as it was written before add_norm
    x = gelu(enc.conv1(mel))
    x = gelu(enc.conv2(x)).transpose(1, 2).contiguous() + enc.positional_embedding
    for block in enc.layers:
        x = x + block.self_attn(block.self_attn_norm(x))
        x = x + block.mlp(block.mlp_norm(x))
    feats = net.encode(mel)
    assert torch.equal(feats, enc.final_norm(x))
    # the decoder: two calls through the cache against the former loop
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cache = net.new_cache(feats)
    logits = torch.cat([net.decode(tokens[:, :2], cache), net.decode(tokens[:, 2:], cache)], dim=1)
    dec = net.decoder
    x = dec.embed_tokens(tokens) + dec.positional_embedding[:3]
    for block in dec.layers:
        x = x + block.self_attn(block.self_attn_norm(x), causal=True)
        x = x + block.cross_attn(block.cross_attn_norm(x), feats)
        x = x + block.mlp(block.mlp_norm(x))
    expect = dec.embed_tokens.unembed(dec.final_norm(x)).float()
    torch.testing.assert_close(logits, expect, atol=1e-5, rtol=1e-5)  # cached vs full: same math


def test_encoder_graphs_run_eagerly_on_cpu() -> None:
    from oasr_models_whisper.encoder_graphs import EncoderGraphs

    net = _tiny_whisper()
    graphs = EncoderGraphs(net)
    mel = torch.randn(3, 16, 40)
    assert torch.equal(graphs(mel), net.encode(mel))
    assert graphs.stats == {"captures": 0, "replays": 0, "eager": 1}
    assert graphs.bucket(3) == 4 and graphs.bucket(64) == 64 and graphs.bucket(65) is None


def test_fused_op_names_are_declared() -> None:
    for name in ("add_norm", "bias_act", "glu_depthwise_conv1d", "log_mel_power", "paged_prefill_attention"):
        assert name in L.KNOWN_OPS
    assert math.isfinite(float(L.bias_act(torch.zeros(1), None, "gelu")))
