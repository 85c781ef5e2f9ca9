"""bfloat16 long self-attention under int8 on the CPU (``MultiHeadAttention.attention_dtype``,
set by ``quantize_module``; ``OASR_INT8_BF16_ATTENTION=0`` keeps float32): only unmasked CPU
attention of at least LONG_ATTENTION positions changes, within bfloat16's rounding of the
float64 result; decode-step shapes and masked attention stay bit-identical."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import whisper_net  # noqa: E402

from oasr.layers.attention import LONG_ATTENTION, MultiHeadAttention  # noqa: E402


def _pair(seed: int = 0) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    torch.manual_seed(seed)
    ref = MultiHeadAttention(64, 4, key_bias=False)
    low = MultiHeadAttention(64, 4, key_bias=False)
    low.load_state_dict(ref.state_dict())
    low.attention_dtype = torch.bfloat16
    return ref.eval(), low.eval()


@torch.inference_mode()
def test_long_attention_runs_in_bf16_within_its_rounding():
    ref, low = _pair()
    t = 320
    assert t * t >= LONG_ATTENTION
    x = torch.randn(2, t, 64)
    want = ref.double()(x.double())
    ref.float()
    got, f32 = low(x), ref(x)
    assert got.dtype == torch.float32 and got.shape == f32.shape
    err_bf16 = (got.double() - want).abs().max().item()
    err_f32 = (f32.double() - want).abs().max().item()
    assert not torch.equal(got, f32)  # the bf16 path ran
    assert err_f32 < 1e-5
    # bf16 keeps 8 significant bits: inputs and the output rounded to 2**-9 relative
    scale = want.abs().max().item()
    assert err_bf16 <= 0.02 * scale, (err_bf16, scale)


@torch.inference_mode()
def test_short_and_masked_attention_stay_float32_exactly():
    ref, low = _pair(1)
    step = torch.randn(3, 1, 64)  # a decode step: 1 query
    assert torch.equal(low(step), ref(step))
    memory = torch.randn(3, 200, 64)  # 1 x 200 cross-attention, under the threshold
    assert torch.equal(low(step, memory), ref(step, memory))
    x = torch.randn(2, 300, 64)
    pad = torch.zeros(2, 300, dtype=torch.bool)
    pad[1, 250:] = True  # a key padding mask: the masked path is not changed
    assert torch.equal(low(x, key_padding_mask=pad), ref(x, key_padding_mask=pad))


def test_quantize_sets_it_where_it_applies(monkeypatch):
    from oasr.quantization import apply
    from oasr.quantization.apply import ATTENTION_ENV, attention_dtype_applies, quantize_model

    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    monkeypatch.setattr(apply, "_cpu_has_bf16", lambda: True)
    assert attention_dtype_applies("int8_w8a8", "cpu")
    assert not attention_dtype_applies("int8_w8a8", "cuda")
    assert not attention_dtype_applies("fp8_w8a8", "cpu")
    model = SimpleNamespace(name="whisper-test", network=whisper_net(seed=2))
    quantize_model(model, "int8_w8a8")
    mhas = [m for m in model.network.modules() if isinstance(m, MultiHeadAttention)]
    assert mhas and all(m.attention_dtype is torch.bfloat16 for m in mhas)

    monkeypatch.setenv(ATTENTION_ENV, "0")
    assert not attention_dtype_applies("int8_w8a8", "cpu")
    model = SimpleNamespace(name="whisper-test", network=whisper_net(seed=2))
    quantize_model(model, "int8_w8a8")
    assert all(m.attention_dtype is None for m in model.network.modules() if isinstance(m, MultiHeadAttention))

    monkeypatch.delenv(ATTENTION_ENV)
    monkeypatch.setattr(apply, "_cpu_has_bf16", lambda: False)  # no native bf16: float32 is faster
    assert not attention_dtype_applies("int8_w8a8", "cpu")


@torch.inference_mode()
def test_causal_long_attention():
    ref, low = _pair(2)
    x = torch.randn(1, 300, 64)
    got, f32 = low(x, causal=True), ref(x, causal=True)
    # causal self-attention builds no mask tensor (is_causal): the bf16 path runs for it too
    assert not torch.equal(got, f32)
    assert (got - f32).abs().max().item() <= 0.02 * f32.abs().max().item()
