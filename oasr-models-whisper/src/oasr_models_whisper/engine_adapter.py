"""Whisper on the core's continuous-batching executor (:mod:`oasr.executors.autoregressive`).

Whisper supplies the two halves that executor asks a family for:

* :class:`WhisperStepModel`: the audio encoder, the cross-attention K/V projection, and one
  decoder forward over the executor's paged self-attention cache (on CUDA with the three
  self-attention projections fused into one GEMM per layer);
* :class:`WhisperDriver`: a request is a sequence of 30-second windows. It runs the VAD gate for
  the requests admitted together, skips silent windows, detects the language, builds each
  window's initial tokens (the previous text as prompt), applies the timestamp rules, and when a
  window ends runs the same temperature-fallback and seeking code as the per-batch path
  (:func:`oasr_models_whisper.transcribe._advance`), then queues the next window or finishes.

Greedy decoding (any temperature schedule whose first temperature is 0 and whose windows do not
fall back) gives the same tokens as ``WhisperASR.transcribe``: same filters (suppress blank,
suppress tokens, timestamp rules: :func:`~oasr_models_whisper.decoding.apply_timestamp_rules`,
shared with the per-batch search), same float32 log-probability sums, same seeking. Beam search
(``beam_size > 1``) and VAD-batched long-form (``long_form="vad"``) run on the executor's batch
path (``WhisperASR.transcribe``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oasr.audio import as_mono_waveform
from oasr.executors.autoregressive import AttentionContext, AutoregressiveExecutor, Row, Window
from oasr.features.whisper import HOP_LENGTH, N_FRAMES, N_SAMPLES, SAMPLE_RATE, log_mel_spectrogram
from oasr.layers.fused import add_norm
from oasr.types import DecodingOptions, Transcript
from oasr_models_whisper.decoding import (
    CHUNK_SECONDS,
    NO_MAX_INITIAL,
    WindowResult,
    apply_timestamp_rules,
    compression_ratio,
    detect_language,
    initial_tokens,
    resolve_suppress_tokens,
)
from oasr_models_whisper.nn import decoder_norms
from oasr_models_whisper.options import whisper_options
from oasr_models_whisper.speech_gate import GateScan, empty_transcript, gate_detector, gate_enabled
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

__all__ = ["WhisperDriver", "WhisperStepModel", "batched_whole_log_mels", "make_executor"]

log = logging.getLogger(__name__)

#: seconds of audio the VAD gate scans per scheduler step, summed over the requests being
#: gated, when ``SchedulerConfig.gate_seconds_per_step`` is None: on the CPU Silero scans about
#: 500 s of audio per second, so 30 s is ~60 ms of a step; on CUDA one batched forward of a
#: full batch of 30 s inputs (64 x 30 s) still fits one step
GATE_SECONDS_CPU = 30.0
GATE_SECONDS_CUDA = 3600.0


def make_executor(model: Any, config: SchedulerConfig) -> AutoregressiveExecutor | None:
    from oasr_models_whisper.nn import WhisperNet

    if not isinstance(getattr(model, "network", None), WhisperNet):
        return None
    if model.network.device.type == "cpu" and config.max_encoder_batch is None:
        # one window per encoder call on CPU: its matrices (1500 frames) keep both cores busy
        # already, so a batch saves no time there, only holds every window's activations at
        # once (tiny.en, 9 inputs: 1.37 GB peak instead of 1.03 GB)
        config = dataclasses.replace(config, max_encoder_batch=1)
    from oasr_models_whisper.encoder_graphs import encoder_graphs_enabled

    # the encoder from CUDA graphs only on request (OASR_ENCODER_GRAPHS=1): on the H200 the
    # large-v3 encoder is GPU-bound already (batch 8: 0.99x eager), so capturing costs memory
    # and capture time for no gain there
    graphs = config.cuda_graphs is not False and model.network.device.type == "cuda" and encoder_graphs_enabled()
    step = WhisperStepModel(model.network, encoder_graphs=graphs)
    return AutoregressiveExecutor(model, step, WhisperDriver(model), config)


def batched_whole_log_mels(waves: list[torch.Tensor], n_mels: int, device: torch.device) -> list[torch.Tensor]:
    """:func:`whole_log_mel` of each of ``waves`` (each at most ``LONG_AUDIO_SAMPLES``) from one
    batched STFT on ``device``: the waves are zero-padded to the longest, and each log-mel is cut
    to its own frames. The values are those of one recording at a time: a frame sees the same
    samples (the padding continues the 30 s of silence every recording gets), the extra frames
    of a shorter recording are silence, whose log-mel (-10 before normalisation) never raises
    its peak, and the peak is taken per recording."""
    n = max(w.shape[0] for w in waves)
    host = torch.empty((len(waves), n), dtype=torch.float32, pin_memory=device.type == "cuda")
    for row, w in zip(host, waves, strict=True):
        row[: w.shape[0]].copy_(w)
        row[w.shape[0] :].zero_()
    mels = log_mel_spectrogram(host.to(device, non_blocking=True), n_mels, padding=N_SAMPLES)
    # whole_log_mel gives (samples + N_SAMPLES) // HOP_LENGTH frames (the last STFT frame dropped)
    return [mel[:, : (w.shape[0] + N_SAMPLES) // HOP_LENGTH] for mel, w in zip(mels, waves, strict=True)]


# --------------------------------------------------------------------------- the network
class WhisperStepModel:
    """:class:`oasr.executors.autoregressive.StepModel` over a :class:`WhisperNet`."""

    def __init__(self, net: Any, encoder_graphs: bool = False) -> None:
        self.net = net
        dims = net.dims
        #: the encoder from CUDA graphs per batch bucket (encoder_graphs.py; CUDA only)
        self.encoder_graphs = None
        if encoder_graphs and net.device.type == "cuda":
            from oasr_models_whisper.encoder_graphs import EncoderGraphs

            self.encoder_graphs = EncoderGraphs(net)
        self.device = net.device
        self.dtype = net.dtype
        self.num_layers = dims.n_text_layer
        self.num_kv_heads = dims.n_text_head
        self.head_dim = dims.n_text_state // dims.n_text_head
        self.max_positions = dims.n_text_ctx
        self.vocab_size = dims.n_vocab
        self.cross_shape = (dims.n_audio_ctx, dims.n_text_state)
        self.cross_heads = dims.n_text_head
        self._fused_qkv = self._fuse_self_qkv() if self.device.type == "cuda" else None
        #: the same for W8A8 layers: one QuantizedLinear of the three's weights and scales
        self._fused_qkv_quant = (self._fuse_self_qkv_quantized()
                                 if self.device.type == "cuda" and self._fused_qkv is None else None)  # fmt: skip
        self._norms = decoder_norms(net.decoder)
        esize = torch.empty(0, dtype=self.dtype).element_size()
        #: memory beyond the executor's pools (the fused projection weights, the fp8 layers'
        #: dense copies)
        self.extra_bytes = self._keep_dense_decode_weights() if self.device.type == "cuda" else 0
        self.extra_bytes += sum(w.numel() * esize for w, _ in self._fused_qkv or ())
        self.extra_bytes += sum(sum(t.numel() * t.element_size() for t in q.buffers())
                                for q in self._fused_qkv_quant or ())  # fmt: skip

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

    def _fuse_self_qkv_quantized(self) -> list[Any] | None:
        """:meth:`_fuse_self_qkv` for W8A8 projections (:class:`~oasr.layers.quantized.
        QuantizedLinear`, one activation term, no SmoothQuant divisor): the weights (N, K)
        and their per-output-channel scales concatenated. The activations' per-token scales
        come from the same ``h`` and each output channel keeps its own scale, so it is the same
        math in one quantization and one GEMM instead of three of each. ``OASR_FP8_FUSED_QUANT=0``
        keeps the three calls (the path before, for an A/B)."""
        import os

        from oasr.layers.quantized import QuantizedLinear

        if os.environ.get("OASR_FP8_FUSED_QUANT") == "0":
            return None
        fused = []
        for block in self.net.decoder.layers:
            att = block.self_attn
            projs = (att.q_proj, att.k_proj, att.v_proj)
            if any(type(p) is not QuantizedLinear or p.act_terms != 1 or p.input_scale is not None
                   or p.method != projs[0].method or p.compute_dtype != self.dtype for p in projs):  # fmt: skip
                return None
            bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=self.dtype,
                                                                            device=p.qweight.device)
                              for p in projs])  # fmt: skip
            qweight = torch.cat([p.qweight for p in projs]).contiguous()
            scale = torch.cat([p.weight_scale for p in projs]).contiguous()
            method = projs[0].method
            fused.append(QuantizedLinear.from_quantized(qweight, scale, bias, method, dtype=self.dtype))  # fmt: skip
        return fused

    def _keep_dense_decode_weights(self) -> int:
        """The fp8 and int8 linears of a decode step keep their weight dequantized for calls of a
        few rows (:meth:`~oasr.layers.quantized.QuantizedLinear.keep_dense_weight`): a step's six
        GEMMs per layer in fp16 instead of six quantization kernels and six quantized GEMMs
        (fp8: about half the time on the H200), and unquantized activations (int8: the decode
        steps' per-token int8 activations cost real tiny.en WER on the GPU). Not the
        cross-attention K/V projections (1500 frames per window: the quantized GEMM's shape).
        Returns the bytes of the network's layers' copies (the fused q/k/v layers' copies are
        among their buffers, counted with them)."""
        from oasr.layers.quantized import keep_dense_weights

        keep_dense_weights(self._fused_qkv_quant or ())
        mods: list[Any] = []
        for block in self.net.decoder.layers:
            att, cross = block.self_attn, block.cross_attn
            mods += [att.out_proj, cross.q_proj, cross.out_proj, *block.mlp.modules()]
            if self._fused_qkv_quant is None:
                mods += [att.q_proj, att.k_proj, att.v_proj]
        return keep_dense_weights(mods)

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        if self.encoder_graphs is not None:
            return self.encoder_graphs(mel)
        return self.net.encode(mel)

    def project_cross(self, layer: int, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        att = self.net.decoder.layers[layer].cross_attn
        return att.k_proj(features), att.v_proj(features)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        dec = self.net.decoder
        b, t = tokens.shape
        x = dec.embed_tokens(tokens) + dec.positional_embedding[positions]
        norms = self._norms
        h = norms[0](x)
        for li, block in enumerate(dec.layers):
            att = block.self_attn
            if self._fused_qkv is not None:
                w, bias = self._fused_qkv[li]
                q, k, v = torch.nn.functional.linear(h, w, bias).split(att.embed_dim, dim=-1)
                q = att._split(q)
            elif self._fused_qkv_quant is not None:
                q, k, v = self._fused_qkv_quant[li](h).split(att.embed_dim, dim=-1)
                q = att._split(q)
            else:
                q = att._split(att.q_proj(h))
                k, v = att.k_proj(h), att.v_proj(h)
            out = ctx.self_attention(li, q, k, v)
            # each residual add with the norm after it: one kernel with oasr-kernels
            x, h = add_norm(x, att.out_proj(out.transpose(1, 2).reshape(b, t, -1)), norms[3 * li + 1])
            x, h = add_norm(x, self._cross_attention(block, h, li, ctx), norms[3 * li + 2])
            x, h = add_norm(x, block.mlp(h), norms[3 * li + 3])
        return dec.logits(h).float()

    @staticmethod
    def _cross_attention(block: Any, h: torch.Tensor, layer: int, ctx: AttentionContext) -> torch.Tensor:
        """Cross-attention of the normalised ``h`` (B, T, d) over the executor's pooled K/V
        through ``ctx.cross_attention`` (cuDNN's SDPA in captured steps, flash otherwise; the fp8
        pools through the op that reads the e4m3 bytes): this read is most of a large model's
        decode step."""
        att = block.cross_attn
        b, t, _ = h.shape
        out = ctx.cross_attention(layer, att._split(att.q_proj(h)))
        return att.out_proj(out.transpose(1, 2).reshape(b, t, -1))


# --------------------------------------------------------------------------- the requests
@dataclass(eq=False)
class _Request:
    """One request's progress through its windows."""

    request: Request
    options: DecodingOptions
    job: _Job
    suppress: tuple[int, ...]
    temps: tuple[float, ...]
    size: int = 0  # frames of the window being decoded (0: none left)
    temp_index: int = 0
    detecting: bool = False  # the next encoding is the language-detection pass


@dataclass(eq=False)
class _WindowInfo:
    detect: bool
    timestamps: bool = True
    max_initial: int = NO_MAX_INITIAL
    sot_index: int = 0
    last_timestamp: int = -1  # the latest timestamp token sampled (timestamp rules)
    no_speech_prob: float = float("nan")


class WhisperDriver:
    """:class:`oasr.executors.autoregressive.RequestDriver` for Whisper (module docstring)."""

    def __init__(self, model: WhisperASR) -> None:
        self.model = model
        self.net = model.network
        self.tok = model.tokenizer
        self.dims = self.net.dims
        self.device = self.net.device
        self.states: dict[str, _Request] = {}
        self._language: dict[str, str | None] = {}  # checked at admission, used at begin
        self._cols = torch.arange(self.dims.n_vocab, device=self.device)
        self._blank = (*self.tok.encode(" "), self.tok.eot)
        #: the VAD gate's scan over the requests being gated, and those requests by id
        self._gate: GateScan | None = None
        self._gating: dict[str, Request] = {}

    # ------------------------------------------------------------------ admission
    def accept(self, request: Request) -> bool:
        options = whisper_options(request.options)  # common + Whisper options as attributes
        language = self.model._check(options)  # typed errors for bad options: this request only
        as_mono_waveform(request.audio)
        if (options.beam_size > 1 and options.temperatures[0] == 0) or options.long_form == "vad":
            return False  # beam search and VAD-batched long-form run whole on the batch path
        self._language[request.rid] = language
        return True

    def begin(self, requests: list[Request], ex: AutoregressiveExecutor) -> None:
        """The VAD gate, then the first windows. The gate scans a bounded slice of audio per
        scheduler step over every gated request (:class:`GateScan`, ``SchedulerConfig.
        gate_seconds_per_step``: one batched detector forward for all of them); a request still
        being scanned comes back here at the next step (``ex.begin_later``), so one step never
        scans hours of audio while aborts, admissions and the decoding rows wait for it, and a
        short clip is decided in its first step beside long ones."""
        for request in requests:
            if request.rid in self._gating:
                continue  # still being scanned
            gate = self._gate_for(ex) if gate_enabled(request.options) else None
            if gate is None:
                self._start(request, ex)
                continue
            gate.add(request.rid, request.audio)
            self._gating[request.rid] = request
        if not self._gating:
            return
        try:
            decided = self._gate.advance()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - the gate is a filter: when it fails, decode
            log.warning("vad_gate failed; decoding the inputs ungated", exc_info=True)
            decided = dict.fromkeys(self._gating, True)
            self._gate = None
        for rid, speech in decided.items():
            request = self._gating.pop(rid)
            if speech:
                self._start(request, ex)
            else:
                language = self._language.get(rid)
                ex.finish(request, empty_transcript(len(request.audio), request.options, language))
        for request in self._gating.values():
            ex.begin_later(request)

    def _gate_for(self, ex: AutoregressiveExecutor) -> GateScan | None:
        """The gate scan (built on first use); None without a detector."""
        if self._gate is None:
            detector = gate_detector(self.device)
            if detector is None:
                return None
            seconds = ex.config.gate_seconds_per_step
            if seconds is None:
                seconds = GATE_SECONDS_CUDA if self.device.type == "cuda" else GATE_SECONDS_CPU
            self._gate = GateScan(detector, int(seconds * SAMPLE_RATE))
        return self._gate

    def _start(self, request: Request, ex: AutoregressiveExecutor) -> None:
        try:
            self._setup(request, self._language.get(request.rid), ex)
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            ex.finish(request, exc)

    def _setup(self, request: Request, language: str | None, ex: AutoregressiveExecutor) -> None:
        options = whisper_options(request.options)  # common + Whisper options as attributes
        wave = torch.as_tensor(np.asarray(request.audio, dtype=np.float32))  # checked by accept
        # the log-mel is computed before the first encode (encoder_inputs: batched on CUDA);
        # whole_log_mel gives wave_samples // HOP_LENGTH frames of content
        job = _Job(0, wave, None, wave.shape[0] // HOP_LENGTH, wave.shape[0] / SAMPLE_RATE)
        job.language = language
        multilingual = self.model.multilingual
        suppress = resolve_suppress_tokens(self.tok, options.suppress_tokens, self.model.non_speech_tokens)
        st = _Request(request, options, job, suppress, options.temperatures)
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
        self._next_window(st, ex)

    def release(self, request: Request) -> None:
        self.states.pop(request.rid, None)
        self._language.pop(request.rid, None)
        if self._gating.pop(request.rid, None) is not None and self._gate is not None:
            self._gate.remove(request.rid)

    # ------------------------------------------------------------------ windows
    def _set_sot(self, st: _Request) -> None:
        task = st.options.task if self.model.multilingual else None
        st.job.sot_sequence = tuple(
            self.tok.sot_sequence(st.job.language, task, multilingual=self.model.multilingual)
        )

    def _next_window(self, st: _Request, ex: AutoregressiveExecutor) -> None:
        """Queue the request's next window for encoding, or finish the request."""
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
            ex.finish(st.request, self._result(st))
            return
        st.size = min(N_FRAMES, job.content_frames - job.seek)
        st.temp_index = 0
        ex.encode_later(Window(st.request, state=st, info=_WindowInfo(detect=st.detecting)))

    def _result(self, st: _Request) -> Transcript:
        j = st.job
        segs = [s for s in j.segments if s.text.strip()]
        for k, s in enumerate(segs):
            s.id = k
        text = self.tok.decode(j.all_tokens[j.prompt_tokens_initial :]).strip()
        return Transcript(text=text, language=j.language, duration=j.duration, segments=segs,
                          task=st.options.task)  # fmt: skip

    def encoder_inputs(self, windows: list[Window]) -> torch.Tensor:
        self._ensure_mels([w.state for w in windows])
        mels = []
        for w in windows:
            job = w.state.job
            mels.append(job.mel[:, :N_FRAMES] if w.info.detect else _window_mel(job.mel, job.seek, w.state.size))
        return torch.stack(mels).to(self.device, self.net.dtype)

    def _ensure_mels(self, states: list[_Request]) -> None:
        """The whole-recording log-mel of every request that has none yet, on the network's
        device. On CUDA, recordings in the same 30-second length bucket share one batched STFT
        (:func:`batched_whole_log_mels`): per request it is a dozen small kernels and two host
        copies, a millisecond of admission time in which the GPU waits (64 ms per batch of 64),
        and inputs queued as they are decoded rarely share a length. On the CPU one at a time,
        exactly the per-batch path's computation."""
        cuda = self.device.type == "cuda"
        todo: dict[tuple[bool, int], list[_Request]] = {}
        for st in states:
            if st.job.mel is None:
                n = st.job.wave.shape[0]
                key = (True, (n - 1) // N_SAMPLES) if cuda and n <= LONG_AUDIO_SAMPLES else (False, n)
                todo.setdefault(key, []).append(st)
        for (shared, _), group in todo.items():
            if shared and len(group) > 1:
                try:
                    mels = batched_whole_log_mels([st.job.wave for st in group], self.dims.n_mels, self.device)
                except Exception:  # noqa: BLE001 - e.g. out of memory: one at a time below
                    log.warning("batched log-mel failed; computing it per request", exc_info=True)
                else:
                    for st, mel in zip(group, mels, strict=True):
                        st.job.mel = mel
                    continue
            for st in group:
                st.job.mel = whole_log_mel(st.job.wave.to(self.device), self.dims.n_mels)

    def encoded(self, windows: list[Window], features: torch.Tensor, ex: AutoregressiveExecutor) -> None:
        detect = [k for k, w in enumerate(windows) if w.info.detect]
        if detect:
            codes, _ = detect_language(self.net, self.tok, features[detect])
            for k, code in zip(detect, codes, strict=True):
                st = windows[k].state
                st.job.language = code
                st.detecting = False
                self._set_sot(st)
                self._next_window(st, ex)  # its first window is encoded next step
        for k, w in enumerate(windows):
            if k in detect:
                continue
            try:
                self._prepare(w, features[k : k + 1])
                ex.decode_later(w)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                ex.finish(w.request, exc)

    def _prepare(self, w: Window, features: torch.Tensor) -> None:
        """The window's prompt, budget and filters (the per-batch path's, per row)."""
        st: _Request = w.state
        options = st.options
        w.features = features
        w.prompt = initial_tokens(
            self.tok, st.job.sot_sequence, prompt=st.job.all_tokens[st.job.prompt_reset_since :],
            without_timestamps=options.without_timestamps, n_text_ctx=self.dims.n_text_ctx,
        )  # fmt: skip
        w.sample_len = options.max_new_tokens or self.dims.n_text_ctx // 2
        w.temperature = st.temps[st.temp_index]
        w.suppress = st.suppress
        w.begin_suppress = self._blank if options.suppress_blank else ()
        w.stop_tokens = (self.tok.eot,)
        info: _WindowInfo = w.info
        info.sot_index = w.prompt.index(self.tok.sot)
        info.timestamps = not options.without_timestamps
        if info.timestamps:
            info.max_initial = round(1.0 / (CHUNK_SECONDS / self.dims.n_audio_ctx))

    # ------------------------------------------------------------------ decoding
    def prefilled(self, rows: list[Row], logits: torch.Tensor) -> None:
        """The no-speech probability: what the prompt predicts at <|startoftranscript|>."""
        if self.tok.no_speech is None:
            return
        at = torch.tensor([r.window.info.sot_index for r in rows], device=logits.device)
        picked = logits[torch.arange(len(rows), device=logits.device), at].float()
        probs = picked.softmax(dim=-1)[:, self.tok.no_speech].tolist()
        for r, p in zip(rows, probs, strict=True):
            r.window.info.no_speech_prob = float(p)

    def process_logits(self, logits: torch.Tensor, rows: list[Row]) -> None:
        """The timestamp rules on the rows that predict timestamps. What the rules read of each
        row's history is five integers, sent in one host-to-device copy; rebuilding the token
        history on the device every step cost more than the step itself on small models."""
        ts_rows = [i for i, r in enumerate(rows) if r.window.info.timestamps]
        if not ts_rows:
            return
        tb = self.tok.timestamp_begin
        host = np.empty((len(ts_rows), 6), dtype=np.int64)
        for k, i in enumerate(ts_rows):
            row = rows[i]
            info: _WindowInfo = row.window.info
            sampled = row.sampled
            n = len(sampled)
            if n and sampled[-1] >= tb:  # each call sees one new token per row
                info.last_timestamp = sampled[-1]
            host[k] = (n, n > 0 and sampled[-1] >= tb, n < 2 or sampled[-2] >= tb,
                       info.last_timestamp, info.max_initial, i)  # fmt: skip
        state = torch.from_numpy(host).to(self.device, non_blocking=True)
        n, last_is_ts, penult_is_ts, last_ts, max_initial, idx = state.unbind(1)
        sub = logits[idx]
        apply_timestamp_rules(sub, self.tok, sampled_count=n, last_is_ts=last_is_ts.bool(),
                              penult_is_ts=penult_is_ts.bool(), last_ts=last_ts,
                              max_initial=max_initial, cols=self._cols)  # fmt: skip
        logits[idx] = sub

    def finished(self, row: Row, ex: AutoregressiveExecutor) -> None:
        w = row.window
        st: _Request = w.state
        info: _WindowInfo = w.info
        eot = self.tok.eot
        body = row.sampled
        toks = body[: body.index(eot)] if eot in body else list(body)
        text = self.tok.decode(toks).strip()
        slp = float(row.sum_logprob) if row.sum_logprob is not None else 0.0
        r = WindowResult(
            tokens=toks, text=text, sum_logprob=slp, avg_logprob=slp / (len(toks) + 1),
            no_speech_prob=float(info.no_speech_prob), temperature=w.temperature,
            compression_ratio=compression_ratio(text),
        )  # fmt: skip
        if st.temp_index + 1 < len(st.temps) and _needs_fallback(r, st.options):
            st.temp_index += 1  # the same window (same features) at the next temperature
            w.temperature = st.temps[st.temp_index]
            info.last_timestamp = -1
            ex.decode_later(w)
            return
        _advance(st.job, st.size, r, w.features, self.net, self.tok, st.options)
        w.features = None
        self._next_window(st, ex)
