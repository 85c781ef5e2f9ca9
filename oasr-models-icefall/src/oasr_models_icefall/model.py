"""icefall Zipformer models as OASR :class:`~oasr.model.StreamingASRModel` s.

``ZipformerTransducer`` (registry key ``transducer``) and ``ZipformerCTC`` (``zipformer``) share
everything but their default head: a checkpoint with a transducer head loads as the first (and
may still decode with its CTC head, ``decoding_method=ctc_*``), a CTC-only one as the second.

Offline, as icefall's ``decode.py``: 80-bin Kaldi fbank (snip_edges false, high_freq -400,
dither 0, samples in [-1, 1]), padded with ``log(1e-10)``; a causal model gets 30 more padding
frames and the chunk mask of ``chunk_size`` / ``left_context_frames``. Then the encoder, and:
transducer greedy search (``max_sym_per_frame``) or modified beam search (``beam_size``), or CTC
greedy / prefix beam search, all from :mod:`oasr.decoders`.

Streaming (causal models), as icefall's ``streaming_decode.py``: features come in chunks of
``2 * chunk_size + 13`` frames every ``2 * chunk_size`` frames (the end padded with 13 frames of
``log(1e-10)``), each chunk runs through the encoder's ``streaming_forward`` with per-layer caches
of ``left_context_frames``, and the search advances by its ``chunk_size / 2`` output frames. The
ready chunks of all streams run as one batch (grouped by chunk and left context); caches hold a
fixed window whose unfilled slots are masked, so a stream's result does not depend on its batch.
The caches of all streams live in core's :class:`~oasr.stream_cache.StreamCachePool` (one per
left context; every cache tensor a slot tensor): a step gathers its rows with one
``index_select`` per cache tensor and writes them back with one ``index_copy_``, whatever the
batch size, and a finished or aborted stream returns its slot (``release_stream``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.decoders import (
    CTCGreedySearch,
    CTCPrefixBeamSearch,
    Hypothesis,
    TransducerGreedySearch,
    TransducerModifiedBeamSearch,
    group_words,
    token_timestamps,
)
from oasr.decoders.context_graph import ContextGraph, PieceEncoder, context_graph_for
from oasr.decoders.ctc_gpu import GPUCTCPrefixBeamSearch, ctc_prefix_beam_search_gpu, step_streams
from oasr.decoders.graph_search import (
    graph_search_requested,
    graph_transcripts,
    refuse_graph_search_streaming,
)
from oasr.defaults import env_switch
from oasr.errors import CheckpointError, InvalidRequestError, UnsupportedOptionError
from oasr.features.kaldi import KaldiFbank
from oasr.layers import default_dtype, resolve_dtype
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
from oasr_models_icefall.config import infer_config, read_override
from oasr_models_icefall.fbank import CenteredFbankStream
from oasr_models_icefall.files import (
    find_tokens,
    find_weights_cheap,
    load_averaged_model,
    load_state,
    numbered,
    numbered_pair,
    read_tokens,
)
from oasr_models_icefall.nn import (
    IGNORED_PREFIXES,
    LOG_EPS,
    IcefallNet,
    StreamCaches,
    ZipformerConfig,
)
from oasr_models_icefall.options import IcefallOptions
from oasr_models_icefall.plugin import CTC_CAPABILITIES, TRANSDUCER_CAPABILITIES

WORD_START = "\u2581"
#: icefall's decode.py pads causal models with this many frames of log(1e-10)
CAUSAL_TAIL_FRAMES = 30
#: right context of the streaming front end (icefall's pad_length = 7 + 2 * 3)
STREAM_PAD = 13


class Tokens:
    """icefall's token table (``tokens.txt`` / ``bpe.model``): id -> piece."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)
        self.blank_id = self.pieces.index("<blk>") if "<blk>" in self.pieces else 0
        self.unk_id = self.pieces.index("<unk>") if "<unk>" in self.pieces else None
        body = [p.lstrip(WORD_START) for p in self.pieces if p and not p.startswith("<")]
        latin = sum(1 for p in body if p and all(c.isascii() for c in p))
        self.language = "en" if body and latin > 0.8 * len(body) else None

    def piece(self, i: int) -> str:
        return self.pieces[i] if 0 <= i < len(self.pieces) else f"<{i}>"

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.piece(i) for i in ids).replace(WORD_START, " ").strip()


class IcefallDecoderNetwork:
    """The :class:`oasr.decoders.TransducerNetwork` of an icefall model: the state is the last
    ``context_size`` tokens (``-1`` before the first), outputs are already projected
    (``joiner.decoder_proj``), encoder frames are passed projected (``joiner.encoder_proj``)."""

    def __init__(self, net: IcefallNet) -> None:
        self.net = net
        self.context_size = net.cfg.context_size

    def initial_state(self, batch_size: int, device: Any) -> torch.Tensor:
        return torch.full((batch_size, self.context_size), -1, dtype=torch.long, device=device)

    def predict(self, tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        context = torch.cat([state[:, 1:], tokens.to(state.device).unsqueeze(1)], dim=1)
        return self.net.joiner.decoder_proj(self.net.decoder(context)), context

    def select_state(self, state: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return state[index]

    def merge_state(self, state: torch.Tensor, new_state: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        return torch.where(update.unsqueeze(1), new_state, state)

    def join(self, encoder_frames: torch.Tensor, decoder_out: torch.Tensor) -> torch.Tensor:
        return self.net.joiner(encoder_frames, decoder_out)


@dataclass
class IcefallStream:
    """One live stream (an :class:`oasr.model.StreamState`)."""

    options: ResolvedOptions
    method: str
    chunk: int  # 50 Hz frames per chunk
    left: int
    fbank: CenteredFbankStream
    search: Any
    cache: StreamContext | None = None  # this stream's slot in the model's cache pool
    samples_received: int = 0
    frames_consumed: int = 0
    offset: int = 0  # encoder frames (25 Hz) decoded
    finished: bool = False
    #: greedy search, batched across the streams of a step: this stream's row of it
    hyp: Hypothesis = field(default_factory=lambda: Hypothesis(tokens=[]))
    text: str = ""  # the partial text of ``hyp`` (decoded again only when it grew)
    tokens_seen: int = 0

    @property
    def window(self) -> int:
        return 2 * self.chunk + STREAM_PAD

    @property
    def samples_needed(self) -> int:
        if self.finished:
            return 0
        frames = self.frames_consumed + self.window
        # a centred 25 ms frame t is complete once samples up to 160 t + 280 arrived
        return max(1, self.fbank.samples_for(frames) - self.samples_received)


class _IcefallASR:
    capabilities: ModelCapabilities = TRANSDUCER_CAPABILITIES
    default_head = "transducer"
    #: on CUDA, a stream step's device half (fbank, caches, encoder, one-symbol greedy search)
    #: is a CUDA-graph replay per batch-size bucket: the default there (an H200 ran 64 / 128 /
    #: 256 streams of 320 ms chunks at step p99 16.5 / 14.7 / 32.5 ms, eager 241 / 231 / 582);
    #: ``OASR_ICEFALL_STREAM_GRAPHS=0`` or False here: the eager step. A capture that fails warns
    #: and that step and the later ones run eagerly. Nothing changes on the CPU
    stream_cuda_graphs = env_switch("OASR_ICEFALL_STREAM_GRAPHS", True)
    #: tests: the graph steps' bucketing and padding on the CPU (GraphSteps(simulate=True))
    _simulate_stream_graphs = False
    #: host seconds per phase of the stream steps (a benchmark sets a StepProfile; None: off)
    stream_profile: StepProfile | None = None

    def __init__(self, net: IcefallNet, tokens: Sequence[str], *, name: str | None = None,
                 source_path: Path | None = None) -> None:  # fmt: skip
        cfg: ZipformerConfig = net.cfg
        if len(tokens) != cfg.vocab_size:
            raise CheckpointError(f"the token table has {len(tokens)} entries but the model has "
                                  f"{cfg.vocab_size} outputs; tokens.txt does not belong to this checkpoint")
        self.net = net.eval()
        self.cfg = cfg
        self.tokens = Tokens(tokens)
        self.blank_id = self.tokens.blank_id
        self.source_path = source_path
        self.source_format = "icefall"
        head = "transducer" if self.default_head == "transducer" else "ctc"
        kind = "causal " if cfg.causal else ""
        encoder = getattr(cfg, "encoder", "zipformer")
        self.name = name or f"icefall {kind}{encoder} {head} ({sum(cfg.num_encoder_layers)} layers, {cfg.output_dim}d)"
        self.capabilities = replace(type(self).capabilities, streaming=cfg.causal)
        self.feature_spec = FeatureSpec(
            kind="kaldi_fbank", sample_rate=16000, num_bins=cfg.feature_dim, hop_length=160,
            win_length=400, n_fft=512,
            options={"snip_edges": False, "high_freq": -400.0, "dither": 0.0, "energy_floor": 0.0},
        )  # fmt: skip
        self.fbank = KaldiFbank(self.feature_spec)
        self.decoder_network = IcefallDecoderNetwork(net) if cfg.use_transducer else None
        self.default_options = IcefallOptions(chunk_size=16 if cfg.causal else -1)
        self.frame_shift = 0.04  # 25 Hz encoder output
        #: greedy search replays one frame as a CUDA graph on CUDA (the stateless decoder and
        #: joiner are capturable); False runs the frames eagerly
        self.cuda_graphs = True
        self.max_token_duration = 1.0
        self._encoder: PieceEncoder | None = None  # hotword spelling, made on first use
        #: CTC prefix beam search on CUDA as batched tensor operations (oasr.decoders.ctc_gpu);
        #: False keeps the host search
        self.tensor_ctc_search = True

    # -- native format (oasr convert) -----------------------------------------------------
    def save_native(self, dst: str | Path) -> str:
        """``model.safetensors`` (icefall's names, tensors as loaded) + ``oasr_model.json`` (the
        inferred config, tokens, frontend, decoding defaults); returns the registry key."""
        from safetensors.torch import save_file

        from oasr.checkpoint import write_native_config
        from oasr_models_icefall.config import config_dict

        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.net.state_dict().items()},
                  str(dst / "model.safetensors"))  # fmt: skip
        key = "transducer" if isinstance(self, ZipformerTransducer) else "zipformer"
        write_native_config(dst, key, {
            "icefall_config": config_dict(self.cfg), "tokens": list(self.tokens.pieces),
            "source_format": self.source_format,
            "tokenizer": {"kind": "icefall_tokens"},
        }, feature_spec=self.feature_spec, decoding=self.default_options)  # fmt: skip
        return key

    @classmethod
    def from_native(cls, path: str | Path, body: dict[str, Any] | None = None,
                    config: EngineConfig | None = None) -> _IcefallASR:  # fmt: skip
        from safetensors.torch import load_file

        from oasr.checkpoint import read_native_config
        from oasr_models_icefall.config import config_from_dict

        path = Path(path)
        body = body or read_native_config(path)
        config = config or EngineConfig()
        try:
            raw = dict(body["icefall_config"])
            if raw.get("encoder") == "conformer":
                from oasr_models_icefall.conformer import ConformerConfig

                cfg = ConformerConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
            else:
                cfg = config_from_dict(raw)
            tokens = list(body["tokens"])
            state = load_file(str(path / "model.safetensors"))
        except (KeyError, TypeError, OSError) as exc:
            raise CheckpointError(f"{path}: incomplete native icefall checkpoint ({exc})") from exc
        net = build_network(cfg, state, config.device, resolve_dtype(config.dtype))
        model = cls(net, tokens, source_path=path)
        model.source_format = "oasr"
        model.default_options = model.default_options.with_saved(body.get("decoding"))
        return model

    @property
    def device(self) -> torch.device:
        return self.net.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.dtype

    # -- options ----------------------------------------------------------------------------
    def _check(self, options: DecodingOptions | ResolvedOptions) -> ResolvedOptions:
        o = options.validate_for(self)
        m = self._method(o)
        if m.startswith("ctc") and not self.cfg.use_ctc:
            raise UnsupportedOptionError(f"{self.name} has no CTC head; use greedy_search or "
                                         f"modified_beam_search", param="decoding_method")
        if graph_search_requested(o) and not self.cfg.use_ctc:
            raise UnsupportedOptionError(f"{self.name} has no CTC head to decode over a WFST graph",
                                         param="wfst_graph")  # fmt: skip
        if not m.startswith("ctc") and not self.cfg.use_transducer:
            raise UnsupportedOptionError(f"{self.name} has no transducer head; use ctc_greedy_search "
                                         f"or ctc_prefix_beam_search", param="decoding_method")
        if o.chunk_size > 0 and not self.cfg.causal:
            if "chunk_size" in (options.model_options if isinstance(options, DecodingOptions) else {}):
                raise UnsupportedOptionError(f"{self.name} is not causal; chunk_size must be -1",
                                             param="chunk_size")
        if self.cfg.causal and o.chunk_size > 0:
            ds = max(self.cfg.downsampling_factor)
            if o.chunk_size % ds:
                raise InvalidRequestError(f"chunk_size must be a multiple of {ds} (the largest "
                                          f"downsampling factor of {self.name})", param="chunk_size")
            if o.left_context_frames % ds:
                raise InvalidRequestError(f"left_context_frames must be a multiple of {ds}",
                                          param="left_context_frames")
        return o

    def _method(self, o: ResolvedOptions) -> str:
        m = o.decoding_method
        if m != "auto":
            return m
        greedy = o.beam_size == 1 and not o.hotwords  # hotwords need a beam: auto switches
        if self.default_head == "transducer" and self.cfg.use_transducer:
            return "greedy_search" if greedy else "modified_beam_search"
        return "ctc_greedy_search" if greedy else "ctc_prefix_beam_search"

    @staticmethod
    def _beam(o: ResolvedOptions) -> int:
        return o.beam_size if o.beam_size > 1 else 4

    def _context_graph(self, o: ResolvedOptions) -> ContextGraph | None:
        """The request's hotwords as a context graph (spelled with the model's tokens)."""
        if not o.hotwords:
            return None
        if self._encoder is None:
            self._encoder = PieceEncoder(self.tokens.pieces, WORD_START)
        return context_graph_for(o.hotwords, self._encoder, o.hotwords_score)

    def _new_search(self, o: ResolvedOptions, method: str, batch: int) -> Any:
        if method == "greedy_search":
            return TransducerGreedySearch(self.decoder_network, batch, blank_id=self.blank_id,
                                          max_symbols_per_frame=o.max_sym_per_frame,
                                          blank_penalty=o.blank_penalty,
                                          cuda_graph=self.cuda_graphs)  # fmt: skip
        if method == "modified_beam_search":
            return TransducerModifiedBeamSearch(self.decoder_network, self._beam(o), batch,
                                                blank_id=self.blank_id, blank_penalty=o.blank_penalty,
                                                length_norm_offset=self.cfg.context_size,
                                                context_graph=self._context_graph(o))  # fmt: skip
        if method == "ctc_greedy_search":
            return CTCGreedySearch(self.blank_id)
        if self.tensor_ctc_search and self.device.type == "cuda":  # streams batch in one step
            return GPUCTCPrefixBeamSearch(self._beam(o), self.blank_id, self.device,
                                          self._context_graph(o))
        return CTCPrefixBeamSearch(self._beam(o), self.blank_id, self._context_graph(o))

    # -- encoder ----------------------------------------------------------------------------
    def features(self, waves: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """icefall's decoding features: (B, T, 80) padded with log(1e-10), and frame counts."""
        from oasr.features.batching import padded_batch

        x, lengths = padded_batch(waves, self.device)  # fbank on the model's device
        feats, lens = self.fbank.extract(x, lengths)
        pad = torch.arange(feats.shape[1], device=feats.device)[None, :] >= lens[:, None]
        return feats.masked_fill(pad[:, :, None], LOG_EPS), lens

    def encode_features(self, feats: torch.Tensor, lens: torch.Tensor, options: ResolvedOptions,
                        uniform: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The encoder over a padded feature batch; ``uniform``: every row has the batch's full
        length (the caller knows it without reading ``lens`` back), so no padding masks."""
        chunk, left = -1, -1
        if self.cfg.causal:
            feats = torch.nn.functional.pad(feats, (0, 0, 0, CAUSAL_TAIL_FRAMES), value=LOG_EPS)
            lens = lens + CAUSAL_TAIL_FRAMES
            chunk, left = options.chunk_size, options.left_context_frames
        with torch.no_grad():
            return self.net.encode(feats.to(self.device, self.dtype), lens.to(self.device), chunk, left, uniform)

    # -- decoding ---------------------------------------------------------------------------
    def _search_frames(self, enc: torch.Tensor, method: str) -> torch.Tensor:
        """What the search consumes: projected encoder frames, or CTC log-probabilities (CPU)."""
        with torch.no_grad():
            if method.startswith("ctc"):
                lp = self.net.ctc_log_probs(enc)
                # the prefix beam search runs on CUDA as batched tensor operations
                tensor = method == "ctc_prefix_beam_search" and lp.is_cuda and self.tensor_ctc_search
                return lp if tensor else lp.cpu()
            return self.net.joiner.encoder_proj(enc)

    def decode(self, enc: torch.Tensor, lens: torch.Tensor, options: ResolvedOptions) -> list[Hypothesis]:
        method = self._method(options)
        frames = self._search_frames(enc, method)
        lens_list = [int(n) for n in lens.tolist()]  # one read-back, not one per row
        if method == "ctc_prefix_beam_search" and frames.is_cuda:  # (tensor_ctc_search)
            if options.blank_penalty:
                frames = frames.clone()
                frames[:, :, self.blank_id] -= options.blank_penalty
            graph = self._context_graph(options)
            nbest = ctc_prefix_beam_search_gpu(frames, lens_list, self._beam(options), self.blank_id,
                                               [graph] * len(lens_list))
            return [n[0] for n in nbest]
        if method.startswith("ctc"):
            out = []
            for b, n in enumerate(lens_list):
                search = self._new_search(options, method, 1)
                lp = frames[b, :n]
                if options.blank_penalty:
                    lp = lp.clone()
                    lp[:, self.blank_id] -= options.blank_penalty
                search.step(lp)
                out.append(search.result() if isinstance(search, CTCGreedySearch) else search.best())
            return out
        search = self._new_search(options, method, frames.shape[0])
        search.step(frames, lens_list)
        return search.results() if isinstance(search, TransducerGreedySearch) else search.best()

    def _transcript(self, hyp: Hypothesis, duration: float, num_frames: int, options: ResolvedOptions) -> Transcript:
        text = self.tokens.decode(hyp.tokens)
        words: list[Word] = []
        if options.word_timestamps and hyp.tokens:
            if len(hyp.times) != len(hyp.tokens):
                raise UnsupportedOptionError("this hypothesis has no alignment; word timestamps "
                                             "are not available", param="word_timestamps")
            timings = token_timestamps(hyp.tokens, hyp.times, hyp.confidences, frame_shift=self.frame_shift,
                                       num_frames=num_frames, max_token_duration=self.max_token_duration)
            pieces = [self.tokens.piece(t) for t in hyp.tokens]
            words = [Word(w, min(s, duration), min(e, duration), c) for w, s, e, c in group_words(pieces, timings)]
        lps = hyp.token_logprobs
        seg = Segment(id=0, start=0.0, end=round(duration, 3), text=text, tokens=list(hyp.tokens),
                      words=words, avg_logprob=float(sum(lps) / len(lps)) if lps else 0.0)  # fmt: skip
        return Transcript(text=text, language=self.tokens.language, duration=duration,
                          segments=[seg] if text else [])  # fmt: skip

    def transcribe(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                   progress: ProgressCallback | None = None) -> list[Transcript]:  # fmt: skip
        o = self._check(options)
        waves = [as_mono_waveform(a, f"audio #{k}") for k, a in enumerate(audios)]
        sr = self.feature_spec.sample_rate
        out: list[Transcript | None] = [None] * len(waves)
        # icefall needs at least 9 fbank frames (7 for the front end, then a frame) offline
        # no fbank frame: nothing to say; a model that is not causal needs 9 frames (its
        # front end's context), a causal one is padded with 30 frames as icefall decodes it
        need = 1 if self.cfg.causal else 9
        todo = [i for i, w in enumerate(waves) if self.fbank.num_frames(len(w)) >= need]
        for i, w in enumerate(waves):
            if i not in todo:
                out[i] = Transcript(text="", language=self.tokens.language, duration=len(w) / sr)
        if todo:
            feats, lens = self.features([waves[i] for i in todo])
            # inputs of one length (e.g. fixed windows of long audio): no padding to mask
            uniform = len({len(waves[i]) for i in todo}) == 1
            enc, enc_lens = self.encode_features(feats, lens, o, uniform)
            if graph_search_requested(o):  # model option wfst_graph: CTC over a WFST graph
                with torch.no_grad():
                    lp = self.net.ctc_log_probs(enc)
                graphed = graph_transcripts(lp, enc_lens.tolist(), o, [len(waves[i]) / sr for i in todo],
                                            self.frame_shift, self.tokens.language)  # fmt: skip
                for row, i in enumerate(todo):
                    out[i] = graphed[row]
            else:
                hyps = self.decode(enc, enc_lens, o)
                frames = enc_lens.tolist()
                for row, i in enumerate(todo):
                    out[i] = self._transcript(hyps[row], len(waves[i]) / sr, int(frames[row]), o)
        if progress is not None:
            total = sum(len(w) for w in waves) / sr
            progress(total, total)
        return [t for t in out if t is not None]

    # -- streaming --------------------------------------------------------------------------
    def new_stream(self, options: DecodingOptions | None = None) -> IcefallStream:
        o = self._check(options or DecodingOptions())
        refuse_graph_search_streaming(o)
        if not self.cfg.causal:
            raise UnsupportedOptionError(f"{self.name} is not causal (trained without chunks); it "
                                         f"decodes offline only", param="service_mode")
        if o.chunk_size <= 0:
            raise InvalidRequestError("streaming needs chunk_size > 0 (50 Hz frames per chunk)",
                                      param="chunk_size")
        method = self._method(o)
        st = IcefallStream(
            options=o, method=method, chunk=o.chunk_size, left=o.left_context_frames,
            fbank=CenteredFbankStream(self.fbank),
            search=None if method == "greedy_search" else self._new_search(o, method, 1),
        )  # fmt: skip
        pool, init, _ = self._cache_pool(st.left)
        st.cache = pool.open(owner=st)
        for name, t in init.items():  # the initial state's non-zero parts (open() zeroed the slot)
            pool.slot_tensors[name][st.cache.slot] = t[0]
        return st

    def _cache_pool(self, left: int) -> tuple[StreamCachePool, dict[str, torch.Tensor], _CacheLayout]:
        """The cache pool of streams with ``left`` context frames (created on first use), the
        initial state's slot values that are not all zeros, and the encoder caches' layout.

        Slots: ``encoder`` every encoder cache of a stream in one flat row (a step gathers and
        scatters them with one ``index_select`` / ``index_copy_``), ``processed`` (embed frames
        seen), and with a transducer head ``dec_state`` / ``dec_out`` (the greedy search's
        prediction-network state and output)."""
        pools = self.__dict__.setdefault("_stream_pools", {})
        if left not in pools:
            caches = self.net.initial_state(1, left)
            layout = _CacheLayout.of(caches)
            flat, processed = layout.pack(caches)
            init = {"encoder": flat, "processed": processed}
            if self.decoder_network is not None:
                # greedy transducer streams: the prediction network's state and output after
                # the initial blank, the same for every new stream
                net = self.decoder_network
                blank = torch.full((1,), self.blank_id, dtype=torch.long, device=self.device)
                with torch.no_grad():
                    dec_out, dec_state = net.predict(blank, net.initial_state(1, self.device))
                init.update(dec_state=dec_state, dec_out=dec_out)
            pool = StreamCachePool(
                slots={k: (tuple(t.shape[1:]), t.dtype) for k, t in init.items()}, device=self.device
            )  # fmt: skip
            pools[left] = (pool, {k: t for k, t in init.items() if bool(t.any())}, layout)
        return pools[left]

    def release_stream(self, st: IcefallStream) -> None:
        """Return the stream's caches to the pool (finish, abort, disconnect; idempotent)."""
        if st.cache is not None:
            self._cache_pool(st.left)[0].release(st.cache)

    def stream_occupancy(self) -> dict[str, float]:
        """Gauges of the streaming cache pools (summed over left contexts)."""
        out: dict[str, float] = {}
        for pool, *_ in self.__dict__.get("_stream_pools", {}).values():
            for k, v in pool.occupancy().items():
                out[k] = out.get(k, 0) + v
        for graphs in self.__dict__.get("_graphs", {}).values():
            for k, v in graphs.stats.items():
                out[f"graph_{k}"] = out.get(f"graph_{k}", 0) + v
        return out

    def _windows(self, st: IcefallStream, last: bool) -> list[tuple[int, int]]:
        """The stream's chunk windows its frames allow now: (first fbank frame, how many of the
        window's frames are real; the rest are icefall's padding of ``log(1e-10)`` features)."""
        out = []
        step = 2 * st.chunk
        avail = st.fbank.emitted - st.frames_consumed
        while avail >= st.window:
            out.append((st.frames_consumed, st.window))
            st.frames_consumed += step
            avail -= step
        if last:
            if st.fbank.emitted == 0:  # not one fbank frame: nothing to say (as offline)
                return out
            left = avail + STREAM_PAD  # icefall pads the end with 13 frames
            while left > 0:
                out.append((st.frames_consumed, max(0, min(avail, st.window))))
                st.frames_consumed += step
                avail -= step
                left -= step
        return out

    def stream_step(self, states: Sequence[IcefallStream], chunks: Sequence[np.ndarray],
                    is_last: Sequence[bool]) -> list[StreamingUpdate]:  # fmt: skip
        if not len(states) == len(chunks) == len(is_last):
            raise InvalidRequestError("states, chunks and is_last must have the same length")
        prof = self.stream_profile
        if prof is not None:
            prof.start()
            prof.steps += 1
            prof.rows += len(states)
        pending = []
        for k, (st, chunk, last) in enumerate(zip(states, chunks, is_last, strict=True)):
            if st.finished:
                raise InvalidRequestError("this stream already finished; start a new one")
            if chunk is None or not len(chunk):
                a = None
            elif isinstance(chunk, np.ndarray) and chunk.dtype == np.float32 and chunk.ndim == 1:
                a = chunk  # the engine hands over checked float32 mono arrays
            else:
                a = as_mono_waveform(chunk, f"chunk #{k}")
            if a is not None and a.size:
                st.samples_received += a.size
                st.fbank.accept(a)
            if last:
                st.fbank.finish()
            pending.append(self._windows(st, bool(last)))
        if prof is not None:
            prof.lap("features")
        for r in range(max((len(p) for p in pending), default=0)):
            groups: dict[tuple[int, int], list[int]] = {}
            for i, p in enumerate(pending):
                if len(p) > r:
                    groups.setdefault((states[i].chunk, states[i].left), []).append(i)
            for rows in groups.values():
                self._encode_chunk([states[i] for i in rows], [pending[i][r] for i in rows])
        updates = []
        for st, last in zip(states, is_last, strict=True):
            hyp = self._hyp(st)
            if last:
                if prof is not None:
                    prof.lap("results")
                st.finished = True
                self.release_stream(st)
                tr = self._transcript(hyp, st.samples_received / self.feature_spec.sample_rate, st.offset, st.options)
                updates.append(StreamingUpdate(text=tr.text, is_final=True, transcript=tr))
                if prof is not None:
                    prof.finals += 1
                    prof.lap("finals")
                continue
            if st.search is not None or len(hyp.tokens) != st.tokens_seen:  # greedy only grows
                st.text, st.tokens_seen = self.tokens.decode(hyp.tokens), len(hyp.tokens)
            updates.append(StreamingUpdate(text=st.text, is_final=False))
        if prof is not None:
            prof.lap("results")
        return updates

    @staticmethod
    def _hyp(st: IcefallStream) -> Hypothesis:
        s = st.search
        if s is None:
            return st.hyp
        if isinstance(s, (CTCGreedySearch,)):
            return s.result()
        if isinstance(s, (CTCPrefixBeamSearch, GPUCTCPrefixBeamSearch)):
            return s.best()
        if isinstance(s, TransducerGreedySearch):
            return s.results()[0]
        return s.best()[0]

    def _encode_chunk(self, states: list[IcefallStream], windows: list[tuple[int, int]]) -> None:
        """One chunk of each stream (same chunk and left context) in one batched step: the
        device half (:meth:`_chunk_compute`: cache gather, encoder, cache scatter, the greedy
        search of the one-symbol-per-frame greedy streams) is one CUDA-graph replay on CUDA
        (per batch-size bucket, padded rows on the pool's scratch slot 0); one device-to-host
        copy brings their tokens back. Other searches advance on the encoder output after it."""
        b = len(states)
        chunk, left = states[0].chunk, states[0].left
        prof = self.stream_profile
        pool, *_ = self._cache_pool(left)
        ctxs = [st.cache for st in states]
        pool.reserve(ctxs, [0] * b)  # applies pending releases
        if prof is not None:
            prof.calls += 1
            prof.lap("gather")
        graphs = self._stream_graphs(left)
        rows = bucket(b, BATCH_BUCKETS) if graphs is not None else b
        samples = self._sample_buffer(rows, states[0].fbank.span(states[0].window))  # (rows, span)
        for i, (st, (first, n)) in enumerate(zip(states, windows, strict=True)):
            st.fbank.write_span(samples[i], first, n)
            st.fbank.drop_before(first + 2 * st.chunk)  # where its next window starts
        in_step = np.zeros(b, bool)  # greedy with one symbol per frame: searched in the step
        if self.decoder_network is not None:
            in_step[:] = [st.search is None and st.options.max_sym_per_frame == 1 for st in states]
        ints = np.zeros((rows, 3), np.int64)
        ints[:b, 0], ints[:b, 1], ints[:b, 2] = pool.slot_ids(ctxs), in_step, [n for _, n in windows]
        penalty = np.zeros(rows, np.float32)
        penalty[:b] = [st.options.blank_penalty for st in states]
        dev = self.device
        pinned = self.__dict__["_sample_store"].is_pinned()
        # the eager step skips the blank-penalty op when no stream has one (a graph's inputs are fixed)
        pen = torch.from_numpy(penalty).to(dev) if graphs is not None or penalty.any() else None
        inputs = (self.__dict__["_sample_tensor"].to(dev, non_blocking=pinned), torch.from_numpy(ints).to(dev), pen)
        if pinned:  # the buffer is refilled only once this copy is done
            self._h2d_done = torch.cuda.Event()
            self._h2d_done.record()
        if prof is not None:
            prof.lap("features")
        with torch.no_grad():
            outs = None
            if graphs is not None:
                key = (rows, chunk)
                if self._capture_stream_graph(graphs, key, pool.generation):
                    outs = graphs.run(key, pool.generation, *inputs)
                else:  # this step eagerly, on the inputs built above (the capture changed no stream)
                    inputs = tuple(t[:b] for t in inputs)
            if outs is None:
                outs = self._chunk_compute(left, *inputs, search=bool(in_step.any()))
            out = outs[0][:b]
            if prof is not None:
                prof.lap("encoder")
            host = outs[1][:b].cpu().numpy() if in_step.any() else None  # (b, 2, T): tokens, logps
            if not in_step.all() and graphs is not None:
                out = out.clone()  # the graph's output buffer is reused by its next replay
        if prof is not None:
            prof.lap("wait")
        if host is not None:
            for i in np.nonzero(in_step)[0].tolist():
                st = states[i]
                hyp, lps = st.hyp, host[i, 1].astype(np.float64)
                hyp.score += float(lps.sum())
                at = np.nonzero(host[i, 0] >= 0)[0]
                hyp.tokens += host[i, 0, at].astype(np.int64).tolist()
                hyp.times += (at + st.offset).tolist()
                hyp.token_logprobs += lps[at].tolist()
        greedy = [i for i, st in enumerate(states) if st.search is None and not in_step[i]]
        if greedy:  # several symbols per frame: the core's search, batched
            self._greedy_rows([states[i] for i in greedy], out[greedy] if len(greedy) < b else out)
        tensor_beams: list[tuple[GPUCTCPrefixBeamSearch, torch.Tensor]] = []
        for i, st in enumerate(states):
            st.offset += out.shape[1]
            if st.search is None:
                continue
            f = self._search_frames(out[i : i + 1], st.method)
            if st.method.startswith("ctc"):
                lp = f[0]
                if st.options.blank_penalty:
                    lp = lp.clone()
                    lp[:, self.blank_id] -= st.options.blank_penalty
                if isinstance(st.search, GPUCTCPrefixBeamSearch):
                    tensor_beams.append((st.search, lp))
                else:
                    st.search.step(lp)
            else:
                st.search.step(f, [f.shape[1]])
        if tensor_beams:  # every tensor prefix beam of this chunk in one batched step
            step_streams([b for b, _ in tensor_beams], [lp for _, lp in tensor_beams])
        if prof is not None:
            prof.lap("search")

    def _sample_buffer(self, rows: int, span: int) -> np.ndarray:
        """A host buffer (rows, span) for the samples a step's windows of frames cover (page-
        locked with the CUDA-graph step, reused: one copy to the device). Not zeroed: frames past
        a row's real ones are masked on the device."""
        shape = (rows, span)
        n = math.prod(shape)
        store = self.__dict__.get("_sample_store")
        if store is None or store.numel() < n:
            pinned = self.device.type == "cuda" and self.stream_cuda_graphs
            store = torch.zeros(max(n, 2 * store.numel() if store is not None else 0), pin_memory=pinned)
            self.__dict__["_sample_store"] = store
        done = self.__dict__.pop("_h2d_done", None)
        if done is not None:  # the previous step's copy out of it has finished
            done.synchronize()
        view = store[:n].view(shape)
        self.__dict__["_sample_tensor"] = view
        return view.numpy()

    def _chunk_compute(self, left: int, samples: torch.Tensor, ints: torch.Tensor,
                       penalty: torch.Tensor, search: bool = True) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The device half of a chunk step (captured as a CUDA graph on CUDA). ``samples`` (R,
        span): the samples each row's window of ``2 chunk + 13`` fbank frames covers (frames every
        ``hop``); ``ints`` (R, 3):
        cache slot, 1 where the row's greedy search (one symbol per frame) runs here, how many
        of the window's frames are real (the rest get icefall's ``log(1e-10)`` padding);
        ``penalty`` (R,) blank penalties (None: all zero; the eager step's shortcut). Returns the encoder output (R, chunk / 2, D) and, with
        a transducer head, (R, 2, chunk / 2): each frame's token (-1: none) and log-probability,
        as the core's device greedy search (``TransducerGreedySearch`` on CUDA) computes them.
        ``search`` False (the eager step's shortcut when no row's greedy search runs here):
        only the encoder output, the decoder states untouched."""
        pool, _, layout = self._cache_pool(left)
        tensors = pool.slot_tensors
        slots = ints[:, 0]
        raw = samples.unfold(-1, self.feature_spec.win_length, self.feature_spec.hop_length)
        feats = self.fbank.compute_frames(raw)  # (R, window, F)
        real = torch.arange(raw.shape[1], device=raw.device)[None, :] < ints[:, 2:3]
        feats = torch.where(real.unsqueeze(2), feats, LOG_EPS)
        caches = layout.unpack(tensors["encoder"].index_select(0, slots), tensors["processed"].index_select(0, slots))
        out, new = self.net.streaming_forward(feats.to(self.dtype), caches, left)
        flat, processed = layout.pack(new)
        tensors["encoder"].index_copy_(0, slots, flat)
        tensors["processed"].index_copy_(0, slots, processed)
        net = self.decoder_network
        if net is None or not search:  # (a graph always searches: its shapes are fixed)
            return (out,)
        dec_state, dec_out = tensors["dec_state"], tensors["dec_out"]  # by slot
        state0, d0 = dec_state.index_select(0, slots), dec_out.index_select(0, slots)
        state, dec = state0, d0
        frames = self.net.joiner.encoder_proj(out)
        blank = self.blank_id
        blanks = torch.full_like(slots, blank)
        bests, all_logits = [], []
        for frame in frames.unbind(1):
            logits = net.join(frame, dec).float()
            if penalty is not None:
                logits[:, blank] -= penalty
            best = logits.argmax(dim=-1)
            emit = best != blank
            d, s = net.predict(torch.where(emit, best, blanks), state)
            state = net.merge_state(state, s, emit)
            dec = torch.where(emit.unsqueeze(1), d.to(dec.dtype), dec)
            bests.append(best)
            all_logits.append(logits)
        use = ints[:, 1].bool().unsqueeze(1)  # other rows keep their decoder state
        dec_state.index_copy_(0, slots, torch.where(use, state, state0))
        dec_out.index_copy_(0, slots, torch.where(use, dec, d0))
        best = torch.stack(bests, 1)  # (R, T): the frames' log-probabilities in one pass
        logps = torch.stack(all_logits, 1).log_softmax(dim=-1).gather(2, best.unsqueeze(2)).squeeze(2)
        tokens = torch.where(best != blank, best, -1).to(torch.float32)
        return out, torch.stack([tokens, logps], 1)

    def _graph_inputs(self, left: int, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """Inputs of a captured step's shapes that touch only the scratch slot 0."""
        rows, chunk = key
        dev = self.device
        span = (2 * chunk + STREAM_PAD - 1) * self.feature_spec.hop_length + self.feature_spec.win_length
        return (torch.zeros(rows, span, device=dev),
                torch.zeros(rows, 3, dtype=torch.long, device=dev), torch.zeros(rows, device=dev))  # fmt: skip

    def _stream_graphs(self, left: int) -> GraphSteps | None:
        """The captured chunk steps of streams with ``left`` context frames (None off CUDA or
        with ``stream_cuda_graphs`` off)."""
        simulate = self._simulate_stream_graphs and self.device.type != "cuda"
        if not self.stream_cuda_graphs or (self.device.type != "cuda" and not simulate):
            return None
        graphs = self.__dict__.setdefault("_graphs", {})
        if left not in graphs:
            graphs[left] = GraphSteps(functools.partial(self._chunk_compute, left),
                                      functools.partial(self._graph_inputs, left), simulate=simulate)  # fmt: skip
        return graphs[left]

    def _capture_stream_graph(self, graphs: GraphSteps, key: tuple[int, int], generation: Any) -> bool:
        """Capture ``key``'s step graph unless it exists; False when the capture failed (warned;
        ``stream_cuda_graphs`` is then False: eager steps from now on). A failed capture leaves
        every stream as it was: its warm-up and capture touch only the scratch slot 0."""
        if graphs.try_capture(key, generation, self.name):
            return True
        self.stream_cuda_graphs = False
        return False

    def capture_stream_graphs(self, max_batch: int, chunk_size: int | None = None,
                              left_context_frames: int | None = None, streams: int | None = None,
                              buckets: Sequence[int] | None = None) -> int:  # fmt: skip
        """Capture now the CUDA graphs that steps of up to ``max_batch`` streams with these chunk
        and left-context sizes (defaults: the model's) replay (every batch bucket up to
        ``max_batch``'s, or only ``buckets``), after growing the cache pool to ``streams``
        (default ``max_batch``) streams, so that no capture or growth happens while streams are
        served. Returns the number of graphs captured (0 off CUDA, with graphs off, or when a
        capture failed: graphs are then off, warned)."""
        chunk = chunk_size or self.default_options.chunk_size
        left = self.default_options.left_context_frames if left_context_frames is None else left_context_frames
        graphs = self._stream_graphs(left)
        if graphs is None:
            return 0
        pool, *_ = self._cache_pool(left)
        pool.ensure(streams or max_batch)
        top = bucket(max_batch, BATCH_BUCKETS)
        before = graphs.stats["captures"]
        with torch.no_grad():
            for rows in buckets or [r for r in BATCH_BUCKETS if r <= top]:
                if not self._capture_stream_graph(graphs, (bucket(rows, BATCH_BUCKETS), chunk), pool.generation):
                    return 0
        return graphs.stats["captures"] - before

    def _greedy_rows(self, states: list[IcefallStream], enc: torch.Tensor) -> None:
        """Greedy search of one chunk for several streams in one batched search (each stream
        keeps its hypothesis and decoder state between steps)."""
        net = self.decoder_network
        dev = enc.device
        pool, *_ = self._cache_pool(states[0].left)
        dec_state, dec_out = pool.slot_tensors["dec_state"], pool.slot_tensors["dec_out"]  # by slot
        by_settings: dict[tuple[int, float], list[int]] = {}
        for i, st in enumerate(states):
            by_settings.setdefault((st.options.max_sym_per_frame, st.options.blank_penalty), []).append(i)
        frames = self._search_frames(enc, "greedy_search")
        for (max_sym, penalty), rows in by_settings.items():
            group = [states[i] for i in rows]
            slots = torch.from_numpy(pool.slot_ids([st.cache for st in group])).to(dev)
            search = TransducerGreedySearch.resume(
                net, [st.hyp for st in group], [st.offset for st in group],
                dec_state.index_select(0, slots), dec_out.index_select(0, slots),
                blank_id=self.blank_id, max_symbols_per_frame=max_sym, blank_penalty=penalty)
            search.step(frames[rows] if len(rows) < len(states) else frames)
            for st, hyp in zip(group, search.results(), strict=True):
                st.hyp = hyp
            dec_state.index_copy_(0, slots, search.state)
            dec_out.index_copy_(0, slots, search.decoder_out.to(dec_out.dtype))


def _flatten_caches(c: StreamCaches) -> list[torch.Tensor]:
    return [c.embed, *(t for stack in c.layers for layer in stack for t in layer)]


@dataclass(frozen=True)
class _CacheLayout:
    """Where each encoder cache of a stream lies in its flat row of the cache pool."""

    like: StreamCaches  # the nesting (stacks, layers)
    shapes: tuple[tuple[int, ...], ...]  # per cache tensor, without the batch dimension
    offsets: tuple[int, ...]  # first element of each in the row, then the row's length

    @functools.cached_property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:], strict=False)]

    @classmethod
    def of(cls, caches: StreamCaches) -> _CacheLayout:
        shapes = tuple(tuple(t.shape[1:]) for t in _flatten_caches(caches))
        sizes = [math.prod(s) for s in shapes]
        return cls(caches, shapes, tuple(int(x) for x in np.cumsum([0, *sizes])))

    def pack(self, caches: StreamCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, row) every cache of each stream (one concatenation), and ``processed``."""
        parts = _flatten_caches(caches)
        return torch.cat([t.reshape(t.shape[0], -1) for t in parts], dim=1), caches.processed

    def unpack(self, flat: torch.Tensor, processed: torch.Tensor) -> StreamCaches:
        """:meth:`pack` reversed: views of ``flat`` (B, row), no copies."""
        b = flat.shape[0]
        pieces = flat.split(self.sizes, dim=1)  # one op for all the column ranges
        parts = iter([p.view(b, *s) for p, s in zip(pieces, self.shapes, strict=True)])
        embed = next(parts)
        layers = [[[next(parts) for _ in layer] for layer in stack] for stack in self.like.layers]
        return StreamCaches(embed, layers, processed)


class ZipformerTransducer(_IcefallASR):
    """An icefall Zipformer with a transducer head (registry key ``transducer``)."""

    capabilities = TRANSDUCER_CAPABILITIES
    default_head = "transducer"


class ZipformerCTC(_IcefallASR):
    """An icefall Zipformer with only a CTC head (registry key ``zipformer``)."""

    capabilities = CTC_CAPABILITIES
    default_head = "ctc"


def load_icefall(path: str | Path, config: EngineConfig | None = None, *, epoch: int | None = None,
                 avg: int = 1, iteration: int | None = None,
                 use_averaged_model: bool | None = None) -> _IcefallASR:  # fmt: skip
    """Load an icefall experiment / release directory, or one ``.pt`` file in it.

    ``epoch`` + ``avg`` average ``epoch-(epoch-avg+1).pt .. epoch-epoch.pt`` (``iteration``:
    ``checkpoint-N.pt`` files) as icefall's ``--epoch`` / ``--avg``; with
    ``use_averaged_model`` the running averages of ``epoch-(epoch-avg).pt`` and
    ``epoch-epoch.pt`` give the average instead (icefall's ``--use-averaged-model``). The
    override file (``oasr_icefall.json``) may name them too (``{"epoch": 30, "avg": 9,
    "use_averaged_model": true}``)."""
    config = config or EngineConfig()
    path = Path(path)
    directory = path.parent if path.is_file() else path
    if not directory.is_dir():
        raise CheckpointError(f"{path} does not exist")
    override = read_override(directory) or (read_override(directory.parent) if directory.name == "exp" else {})
    epoch = epoch if epoch is not None else override.get("epoch")
    iteration = iteration if iteration is not None else override.get("iteration")
    avg = int(override.get("avg", avg)) if avg == 1 else avg
    if use_averaged_model is None:
        use_averaged_model = bool(override.get("use_averaged_model", False))
    averaged = None
    if use_averaged_model and not path.is_file() and (epoch is not None or iteration is not None):
        kind, last = ("checkpoint", int(iteration)) if iteration is not None else ("epoch", int(epoch))
        averaged = numbered_pair(path, kind, last - avg, last)
    if averaged:
        files = [averaged[1]]
    elif path.is_file():
        files = [path]
    elif iteration is not None:
        files = numbered(path, "checkpoint", int(iteration), avg)
    elif epoch is not None:
        files = numbered(path, "epoch", int(epoch), avg)
    else:
        found = find_weights_cheap(path)
        if found is None:
            raise CheckpointError(f"{path} has no icefall weights: expected exp/pretrained.pt, "
                                  f"pretrained.pt, epoch-N.pt or checkpoint-N.pt")
        files = [found]
    tokens_path = find_tokens(files[0].parent) or find_tokens(directory)
    if tokens_path is None:
        raise CheckpointError(f"{path} has no tokens: expected tokens.txt or bpe.model beside the weights "
                              f"or in data/lang_bpe_500/")
    state = load_averaged_model(*averaged) if averaged else load_state(files)
    from oasr_models_icefall.conformer import (
        convert_conformer_state,
        infer_conformer_config,
        is_conformer_state,
    )

    if is_conformer_state(state):  # pruned_transducer_stateless2-style reworked Conformer
        cfg = infer_conformer_config(state, override)
        state = convert_conformer_state(state, cfg)
    else:
        cfg = infer_config(state, override)
        state = {k: v for k, v in state.items() if not k.startswith(IGNORED_PREFIXES)}
    net = build_network(cfg, state, config.device, resolve_dtype(config.dtype))
    cls = ZipformerTransducer if cfg.use_transducer else ZipformerCTC
    return cls(net, read_tokens(tokens_path), source_path=path)


def build_network(cfg: Any, state: dict[str, torch.Tensor], device: str = "cpu",
                  dtype: torch.dtype | None = None) -> Any:  # fmt: skip
    """The network of ``cfg`` (a Zipformer or a Conformer) with ``state`` adopted: no random
    init, names and shapes checked."""
    from oasr_models_icefall.conformer import ConformerConfig, ConformerTransducerNet

    with torch.device("meta"):
        net = ConformerTransducerNet(cfg) if isinstance(cfg, ConformerConfig) else IcefallNet(cfg)
    expected = net.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        raise CheckpointError(
            "the state dict does not match the inferred Zipformer "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]}, misshapen {wrong[:5]})")
    net.load_state_dict(state, strict=True, assign=True)
    dtype = dtype or default_dtype(device)
    return net.to(device=device, dtype=dtype).eval()


__all__ = ["IcefallDecoderNetwork", "IcefallStream", "Tokens", "ZipformerCTC", "ZipformerTransducer",
           "build_network", "load_icefall"]
