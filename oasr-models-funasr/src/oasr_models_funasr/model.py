"""``ParaformerASR``: FunASR Paraformer / BiCifParaformer / SeacoParaformer as an OASR
:class:`~oasr.model.ASRModel`.

One non-autoregressive pass per batch: FunASR fbank + LFR + CMVN (core frontend, the release's
``am.mvn``) -> SANM encoder -> CIF predictor (token count and acoustic embeddings,
:mod:`oasr.decoders.cif`) -> SANM decoder -> argmax per token. The engine's batch executor hands
``transcribe`` one length-bucketed batch at a time; rows are padded and masked so that a row's
result does not depend on its batch.

Timestamps (``word_timestamps=True``) follow FunASR: Paraformer's from the CIF fires of the
predictor, BiCif's and SeACo's from their upsampled timestamp predictor; CJK characters are words,
``@@`` pieces are joined into words (:mod:`oasr_models_funasr.text`).

Hotwords (SeACo checkpoints only; the others refuse them): FunASR's bias path, see
:meth:`ParaformerASR._bias`.

Long inputs (longer than ``max_segment_s``, by default; ``long_form="vad"`` for every input) are
cut at the speech segments the core's VAD finds (Silero), each segment at most
``max_segment_s`` long, and all segments of all inputs of the batch run as one batch; each
segment becomes one :class:`~oasr.types.Segment` with its own times.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.decoders.cif import add_tail, cif_cumsum, cif_fires, cif_loop, cif_timestamps
from oasr.errors import CheckpointError
from oasr.features.batching import padded_batch
from oasr.features.funasr import FunASRFbankLFR
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
from oasr_models_funasr.checkpoints import ParaformerConfig, load_release
from oasr_models_funasr.graphs import (
    ParaformerGraphs,
    decode_tokens,
    encode_predict,
    graphs_enabled,
)
from oasr_models_funasr.nn import ParaformerNet
from oasr_models_funasr.options import ParaformerOptions
from oasr_models_funasr.plugin import CAPABILITIES
from oasr_models_funasr.text import postprocess


@dataclass
class Decoded:
    """One decoded piece of audio: tokens (ids and strings, specials filtered as FunASR does),
    token log-probabilities and, when asked, token times in ms from the piece's start."""

    ids: list[int]
    tokens: list[str]
    logprobs: list[float]
    times: list[tuple[int, int]] | None = None


def frontend_spec(fc: dict[str, Any]) -> FeatureSpec:
    """The core FunASR frontend spec of a release's ``frontend_conf`` (dither forced to 0)."""
    fs = int(fc.get("fs", 16000))
    frame_length = float(fc.get("frame_length", 25))
    frame_shift = float(fc.get("frame_shift", 10))
    return FeatureSpec(
        kind="funasr_fbank_lfr",
        sample_rate=fs,
        num_bins=int(fc.get("n_mels", 80)),
        hop_length=int(fs * frame_shift / 1000),
        win_length=int(fs * frame_length / 1000),
        n_fft=512,
        options={
            "lfr_m": int(fc.get("lfr_m", 1)),
            "lfr_n": int(fc.get("lfr_n", 1)),
            "window_type": str(fc.get("window", "hamming")),
            "snip_edges": bool(fc.get("snip_edges", True)),
            "upscale": bool(fc.get("upsacle_samples", True)),
            "frame_length_ms": frame_length,
            "frame_shift_ms": frame_shift,
            "dither": 0.0,
        },
    )


class ParaformerASR:
    """A loaded Paraformer, BiCifParaformer or SeacoParaformer."""

    capabilities: ModelCapabilities = CAPABILITIES

    def __init__(
        self,
        net: ParaformerNet,
        cfg: ParaformerConfig,
        tokens: Sequence[str],
        *,
        cmvn: np.ndarray | None = None,
        name: str = "paraformer",
        source_path: Path | None = None,
        seg_dict: dict[str, str] | None = None,
    ) -> None:
        if len(tokens) != cfg.vocab_size or net.vocab_size != cfg.vocab_size:
            raise CheckpointError(
                f"the token list has {len(tokens)} entries but the model has {net.vocab_size} outputs"
            )
        self.net = net
        self.config = cfg
        self.tokens = list(tokens)
        self.token_ids = {t: i for i, t in enumerate(self.tokens)}
        self.seg_dict = seg_dict
        # only SeACo-Paraformer checkpoints can bias towards hotwords
        self.capabilities = replace(CAPABILITIES, hotwords=cfg.seaco is not None)
        #: SeACo: hotwords kept after the attention filter when there are more
        self.hotword_filter = 50
        #: the transcripts' language: "zh" for a CJK token list, else "en"
        self.language = self._token_language()
        #: VAD pieces of long inputs are decoded in batches of at most this many (or of as many
        #: as the inputs of the call, when more): ``EngineConfig.max_batch_size``
        self.max_batch_size = 16
        self.name = name
        self.source_format = "funasr"
        self.source_path = source_path
        self.feature_spec = frontend_spec(cfg.frontend)
        self.frontend = FunASRFbankLFR(self.feature_spec, cmvn=cmvn)
        if self.frontend.dim != cfg.encoder.input_size:
            raise CheckpointError(
                f"frontend features have {self.frontend.dim} dims but the encoder takes {cfg.encoder.input_size}"
            )
        self.default_options = ParaformerOptions()
        #: on CUDA the encoder + predictor and the decoder replay CUDA graphs at bucketed shapes
        #: (:mod:`oasr_models_funasr.graphs`), captured lazily in the thread that calls the model;
        #: on by default (``OASR_FUNASR_GRAPHS=0`` or False here: eager); no effect on the CPU
        self.cuda_graphs = graphs_enabled()
        self._graphs: ParaformerGraphs | None = None
        lfr_n = int(self.feature_spec.options["lfr_n"])
        #: seconds per encoder frame (one LFR frame: 60 ms for lfr_n 6)
        self.frame_shift = lfr_n * self.feature_spec.hop_length / self.feature_spec.sample_rate

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_release(cls, path: str | Path, config: EngineConfig | None = None) -> ParaformerASR:
        from oasr.features.funasr import load_am_mvn

        config = config or EngineConfig()
        cfg, state, tokens, cmvn_path = load_release(Path(path))
        net = build_network(cfg, state, config.device, resolve_dtype(config.dtype))
        cmvn = load_am_mvn(cmvn_path) if cmvn_path is not None else None
        e = cfg.encoder
        name = f"funasr {cfg.model} {e.num_blocks}x{e.output_size}"
        seg = Path(path) / "seg_dict"
        seg_dict = read_seg_dict(seg) if cfg.seaco is not None and seg.is_file() else None
        model = cls(
            net, cfg, tokens, cmvn=cmvn, name=name, source_path=Path(path), seg_dict=seg_dict
        )
        model.max_batch_size = config.max_batch_size
        return model

    @classmethod
    def from_native(
        cls,
        path: str | Path,
        body: dict[str, Any] | None = None,
        config: EngineConfig | None = None,
    ) -> ParaformerASR:
        """Load OASR's native format (``oasr convert`` of a FunASR release)."""
        from safetensors.torch import load_file

        from oasr.checkpoint import read_native_config
        from oasr_models_funasr.checkpoints import parse_config

        path = Path(path)
        body = body or read_native_config(path)
        config = config or EngineConfig()
        try:
            tokens = list(body["tokens"])
            cfg = parse_config(body["funasr_config"], len(tokens), name=f"{path}/oasr_model.json")
            cmvn = None if body.get("cmvn") is None else np.asarray(body["cmvn"], dtype=np.float32)
            seg_dict = body.get("seg_dict")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: incomplete oasr_model.json ({exc})") from exc
        try:
            state = load_file(str(path / "model.safetensors"))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types
            raise CheckpointError(f"cannot read {path / 'model.safetensors'}: {exc}") from exc
        net = build_network(cfg, state, config.device, resolve_dtype(config.dtype))
        e = cfg.encoder
        model = cls(net, cfg, tokens, cmvn=cmvn, name=f"funasr {cfg.model} {e.num_blocks}x{e.output_size}",
                    source_path=path, seg_dict=seg_dict)  # fmt: skip
        model.source_format = "oasr"
        model.max_batch_size = config.max_batch_size
        model.default_options = model.default_options.with_saved(body.get("decoding"))
        return model

    def save_native(self, dst: str | Path) -> str:
        """Write OASR's native format: ``model.safetensors`` (FunASR's parameter names, float32)
        and ``oasr_model.json`` (the release's config.yaml, tokens, CMVN, seg_dict). Returns
        ``"paraformer"``."""
        from safetensors.torch import save_file

        from oasr.checkpoint import write_native_config
        from oasr_models_funasr.plugin import ARCHITECTURE

        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        state = {
            k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in self.net.state_dict().items()
        }
        save_file(state, str(dst / "model.safetensors"))
        write_native_config(dst, ARCHITECTURE, {
            "funasr_config": self.config.raw,
            "tokens": self.tokens,
            "cmvn": None if self.frontend.cmvn_np is None else self.frontend.cmvn_np.tolist(),
            "seg_dict": self.seg_dict,
            "source_format": self.source_format,
            "tokenizer": {"kind": "funasr_tokens"},
        }, feature_spec=self.feature_spec, decoding=self.default_options)  # fmt: skip
        return ARCHITECTURE

    def hotword_ids(self, hotwords: Sequence[str]) -> list[list[int]]:
        """FunASR's SeACo hotword list: every whitespace-separated word of ``hotwords`` is one
        hotword, tokenised with the release's ``seg_dict`` (else CJK characters one by one, else
        ``<unk>``) as FunASR's ``generate_hotwords_list`` does; a final ``[<s>]`` entry is the
        no-bias hotword."""
        unk = self.token_ids.get(self.config.unk_symbol, len(self.tokens) - 1)
        out: list[list[int]] = []
        for word in " ".join(hotwords).split():
            pieces = [word]
            if self.seg_dict is not None:
                pieces = _seg_tokenize(pieces, self.seg_dict)
            out.append([self.token_ids.get(p, unk) for p in pieces])
        out.append([self.config.sos])
        return out

    @property
    def device(self) -> torch.device:
        return self.net.device

    def _cuda_graphs(self) -> ParaformerGraphs | None:
        """The encoder / decoder graphs on CUDA (``cuda_graphs`` True), else None."""
        if not self.cuda_graphs:
            return None
        if self._graphs is None:
            if self.net.device.type != "cuda":
                return None
            self._graphs = ParaformerGraphs(self.net)
        return self._graphs

    # ------------------------------------------------------------------ features and network
    def features(self, waves: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """LFR + CMVN features (B, T, D) float32 on the model's device, and their lengths."""
        batch, lens = padded_batch(waves, self.device)
        return self.frontend.extract(batch, lens)

    @torch.no_grad()
    def encode(self, feats: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Encoder output (B, T, d) float32, zero past each length."""
        return self.net.encoder(feats.to(self.net.dtype), lens).float()

    @torch.no_grad()
    def encode_and_predict(
        self, feats: torch.Tensor, lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encoder output (B, T, d) in the model's dtype and in float32, the CIF predictor's
        convolution (B, d, T) and weights (B, T) (float32); from CUDA graphs when on."""
        graphs = self._cuda_graphs()
        if graphs is not None:
            return graphs.encode_predict(feats, lens)
        return encode_predict(self.net, feats.to(self.net.dtype), lens)

    @torch.no_grad()
    def decode_batch(
        self,
        waves: Sequence[np.ndarray],
        timestamps: bool,
        hotwords: list[list[int]] | None = None,
    ) -> list[Decoded]:
        """One non-autoregressive pass over a batch of waveforms; ``hotwords`` (token ids, the
        last one ``[<s>]``) bias a SeACo model."""
        feats, flens = self.features(waves)
        net, cfg = self.net, self.config
        pc = cfg.predictor
        graphs = self._cuda_graphs()
        enc_h, enc, conv, alphas = self.encode_and_predict(feats, flens)
        if pc.tail_threshold > 0:
            # the tail weight goes right after each row's last frame: what FunASR does for an
            # input decoded alone (with or without its tail_mask), whatever the padding
            hidden, alphas_t, token_num = add_tail(enc, alphas, flens, pc.tail_threshold)
        else:
            hidden, alphas_t, token_num = enc, alphas, alphas.sum(-1)
        if pc.kind == "CifPredictorV3":
            embeds, fires = cif_loop(hidden, alphas_t, pc.threshold)
        else:
            embeds, fires = cif_cumsum(hidden, alphas_t)
        ntok = token_num.round().long()
        b = len(waves)
        most = int(ntok.max()) if b else 0  # the one size the host needs before the decoder
        if pc.tail_threshold > 0:
            embeds = embeds[:, :most]  # token_num is whole there: its max is ntok's
        if b == 0 or most < 1:
            return [Decoded([], [], [], [] if timestamps else None) for _ in range(b)]
        embeds_h = embeds.to(net.dtype)
        if graphs is not None and not hotwords:
            best, ids = graphs.decode(enc_h, flens, embeds_h, ntok)
        else:
            # SeACo hotwords rewrite the decoder's log-probabilities from its hidden states
            bias = (
                (lambda logp, hidden: self._bias(logp, embeds_h, hidden, ntok, hotwords))
                if hotwords
                else None
            )
            best, ids = decode_tokens(net, enc_h, flens, embeds_h, ntok, bias)
        us_alphas = us_fires = fires_h = alphas_h = None
        if timestamps and pc.kind == "CifPredictorV3":
            us_alphas = net.predictor.upsampled_alphas(enc, conv, flens, ntok).float().cpu()
            us_fires = cif_fires(us_alphas.numpy(), float(pc.threshold - 1e-4))
        elif timestamps:
            # one read-back each for the whole batch (per row they were two waits per input)
            fires_h, alphas_h = fires.float().cpu(), alphas_t.float().cpu()
        # two read-backs for everything the host needs (one per dtype)
        n = ids.shape[1]
        ints = torch.cat([ids, ntok[:, None], flens[:, None].long()], dim=1).cpu()
        ids_l = ints[:, :n].tolist()
        ntok_l, flens_l = ints[:, n].tolist(), ints[:, n + 1].tolist()
        best_l = best.cpu().tolist()
        out = []
        drop = {cfg.blank_id, cfg.sos, cfg.eos}
        for i in range(b):
            row = [
                (t, s)
                for t, s in zip(ids_l[i][: ntok_l[i]], best_l[i][: ntok_l[i]], strict=True)
                if t not in drop
            ]
            tids = [t for t, _ in row]
            toks = [self.tokens[t] for t in tids]
            d = Decoded(tids, toks, [s for _, s in row])
            if timestamps:
                if pc.kind == "CifPredictorV3":
                    n = flens_l[i] * pc.upsample_times
                    ua = us_alphas[i, :n]
                    uf = torch.from_numpy(us_fires[i, :n])
                    ts = cif_timestamps(
                        ua,
                        uf,
                        toks,
                        upsample_rate=pc.upsample_times,
                        frame_ms=self.frame_shift * 1000,
                    )
                else:
                    # FunASR passes the CIF fires as the weights and the alphas as the fires
                    n = flens_l[i] + (1 if pc.tail_threshold > 0 else 0)
                    n = min(n, fires_h.shape[1], alphas_h.shape[1])
                    ts = cif_timestamps(
                        fires_h[i, :n],
                        alphas_h[i, :n],
                        toks,
                        upsample_rate=1,
                        frame_ms=self.frame_shift * 1000,
                    )
                d.times = ts.tokens
            out.append(d)
        return out

    def _bias(
        self,
        logp: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        ntok: torch.Tensor,
        hotwords: list[list[int]],
    ) -> torch.Tensor:
        """SeACo: the bias decoder attends from the CIF embeddings and from the decoder's
        hidden states over the hotwords; where its output layer does not pick ``NO_BIAS``, its
        distribution replaces the decoder's (FunASR's merge with seaco_weight 1)."""
        net = self.net
        states = net.hotword_states(hotwords)  # (H, inner)
        b, h = logp.shape[0], states.shape[0]
        ctx = states[None].expand(b, -1, -1)
        k = self.hotword_filter
        if 0 < k < h:
            # FunASR keeps the hotwords the bias decoder's 6th layer attends to most (summed
            # over heads and tokens), plus the no-bias entry; per input, as FunASR decides it
            # for an input decoded alone
            rows = []
            for r in range(b):
                n = int(ntok[r])
                w = net.seaco_decoder.cross_attention_weights(
                    states[None],
                    torch.tensor([h], device=states.device),
                    hidden[r : r + 1, :n],
                    ntok[r : r + 1],
                    layer=5,
                )
                keep = torch.topk(w[0].sum(0).sum(0), min(k, h - 1))[1].tolist() + [h - 1]
                rows.append(states[keep])
            ctx = torch.stack(rows)
        ctx_lens = torch.full((b,), ctx.shape[1], device=ctx.device)
        _, cif_att = net.seaco_decoder(ctx, ctx_lens, embeds, ntok)
        _, dec_att = net.seaco_decoder(ctx, ctx_lens, hidden, ntok)
        dha = torch.log_softmax(net.hotword_output_layer(cif_att + dec_att).float(), dim=-1)
        keep_decoder = (dha.argmax(-1) == self.config.seaco.no_bias)[..., None]
        return torch.where(keep_decoder, logp, dha)

    # ------------------------------------------------------------------ requests
    def _check(self, options: DecodingOptions | ResolvedOptions) -> ResolvedOptions:
        return options.validate_for(self)

    def transcribe(
        self,
        audios: Sequence[np.ndarray],
        options: DecodingOptions,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        options = self._check(options)
        sr = self.feature_spec.sample_rate
        waves = [as_mono_waveform(a, f"audio #{k}") for k, a in enumerate(audios)]
        if not waves:
            return []
        # pieces: (input index, start sample, waveform)
        pieces: list[tuple[int, int, np.ndarray]] = []
        max_len = int(options.max_segment_s * sr)
        for i, w in enumerate(waves):
            use_vad = options.long_form == "vad" or (
                options.long_form == "auto" and len(w) > max_len
            )
            if use_vad:
                for s, e in self._speech_spans(w, options):
                    pieces.append((i, s, w[s:e]))
            else:
                pieces.append((i, 0, w))
        pieces = [p for p in pieces if len(p[2]) >= self.feature_spec.win_length]
        decoded: list[Decoded | None] = [None] * len(pieces)
        if pieces:
            hw = self.hotword_ids(options.hotwords) if options.hotwords else None
            # the inputs are one batch (the engine bounds and buckets it); VAD pieces of long
            # inputs are more: they run longest first, in batches of at least as many
            size = max(self.max_batch_size, len(waves))
            order = sorted(range(len(pieces)), key=lambda k: -len(pieces[k][2]))
            for c in range(0, len(order), size):
                idx = order[c : c + size]
                outs = self.decode_batch([pieces[k][2] for k in idx], options.word_timestamps, hw)
                for k, d in zip(idx, outs, strict=True):
                    decoded[k] = d
        per_input: list[list[tuple[int, np.ndarray, Decoded]]] = [[] for _ in waves]
        for (i, start, w), d in zip(pieces, decoded, strict=True):
            assert d is not None
            per_input[i].append((start, w, d))
        if progress is not None:
            total = sum(len(w) for w in waves) / sr
            progress(total, total)
        return [
            self._transcript(parts, len(w) / sr, options)
            for parts, w in zip(per_input, waves, strict=True)
        ]

    def _speech_spans(self, wave: np.ndarray, options: ResolvedOptions) -> list[tuple[int, int]]:
        from oasr.vad import SegmentationOptions, get_speech_segments

        sr = self.feature_spec.sample_rate
        seg_opts = SegmentationOptions(max_speech_s=options.max_segment_s)
        return [(s.start, s.end) for s in get_speech_segments(wave, sr, options=seg_opts)]

    def _token_language(self) -> str | None:
        """'zh' when most tokens are CJK characters, else 'en' (a monolingual release)."""
        from oasr_models_funasr.text import _is_cjk

        body = [t for t in self.tokens if t and not t.startswith("<")]
        if not body:
            return None
        cjk = sum(1 for t in body if _is_cjk(t) and not t.isdigit())
        return "zh" if cjk > 0.5 * len(body) else "en"

    def _transcript(
        self,
        parts: list[tuple[int, np.ndarray, Decoded]],
        duration: float,
        options: ResolvedOptions,
    ) -> Transcript:
        sr = self.feature_spec.sample_rate
        segments: list[Segment] = []
        texts: list[str] = []
        for start, w, d in parts:
            text, words, spans = postprocess(d.tokens, d.times if options.word_timestamps else None)
            if not text:
                continue
            off = start / sr
            # (math.fsum: numpy's mean of a short list costs ~20x more, per row)
            avg = math.fsum(d.logprobs) / len(d.logprobs) if d.logprobs else 0.0
            seg_words: list[Word] = []
            if options.word_timestamps and len(words) == len(spans):
                conf = math.exp(avg) if d.logprobs else 0.0
                seg_words = [
                    Word(word, round(off + s / 1000.0, 3), round(off + e / 1000.0, 3), conf)
                    for word, (s, e) in zip(words, spans, strict=True)
                ]
            segments.append(
                Segment(
                    id=len(segments),
                    start=round(off, 3),
                    end=round(off + len(w) / sr, 3),
                    text=text,
                    tokens=list(d.ids),
                    words=seg_words,
                    avg_logprob=avg,
                )
            )
            texts.append(text)
        sep = "" if self.language == "zh" else " "
        return Transcript(
            text=sep.join(texts).strip(),
            language=self.language,
            duration=duration,
            segments=segments,
        )


def read_seg_dict(path: Path) -> dict[str, str]:
    """``seg_dict``: ``word piece piece ...`` per line -> {word: "piece piece ..."}."""
    out: dict[str, str] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    for line in lines:
        parts = line.strip().split()
        if parts:
            out[parts[0]] = " ".join(parts[1:])
    return out


_CJK_OR_DIGITS = re.compile(r"^[\u4E00-\u9FA50-9]+$")


def _seg_tokenize(words: list[str], seg_dict: dict[str, str]) -> list[str]:
    """FunASR's hotword ``seg_tokenize``: a word in the dictionary gives its pieces; a word of
    CJK characters / digits gives each character's pieces (``<unk>`` for unknown ones); any
    other word is ``<unk>``."""
    out: list[str] = []
    for word in words:
        word = word.lower()
        if word in seg_dict:
            out += seg_dict[word].split()
        elif _CJK_OR_DIGITS.match(word):
            out += [
                p for ch in word for p in (seg_dict[ch].split() if ch in seg_dict else ["<unk>"])
            ]
        else:
            out.append("<unk>")
    return out


def build_network(
    cfg: ParaformerConfig,
    state: dict[str, torch.Tensor],
    device: str | torch.device,
    dtype: torch.dtype | None,
) -> ParaformerNet:
    """The network with the release's weights (strict: missing / misshapen tensors are listed;
    the CTC head some releases carry is ignored)."""
    with torch.device("meta"):
        net = ParaformerNet(cfg.encoder, cfg.decoder, cfg.predictor, cfg.vocab_size, cfg.seaco)
    expected = {k: v.shape for k, v in net.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.startswith("ctc.")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    bad = sorted(
        k for k in set(expected) & set(state) if tuple(state[k].shape) != tuple(expected[k])
    )
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if bad:
            parts.append(
                "misshapen "
                + ", ".join(f"{k} {tuple(state[k].shape)} != {tuple(expected[k])}" for k in bad[:5])
            )
        raise CheckpointError("model.pt does not match config.yaml: " + "; ".join(parts))
    if dtype is None:
        dtype = torch.float16 if str(device).startswith("cuda") else torch.float32
    # a copy in memory (the state dict is memory-mapped from model.pt)
    net.load_state_dict({k: v.to(dtype, copy=True) for k, v in state.items()}, assign=True)
    net.predictor.float()  # the predictor and CIF run in float32, as in FunASR (autocast off)
    return net.to(device).eval()


__all__ = ["Decoded", "ParaformerASR", "build_network", "frontend_spec"]
