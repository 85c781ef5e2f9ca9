"""Qwen2-Audio on a CUDA device (``pytest -m gpu tests/qwen``): greedy tokens equal to
transformers' generate in float32 on the device, and the bf16 engine path with CUDA graphs and
the paged KV cache (GQA) running batched requests."""

from __future__ import annotations

import pytest
import torch

from oasr.types import DecodingOptions, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
N_NEW = 24


def _chat_text(processor) -> str:
    conversation = [{"role": "user", "content": [{"type": "audio", "audio_url": "x.wav"},
                                                 {"type": "text", "text": "Transcribe the speech."}]}]  # fmt: skip
    return processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def _transformers_greedy(qwen_chat_dir, audios) -> list[list[int]]:
    """The reference: each clip's greedy tokens from transformers' generate in float32 on the
    device, up to (not including) the first stop token."""
    transformers = pytest.importorskip("transformers")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(qwen_chat_dir, dtype=torch.float32)
    hf = hf.cuda().eval()
    processor = transformers.AutoProcessor.from_pretrained(qwen_chat_dir)
    stops = set(hf.generation_config.eos_token_id)
    want = []
    for c in audios:
        inputs = processor(text=_chat_text(processor), audio=[c], sampling_rate=16000, return_tensors="pt").to("cuda")
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=N_NEW, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        new = out.tolist()
        want.append(new[: next((i for i, t in enumerate(new) if t in stops), len(new))])
    return want


def test_greedy_parity_on_cuda(qwen_chat_dir, clips):
    from oasr.checkpoint import load_model

    want = _transformers_greedy(qwen_chat_dir, clips)
    ours = load_model(EngineConfig(ckpt_dir=str(qwen_chat_dir), device="cuda", dtype="float32"))
    got = ours.transcribe(clips, DecodingOptions(max_new_tokens=N_NEW))
    assert [t.segments[0].tokens for t in got] == want


def test_bf16_engine_with_cuda_graphs(qwen_chat_dir, clips):
    from oasr.engine import ASREngine
    from oasr.scheduler import SchedulerConfig

    sc = SchedulerConfig(max_batch_size=4)
    engine = ASREngine(EngineConfig(ckpt_dir=str(qwen_chat_dir), device="cuda", dtype="bfloat16",
                                    max_batch_size=4), scheduler_config=sc)  # fmt: skip
    try:
        waves = list(clips) * 3
        out = engine.transcribe_offline(waves, DecodingOptions(max_new_tokens=N_NEW))
        ex = engine.scheduler.executor
        assert ex.stats["graph_replays"] > 0 and ex.cache.num_heads < engine.model.network.config.text.heads
        assert all(o.text for o in out)
        # one request alone: the same text streamed piece by piece as decoded at once
        single = engine.transcribe_offline(clips[0], DecodingOptions(max_new_tokens=N_NEW))
        updates = list(engine.transcribe_partials(clips[0], DecodingOptions(max_new_tokens=N_NEW)))
        assert updates[-1].is_final and updates[-1].text == single.text and len(updates) > 2
        assert "".join(u.delta for u in updates[:-1]) == single.text
    finally:
        engine.shutdown()


def test_whole_30s_windows_parity_on_cuda(qwen_chat_dir, clips):
    """The batch path on the device in float32: whole 30 s windows (encoder without a padding
    mask, one log-mel batch), a short clip beside them, the prefill's causal SDPA: greedy tokens
    equal to transformers' generate."""
    import numpy as np

    from oasr.checkpoint import load_model

    rng = np.random.default_rng(5)
    t = np.arange(16000 * 30) / 16000
    batch = [(0.3 * np.sin(2 * np.pi * f * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
             for f in (250.0, 390.0)]  # fmt: skip
    batch.insert(1, clips[0])
    want = _transformers_greedy(qwen_chat_dir, batch)
    ours = load_model(EngineConfig(ckpt_dir=str(qwen_chat_dir), device="cuda", dtype="float32"))
    got = ours.transcribe(batch, DecodingOptions(max_new_tokens=N_NEW))
    assert [g.segments[0].tokens for g in got] == want


def test_long_prefill_attention_and_kv_store_on_cuda(monkeypatch):
    """The executor's prefill pieces in bf16 on the device, in the decoder's layouts (views of
    one fused q/k/v output): a long prompt's causal attention (cuDNN first: the size threshold
    lowered to this test's prompt) against float32 math, the last query alone against the whole
    prompt's last row, and the 16-byte-word K/V store byte-equal to ``index_copy_``."""
    from oasr.executors import autoregressive
    from oasr.executors.autoregressive import _causal_attention
    from oasr.kv_cache import store_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, d, t = 4, 8, 128, 773
    monkeypatch.setattr(autoregressive, "CUDNN_PREFILL_WORK", b * h * t * t)
    qkv = torch.randn(b, t, 3 * h * d, device="cuda", generator=g).to(torch.bfloat16)
    q = qkv[..., : h * d].view(b, t, h, d).transpose(1, 2)
    k = qkv[..., h * d : 2 * h * d].view(b, t, h, d)
    v = qkv[..., 2 * h * d :].view(b, t, h, d)
    got = _causal_attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().transpose(1, 2), v.float().transpose(1, 2), is_causal=True
    )
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    last = _causal_attention(q[:, :, -1:], k, v)
    torch.testing.assert_close(last.float(), want[:, :, -1:], atol=2e-2, rtol=2e-2)

    rows = qkv[..., 2 * h * d :].reshape(b * t, h * d)  # strided: the fused output's values
    slots = torch.randperm(2 * b * t, device="cuda", generator=g)[: b * t]
    pool = torch.zeros(2 * b * t, h * d, device="cuda", dtype=torch.bfloat16)
    want_pool = pool.clone().index_copy_(0, slots, rows)
    store_rows(pool, slots, rows)
    assert torch.equal(pool.view(torch.int16), want_pool.view(torch.int16))
