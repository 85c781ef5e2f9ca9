"""FastConformer models as OASR :class:`~oasr.model.ASRModel` s.

Offline: NeMo mel (core ``nemo_mel``, the checkpoint's preprocessor) -> FastConformer encoder
(full attention, or local attention for long inputs) -> the head's search, batched:

* CTC (``ParakeetCTC``): greedy, or prefix beam search at ``beam_size > 1`` (core
  ``oasr.decoders.ctc``); word times from the CTC peaks;
* RNN-T (``ParakeetRNNT``, ``NemotronASR``): greedy with ``max_symbols_per_frame``, or icefall's
  modified beam search at ``beam_size > 1`` (core ``oasr.decoders.transducer``); word times from
  the emission frames;
* TDT (``ParakeetTDT``): NeMo's greedy TDT (core ``TDTGreedySearch``), or the TDT beam search
  (core ``oasr.decoders.tdt_beam``) at ``beam_size > 1``; token spans from the predicted
  durations.

``NemotronASR`` adds cache-aware streaming (``streaming.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.decoders.ctc import CTCPrefixBeamSearch, ctc_greedy_search, group_words, token_timestamps
from oasr.decoders.hypothesis import Hypothesis
from oasr.decoders.tdt_beam import tdt_beam_search
from oasr.decoders.transducer import (
    TDTGreedySearch,
    TransducerGreedySearch,
    TransducerModifiedBeamSearch,
    duration_token_timestamps,
)
from oasr.defaults import env_switch
from oasr.errors import UnsupportedOptionError
from oasr.layers import resolve_dtype
from oasr.model import ProgressCallback
from oasr.options import ResolvedOptions
from oasr.types import (
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Segment,
    Transcript,
    Word,
)
from oasr_models_nemo.config import NemoConfig
from oasr_models_nemo.nn import FastConformerNet, NemoTransducerNetwork, build_network
from oasr_models_nemo.options import NemoOptions
from oasr_models_nemo.plugin import (
    CTC_CAPABILITIES,
    NEMOTRON_CAPABILITIES,
    RNNT_CAPABILITIES,
    TDT_CAPABILITIES,
)
from oasr_models_nemo.tokenizer import SentencePieceDecoder

#: the local attention window (encoder frames each side) of the auto mode, NeMo's recommended
#: ``rel_pos_local_attn`` context for long audio
AUTO_LOCAL_WINDOW = 256


class NemoASR:
    """A loaded FastConformer model (use :meth:`load` / the subclasses' registry keys)."""

    capabilities: ModelCapabilities = RNNT_CAPABILITIES

    def __init__(self, net: FastConformerNet, config: NemoConfig, tokenizer: SentencePieceDecoder,
                 *, source_format: str = "hf-parakeet", source_path: Path | None = None) -> None:
        self.net = net
        self.config = config
        self.tokenizer = tokenizer
        self.source_format = source_format
        self.source_path = source_path
        self.name = (f"{config.architecture} fastconformer {config.num_layers}x"
                     f"{config.hidden_size}")
        self.feature_spec = FeatureSpec(
            kind="nemo_mel", sample_rate=config.sample_rate, num_bins=config.num_mel_bins,
            hop_length=config.hop_length, win_length=config.win_length, n_fft=config.n_fft,
            options={"preemph": config.preemphasis, "normalize": config.normalize, "pad_to": 0,
                     "dither": 0.0},
        )
        from oasr.features.nemo import NemoMel

        self.mel = NemoMel(self.feature_spec)
        self.default_options = NemoOptions(max_symbols_per_frame=config.max_symbols_per_step)
        if config.is_transducer:
            self.transducer = NemoTransducerNetwork(net)
        #: greedy TDT / RNN-T searches on CUDA replay their device loop as CUDA graphs (the LSTM
        #: prediction network and the joiner are capturable); False steps them eagerly
        self.cuda_graphs = True

    # ------------------------------------------------------------------ construction
    @staticmethod
    def class_for(config: NemoConfig) -> type[NemoASR]:
        if config.streaming:
            return NemotronASR
        return {"ctc": ParakeetCTC, "rnnt": ParakeetRNNT, "tdt": ParakeetTDT}[config.head]

    @classmethod
    def _build(cls, cfg: NemoConfig, state: dict, tokenizer: SentencePieceDecoder,
               config: EngineConfig | None, source: str, path: Path | None) -> NemoASR:
        config = config or EngineConfig()
        net = build_network(cfg, state, config.device, resolve_dtype(config.dtype))
        return NemoASR.class_for(cfg)(net, cfg, tokenizer, source_format=source, source_path=path)

    @classmethod
    def from_hf(cls, path: str | Path, config: EngineConfig | None = None) -> NemoASR:
        from oasr_models_nemo.checkpoints import load_hf

        cfg, state, tok = load_hf(Path(path))
        return cls._build(cfg, state, tok, config, "hf-parakeet", Path(path))

    @classmethod
    def from_nemo(cls, path: str | Path, config: EngineConfig | None = None) -> NemoASR:
        from oasr_models_nemo.checkpoints import load_nemo

        cfg, state, tok = load_nemo(Path(path))
        return cls._build(cfg, state, tok, config, "nemo", Path(path))

    @classmethod
    def from_native(cls, path: str | Path, body: dict[str, Any] | None = None,
                    config: EngineConfig | None = None) -> NemoASR:
        from oasr.checkpoint import read_native_config
        from oasr_models_nemo.checkpoints import load_native

        body = body or read_native_config(Path(path))
        cfg, state, tok = load_native(Path(path), body)
        model = cls._build(cfg, state, tok, config, "oasr", Path(path))
        model.default_options = model.default_options.with_saved(body.get("decoding"))
        return model

    def save_native(self, dst: str | Path) -> str:
        """OASR's native format (``model.safetensors`` in OASR names + ``oasr_model.json`` with
        the config, the tokenizer's pieces and the decoding defaults)."""
        from oasr_models_nemo.checkpoints import save_native

        return save_native(Path(dst), self)

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.net.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.dtype

    @property
    def frame_shift(self) -> float:
        """Seconds per encoder frame (80 ms for x8 subsampling at a 10 ms hop)."""
        c = self.config
        return c.subsampling_factor * c.hop_length / c.sample_rate

    def _check(self, options: DecodingOptions | ResolvedOptions) -> ResolvedOptions:
        options = options.validate_for(self)
        if options.task == "translate":
            raise UnsupportedOptionError(f"{self.name} transcribes only; task must be "
                                         f"'transcribe'", param="task")
        return options

    def features(self, waves: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """NeMo mel of a batch, computed on the model's device (the padded batch through core's
        reused page-locked buffer on CUDA)."""
        from oasr.features.batching import padded_batch

        batch, lengths = padded_batch(waves, self.net.device)
        return self.mel.extract(batch, lengths)

    def local_window(self, frames: int, options: ResolvedOptions | NemoOptions) -> int:
        """Local attention window of a full-context model for an input of ``frames`` (0: full
        attention). A limited-context model (Nemotron) keeps its own context, encoded
        block-wise when long."""
        if self.config.att_context != (-1, -1):
            return 0
        w = options.local_attention_window
        if w >= 0:
            return w
        return AUTO_LOCAL_WINDOW if frames > options.full_attention_max_frames else 0

    def encode_features(self, feats: torch.Tensor, flens: torch.Tensor,
                        options: ResolvedOptions | NemoOptions | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, F) features -> encoder frames (B, T', D) and lengths."""
        net = self.net
        options = options or self.default_options
        frames = int(net.encoder.subsampling.out_lengths(flens.max()).item()) if len(flens) else 0
        context = None
        if self.config.streaming:  # the lookahead the request streams with, offline too
            lookahead = getattr(options, "lookahead", -1)
            if lookahead >= 0:
                context = (self.config.att_context[0], lookahead)
        with torch.no_grad():
            return net.encoder(feats.to(net.device, net.dtype), flens.to(net.device),
                               local_window=self.local_window(frames, options),
                               att_context=context)

    def encode(self, waves: Sequence[np.ndarray], options: ResolvedOptions | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        feats, flens = self.features(waves)
        return self.encode_features(feats, flens, options)

    # ------------------------------------------------------------------ decoding
    def search(self, enc: torch.Tensor, lens: torch.Tensor, options: ResolvedOptions
               ) -> list[Hypothesis]:
        """The best hypothesis of each row of encoder frames (B, T, D)."""
        c = self.config
        lengths = [int(n) for n in lens.tolist()]
        with torch.no_grad():
            if c.head == "ctc":
                # stays on the model's device: the searches read only each frame's best
                # (greedy) or top-k (prefix beam) back
                logp = torch.log_softmax(self.net.ctc_head(enc).float(), dim=-1)
                if options.beam_size <= 1:  # the batch's best frames read back in one copy
                    return ctc_greedy_search(logp, lengths, c.blank_id)
                out = []
                for b, n in enumerate(lengths):
                    s = CTCPrefixBeamSearch(options.beam_size, c.blank_id)
                    s.step(logp[b, :n])
                    out.append(s.nbest()[0])
                return out
            proj = self.net.encoder_projector(enc)
            b = proj.shape[0]
            if c.head == "tdt" and options.beam_size > 1:
                return [n[0] for n in tdt_beam_search(
                    self.transducer, proj, lengths, durations=c.durations, blank_id=c.blank_id,
                    beam_size=options.beam_size,
                    max_symbols_per_frame=options.max_symbols_per_frame)]
            if c.head == "tdt":
                tdt = TDTGreedySearch(self.transducer, c.durations, b, blank_id=c.blank_id,
                                      max_symbols_per_frame=options.max_symbols_per_frame,
                                      cuda_graph=self.cuda_graphs)
                tdt.step(proj, lengths)
                return tdt.results()
            if options.beam_size > 1:
                beam = TransducerModifiedBeamSearch(self.transducer, options.beam_size, b,
                                                    blank_id=c.blank_id)
                beam.step(proj, lengths)
                return beam.best()
            greedy = TransducerGreedySearch(self.transducer, b, blank_id=c.blank_id,
                                            max_symbols_per_frame=options.max_symbols_per_frame,
                                            cuda_graph=self.cuda_graphs)
            greedy.step(proj, lengths)
            return greedy.results()

    def transcript(self, hyp: Hypothesis, duration: float, num_frames: int,
                   options: DecodingOptions | ResolvedOptions, offset: float = 0.0) -> Transcript:
        tokens = [t for t in hyp.tokens if t < len(self.tokenizer)]
        text = self.tokenizer.decode(tokens)
        words: list[Word] = []
        if options.word_timestamps and hyp.tokens and len(hyp.times) == len(hyp.tokens):
            if hyp.durations and len(hyp.durations) == len(hyp.tokens):
                timings = duration_token_timestamps(
                    hyp.tokens, hyp.times, hyp.durations, hyp.confidences,
                    frame_shift=self.frame_shift, num_frames=num_frames, offset=offset)
            else:
                timings = token_timestamps(hyp.tokens, hyp.times, hyp.confidences,
                                           frame_shift=self.frame_shift, num_frames=num_frames,
                                           offset=offset)
            pieces = [self.tokenizer.piece(t) for t in hyp.tokens]
            end = offset + duration
            words = [Word(w, min(s, end), min(e, end), conf)
                     for w, s, e, conf in group_words(pieces, timings)]
        lps = hyp.token_logprobs
        seg = Segment(id=0, start=round(offset, 3), end=round(offset + duration, 3), text=text,
                      tokens=list(hyp.tokens), words=words,
                      avg_logprob=float(sum(lps) / len(lps)) if lps else 0.0)
        return Transcript(text=text, language=None, duration=duration,
                          segments=[seg] if text else [])

    def transcribe(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                   progress: ProgressCallback | None = None) -> list[Transcript]:
        options = self._check(options)
        waves = [as_mono_waveform(a, f"audio #{k}") for k, a in enumerate(audios)]
        if not waves:
            return []
        sr = self.feature_spec.sample_rate
        results: list[Transcript | None] = [None] * len(waves)
        idx = []
        for i, w in enumerate(waves):
            if self.mel.num_frames(len(w)) < 1:
                results[i] = Transcript(text="", language=None, duration=len(w) / sr)
            else:
                idx.append(i)
        if idx:
            # one batch, as the engine's scheduler formed it (it bounds and buckets batches)
            enc, lens = self.encode([waves[i] for i in idx], options)
            hyps = self.search(enc, lens, options)
            for i, hyp, n in zip(idx, hyps, lens.tolist(), strict=True):
                results[i] = self.transcript(hyp, len(waves[i]) / sr, int(n), options)
        if progress is not None:
            total = sum(len(w) for w in waves) / sr
            progress(total, total)
        return [r for r in results if r is not None]


class ParakeetCTC(NemoASR):
    capabilities = CTC_CAPABILITIES


class ParakeetRNNT(NemoASR):
    capabilities = RNNT_CAPABILITIES


class ParakeetTDT(NemoASR):
    capabilities = TDT_CAPABILITIES


class NemotronASR(NemoASR):
    """The cache-aware streaming FastConformer RNN-T (offline decoding uses its trained
    attention context: chunked-limited)."""

    capabilities = NEMOTRON_CAPABILITIES
    #: keep each stream's encoder output chunks on its state (``encoder_output``; tests)
    keep_encoder_output = False
    #: streams run their chunk step as CUDA-graph replays on CUDA (one graph per batch bucket
    #: and lookahead) and the chunk's greedy search in its device loop. On by default on CUDA
    #: (an H200 held 384 streams of 560 ms chunks with step p99 <= 100 ms, eager 320);
    #: ``OASR_NEMO_STREAM_GRAPHS=0`` (or False here, before the first stream) keeps the eager
    #: step. A capture that fails warns and that step and all later ones run eagerly. Nothing
    #: changes on the CPU.
    stream_cuda_graphs = env_switch("OASR_NEMO_STREAM_GRAPHS", True)
    #: the attention history a stream keeps when the model's left context is unlimited
    stream_max_history = 1024
    #: a ``oasr.stream_cache.StepProfile`` (or any object with its ``start`` / ``lap`` and
    #: counters) to time the phases of ``stream_step``; None: no timing
    stream_profile = None

    @property
    def stream_runtime(self):  # noqa: ANN201 - streaming.NemotronStreamRuntime
        """The cache pool of all streams and the chunk step (created with the first stream)."""
        rt = self.__dict__.get("_stream_runtime")
        if rt is None:
            from oasr_models_nemo.streaming import NemotronStreamRuntime

            rt = self.__dict__["_stream_runtime"] = NemotronStreamRuntime(self)
        return rt

    def new_stream(self, options: DecodingOptions | None = None):
        """A new stream (``oasr_models_nemo.streaming.NemotronStreamState``); the family option
        ``lookahead`` picks the right context (chunk = lookahead + 1 encoder frames)."""
        from oasr_models_nemo.streaming import new_stream

        return new_stream(self, self._check(options or DecodingOptions()))

    def stream_step(self, states, chunks, is_last):  # noqa: ANN001 - see StreamingASRModel
        from oasr_models_nemo.streaming import stream_step

        return stream_step(self, states, chunks, is_last)

    def release_stream(self, state) -> None:  # noqa: ANN001
        """Return the stream's caches to the pool (finish, abort, disconnect; idempotent)."""
        from oasr_models_nemo.streaming import release

        release(self, state)

    def stream_occupancy(self) -> dict[str, float]:
        """The streaming cache pool's gauges and graph counters; empty before the first stream."""
        rt = self.__dict__.get("_stream_runtime")
        if rt is None:
            return {}
        out = dict(rt.pool.occupancy())
        if rt.graphs is not None:
            out.update({f"graph_{k}": v for k, v in rt.graphs.stats.items()})
        return out

    def capture_stream_graphs(self, max_batch: int, lookahead: int | None = None,
                              streams: int | None = None, max_symbols: int | None = None) -> int:
        """Capture now the CUDA graphs that steps of up to ``max_batch`` streams with
        ``lookahead`` (default: the model's) replay, after growing the cache pool to
        ``streams`` (default ``max_batch``) streams, and warm the greedy search's device loop
        for ``max_symbols`` symbols per frame (default: the model's), so that serving captures
        nothing. Returns the number of step graphs captured (0 off CUDA, with
        ``stream_cuda_graphs`` off, or when a capture failed: the steps then run eagerly)."""
        r = self.config.att_context[1] if lookahead is None or lookahead < 0 else int(lookahead)
        symbols = self.default_options.max_symbols_per_frame if max_symbols is None else max_symbols
        return self.stream_runtime.capture(max_batch, r, streams, (symbols,))


__all__ = ["NemoASR", "NemotronASR", "ParakeetCTC", "ParakeetRNNT", "ParakeetTDT"]
