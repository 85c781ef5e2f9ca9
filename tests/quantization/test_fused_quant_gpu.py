"""oasr-kernels' one-launch per-token activation quantization (pytest -m gpu): the same bytes
and scales as the native five ops, every dtype, vectorised and scalar rows, zero rows; and a
quantized Whisper decode step with every fusion (the kernel, the bias in ``_scaled_mm``, the
fused q/k/v) against the path without them (``OASR_FP8_FUSED_QUANT=0``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from qact_cases import tie_rows  # noqa: E402
from qhelpers import rel_err, whisper_net  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
# 9000 rows: a warp per row on an H200 (the encoder batches' plan), the others larger groups
@pytest.mark.parametrize("shape", [(1, 1280), (64, 5120), (1500, 1280), (7, 1003), (3, 8),
                                   (9000, 1280), (9000, 5120)])  # fmt: skip
def test_kernel_matches_native_bytes_and_scales(fmt, dtype, shape):
    pytest.importorskip("cupy")
    from oasr.quantization.numerics import quantize_activations
    from oasr_kernels.quantize_act import quantize_activations_cuda

    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * torch.rand(shape[0], 1, device="cuda") * 10).to(
        getattr(torch, dtype)
    )
    x[0, : shape[1] // 2] *= 1e-4  # small values: e4m3 subnormals
    if shape[0] > 2:
        x[1].zero_()  # an all-zero row: the smallest scale
    got = quantize_activations_cuda(x, fmt)
    assert got is not NotImplemented
    q, s = got
    q0, s0 = quantize_activations(x, fmt)
    assert q.dtype == q0.dtype and s.shape == s0.shape
    assert torch.equal(s, s0)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("width,copies", [(256, 1), (1280, 1), (1280, 3000)])
def test_kernel_rounds_every_case_as_native(fmt, dtype, width, copies):
    """Exact quotients on every representable value, every tie and (float32) the floats either
    side of each tie: sm_89+'s hardware e4m3 conversion rounds as torch's cast does. 3000
    copies: 9000 rows, the warp-per-row kernel holding 6 vectors a thread (fp16 / bf16)."""
    pytest.importorskip("cupy")
    from oasr.quantization.numerics import quantize_activations
    from oasr_kernels.quantize_act import quantize_activations_cuda

    x = tie_rows(fmt, getattr(torch, dtype), width).cuda().repeat(copies, 1)
    q, s = quantize_activations_cuda(x, fmt)
    q0, s0 = quantize_activations(x, fmt)
    assert torch.equal(s, s0) and bool((s0.log2() == s0.log2().round()).all())  # exact quotients
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))


def test_kernel_declines_what_it_does_not_take():
    pytest.importorskip("cupy")
    from oasr_kernels.quantize_act import quantize_activations_cuda

    x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    assert quantize_activations_cuda(x.t(), "fp8") is NotImplemented  # not contiguous
    assert quantize_activations_cuda(x.double(), "fp8") is NotImplemented
    q, s = quantize_activations_cuda(x[:0], "fp8")
    assert q.shape == (0, 64) and s.shape == (0, 1)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="no fp8"
)
def test_fused_decode_step_matches_the_unfused_path(monkeypatch):
    """A random-weight fp8 Whisper decoder step through WhisperStepModel's layers: with the
    fusions and without (the same quantized values; the bias rounded once instead of twice and
    the q/k/v GEMM's different tiling move a few fp16 ulps)."""
    from oasr.kernel_providers import install_kernel_providers
    from oasr.quantization.apply import quantize_module
    from oasr_models_whisper.engine_adapter import WhisperStepModel

    install_kernel_providers("cuda")
    # the fp8 GEMMs, not the decode steps' dense copies
    monkeypatch.setenv("OASR_FP8_DENSE_ROWS", "0")
    net = whisper_net(seed=2, d=256).cuda().half()
    quantize_module(net, "fp8_w8a8")
    torch.manual_seed(0)
    h = torch.randn(64, 1, 256, device="cuda", dtype=torch.float16)
    fused_step = WhisperStepModel(net)
    assert fused_step._fused_qkv_quant is not None
    att = net.decoder.layers[0].self_attn
    fused = torch.cat([fused_step._fused_qkv_quant[0](h), att.out_proj(h)], dim=-1).float()
    monkeypatch.setenv("OASR_FP8_FUSED_QUANT", "0")
    assert WhisperStepModel(net)._fused_qkv_quant is None
    plain = torch.cat(
        [att.q_proj(h), att.k_proj(h), att.v_proj(h), att.out_proj(h)], dim=-1
    ).float()
    assert rel_err(fused, plain) < 5e-3
