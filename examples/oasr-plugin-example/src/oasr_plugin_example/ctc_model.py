"""``ExampleCTC``: a tiny streaming CTC recogniser written only against oasr-core.

What each piece reuses from core:

* network: :mod:`oasr_plugin_example.ctc_network`, built from ``oasr.layers``;
* features: the ``kaldi_fbank`` frontend, resolved from core's feature-extractor registry; a
  stream uses its streaming framing (``fbank.stream()``), whose frames equal the offline ones;
* decoding: ``oasr.decoders.ctc``: :class:`CTCGreedySearch` (``beam_size`` 1) or
  :class:`CTCPrefixBeamSearch` (wider), both incremental, so a stream feeds them chunk by chunk
  and offline feeds them the whole utterance; :func:`token_timestamps` and :func:`group_words`
  turn CTC peaks into token, word and segment times;
* options: :class:`~oasr_plugin_example.ctc_options.ExampleCTCOptions` on ``oasr.options``;
* serving: nothing. The engine runs offline requests through its ``BatchExecutor`` (one
  :meth:`ExampleCTC.transcribe` call per batch) and streams through its ``StreamingScheduler``
  (one :meth:`ExampleCTC.stream_step` call per step for every ready stream), because this
  class satisfies the ``ASRModel`` and ``StreamingASRModel`` Protocols of ``oasr.model``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.decoders.ctc import (
    CTCGreedySearch,
    CTCHypothesis,
    CTCPrefixBeamSearch,
    TokenTiming,
    group_words,
    token_timestamps,
)
from oasr.errors import CheckpointError, InvalidRequestError
from oasr.model import ProgressCallback, StreamingUpdate
from oasr.options import ResolvedOptions
from oasr.plugins import resolve
from oasr.types import (
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Segment,
    Transcript,
    Word,
)
from oasr_plugin_example.ctc_checkpoint import CTCConfig, read_config, read_units
from oasr_plugin_example.ctc_network import ExampleCTCNet
from oasr_plugin_example.ctc_options import ExampleCTCOptions
from oasr_plugin_example.plugin import CTC_CAPABILITIES

WORD_START = "\u2581"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip


def model_dtype(name: str, device: str) -> torch.dtype:
    """``EngineConfig.dtype`` as a torch dtype: ``auto`` is float32 on the CPU, float16 on a GPU."""
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.float16
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise InvalidRequestError(
            f"dtype {name!r} is not supported; use auto, float32, float16 or bfloat16", param="dtype"
        ) from None


class Units:
    """The unit table: id -> sentencepiece-style piece (``▁`` starts a word)."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    def piece(self, i: int) -> str:
        return self.pieces[i] if 0 <= i < len(self.pieces) else f"<{i}>"

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.piece(i) for i in ids).replace(WORD_START, " ").strip()


@dataclass
class ExampleCTCStream:
    """One live stream (an :class:`oasr.model.StreamState`): fbank framing, the feature frames
    not yet encoded, per-layer attention and convolution caches, and the incremental search."""

    options: ResolvedOptions
    fbank: Any  # the kaldi_fbank frontend's stream
    search: CTCGreedySearch | CTCPrefixBeamSearch
    window: int  # feature frames one chunk needs
    stride: int  # feature frames between chunk starts
    win_length: int
    hop_length: int
    feats: torch.Tensor  # (n, F) frames received, not yet consumed
    samples_received: int = 0
    frames_consumed: int = 0
    offset: int = 0  # encoder frames produced so far
    k: list[torch.Tensor] = field(default_factory=list)  # per layer (H, Tc, D)
    v: list[torch.Tensor] = field(default_factory=list)
    conv: list[torch.Tensor] = field(default_factory=list)  # per layer (C, kernel - 1)
    finished: bool = False

    @property
    def samples_needed(self) -> int:
        if self.finished:
            return 0
        frames = self.frames_consumed + self.window
        return max(1, self.win_length + (frames - 1) * self.hop_length - self.samples_received)


class ExampleCTC:
    """A loaded ``example_ctc`` checkpoint (see the module docstring)."""

    #: declared once, in the hook module: what ``oasr models`` shows is what this class does
    capabilities: ModelCapabilities = CTC_CAPABILITIES

    def __init__(self, net: ExampleCTCNet, units: Sequence[str], *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, name: str | None = None) -> None:  # fmt: skip
        config = net.config
        if len(units) != config.vocab_size:
            raise CheckpointError(
                f"the unit table has {len(units)} entries but the model has {config.vocab_size} "
                f"outputs; units.txt does not belong to this checkpoint"
            )
        self.config: CTCConfig = config
        self.net = net.to(device, dtype).eval()
        self.units = Units(units)
        self.name = name or f"example_ctc {config.num_layers}x{config.d_model}"
        self.feature_spec = FeatureSpec(
            kind="kaldi_fbank", sample_rate=config.sample_rate, num_bins=config.num_mel_bins,
            hop_length=config.sample_rate // 100, win_length=config.sample_rate // 40, n_fft=512,
            options={"dither": 0.0},
        )  # fmt: skip
        # core's frontend, found by kind like any plugin's would be
        self.fbank = resolve("feature_extractor", self.feature_spec.kind)(self.feature_spec)
        #: the checkpoint's defaults of the per-request options (HasModelOptions)
        self.default_options = ExampleCTCOptions(
            chunk_size=config.chunk_size, num_left_chunks=config.num_left_chunks
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path, config: EngineConfig | None = None) -> ExampleCTC:
        from safetensors.torch import load_file

        path = Path(path)
        cfg = read_config(path)
        units = read_units(path)
        net = ExampleCTCNet(cfg)
        try:
            net.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
        except (RuntimeError, OSError) as exc:
            raise CheckpointError(f"{path}: the weights do not match {cfg}: {exc}") from exc
        config = config or EngineConfig()
        return cls(net, units, device=config.device, dtype=model_dtype(config.dtype, config.device))

    @property
    def device(self) -> torch.device:
        return self.net.ctc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.ctc.weight.dtype

    @property
    def frame_shift(self) -> float:
        """Seconds per encoder frame (40 ms)."""
        return self.net.subsampling_rate * self.feature_spec.hop_length / self.feature_spec.sample_rate

    # -- decoding ------------------------------------------------------------------------------
    def _search(self, options: ResolvedOptions) -> CTCGreedySearch | CTCPrefixBeamSearch:
        blank = self.config.blank_id
        return CTCGreedySearch(blank) if options.beam_size == 1 else CTCPrefixBeamSearch(options.beam_size, blank)

    def _penalised(self, log_probs: torch.Tensor, options: ResolvedOptions) -> torch.Tensor:
        if options.blank_penalty:
            log_probs = log_probs.clone()
            log_probs[..., self.config.blank_id] -= options.blank_penalty
        return log_probs

    @staticmethod
    def _best(search: CTCGreedySearch | CTCPrefixBeamSearch) -> CTCHypothesis:
        return search.result() if isinstance(search, CTCGreedySearch) else search.best()

    def _transcript(self, hyp: CTCHypothesis, duration: float, num_frames: int,
                    options: ResolvedOptions) -> Transcript:  # fmt: skip
        """Text, segments (split where two tokens are more than ``segment_gap`` apart: a pause
        also ends a word) and, when asked, word timestamps, from the hypothesis' CTC peaks."""
        language = self.config.language
        if not hyp.tokens:
            return Transcript(text="", language=language, duration=duration)
        timings = token_timestamps(hyp.tokens, hyp.times, hyp.confidences,
                                   frame_shift=self.frame_shift, num_frames=num_frames)  # fmt: skip
        pieces = [self.units.piece(t) for t in hyp.tokens]
        gap = self.config.segment_gap / self.frame_shift
        pauses = [i for i in range(1, len(pieces)) if hyp.times[i] - hyp.times[i - 1] > gap]
        segments: list[Segment] = []
        for a, b in zip([0, *pauses], [*pauses, len(pieces)], strict=True):
            text = self.units.decode(hyp.tokens[a:b])
            if text:
                segments.append(self._segment(len(segments), text, hyp, a, b, pieces, timings,
                                              duration, options.word_timestamps))  # fmt: skip
        return Transcript(text=" ".join(s.text for s in segments), language=language,
                          duration=duration, segments=segments)  # fmt: skip

    @staticmethod
    def _segment(index: int, text: str, hyp: CTCHypothesis, a: int, b: int, pieces: list[str],
                 timings: list[TokenTiming], duration: float, words: bool) -> Segment:  # fmt: skip
        lps = hyp.token_logprobs[a:b]
        out = Segment(
            id=index, start=min(timings[a].start, duration), end=min(timings[b - 1].end, duration),
            text=text, tokens=list(hyp.tokens[a:b]), avg_logprob=float(sum(lps) / len(lps)),
        )  # fmt: skip
        if words:
            out.words = [Word(w, min(s, duration), min(e, duration), c)
                         for w, s, e, c in group_words(pieces[a:b], timings[a:b])]  # fmt: skip
        return out

    # -- offline (the engine's BatchExecutor calls this once per batch) ----------------------
    def transcribe(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                   progress: ProgressCallback | None = None) -> list[Transcript]:  # fmt: skip
        resolved = options.validate_for(self)
        waves = [as_mono_waveform(a, f"audio #{k}") for k, a in enumerate(audios)]
        rate = self.feature_spec.sample_rate
        out: list[Transcript | None] = [None] * len(waves)
        # shorter than one encoder frame: nothing to recognise
        min_samples = self.fbank.opts.win_length + self.net.right_context * self.fbank.opts.hop_length
        todo = [i for i, w in enumerate(waves) if len(w) >= min_samples]
        for i, w in enumerate(waves):
            if i not in todo:
                out[i] = Transcript(text="", language=self.config.language, duration=len(w) / rate)
        if todo:
            feats, flens = self.fbank.extract([torch.from_numpy(waves[i]) for i in todo])
            with torch.no_grad():
                log_probs, lens = self.net(feats.to(self.device, self.dtype), flens.to(self.device),
                                           resolved.chunk_size, resolved.num_left_chunks)  # fmt: skip
            log_probs = self._penalised(log_probs.cpu(), resolved)
            for row, i in enumerate(todo):
                n = int(lens[row])
                search = self._search(resolved)
                search.step(log_probs[row, :n])
                out[i] = self._transcript(self._best(search), len(waves[i]) / rate, n, resolved)
        if progress is not None:
            total = sum(len(w) for w in waves) / rate
            progress(total, total)
        return [t for t in out if t is not None]

    # -- streaming (the engine's StreamingScheduler calls these) -----------------------------
    def new_stream(self, options: DecodingOptions | None = None) -> ExampleCTCStream:
        resolved = (options or DecodingOptions()).validate_for(self)
        sub = self.net.subsampling_rate
        opts = self.fbank.opts
        layers = len(self.net.blocks)
        return ExampleCTCStream(
            options=resolved, fbank=self.fbank.stream(), search=self._search(resolved),
            window=(resolved.chunk_size - 1) * sub + self.net.right_context + 1,
            stride=resolved.chunk_size * sub, win_length=opts.win_length, hop_length=opts.hop_length,
            feats=torch.zeros(0, self.fbank.dim),
            k=[torch.zeros(0)] * layers, v=[torch.zeros(0)] * layers, conv=[torch.zeros(0)] * layers,
        )  # fmt: skip

    def _windows(self, st: ExampleCTCStream, last: bool) -> list[torch.Tensor]:
        """The chunks of feature frames ``st`` can encode now; on its last call, the tail too
        (when it still makes at least one encoder frame)."""
        out = []
        while st.feats.shape[0] >= st.window:
            out.append(st.feats[: st.window])
            st.feats = st.feats[st.stride :]
            st.frames_consumed += st.stride
        if last:
            if st.feats.shape[0] > self.net.right_context:
                out.append(st.feats)
            st.feats = st.feats[:0]
        return out

    def stream_step(self, states: Sequence[ExampleCTCStream], chunks: Sequence[np.ndarray],
                    is_last: Sequence[bool]) -> list[StreamingUpdate]:  # fmt: skip
        if not len(states) == len(chunks) == len(is_last):
            raise InvalidRequestError("states, chunks and is_last must have the same length")
        pending = []
        for k, (st, chunk, last) in enumerate(zip(states, chunks, is_last, strict=True)):
            if st.finished:
                raise InvalidRequestError("this stream already finished; start a new one")
            audio = as_mono_waveform(np.zeros(0, np.float32) if chunk is None else chunk, f"chunk #{k}")
            if audio.size:
                st.samples_received += audio.size
                st.feats = torch.cat([st.feats, st.fbank.accept(torch.from_numpy(audio)).cpu()])
            pending.append(self._windows(st, bool(last)))
        # one batched network call per round: round r encodes the r-th ready chunk of each stream
        for r in range(max((len(p) for p in pending), default=0)):
            rows = [i for i, p in enumerate(pending) if len(p) > r]
            self._encode([states[i] for i in rows], [pending[i][r] for i in rows])
        updates = []
        for st, last in zip(states, is_last, strict=True):
            hyp = self._best(st.search)
            if last:
                st.finished = True
                st.k, st.v, st.conv = [], [], []  # free the caches now
                rate = self.feature_spec.sample_rate
                tr = self._transcript(hyp, st.samples_received / rate, st.offset, st.options)
                updates.append(StreamingUpdate(text=tr.text, is_final=True, transcript=tr))
            else:
                updates.append(StreamingUpdate(text=self.units.decode(hyp.tokens), is_final=False))
        return updates

    def _encode(self, states: list[ExampleCTCStream], windows: list[torch.Tensor]) -> None:
        """Encode one chunk of each stream in one batch and advance its caches and search."""
        dev = self.device
        b = len(states)
        feats = torch.zeros(b, max(w.shape[0] for w in windows), self.fbank.dim)
        for i, w in enumerate(windows):
            feats[i, : w.shape[0]] = w
        flens = torch.tensor([w.shape[0] for w in windows])
        cache_lengths = [st.k[0].shape[1] if st.k[0].dim() == 3 else 0 for st in states]
        tc = max(cache_lengths)
        caches = self.net.empty_caches(b, tc)
        for layer, cache in enumerate(caches):
            for i, st in enumerate(states):
                if cache_lengths[i]:
                    cache.k[i, :, : cache_lengths[i]] = st.k[layer]
                    cache.v[i, :, : cache_lengths[i]] = st.v[layer]
                if st.conv[layer].dim() == 2:
                    cache.conv[i] = st.conv[layer]
        offsets = torch.tensor([st.offset for st in states], device=dev)
        with torch.no_grad():
            log_probs, lens, new = self.net.forward_chunk(
                feats.to(dev, self.dtype), flens.to(dev), offsets, caches,
                torch.tensor(cache_lengths, device=dev),
            )
        log_probs = log_probs.cpu()
        for i, st in enumerate(states):
            n, c = int(lens[i]), cache_lengths[i]
            o = st.options
            keep = None if o.num_left_chunks < 0 else o.chunk_size * o.num_left_chunks
            for layer, cache in enumerate(new):
                # row i's valid keys: its cached ones, then this chunk's frames
                k = torch.cat([cache.k[i, :, :c], cache.k[i, :, tc : tc + n]], dim=1)
                v = torch.cat([cache.v[i, :, :c], cache.v[i, :, tc : tc + n]], dim=1)
                if keep is not None:
                    k, v = k[:, k.shape[1] - min(keep, k.shape[1]) :], v[:, v.shape[1] - min(keep, v.shape[1]) :]
                st.k[layer], st.v[layer], st.conv[layer] = k, v, cache.conv[i]
            st.offset += n
            st.search.step(self._penalised(log_probs[i, :n], o))


__all__ = ["ExampleCTC", "ExampleCTCStream", "Units"]
