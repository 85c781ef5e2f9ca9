"""Frontends resolve through the registry; CUDA output equals CPU output (gpu marker)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from oasr.types import FeatureSpec

SPECS = {
    "whisper_logmel": FeatureSpec(kind="whisper_logmel", num_bins=128),
    "kaldi_fbank": FeatureSpec(kind="kaldi_fbank", options={"scale": 32768.0}),
    "funasr_fbank_lfr": FeatureSpec(kind="funasr_fbank_lfr"),
    "nemo_mel": FeatureSpec(kind="nemo_mel", num_bins=128, n_fft=512),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_registered(kind, speech):
    from oasr.plugins import resolve

    cls = resolve("feature_extractor", kind)
    fe = cls(SPECS[kind])
    out = fe(torch.from_numpy(speech[3]))
    assert out.ndim == 2 and out.shape[0] > 0 and torch.isfinite(out).all()
    feats, lens = fe.extract([speech[3], speech[0]])
    assert feats.shape[0] == 2 and lens.shape == (2,)


def test_audio_import_does_not_import_torch():
    code = "import sys, oasr.audio; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_cuda_matches_cpu(kind, speech):
    from oasr.plugins import resolve

    assert torch.cuda.is_available()
    fe = resolve("feature_extractor", kind)(SPECS[kind])
    xs = [speech[0], speech[1], speech[3]]
    n = max(len(x) for x in xs)
    batch = torch.from_numpy(np.stack([np.pad(x, (0, n - len(x))) for x in xs]))
    lens = torch.tensor([len(x) for x in xs])
    cpu, cpu_lens = fe.extract(batch, lens)
    gpu, gpu_lens = fe.extract(batch.cuda(), lens.cuda())
    assert gpu.is_cuda and gpu_lens.is_cuda  # computed on the device, no host round-trip
    torch.testing.assert_close(gpu_lens.cpu(), cpu_lens)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-3, rtol=1e-4)
    if kind != "whisper_logmel":
        s = fe.stream(device="cuda") if kind != "nemo_mel" else None
        if s is not None:
            got = torch.cat([s.accept(batch[0, i : i + 777].cuda()) for i in range(0, n, 777)]
                            + [s.finish()])
            torch.testing.assert_close(got.cpu(), cpu[0, : got.shape[0]], atol=2e-3, rtol=1e-4)
