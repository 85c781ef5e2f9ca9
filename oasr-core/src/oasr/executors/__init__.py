"""Executors: the model-facing half of the offline scheduler (:mod:`oasr.scheduler`).

* :class:`oasr.scheduler.BatchExecutor`: any model, one ``model.transcribe`` call per admitted
  batch (CTC, CIF, transducer offline).
* :class:`oasr.executors.autoregressive.AutoregressiveExecutor`: continuous batching of an
  autoregressive decoder (decoder rows refilled as sequences finish, a paged KV cache with a
  memory budget, CUDA graphs per (batch, blocks) bucket, encoder look-ahead on a side stream,
  per-row sampling). A family supplies a :class:`~oasr.executors.autoregressive.StepModel` (the
  network: encode, optional cross K/V, one forward over the paged cache) and a
  :class:`~oasr.executors.autoregressive.RequestDriver` (what a request is made of: its windows,
  prompts, logit rules and what happens when a sequence ends). Whisper runs on it; the
  speech-LLM family will.

Importing this package imports nothing heavy; :mod:`oasr.executors.autoregressive` imports torch.
"""

from __future__ import annotations

__all__ = ["AutoregressiveExecutor", "RequestDriver", "Row", "StepModel", "Window"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: keep torch out of `import oasr.executors`
    if name in __all__:
        from oasr.executors import autoregressive

        return getattr(autoregressive, name)
    raise AttributeError(f"module 'oasr.executors' has no attribute {name!r}")
