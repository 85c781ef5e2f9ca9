"""Continuous batching of Whisper's decoder for :class:`oasr.scheduler.Scheduler`.

:class:`WhisperExecutor` runs every admitted request's 30-second windows through one shared
decoder batch. A *sequence* is one window being decoded; it owns one decoder row. At every step:

1. requests that need a new window are prepared (silence skip, log-mel of the window, initial
   tokens with the previous text as prompt, exactly as :func:`oasr_models_whisper.transcribe.
   transcribe` does) and their windows are encoded in one encoder batch;
2. windows whose KV blocks can be reserved start: the cross-attention K/V of the window is
   projected once into the row's slot of the cross-K/V pool, and the initial tokens are run as a
   prefill (the no-speech probability is read there);
3. all running rows advance by one token in one decoder call over the paged self-attention cache
   (:class:`oasr.kv_cache.PagedKVCache`), replayed from a captured CUDA graph on GPU;
4. a row that samples ``<|endoftext|>`` (or reaches its length limit) ends: its blocks return to
   the pool, its row is refilled by the last row (rows stay dense, so cross-attention reads the
   pool without a gather), and the window result goes through the same seeking / segment code as
   the per-batch path (``_advance``). Temperature fallback re-decodes the window at the next
   temperature. A request whose last window ended completes.

Greedy decoding (any temperature schedule whose first temperature is 0 and whose windows do not
fall back) gives the same tokens as ``WhisperASR.transcribe``: same filters (suppress blank,
suppress tokens, timestamp rules, per row), same float32 log-probability sums, same seeking.
Beam search (``beam_size > 1``) and VAD-batched long-form (``long_form="vad"``) run on the
per-batch path (``WhisperASR.transcribe``), one batch per step for the requests that asked for it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oasr.errors import BadAudioError, InvalidRequestError
from oasr.features.whisper import HOP_LENGTH, N_FRAMES, N_SAMPLES, SAMPLE_RATE, log_mel_spectrogram
from oasr.kv_cache import PagedKVCache, blocks_for
from oasr.layers import install_kernel_providers, paged_decode_attention
from oasr.layers.attention import attention, fixed_shape_attention
from oasr.types import DecodingOptions, Transcript
from oasr_models_whisper.decoding import (
    CHUNK_SECONDS,
    WindowResult,
    compression_ratio,
    detect_language,
    initial_tokens,
    resolve_suppress_tokens,
)
from oasr_models_whisper.speech_gate import empty_transcript, gate_enabled, speech_gate
from oasr_models_whisper.transcribe import (
    LONG_AUDIO_SAMPLES,
    _advance,
    _is_silent,
    _Job,
    _needs_fallback,
    _window_mel,
    whole_log_mel,
)

if TYPE_CHECKING:
    from oasr.scheduler import Request, SchedulerConfig
    from oasr_models_whisper.model import WhisperASR

__all__ = ["WhisperExecutor", "make_executor"]

log = logging.getLogger(__name__)

_UIDS = itertools.count()


def make_executor(model: Any, config: SchedulerConfig) -> WhisperExecutor | None:
    from oasr_models_whisper.nn import WhisperNet

    if not isinstance(getattr(model, "network", None), WhisperNet):
        return None
    return WhisperExecutor(model, config)


# --------------------------------------------------------------------------- bookkeeping
@dataclass
class _ReqState:
    request: Request
    options: DecodingOptions
    job: _Job
    suppress: tuple[int, ...]
    temps: tuple[float, ...]
    # the window being prepared / decoded
    size: int = 0
    feats: torch.Tensor | None = None  # (1, n_audio_ctx, d)
    init: list[int] = field(default_factory=list)
    temp_index: int = 0
    detecting: bool = False
    failed: BaseException | None = None


@dataclass
class _Seq:
    st: _ReqState
    blocks: list[int]
    init_len: int
    sample_begin: int
    sot_index: int
    temperature: float
    sample_len: int
    sampled: list[int] = field(default_factory=list)
    sum_logprob: Any = None  # np.float32
    no_speech_prob: float = math.nan
    suppress_mask: torch.Tensor | None = None  # (V,) bool
    blank_mask: torch.Tensor | None = None  # (V,) bool, or None
    timestamps: bool = True
    max_initial: int | None = None
    last_timestamp: int = -1  # the latest timestamp token sampled (timestamp rules)
    uid: int = field(default_factory=lambda: next(_UIDS))

    @property
    def length(self) -> int:  # tokens in the cache after this step's write
        return self.init_len + len(self.sampled)


class _Graph:
    """One captured decode step for a (batch, gathered blocks) shape."""

    def __init__(self, b: int, nb: int, device: torch.device) -> None:
        self.b, self.nb = b, nb
        self.tokens = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.zeros(b, dtype=torch.long, device=device)
        self.tables = torch.zeros(b, nb, dtype=torch.long, device=device)
        self.lengths = torch.ones(b, dtype=torch.long, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None


class WhisperExecutor:
    """Continuous batching executor for :class:`~oasr_models_whisper.model.WhisperASR`."""

    def __init__(self, model: WhisperASR, config: SchedulerConfig) -> None:
        self.model = model
        self.net = model.network
        self.tok = model.tokenizer
        self.config = config
        dims = self.net.dims
        self.dims = dims
        self.device = self.net.device
        self.dtype = self.net.dtype
        self.n_layer = dims.n_text_layer
        self.n_head = dims.n_text_head
        self.head_dim = dims.n_text_state // dims.n_text_head
        self.block_size = config.block_size
        esize = torch.empty(0, dtype=self.dtype).element_size()
        cross_bytes = 2 * self.n_layer * dims.n_audio_ctx * dims.n_text_state * esize
        block_bytes = PagedKVCache.bytes_per_block(self.n_layer, self.block_size, self.n_head,
                                                   self.head_dim, esize)  # fmt: skip
        self.max_blocks = blocks_for(dims.n_text_ctx, self.block_size)
        full_seq = self.max_blocks * block_bytes
        rows = config.max_batch_size
        if config.kv_cache_bytes is None:
            num_blocks = rows * self.max_blocks + 1
        else:
            budget = int(config.kv_cache_bytes)
            if budget < cross_bytes + full_seq:
                raise InvalidRequestError(
                    f"kv_cache_bytes={budget} cannot hold one Whisper window "
                    f"({cross_bytes + full_seq} bytes: cross-attention K/V + a full decoder context)",
                    param="kv_cache_bytes",
                )
            rows = min(rows, budget // (cross_bytes + block_bytes))
            num_blocks = (budget - rows * cross_bytes) // block_bytes + 1
            num_blocks = min(num_blocks, rows * self.max_blocks + 1)
        self.max_rows = max(1, rows)
        #: windows encoded ahead while every row is busy (CUDA: on a second stream, so the
        #: compute-bound encoder overlaps the memory-bound decode steps)
        lookahead = config.encoder_lookahead
        if lookahead is None:
            lookahead = self.max_rows if self.device.type == "cuda" else 0
        self.encoder_lookahead = max(0, int(lookahead))
        #: the most requests holding state at once (preparing, encoded and waiting, decoding)
        self.max_requests = config.max_batch_size + self.encoder_lookahead
        #: while requests run, admit only once this many can join at once (amortises the VAD
        #: gate, the log-mel and the encoder call over several requests). With windows encoded
        #: ahead, decoder rows refill from those, so admissions can wait for half the look-ahead
        #: to free up; without, for an eighth of the rows.
        group = config.min_admit_group
        if group is None:
            group = self.encoder_lookahead // 2 if self.encoder_lookahead else self.max_rows // 8
        self.min_admit_group = max(1, int(group))
        self._group_open = False
        self.cache = PagedKVCache(self.n_layer, int(num_blocks), self.block_size, self.n_head,
                                  self.head_dim, device=self.device, dtype=self.dtype)  # fmt: skip
        # (rows, frames, d): the projection's own layout, so a window's K/V lands with one
        # contiguous copy; attention reads it as a (rows, heads, frames, head_dim) view
        shape = (self.max_rows, dims.n_audio_ctx, dims.n_text_state)
        self.cross_k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layer)]
        self.cross_v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layer)]
        self.memory_bytes = self.cache.nbytes + 2 * sum(t.numel() * esize for t in self.cross_k)
        self._fused_qkv = self._fuse_self_qkv() if self.device.type == "cuda" else None
        # kernel providers (oasr-kernels: paged decode attention) for models built without
        # load_model, e.g. from an in-memory checkpoint
        install_kernel_providers(self.device.type)
        if self._fused_qkv is not None:
            self.memory_bytes += sum(w.numel() * esize for w, _ in self._fused_qkv)
        self.rows: list[_Seq] = []  # decoding, dense: row i uses cross slot i
        self.states: dict[str, _ReqState] = {}  # admitted requests
        self.to_encode: list[_ReqState] = []
        self.ready: list[_ReqState] = []  # encoded, waiting for a row and KV blocks
        self.legacy: list[Request] = []  # beam search: per-batch path
        self.to_gate: list[tuple[Request, str | None]] = []  # admitted, VAD gate not run yet
        # an encoder batch running on the side stream: (done event, its states, features)
        self._encoding: tuple[Any, list[_ReqState], torch.Tensor] | None = None
        self._enc_stream = (torch.cuda.Stream(self.device)
                            if self.device.type == "cuda" and self.encoder_lookahead else None)  # fmt: skip
        use_graphs = config.cuda_graphs
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            self.use_graphs = False
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._sup_key: tuple | None = None
        self._sup: torch.Tensor | None = None
        self._pool = None
        self._vocab = dims.n_vocab
        self._cols = torch.arange(self._vocab, device=self.device)
        self.graph_batch_sizes = sorted({b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
                                         if b < self.max_rows} | {self.max_rows})  # fmt: skip
        self.stats = {"steps": 0, "graph_replays": 0, "eager_steps": 0, "max_rows": 0,
                      "tokens": 0, "overlapped_encodes": 0}

    def _fuse_self_qkv(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """One (3d, d) weight per decoder layer for the self-attention q/k/v projections: one
        GEMM instead of three per layer and step (at batch 1 each costs a kernel's latency, not
        its bytes). Only for plain :class:`Linear` layers; a quantized or replaced projection
        keeps the three calls."""
        from oasr.layers.basic import Linear

        fused = []
        for block in self.net.decoder.layers:
            att = block.self_attn
            projs = (att.q_proj, att.k_proj, att.v_proj)
            if any(type(p) is not Linear or p.weight.dtype != self.dtype for p in projs):
                return None
            bias = [p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0]) for p in projs]
            fused.append((torch.cat([p.weight for p in projs]).contiguous(), torch.cat(bias).contiguous()))
        return fused

    # ------------------------------------------------------------------ Executor protocol
    @property
    def num_running(self) -> int:
        return len(self.states) + len(self.legacy) + len(self.to_gate)

    def try_admit(self, request: Request) -> bool:
        free = self.max_requests - self.num_running
        if free <= 0:
            return False
        if self.states and not self._group_open and free < self.min_admit_group:
            return False  # refill in groups: one encoder batch + one prefill for several windows
        options = request.options
        language = self.model._check(options)  # typed errors for bad options: this request only
        audio = np.asarray(request.audio)
        if audio.ndim != 1:
            raise BadAudioError(f"audio must be a mono 1-D waveform, got shape {audio.shape}")
        if not np.isfinite(audio).all():
            raise BadAudioError("audio contains NaN or infinite samples")
        self._group_open = True  # the rest of this admission round joins the group
        if (options.beam_size > 1 and options.temperatures[0] == 0) or options.long_form == "vad":
            # beam search and VAD-batched long-form run whole on the per-batch path
            self.legacy.append(request)
            return True
        if gate_enabled(options):
            # the VAD gate runs at the next step, once for every request admitted until then
            # (one batched scan on a GPU instead of launch-bound LSTM steps per request)
            self.to_gate.append((request, language))
            return True
        self._setup(request, language)
        return True

    def _setup(self, request: Request, language: str | None) -> None:
        """Request state for a greedy request that will be decoded; its first window queued."""
        options = request.options
        audio = np.asarray(request.audio)
        wave = torch.as_tensor(audio.astype(np.float32, copy=False)).flatten()
        # the log-mel is computed before the first encode (_ensure_mels: batched on CUDA);
        # whole_log_mel gives wave_samples // HOP_LENGTH frames of content
        job = _Job(0, wave, None, wave.shape[0] // HOP_LENGTH, wave.shape[0] / SAMPLE_RATE)
        job.language = language
        multilingual = self.model.multilingual
        suppress = resolve_suppress_tokens(self.tok, options.suppress_tokens, self.model.non_speech_tokens)
        st = _ReqState(request, options, job, suppress, options.temperatures)
        if options.prompt:
            ids = self.tok.encode(" " + options.prompt.strip())
            job.all_tokens.extend(ids)
            job.prompt_tokens_initial = len(ids)
        if job.language is None and multilingual and job.content_frames > 0:
            st.detecting = True
        elif job.language is None:
            job.language = "en" if not multilingual else None
        if not st.detecting:
            self._set_sot(st)
        self.states[request.rid] = st
        self._next_window(st)

    def _run_gate(self, done: list) -> None:
        """The VAD gate of the requests admitted since the last step: those without speech
        complete with the empty transcript, the others start."""
        pending, self.to_gate = self.to_gate, []
        audios = [np.asarray(r.audio) for r, _ in pending]
        try:  # the segmentation does not depend on the options: one call for all
            keep = speech_gate(audios, pending[0][0].options, self.device)
        except Exception:  # noqa: BLE001 - the gate is a filter: when it fails, decode
            log.warning("vad_gate failed; decoding the inputs ungated", exc_info=True)
            keep = [True] * len(pending)
        for (request, language), speech, audio in zip(pending, keep, audios, strict=True):
            if not speech:
                done.append((request, empty_transcript(len(audio), request.options, language)))
                continue
            try:
                self._setup(request, language)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                done.append((request, exc))

    def abort(self, request: Request) -> bool:
        if request in self.legacy:
            self.legacy.remove(request)
            return True
        for k, (r, _) in enumerate(self.to_gate):
            if r is request:
                del self.to_gate[k]
                return True
        st = self.states.pop(request.rid, None)
        if st is None:
            return False
        if st in self.to_encode:
            self.to_encode.remove(st)
        if st in self.ready:
            self.ready.remove(st)
        for i, seq in enumerate(self.rows):
            if seq.st is st:
                self._drop_row(i)
                break
        return True

    def step(self) -> list[tuple[Request, Transcript | BaseException]]:
        done: list[tuple[Request, Transcript | BaseException]] = []
        self._group_open = False
        self.stats["steps"] += 1
        if self.legacy:
            done.extend(self._run_legacy())
        with torch.inference_mode():
            if self.to_gate:
                self._run_gate(done)
            self._collect_encoded(done)
            self._encode_pending(done)
            self._start_ready(done)
            if self.rows:
                self._decode_step(done)
        return done

    # ------------------------------------------------------------------ request lifecycle
    def _set_sot(self, st: _ReqState) -> None:
        task = st.options.task if self.model.multilingual else None
        st.job.sot_sequence = tuple(
            self.tok.sot_sequence(st.job.language, task, multilingual=self.model.multilingual)
        )

    def _next_window(self, st: _ReqState) -> None:
        """Queue the request's next window for encoding, or mark it complete."""
        job = st.job
        if not st.detecting and st.options.no_speech_threshold is not None:
            while not job.done:
                size = min(N_FRAMES, job.content_frames - job.seek)
                if _is_silent(job.wave[job.seek * HOP_LENGTH : (job.seek + size) * HOP_LENGTH]):
                    job.seek += size
                else:
                    break
        if job.done and not st.detecting:
            st.size = 0
            return
        st.size = min(N_FRAMES, job.content_frames - job.seek)
        st.temp_index = 0
        self.to_encode.append(st)

    def _result(self, st: _ReqState) -> Transcript:
        j = st.job
        segs = [s for s in j.segments if s.text.strip()]
        for k, s in enumerate(segs):
            s.id = k
        text = self.tok.decode(j.all_tokens[j.prompt_tokens_initial :]).strip()
        return Transcript(text=text, language=j.language, duration=j.duration, segments=segs,
                          task=st.options.task)  # fmt: skip

    def _complete(self, st: _ReqState, done: list, error: BaseException | None = None) -> None:
        self.states.pop(st.request.rid, None)
        done.append((st.request, error if error is not None else self._result(st)))

    def _run_legacy(self) -> list[tuple[Request, Transcript | BaseException]]:
        batch, self.legacy = self.legacy, []
        out: list[tuple[Request, Transcript | BaseException]] = []
        groups: list[list[Request]] = []
        for r in batch:
            for g in groups:
                if g[0].options == r.options:
                    g.append(r)
                    break
            else:
                groups.append([r])
        for reqs in groups:
            try:
                res = self.model.transcribe([r.audio for r in reqs], reqs[0].options)
                out.extend(zip(reqs, res, strict=True))
            except Exception:  # noqa: BLE001
                for r in reqs:
                    try:
                        out.append((r, self.model.transcribe([r.audio], r.options)[0]))
                    except Exception as exc:  # noqa: BLE001
                        out.append((r, exc))
        return out

    # ------------------------------------------------------------------ encoder
    def _encode_pending(self, done: list) -> None:
        if not self.to_encode or self._encoding is not None:
            return
        limit = self.config.max_encoder_batch or self.config.max_batch_size
        batch, self.to_encode = self.to_encode[:limit], self.to_encode[limit:]
        # while rows decode, encode on the side stream and pick the result up in a later step;
        # with no row running there is nothing to overlap with
        overlap = self._enc_stream is not None and bool(self.rows)
        try:
            self._ensure_mels(batch)
            mels = []
            for st in batch:
                if st.detecting:
                    mels.append(st.job.mel[:, :N_FRAMES])
                else:
                    mels.append(_window_mel(st.job.mel, st.job.seek, st.size))
            mel = torch.stack(mels).to(self.device, self.dtype)
            if overlap:
                main = torch.cuda.current_stream(self.device)
                self._enc_stream.wait_stream(main)  # the log-mels come from the main stream
                with torch.cuda.stream(self._enc_stream):
                    feats = self.net.encode(mel)
                    event = torch.cuda.Event()
                    event.record()
                # tell the allocator which stream uses what, so no block is reused early
                mel.record_stream(self._enc_stream)
                feats.record_stream(main)
                self._encoding = (event, batch, feats)
                self.stats["overlapped_encodes"] += 1
                return
            feats = self.net.encode(mel)
        except Exception:  # noqa: BLE001 - isolate: encode one by one
            for st in batch:
                try:
                    self._ensure_mels([st])
                    m = st.job.mel[:, :N_FRAMES] if st.detecting else _window_mel(st.job.mel, st.job.seek, st.size)
                    st.feats = self.net.encode(m[None].to(self.device, self.dtype))
                    self._after_encode(st)
                except Exception as exc:  # noqa: BLE001
                    self._complete(st, done, exc)
            return
        self._encoded(batch, feats, done)

    def _ensure_mels(self, batch: list[_ReqState]) -> None:
        """The whole-recording log-mel of every request in ``batch`` that has none yet, on the
        network's device. On CUDA, equal-length recordings share one batched STFT: per request
        it is a dozen small kernels and two host copies, a millisecond of admission time in
        which the GPU waits (64 ms per batch of 64). On the CPU one at a time, exactly the per-batch
        path's computation."""
        todo: dict[int, list[_ReqState]] = {}
        for st in batch:
            if st.job.mel is None:
                todo.setdefault(st.job.wave.shape[0], []).append(st)
        for n, group in todo.items():
            if self.device.type == "cuda" and len(group) > 1 and n <= LONG_AUDIO_SAMPLES:
                waves = torch.stack([st.job.wave for st in group]).pin_memory()
                mels = log_mel_spectrogram(waves.to(self.device, non_blocking=True), self.dims.n_mels,
                                           padding=N_SAMPLES)  # fmt: skip
                for st, mel in zip(group, mels, strict=True):
                    st.job.mel = mel
            else:
                for st in group:
                    st.job.mel = whole_log_mel(st.job.wave.to(self.device), self.dims.n_mels)

    def _collect_encoded(self, done: list) -> None:
        """Take the side stream's encoder batch once it is done; wait for it only when nothing
        else is left to run."""
        if self._encoding is None:
            return
        event, batch, feats = self._encoding
        if not event.query() and (self.rows or self.ready):
            return
        self._encoding = None
        torch.cuda.current_stream(self.device).wait_event(event)
        live = [k for k, st in enumerate(batch) if st.request.rid in self.states]  # not aborted
        if live:
            self._encoded([batch[k] for k in live], feats[live] if len(live) < len(batch) else feats, done)

    def _encoded(self, batch: list[_ReqState], feats: torch.Tensor, done: list) -> None:
        detect = [k for k, st in enumerate(batch) if st.detecting]
        if detect:
            codes, _ = detect_language(self.net, self.tok, feats[detect])
            for k, code in zip(detect, codes, strict=True):
                st = batch[k]
                st.job.language = code
                st.detecting = False
                self._set_sot(st)
                self._next_window(st)  # encode the first window next step
                if st.size == 0:
                    self._complete(st, done)
        for k, st in enumerate(batch):
            if k in detect:
                continue
            st.feats = feats[k : k + 1]
            self._after_encode(st)

    def _after_encode(self, st: _ReqState) -> None:
        if st.detecting:  # encode failed over to one by one while detecting
            codes, _ = detect_language(self.net, self.tok, st.feats)
            st.job.language = codes[0]
            st.detecting = False
            self._set_sot(st)
            self._next_window(st)
            return
        st.init = initial_tokens(
            self.tok, st.job.sot_sequence, prompt=st.job.all_tokens[st.job.prompt_reset_since :],
            without_timestamps=st.options.without_timestamps, n_text_ctx=self.dims.n_text_ctx,
        )  # fmt: skip
        self.ready.append(st)

    # ------------------------------------------------------------------ starting windows
    def _sample_len(self, st: _ReqState) -> int:
        return st.options.max_new_tokens or self.dims.n_text_ctx // 2

    def _start_ready(self, done: list) -> None:
        starting: list[_Seq] = []
        keep: list[_ReqState] = []
        for st in self.ready:
            if len(self.rows) + len(starting) >= self.max_rows:
                keep.append(st)
                continue
            sample_len = self._sample_len(st)
            need = blocks_for(min(len(st.init) + sample_len, self.dims.n_text_ctx), self.block_size)
            if not self.cache.allocator.can_allocate(need):
                keep.append(st)
                continue
            blocks = self.cache.allocator.allocate(need)
            temperature = st.temps[st.temp_index]
            seq = _Seq(st, blocks, len(st.init), len(st.init), st.init.index(self.tok.sot),
                       temperature, sample_len)  # fmt: skip
            self._row_filters(seq)
            starting.append(seq)
        self.ready = keep
        if not starting:
            return
        # cross-attention K/V once per window, straight into the rows' slots
        base = len(self.rows)
        feats = torch.cat([s.st.feats for s in starting]).to(self.device, self.dtype)
        for li, block in enumerate(self.net.decoder.layers):
            att = block.cross_attn
            self.cross_k[li][base : base + len(starting)].copy_(att.k_proj(feats))
            self.cross_v[li][base : base + len(starting)].copy_(att.v_proj(feats))
        self.rows.extend(starting)
        self.stats["max_rows"] = max(self.stats["max_rows"], len(self.rows))
        # prefill, grouped by initial length
        by_len: dict[int, list[int]] = {}
        for i in range(base, len(self.rows)):
            by_len.setdefault(self.rows[i].init_len, []).append(i)
        finished: list[int] = []
        for t, idx in by_len.items():
            seqs = [self.rows[i] for i in idx]
            tokens = torch.tensor([s.st.init for s in seqs], dtype=torch.long, device=self.device)
            positions = torch.arange(t, device=self.device).expand(len(seqs), t)
            tables = self._tables(seqs, blocks_for(t, self.block_size))
            slots = self._slot_ids(tables, positions)
            lengths = torch.full((len(seqs),), t, dtype=torch.long, device=self.device)
            rows = torch.tensor(idx, device=self.device)
            logits = self._forward(tokens, positions, slots, tables, lengths, rows, causal=True)
            if self.tok.no_speech is not None:
                sot = seqs[0].sot_index
                probs = logits[:, sot].float().softmax(dim=-1)[:, self.tok.no_speech].tolist()
                for s, p in zip(seqs, probs, strict=True):
                    s.no_speech_prob = float(p)
            last = logits[:, -1].float().clone()
            for s in seqs:
                s.sum_logprob = np.float32(0.0)
            finished.extend(self._sample(seqs, idx, last))
        self._retire(finished, done)

    def _row_filters(self, seq: _Seq) -> None:
        st = seq.st
        v = self._vocab
        sup = torch.zeros(v, dtype=torch.bool, device=self.device)
        ids = [t for t in st.suppress if t < v]
        if ids:
            sup[torch.tensor(ids, device=self.device)] = True
        seq.suppress_mask = sup
        if st.options.suppress_blank:
            blank = torch.zeros(v, dtype=torch.bool, device=self.device)
            blank[torch.tensor([*self.tok.encode(" "), self.tok.eot], device=self.device)] = True
            seq.blank_mask = blank
        seq.timestamps = not st.options.without_timestamps
        if seq.timestamps:
            precision = CHUNK_SECONDS / self.dims.n_audio_ctx
            seq.max_initial = round(1.0 / precision)

    # ------------------------------------------------------------------ the decoder
    def _tables(self, seqs: Sequence[_Seq], nb: int) -> torch.Tensor:
        rows = [(s.blocks + [0] * nb)[:nb] for s in seqs]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _slot_ids(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        blk = tables.gather(1, positions // bs)
        return blk * bs + positions % bs

    def _forward(self, tokens, positions, slots, tables, lengths, rows, causal: bool) -> torch.Tensor:
        """tokens/positions/slots (B, T); tables (B, nb); lengths (B,) tokens cached after the
        write; ``rows`` (B,) indices into the cross pools, or an int n for rows [0, n).
        Returns float32 logits (B, T, V)."""
        dec = self.net.decoder
        b, t = tokens.shape
        nb = tables.shape[1]
        x = dec.embed_tokens(tokens) + dec.positional_embedding[positions]
        keys = torch.arange(nb * self.block_size, device=self.device)
        if causal:
            mask = keys[None, None, :] <= positions[:, :, None]  # (B, T, S)
        else:
            mask = keys[None, None, :] < lengths[:, None, None]
        mask = mask[:, None]  # (B, 1, T, S)
        flat_slots = slots.reshape(-1)
        for li, block in enumerate(dec.layers):
            att = block.self_attn
            h = block.self_attn_norm(x)
            if self._fused_qkv is not None:
                w, bias = self._fused_qkv[li]
                q, k, v = torch.nn.functional.linear(h, w, bias).split(att.embed_dim, dim=-1)
                q = att._split(q)
            else:
                q = att._split(att.q_proj(h))
                k, v = att.k_proj(h), att.v_proj(h)
            k = k.reshape(b * t, self.n_head, self.head_dim)
            v = v.reshape(b * t, self.n_head, self.head_dim)
            self.cache.write(li, flat_slots, k, v)
            if t == 1:  # a decode step: read the valid keys straight from the blocks
                out = paged_decode_attention(q, self.cache.k[li], self.cache.v[li], tables, lengths)
            else:
                kk, vv = self.cache.gather(li, tables)
                out = attention(q, kk, vv, mask)
            x = x + att.out_proj(out.transpose(1, 2).reshape(b, t, -1))
            if isinstance(rows, int):
                ck, cv = self.cross_k[li][:rows], self.cross_v[li][:rows]
            else:
                ck, cv = self.cross_k[li].index_select(0, rows), self.cross_v[li].index_select(0, rows)
            x = x + self._cross_attention(block, x, ck, cv)
            x = x + block.mlp(block.mlp_norm(x))
        x = dec.final_norm(x)
        return dec.embed_tokens.unembed(x).float()

    def _cross_attention(self, block, x: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor) -> torch.Tensor:
        """Cross-attention of ``x`` (B, T, d) over pooled K/V (B, frames, d)."""
        att = block.cross_attn
        b, t, _ = x.shape
        q = att._split(att.q_proj(block.cross_attn_norm(x)))
        ck, cv = att._split(ck), att._split(cv)
        # the key length is always the encoder's: cuDNN's kernel streams the K/V of a large
        # batch about twice as fast as flash (see fixed_shape_attention), and this read is
        # most of a large model's decode step
        with fixed_shape_attention():
            out = attention(q, ck, cv)
        return att.out_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _decode_step(self, done: list) -> None:
        # rows that were prefilled this step already sampled; every row advances by one token
        n = len(self.rows)
        seqs = self.rows
        need = max(blocks_for(s.length, self.block_size) for s in seqs)
        tokens = [s.sampled[-1] for s in seqs]
        positions = [s.length - 1 for s in seqs]
        if self.use_graphs:
            logits = self._graph_step(seqs, tokens, positions, need)
        else:
            self.stats["eager_steps"] += 1
            tables = self._tables(seqs, need)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
            tok = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
            slots = self._slot_ids(tables, pos)
            logits = self._forward(tok, pos, slots, tables, pos[:, 0] + 1, n, causal=True)[:, -1]
        finished = self._sample(seqs, list(range(n)), logits[:n].float())
        self._retire(finished, done)

    # ------------------------------------------------------------------ CUDA graphs
    def _graph_for(self, n: int, need: int) -> _Graph:
        b = next(x for x in self.graph_batch_sizes if x >= n)
        nb = 1
        while nb < need:
            nb *= 2
        nb = min(nb, self.max_blocks)
        key = (b, nb)
        g = self._graphs.get(key)
        if g is None:
            g = _Graph(b, nb, self.device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()

            def run() -> torch.Tensor:
                pos = g.positions[:, None]
                return self._forward(g.tokens[:, None], pos, g.slots[:, None], g.tables,
                                     pos[:, 0] + 1, b, causal=True)[:, -1]  # fmt: skip

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                g.logits = run()
            g.graph = graph
            self._graphs[key] = g
        return g

    def _graph_step(self, seqs, tokens, positions, need) -> torch.Tensor:
        n = len(seqs)
        g = self._graph_for(n, need)
        bs = self.block_size
        tab = [(s.blocks + [0] * g.nb)[: g.nb] for s in seqs] + [[0] * g.nb] * (g.b - n)
        pos = positions + [0] * (g.b - n)
        slots = [tab[i][pos[i] // bs] * bs + pos[i] % bs for i in range(g.b)]
        host = torch.tensor([tokens + [0] * (g.b - n), pos, slots], dtype=torch.long)
        dev = host.to(self.device, non_blocking=True)
        g.tokens.copy_(dev[0])
        g.positions.copy_(dev[1])
        g.slots.copy_(dev[2])
        g.tables.copy_(torch.tensor(tab, dtype=torch.long).to(self.device, non_blocking=True))
        g.graph.replay()
        self.stats["graph_replays"] += 1
        assert g.logits is not None
        return g.logits

    # ------------------------------------------------------------------ sampling
    def _sample(self, seqs: list[_Seq], rows: list[int], logits: torch.Tensor) -> list[int]:
        """Filter ``logits`` (B, V) per row, pick the next token of each sequence; return the
        rows (indices into ``self.rows``) that finished."""
        b, v = logits.shape
        dev = self.device
        tb, eot = self.tok.timestamp_begin, self.tok.eot
        neg = -math.inf
        blank_rows = [i for i, s in enumerate(seqs) if s.blank_mask is not None and not s.sampled]
        if blank_rows:
            sup = torch.stack([s.suppress_mask for s in seqs])
            br = torch.tensor(blank_rows, device=dev)
            sup[br] |= torch.stack([seqs[i].blank_mask for i in blank_rows])
        else:  # the same rows as last step: reuse the stacked masks
            key = tuple(s.uid for s in seqs)
            if self._sup_key != key:
                self._sup_key, self._sup = key, torch.stack([s.suppress_mask for s in seqs])
            sup = self._sup
        logits.masked_fill_(sup, neg)
        ts_rows = [i for i, s in enumerate(seqs) if s.timestamps]
        if ts_rows:
            self._timestamp_rules(logits, seqs, ts_rows)
        temps = [s.temperature for s in seqs]
        if all(t == 0 for t in temps):
            next_tokens = logits.argmax(dim=-1)
        else:
            next_tokens = logits.argmax(dim=-1)
            hot = [i for i, t in enumerate(temps) if t > 0]
            ht = torch.tensor([temps[i] for i in hot], device=dev)[:, None]
            probs = torch.softmax(logits[hot].float() / ht, dim=-1)
            next_tokens[hot] = torch.multinomial(probs, 1)[:, 0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs[torch.arange(b, device=dev), next_tokens]
        # one device-to-host sync per step: token ids (< 2**24) and float32 log-probs are both
        # exact in float64
        toks_f, picked_f = torch.stack((next_tokens.double(), picked.double())).tolist()
        toks = [int(t) for t in toks_f]
        # float32 sums, added in the same order as the per-batch path's float32 tensor
        for s, p in zip(seqs, picked_f, strict=True):
            s.sum_logprob = np.float32(s.sum_logprob) + np.float32(p)
        self.stats["tokens"] += len(toks)
        finished = []
        for i, (s, t) in enumerate(zip(seqs, toks, strict=True)):
            s.sampled.append(t)
            if t >= tb:
                s.last_timestamp = t
            if t == eot or len(s.sampled) >= s.sample_len or s.length > self.dims.n_text_ctx:
                finished.append(rows[i])
            elif s.length > len(s.blocks) * self.block_size:
                raise RuntimeError("KV blocks exhausted")  # cannot happen: blocks cover init + sample_len
        return finished

    def _timestamp_rules(self, logits, seqs, ts_rows) -> None:
        """openai-whisper's ApplyTimestampRules on the rows that predict timestamps. What the
        rules read of each row's history (its length, whether its last two tokens are
        timestamps, its latest timestamp) is five integers, sent in one host-to-device copy;
        rebuilding the token history on the device every step cost more than the step itself
        on small models."""
        dev = self.device
        tb, eot = self.tok.timestamp_begin, self.tok.eot
        neg = -math.inf
        host = np.empty((len(ts_rows), 6), dtype=np.int64)
        for r, i in enumerate(ts_rows):
            seq = seqs[i]
            sampled = seq.sampled
            n = len(sampled)
            host[r, 0] = n
            host[r, 1] = n > 0 and sampled[-1] >= tb  # last token is a timestamp
            host[r, 2] = n < 2 or sampled[-2] >= tb  # penultimate is one (or there is none)
            host[r, 3] = seq.last_timestamp  # latest timestamp token, -1 before the first
            host[r, 4] = seq.max_initial if seq.max_initial is not None else 10**9
            host[r, 5] = i
        state = torch.from_numpy(host).to(dev, non_blocking=True)
        n, last_ts, pen_ts, last_val, max_init, idx = state.unbind(1)
        last_ts, pen_ts = last_ts.bool(), pen_ts.bool()
        sub = logits[idx]
        sub[:, self.tok.no_timestamps] = neg
        col = self._cols
        pair_done = last_ts & pen_ts
        pair_open = last_ts & ~pen_ts
        mask = (pair_done[:, None] & (col[None, :] >= tb)) | (pair_open[:, None] & (col[None, :] < eot))
        has_ts = last_val >= 0
        limit = torch.where(pair_open, last_val, last_val + 1)
        mask |= has_ts[:, None] & (col[None, :] >= tb) & (col[None, :] < limit[:, None])
        begin = n == 0
        mask |= begin[:, None] & (col[None, :] < tb)
        mask |= begin[:, None] & (col[None, :] > tb + max_init[:, None])
        sub.masked_fill_(mask, neg)
        logprobs = torch.log_softmax(sub.float(), dim=-1)
        ts_mass = logprobs[:, tb:].logsumexp(dim=-1)
        best_text = logprobs[:, :tb].max(dim=-1).values
        force = ts_mass > best_text
        sub.masked_fill_(force[:, None] & (col[None, :] < tb), neg)
        logits[idx] = sub

    # ------------------------------------------------------------------ finishing windows
    def _drop_row(self, i: int) -> _Seq:
        """Remove row ``i``; the last row moves into its place (cross K/V copied)."""
        seq = self.rows[i]
        last = len(self.rows) - 1
        if i != last:
            for li in range(self.n_layer):
                self.cross_k[li][i].copy_(self.cross_k[li][last])
                self.cross_v[li][i].copy_(self.cross_v[li][last])
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.cache.allocator.free(seq.blocks)
        seq.blocks = []
        return seq

    def _retire(self, finished: list[int], done: list) -> None:
        if not finished:
            return
        # drop from the highest row down so moved rows keep valid indices
        seqs = []
        for i in sorted(set(finished), reverse=True):
            seqs.append(self._drop_row(i))
        for seq in seqs:
            st = seq.st
            if st.request.rid not in self.states:
                continue  # aborted
            try:
                self._window_done(seq, done)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self._complete(st, done, exc)

    def _window_done(self, seq: _Seq, done: list) -> None:
        st = seq.st
        eot = self.tok.eot
        body = seq.sampled
        toks = body[: body.index(eot)] if eot in body else list(body)
        text = self.tok.decode(toks).strip()
        slp = float(seq.sum_logprob) if seq.sum_logprob is not None else 0.0
        r = WindowResult(
            tokens=toks, text=text, sum_logprob=slp, avg_logprob=slp / (len(toks) + 1),
            no_speech_prob=float(seq.no_speech_prob), temperature=seq.temperature,
            compression_ratio=compression_ratio(text),
        )  # fmt: skip
        if st.temp_index + 1 < len(st.temps) and _needs_fallback(r, st.options):
            st.temp_index += 1
            self.ready.append(st)  # same window, next temperature
            return
        _advance(st.job, st.size, r, st.feats, self.net, self.tok, st.options)
        st.feats = None
        self._next_window(st)
        if st.size == 0:
            self._complete(st, done)
