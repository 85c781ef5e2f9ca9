"""Cache-aware streaming of the Nemotron FastConformer (NeMo's ``chunked_limited`` streaming, as
``transformers``' ``NemotronAsrStreamingForRNNT`` does it chunk by chunk), batched over streams
of any ages with their caches in core's :class:`~oasr.stream_cache.StreamCachePool`.

A stream with lookahead ``r`` consumes mel frames in chunks of ``1 + 8 r`` (the first) and
``8 (r + 1)`` (then), each giving ``r + 1`` encoder frames (x8 subsampling). What a stream carries
from one chunk to the next lives in the pool, one slot per stream, gathered by index for a step
and written back by index (no per-stream copies):

* per strided subsampling layer its last ``k - s`` input frames (``sub0``, ``sub1``, ..);
* per Conformer layer the keys and values of the last ``left + max_chunk`` frames (``k``, ``v``:
  a ring, frame ``f`` at ``f % ring``): a step writes its chunk's keys and values over the oldest
  and reads the window, the ``left`` frames before the chunk and the chunk, by index and in
  order (one gather per layer, no concatenation, nothing copied back; the frames a young stream
  does not have yet are zeros, masked); and the causal depthwise convolution's last ``k - 1``
  inputs (``conv``);
* greedy transducer streams: the prediction network's state and output (``dec_h``, ``dec_c``,
  ``dec_out``), so the chunk's greedy search is one batched core search
  (:meth:`~oasr.decoders.transducer.TransducerGreedySearch.resume`) for all streams; on CUDA the
  search's device loop (the label-looping loop the offline path uses, its steps replayed as a
  CUDA graph). Beam streams keep their own incremental search.

On the host a stream keeps only its raw audio from the sample before the next chunk's first
window on and a few counters (what a step hands over is held by reference and copied once, into
the step's row). One step builds, for every ready stream, the audio of its chunk (one array, one
host-to-device copy), and one call computes the pre-emphasis and log-mel of every row, the
Conformer layers and the projection into the joint: a fixed sequence of kernels for a given
(batch, lookahead), captured as a CUDA graph per batch-size bucket on CUDA (padded rows read and
write the pool's scratch slot 0) and run eagerly elsewhere (and on CUDA with
``OASR_NEMO_STREAM_GRAPHS=0``, or from a failed capture on: that step and the later ones).

First and later chunks share that call: a first chunk is handed over as a later one whose first
``8 - 1`` mel frames are zero, its caches zero (a new slot), and the output frames those zeros
give zeroed after every strided layer (``s^(n-1-l) - 1`` frames of layer l for stride s and n
strided layers: ``3, 1, 0`` for x8). A causal convolution of zeros then sees exactly what the
first chunk's own ``k - 1`` frames of zero padding give, so the first chunk's frames are
unchanged. At the end the last chunk is zero-padded and the frames past the utterance are masked
as offline, so a stream's result equals offline decoding, whatever streams share its steps.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.decoders.hypothesis import Hypothesis
from oasr.decoders.transducer import TransducerGreedySearch, TransducerModifiedBeamSearch
from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.model import StreamingUpdate
from oasr.options import ResolvedOptions
from oasr.stream_cache import BATCH_BUCKETS, GraphSteps, StreamCachePool, StreamContext, bucket
from oasr_models_nemo.nn import KeyValueStore, LayerCache
from oasr_models_nemo.tokenizer import WORD_BOUNDARY

if TYPE_CHECKING:
    from oasr_models_nemo.model import NemotronASR

#: "no limit" for the valid output frames of a chunk that is not a stream's last
_UNLIMITED = 1 << 30
_SPACES = re.compile(r" +")


@dataclass
class NemotronStreamState:
    options: ResolvedOptions
    lookahead: int
    #: beam search: the stream's own incremental search; greedy: None (its hypothesis is here,
    #: its prediction-network state in the pool; one search per step serves all streams)
    search: Any
    hop: int
    n_fft: int
    #: samples a mel frame needs past its own hop (the centred window's right half)
    window_extra: int
    subsampling: int
    #: the stream's slot in the model's cache pool (None once finished)
    cache: StreamContext | None = None
    #: ``buf[:fill]`` then the ``pending`` arrays: raw samples, left-padded by ``n_fft // 2``
    #: zeros (the centred first frame), from the sample before mel frame ``buffer_frame``'s
    #: window start on (pre-emphasis, on the device, needs each window's previous sample; the
    #: stream's first sample has a zero before it). A step copies a chunk's samples once, from
    #: the arrays handed over into the step's row, and keeps in ``buf`` (trimmed in place, no
    #: allocation per step) only what the next chunks need
    buf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    fill: int = 0
    pending: list[np.ndarray] = field(default_factory=list)
    buffer_frame: int = 0
    samples_received: int = 0
    frames_consumed: int = 0  # mel frames handed to chunks
    chunks: int = 0  # chunks cut so far
    emitted: int = 0  # encoder frames emitted
    cached: int = 0  # attention history frames in the stream's window
    #: encoder output chunks, kept only when the model's ``keep_encoder_output`` is set (tests)
    encoder_output: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    text: str = ""
    tokens_seen: int = 0  # greedy: hypothesis tokens whose bytes are in ``raw_text``
    raw_text: bytearray = field(default_factory=bytearray)
    text_body: str = ""  # ``text`` before its final strip
    text_clean: bool = True  # ``raw_text`` ends on a whole UTF-8 character
    hyp: Hypothesis = field(default_factory=lambda: Hypothesis(tokens=[]))

    @property
    def audio(self) -> np.ndarray:
        """The buffered samples (a copy)."""
        return np.concatenate([self.buf[: self.fill], *self.pending])

    @property
    def first(self) -> bool:
        return self.chunks == 0

    @property
    def chunk_frames(self) -> int:
        """Mel frames of the next chunk."""
        r = self.lookahead
        return 1 + self.subsampling * r if self.first else self.subsampling * (r + 1)

    @property
    def mel_frames(self) -> int:
        """Mel frames the audio received so far holds (NeMo's ``get_seq_len``)."""
        return (self.samples_received + 2 * (self.n_fft // 2) - self.n_fft) // self.hop

    @property
    def samples_needed(self) -> int:
        if self.finished:
            return 0
        frames = self.frames_consumed + self.chunk_frames
        return max(1, frames * self.hop + self.window_extra - self.samples_received)

    def frames_ready(self) -> int:
        """Mel frames whose whole window has arrived (and that are certainly valid)."""
        have = self.n_fft // 2 + self.samples_received  # padded samples
        whole = (have - self.n_fft) // self.hop + 1 if have >= self.n_fft else 0
        return max(0, min(whole, self.mel_frames))


class NemotronStreamRuntime:
    """A model's streaming machinery: the cache pool of all its streams, the step function and
    its CUDA graphs. Created with the model's first stream (``NemotronASR.stream_runtime``)."""

    #: Python's cyclic garbage collector paused for the length of a step (when it was on; on
    #: again at the step's end). A step of N streams makes and drops tens of container objects
    #: per stream (hypotheses, lists); collections in its middle promote the live ones to older
    #: generations, and every so often that sets off a full collection of the whole heap (100+
    #: ms with torch loaded: a p99 outlier). Paused, they are freed by reference counting
    #: before the collector runs (CPU, 256 streams x 10 steps: 43 young and 4 middle
    #: collections -> 1 young). Nothing leaks: cyclic garbage waits for the next collection.
    defer_gc = True

    def __init__(self, model: NemotronASR) -> None:
        c = model.config
        net = model.net
        enc = net.encoder
        sub = enc.subsampling
        self.model = model
        dev, dt = net.device, net.dtype
        if sub.kernel < sub.stride:
            raise UnsupportedOptionError(f"streaming needs a subsampling kernel >= its stride "
                                         f"(got {sub.kernel} < {sub.stride})")
        #: attention history a stream keeps (the model's left context; without one, a bound)
        self.left = c.att_context[0] if c.att_context[0] >= 0 else model.stream_max_history
        attn = enc.layers[0].self_attn
        n_layers = len(enc.layers)
        #: frames of attention history a slot holds: a ring of the last ``left`` frames and the
        #: largest chunk (the chunk's keys are written in place of the oldest; a step reads the
        #: window by index, in order: no concatenation, no copy back)
        known = [r for r in (*c.lookaheads, c.att_context[1]) if r >= 0]
        self.max_chunk = max(known, default=0) + 1
        if not c.lookaheads:  # any lookahead may come: chunks up to the history's length
            self.max_chunk = max(self.max_chunk, self.left)
        self.ring = self.left + self.max_chunk
        self.heads, self.head_dim, self.n_layers = attn.heads, attn.head_dim, n_layers
        self.kpad = c.conv_kernel_size - 1
        self.n_strided = sub.num_strided
        # per strided layer: its input's channels and (padded) frequency bins
        slots: dict[str, tuple[tuple[int, ...], Any]] = {}
        channels, freq = 1, c.num_mel_bins
        for s in range(sub.num_strided):
            padded = freq + sum(sub.pad)
            slots[f"sub{s}"] = ((channels, sub.kernel - sub.stride, padded), dt)
            freq = (padded - sub.kernel) // sub.stride + 1
            channels = c.subsampling_channels
        slots["k"] = ((n_layers, self.ring, attn.heads, attn.head_dim), dt)
        slots["v"] = ((n_layers, self.ring, attn.heads, attn.head_dim), dt)
        slots["conv"] = ((n_layers, c.hidden_size, self.kpad), dt)
        # the prediction network after its start symbol (blank), as NeMo starts: every new
        # greedy stream's decoder state
        tnet = model.transducer
        with torch.no_grad():
            blank = torch.full((1,), c.blank_id, dtype=torch.long, device=dev)
            out, (h, cc) = tnet.predict(blank, tnet.initial_state(1, dev))
        self.initial = {"dec_h": h[:, 0], "dec_c": cc[:, 0], "dec_out": out[0]}
        for name, t in self.initial.items():
            slots[name] = (tuple(t.shape), t.dtype)
        self.pool = StreamCachePool(slots=slots, device=dev)
        #: zero mel frames before a first chunk's (a later chunk's size less the first's) and
        #: the output frames of strided layer l they give
        s, n = sub.stride, sub.num_strided
        if s ** n != c.subsampling_factor:
            raise UnsupportedOptionError(f"streaming needs subsampling_factor = stride ** layers "
                                         f"(got {c.subsampling_factor}, {s} ** {n})")
        self.first_pad = s ** n - 1
        self.first_junk = [s ** (n - 1 - layer) - 1 for layer in range(n)]
        self.graphs: GraphSteps | None = None
        if model.stream_cuda_graphs and dev.type == "cuda":
            self.graphs = GraphSteps(self.compute, self.dummy_inputs)
        self._pinned: dict[tuple[int, int], torch.Tensor] = {}
        self._host: dict[tuple[int, int], np.ndarray] = {}
        self._copied: Any = None  # CUDA event: the last copy from a page-locked buffer is done

    # -- shapes -------------------------------------------------------------------------------
    def chunk_mel_frames(self, lookahead: int) -> int:
        """Mel frames of a later chunk (a first one is padded to this size)."""
        return self.model.config.subsampling_factor * (lookahead + 1)

    def chunk_samples(self, lookahead: int) -> int:
        fe = self.model.mel
        return (self.chunk_mel_frames(lookahead) - 1) * fe.hop_length + fe.n_fft

    def row_samples(self, lookahead: int) -> int:
        """Raw samples of a step's row: the chunk's and the one before it (pre-emphasis)."""
        return self.chunk_samples(lookahead) + 1

    @property
    def n_ints(self) -> int:
        # slot, cached frames, valid encoder frames, mel lo, mel hi, per strided layer the first
        # and the end of its valid output frames, the ring position of the chunk's first frame,
        # then the end of the row's real samples
        return 7 + 2 * self.n_strided

    # -- the device half of a step (captured as a CUDA graph on CUDA) ---------------------------
    def compute(self, audio: torch.Tensor, ints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``audio`` (rows, 1 + samples) float32: each row's chunk of raw samples after the
        sample before it; ``ints`` (rows, :attr:`n_ints`). Pre-emphasis (as offline: ``y[t] =
        x[t] - p x[t-1]``; samples from the row's end column on are zero), log-mel,
        subsampling, Conformer layers with the pool's caches (read and written back by slot),
        projection into the joint. Returns the encoder output (rows, T, D) and its projection
        (rows, T, D_joint)."""
        model = self.model
        net, fe = model.net, model.mel
        enc = net.encoder
        pool = self.pool.slot_tensors
        n = self.n_strided
        y = audio[:, 1:] if fe.preemph is None else audio[:, 1:] - fe.preemph * audio[:, :-1]
        at = torch.arange(y.shape[1], device=audio.device)
        y = y.masked_fill(at[None, :] >= ints[:, -1:], 0.0)
        frames = y.unfold(-1, fe.n_fft, fe.hop_length)  # (rows, CF, n_fft)
        cf = frames.shape[1]
        right = cf // model.config.subsampling_factor - 1
        t_out = right + 1
        slots, cached, valid = ints[:, 0], ints[:, 1], ints[:, 2]
        idx = torch.arange(cf, device=audio.device)
        keep = (idx[None, :] >= ints[:, 3:4]) & (idx[None, :] < ints[:, 4:5])
        feats = fe.log_mel_frames(frames).masked_fill(~keep[..., None], 0.0).to(net.dtype)
        sub_caches = [pool[f"sub{s}"].index_select(0, slots) for s in range(n)]
        starts = [ints[:, 5 + s] for s in range(n)]
        limits = [ints[:, 5 + n + s] for s in range(n)]
        x, new_sub = enc.subsampling.forward_stream(feats, sub_caches, limits, starts)
        for s in range(n):
            pool[f"sub{s}"].index_copy_(0, slots, new_sub[s])
        left = self.left
        position = torch.arange(left + t_out, device=audio.device)
        key_valid = (position[None, :] >= left - cached[:, None]) & (position[None, :] < left + valid[:, None])
        # the keys / values of a slot's layer i: rows (slot * layers + i) * ring + frame % ring
        # of the pool seen as (rows, heads, head_dim); the chunk is written at its frames, the
        # window (``left`` frames before it and the chunk) read in order
        ring, layers = self.ring, len(enc.layers)
        first = ints[:, 5 + 2 * n]  # the chunk's first frame, modulo the ring
        base = slots * (layers * ring)
        write = base[:, None] + (first[:, None] + torch.arange(t_out, device=audio.device)) % ring
        read = base[:, None] + (first[:, None] + position[None, :] - left) % ring
        kflat = pool["k"].view(-1, self.heads, self.head_dim)
        vflat = pool["v"].view(-1, self.heads, self.head_dim)
        convs = pool["conv"].index_select(0, slots)
        caches = [LayerCache(None, None, convs[:, i],
                             _RingWindow(kflat, vflat, (write + i * ring).flatten(), (read + i * ring).flatten()))
                  for i in range(layers)]  # fmt: skip
        out, new = enc.forward_stream(x, key_valid[:, left:], key_valid, caches, right)
        # the convolutions' inputs slide by the chunk (only a stream's last chunk has fewer
        # valid frames, and its caches are not read again)
        for i, lc in enumerate(new):
            pool["conv"][:, i].index_copy_(0, slots, lc.conv[:, :, t_out:])
        return out, net.encoder_projector(out)

    def dummy_inputs(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of a captured step's shapes that touch only the scratch slot 0."""
        rows, lookahead = key
        dev = self.model.device
        audio = torch.zeros(rows, self.row_samples(lookahead), device=dev)
        return audio, torch.zeros(rows, self.n_ints, dtype=torch.long, device=dev)

    def capture(self, max_batch: int, lookahead: int, streams: int | None = None,
                max_symbols: Sequence[int] = ()) -> int:
        """Capture now the CUDA graphs of steps of up to ``max_batch`` streams (every batch
        bucket up to it) with ``lookahead``, after growing the pool to ``streams`` (default
        ``max_batch``) slots, and warm the greedy search's device loop of those buckets for each
        of ``max_symbols`` (symbols per frame; the loop's graphs are captured on first use), so
        that serving captures nothing. Returns the step graphs captured (0 off CUDA, with
        graphs off, or when a capture failed: graphs are then off, warned)."""
        if self.graphs is None:
            return 0
        self.pool.ensure(streams or max_batch)
        before = self.graphs.stats["captures"]
        top = bucket(max_batch, BATCH_BUCKETS)
        t_out = lookahead + 1
        dev = self.model.device
        with torch.no_grad():
            for rows in (r for r in BATCH_BUCKETS if r <= top):
                if not self._capture((rows, lookahead)):
                    return 0
                for symbols in sorted({int(m) for m in max_symbols if int(m) > 1}):
                    proj = torch.zeros(rows, t_out, self.initial["dec_out"].shape[-1], device=dev,
                                       dtype=self.model.dtype)
                    state = tuple(self.initial[k][:, None].expand(-1, rows, -1).contiguous()
                                  for k in ("dec_h", "dec_c"))
                    out = self.initial["dec_out"][None].expand(rows, -1).contiguous()
                    search = self._greedy_search([Hypothesis(tokens=[])] * rows, [0] * rows, state, out,
                                                 symbols)  # fmt: skip
                    search.step(proj, [t_out] * rows)
        return self.graphs.stats["captures"] - before

    def _capture(self, key: tuple[int, int]) -> bool:
        """Capture the step graph of ``key`` unless it exists; False when the capture failed:
        graphs are then off (warned) and every step from this one on runs eagerly. A failed
        capture changes no stream: its warm-up and capture read and write only the scratch slot,
        and the step that asked for it runs eagerly on the inputs it already built."""
        graphs = self.graphs
        if graphs is None:
            return False
        if graphs.try_capture(key, self.pool.generation, self.model.name):
            return True
        self.graphs = None
        return False

    # -- host side ----------------------------------------------------------------------------
    @property
    def _on_cuda_graphs(self) -> bool:
        """CUDA graphs on a CUDA device (the default there): also the greedy search's device loop and
        page-locked audio buffers. Simulated graphs (CPU tests) change only the bucketing."""
        return self.graphs is not None and not self.graphs.simulate and self.model.device.type == "cuda"

    def _greedy_search(self, hyps: list[Hypothesis], frames: list[int], state: Any, decoder_out: Any,
                       max_symbols: int) -> TransducerGreedySearch:  # fmt: skip
        model = self.model
        device_loop = self._on_cuda_graphs
        search = TransducerGreedySearch.resume(
            model.transducer, hyps, frames, state, decoder_out, blank_id=model.config.blank_id,
            max_symbols_per_frame=max_symbols, cuda_graph=device_loop and model.cuda_graphs)
        if device_loop:
            # a chunk has a few frames: the device loop (label looping, CUDA-graph steps) rather
            # than the host frame loop's per-frame reads at several symbols per frame
            search.label_looping_min_frames = 1
        return search

    def _host_audio(self, rows: int, samples: int) -> np.ndarray:
        """A (rows, samples) float32 array (the caller writes every row it uses; the others
        feed padded rows); page-locked with CUDA graphs (reused per shape, once the previous
        copy from it has finished)."""
        if not self._on_cuda_graphs:  # copied (CUDA) or read (CPU) before the call returns
            buf = self._host.get((rows, samples))
            if buf is None:
                buf = self._host[(rows, samples)] = np.zeros((rows, samples), np.float32)
            return buf
        if self._copied is not None:
            self._copied.synchronize()
        buf = self._pinned.get((rows, samples))
        if buf is None:
            buf = self._pinned[(rows, samples)] = torch.zeros(rows, samples, pin_memory=True)
        return buf.numpy()

    def encode(self, states: list[NemotronStreamState], plans: list[tuple[int, int, int, bool]]) -> None:
        """One chunk of each stream (same lookahead) in one call, then the search. ``plans[i]``:
        (first mel frame, real mel frames, chunk index, last chunk) of stream i."""
        model = self.model
        fe = model.mel
        hop, n_fft = fe.hop_length, fe.n_fft
        lookahead = states[0].lookahead
        t_out = lookahead + 1
        n = self.n_strided
        b = len(states)
        graphs = self.graphs
        rows = bucket(b, BATCH_BUCKETS) if graphs is not None else b
        samples = self.row_samples(lookahead)
        audio = self._host_audio(rows, samples)
        # per row: slot, cached frames, then the chunk's first / end mel frame, per strided
        # layer the first / end valid output frame (a first chunk is left-padded; a last one
        # ends where the utterance does) and the end of its real samples
        ints = np.zeros((rows, self.n_ints), np.int64)
        ends = ints[:, -1]
        ring_pos = ints[:, 5 + 2 * n]
        ring = self.ring
        limits = np.full((b, n), _UNLIMITED, np.int64)
        first_pad = self.first_pad * hop
        firsts = []
        for i, (st, (f0, count, index, last)) in enumerate(zip(states, plans, strict=True)):
            a0 = (f0 - st.buffer_frame) * hop
            row = audio[i]
            if index == 0:
                firsts.append(i)
                pad = first_pad
                row[:pad] = 0.0
            else:
                pad = 0
            size = _copy_span(st, a0, a0 + 1 + (count - 1) * hop + n_fft, row[pad:]) if count else 0
            if pad + size < samples:  # the rest of the row is zero
                row[pad + size:] = 0.0
            ends[i] = pad + max(0, size - 1)
            ring_pos[i] = index * t_out % ring
            if last and st.mel_frames:
                total = _offline_lengths(model, st.mel_frames)
                done = _layer_frames(model, lookahead, index)  # the chunks before this one
                limits[i] = [max(0, total[s] - done[s]) for s in range(n)]
            elif last:  # no audio: nothing to say (as offline)
                limits[i] = 0
        ints[:b, 0] = self.pool.slot_ids([st.cache for st in states])
        ints[:b, 1] = np.fromiter((st.cached for st in states), np.int64, b)
        valid = np.minimum(limits[:, -1], t_out)
        ints[:b, 2] = valid
        ints[:b, 4] = np.fromiter((p[1] for p in plans), np.int64, b)
        ints[:b, 5 + n: 5 + 2 * n] = limits
        if firsts:
            ints[firsts, 3] = self.first_pad
            ints[firsts, 4] += self.first_pad
            ints[firsts, 5: 5 + n] = self.first_junk
            ints[firsts, 5 + n: 5 + 2 * n] += np.asarray(self.first_junk, np.int64)
        prof = model.stream_profile
        dev = model.device
        self.pool.reserve([st.cache for st in states], [0] * b)  # applies pending releases
        pinned = self._pinned.get((rows, samples)) if self._on_cuda_graphs else None
        audio_t = (torch.from_numpy(audio) if pinned is None else pinned).to(dev, non_blocking=True)
        if pinned is not None:
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()
        ints_t = torch.from_numpy(ints).to(dev, non_blocking=True)
        if prof is not None:
            prof.lap("features")
        with torch.no_grad():
            out = proj = None
            key = (rows, lookahead)
            if graphs is not None and self._capture(key):
                out, proj = graphs.run(key, self.pool.generation, audio_t, ints_t)
            if out is None:
                out, proj = self.compute(audio_t, ints_t)
            if prof is not None:
                prof.lap("encoder")
            self._search(states, out, proj, valid, rows, ints_t[:, 0])
        if prof is not None:
            prof.lap("search")
        left = self.left
        for st, v in zip(states, valid.tolist(), strict=True):
            st.emitted += v
            st.cached = min(st.cached + t_out, left)
        if prof is not None:
            prof.lap("scatter")

    def _search(self, states: list[NemotronStreamState], out: torch.Tensor, proj: torch.Tensor,
                valid: np.ndarray, rows: int, step_slots: torch.Tensor) -> None:
        """``step_slots`` (rows,): the step's slot ids on the device (the scratch slot 0 for its
        padded rows)."""
        model = self.model
        if model.keep_encoder_output:
            host = out[: len(states)].detach().cpu()
            for i, st in enumerate(states):
                st.encoder_output.append(host[i, : int(valid[i])])
        for i, st in enumerate(states):
            if st.search is not None:
                n = int(valid[i])
                st.search.step(proj[i: i + 1, :n], [n])
        greedy: dict[int, list[int]] = {}
        for i, st in enumerate(states):
            if st.search is None:
                greedy.setdefault(st.options.max_symbols_per_frame, []).append(i)
        pool = self.pool.slot_tensors
        dev = model.device
        for max_symbols, idx in greedy.items():
            group = [states[i] for i in idx]
            whole = len(idx) == len(states)
            # with graphs, every row of the step's bucket (one device-loop shape per bucket); the
            # padded rows read the scratch slot and have no frames
            width = rows if whole and self.graphs is not None else len(idx)
            if whole:  # the step's own slot column, already on the device
                slots = step_slots[:width]
            else:
                slot_ids = np.zeros(width, np.int64)
                slot_ids[: len(idx)] = self.pool.slot_ids([st.cache for st in group])
                slots = torch.from_numpy(slot_ids).to(dev, non_blocking=True)
            state = (pool["dec_h"].index_select(0, slots).transpose(0, 1).contiguous(),
                     pool["dec_c"].index_select(0, slots).transpose(0, 1).contiguous())
            # the search starts each row from an empty hypothesis and the stream appends what this
            # chunk added (not a copy of the whole hypothesis in and out per step)
            hyps = [Hypothesis(tokens=[])] * width
            frames = [st.emitted for st in group] + [0] * (width - len(idx))
            counts = valid.tolist()
            lens = [counts[i] for i in idx] + [0] * (width - len(idx))
            search = self._greedy_search(hyps, frames, state, pool["dec_out"].index_select(0, slots), max_symbols)
            search.step(proj[:width] if whole else proj[torch.as_tensor(idx, device=dev)], lens)
            for st, new in zip(group, search.results(), strict=False):
                h = st.hyp
                if new.tokens:
                    h.tokens += new.tokens
                    h.times += new.times
                    h.token_logprobs += new.token_logprobs
                h.score += new.score
            real = slots[: len(idx)]
            pool["dec_h"].index_copy_(0, real, search.state[0][:, : len(idx)].transpose(0, 1))
            pool["dec_c"].index_copy_(0, real, search.state[1][:, : len(idx)].transpose(0, 1))
            pool["dec_out"].index_copy_(0, real, search.decoder_out[: len(idx)].to(pool["dec_out"].dtype))


class _RingWindow(KeyValueStore):
    """One layer's keys / values of a step's streams in the pool's rings (see ``compute``):
    the chunk's go to rows ``write`` (B * T,), the window is read from rows ``read`` (B * S,)."""

    def __init__(self, kflat: torch.Tensor, vflat: torch.Tensor, write: torch.Tensor, read: torch.Tensor) -> None:
        self.kflat, self.vflat, self.write, self.read = kflat, vflat, write, read

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, t, d = k.shape
        # (B, H, T, dk) views of (B, T, H, dk) projections: rows of H x dk as they are
        self.kflat.index_copy_(0, self.write, k.transpose(1, 2).reshape(b * t, h, d))
        self.vflat.index_copy_(0, self.write, v.transpose(1, 2).reshape(b * t, h, d))
        s = self.read.numel() // b
        keys = self.kflat.index_select(0, self.read).view(b, s, h, d).transpose(1, 2)
        values = self.vflat.index_select(0, self.read).view(b, s, h, d).transpose(1, 2)
        return keys, values


def new_stream(model: NemotronASR, options: ResolvedOptions) -> NemotronStreamState:
    c = model.config
    r = options.lookahead if options.lookahead >= 0 else c.att_context[1]
    if c.lookaheads and r not in c.lookaheads:
        raise InvalidRequestError(
            f"lookahead {r} is not one this model was trained with ({list(c.lookaheads)})",
            param="lookahead")
    search = None
    if options.beam_size > 1:
        search = TransducerModifiedBeamSearch(model.transducer, options.beam_size, 1, blank_id=c.blank_id)
    fe = model.mel
    if fe.normalize is not None or fe.dither > 0:
        raise UnsupportedOptionError("streaming NeMo mel needs normalize=None and dither=0 (per-utterance "
                                     "statistics need the whole signal)", param="normalize")
    st = NemotronStreamState(
        options=options, lookahead=r, search=search, hop=fe.hop_length, n_fft=fe.n_fft,
        window_extra=max(0, fe.n_fft - fe.n_fft // 2 - fe.hop_length),
        subsampling=c.subsampling_factor, buf=np.zeros(fe.n_fft // 2 + 1, np.float32),
        fill=fe.n_fft // 2 + 1)
    rt = model.stream_runtime
    if r + 1 > rt.max_chunk:
        raise InvalidRequestError(f"lookahead {r} is more than this model's streams take ({rt.max_chunk - 1})",
                                  param="lookahead")
    st.cache = rt.pool.open(owner=st)
    tensors = rt.pool.slot_tensors
    for name, value in rt.initial.items():  # open() zeroed the slot
        tensors[name][st.cache.slot] = value
    return st


def _offline_lengths(model: NemotronASR, mel_frames: int) -> list[int]:
    """Output frames of each strided subsampling layer for ``mel_frames`` input frames."""
    sub = model.net.encoder.subsampling
    out, n = [], mel_frames
    for _ in range(sub.num_strided):
        n = (n + sum(sub.pad) - sub.kernel) // sub.stride + 1
        out.append(n)
    return out


def _layer_frames(model: NemotronASR, lookahead: int, chunks: int) -> list[int]:
    """Output frames of each strided layer after ``chunks`` whole chunks: the first chunk's
    ``1 + 8 r`` mel frames give ``4 r + 1``, ``2 r + 1``, ``r + 1``; later chunks ``4 (r + 1)``,
    ``2 (r + 1)``, ``r + 1`` (x8)."""
    sub = model.net.encoder.subsampling
    out = []
    for s in range(sub.num_strided):
        scale = sub.stride ** (sub.num_strided - 1 - s)
        out.append(0 if chunks <= 0 else lookahead * scale + 1 + (chunks - 1) * (lookahead + 1) * scale)
    return out


def _accept(st: NemotronStreamState, a: np.ndarray) -> None:
    """Append raw samples to the stream (pre-emphasis happens on the device, per row of a step:
    :meth:`NemotronStreamRuntime.compute`): held by reference until the step's end
    (:func:`_settle`)."""
    st.pending.append(a)
    st.samples_received += a.size


def _copy_span(st: NemotronStreamState, start: int, stop: int, out: np.ndarray) -> int:
    """Copy the stream's samples ``start:stop`` (of ``buf[:fill]`` then ``pending``; fewer where
    they end) to the start of ``out``; returns how many."""
    n = 0
    fill = st.fill
    if start < fill:
        piece = st.buf[start: min(stop, fill)]
        n = piece.size
        out[:n] = piece
    base = fill
    for a in st.pending:
        if base >= stop:
            break
        end = base + a.size
        if end > start:
            piece = a[max(0, start - base): stop - base]
            out[n: n + piece.size] = piece
            n += piece.size
        base = end
    return n


def _settle(st: NemotronStreamState, drop: int) -> None:
    """Forget the stream's first ``drop`` samples and move the pending ones into ``buf``."""
    fill, pending = st.fill, st.pending
    if len(pending) == 1 and drop >= fill:  # the usual step: the rest of what it was handed
        tail = pending[0][drop - fill:]
        keep = tail.size
        if keep > st.buf.size:
            st.buf = np.empty(max(keep, 2 * st.buf.size), np.float32)
        st.buf[:keep] = tail
        st.fill = keep
        pending.clear()
        return
    total = fill + sum(a.size for a in st.pending)
    keep = total - drop
    if keep > st.buf.size:  # grow (amortised: at least double)
        buf = np.empty(max(keep, 2 * st.buf.size), np.float32)
        if drop < fill:
            buf[: fill - drop] = st.buf[drop: fill]
        st.buf = buf
    elif drop and drop < fill:
        st.buf[: fill - drop] = st.buf[drop: fill]
    if pending:
        _copy_span(st, max(drop, fill), total, st.buf[max(0, fill - drop):])
        pending.clear()
    st.fill = keep


def _plan(st: NemotronStreamState, last: bool) -> list[tuple[int, int, int, bool]]:
    """The chunks the stream's audio allows now: (first mel frame, mel frames, chunk index,
    last). At the end, the rest (possibly nothing) as a last, zero-padded chunk."""
    out = []
    avail = st.mel_frames if last else st.frames_ready()
    while avail - st.frames_consumed >= st.chunk_frames:
        n = st.chunk_frames
        out.append((st.frames_consumed, n, st.chunks, last and avail - st.frames_consumed == n))
        st.frames_consumed += n
        st.chunks += 1
    if last and (avail > st.frames_consumed or not out):
        n = avail - st.frames_consumed
        out.append((st.frames_consumed, n, st.chunks, True))
        st.frames_consumed += n
        st.chunks += 1
    elif last and out:
        out[-1] = (*out[-1][:3], True)
    return out


def stream_step(model: NemotronASR, states: Sequence[NemotronStreamState],
                chunks: Sequence[np.ndarray | None], is_last: Sequence[bool]) -> list[StreamingUpdate]:
    if not (len(states) == len(chunks) == len(is_last)):
        raise InvalidRequestError("states, chunks and is_last must have the same length")
    rt = model.stream_runtime
    paused = rt.defer_gc and gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _stream_step(model, rt, states, chunks, is_last)
    except BaseException:
        # what the failed step was handed is copied now (the caller's arrays are its own again)
        for st in states:
            if st.pending:
                _settle(st, 0)
        raise
    finally:
        if paused:
            gc.enable()


def _stream_step(model: NemotronASR, rt: NemotronStreamRuntime, states: Sequence[NemotronStreamState],
                 chunks: Sequence[np.ndarray | None], is_last: Sequence[bool]) -> list[StreamingUpdate]:
    prof = model.stream_profile
    if prof is not None:
        prof.start()
    # every stream and chunk checked before any stream changes (a bad one fails the step alone)
    audio = []
    for k, (st, chunk) in enumerate(zip(states, chunks, strict=True)):
        if st.finished:
            raise InvalidRequestError("this stream already finished; start a new one")
        if chunk is not None and len(chunk):
            # the engine hands over checked float32 mono arrays: no second check
            ok = isinstance(chunk, np.ndarray) and chunk.dtype == np.float32 and chunk.ndim == 1
            audio.append(chunk if ok else as_mono_waveform(chunk, f"chunk #{k}"))
        else:
            audio.append(None)
    plans = []
    for st, a, last in zip(states, audio, is_last, strict=True):
        if a is not None and a.size:
            _accept(st, a)
        plans.append(_plan(st, bool(last)))
    if prof is not None:
        prof.lap("features")
    # the r-th chunk of every stream in one call (streams of one lookahead share a call)
    for r in range(max((len(p) for p in plans), default=0)):
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(plans):
            if len(p) > r:
                groups.setdefault(states[i].lookahead, []).append(i)
        for rows in groups.values():
            rt.encode([states[i] for i in rows], [plans[i][r] for i in rows])
            if prof is not None:
                prof.calls += 1
    hop = model.mel.hop_length
    updates = []
    for st, last in zip(states, is_last, strict=True):
        if last:
            updates.append(_finish(model, st))
            continue
        # without the samples before the next chunk's first window
        _settle(st, (st.frames_consumed - st.buffer_frame) * hop)
        st.buffer_frame = st.frames_consumed
        best = _best(st)
        if st.search is not None:  # a beam's best may change anywhere
            st.text = model.tokenizer.decode(best.tokens)
        elif len(best.tokens) != st.tokens_seen:  # greedy only appends: decode the new tokens
            _extend_text(st, model.tokenizer.decode_bytes(best.tokens[st.tokens_seen:]))
            st.tokens_seen = len(best.tokens)
        updates.append(StreamingUpdate(text=st.text, is_final=False))
    if prof is not None:
        prof.lap("results")
        prof.steps += 1
        prof.rows += len(states)
    return updates


def _extend_text(st: NemotronStreamState, new: bytearray) -> None:
    """``st.text`` = the tokenizer's text of ``st.raw_text + new``, from the new bytes alone when
    both decode to whole characters (spaces collapse across the seam), else from all of them."""
    st.raw_text += new
    if st.text_clean:
        try:
            piece = bytes(new).decode("utf-8")
        except UnicodeDecodeError:
            piece = None
        if piece is not None:
            piece = _SPACES.sub(" ", piece.replace(WORD_BOUNDARY, " "))
            if piece.startswith(" ") and st.text_body.endswith(" "):
                piece = piece[1:]
            st.text_body += piece
            st.text = st.text_body.strip()
            return
    # a character split across tokens (byte pieces) or not UTF-8: decode everything again
    st.text_body = _SPACES.sub(" ", st.raw_text.decode("utf-8", errors="replace").replace(WORD_BOUNDARY, " "))
    st.text = st.text_body.strip()
    try:
        st.raw_text.decode("utf-8")
        st.text_clean = True
    except UnicodeDecodeError:
        st.text_clean = False


def _best(st: NemotronStreamState) -> Any:
    return st.hyp if st.search is None else st.search.best()[0]


def release(model: NemotronASR, st: NemotronStreamState) -> None:
    if st.cache is not None:
        model.stream_runtime.pool.release(st.cache)


def _finish(model: NemotronASR, st: NemotronStreamState) -> StreamingUpdate:
    st.finished = True
    duration = st.samples_received / model.feature_spec.sample_rate
    tr = model.transcript(_best(st), duration, st.emitted, st.options)
    st.text = tr.text
    release(model, st)
    st.fill = 0
    st.pending = []
    return StreamingUpdate(text=tr.text, is_final=True, transcript=tr)
