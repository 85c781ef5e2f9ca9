"""WhisperNet against reference implementations (transformers, openai-whisper) on tiny random
weights, plus incremental decoding, beam reordering and alignment-head attention."""

from __future__ import annotations

import base64
import gzip

import numpy as np
import pytest
import torch

from oasr_models_whisper.checkpoints import load_hf, load_openai
from oasr_models_whisper.network import WhisperNetwork
from oasr_models_whisper.nn import WhisperDecoderCache, WhisperNet, build_network

ATOL = 1e-4  # fp32 on CPU against the reference implementations

TOKENS = torch.tensor([[50258, 50259, 50359, 50363, 400, 1000, 17, 9],
                       [50258, 50260, 50359, 50363, 1234, 5, 6, 7]])


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.fixture(scope="module")
def hf_net(hf_tiny_dir) -> WhisperNet:
    return build_network(load_hf(hf_tiny_dir))


@pytest.fixture(scope="module")
def hf_ref(hf_tiny_model, random_mel):
    with torch.no_grad():
        enc = hf_tiny_model.model.encoder(random_mel).last_hidden_state
        logits = hf_tiny_model(encoder_outputs=(enc,), decoder_input_ids=TOKENS).logits
    return enc, logits


def test_network_satisfies_protocol(hf_net):
    assert isinstance(hf_net.dims.n_vocab, int)
    net: WhisperNetwork = hf_net  # structural typing; attributes exist
    assert net.device.type == "cpu" and net.dtype == torch.float32
    assert net.alignment_heads.shape[1] == 2


def test_network_hf_encoder_matches_transformers(hf_net, hf_ref, random_mel):
    enc = hf_net.encode(random_mel)
    err = _max_err(enc, hf_ref[0])
    print(f"hf encoder max abs err {err:.2e}")
    assert enc.shape == (2, 1500, 64)
    assert err < ATOL


def test_network_hf_logits_teacher_forced_and_incremental(hf_net, hf_ref, random_mel):
    enc = hf_net.encode(random_mel)
    ref = hf_ref[1]
    cache = hf_net.new_cache(enc)
    full = hf_net.decode(TOKENS, cache)
    assert full.dtype == torch.float32 and full.shape == ref.shape
    assert cache.length == TOKENS.shape[1]
    err_full = _max_err(full, ref)
    # incremental: a 3-token prompt, then one token at a time, then two at once
    cache = hf_net.new_cache(enc)
    parts = [hf_net.decode(TOKENS[:, :3], cache)]
    for i in range(3, 6):
        parts.append(hf_net.decode(TOKENS[:, i : i + 1], cache))
    parts.append(hf_net.decode(TOKENS[:, 6:], cache))
    inc = torch.cat(parts, dim=1)
    err_inc = _max_err(inc, ref)
    print(f"hf logits max abs err teacher-forced {err_full:.2e} incremental {err_inc:.2e}")
    assert err_full < ATOL and err_inc < ATOL


def test_network_beam_reorder(hf_net, random_mel):
    enc = hf_net.encode(random_mel)
    cache = hf_net.new_cache(enc)
    hf_net.decode(TOKENS[:, :4], cache)
    index = torch.tensor([1, 0, 1])  # rows: old 1, old 0, old 1 (duplicate)
    cache.reorder(index)
    assert cache.length == 4
    step = hf_net.decode(TOKENS[index, 4:6], cache)
    # reference: a fresh cache over the reordered audio and full token rows
    fresh = hf_net.new_cache(enc[index])
    ref = hf_net.decode(TOKENS[index, :6], fresh)[:, 4:6]
    assert _max_err(step, ref) < 1e-5
    # identity reorder is a no-op
    before = [kv.k for kv in cache.self_kv]
    cross_before = cache.cross_kv
    cache.reorder(torch.arange(3))
    assert all(a is kv.k for a, kv in zip(before, cache.self_kv, strict=True))
    assert cache.cross_kv is cross_before


def test_network_decode_past_context_raises(hf_net, random_mel):
    cache = hf_net.new_cache(hf_net.encode(random_mel[:1]))
    with pytest.raises(ValueError, match="context"):
        hf_net.decode(torch.zeros(1, 449, dtype=torch.long), cache)


def test_network_hf_alignment_heads_and_cross_attention(hf_net, hf_tiny_model, random_mel):
    assert hf_net.alignment_heads.tolist() == [[1, 0], [1, 3], [0, 2]]
    enc = hf_net.encode(random_mel)
    weights = hf_net.cross_attention(TOKENS, enc)
    assert weights.shape == (2, 3, TOKENS.shape[1], 1500)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 3, TOKENS.shape[1]), atol=1e-5)
    hf_tiny_model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = hf_tiny_model(
            encoder_outputs=(enc,), decoder_input_ids=TOKENS, output_attentions=True
        )
    ref = torch.stack([out.cross_attentions[layer][:, head] for layer, head in [[1, 0], [1, 3], [0, 2]]], 1)
    err = _max_err(weights, ref)
    print(f"hf cross-attention weights max abs err {err:.2e}")
    assert err < 1e-5


def test_network_openai_logits_and_alignment(openai_tiny, random_mel):
    import whisper.model as wm

    ref_model, path = openai_tiny
    heads_mask = np.zeros((2, 4), dtype=bool)
    heads_mask[1, [1, 2]] = True
    heads_mask[0, 3] = True
    encoded = base64.b85encode(gzip.compress(heads_mask.tobytes()))
    net = build_network(load_openai(path, alignment_heads=encoded))
    assert net.alignment_heads.tolist() == [[0, 3], [1, 1], [1, 2]]
    tokens = TOKENS.clone()
    tokens[tokens >= 51864] = 50257
    with torch.no_grad():
        ref_enc = ref_model.encoder(random_mel)
        ref_logits = ref_model.decoder(tokens, ref_enc)
    enc = net.encode(random_mel)
    cache = net.new_cache(enc)
    logits = torch.cat([net.decode(tokens[:, :5], cache), net.decode(tokens[:, 5:], cache)], 1)
    e_enc, e_log = _max_err(enc, ref_enc), _max_err(logits, ref_logits)
    print(f"openai encoder max abs err {e_enc:.2e} logits {e_log:.2e}")
    assert e_enc < ATOL and e_log < ATOL

    # alignment weights vs openai's cross-attention qk (softmaxed), as its timing code does
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        block.cross_attn.register_forward_hook(
            lambda _m, _i, outs, idx=i: captured.__setitem__(idx, outs[1])
        )
        for i, block in enumerate(ref_model.decoder.blocks)
    ]
    try:
        with torch.no_grad(), wm.disable_sdpa():
            ref_model.decoder(tokens, ref_enc)
    finally:
        for h in hooks:
            h.remove()
    ref_w = torch.stack([captured[layer][:, head].float().softmax(-1) for layer, head in [[0, 3], [1, 1], [1, 2]]], 1)
    err = _max_err(net.cross_attention(tokens, enc), ref_w)
    print(f"openai cross-attention weights max abs err {err:.2e}")
    assert err < 1e-5


def test_network_cache_type(hf_net, random_mel):
    cache = hf_net.new_cache(hf_net.encode(random_mel[:1]))
    assert isinstance(cache, WhisperDecoderCache)
    assert cache.length == 0 and cache.batch_size == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_network_cuda_matches_cpu(hf_tiny_dir, random_mel, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    loaded = load_hf(hf_tiny_dir)
    cpu = build_network(loaded)
    gpu = build_network(loaded, device="cuda", dtype=dtype)
    assert gpu.dtype == dtype and gpu.device.type == "cuda"
    ref_enc = cpu.encode(random_mel)
    ref = cpu.decode(TOKENS, cpu.new_cache(ref_enc))
    enc = gpu.encode(random_mel.cuda())
    cache = gpu.new_cache(enc)
    out = torch.cat([gpu.decode(TOKENS[:, :4].cuda(), cache), gpu.decode(TOKENS[:, 4:].cuda(), cache)], 1)
    assert out.dtype == torch.float32
    tol = {torch.float32: 2e-3, torch.float16: 3e-2, torch.bfloat16: 2e-1}[dtype]
    err = _max_err(out.cpu(), ref)
    print(f"cuda {dtype} logits max abs err {err:.2e}")
    assert err < tol
    w = gpu.cross_attention(TOKENS.cuda(), enc)
    assert torch.allclose(w.sum(-1).cpu(), torch.ones(w.shape[:3]), atol=1e-3)


RELEASED = {
    # name: (n_mels, d, heads, enc layers, dec layers, n_vocab)
    "tiny.en": (80, 384, 6, 4, 4, 51864),
    "base": (80, 512, 8, 6, 6, 51865),
    "small.en": (80, 768, 12, 12, 12, 51864),
    "medium": (80, 1024, 16, 24, 24, 51865),
    "large": (80, 1280, 20, 32, 32, 51865),
    "large-v3": (128, 1280, 20, 32, 32, 51866),
    "turbo": (128, 1280, 20, 32, 4, 51866),
    "distil-large-v3": (128, 1280, 20, 32, 2, 51866),
    "distil-medium.en": (80, 1024, 16, 24, 2, 51864),
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_network_released_sizes_state_dict_layout(name):
    from oasr_models_whisper.checkpoints import expected_shapes, guess_size_name
    from oasr_models_whisper.network import WhisperDims

    m, d, h, le, ld, v = RELEASED[name]
    dims = WhisperDims(m, 1500, d, h, le, v, 448, d, h, ld)
    net = WhisperNet(dims, device="meta")  # shapes only, nothing allocated
    shapes = {k: tuple(t.shape) for k, t in net.state_dict().items()}
    assert shapes == expected_shapes(dims)
    assert net.alignment_heads.shape == (h * (ld - ld // 2), 2)
    assert guess_size_name(dims) == name
