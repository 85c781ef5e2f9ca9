"""The ``transformers_pipeline`` backend of asrbench's speech workload.

``transformers.pipeline("automatic-speech-recognition")`` on the same Whisper weights OASR runs:
the checkpoint is read by OASR's loader (``load_any``: for tiny.en the CTranslate2 ``model.bin``)
and converted in memory by :mod:`oasr_models_whisper.hf_export`, so both hold identical tensors.

* model: ``WhisperForConditionalGeneration`` (SDPA attention), fp16 on CUDA, fp32 on CPU
  (``--dtype`` overrides), the dtype also given to ``pipeline(dtype=...)``;
* tokenizer: ``WhisperTokenizerFast`` over the checkpoint's ``tokenizer.json``; features:
  ``WhisperFeatureExtractor`` (80 or 128 mels, as the model);
* decoding: greedy, no timestamps, the suppress lists OASR uses, at most 448 tokens; English-only
  models start ``<|startoftranscript|><|notimestamps|>``, multilingual ones get
  ``language="en", task="transcribe"``;
* long inputs: the pipeline's own chunking, ``chunk_length_s=30`` with its default stride
  (``chunk_length_s / 6`` on each side), chunks merged by the pipeline;
* batches: ``batch_size`` inputs (chunks) per ``generate``.

Files are decoded by ``oasr.audio.load_audio`` (PyAV, the decoder OASR uses for files) inside the
timed call, and the arrays go to the pipeline: its own file loading shells out to an ``ffmpeg``
binary, which the GPU machine does not have.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHUNK_LENGTH_S = 30.0
SAMPLE_RATE = 16000


def _torch_dtype(device: str, dtype: str | None) -> Any:
    import torch

    if dtype in (None, "auto"):
        return torch.float16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def build_pipeline(ckpt: str | Path, device: str = "cpu", dtype: str | None = None) -> Any:
    """The ASR pipeline on ``ckpt``'s weights (any layout OASR reads)."""
    import transformers
    from transformers import WhisperFeatureExtractor

    from oasr_models_whisper.checkpoints import load_any
    from oasr_models_whisper.hf_export import hf_generation_config, hf_tokenizer, to_hf_model
    from oasr_models_whisper.tokenizer import WhisperTokenizer

    loaded = load_any(ckpt)
    files = {k: str(v) for k, v in loaded.tokenizer_files.items()}
    ours = WhisperTokenizer.from_files(files, num_languages=loaded.num_languages or None)
    torch_dtype = _torch_dtype(device, dtype)
    model = to_hf_model(loaded, ours, dtype=torch_dtype, device=device)
    model.generation_config = hf_generation_config(loaded, ours)
    features = WhisperFeatureExtractor(feature_size=loaded.dims.n_mels, sampling_rate=SAMPLE_RATE)
    # transformers 5 names it dtype, 4.x torch_dtype; with a built model it only sets the input
    # features' dtype (the model is already cast above)
    new_name = "dtype" in inspect.signature(transformers.pipeline).parameters
    key = "dtype" if new_name else "torch_dtype"
    pipe = transformers.pipeline(
        "automatic-speech-recognition", model=model, tokenizer=hf_tokenizer(loaded),
        feature_extractor=features, device=device, **{key: torch_dtype},
    )  # fmt: skip
    pipe.multilingual = loaded.is_multilingual
    return pipe


def transformers_pipeline_backend(
    ckpt: str, device: str, threads: int, dtype: str | None = None, batch_size: int | None = None
) -> Callable[[list[Path]], list[str]]:
    from oasr.audio import load_audio

    pipe = build_pipeline(ckpt, device, dtype)
    batch = batch_size or 16
    generate_kwargs: dict[str, Any] = {"do_sample": False, "num_beams": 1}
    if pipe.multilingual:
        generate_kwargs.update(language="en", task="transcribe")

    def run(paths: list[Path]) -> list[str]:
        audios = [load_audio(p, SAMPLE_RATE) for p in paths]
        outs = pipe(
            audios, batch_size=batch, chunk_length_s=CHUNK_LENGTH_S, ignore_warning=True,
            return_timestamps=False, generate_kwargs=generate_kwargs,
        )  # fmt: skip
        return [o["text"] for o in outs]

    return run
