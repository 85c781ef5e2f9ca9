"""What the batch-32 path runs, checked on the CPU against the one-at-a-time computation: the
driver's batched log-mel (windows of one length in one STFT, the windows' order kept), whole 30 s
windows encoded without a padding mask, and the executor's prefill attention over the prompt's
own keys/values (causal SDPA) against the paged-pool attention it replaces."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from oasr.checkpoint import load_model  # noqa: E402
from oasr.executors.autoregressive import Window, _causal_attention  # noqa: E402
from oasr.features.whisper import N_FRAMES, N_SAMPLES  # noqa: E402
from oasr.kv_cache import rows_fit_words, store_rows  # noqa: E402
from oasr.layers.attention import _paged_prefill_attention_native  # noqa: E402
from oasr.types import EngineConfig  # noqa: E402
from oasr_models_qwen.engine_adapter import QwenDriver, QwenStepModel, window_mel  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(qwen_chat_dir):
    return load_model(EngineConfig(ckpt_dir=str(qwen_chat_dir), device="cpu", dtype="float32"))


def _windows(waves: list[np.ndarray]) -> list[Window]:
    return [Window(None, state=SimpleNamespace(wave=torch.as_tensor(w)), info=(0, len(w))) for w in waves]  # type: ignore[arg-type]


def test_batched_log_mel_equals_one_at_a_time(model):
    rng = np.random.default_rng(3)
    lengths = (N_SAMPLES, 20000, N_SAMPLES, 20000, 31111)  # equal lengths apart: the order is restored
    waves = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in lengths]
    driver = QwenDriver(model)
    mel, frames = driver.encoder_inputs(_windows(waves))
    assert mel.shape == (len(waves), 128, N_FRAMES)
    for k, w in enumerate(waves):
        want, n = window_mel(torch.as_tensor(w), 128)
        assert torch.equal(mel[k], want) and int(frames[k]) == n
    # whole 30 s windows only: no frame counts, the encoder runs without a padding mask
    (full,) = driver.encoder_inputs(_windows([waves[0], waves[2]]))
    assert torch.equal(full, mel[[0, 2]])


def test_full_windows_encode_without_a_mask(model):
    rng = np.random.default_rng(4)
    waves = [(0.1 * rng.standard_normal(N_SAMPLES)).astype(np.float32) for _ in range(2)]
    step = QwenStepModel(model)
    inputs = QwenDriver(model).encoder_inputs(_windows(waves))
    assert len(inputs) == 1
    with torch.no_grad():
        got = step.encode(inputs)
        masked = step.encode((inputs[0], torch.full((2,), N_FRAMES)))  # every key kept
    torch.testing.assert_close(got, masked, atol=1e-5, rtol=1e-5)
    assert got.shape[1] == 750 and got.abs().mean() > 0.1


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_prefill_attends_over_its_own_keys(kv_heads):
    """The executor's prefill (positions 0 .. T-1 of every row) reads the new keys/values as
    given: equal to the attention over the paged pools they were written to."""
    g = torch.Generator().manual_seed(kv_heads)
    b, h, t, d, bs = 3, 4, 37, 16, 8
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, t, kv_heads, d, generator=g)
    v = torch.randn(b, t, kv_heads, d, generator=g)
    nb = -(-t // bs)
    tables = torch.randperm(b * nb, generator=g).view(b, nb) + 1  # block 0 unused, as in the pool
    k_pool = torch.zeros(b * nb + 1, bs, kv_heads, d)
    v_pool = torch.zeros_like(k_pool)
    pos = torch.arange(t)
    slots = (tables.gather(1, (pos // bs).expand(b, t)) * bs + pos % bs).reshape(-1)
    k_pool.view(-1, kv_heads, d).index_copy_(0, slots, k.reshape(b * t, kv_heads, d))
    v_pool.view(-1, kv_heads, d).index_copy_(0, slots, v.reshape(b * t, kv_heads, d))
    want = _paged_prefill_attention_native(q, k_pool, v_pool, tables, torch.full((b,), t), None)
    torch.testing.assert_close(_causal_attention(q, k, v), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_prefill_last_queries_see_their_causal_keys(kv_heads):
    """The last ``tq`` positions' queries alone (the decoder's last layer in a prefill that reads
    only the last hidden state) equal those rows of the whole prompt's causal attention."""
    g = torch.Generator().manual_seed(10 + kv_heads)
    b, h, t, d = 2, 4, 29, 16
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, t, kv_heads, d, generator=g)
    v = torch.randn(b, t, kv_heads, d, generator=g)
    whole = _causal_attention(q, k, v)
    for tq in (1, 5):
        got = _causal_attention(q[:, :, -tq:], k, v)
        torch.testing.assert_close(got, whole[:, :, -tq:], atol=1e-5, rtol=1e-5)


def test_store_rows_moves_the_same_bytes_as_index_copy():
    """The cache's K/V write (16-byte words where the layouts allow) against index_copy_:
    bf16 rows from a strided view of a fused projection (the values' columns), and a layout
    that cannot be read as words (falls back to the element copy)."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, 48, generator=g).to(torch.bfloat16)
    rows = qkv[:, 32:]  # row stride 48, offset 32: 16-byte aligned
    index = torch.tensor([7, 2, 9, 0, 4, 11])
    for src in (rows, qkv[:, 1:17], torch.randn(6, 3, generator=g)):
        dst = torch.randn(12, src.shape[1], generator=g).to(src.dtype)
        want = dst.clone().index_copy_(0, index, src)
        store_rows(dst, index, src)
        assert torch.equal(dst.view(torch.uint8) if dst.dtype == torch.bfloat16 else dst,
                           want.view(torch.uint8) if want.dtype == torch.bfloat16 else want)  # fmt: skip
    assert rows_fit_words(rows) and not rows_fit_words(qkv[:, 1:17])


def test_decoder_last_position_only(model):
    """``Qwen2Decoder(last_only=True)`` (the executor's prefill) equals the last position of the
    whole forward, and stores every position's keys/values."""
    net = model.network
    dims = net.config.text
    g = torch.Generator().manual_seed(8)
    b, t = 2, 23
    x = torch.randn(b, t, dims.hidden, generator=g)
    positions = torch.arange(t).expand(b, t)
    stored: dict[tuple[bool, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(last_only):  # noqa: ANN001, ANN202
        def run(li, q, k, v):  # noqa: ANN001, ANN202
            stored[(last_only, li)] = (k.clone(), v.clone())
            shape = (b, t, dims.kv_heads, dims.head_dim)
            return _causal_attention(q, k.reshape(shape), v.reshape(shape))

        return run

    with torch.no_grad():
        whole = net.decoder(x, positions, attend(False))
        last = net.decoder(x, positions, attend(True), last_only=True)
    assert last.shape == (b, 1, dims.hidden)
    torch.testing.assert_close(last, whole[:, -1:], atol=1e-5, rtol=1e-5)
    for li in range(dims.layers):
        for a, w in zip(stored[(True, li)], stored[(False, li)], strict=True):
            torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)
