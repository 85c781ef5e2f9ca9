"""Reference helpers shared by the feature tests."""

from __future__ import annotations

import kaldi_native_fbank as knf
import numpy as np

#: fbank parity bounds (log-mel domain), see test_kaldi.py
MAX_TOL, MEAN_TOL = 5e-3, 2e-5

FRAME_KEYS = {"window_type", "snip_edges", "preemph_coeff", "remove_dc_offset",
              "round_to_power_of_two", "samp_freq"}
MEL_KEYS = {"low_freq", "high_freq", "num_bins"}


def knf_fbank(x: np.ndarray, sample_rate: int = 16000, **kw) -> np.ndarray:
    o = knf.FbankOptions()
    o.frame_opts.dither = 0.0
    o.frame_opts.samp_freq = sample_rate
    o.mel_opts.num_bins = 80
    for k, v in kw.items():
        if k in FRAME_KEYS:
            setattr(o.frame_opts, k, v)
        elif k in MEL_KEYS:
            setattr(o.mel_opts, k, v)
        else:
            setattr(o, k, v)
    f = knf.OnlineFbank(o)
    f.accept_waveform(sample_rate, x.tolist())
    f.input_finished()
    return np.stack([f.get_frame(i) for i in range(f.num_frames_ready)])
