"""Core's TDT greedy on the device (``TDTGreedySearch(sync_free=True)``, the default on CUDA:
every row stepped at once, the host reading a flag every few steps) gives exactly the
hypotheses of its row loop, whole and chunked, with many zero durations (the per-frame symbol
limit) too; RNN-T greedy with several symbols per frame runs the same device loop (one duration,
0) and equals its frame loop. Run here on the CPU with the Parakeet test models' prediction
networks; ``test_gpu.py`` replays the same loops as CUDA graphs."""

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


def _run(network, enc, lens, durations, blank, sync_free, chunk=None, max_symbols=10,  # noqa: ANN001
         cuda_graph=False):
    search = TDTGreedySearch(network, durations, enc.shape[0], blank_id=blank,
                             max_symbols_per_frame=max_symbols, sync_free=sync_free,
                             cuda_graph=cuda_graph)
    if chunk is None:
        search.step(enc, lens)
    else:
        for s in range(0, enc.shape[1], chunk):
            part = enc[:, s:s + chunk]
            search.step(part, [max(0, min(chunk, n - s)) for n in lens])
    return search.results()


def _projected(model, waves):  # noqa: ANN001, ANN202
    enc, lens = model.encode(waves, model._check(DecodingOptions()))
    with torch.no_grad():
        return model.net.encoder_projector(enc), lens.tolist()


@pytest.fixture
def few_steps_per_check(monkeypatch):  # noqa: ANN001, ANN201
    """Two steps per status read: many reads, and the emission buffers grow (re-captured)."""
    import oasr.decoders.transducer as tr

    grown = []
    grow = tr._DeviceTDT._grow

    def counting_grow(self):  # noqa: ANN001, ANN202
        grown.append(self.cap)
        grow(self)

    monkeypatch.setattr(tr, "TDT_STEPS_PER_CHECK", 2)
    monkeypatch.setattr(tr._DeviceTDT, "_grow", counting_grow)
    monkeypatch.setattr(tr._DeviceTDT, "lagged_status", True)  # as on CUDA: one group behind
    return grown


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


def test_status_reads_and_buffer_growth(hf_checkpoints, waves, few_steps_per_check) -> None:
    """Two steps per status read, read one group late as on CUDA, and a zero-heavy joiner: the
    emission buffers grow during the loop (a graph would be captured again) and the hypotheses
    stay the row loop's."""
    from oasr_models_nemo.model import NemoASR

    model = NemoASR.from_hf(hf_checkpoints["tdt"].path)
    c = model.config
    proj, lens = _projected(model, waves)
    network = _ZeroHeavy(model.transducer, 60.0)
    loop = _run(network, proj, lens, c.durations, c.blank_id, False, max_symbols=4)
    device = _run(network, proj, lens, c.durations, c.blank_id, True, max_symbols=4,
                  cuda_graph=True)  # (no CUDA here: eager steps)
    assert few_steps_per_check, "the emission buffers never grew"
    for a, b in zip(loop, device, strict=True):
        assert (a.tokens, a.times, a.durations) == (b.tokens, b.times, b.durations)
        assert a.score == pytest.approx(b.score, abs=1e-3)


@pytest.mark.parametrize("kind,max_symbols,penalty", [("rnnt", 10, 0.0), ("rnnt", 2, 1.5),
                                                      ("nemotron", 2, 0.0)])
def test_rnnt_label_looping_equals_frame_loop(hf_checkpoints, waves, monkeypatch, kind,
                                              max_symbols, penalty) -> None:
    """RNN-T greedy with ``max_symbols_per_frame > 1`` and ``sync_free``: the device loop gives
    the frame loop's tokens, frames, log-probabilities and scores, whole and in chunks (a
    stream's search resumed chunk by chunk, as Nemotron's streaming does)."""
    from oasr.decoders.transducer import TransducerGreedySearch
    from oasr_models_nemo.model import NemoASR

    model = NemoASR.from_hf(hf_checkpoints[kind].path)
    proj, lens = _projected(model, waves)
    blank = model.config.blank_id

    def search(sync_free, chunk=None):  # noqa: ANN001, ANN202
        s = TransducerGreedySearch(model.transducer, proj.shape[0], blank_id=blank,
                                   max_symbols_per_frame=max_symbols, blank_penalty=penalty,
                                   sync_free=sync_free)
        for a in range(0, proj.shape[1], chunk or proj.shape[1]):
            n = chunk or proj.shape[1]
            s.step(proj[:, a : a + n], [max(0, min(n, int(L) - a)) for L in lens])
        return s.results()

    loop = search(False)
    assert sum(len(h.tokens) for h in loop) > 10
    assert max(lens) >= TransducerGreedySearch.label_looping_min_frames
    device_calls = []
    step = TransducerGreedySearch._step_label_looping
    monkeypatch.setattr(TransducerGreedySearch, "_step_label_looping",
                        lambda self, *a: (device_calls.append(1), step(self, *a)))
    # chunks of 33 frames: the first on the device loop, the rest (< 32 frames) on the frame
    # loop, the state handed over between them
    runs = [search(True), search(True, chunk=33)]
    monkeypatch.setattr(TransducerGreedySearch, "label_looping_min_frames", 1)
    runs.append(search(True, chunk=5))  # every chunk on the device loop
    assert len(device_calls) == 2 + (max(lens) + 4) // 5
    for got in runs:
        for a, b in zip(loop, got, strict=True):
            assert (a.tokens, a.times) == (b.tokens, b.times)
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
            # (the loop sums in float64 on the host, the device in float32)
            assert a.score == pytest.approx(b.score, rel=1e-6, abs=1e-4)


def test_cached_runner_reused_across_calls(hf_checkpoints, waves, monkeypatch) -> None:
    """One runner (buffers + graph on CUDA) per network, batch and width bucket: a second call
    of the same shape reuses it, a call with fewer frames in the same bucket reads only its own
    columns, a chunked call shares it too; every result equals the row loop. (Here on the CPU with the cache forced on and the status read as on CUDA.)"""
    import oasr.decoders.transducer as tr
    from oasr_models_nemo.model import NemoASR

    monkeypatch.setattr(tr._DeviceTDT, "cache_runners", True)
    monkeypatch.setattr(tr._DeviceTDT, "lagged_status", True)
    monkeypatch.setattr(tr, "_tdt_runners", {})
    model = NemoASR.from_hf(hf_checkpoints["tdt"].path)
    c = model.config
    proj, lens = _projected(model, waves)
    short = [min(n, 20) for n in lens]
    for args in ((proj, lens, None), (proj, lens, None), (proj[:, :20], short, None),
                 (proj, lens, 9)):
        enc, ls, chunk = args
        loop = _run(model.transducer, enc, ls, c.durations, c.blank_id, False)
        got = _run(model.transducer, enc, ls, c.durations, c.blank_id, True, chunk)
        for a, b in zip(loop, got, strict=True):
            assert (a.tokens, a.times, a.durations) == (b.tokens, b.times, b.durations)
            assert a.score == pytest.approx(b.score, abs=1e-3)
    # widths 39 (bucket 64), 20 and chunks of 9 all fall in one bucket: one runner
    assert len(tr._tdt_runners) == 1
    (ref, lock, runner), = tr._tdt_runners.values()
    assert ref() is model.transducer and not lock.locked() and runner.width == 64
