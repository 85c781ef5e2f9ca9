"""Cache-aware streaming of the Nemotron FastConformer (NeMo's ``chunked_limited`` streaming, as
``transformers``' ``NemotronAsrStreamingForRNNT`` does it chunk by chunk).

A stream with lookahead ``r`` consumes mel frames in chunks of ``1 + 8 r`` (the first) and
``8 (r + 1)`` (then), each giving ``r + 1`` encoder frames. Per stream: the streaming mel (no
normalisation), unconsumed mel frames, per strided subsampling layer its last ``k - s`` input
frames, per Conformer layer the last ``left`` keys / values and the causal convolution's last
``k - 1`` inputs, and its transducer search (greedy: its hypothesis and prediction-network state,
resumed into one batched core search per step for all streams; beam: its own search). One step
encodes the ready chunk of every stream in one batch: first chunks and later ones go through the subsampling in two groups
(their padding differs), then all rows share the Conformer layers, caches right-aligned to a
common length with the missing keys masked. At the end the last chunk is zero-padded and the
frames past the utterance are masked as offline, so a stream's result equals offline decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.decoders.hypothesis import Hypothesis
from oasr.decoders.transducer import TransducerGreedySearch, TransducerModifiedBeamSearch
from oasr.errors import InvalidRequestError
from oasr.model import StreamingUpdate
from oasr.options import ResolvedOptions
from oasr_models_nemo.nn import LayerCache

if TYPE_CHECKING:
    from oasr_models_nemo.model import NemotronASR


@dataclass
class NemotronStreamState:
    options: ResolvedOptions
    lookahead: int
    mel: Any  # oasr.features.nemo.NemoMelStream
    #: beam search: the stream's own incremental search; greedy: None (the stream's hypothesis
    #: and prediction-network state below are resumed into one search per step for all streams)
    search: Any
    hop: int
    #: samples a mel frame needs past its own hop (the centred window's right half)
    window_extra: int
    subsampling: int
    feats: torch.Tensor  # (n, F) mel frames not yet consumed
    frames_consumed: int = 0  # mel frames consumed by chunks
    mel_frames: int = 0  # mel frames received
    samples_received: int = 0
    emitted: int = 0  # encoder frames emitted
    layer_out: list[int] = field(default_factory=list)  # output frames per strided layer so far
    sub_cache: list[torch.Tensor] | None = None  # per strided layer (C, k - s, F')
    k: torch.Tensor | None = None  # every layer's last keys (layers, H, C, dk)
    v: torch.Tensor | None = None
    conv: torch.Tensor | None = None  # every layer's causal-convolution inputs (layers, D, k - 1)
    #: encoder output chunks, kept only when the model's ``keep_encoder_output`` is set (tests)
    encoder_output: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    text: str = ""
    hyp: Hypothesis = field(default_factory=lambda: Hypothesis(tokens=[]))
    decoder_state: Any = None  # (h, c), each (layers, 1, hidden)
    decoder_out: Any = None  # (1, hidden)

    @property
    def first(self) -> bool:
        return self.sub_cache is None

    @property
    def chunk_frames(self) -> int:
        """Mel frames of the next chunk."""
        r = self.lookahead
        return 1 + self.subsampling * r if self.first else self.subsampling * (r + 1)

    @property
    def samples_needed(self) -> int:
        if self.finished:
            return 0
        frames = self.frames_consumed + self.chunk_frames
        return max(1, frames * self.hop + self.window_extra - self.samples_received)


def new_stream(model: NemotronASR, options: ResolvedOptions) -> NemotronStreamState:
    c = model.config
    r = options.lookahead if options.lookahead >= 0 else c.att_context[1]
    if c.lookaheads and r not in c.lookaheads:
        raise InvalidRequestError(
            f"lookahead {r} is not one this model was trained with ({list(c.lookaheads)})",
            param="lookahead")
    if options.beam_size > 1:
        search = TransducerModifiedBeamSearch(model.transducer, options.beam_size, 1,
                                              blank_id=c.blank_id)
    else:
        search = None
    n_strided = model.net.encoder.subsampling.num_strided
    state = NemotronStreamState(
        options=options, lookahead=r, mel=model.mel.stream(model.device), search=search, hop=c.hop_length,
        window_extra=max(0, c.n_fft - c.n_fft // 2 - c.hop_length),
        subsampling=c.subsampling_factor, feats=torch.zeros(0, c.num_mel_bins, device=model.device),
        layer_out=[0] * n_strided)
    if search is None:  # the prediction network after its start symbol (blank), as NeMo starts
        net = model.transducer
        with torch.no_grad():
            blank = torch.full((1,), c.blank_id, dtype=torch.long, device=model.device)
            state.decoder_out, state.decoder_state = net.predict(blank, net.initial_state(1, model.device))
    return state


def _offline_lengths(model: NemotronASR, mel_frames: int) -> list[int]:
    """Output frames of each strided subsampling layer for ``mel_frames`` input frames."""
    sub = model.net.encoder.subsampling
    out, n = [], mel_frames
    for _ in range(sub.num_strided):
        n = (n + sum(sub.pad) - sub.kernel) // sub.stride + 1
        out.append(n)
    return out


def stream_step(model: NemotronASR, states: Sequence[NemotronStreamState],
                chunks: Sequence[np.ndarray | None], is_last: Sequence[bool]) -> list[StreamingUpdate]:
    if not (len(states) == len(chunks) == len(is_last)):
        raise InvalidRequestError("states, chunks and is_last must have the same length")
    # each stream frames its own audio; the log-mel of every stream's new frames is one call
    windows: list[torch.Tensor] = []
    for k, (st, chunk, last) in enumerate(zip(states, chunks, is_last, strict=True)):
        if st.finished:
            raise InvalidRequestError("this stream already finished; start a new one")
        a = as_mono_waveform(chunk, f"chunk #{k}") if chunk is not None and len(chunk) else None
        parts = []
        if a is not None:
            st.samples_received += len(a)
            parts.append(st.mel.accept_windows(torch.from_numpy(a)))  # on the model's device
        if last:
            parts.append(st.mel.finish_windows())
        windows.append(torch.cat(parts) if len(parts) > 1 else parts[0] if parts else None)
    counts = [0 if w is None else w.shape[0] for w in windows]
    if sum(counts):
        mel = model.mel.log_mel_frames(torch.cat([w for w in windows if w is not None and len(w)]))
        pieces = iter(mel.split([c for c in counts if c]))
        for st, n in zip(states, counts, strict=True):
            if n:
                st.feats = torch.cat([st.feats, next(pieces).to(st.feats.dtype)])
                st.mel_frames += n
    pending = [_take_chunks(st, bool(last)) for st, last in zip(states, is_last, strict=True)]
    rounds = max((len(p) for p in pending), default=0)
    for r in range(rounds):
        rows = [i for i, p in enumerate(pending) if len(p) > r]
        by_lookahead: dict[int, list[int]] = {}
        for i in rows:
            by_lookahead.setdefault(states[i].lookahead, []).append(i)
        for group in by_lookahead.values():
            _encode(model, [states[i] for i in group], [pending[i][r] for i in group])
    updates = []
    for st, last in zip(states, is_last, strict=True):
        if last:
            updates.append(_finish(model, st))
        else:
            st.text = model.tokenizer.decode(_best(st).tokens)
            updates.append(StreamingUpdate(text=st.text, is_final=False))
    return updates


def _take_chunks(st: NemotronStreamState, last: bool) -> list[tuple[torch.Tensor, bool]]:
    """Whole chunks of buffered mel frames; at the end the rest, zero-padded to a chunk."""
    out = []
    while st.feats.shape[0] >= st.chunk_frames:
        n = st.chunk_frames
        is_final = last and st.feats.shape[0] == n
        out.append((st.feats[:n], is_final))
        st.feats = st.feats[n:]
        st.frames_consumed += n
        _mark_started(st)
    if last and (st.feats.shape[0] or not out):
        n = st.chunk_frames
        pad = st.feats.new_zeros(n - st.feats.shape[0], st.feats.shape[1])
        out.append((torch.cat([st.feats, pad]), True))
        st.frames_consumed += st.feats.shape[0]
        st.feats = st.feats[:0]
        _mark_started(st)
    elif last and out:
        out[-1] = (out[-1][0], True)
    return out


def _mark_started(st: NemotronStreamState) -> None:
    # chunk sizes are decided when chunks are cut; the subsampling caches arrive when the chunk
    # is encoded. An empty list marks "past the first chunk" until then.
    if st.sub_cache is None:
        st.sub_cache = []


def _encode(model: NemotronASR, states: list[NemotronStreamState],
            chunks: list[tuple[torch.Tensor, bool]]) -> None:
    net = model.net
    enc = net.encoder
    sub = enc.subsampling
    c = model.config
    dev, dt = net.device, net.dtype
    right = states[0].lookahead
    t_out = right + 1
    n_strided = sub.num_strided
    # per row: how many output frames of each strided layer are valid in this chunk
    limits = []
    for st, (_, final) in zip(states, chunks, strict=True):
        if final:
            total = _offline_lengths(model, st.mel_frames)
            limits.append([max(0, total[s] - st.layer_out[s]) for s in range(n_strided)])
        else:
            limits.append([1 << 30] * n_strided)
    # subsampling: first chunks and later chunks separately (different padding / sizes)
    x = torch.zeros(len(states), t_out, c.hidden_size, device=dev, dtype=dt)
    firsts = [i for i, st in enumerate(states) if not st.sub_cache]
    laters = [i for i, st in enumerate(states) if st.sub_cache]
    for group in (firsts, laters):
        if not group:
            continue
        feats = torch.stack([chunks[i][0] for i in group]).to(dev, dt)
        caches: list[torch.Tensor | None] = [None] * n_strided
        if group is laters:
            caches = [torch.stack([states[i].sub_cache[s] for i in group]) for s in range(n_strided)]
        lim = [torch.tensor([limits[i][s] for i in group], device=dev) for s in range(n_strided)]
        with torch.no_grad():
            out, new = sub.forward_stream(feats, caches, lim)
        if out.shape[1] != t_out:
            raise AssertionError(f"a chunk gave {out.shape[1]} frames, expected {t_out}")
        x[group] = out
        for j, i in enumerate(group):
            states[i].sub_cache = [n[j] for n in new]
            for s in range(n_strided):
                states[i].layer_out[s] += min(limits[i][s], _chunk_out(sub, s, group is firsts, right))
    # Conformer layers: every row gives t_out frames; caches right-aligned to a common length
    lens = [0 if st.k is None else st.k.shape[2] for st in states]
    cmax = max(lens)
    b = len(states)
    n_layers = len(enc.layers)
    heads, dk = enc.layers[0].self_attn.heads, enc.layers[0].self_attn.head_dim
    kpad = c.conv_kernel_size - 1
    valid = [min(t_out, limits[i][-1]) for i in range(b)]  # encoder frames of each row
    # which keys are real: each stream's own cache, then the chunk's valid frames (built on the
    # host, one copy)
    position = torch.arange(cmax + t_out)
    starts = torch.tensor([cmax - n for n in lens])
    ends = torch.tensor([cmax + n for n in valid])
    key_valid = ((position[None, :] >= starts[:, None]) & (position[None, :] < ends[:, None])).to(dev)
    valid_mask = key_valid[:, cmax:]

    def stacked(get, shape) -> torch.Tensor:  # noqa: ANN001
        """(B, layers, ...) from each stream's tensor (zeros for a new stream), left-padded on
        the cache axis to ``cmax`` (one stack, not a copy per layer and stream)."""
        rows = []
        for st in states:
            t = get(st)
            if t is None:
                rows.append(torch.zeros(shape, device=dev, dtype=dt))
            elif t.shape[2] < shape[2]:
                rows.append(torch.nn.functional.pad(t, (0, 0, shape[2] - t.shape[2], 0)))
            else:
                rows.append(t)
        return torch.stack(rows)

    keys = stacked(lambda st: st.k, (n_layers, heads, cmax, dk))
    values = stacked(lambda st: st.v, (n_layers, heads, cmax, dk))
    convs = torch.stack([st.conv if st.conv is not None else
                         torch.zeros(n_layers, c.hidden_size, kpad, device=dev, dtype=dt)
                         for st in states])
    caches = [LayerCache(keys[:, li], values[:, li], convs[:, li]) for li in range(n_layers)]
    left = c.att_context[0]
    with torch.no_grad():
        out, new = enc.forward_stream(x, valid_mask, key_valid, caches, right)
        proj = net.encoder_projector(out)
        new_k = torch.stack([lc.k for lc in new], dim=1)  # (B, layers, H, cmax + T, dk)
        new_v = torch.stack([lc.v for lc in new], dim=1)
        new_conv = torch.stack([lc.conv for lc in new], dim=1)  # (B, layers, D, k - 1 + T)
    for i, st in enumerate(states):
        n = valid[i]
        keep = min(lens[i] + n, left) if left >= 0 else lens[i] + n
        end = cmax + n
        st.k = new_k[i, :, :, end - keep:end]
        st.v = new_v[i, :, :, end - keep:end]
        # the depthwise convolution's input: cache (k - 1) then the chunk's frames
        st.conv = new_conv[i, :, :, n: n + kpad]
        if model.keep_encoder_output:
            st.encoder_output.append(out[i, :n].detach().cpu())
        if st.search is not None:
            st.search.step(proj[i: i + 1, :n], [n])
    # greedy streams: one search over all of them, resumed from each stream's state
    greedy: dict[int, list[int]] = {}
    for i, st in enumerate(states):
        if st.search is None:
            greedy.setdefault(st.options.max_symbols_per_frame, []).append(i)
    for max_symbols, rows in greedy.items():
        group = [states[i] for i in rows]
        search = TransducerGreedySearch.resume(
            model.transducer, [st.hyp for st in group], [st.emitted for st in group],
            tuple(torch.cat([st.decoder_state[j] for st in group], dim=1) for j in (0, 1)),
            torch.cat([st.decoder_out for st in group]), blank_id=c.blank_id,
            max_symbols_per_frame=max_symbols)
        search.step(proj[rows] if len(rows) < len(states) else proj, [valid[i] for i in rows])
        for k, (st, hyp) in enumerate(zip(group, search.results(), strict=True)):
            st.hyp = hyp
            st.decoder_state = tuple(x[:, k:k + 1] for x in search.state)
            st.decoder_out = search.decoder_out[k:k + 1]
    for i, st in enumerate(states):
        st.emitted += valid[i]


def _chunk_out(sub: Any, s: int, first: bool, right: int) -> int:
    """Output frames of strided layer ``s`` for one chunk (before masking): the first chunk's
    ``1 + 8 r`` mel frames give ``4 r + 1``, ``2 r + 1``, ``r + 1``; later chunks ``4 (r + 1)``,
    ``2 (r + 1)``, ``r + 1`` (x8)."""
    scale = 2 ** (sub.num_strided - 1 - s)
    return right * scale + 1 if first else (right + 1) * scale


def _best(st: NemotronStreamState) -> Any:
    return st.hyp if st.search is None else st.search.best()[0]


def _finish(model: NemotronASR, st: NemotronStreamState) -> StreamingUpdate:
    st.finished = True
    duration = st.samples_received / model.feature_spec.sample_rate
    tr = model.transcript(_best(st), duration, st.emitted, st.options)
    st.text = tr.text
    st.k = st.v = st.conv = None
    st.sub_cache = []
    return StreamingUpdate(text=tr.text, is_final=True, transcript=tr)
