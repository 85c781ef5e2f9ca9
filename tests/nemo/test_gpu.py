"""CUDA parity (``pytest -m gpu tests/nemo``): the same random Hugging Face checkpoints on the GPU
give CPU's tokens in float32 (against transformers' own classes on the GPU too), close encoder
output in float16, and Nemotron streams on the GPU equal offline decoding there."""

from __future__ import annotations

import warnings

import pytest
import torch

from oasr.types import DecodingOptions, EngineConfig

from .conftest import BLANK, SR, reference_missing  # noqa: TID252

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(reference_missing() is not None,
                                 reason=f"reference: {reference_missing()}")]


def _tokens(transcripts) -> list[list[int]]:
    return [t.segments[0].tokens if t.segments else [] for t in transcripts]


@pytest.mark.parametrize("kind", ["ctc", "rnnt", "tdt", "nemotron"])
def test_cuda_matches_cpu_and_transformers(hf_checkpoints, waves, kind) -> None:
    from oasr.checkpoint import load_model

    ck = hf_checkpoints[kind]
    cpu = load_model(EngineConfig(ckpt_dir=str(ck.path)))
    gpu = load_model(EngineConfig(ckpt_dir=str(ck.path), device="cuda", dtype="float32"))
    opts = DecodingOptions(model_options={"max_symbols_per_frame": 10_000} if kind == "tdt" else {})
    e1, l1 = cpu.encode(waves)
    e2, l2 = gpu.encode(waves)
    assert e2.device.type == "cuda" and l1.tolist() == l2.tolist()
    for b, n in enumerate(l1.tolist()):
        torch.testing.assert_close(e2[b, :n].cpu(), e1[b, :n], atol=1e-3, rtol=1e-3)
    expected = _tokens(cpu.transcribe(waves, opts))
    assert _tokens(gpu.transcribe(waves, opts)) == expected
    # transformers' own class on the GPU, one input at a time (greedy)
    ref = ck.model.to("cuda")
    try:
        for w, tokens in zip(waves, expected, strict=True):
            x = ck.processor([w], sampling_rate=SR, return_tensors="pt")
            feats, mask = x.input_features.cuda(), x.attention_mask.cuda()
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                extra = {"num_lookahead_tokens": 2} if kind == "nemotron" else {}
                if kind == "ctc":
                    seq = ref.generate(input_features=feats, attention_mask=mask)[0].tolist()
                    got = [t for i, t in enumerate(seq) if (i == 0 or t != seq[i - 1]) and t != BLANK]
                else:
                    n = int(ref.get_audio_features(input_features=feats, attention_mask=mask,
                                                   **extra).attention_mask.sum())
                    out = ref.generate(input_features=feats, attention_mask=mask,
                                       max_new_tokens=12 * n, **extra)
                    got, frame = [], 0
                    for tok, dur in zip(out.sequences[0, 1:].tolist(), out.durations[0, 1:].tolist(),
                                        strict=True):
                        if frame >= n:
                            break
                        if tok != BLANK:
                            got.append(tok)
                        frame += dur
            assert got == tokens
    finally:
        ck.model.to("cpu")


@pytest.mark.parametrize("kind", ["ctc", "tdt", "nemotron"])
def test_float16(hf_checkpoints, waves, kind) -> None:
    from oasr.checkpoint import load_model

    path = str(hf_checkpoints[kind].path)
    ref = load_model(EngineConfig(ckpt_dir=path, device="cuda", dtype="float32"))
    half = load_model(EngineConfig(ckpt_dir=path, device="cuda", dtype="float16"))
    assert half.dtype == torch.float16
    e1, l1 = ref.encode(waves)
    e2, _ = half.encode(waves)
    for b, n in enumerate(l1.tolist()):
        torch.testing.assert_close(e2[b, :n].float(), e1[b, :n], atol=5e-2, rtol=5e-2)
    out = half.transcribe(waves, DecodingOptions(word_timestamps=True))
    assert all(t.text for t in out)


def test_nemotron_streaming_on_cuda(hf_checkpoints, waves) -> None:
    from oasr.checkpoint import load_model

    model = load_model(EngineConfig(ckpt_dir=str(hf_checkpoints["nemotron"].path), device="cuda",
                                    dtype="float32"))
    expected = [t.text for t in model.transcribe(waves, DecodingOptions())]
    states = [model.new_stream(DecodingOptions()) for _ in waves]
    fed = [0] * len(waves)
    finals = {}
    while len(finals) < len(waves):
        rows = [k for k in range(len(waves)) if k not in finals]
        chunks, lasts = [], []
        for k in rows:
            chunks.append(waves[k][fed[k]:fed[k] + 2400])
            fed[k] += 2400
            lasts.append(fed[k] >= len(waves[k]))
        for k, u, last in zip(rows, model.stream_step([states[k] for k in rows], chunks, lasts),
                              lasts, strict=True):
            if last:
                finals[k] = u.text
    assert [finals[k] for k in range(len(waves))] == expected


def test_long_audio_on_cuda(hf_checkpoints) -> None:
    import numpy as np

    from oasr.checkpoint import load_model

    model = load_model(EngineConfig(ckpt_dir=str(hf_checkpoints["tdt"].path), device="cuda",
                                    dtype="float16"))
    wave = (np.random.default_rng(0).standard_normal(600 * SR) * 0.1).astype(np.float32)
    out = model.transcribe([wave], DecodingOptions(word_timestamps=True))[0]
    assert out.words and out.words[-1].end > 590
