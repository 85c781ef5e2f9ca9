"""Core's TDT greedy on the device (``TDTGreedySearch(sync_free=True)``, the default on CUDA:
every row stepped at once, the host reading a flag every few steps) gives exactly the
hypotheses of its row loop, whole and chunked, with many zero durations (the per-frame symbol
limit) too. Run here on the CPU with the Parakeet TDT test model's prediction network."""

from __future__ import annotations

import pytest
import torch

from oasr.decoders.transducer import TDTGreedySearch
from oasr.types import DecodingOptions

pytestmark = pytest.mark.slow


class _ZeroHeavy:
    """The model's network with the duration-0 logit raised: tokens often stay on their frame."""

    def __init__(self, net, boost: float) -> None:  # noqa: ANN001
        self.net, self.boost = net, boost

    def __getattr__(self, name):  # noqa: ANN001, ANN204
        return getattr(self.net, name)

    def join(self, frames, decoder_out):  # noqa: ANN001, ANN201
        logits = self.net.join(frames, decoder_out).clone()
        logits[:, -5] += self.boost
        return logits


def _run(network, enc, lens, durations, blank, sync_free, chunk=None, max_symbols=10):  # noqa: ANN001
    search = TDTGreedySearch(network, durations, enc.shape[0], blank_id=blank,
                             max_symbols_per_frame=max_symbols, sync_free=sync_free)
    if chunk is None:
        search.step(enc, lens)
    else:
        for s in range(0, enc.shape[1], chunk):
            part = enc[:, s:s + chunk]
            search.step(part, [max(0, min(chunk, n - s)) for n in lens])
    return search.results()


@pytest.mark.parametrize("boost,max_symbols", [(0.0, 10), (60.0, 3)])
def test_device_path_equals_row_loop(hf_checkpoints, waves, boost, max_symbols) -> None:
    from oasr_models_nemo.model import NemoASR

    model = NemoASR.from_hf(hf_checkpoints["tdt"].path)
    c = model.config
    opts = model._check(DecodingOptions())
    enc, lens = model.encode(waves, opts)
    with torch.no_grad():
        proj = model.net.encoder_projector(enc)
    network = _ZeroHeavy(model.transducer, boost) if boost else model.transducer
    lens = lens.tolist()
    loop = _run(network, proj, lens, c.durations, c.blank_id, False, max_symbols=max_symbols)
    assert sum(len(h.tokens) for h in loop) > 10
    if boost:
        assert sum(d == 0 for h in loop for d in h.durations) > 10  # the symbol limit is hit
    for chunk in (None, 7):
        device = _run(network, proj, lens, c.durations, c.blank_id, True, chunk, max_symbols)
        for a, b in zip(loop, device, strict=True):
            assert (a.tokens, a.times, a.durations) == (b.tokens, b.times, b.durations)
            assert a.score == pytest.approx(b.score, abs=1e-3)
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
