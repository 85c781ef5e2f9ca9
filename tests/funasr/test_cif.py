"""Core CIF (``oasr.decoders.cif``) against FunASR's own functions on random weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasr.decoders.cif import add_tail, cif_cumsum, cif_fires, cif_loop, cif_timestamps


def _batch(seed: int, b: int = 4, t: int = 60, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    alphas = torch.rand(b, t, generator=g) * 0.6
    hidden = torch.randn(b, t, d, generator=g)
    lens = torch.tensor([t - 7 * i for i in range(b)])
    valid = torch.arange(t)[None, :] < lens[:, None]
    return alphas * valid, hidden * valid[..., None], lens


@pytest.mark.parametrize("seed", range(5))
def test_tail_and_cif_match_funasr(seed) -> None:
    from funasr.models.bicif_paraformer.cif_predictor import cif as funasr_cif_loop
    from funasr.models.paraformer.cif_predictor import CifPredictorV2, cif_v1

    alphas, hidden, lens = _batch(seed)
    pred = CifPredictorV2(idim=8, l_order=1, r_order=1, tail_threshold=0.45)
    mask = (torch.arange(alphas.shape[1])[None, :] < lens[:, None]).float()
    rh, ra, rn = pred.tail_process_fn(hidden, alphas, mask=mask)
    h, a, n = add_tail(hidden, alphas, lens, 0.45)
    assert torch.equal(ra, a) and torch.equal(rn, n) and torch.equal(rh, h)
    e_ref, f_ref = cif_v1(rh, ra, 1.0)
    e, f = cif_cumsum(h, a)
    assert torch.equal(f, f_ref)
    assert e.shape == e_ref.shape and torch.allclose(e, e_ref, atol=1e-6)
    e_ref, f_ref = funasr_cif_loop(rh, ra, 1.0)
    e, f = cif_loop(h, a, 1.0)
    assert torch.equal(f, f_ref) and torch.equal(e, e_ref)


@pytest.mark.parametrize("seed", range(20))
def test_fires_and_timestamps_match_funasr(seed) -> None:
    from funasr.utils.timestamp_tools import cif_wo_hidden, ts_prediction_lfr6_standard

    rng = np.random.default_rng(seed)
    t = int(rng.integers(20, 200))
    a = torch.from_numpy(rng.uniform(0, 0.7, t).astype(np.float32))
    assert np.array_equal(cif_fires(a, 1.0 - 1e-4), cif_wo_hidden(a[None], 1.0 - 1e-4)[0].numpy())
    n_tok = int(rng.integers(1, max(2, int(a.sum())) + 3))
    tokens = [f"t{i}" for i in range(n_tok)]
    peaks = torch.from_numpy(cif_fires(a, 1.0 - 1e-4))
    for weights, fires, up in ((a, peaks, 3), (peaks, a, 1)):  # BiCif's order, Paraformer's
        ref_txt, ref = ts_prediction_lfr6_standard(weights.clone(), fires.clone(), list(tokens),
                                                   upsample_rate=up)  # fmt: skip
        got = cif_timestamps(weights, fires, tokens, upsample_rate=up)
        assert [list(x) for x in got.tokens] == ref


def test_batched_cif_fires_equals_cif_fires_per_row() -> None:
    """The batched running sums of BiCif's timestamp weights == core's per-row cif_fires, bit
    for bit, for every prefix length (rows shorter than the batch are prefixes)."""

    rng = np.random.default_rng(0)
    for trial in range(6):
        a = (rng.random((8, 90)) * rng.uniform(0.1, 1.3)).astype(np.float32)
        a[:, int(rng.integers(0, 90)) :] = 0.0 if trial % 2 else 0.9999
        got = cif_fires(a, 1 - 1e-4)
        for row in range(8):
            n = int(rng.integers(0, 91))
            assert np.array_equal(got[row, :n], cif_fires(a[row, :n], 1 - 1e-4))
