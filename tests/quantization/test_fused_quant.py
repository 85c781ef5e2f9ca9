"""The W8A8 decode-step fusions, on the CPU: the self-attention q/k/v projections of a quantized
Whisper decoder as one QuantizedLinear (weights and per-channel scales concatenated: the same
math as three), the fp8 bias added inside ``torch._scaled_mm`` and the ``quantize_activations``
op's native path. The CUDA kernel is checked in test_fused_quant_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import whisper_net  # noqa: E402


def _quantized_step_model(method: str):
    from oasr.quantization.apply import quantize_module
    from oasr_models_whisper.engine_adapter import WhisperStepModel

    net = whisper_net(seed=1, d=64)
    quantize_module(net, method)
    return net, WhisperStepModel(net)


@pytest.mark.parametrize("method", ["fp8_w8a8", "int8_w8a8"])
def test_fused_quantized_qkv_is_the_three_projections(method):
    """float64 input (the reference path of every QuantizedLinear): the fused layer's columns
    are exactly the q, k, v layers' outputs (k without a bias: zeros added)."""
    net, step = _quantized_step_model(method)
    fused = step._fuse_self_qkv_quantized()
    assert fused is not None and len(fused) == len(net.decoder.layers)
    torch.manual_seed(0)
    h = torch.randn(3, 2, 64, dtype=torch.float64)
    for layer, block in zip(fused, net.decoder.layers, strict=True):
        att = block.self_attn
        want = torch.cat([att.q_proj(h), att.k_proj(h), att.v_proj(h)], dim=-1)
        torch.testing.assert_close(layer(h), want, rtol=1e-12, atol=1e-12)


def test_fused_quantized_qkv_off_with_the_switch(monkeypatch):
    monkeypatch.setenv("OASR_FP8_FUSED_QUANT", "0")
    _, step = _quantized_step_model("fp8_w8a8")
    assert step._fuse_self_qkv_quantized() is None


def test_fp8_bias_in_the_gemm_matches_the_separate_add(monkeypatch):
    """float32 on the CPU: bias inside ``_scaled_mm`` (one rounding) against the separate add
    (``OASR_FP8_FUSED_QUANT=0``), both against the float64 reference."""
    import oasr.layers as L
    from oasr.layers.quantized import QuantizedLinear, _scaled_mm_takes_bias
    from oasr.quantization.numerics import reference_linear

    torch.manual_seed(0)
    lin = L.Linear(64, 48)
    q = QuantizedLinear.from_linear(lin, "fp8_w8a8")
    x = torch.randn(7, 64)
    ref = reference_linear(x, q.weight_q, q.weight_scale, q.bias, "fp8")
    fused = q(x)
    monkeypatch.setenv("OASR_FP8_FUSED_QUANT", "0")
    assert not _scaled_mm_takes_bias("cpu", torch.float32)
    separate = q(x)
    scale = ref.abs().max().item()
    for got in (fused, separate):
        assert (got.double() - ref).abs().max().item() <= 1e-5 * scale
    torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6 * scale)


def test_quantize_activations_op_on_cpu_is_the_native_function():
    from oasr.layers.quantized import quantize_activations_op
    from oasr.quantization.numerics import quantize_activations

    torch.manual_seed(0)
    x = torch.randn(5, 40)
    for fmt in ("fp8", "int8"):
        q, s = quantize_activations_op(x, fmt)
        q0, s0 = quantize_activations(x, fmt)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
