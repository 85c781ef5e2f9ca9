"""A float32 model on CUDA turns cuDNN's TF32 off (oasr.checkpoint._strict_float32); fp16 models
and OASR_ALLOW_TF32=1 leave PyTorch's default."""

import pytest
import torch

from oasr.checkpoint import _strict_float32


class _Model:
    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype = torch.device(device), dtype


@pytest.fixture
def tf32_on(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.delenv("OASR_ALLOW_TF32", raising=False)


@pytest.mark.parametrize(("device", "dtype", "expected"), [
    ("cuda", torch.float32, False),
    ("cuda", torch.float16, True),
    ("cuda", torch.bfloat16, True),
    ("cpu", torch.float32, True),
])
def test_only_float32_on_cuda_turns_tf32_off(tf32_on, device, dtype, expected):
    _strict_float32(_Model(device, dtype))
    assert torch.backends.cudnn.allow_tf32 is expected


def test_environment_keeps_pytorch_default(tf32_on, monkeypatch):
    monkeypatch.setenv("OASR_ALLOW_TF32", "1")
    _strict_float32(_Model("cuda", torch.float32))
    assert torch.backends.cudnn.allow_tf32 is True
