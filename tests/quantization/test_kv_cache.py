"""The fp8 KV cache: the format (per key/value vector scales), the paged attention over it
against a float64 reference of the same stored values, and the engine with it on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import rel_err  # noqa: E402

from oasr.kv_cache import PagedKVCache  # noqa: E402
from oasr.quantization.numerics import FP8_MAX, dequantize_kv, quantize_kv  # noqa: E402


def test_kv_format_is_per_vector():
    x = torch.randn(7, 3, 16) * torch.logspace(-3, 2, 7)[:, None, None]
    q, s = quantize_kv(x)
    assert q.dtype is torch.uint8 and s.shape == (7, 3)
    back = dequantize_kv(q, s, torch.float32)
    # every vector keeps e4m3's relative precision whatever its magnitude
    assert float(((back - x).abs().amax(-1) / x.abs().amax(-1)).max()) <= 2**-4
    assert torch.allclose(q.view(torch.float8_e4m3fn).float().abs().amax(-1), torch.full((7, 3), FP8_MAX))


def _filled(fp8: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(2, 9, 4, 2, 16, dtype=torch.float32, kv_dtype="fp8" if fp8 else None)
    lengths = torch.tensor([5, 11])
    tables = torch.tensor([[3, 1, 0], [2, 5, 7]])
    k = torch.randn(16, 2, 16, generator=g) * 3
    v = torch.randn(16, 2, 16, generator=g)
    slots = []
    for row, n in enumerate(lengths.tolist()):
        slots += [int(tables[row, p // 4]) * 4 + p % 4 for p in range(n)]
    slots_t = torch.tensor(slots)
    for layer in range(2):
        cache.write(layer, slots_t, k, v)
    return cache, tables, lengths, slots_t


def test_fp8_cache_reads_back_what_it_stored():
    cache, tables, lengths, slots = _filled(fp8=True)
    plain, *_ = _filled(fp8=False)
    assert cache.k[0].dtype is torch.uint8 and cache.nbytes < plain.nbytes / 3
    kk, vv = cache.gather(1, tables)
    pk, pv = plain.gather(1, tables)
    for row, n in enumerate(lengths.tolist()):
        assert rel_err(kk[row, :, :n], pk[row, :, :n]) < 2**-4
        assert rel_err(vv[row, :, :n], pv[row, :, :n]) < 2**-4
    assert PagedKVCache.bytes_per_block(2, 4, 2, 16, 4, "fp8") * 9 == cache.nbytes


def test_paged_decode_attention_fp8_matches_float64_reference():
    """The native fp8 op against softmax(q k^T) v in float64 over the same dequantized keys and
    values: the fp8 rounding is in the stored values, so only float32 arithmetic differs."""
    from oasr.layers.quantized import paged_decode_attention_fp8

    cache, tables, lengths, _ = _filled(fp8=True, seed=1)
    q = torch.randn(2, 2, 1, 16)
    out = paged_decode_attention_fp8(q, cache.k[0], cache.v[0], cache.k_scale[0], cache.v_scale[0],
                                     tables, lengths)  # fmt: skip
    k64, v64, t64 = cache.dequantized_blocks(0, tables)
    for row, n in enumerate(lengths.tolist()):
        blocks = t64[row]
        kk = k64[blocks].reshape(-1, 2, 16)[:n].double()  # (n, H, D)
        vv = v64[blocks].reshape(-1, 2, 16)[:n].double()
        scores = torch.einsum("hd,nhd->hn", q[row, :, 0].double(), kk) * 16**-0.5
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), vv)
        assert rel_err(out[row, :, 0], want) < 1e-5


def test_engine_with_fp8_kv_cache():
    """A random-weight Whisper through the continuous-batching executor with an fp8 cache:
    the pools are fp8, and the greedy tokens mostly agree with the float32 cache's (the keys
    and values are rounded to e4m3, so a near tie may flip)."""
    import numpy as np

    from benchmarks.synthetic import build_models
    from oasr.engine import ASREngine
    from oasr.scheduler import SchedulerConfig
    from oasr.types import DecodingOptions, EngineConfig

    _, asr = build_models("smoke", "cpu", "float32", 2, seed=3)
    tok = asr.tokenizer
    rng = np.random.default_rng(0)
    audios = [(0.1 * rng.standard_normal(int(s * 16000))).astype(np.float32) for s in (3, 5)]
    opts = DecodingOptions.build(language="en", max_new_tokens=12, suppress_tokens=(tok.eot,),
                                 no_speech_threshold=None, logprob_threshold=None, vad_gate=False,
                                 compression_ratio_threshold=None)  # fmt: skip
    tokens = {}
    for kv in (None, "fp8"):
        eng = ASREngine(EngineConfig(max_batch_size=2, kv_cache_dtype=kv), model=asr,
                        scheduler_config=SchedulerConfig(max_batch_size=2))  # fmt: skip
        outs = eng.transcribe_outputs(audios, decoding=opts)
        assert all(o.ok for o in outs), [o.error for o in outs]
        cache = eng.scheduler.executor.cache
        assert cache.fp8 == (kv == "fp8") and eng.scheduler.executor.stats["tokens"] > 0
        tokens[kv] = [t for o in outs for s in o.transcript.segments for t in s.tokens]
        eng.shutdown()
    same = sum(a == b for a, b in zip(tokens[None], tokens["fp8"], strict=False)) / max(1, len(tokens[None]))
    assert len(tokens[None]) > 10 and same >= 0.7, same


@pytest.mark.parametrize("bad", ["int8", "fp16"])
def test_cache_refuses_other_formats(bad):
    from oasr.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        PagedKVCache(1, 3, 4, 1, 8, kv_dtype=bad)
