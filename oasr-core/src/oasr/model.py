"""The model contract every architecture implements, the optional capabilities a model or its
executor may add, and the checkpoint-format contract.

These are :class:`typing.Protocol` classes: plugins satisfy them structurally and never need to
subclass anything from core. Core asks for an optional capability with ``isinstance(obj,
Protocol)`` (the ``runtime_checkable`` ones below), never with ``getattr``/``hasattr``, so every
optional contract is named and documented here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from oasr.types import DecodingOptions, EngineConfig, FeatureSpec, ModelCapabilities, Transcript

if TYPE_CHECKING:
    import numpy as np

    from oasr.scheduler import SchedulerConfig

#: Called with (units done, units total) while a long job runs; the CLI draws a progress bar.
ProgressCallback = Callable[[float, float], None]


@runtime_checkable
class ASRModel(Protocol):
    """A loaded, ready-to-run recogniser (encoder, decoder, tokenizer and frontend together)."""

    #: Human-readable name used in error messages ("whisper tiny.en").
    name: str
    capabilities: ModelCapabilities
    feature_spec: FeatureSpec

    def transcribe(
        self,
        audios: Sequence[np.ndarray],
        options: DecodingOptions,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        """Recognise a batch of mono float32 waveforms at ``feature_spec.sample_rate``."""
        ...


# -- optional capabilities of a model --------------------------------------------------------------


@runtime_checkable
class SupportsNativeFormat(Protocol):
    """An architecture that reads and writes OASR's native format (``oasr convert``).

    ``from_native`` is a classmethod: :class:`oasr.checkpoint.NativeFormat` calls it on the class
    the registry resolves; ``save_native`` is called on a loaded model. Both must be present."""

    @classmethod
    def from_native(cls, path: Path, body: dict[str, Any], config: EngineConfig) -> ASRModel:
        """Build the model from a native checkpoint; ``body`` is its parsed ``oasr_model.json``
        (``body["architecture"]`` already the canonical registry key)."""
        ...

    def save_native(self, dst: Path) -> str:
        """Write the native format into ``dst``; return the architecture key written."""
        ...


@runtime_checkable
class SupportsExecutor(Protocol):
    """A model with its own continuous-batching executor for the offline scheduler
    (:func:`oasr.scheduler.executor_for`)."""

    def make_executor(self, config: SchedulerConfig) -> Any | None:
        """An :class:`oasr.scheduler.Executor` for this model, or None when this model/config is
        not supported (the scheduler then uses its generic batch executor)."""
        ...


@runtime_checkable
class HasDevice(Protocol):
    """A model that says where it runs. ``device`` is a ``torch.device`` or a string such as
    ``"cuda:0"``; core compares ``str(device)``. A model without it is taken to run on the CPU."""

    @property
    def device(self) -> Any: ...


@runtime_checkable
class HasModelOptions(Protocol):
    """A model whose family declares per-request options (:mod:`oasr.options`).
    ``default_options`` is an instance of the family's :class:`oasr.options.ModelOptions`
    subclass holding this model's defaults (a checkpoint may change them); a request's
    ``DecodingOptions.model_options`` override them. A model without it refuses any."""

    @property
    def default_options(self) -> Any: ...


def model_device(model: object) -> str:
    """``str(model.device)`` for a :class:`HasDevice` model, else ``"cpu"``."""
    return str(model.device) if isinstance(model, HasDevice) else "cpu"


# -- optional capabilities of an executor -----------------------------------------------------------


@runtime_checkable
class HoldsExtraRequests(Protocol):
    """An executor that can hold more requests than it decodes at once (e.g. windows encoded
    ahead of a free decoder row). The scheduler admits up to ``max_requests`` instead of
    ``SchedulerConfig.max_batch_size``."""

    @property
    def max_requests(self) -> int: ...


class CheckpointFormat(Protocol):
    """A checkpoint layout on disk (HF, CTranslate2, WeNet, ...).

    ``detect`` must be cheap and must not import torch: it runs for every registered format when
    a directory is opened. ``load`` builds the model.
    """

    @staticmethod
    def detect(path: Path) -> bool: ...

    @staticmethod
    def load(path: Path, config: EngineConfig) -> ASRModel: ...


# -- streaming -----------------------------------------------------------------------------------


class StreamState(Protocol):
    """Everything one live stream carries between steps (feature framing remainder, encoder
    caches, decoder hypotheses). Created by ``StreamingASRModel.new_stream``; owned by the engine,
    mutated only by the model's ``stream_step``."""

    @property
    def samples_needed(self) -> int:
        """Samples of new audio this stream needs before its next step can run (one chunk)."""
        ...


@dataclass
class StreamingUpdate:
    """What one stream produced in one step."""

    text: str  # the whole hypothesis so far (partial) or the final text
    is_final: bool
    #: the finished result, set when ``is_final``
    transcript: Transcript | None = None


@runtime_checkable
class StreamingASRModel(ASRModel, Protocol):
    """An :class:`ASRModel` whose capabilities include ``streaming=True``.

    The engine buffers each stream's audio and, once a stream has ``samples_needed`` samples (or
    its last audio arrived), hands that chunk to ``stream_step`` together with the ready chunks of
    every other live stream: one batched call per engine step. Results must not depend on which
    other streams share the batch.
    """

    def new_stream(self, options: DecodingOptions) -> StreamState: ...

    def stream_step(
        self,
        states: Sequence[StreamState],
        chunks: Sequence[np.ndarray],
        is_last: Sequence[bool],
    ) -> list[StreamingUpdate]:
        """Advance each stream by its chunk (mono float32 at ``feature_spec.sample_rate``)."""
        ...
