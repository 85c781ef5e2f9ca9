"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register


@hookimpl
def register_vad_detectors(register: Register) -> None:
    register(
        "silero",
        "oasr_vad_silero.model:SileroVAD",
        sample_rates=[8000, 16000],
        streaming=True,
        description="Silero VAD v6 (16 kHz: 512-sample windows, 8 kHz: 256), LSTM state per stream",
    )
