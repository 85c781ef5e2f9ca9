"""The ``example_ctc`` family's own request options (``DecodingOptions.model_options``).

Declared once, with :mod:`oasr.options`: core parses them from every surface (Python, the CLI's
``-O NAME=VALUE``, HTTP form fields, gRPC maps), checks types and bounds and refuses unknown
names; a loaded model holds its checkpoint's defaults in ``default_options``."""

from __future__ import annotations

from dataclasses import dataclass

from oasr.options import ModelOptions, option


@dataclass(frozen=True)
class ExampleCTCOptions(ModelOptions):
    family = "example_ctc"

    chunk_size: int = option(
        4, gt=0,
        doc="Encoder frames (40 ms each) per attention chunk: a stream's step, and the mask "
            "offline decoding uses, so both give the same text (default: the checkpoint's).",
    )  # fmt: skip
    num_left_chunks: int = option(
        -1, ge=-1, doc="Chunks of left context each chunk attends to (bounds a stream's cache); -1: all."
    )
    blank_penalty: float = option(
        0.0, ge=0, doc="Subtracted from the blank's log-probability before the search: higher emits more tokens."
    )
