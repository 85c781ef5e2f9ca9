"""CUDA vs CPU parity (run with ``pytest -m gpu`` on a machine with a GPU)."""

from __future__ import annotations

import pytest
import torch

from oasr.types import DecodingOptions, EngineConfig

from .conftest import DATA, SPEECH  # noqa: TID252

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# float32: cuDNN runs the subsampling convolutions in TF32 by default (PyTorch default), so
# encoder outputs differ from CPU by ~3e-4 relative (measured 1.1e-3 abs at max |x| 4)
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("float16", 3e-2)])
def test_cuda_matches_cpu(dtype, tol) -> None:
    import wave

    import numpy as np

    from oasr.checkpoint import load_model

    def read(name):  # 16 kHz PCM16 WAVs, read without PyAV
        with wave.open(str(SPEECH / name)) as w:
            return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


    cpu = load_model(EngineConfig(ckpt_dir=str(DATA / "u2pp_conformer")))
    gpu = load_model(EngineConfig(ckpt_dir=str(DATA / "u2pp_conformer"), device="cuda", dtype=dtype))
    audios = [read("zh_aishell_BAC009S0764W0121.wav"), read("zh_aishell_BAC009S0724W0121.wav"),
              read("zh_aishell_BAC009S0764W0122.wav")[:30000]]
    e1, l1 = cpu.encode(audios)
    e2, l2 = gpu.encode(audios)
    assert e2.device.type == "cuda"
    assert torch.equal(l1, l2.cpu())
    for b in range(len(audios)):
        n = int(l1[b])
        assert (e1[b, :n] - e2[b, :n].float().cpu()).abs().max().item() < tol * max(1.0, e1.abs().max().item())
    with torch.no_grad():
        lp1 = cpu.net.ctc_log_probs(e1)
        lp2 = gpu.net.ctc_log_probs(e2).cpu()
    mask = torch.arange(e1.shape[1])[None, :] < l1[:, None]
    assert (lp1 - lp2).abs()[mask].max().item() < 50 * tol
    if dtype == "float32":
        opts = DecodingOptions(beam_size=4)
        assert [t.text for t in cpu.transcribe(audios, opts)] == [t.text for t in gpu.transcribe(audios, opts)]
        # streaming on the GPU gives the CPU's streaming result
        s1, s2 = cpu.new_stream(opts, chunk_size=4), gpu.new_stream(opts, chunk_size=4)
        a = audios[0]
        u1 = cpu.stream_step([s1], [a], [True])[0]
        u2 = gpu.stream_step([s2], [a], [True])[0]
        assert u1.text == u2.text
