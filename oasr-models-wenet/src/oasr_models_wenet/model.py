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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.decoders.ctc import (
    CTCGreedySearch,
    CTCHypothesis,
    CTCPrefixBeamSearch,
    attention_rescoring,
    build_rescoring_inputs,
    group_words,
    token_timestamps,
)
from oasr.errors import CheckpointError, InvalidRequestError, UnsupportedOptionError
from oasr.layers import resolve_dtype
from oasr.model import ProgressCallback, StreamingUpdate
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
from oasr_models_wenet.config import WenetConfig
from oasr_models_wenet.nn import ChunkCaches, WenetNet, build_network
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

    def decode(self, ids: Sequence[int]) -> str:
        text = "".join(self.piece(i) for i in ids)
        return text.replace("\u2581", " ").strip()


@dataclass
class WenetStreamState:
    """Per-stream state (see the module docstring). ``samples_needed``: samples of new audio
    the next chunk needs."""

    options: ResolvedOptions  # common + WeNet options of this stream
    chunk_size: int
    num_left_chunks: int
    fbank_stream: Any
    window: int  # feature frames of one chunk's input
    stride: int  # feature frames between chunk starts
    win_length: int
    hop_length: int
    search: Any
    feats: torch.Tensor  # (n, F) feature frames not yet consumed (raw fbank)
    samples_received: int = 0
    frames_consumed: int = 0  # feature frames dropped from the front of ``feats``
    offset: int = 0  # encoder frames emitted
    k: list[torch.Tensor] = field(default_factory=list)  # per layer (H, Tc, D)
    v: list[torch.Tensor] = field(default_factory=list)
    cnn: list[torch.Tensor | None] = field(default_factory=list)  # per layer (C, lorder)
    enc: list[torch.Tensor] = field(default_factory=list)  # encoder output chunks (T, d)
    finished: bool = False
    text: str = ""

    @property
    def samples_needed(self) -> int:
        if self.finished:
            return 0
        frames = self.frames_consumed + self.window
        total = self.win_length + (frames - 1) * self.hop_length
        return max(1, total - self.samples_received)


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
        conf = confidences if use_att else hyp.confidences
        words: list[Word] = []
        if hyp.tokens and len(hyp.times) == len(hyp.tokens):
            timings = token_timestamps(hyp.tokens, hyp.times, conf, frame_shift=self.frame_shift,
                                       num_frames=num_frames, max_token_duration=self.max_token_duration)
            if options.word_timestamps:
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
            return "attention_rescoring" if options.beam_size > 1 else "ctc_greedy_search"
        return m

    def decode_encoded(self, enc: torch.Tensor, lens: torch.Tensor, options: DecodingOptions | ResolvedOptions,
                       durations: Sequence[float]) -> list[Transcript]:
        options = self._check(options)
        method = self._method(options)
        beam = max(1, options.beam_size)
        with torch.no_grad():
            logp = self.net.ctc_log_probs(enc).cpu()
        att = self.attention_beam_search(enc, lens, beam) if method == "attention" else None
        out = []
        for b in range(enc.shape[0]):
            n = int(lens[b])
            conf = None
            if att is not None:
                hyp = CTCHypothesis(att[b])  # no alignment: no times, no words
            elif method in ("ctc_prefix_beam_search", "attention_rescoring"):
                search = CTCPrefixBeamSearch(beam, self.config.blank_id)
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
    def new_stream(self, options: DecodingOptions | None = None, *, chunk_size: int | None = None,
                   num_left_chunks: int | None = None, force: bool = False) -> WenetStreamState:
        """A new stream. ``chunk_size`` / ``num_left_chunks`` default to the model's
        attributes; ``force=True`` streams a model trained without chunk masks anyway (the
        ``ctc_blank`` VAD does; recognition quality is then not what the model was trained for)."""
        options = self._check(options or DecodingOptions())
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
        sub = self.net.encoder.subsampling_rate
        context = self.net.encoder.right_context + 1
        method = self._method(options)
        if method == "attention":
            raise UnsupportedOptionError(
                "decoding_method 'attention' (decoder beam search) decodes offline only; streams "
                "use ctc_greedy_search, ctc_prefix_beam_search or attention_rescoring",
                param="decoding_method",
            )
        search = (CTCGreedySearch(self.config.blank_id) if method == "ctc_greedy_search"
                  else CTCPrefixBeamSearch(options.beam_size, self.config.blank_id))
        net = self.net
        return WenetStreamState(
            options=options, chunk_size=c, num_left_chunks=left,
            fbank_stream=self.fbank.stream(), window=(c - 1) * sub + context, stride=c * sub,
            win_length=self.feature_spec.win_length, hop_length=self.feature_spec.hop_length,
            search=search, feats=torch.zeros(0, self.fbank.dim),
            k=[torch.zeros(0) for _ in net.encoder.encoders], v=[torch.zeros(0) for _ in net.encoder.encoders],
            cnn=[None for _ in net.encoder.encoders],
        )

    def _windows(self, st: WenetStreamState, last: bool) -> list[torch.Tensor]:
        out = []
        context = self.net.encoder.right_context + 1
        while st.feats.shape[0] >= st.window:
            out.append(st.feats[: st.window])
            st.feats = st.feats[st.stride :]
            st.frames_consumed += st.stride
        if last:
            if st.feats.shape[0] >= context:
                out.append(st.feats)
            st.feats = st.feats[:0]
        return out

    def stream_step(self, states: Sequence[WenetStreamState], chunks: Sequence[np.ndarray],
                    is_last: Sequence[bool]) -> list[StreamingUpdate]:
        if not (len(states) == len(chunks) == len(is_last)):
            raise InvalidRequestError("states, chunks and is_last must have the same length")
        pending: list[list[torch.Tensor]] = []
        for k, (st, chunk, last) in enumerate(zip(states, chunks, is_last, strict=True)):
            if st.finished:
                raise InvalidRequestError("this stream already finished; start a new one")
            a = self._wave(chunk, k) if chunk is not None and len(chunk) else np.zeros(0, np.float32)
            if len(a):
                st.samples_received += len(a)
                new = st.fbank_stream.accept(torch.from_numpy(a)).cpu()
                if new.shape[0]:
                    st.feats = torch.cat([st.feats, new.to(st.feats.dtype)])
            pending.append(self._windows(st, bool(last)))
        rounds = max((len(p) for p in pending), default=0)
        for r in range(rounds):
            rows = [i for i, p in enumerate(pending) if len(p) > r]
            self._encode_chunks([states[i] for i in rows], [pending[i][r] for i in rows])
        updates = []
        for st, last in zip(states, is_last, strict=True):
            if last:
                updates.append(self._finish(st))
            else:
                hyp = st.search.best() if isinstance(st.search, CTCPrefixBeamSearch) else st.search.result()
                st.text = self.units.decode(hyp.tokens)
                updates.append(StreamingUpdate(text=st.text, is_final=False))
        return updates

    def _encode_chunks(self, states: list[WenetStreamState], windows: list[torch.Tensor]) -> None:
        net = self.net
        enc = net.encoder
        dev, dt = net.device, net.dtype
        b = len(states)
        w = max(x.shape[0] for x in windows)
        feats = torch.zeros(b, w, windows[0].shape[1])
        for i, x in enumerate(windows):
            feats[i, : x.shape[0]] = x
        flens = torch.tensor([x.shape[0] for x in windows])
        offsets = torch.tensor([st.offset for st in states])
        caches = enc.new_caches(b, dev, dt)
        tc = max(st.k[0].shape[1] if st.k[0].dim() == 3 else 0 for st in states) if enc.encoders else 0
        cache_lens = torch.tensor([st.k[0].shape[1] if st.k and st.k[0].dim() == 3 else 0 for st in states])
        if tc:
            for li in range(len(enc.encoders)):
                kk = caches.k[li].new_zeros(b, caches.k[li].shape[1], tc, caches.k[li].shape[3])
                vv = kk.clone()
                for i, st in enumerate(states):
                    n = int(cache_lens[i])
                    if n:
                        kk[i, :, :n] = st.k[li]
                        vv[i, :, :n] = st.v[li]
                caches.k[li], caches.v[li] = kk, vv
        caches.lengths = cache_lens.to(dev)
        for li in range(len(enc.encoders)):
            if caches.cnn[li] is not None:
                for i, st in enumerate(states):
                    if st.cnn[li] is not None:
                        caches.cnn[li][i] = st.cnn[li]
        with torch.no_grad():
            out, out_lens, new = enc.forward_chunk(feats.to(dev, dt), flens.to(dev), offsets.to(dev), caches)
            logp = net.ctc_log_probs(out).cpu()
        for i, st in enumerate(states):
            n = int(out_lens[i])
            c_len = int(cache_lens[i])
            keep = -1 if st.num_left_chunks < 0 else st.chunk_size * st.num_left_chunks
            for li in range(len(enc.encoders)):
                # valid keys of row i: cache [0, c_len) then chunk frames [tc, tc + n)
                kf = torch.cat([new.k[li][i, :, :c_len], new.k[li][i, :, tc : tc + n]], dim=1)
                vf = torch.cat([new.v[li][i, :, :c_len], new.v[li][i, :, tc : tc + n]], dim=1)
                if keep >= 0:
                    kf, vf = kf[:, kf.shape[1] - min(keep, kf.shape[1]) :], vf[:, vf.shape[1] - min(keep, vf.shape[1]) :]
                st.k[li], st.v[li] = kf, vf
                if new.cnn[li] is not None:
                    st.cnn[li] = new.cnn[li][i]
            st.enc.append(out[i, :n])
            st.offset += n
            st.search.step(logp[i, :n])

    def _finish(self, st: WenetStreamState) -> StreamingUpdate:
        st.finished = True
        sr = self.feature_spec.sample_rate
        duration = st.samples_received / sr
        n = st.offset
        if isinstance(st.search, CTCPrefixBeamSearch):
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
        st.k = st.v = []
        st.cnn = []
        st.enc = [torch.cat(st.enc)] if (self.keep_encoder_output and st.enc) else []
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


__all__ = ["ChunkCaches", "Units", "WenetASR", "WenetStreamState"]
