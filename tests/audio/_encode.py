"""Test helper: encode float32 audio into real containers with PyAV (bundled FFmpeg)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np


def encode(
    samples: np.ndarray,
    rate: int,
    path: Path,
    *,
    container: str,
    codec: str,
    out_rate: int | None = None,
    bit_rate: int | None = None,
    sample_fmt: str | None = None,
) -> Path:
    """Encode (channels, n) float32 ``samples`` at ``rate`` into ``path``."""
    samples = np.atleast_2d(np.asarray(samples, dtype=np.float32))
    channels = samples.shape[0]
    layout = "mono" if channels == 1 else "stereo"
    out_rate = out_rate or rate
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=out_rate, layout=layout)
        if bit_rate:
            stream.bit_rate = bit_rate
        if sample_fmt:
            stream.format = sample_fmt
        stream.codec_context.options = {"strict": "experimental"}
        ctx = stream.codec_context
        frame_size = ctx.frame_size or 1024
        rs = av.AudioResampler(
            format=ctx.format.name, layout=layout, rate=out_rate, frame_size=frame_size
        )
        step = 4096
        for i in range(0, samples.shape[1], step):
            blk = np.ascontiguousarray(samples[:, i : i + step])
            fr = av.AudioFrame.from_ndarray(blk, format="fltp", layout=layout)
            fr.sample_rate = rate
            for f in rs.resample(fr):
                for p in stream.encode(f):
                    out.mux(p)
        for f in rs.resample(None):
            for p in stream.encode(f):
                out.mux(p)
        for p in stream.encode(None):
            out.mux(p)
    return path
