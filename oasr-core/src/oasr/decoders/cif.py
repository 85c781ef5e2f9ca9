"""Continuous integrate-and-fire (CIF): acoustic token embeddings and token timestamps.

CIF (Dong & Xu, 2020) turns per-frame weights ``alphas`` (B, T) and encoder frames (B, T, D)
into one embedding per token: the weights are accumulated along time and a token *fires*
whenever the running sum crosses 1; its embedding is the alpha-weighted sum of the frames it
integrated (a frame that crosses the boundary is split between the two tokens). Paraformer
(FunASR) decodes these embeddings in one non-autoregressive pass and derives token timestamps
from where the tokens fire.

Everything here reproduces FunASR's arithmetic so results match it exactly:

* :func:`add_tail` is ``CifPredictorV2.tail_process_fn``: one extra frame per row carrying
  ``tail_threshold`` right after the row's last valid frame (so a final partial token fires),
  and the token count is the floor of the weight sum.
* :func:`cif_cumsum` is ``cif_v1`` (Paraformer's predictor V2): fire positions from a float64
  prefix sum of the weights, embeddings as differences of a float32 prefix sum of
  ``alpha * frame``. Vectorised; no loop over time.
* :func:`cif_loop` is ``cif`` (BiCif's predictor V3): the running sum frame by frame, in
  float32, batch-vectorised.
* :func:`cif_fires` is ``cif_wo_hidden``: the running sums alone, with a given threshold
  (FunASR's timestamp code fires at ``1 - 1e-4``).
* :func:`cif_timestamps` is ``ts_prediction_lfr6_standard``: token start/end times in ms from
  the frames where tokens fire (shifted by -1.5 frames; long gaps become silence).

Imports torch; ``import oasr`` does not import this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "CIFTimestamps",
    "add_tail",
    "cif_cumsum",
    "cif_fires",
    "cif_loop",
    "cif_timestamps",
]


def add_tail(
    hidden: torch.Tensor, alphas: torch.Tensor, lengths: torch.Tensor | None, tail_threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append one frame per row: weight ``tail_threshold`` at index ``lengths[b]`` (the first
    frame past the row's end; the appended zero frame for the longest rows), hidden zeros there.

    ``hidden`` (B, T, D), ``alphas`` (B, T) with padding already zero. ``lengths`` None: the
    tail goes at index T for every row. Returns (hidden (B, T+1, D), alphas (B, T+1), token
    count = floor(sum of weights) (B,))."""
    b, t, d = hidden.shape
    zeros_t = alphas.new_zeros(b, 1)
    alphas = torch.cat([alphas, zeros_t], dim=1)
    if lengths is None:
        alphas[:, t] += tail_threshold
    else:
        # FunASR: (shifted mask - mask) * threshold marks index length; written as a one-hot
        # add so the sum is the same float32 operation
        onehot = torch.zeros_like(alphas)
        onehot.scatter_(1, lengths.to(torch.long).clamp(max=t)[:, None], 1.0)
        alphas = alphas + onehot * tail_threshold
    hidden = torch.cat([hidden, hidden.new_zeros(b, 1, d)], dim=1)
    return hidden, alphas, torch.floor(alphas.sum(dim=-1))


def _fire_positions(alphas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fires, fire mask) as FunASR's ``cif_wo_hidden_v1``: a frame fires when the floor of
    the float64 prefix sum (rounded to float32) steps up there."""
    prefix = torch.cumsum(alphas, dim=1, dtype=torch.float64).to(torch.float32)
    floor = torch.floor(prefix)
    prev = torch.roll(prefix, 1, dims=1)
    prev_floor = torch.floor(prev)
    prev_floor[:, 0] = 0
    fire = (floor - prev_floor) > 0
    fires = fire.to(alphas.dtype) + prefix - floor
    return fires, fire


def cif_cumsum(hidden: torch.Tensor, alphas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FunASR's ``cif_v1`` (threshold 1): (embeddings (B, N, D) with N = max round(sum of
    weights), zero past each row's fired tokens; fires (B, T): 1 + the fractional prefix sum at
    firing frames, the fractional prefix sum elsewhere)."""
    b, t, d = hidden.shape
    fires, fire = _fire_positions(alphas)
    if not b:
        return hidden.new_zeros(0, 0, d), fires
    counts = fire.sum(1)
    # one read-back for both sizes (each boolean-mask index would be one more wait on the device)
    max_len, most = torch.stack([torch.round(alphas.sum(-1)).int().max(), counts.max().int()]).tolist()
    if not most:
        return hidden.new_zeros(b, max_len, d), fires
    rows, times = fire.nonzero(as_tuple=True)  # fires in row-major (row, time) order
    prefix_h = torch.cumsum(alphas.unsqueeze(-1) * hidden, dim=1)
    frames = prefix_h[rows, times]  # (F, D)
    first = torch.cumsum(counts, 0) - counts  # index in ``frames`` of each row's first fire
    pos = torch.arange(frames.shape[0], device=hidden.device) - first[rows]  # token index in row
    starts = (pos == 0).unsqueeze(-1)
    shifted = torch.roll(frames, 1, dims=0).masked_fill(starts, 0)
    remains = (fires - torch.floor(fires))[rows, times].unsqueeze(-1) * hidden[rows, times]
    shifted_remains = torch.roll(remains, 1, dims=0).masked_fill(starts, 0)
    frames = frames - shifted + shifted_remains - remains
    # more fires than round(sum) can happen only through float rounding; FunASR would fail
    # there, OASR keeps the first max_len
    out = hidden.new_zeros(b, max(max_len, most), d)
    out[rows, pos] = frames
    return out[:, :max_len], fires


def cif_loop(
    hidden: torch.Tensor, alphas: torch.Tensor, threshold: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """FunASR's loop ``cif`` (BiCif predictor V3): the running sum frame by frame in float32;
    a frame where it reaches ``threshold`` fires, completing the token with ``1 - previous
    sum`` of its weight and starting the next with the rest. Returns (embeddings (B, N, D),
    N = max round(sum of weights); fires (B, T): the running sum after each frame)."""
    b, t, d = hidden.shape
    dev = hidden.device
    integrate = torch.zeros(b, device=dev, dtype=alphas.dtype)
    frame = torch.zeros(b, d, device=dev, dtype=hidden.dtype)
    fires_l, frames_l = [], []
    one = torch.ones(b, device=dev, dtype=alphas.dtype)
    for i in range(t):
        alpha = alphas[:, i]
        completion = one - integrate
        integrate = integrate + alpha
        fires_l.append(integrate)
        fire = integrate >= threshold
        integrate = torch.where(fire, integrate - one, integrate)
        cur = torch.where(fire, completion, alpha)
        rest = alpha - cur
        frame = frame + cur[:, None] * hidden[:, i, :]
        frames_l.append(frame)
        frame = torch.where(fire[:, None], rest[:, None] * hidden[:, i, :], frame)
    fires = torch.stack(fires_l, 1) if t else alphas.new_zeros(b, 0)
    max_len = int(torch.round(alphas.sum(-1)).int().max()) if b else 0
    out = hidden.new_zeros(b, max_len, d)
    if t:
        frames = torch.stack(frames_l, 1)
        mask = fires >= threshold
        for r in range(b):
            sel = frames[r][mask[r]][:max_len]
            out[r, : sel.shape[0]] = sel
    return out, fires


def cif_fires(alphas: torch.Tensor | np.ndarray, threshold: float) -> np.ndarray:
    """FunASR's ``cif_wo_hidden`` for one row (T,) or every row of (B, T) at once: the running
    sum after each frame, less ``threshold`` after every frame where it reached ``threshold``;
    float32 throughout, the same operations in the same order per row (one vector step per
    frame for a batch). A row's first ``n`` values are those of its first ``n`` weights alone."""
    a = np.asarray(
        alphas.detach().cpu().numpy() if isinstance(alphas, torch.Tensor) else alphas,
        dtype=np.float32,
    )
    rows = a.reshape(-1, a.shape[-1]) if a.ndim == 2 else a.reshape(1, -1)
    cols = np.ascontiguousarray(rows.T)  # (T, B)
    thr = np.float32(threshold)
    out = np.empty_like(cols)
    acc = np.zeros(cols.shape[1], dtype=np.float32)
    for i in range(cols.shape[0]):
        acc += cols[i]
        out[i] = acc
        np.subtract(acc, thr, out=acc, where=acc >= thr)
    return np.ascontiguousarray(out.T) if a.ndim == 2 else out[:, 0].copy()


@dataclass(frozen=True)
class CIFTimestamps:
    """Token times from CIF fires, as FunASR reports them: ``tokens[i] = (start_ms, end_ms)``
    for each token (silences left out); ``pieces`` the whole sequence with ``"<sil>"``
    stretches, each ``(label, start_s, end_s)``."""

    tokens: list[tuple[int, int]]
    pieces: list[tuple[str, float, float]]


def cif_timestamps(
    weights: torch.Tensor,
    fires: torch.Tensor,
    tokens: Sequence[str],
    *,
    upsample_rate: int = 1,
    frame_ms: float = 60.0,
    offset_ms: float = 0.0,
    force_time_shift: float = -1.5,
    start_end_threshold: int = 5,
    max_token_duration: int = 12,
) -> CIFTimestamps:
    """FunASR's ``ts_prediction_lfr6_standard`` for one utterance.

    ``weights`` and ``fires`` are that function's ``us_alphas`` and ``us_peaks`` (T,) as the
    caller passes them (Paraformer passes its CIF fires as ``weights`` and its alphas as
    ``fires``; BiCif passes the timestamp predictor's upsampled alphas and fires). A token
    fires at each frame where ``fires >= 1 - 1e-4``; when that does not give ``len(tokens) +
    1`` fires, ``weights`` are rescaled to sum to ``len(tokens) + 1`` and integrated again.
    Times are frame indices shifted by ``force_time_shift`` frames, times ``frame_ms /
    upsample_rate``; a leading gap over ``start_end_threshold`` frames is silence, a token
    longer than ``max_token_duration`` frames is cut there (the rest is silence), and the last
    token ends half-way to the end when the tail is long."""
    tokens = list(tokens)
    if not tokens:
        return CIFTimestamps([], [])
    if tokens[-1] == "</s>":
        tokens = tokens[:-1]
    rate = frame_ms / 1000.0 / upsample_rate
    thr = np.float32(1.0 - 1e-4)
    w = weights.detach().to("cpu", torch.float32).reshape(-1)
    peaks = fires.detach().to("cpu", torch.float32).reshape(-1).numpy()
    fire_place = np.where(peaks >= thr)[0] + force_time_shift
    if len(fire_place) != len(tokens) + 1:
        w = w / (w.sum() / (len(tokens) + 1))
        peaks = cif_fires(w, float(1.0 - 1e-4))
        fire_place = np.where(peaks >= thr)[0] + force_time_shift
    n = peaks.shape[0]
    if len(fire_place) == 0:
        return CIFTimestamps([], [])
    times: list[list[float]] = []
    labels: list[str] = []
    if fire_place[0] > start_end_threshold:
        times.append([0.0, fire_place[0] * rate])
        labels.append("<sil>")
    for i in range(len(fire_place) - 1):
        labels.append(tokens[i] if i < len(tokens) else "<unk>")
        if max_token_duration < 0 or fire_place[i + 1] - fire_place[i] <= max_token_duration:
            times.append([fire_place[i] * rate, fire_place[i + 1] * rate])
        else:
            cut = fire_place[i] + max_token_duration
            times.append([fire_place[i] * rate, cut * rate])
            times.append([cut * rate, fire_place[i + 1] * rate])
            labels.append("<sil>")
    if n - fire_place[-1] > start_end_threshold:
        end = (n + fire_place[-1]) * 0.5
        times[-1][1] = end * rate
        times.append([end * rate, n * rate])
        labels.append("<sil>")
    elif times:
        times[-1][1] = n * rate
    if offset_ms:
        for t in times:
            t[0] += offset_ms / 1000.0
            t[1] += offset_ms / 1000.0
    toks = [
        (int(s * 1000), int(e * 1000))
        for lab, (s, e) in zip(labels, times, strict=True)
        if lab != "<sil>"
    ]
    return CIFTimestamps(
        toks, [(lab, float(s), float(e)) for lab, (s, e) in zip(labels, times, strict=True)]
    )
