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
binary, which the GPU machine does not have. With ``readers=N`` (asrbench ``--readers``, the
many-files workload) the files are decoded in ``N`` worker processes of a ``torch``
``DataLoader`` (persistent, started at the warm-up like OASR's decode pool; ``forkserver`` on
Linux, as OASR's; samples handed back as tensors through shared memory, the DataLoader's own
path) and fed to the pipeline as they come, in order: the pipeline's own ``num_workers`` cannot
do this (a chunking pipeline forces it to 1, and that one worker would run the whole
pre-processing), so the readers stand beside it, the way OASR's decode pool stands beside its
engine.
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


class FileSamples:
    """A map-style dataset whose keys are file paths: ``dataset[path]`` is the file decoded by
    ``oasr.audio.load_audio`` as a float32 tensor (a tensor so the DataLoader hands it back
    through shared memory, not pickled through its result pipe)."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self.sample_rate = sample_rate

    def __getitem__(self, path: str) -> Any:
        import torch

        from oasr.audio import load_audio

        return torch.from_numpy(load_audio(path, self.sample_rate))


class CurrentPaths:
    """The DataLoader's sampler: the paths of the call in progress, in order (set per call, so
    one persistent set of workers serves every call)."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __iter__(self) -> Any:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


def _as_is(sample: Any) -> Any:
    return sample  # the DataLoader's collate_fn (batch_size=None): one tensor per file


def file_readers(readers: int) -> tuple[Any, CurrentPaths]:
    """A persistent ``DataLoader`` with ``readers`` worker processes decoding the paths put in
    its sampler, and that sampler."""
    import multiprocessing
    import sys

    from torch.utils.data import DataLoader

    sampler = CurrentPaths()
    method = "forkserver" if sys.platform.startswith("linux") else "spawn"
    loader = DataLoader(FileSamples(), batch_size=None, sampler=sampler, num_workers=readers,
                        collate_fn=_as_is, persistent_workers=True, prefetch_factor=4,
                        multiprocessing_context=multiprocessing.get_context(method))  # fmt: skip
    return loader, sampler


def transformers_pipeline_backend(
    ckpt: str, device: str, threads: int, dtype: str | None = None, batch_size: int | None = None,
    readers: int = 0,
) -> Callable[[list[Path]], list[str]]:
    """``run(paths) -> texts``. ``readers`` > 0 decodes the files in that many DataLoader
    worker processes (see the module docstring); 0 decodes them one by one in the caller."""
    from oasr.audio import load_audio

    pipe = build_pipeline(ckpt, device, dtype)
    batch = batch_size or 16
    generate_kwargs: dict[str, Any] = {"do_sample": False, "num_beams": 1}
    if pipe.multilingual:
        generate_kwargs.update(language="en", task="transcribe")
    loader, sampler = file_readers(readers) if readers > 0 else (None, None)

    def run(paths: list[Path]) -> list[str]:
        if loader is None:
            audios: Any = [load_audio(p, SAMPLE_RATE) for p in paths]
        else:
            sampler.paths = [str(p) for p in paths]  # type: ignore[union-attr]
            audios = (samples.numpy() for samples in loader)  # decoded while the model runs
        outs = pipe(
            audios, batch_size=batch, chunk_length_s=CHUNK_LENGTH_S, ignore_warning=True,
            return_timestamps=False, generate_kwargs=generate_kwargs,
        )  # fmt: skip
        return [o["text"] for o in outs]

    return run
