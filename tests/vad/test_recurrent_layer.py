"""``oasr.layers.recurrent.LSTMCell`` against torch.nn.LSTMCell."""

from __future__ import annotations

import pytest
import torch

from oasr.layers import override
from oasr.layers.recurrent import LSTMCell


def _pair(seed: int = 0) -> tuple[LSTMCell, torch.nn.LSTMCell]:
    torch.manual_seed(seed)
    ours = LSTMCell(24, 16)
    ref = torch.nn.LSTMCell(24, 16)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def test_cell_and_sequence_match_torch():
    ours, ref = _pair()
    x = torch.randn(3, 11, 24)
    h = c = None
    ys = []
    with torch.no_grad():
        state = None
        for t in range(11):
            state = ref(x[:, t], state)
            ys.append(state[0])
            h, c = ours(x[:, t], h, c)
            assert torch.allclose(h, state[0], atol=1e-6) and torch.allclose(c, state[1], atol=1e-6)
        y, hs, cs = ours.forward_sequence(x)
    assert torch.allclose(y, torch.stack(ys, 1), atol=1e-5)
    assert torch.allclose(hs, state[0], atol=1e-5) and torch.allclose(cs, state[1], atol=1e-5)


def test_sequence_mask_carries_state():
    ours, _ = _pair(1)
    x = torch.randn(2, 6, 24)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    with torch.no_grad():
        _, h, c = ours.forward_sequence(x, mask=mask)
        _, h1, c1 = ours.forward_sequence(x[1:, :3])
    assert torch.allclose(h[1:], h1, atol=1e-6) and torch.allclose(c[1:], c1, atol=1e-6)


def test_ops_can_be_overridden():
    ours, _ = _pair()
    x = torch.randn(2, 24)
    calls = []

    def fake(module, x, h, c):
        calls.append(module)
        return NotImplemented

    with override("lstm_cell", "cpu", fake), torch.no_grad():
        a = ours(x)
    assert calls == [ours] and a[0].shape == (2, 16)
    with override("lstm_sequence", "cpu", lambda m, x, h, c, mask: ("y", h, c)):
        assert ours.forward_sequence(x[:, None])[0] == "y"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sequence_in_one_cudnn_call_matches_the_step_loop():
    """On CUDA an unmasked sequence runs as one cuDNN LSTM call; an all-True mask takes the
    step loop. Same outputs and final state (float32, TF32 off)."""
    torch.manual_seed(0)
    cell = LSTMCell(64, 128).cuda()
    x = torch.randn(5, 300, 64, device="cuda")
    h = torch.randn(5, 128, device="cuda")
    c = torch.randn(5, 128, device="cuda")
    y1, h1, c1 = cell.forward_sequence(x, h, c)
    y2, h2, c2 = cell.forward_sequence(x, h, c, torch.ones(5, 300, dtype=torch.bool, device="cuda"))
    for a, b in ((y1, y2), (h1, h2), (c1, c2)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
