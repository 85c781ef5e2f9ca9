"""Real tiny.en (the CTranslate2 weights the CLI uses by default) on the repository's English
clips: CPU int8 W8A8 WER within +0.3 points of the float32 model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from qwer import transcripts, wer  # noqa: E402

pytestmark = pytest.mark.slow


def _tiny_en() -> str:
    try:
        from oasr.defaults import default_checkpoint

        return str(default_checkpoint())
    except Exception as exc:  # noqa: BLE001 - the package is missing: say so
        pytest.skip(f"real tiny.en not installed ({exc})")


def test_cpu_int8_wer_within_0_3_points_of_float32():
    ckpt = _tiny_en()
    base = transcripts(ckpt, "cpu", None, None, threads=2)
    quant = transcripts(ckpt, "cpu", "int8_w8a8", None, threads=2)
    base_wer, quant_wer = wer(base), wer(quant)
    print(f"\ntiny.en WER on {len(base)} English clips: float32 {base_wer:.2f}%  int8_w8a8 {quant_wer:.2f}%")
    assert quant_wer <= base_wer + 0.3
    assert base_wer < 15.0
