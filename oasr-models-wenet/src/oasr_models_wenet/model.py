"""``WenetASR``: WeNet Conformer U2/U2++ as an OASR :class:`~oasr.model.StreamingASRModel`.

Offline: Kaldi fbank (the checkpoint's options, dither 0) -> global CMVN -> Conformer encoder
(full attention, or the chunk mask when ``offline_chunk_size > 0``) -> CTC. ``beam_size == 1``:
CTC greedy; ``beam_size > 1``: CTC prefix beam search with that beam, then attention rescoring
(U2++: left-to-right and right-to-left decoders weighted by ``reverse_weight``).

Streaming: ``new_stream(options)`` / ``stream_step(states, chunks, is_last)``. Each stream keeps
its fbank framing remainder, unconsumed feature frames, per-layer K/V caches (trimmed to
``chunk_size * num_left_chunks`` frames when ``num_left_chunks >= 0``), causal-convolution
caches and an incremental CTC search; one call encodes the ready chunk of every stream in one
batch (rows padded and masked, so results do not depend on the batch). The last chunk triggers
attention rescoring over the whole utterance's encoder output.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.decoders.context_graph import ContextGraph, PieceEncoder, context_graph_for
from oasr.decoders.ctc import (
    CTCGreedySearch,
    CTCHypothesis,
    CTCPrefixBeamSearch,
    attention_rescoring,
    build_rescoring_inputs,
    group_words,
    token_timestamps,
)
from oasr.decoders.ctc_gpu import (
    GPUCTCPrefixBeamSearch,
    ctc_prefix_beam_search_gpu,
    nbest_streams,
    step_streams,
)
from oasr.decoders.graph_search import (
    graph_search_requested,
    graph_transcripts,
    refuse_graph_search_streaming,
)
from oasr.errors import CheckpointError, InvalidRequestError, UnsupportedOptionError
from oasr.layers import resolve_dtype
from oasr.model import ProgressCallback, StreamingUpdate
from oasr.options import ResolvedOptions
from oasr.stream_cache import (
    BATCH_BUCKETS,
    GraphSteps,
    StepProfile,
    StreamCachePool,
    StreamContext,
    bucket,
)
from oasr.types import (
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Segment,
    Transcript,
    Word,
)
from oasr_models_wenet.config import WenetConfig
from oasr_models_wenet.nn import WenetNet, build_network
from oasr_models_wenet.options import WenetOptions
from oasr_models_wenet.plugin import CAPABILITIES


class Units:
    """The unit table (``units.txt``): id -> piece; detokenizes sentencepiece-style pieces."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    def piece(self, i: int) -> str:
        return self.pieces[i] if 0 <= i < len(self.pieces) else f"<{i}>"

    @functools.cached_property
    def language(self) -> str | None:
        """'zh' when most units are CJK characters, 'en' when most are Latin letters, else
        None (a monolingual model's transcripts carry this language)."""
        from oasr.decoders.ctc import _is_cjk

        body = [p.lstrip("\u2581") for p in self.pieces if p and not p.startswith("<")]
        if not body:
            return None
        cjk = sum(1 for p in body if p and all(_is_cjk(c) for c in p))
        latin = sum(1 for p in body if p and all(c.isascii() and (c.isalpha() or c == "'") for c in p))
        if cjk > 0.5 * len(body):
            return "zh"
        if latin > 0.5 * len(body):
            return "en"
        return None

    def join(self, ids: Sequence[int]) -> str:
        """The pieces of ``ids`` concatenated, word boundaries ("\u2581") kept: ``decode`` of a
        hypothesis that grew is ``clean(join(old) + join(new))``."""
        p = self.pieces
        if ids and 0 <= min(ids) and max(ids) < len(p):  # every id known (search output): C loops
            return "".join(map(p.__getitem__, ids))
        return "".join([self.piece(i) for i in ids])

    @staticmethod
    def clean(joined: str) -> str:
        """Text from joined pieces: word boundaries become spaces, outer spaces stripped."""
        return joined.replace("\u2581", " ").strip()

    def decode(self, ids: Sequence[int]) -> str:
        return self.clean(self.join(ids))


@dataclass
class WenetStreamState:
    """Per-stream state (see the module docstring). ``samples_needed``: samples of new audio
    the next chunk needs. The stream's attention history and convolution caches live in the
    model's :class:`~oasr.stream_cache.StreamCachePool` under ``cache`` (its slot)."""

    options: ResolvedOptions  # common + WeNet options of this stream
    chunk_size: int
    num_left_chunks: int
    window: int  # feature frames of one chunk's input
    stride: int  # feature frames between chunk starts
    win_length: int
    hop_length: int
    search: Any
    cache: StreamContext | None = None
    #: the audio from feature frame ``frames_consumed`` on, as the arrays it was fed in (views):
    #: a chunk's window is copied from them straight into the batch, never joined first
    pieces: list[np.ndarray] = field(default_factory=list)
    samples_received: int = 0
    frames_consumed: int = 0  # feature frames before the next chunk's first
    offset: int = 0  # encoder frames emitted
    keep_encoder_output: bool = False  # collect ``enc`` (attention rescoring, tests, VAD)
    return_encoder_output: bool = False  # keep ``enc`` after the final update (tests, VAD)
    enc: list[torch.Tensor] = field(default_factory=list)  # encoder output chunks (T, d)
    finished: bool = False
    text: str = ""
    tokens_seen: int = 0  # hypothesis length when ``text`` was last decoded
    joined: str = ""  # greedy: the pieces of the first ``tokens_seen`` tokens (Units.join)

    @property
    def samples_needed(self) -> int:
        if self.finished:
            return 0
        frames = self.frames_consumed + self.window
        total = self.win_length + (frames - 1) * self.hop_length
        return max(1, total - self.samples_received)

    def copy_audio(self, lo: int, dst: np.ndarray) -> int:
        """Copy the buffered samples from ``lo`` on into ``dst`` (as many as fit and exist);
        returns how many were copied."""
        n, done = dst.size, 0
        for p in self.pieces:
            if lo >= p.size:
                lo -= p.size
                continue
            k = min(p.size - lo, n - done)
            dst[done : done + k] = p[lo : lo + k]
            done += k
            lo = 0
            if done == n:
                break
        return done

    def drop_audio(self, n: int) -> None:
        """Forget the first ``n`` buffered samples (all of them when there are fewer)."""
        ps = self.pieces
        while ps and n >= ps[0].size:
            n -= ps.pop(0).size
        if ps and n > 0:
            ps[0] = ps[0][n:]

    @property
    def frames_available(self) -> int:
        """Feature frames the received audio holds (Kaldi framing, ``snip_edges``)."""
        n = self.samples_received
        return 0 if n < self.win_length else 1 + (n - self.win_length) // self.hop_length


class WenetASR:
    """A loaded WeNet U2/U2++ model."""

    #: the architecture's capabilities, as registered; an instance narrows them to its checkpoint
    capabilities: ModelCapabilities = CAPABILITIES

    def __init__(self, net: WenetNet, units: Sequence[str], config: WenetConfig, *, name: str = "wenet conformer",
                 source_format: str = "wenet", source_path: Path | None = None) -> None:
        self.net = net
        self.config = config
        self.units = Units(units)
        if len(self.units.pieces) != config.vocab_size:
            raise CheckpointError(
                f"the unit table has {len(self.units.pieces)} entries but the model has "
                f"{config.vocab_size} outputs; the units.txt does not belong to this checkpoint"
            )
        self.name = name
        self.source_format = source_format
        self.source_path = source_path
        self._hotword_encoder: PieceEncoder | None = None  # spells hotwords; made on first use
        # WeNet streams only models trained with chunk masks (dynamic or static); a full-context
        # model would see a context it was never trained on
        trained_chunked = config.use_dynamic_chunk or config.static_chunk_size > 0
        self.capabilities = replace(CAPABILITIES, streaming=trained_chunked)
        self.feature_spec = FeatureSpec(
            kind="kaldi_fbank",
            sample_rate=config.sample_rate,
            num_bins=config.num_mel_bins,
            hop_length=int(config.sample_rate * config.frame_shift_ms / 1000),
            win_length=int(config.sample_rate * config.frame_length_ms / 1000),
            n_fft=512,
            options={"scale": 32768.0, "dither": 0.0, "energy_floor": 0.0,
                     "frame_length_ms": config.frame_length_ms, "frame_shift_ms": config.frame_shift_ms},
        )
        from oasr.features.kaldi import KaldiFbank

        self.fbank = KaldiFbank(self.feature_spec)
        # a static-chunk model (use_dynamic_chunk false, static_chunk_size > 0) always runs with its
        # chunk mask, offline too, as WeNet's encoder does
        static = config.static_chunk_size if not config.use_dynamic_chunk and config.static_chunk_size > 0 else 0
        self.static_chunk_size = static
        #: this model's defaults of the per-request WeNet options (WeNet recipes decode with
        #: ctc_weight 0.3 / reverse_weight 0.5); the attributes below read and set them
        self.default_options = WenetOptions(
            ctc_weight=0.3,
            reverse_weight=0.5 if net.r_decoder is not None else 0.0,
            chunk_size=static or 16,
            decoding_chunk_size=static or -1,
        )
        self.max_token_duration = 1.0
        self.keep_encoder_output = False
        self.word_confidence = "ctc"  # or "attention" (decoder probabilities after rescoring)

    # the model-level defaults of the WeNet options, under their historical attribute names;
    # setting one validates it
    def _default(name: str, doc: str) -> property:  # noqa: N805 - a class-body helper
        def get(self: WenetASR) -> Any:
            return getattr(self.default_options, name)

        def set_(self: WenetASR, value: Any) -> None:
            self.default_options = self.default_options.override({name: value})

        return property(get, set_, doc=doc)

    decoding_method = _default("decoding_method", "default WeNet option decoding_method")
    ctc_weight = _default("ctc_weight", "default WeNet option ctc_weight")
    reverse_weight = _default("reverse_weight", "default WeNet option reverse_weight")
    chunk_size = _default("chunk_size", "default streaming chunk (WeNet option chunk_size)")
    num_left_chunks = _default("num_left_chunks", "default WeNet option num_left_chunks")
    offline_chunk_size = _default("decoding_chunk_size", "default WeNet option decoding_chunk_size")
    offline_left_chunks = _default("num_decoding_left_chunks",
                                   "default WeNet option num_decoding_left_chunks")
    del _default

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_wenet(cls, path: str | Path, config: EngineConfig | None = None) -> WenetASR:
        from oasr_models_wenet.checkpoints import load_wenet

        cfg, state, units = load_wenet(Path(path))
        return cls._build(cfg, state, units, config, "wenet", Path(path))

    @classmethod
    def _build(cls, cfg: WenetConfig, state: dict, units: list[str], config: EngineConfig | None,
               source: str, path: Path | None) -> WenetASR:
        config = config or EngineConfig()
        net = build_network(cfg, state, config.device, resolve_dtype(config.dtype))
        return cls(net, units, cfg, source_format=source, source_path=path,
                   name=f"wenet {cfg.input_layer} conformer {cfg.num_blocks}x{cfg.output_size}")

    @classmethod
    def from_native(cls, path: str | Path, body: dict[str, Any] | None = None,
                    config: EngineConfig | None = None) -> WenetASR:
        from oasr.checkpoint import read_native_config
        from oasr_models_wenet.checkpoints import load_native

        body = body or read_native_config(Path(path))
        cfg, state, units = load_native(Path(path), body)
        model = cls._build(cfg, state, units, config, "oasr", Path(path))
        model.default_options = model.default_options.with_saved(body.get("decoding"))
        return model

    def save_native(self, dst: str | Path) -> str:
        """Write OASR's native format (``model.safetensors`` + ``oasr_model.json`` with the
        config and unit table); returns ``"conformer"``."""
        from oasr_models_wenet.checkpoints import save_native

        return save_native(Path(dst), self)

    # ------------------------------------------------------------------ helpers
    @property
    def frame_shift(self) -> float:
        """Seconds per encoder frame."""
        return self.net.encoder.subsampling_rate * self.feature_spec.hop_length / self.feature_spec.sample_rate

    def _check(self, options: DecodingOptions | ResolvedOptions) -> ResolvedOptions:
        """``options`` validated for this model, with the WeNet options resolved."""
        options = options.validate_for(self)
        if options.reverse_weight > 0 and self.net.r_decoder is None:
            raise UnsupportedOptionError(
                f"{self.name} has no right-to-left decoder (U2, not U2++); reverse_weight must be 0",
                param="reverse_weight",
            )
        if options.decoding_chunk_size > 0:
            if not self.capabilities.streaming:
                raise UnsupportedOptionError(
                    f"{self.name} was trained without chunk masks; decoding_chunk_size must be -1",
                    param="decoding_chunk_size",
                )
            if self.static_chunk_size and options.decoding_chunk_size != self.static_chunk_size:
                raise UnsupportedOptionError(
                    f"{self.name} was trained with a static chunk of {self.static_chunk_size} "
                    f"frames; decoding_chunk_size must be {self.static_chunk_size}",
                    param="decoding_chunk_size",
                )
        if options.language not in (None, "", "auto") and options.language.split("-")[0].lower() not in (
            "zh", "en", "auto"
        ):
            # the checkpoint is monolingual; a language hint cannot be honoured but is harmless
            pass
        return options

    @staticmethod
    def _wave(audio: Any, k: int) -> np.ndarray:
        return as_mono_waveform(audio, f"audio #{k}")

    def _transcript(self, hyp: CTCHypothesis, duration: float, options: DecodingOptions, *,
                    confidences: list[float] | None = None, num_frames: int | None = None) -> Transcript:
        text = self.units.decode(hyp.tokens)
        # token confidences: the CTC posterior at each token's peak frame (default), or the
        # attention decoder's probabilities after rescoring (WeNet's choice) when
        # ``word_confidence == "attention"``
        use_att = confidences is not None and self.word_confidence == "attention"
        words: list[Word] = []
        # token timings feed only the words (the hot path of every stream's final update skips
        # them when word timestamps were not asked for)
        if options.word_timestamps and hyp.tokens and len(hyp.times) == len(hyp.tokens):
            conf = confidences if use_att else hyp.confidences
            timings = token_timestamps(hyp.tokens, hyp.times, conf, frame_shift=self.frame_shift,
                                       num_frames=num_frames, max_token_duration=self.max_token_duration)
            pieces = [self.units.piece(t) for t in hyp.tokens]
            words = [Word(w, min(s, duration), min(e, duration), c)
                     for w, s, e, c in group_words(pieces, timings)]
        lps = hyp.token_logprobs
        avg = float(sum(lps) / len(lps)) if lps else 0.0
        seg = Segment(id=0, start=0.0, end=round(duration, 3), text=text, tokens=list(hyp.tokens),
                      words=words, avg_logprob=avg)
        return Transcript(text=text, language=self.units.language, duration=duration,
                          segments=[seg] if text else [])

    def _rescore(self, enc: torch.Tensor, nbest: list[CTCHypothesis], ctc_weight: float | None = None,
                 reverse_weight: float | None = None) -> tuple[CTCHypothesis, list[float]]:
        """Attention rescoring of one utterance's n-best over its encoder output (T, d); the
        weights default to the model's."""
        ctc_weight = self.ctc_weight if ctc_weight is None else ctc_weight
        reverse_weight = self.reverse_weight if reverse_weight is None else reverse_weight
        c = self.config
        hyps = [h.tokens for h in nbest]
        l2r, r2l, lens = build_rescoring_inputs(hyps, c.sos, c.eos)
        dev = enc.device
        n = len(hyps)
        memory = enc.unsqueeze(0).expand(n, -1, -1)
        with torch.no_grad():
            lo = torch.log_softmax(self.net.decoder(memory, None, l2r.to(dev), lens.to(dev)), dim=-1)
            ro = None
            if self.net.r_decoder is not None and reverse_weight > 0:
                ro = torch.log_softmax(self.net.r_decoder(memory, None, r2l.to(dev), lens.to(dev)), dim=-1)
        res = attention_rescoring(hyps, [h.score for h in nbest], lo.cpu(), None if ro is None else ro.cpu(),
                                  eos=c.eos, ctc_weight=ctc_weight, reverse_weight=reverse_weight)
        best = nbest[res.best_index]
        return (CTCHypothesis(list(best.tokens), res.scores[res.best_index], list(best.times),
                              list(best.token_logprobs)), res.token_confidences[res.best_index])

    # ------------------------------------------------------------------ offline
    def encode(self, waves: Sequence[np.ndarray], chunk_size: int = -1,
               left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Waveforms -> (encoder output (B, T, d), lengths (B,))."""
        feats, flens = self.fbank.extract([torch.from_numpy(w) for w in waves])
        return self.encode_features(feats, flens, chunk_size, left_chunks)

    def encode_features(self, feats: torch.Tensor, flens: torch.Tensor, chunk_size: int = -1,
                        left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        net = self.net
        with torch.no_grad():
            return net.encoder(feats.to(net.device, net.dtype), flens.to(net.device), chunk_size, left_chunks)

    def _method(self, options: ResolvedOptions) -> str:
        m = options.decoding_method
        if m == "auto":
            if options.hotwords and options.beam_size == 1:  # hotwords need a beam
                return "ctc_prefix_beam_search"
            return "attention_rescoring" if options.beam_size > 1 else "ctc_greedy_search"
        return m

    @staticmethod
    def _beam(options: ResolvedOptions) -> int:
        """The prefix beam's width: ``beam_size``, or 4 where hotwords turned greedy into beam."""
        return options.beam_size if options.beam_size > 1 else (4 if options.hotwords else 1)

    def _context_graph(self, options: ResolvedOptions) -> ContextGraph | None:
        """The request's hotwords as a context graph, spelled with the unit table."""
        if not options.hotwords:
            return None
        if self._hotword_encoder is None:
            self._hotword_encoder = PieceEncoder(self.units.pieces)
        return context_graph_for(options.hotwords, self._hotword_encoder, options.hotwords_score)

    def decode_encoded(self, enc: torch.Tensor, lens: torch.Tensor, options: DecodingOptions | ResolvedOptions,
                       durations: Sequence[float]) -> list[Transcript]:
        options = self._check(options)
        method = self._method(options)
        beam = self._beam(options)
        graph = self._context_graph(options)
        with torch.no_grad():
            logp = self.net.ctc_log_probs(enc)
        if graph_search_requested(options):  # model option wfst_graph: CTC over a WFST graph
            return graph_transcripts(logp, lens.tolist(), options, durations, self.frame_shift,
                                     self.units.language)  # fmt: skip
        device_nbest = None
        if logp.is_cuda and method in ("ctc_prefix_beam_search", "attention_rescoring"):
            # on CUDA the prefix beam search runs as batched tensor operations
            device_nbest = ctc_prefix_beam_search_gpu(logp, [int(n) for n in lens], beam,
                                                      self.config.blank_id, [graph] * enc.shape[0])
        logp = logp.cpu()
        att = self.attention_beam_search(enc, lens, beam) if method == "attention" else None
        out = []
        for b in range(enc.shape[0]):
            n = int(lens[b])
            conf = None
            if att is not None:
                hyp = CTCHypothesis(att[b])  # no alignment: no times, no words
            elif method in ("ctc_prefix_beam_search", "attention_rescoring"):
                if device_nbest is not None:
                    nbest = device_nbest[b]
                else:
                    search = CTCPrefixBeamSearch(beam, self.config.blank_id, graph)
                    search.step(logp[b, :n])
                    nbest = search.nbest()
                hyp = nbest[0]
                if method == "attention_rescoring" and (nbest[0].tokens or len(nbest) > 1):
                    hyp, conf = self._rescore(enc[b, :n], nbest, options.ctc_weight, options.reverse_weight)
            else:
                g = CTCGreedySearch(self.config.blank_id)
                g.step(logp[b, :n])
                hyp = g.result()
            out.append(self._transcript(hyp, durations[b], options, confidences=conf, num_frames=n))
        return out

    def attention_beam_search(self, enc: torch.Tensor, lens: torch.Tensor, beam: int,
                              length_penalty: float = 0.0) -> list[list[int]]:
        """WeNet's ``attention`` decoding: left-to-right decoder beam search over the encoder
        output (B, T, d) (at most T steps), best hypothesis per item (no CTC)."""
        c = self.config
        dev = enc.device
        b, t, _ = enc.shape
        running = b * beam
        memory = enc.repeat_interleave(beam, dim=0)
        mem_pad = (torch.arange(t, device=dev)[None, :] >= lens.to(dev)[:, None]).repeat_interleave(beam, 0)
        hyps = torch.full((running, 1), c.sos, dtype=torch.long, device=dev)
        scores = torch.tensor([0.0] + [-float("inf")] * (beam - 1), device=dev).repeat(b).unsqueeze(1)
        end = torch.zeros_like(scores, dtype=torch.bool)
        base = (torch.arange(b, device=dev) * beam)[:, None]
        with torch.no_grad():
            for _ in range(t):
                if bool(end.all()):
                    break
                lens_h = torch.full((running,), hyps.shape[1], dtype=torch.long, device=dev)
                logits = self.net.decoder(memory, mem_pad, hyps, lens_h)[:, -1]
                top_v, top_i = torch.log_softmax(logits, dim=-1).topk(beam)
                if beam > 1:  # a finished row keeps one zero-cost continuation (eos)
                    top_v = torch.where(end, torch.cat([top_v.new_zeros(running, 1),
                                                        top_v.new_full((running, beam - 1), -float("inf"))], 1), top_v)
                else:
                    top_v = top_v.masked_fill(end, 0.0)
                top_i = top_i.masked_fill(end, c.eos)
                scores = (scores + top_v).view(b, beam * beam)
                scores, offset = scores.topk(beam)
                best = (base * beam + offset).view(-1)
                pred = top_i.view(-1)[best]
                hyps = torch.cat([hyps[best // beam], pred[:, None]], dim=1)
                scores = scores.view(-1, 1)
                end = (hyps[:, -1] == c.eos)[:, None]
        lengths = hyps.ne(c.eos).sum(1).view(b, beam).float()
        final = scores.view(b, beam) / lengths.pow(length_penalty)
        idx = final.argmax(dim=-1) + torch.arange(b, device=dev) * beam
        out = []
        for row in hyps[idx, 1:].tolist():
            out.append([x for x in row if x != c.eos])
        return out

    def transcribe(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                   progress: ProgressCallback | None = None) -> list[Transcript]:
        options = self._check(options)
        waves = [self._wave(a, k) for k, a in enumerate(audios)]
        if not waves:
            return []
        # one model call for exactly this batch: the engine's scheduler bounds it
        # (max_batch_size) and groups similar lengths; the model does not re-batch
        sr = self.feature_spec.sample_rate
        results: list[Transcript | None] = [None] * len(waves)
        idx = []
        for i, w in enumerate(waves):
            if len(w) < self.feature_spec.win_length:  # not one feature frame: nothing to say
                results[i] = Transcript(text="", language=None, duration=len(w) / sr)
            else:
                idx.append(i)
        if idx:
            enc, lens = self.encode([waves[i] for i in idx], options.decoding_chunk_size,
                                    options.num_decoding_left_chunks)
            outs = self.decode_encoded(enc, lens, options, [len(waves[i]) / sr for i in idx])
            for i, t in zip(idx, outs, strict=True):
                results[i] = t
        if progress is not None:
            total = sum(len(w) for w in waves) / sr
            progress(total, total)
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------ streaming
    #: streams run their steady-state chunk as CUDA-graph replays on CUDA (per batch and
    #: history-length bucket); False: always eager
    stream_cuda_graphs = True
    #: on CUDA, streams with a prefix beam search it on the device, all of a step's at once
    #: (``oasr.decoders.ctc_gpu``); False: the host search
    stream_gpu_beam = True
    #: the most attention-history frames a stream keeps when its ``num_left_chunks`` is < 0
    #: (4096 frames = 164 s at 40 ms); older frames are dropped
    stream_max_history = 4096
    #: the history frames :meth:`capture_stream_graphs` prepares by default when streams keep an
    #: unbounded history (1024 frames: 41 s at 40 ms); older streams capture their larger history
    #: buckets when they get there
    stream_warm_history = 1024
    #: a :class:`~oasr.stream_cache.StepProfile` to time each phase of ``stream_step`` into
    #: (host seconds; ``benchmarks.streambench --phases``); None: no timing
    stream_profile: StepProfile | None = None
    #: on CUDA, build each step's inputs in page-locked host memory and let the graph replay copy
    #: them (DMA, no staging copy). Off by default: not yet run on a GPU (``OASR_STREAM_PINNED=1``)
    stream_pinned_inputs = os.environ.get("OASR_STREAM_PINNED", "") == "1"

    @property
    def stream_pool(self) -> StreamCachePool:
        """The streaming caches of all live streams (created with the first stream)."""
        pool = self.__dict__.get("_stream_pool")
        if pool is None:
            enc = self.net.encoder
            conv = enc.conv_cache_shape
            pool = StreamCachePool(
                slots={"cnn": (conv, self.net.dtype)} if conv is not None else {},
                frame_shape=enc.history_shape, frame_dtype=self.net.dtype, block_size=16,
                max_frames=self.stream_max_history, max_chunk_frames=512, device=self.net.device,
            )  # fmt: skip
            self.__dict__["_stream_pool"] = pool
        return pool

    def new_stream(self, options: DecodingOptions | None = None, *, chunk_size: int | None = None,
                   num_left_chunks: int | None = None, force: bool = False,
                   keep_encoder_output: bool | None = None) -> WenetStreamState:
        """A new stream. ``chunk_size`` / ``num_left_chunks`` default to the model's
        attributes; ``force=True`` streams a model trained without chunk masks anyway (the
        ``ctc_blank`` VAD does; recognition quality is then not what the model was trained for).
        ``keep_encoder_output``: collect the encoder output in ``state.enc`` (default: the
        model's ``keep_encoder_output``; always when attention rescoring needs it)."""
        options = self._check(options or DecodingOptions())
        refuse_graph_search_streaming(options)
        if not self.capabilities.streaming and not force:
            raise UnsupportedOptionError(
                f"{self.name} was trained without chunk masks (use_dynamic_chunk false, "
                f"static_chunk_size 0); WeNet does not stream such models. Use offline decoding",
                param="service_mode",
            )
        c = options.chunk_size if chunk_size is None else int(chunk_size)
        left = options.num_left_chunks if num_left_chunks is None else int(num_left_chunks)
        if c <= 0:
            raise InvalidRequestError("streaming needs chunk_size > 0 (encoder frames per chunk)",
                                      param="chunk_size")
        if c > self.stream_pool.max_chunk_frames:
            raise InvalidRequestError(f"chunk_size is at most {self.stream_pool.max_chunk_frames} "
                                      "encoder frames", param="chunk_size")  # fmt: skip
        sub = self.net.encoder.subsampling_rate
        context = self.net.encoder.right_context + 1
        method = self._method(options)
        if method == "attention":
            raise UnsupportedOptionError(
                "decoding_method 'attention' (decoder beam search) decodes offline only; streams "
                "use ctc_greedy_search, ctc_prefix_beam_search or attention_rescoring",
                param="decoding_method",
            )
        if method == "ctc_greedy_search":
            search: Any = CTCGreedySearch(self.config.blank_id)
        elif self.stream_gpu_beam and self.net.device.type == "cuda":  # streams batch on the device
            search = GPUCTCPrefixBeamSearch(self._beam(options), self.config.blank_id, self.net.device,
                                            self._context_graph(options))
        else:
            search = CTCPrefixBeamSearch(self._beam(options), self.config.blank_id, self._context_graph(options))
        keep = self.keep_encoder_output if keep_encoder_output is None else keep_encoder_output
        st = WenetStreamState(
            options=options, chunk_size=c, num_left_chunks=left, window=(c - 1) * sub + context,
            stride=c * sub, win_length=self.feature_spec.win_length,
            hop_length=self.feature_spec.hop_length, search=search,
            keep_encoder_output=bool(keep) or method == "attention_rescoring",
            return_encoder_output=bool(keep),
        )  # fmt: skip
        st.cache = self.stream_pool.open(owner=st)
        return st

    def release_stream(self, st: WenetStreamState) -> None:
        """Return the stream's caches to the pool (finish, abort, disconnect; idempotent)."""
        if st.cache is not None:
            self.stream_pool.release(st.cache)

    def stream_occupancy(self) -> dict[str, float]:
        """The streaming cache pool's gauges (streams, slots, blocks used / allocated, bytes);
        empty before the first stream."""
        pool = self.__dict__.get("_stream_pool")
        out = {} if pool is None else pool.occupancy()
        graphs = self.__dict__.get("_graphs")
        if graphs is not None:
            out.update({f"graph_{k}": v for k, v in graphs.stats.items()})
        return out

    def _plan(self, st: WenetStreamState, last: bool) -> list[tuple[int, int]]:
        """The chunk windows the stream's audio allows now: (first feature frame, frames)."""
        out = []
        avail = st.frames_available
        f0 = st.frames_consumed
        while avail - f0 >= st.window:
            out.append((f0, st.window))
            f0 += st.stride
        if last and avail - f0 >= self.net.encoder.right_context + 1:
            out.append((f0, avail - f0))
        return out

    def stream_step(self, states: Sequence[WenetStreamState], chunks: Sequence[np.ndarray],
                    is_last: Sequence[bool]) -> list[StreamingUpdate]:
        if not (len(states) == len(chunks) == len(is_last)):
            raise InvalidRequestError("states, chunks and is_last must have the same length")
        prof = self.stream_profile
        if prof is not None:
            prof.start()
            prof.steps += 1
            prof.rows += len(states)
        plans: list[list[tuple[int, int]]] = []
        for k, (st, chunk, last) in enumerate(zip(states, chunks, is_last, strict=True)):
            if st.finished:
                raise InvalidRequestError("this stream already finished; start a new one")
            if chunk is not None and len(chunk):
                # the engine hands over checked float32 mono arrays: no second conversion
                ok = isinstance(chunk, np.ndarray) and chunk.dtype == np.float32 and chunk.ndim == 1
                a = chunk if ok else self._wave(chunk, k)
                if len(a):
                    st.samples_received += len(a)
                    st.pieces.append(a)
            plans.append(self._plan(st, bool(last)))
        if prof is not None:
            prof.lap("features")
        self._run_plans(states, plans)
        on_device = [st for st, last in zip(states, is_last, strict=True)
                     if not last and isinstance(st.search, GPUCTCPrefixBeamSearch)]  # fmt: skip
        device_best = ({id(st): nb[0] for st, nb in zip(on_device, nbest_streams([st.search for st in on_device]),
                                                         strict=True)} if on_device else {})  # fmt: skip
        if prof is not None:
            prof.lap("search")
        updates = []
        units = self.units
        for st, last in zip(states, is_last, strict=True):
            if last:
                if prof is not None:
                    prof.lap("results")
                    prof.finals += 1
                updates.append(self._finish(st))
                if prof is not None:
                    prof.lap("finals")
                continue
            search = st.search
            if isinstance(search, CTCGreedySearch):
                # a greedy hypothesis only grows: join the new tokens' pieces, nothing else
                tokens = search.hyp.tokens
                if len(tokens) != st.tokens_seen:
                    st.joined += units.join(tokens[st.tokens_seen :])
                    st.text = units.clean(st.joined)
                    st.tokens_seen = len(tokens)
            else:
                hyp = device_best[id(st)] if id(st) in device_best else search.best()
                st.text = units.decode(hyp.tokens)
                st.tokens_seen = len(hyp.tokens)
            updates.append(StreamingUpdate(text=st.text, is_final=False))
        if prof is not None:
            prof.lap("results")
        return updates

    def flush_stream(self, st: WenetStreamState) -> None:
        """Encode what is left of the stream's audio (its partial last chunk) without finishing
        it (the ``ctc_blank`` VAD's final call)."""
        self._run_plans([st], [self._plan(st, True)])

    def _run_plans(self, states: Sequence[WenetStreamState], plans: list[list[tuple[int, int]]]) -> None:
        """Every planned window, the r-th windows of all streams as one batched step."""
        rounds = max((len(p) for p in plans), default=0)
        for r in range(rounds):
            rows = [i for i, p in enumerate(plans) if len(p) > r]
            if self._centred_conv:
                # a centred convolution of a shorter window padded to its batch mates' would see
                # GLU(bias) past its end, not the zeros it sees alone: one call per window length
                # (only last, partial chunks differ), so results do not depend on batch mates
                by_len: dict[int, list[int]] = {}
                for i in rows:
                    by_len.setdefault(plans[i][r][1], []).append(i)
                groups = list(by_len.values())
            else:
                groups = [rows]
            for g in groups:
                self._encode_chunks([states[i] for i in g], [plans[i][r] for i in g])

    # one batched chunk step -------------------------------------------------------------------
    def stream_features(self, st: WenetStreamState, feats: torch.Tensor) -> None:
        """Run a whole (n, F) fbank sequence through the stream chunk by chunk, as its audio
        would be (WeNet's ``simulate_streaming``; the parity tests feed WeNet's own features)."""
        windows, f0, n = [], 0, feats.shape[0]
        while n - f0 >= st.window:
            windows.append((f0, st.window))
            f0 += st.stride
        if n - f0 >= self.net.encoder.right_context + 1:
            windows.append((f0, n - f0))
        for f0, nf in windows:
            self._encode_chunks([st], [(f0, nf)], feats=[feats[f0 : f0 + nf]])

    def _encode_chunks(self, states: list[WenetStreamState], windows: list[tuple[int, int]],
                       feats: list[torch.Tensor] | None = None) -> None:
        """One chunk of each stream in one encoder call: features from the streams' audio (one
        batched fbank), history gathered from the pool by index, this chunk's keys/values and
        convolution caches written back by index, CTC log-probabilities; then each stream's
        search advances on the host (one device-to-host copy for the batch). The host work per
        stream is numpy over the batch except one slice copy of its audio and a few attribute
        updates; phases are timed into ``stream_profile`` when it is set."""
        import torch

        prof = self.stream_profile
        net, enc, pool = self.net, self.net.encoder, self.stream_pool
        hop, win = self.feature_spec.hop_length, self.feature_spec.win_length
        b = len(states)
        ctxs = [st.cache for st in states]
        flen = np.fromiter((w[1] for w in windows), np.int64, b)
        new = flen.copy()
        for k, stride in enc.embed.layers:  # the subsampling's output frames, vectorised
            new = (new - k) // stride + 1
        new = new.clip(min=0)
        offsets = np.fromiter((st.offset for st in states), np.int64, b)
        pool.reserve(ctxs, new)
        hist_lens = np.fromiter((c.cached for c in ctxs), np.int64, b)
        # padded to the full window (a batch of last, partial chunks replays the same graph);
        # not with centred convolutions: they would see the padding's GLU output at the edge
        w_max = int(flen.max())
        if feats is None and not self._centred_conv:
            w_max = max(w_max, max(st.window for st in states))
        t_max = int(enc.embed.output_length(w_max))
        graphs = self._stream_graphs() if feats is None else None
        if graphs is not None:
            rows = bucket(b, BATCH_BUCKETS)
            s_max = _history_bucket(int(hist_lens.max()))
        else:
            rows, s_max = b, int(hist_lens.max())
        read, _ = pool.read_index(ctxs, s_max)
        write = pool.write_index(ctxs, new, t_max)
        dev = net.device
        # the step's inputs are built in place in host buffers (page-locked on CUDA with
        # ``stream_pinned_inputs``: the copies to the device are then plain DMA, no staging)
        pinned = self.stream_pinned_inputs and dev.type == "cuda"
        ints_t, ints = _host_buffer((rows, 4 + s_max + t_max), torch.int64, pinned)
        ints[:b, 0], ints[:b, 1], ints[:b, 2], ints[:b, 3] = flen, offsets, hist_lens, pool.slot_ids(ctxs)
        ints[:b, 4 : 4 + s_max] = read
        ints[:b, 4 + s_max :] = write
        if rows > b:  # padded rows: scratch slot 0, scratch block rows
            ints[b:, : 4 + s_max] = 0
            ints[b:, 4 + s_max :] = np.arange(t_max) % pool.block_size
        enc.ensure_positions(int(offsets.max()) + s_max + t_max + 1)
        if prof is not None:
            prof.lap("gather")
            prof.calls += 1
        if feats is None:  # the audio of each window, (rows, samples), one host -> device copy
            n_samp = (w_max - 1) * hop + win
            audio_t, audio = _host_buffer((rows, n_samp), torch.float32, pinned)
            for i, (st, (f0, nf)) in enumerate(zip(states, windows, strict=True)):
                lo = (f0 - st.frames_consumed) * hop
                got = st.copy_audio(lo, audio[i, : (nf - 1) * hop + win])
                if got < n_samp:
                    audio[i, got:] = 0.0
            audio[b:] = 0.0
            if prof is not None:
                prof.lap("features")
        # the searches and the outputs kept, by row (one pass over the batch)
        greedy, beam_rows, device_rows, keep_rows = [], [], [], []
        for i, st in enumerate(states):
            search = st.search
            if isinstance(search, CTCGreedySearch):
                greedy.append(i)
            elif isinstance(search, GPUCTCPrefixBeamSearch):
                device_rows.append(i)
            elif isinstance(search, CTCPrefixBeamSearch):
                beam_rows.append(i)
            if st.keep_encoder_output:
                keep_rows.append(i)
        with torch.no_grad():
            if feats is not None:
                f = torch.nn.utils.rnn.pad_sequence([x.float() for x in feats], batch_first=True)
                out, logp, best = self._chunk_core(f.to(dev), ints_t.to(dev))
            elif graphs is not None:
                if not pinned:  # the path verified on the H200: device copies first
                    audio_t = audio_t.to(dev, non_blocking=True)
                    ints_t = ints_t.to(dev, non_blocking=True)
                # (page-locked inputs: the replay copies the host buffers into its inputs itself)
                key = (rows, w_max, s_max)
                generation = (pool.generation, enc.pos_enc.pe.data_ptr())
                if graphs.try_capture(key, generation, self.name):
                    out, logp, best = graphs.run(key, generation, audio_t, ints_t)
                else:
                    self.stream_cuda_graphs = False
                    # the capture touched scratch rows only: this step runs from the streams'
                    # unchanged state, at the padded shapes a replay would have (same numerics)
                    out, logp, best = self._chunk_compute(audio_t.to(dev), ints_t.to(dev))
            else:
                out, logp, best = self._chunk_compute(audio_t.to(dev, non_blocking=True),
                                                      ints_t.to(dev, non_blocking=True))  # fmt: skip
            if prof is not None:
                prof.lap("encoder")
            host = best[:b].cpu()  # (b, 2, T): best log-probability, token; waits for the device
            if prof is not None:
                prof.lap("wait")
            beam_lp = logp[beam_rows].cpu() if beam_rows else None
            if device_rows:  # every device beam of this step in one batched search step
                step_streams([states[i].search for i in device_rows], [logp[i, : int(new[i])] for i in device_rows])
            kept = out[keep_rows].clone() if keep_rows else None
        if prof is not None:
            prof.lap("search")
        keep_hist = np.fromiter(
            (-1 if st.num_left_chunks < 0 else st.chunk_size * st.num_left_chunks for st in states), np.int64, b)
        pool.advance(ctxs, new, keep_hist)
        new_l = new.tolist()
        for st, n, (_, nf) in zip(states, new_l, windows, strict=True):
            st.offset += n
            if nf == st.window:
                st.drop_audio(st.stride * hop)
                st.frames_consumed += st.stride
            else:
                st.pieces.clear()
                st.frames_consumed += nf
        for j, i in enumerate(keep_rows):
            states[i].enc.append(kept[j, : new_l[i]])
        if prof is not None:
            prof.lap("scatter")
        if greedy:
            host_np = host.numpy()
            if len(greedy) < b:
                host_np = host_np[greedy]
            _greedy_advance([states[i].search for i in greedy], host_np[:, 0].astype(np.float64),
                            host_np[:, 1].astype(np.int64), new[greedy] if len(greedy) < b else new,
                            self.config.blank_id)  # fmt: skip
        for j, i in enumerate(beam_rows):
            states[i].search.step(beam_lp[j, : new_l[i]])
        if prof is not None:
            prof.lap("search")

    def _chunk_compute(self, audio: torch.Tensor, ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The device half of a chunk step (captured as a CUDA graph on CUDA): fbank of every
        row's window, history gather, encoder, K/V and convolution-cache scatter, CTC."""
        hop, win = self.feature_spec.hop_length, self.feature_spec.win_length
        fbank = self.fbank
        x = audio * fbank.opts.scale if fbank.opts.scale != 1.0 else audio
        return self._chunk_core(fbank.compute_frames(x.unfold(-1, win, hop)), ints)  # (rows, W, F)

    def _chunk_core(self, feats: torch.Tensor, ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`_chunk_compute` from features (rows, W, F)."""
        import torch

        net, enc, pool = self.net, self.net.encoder, self.stream_pool
        rows = feats.shape[0]
        t_max = int(enc.embed.output_length(feats.shape[1]))
        s_max = ints.shape[1] - 4 - t_max
        flen, offsets, hist_lens, slots = ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3]
        shape = enc.history_shape
        hist = pool.frames.index_select(0, ints[:, 4 : 4 + s_max].reshape(-1)).view(rows, s_max, *shape)
        cnn_pool = pool.slot_tensors.get("cnn")
        cnn = cnn_pool.index_select(0, slots) if cnn_pool is not None else None
        out, _, kv, cnn_out = enc.forward_chunk(feats.to(net.dtype), flen, offsets, hist, hist_lens, cnn)
        pool.frames.index_copy_(0, ints[:, 4 + s_max :].reshape(-1), kv.reshape(-1, *shape))
        if cnn_pool is not None:
            cnn_pool.index_copy_(0, slots, cnn_out)
        logp = net.ctc_log_probs(out)
        best, idx = logp.max(dim=-1)
        return out, logp, torch.stack([best, idx.to(best.dtype)], dim=1)

    @functools.cached_property
    def _centred_conv(self) -> bool:
        return any(layer.conv_module is not None and layer.conv_module.lorder == 0
                   for layer in self.net.encoder.encoders)  # fmt: skip

    def capture_stream_graphs(self, max_batch: int, chunk_size: int | None = None,
                              max_history: int | None = None, streams: int | None = None) -> int:
        """Capture now the CUDA graphs a run of up to ``max_batch`` streams per step with
        ``chunk_size``-frame chunks and up to ``max_history`` history frames will replay (every
        batch bucket <= ``max_batch`` x history bucket), after growing the cache pool to
        ``streams`` (default ``max_batch``) streams of that history, so that no capture or growth
        happens while streams are served. Inputs are scratch rows only. Returns the number of
        graphs captured (0 off CUDA or with graphs off). Defaults (a server's warm-up): the
        model's chunk, and the history its default options keep (``chunk_size x
        num_left_chunks``), or :attr:`stream_warm_history` frames when that is unbounded."""
        import torch

        graphs = self._stream_graphs()
        if graphs is None:
            return 0
        if chunk_size is None:
            chunk_size = self.chunk_size
        if max_history is None:
            left = self.num_left_chunks
            bounded = chunk_size * left if left >= 0 else self.stream_warm_history
            max_history = min(bounded, self.stream_max_history)
        enc, pool = self.net.encoder, self.stream_pool
        pool.ensure(streams or max_batch, max_history + chunk_size)
        sub, context = enc.subsampling_rate, enc.right_context + 1
        w = (chunk_size - 1) * sub + context
        enc.ensure_positions(max(enc.pos_enc.pe.shape[0], 8 * (max_history + chunk_size)))
        generation = (pool.generation, enc.pos_enc.pe.data_ptr())
        before = graphs.stats["captures"]
        top = _history_bucket(max_history)
        s_buckets = [0] + [s for s in (16 << k for k in range(16)) if s <= top]
        with torch.no_grad():
            for rows in (r for r in BATCH_BUCKETS if r <= bucket(max_batch, BATCH_BUCKETS)):
                for s_max in s_buckets:
                    graphs.capture((rows, w, s_max), generation)
        return graphs.stats["captures"] - before

    def _graph_inputs(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of a captured step's shapes that touch only scratch rows: no audio, slot 0,
        history and new frames in the scratch block."""
        import torch

        rows, w, s_max = key
        hop, win = self.feature_spec.hop_length, self.feature_spec.win_length
        t = int(self.net.encoder.embed.output_length(w))
        dev = self.net.device
        audio = torch.zeros(rows, (w - 1) * hop + win, device=dev)
        ints = torch.zeros(rows, 4 + s_max + t, dtype=torch.long, device=dev)
        ints[:, 4 + s_max :] = torch.arange(t, device=dev) % self.stream_pool.block_size
        return audio, ints

    def _stream_graphs(self) -> GraphSteps | None:
        """The captured chunk steps (None off CUDA or with ``stream_cuda_graphs`` off)."""
        if not self.stream_cuda_graphs or self.net.device.type != "cuda":
            return None
        graphs = self.__dict__.get("_graphs")
        if graphs is None:
            graphs = self.__dict__["_graphs"] = GraphSteps(self._chunk_compute, self._graph_inputs)
        return graphs

    def _finish(self, st: WenetStreamState) -> StreamingUpdate:
        st.finished = True
        sr = self.feature_spec.sample_rate
        duration = st.samples_received / sr
        n = st.offset
        if not isinstance(st.search, CTCGreedySearch):
            nbest = st.search.nbest()
            o = st.options
            if n and (nbest[0].tokens or len(nbest) > 1) and self._method(o) == "attention_rescoring":
                hyp, conf = self._rescore(torch.cat(st.enc), nbest, o.ctc_weight, o.reverse_weight)
            else:
                hyp, conf = nbest[0], None
        else:
            hyp, conf = st.search.result(), None
        tr = self._transcript(hyp, duration, st.options, confidences=conf, num_frames=n)
        st.text = tr.text
        # release the caches (the encoder output is kept only when asked: tests, VAD)
        keep = [torch.cat(st.enc)] if (st.return_encoder_output and st.enc) else []
        self.release_stream(st)
        st.enc = keep
        st.pieces.clear()
        return StreamingUpdate(text=tr.text, is_final=True, transcript=tr)

    # ------------------------------------------------------------------ VAD support
    def ctc_blank_posteriors(self, wave: np.ndarray) -> np.ndarray:
        """exp(log P(blank)) per encoder frame of one waveform (offline encoder)."""
        w = self._wave(wave, 0)
        if len(w) < self.feature_spec.win_length:
            return np.zeros(0, np.float32)
        enc, lens = self.encode([w], self.offline_chunk_size, self.offline_left_chunks)
        with torch.no_grad():
            logp = self.net.ctc_log_probs(enc)[0, : int(lens[0]), self.config.blank_id]
        return logp.exp().cpu().numpy().astype(np.float32)


def _greedy_advance(searches: list[CTCGreedySearch], vals: np.ndarray, toks: np.ndarray,
                    lens: np.ndarray, blank: int) -> None:
    """:meth:`CTCGreedySearch._advance` for a batch at once: ``vals`` / ``toks`` (B, T) each
    frame's best log-probability and token, ``lens`` (B,) valid frames. Same hypotheses, scores
    summed in the same order. No Python per frame or per token: a token's run (its first frame
    and the frames repeating it) is one segment of the batch's speech frames, its log-probability
    the segment's maximum (``np.maximum.reduceat``); Python only extends each row's lists."""
    b, t = toks.shape
    valid = np.arange(t)[None, :] < lens[:, None]
    prev = np.fromiter((s.prev for s in searches), np.int64, b)
    before = np.concatenate([prev[:, None], toks[:, :-1]], axis=1)
    speech = valid & (toks != blank)
    emit = speech & (toks != before)
    # sequential float64 sums, as the one-row search adds its frames
    score = np.cumsum(np.concatenate([np.fromiter((s.hyp.score for s in searches), np.float64, b)[:, None],
                                      np.where(valid, vals, 0.0)], axis=1), axis=1)[:, -1]
    # speech frames in row-major order; a run is contiguous there: an emitted token's first frame
    # and its repeats, or (first in its row) repeats of the previous chunk's last token
    pos = np.flatnonzero(speech)
    if pos.size:
        rows, frames = np.divmod(pos, t)
        first = np.ones(pos.size, bool)
        first[1:] = (rows[1:] != rows[:-1]) | emit.ravel()[pos[1:]]
        starts = np.flatnonzero(first)
        run_max = np.maximum.reduceat(vals.ravel()[pos], starts).tolist()
        run_row = rows[starts]
        run_emit = emit.ravel()[pos[starts]].tolist()
        run_tok = toks.ravel()[pos[starts]].tolist()
        run_frame = frames[starts].tolist()
        bounds = np.searchsorted(run_row, np.arange(b + 1)).tolist()
    else:
        bounds = [0] * (b + 1)
    for r, s in enumerate(searches):
        lo, hi = bounds[r], bounds[r + 1]
        if lo < hi:
            h = s.hyp
            if not run_emit[lo]:  # the previous chunk's last token goes on: its best frame
                if run_max[lo] > h.token_logprobs[-1]:
                    h.token_logprobs[-1] = run_max[lo]
                lo += 1
            if lo < hi:
                f0 = s.frame
                h.tokens.extend(run_tok[lo:hi])
                h.times.extend([f0 + f for f in run_frame[lo:hi]])
                h.token_logprobs.extend(run_max[lo:hi])
        n = int(lens[r])
        if n:
            s.hyp.score = float(score[r])
            s.prev = int(toks[r, n - 1])
            s.frame += n


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> tuple[torch.Tensor, np.ndarray]:
    """An uninitialised host tensor for a step's inputs and its numpy view; ``pinned``:
    page-locked (torch's host allocator caches those blocks and hands one back only after the
    copies that read it have run, so refilling the next step's buffer is safe)."""
    t = torch.empty(shape, dtype=dtype, pin_memory=pinned)
    return t, t.numpy()


def _history_bucket(n: int) -> int:
    """History frames gathered by a captured step: 0, then powers of two from 16."""
    if n <= 0:
        return 0
    return max(16, 1 << (n - 1).bit_length())


__all__ = ["Units", "WenetASR", "WenetStreamState"]
