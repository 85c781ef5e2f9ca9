"""Paraformer's network on ``oasr.layers``, with FunASR's parameter names (``model.pt`` loads as
released, no renaming).

* ``encoder``: SANM encoder (``SANMEncoder``, ``input_layer: pe``): input x sqrt(d) + sinusoidal
  positions (1-based, FunASR's ``SinusoidalPositionEncoder``), ``encoders0`` (one layer whose
  input is the LFR feature width, so no attention residual) and ``encoders`` (the rest); each
  layer is pre-norm SANM self-attention (multi-head attention plus an FSMN memory: a depthwise
  convolution over the values) and a ReLU feed-forward; ``after_norm``.
* ``predictor``: CIF predictor V2 (Paraformer) or V3 (BiCif, SeACo: also a timestamp head, a
  transposed convolution upsampling time by ``upsample_times``, ``cnn`` or ``cnn_blstm``).
* ``decoder``: Paraformer SANM decoder: ``decoders`` (FSMN self-memory + cross-attention),
  ``decoders2`` (FSMN only), ``decoders3`` (feed-forward only), ``after_norm``,
  ``output_layer``. Its token embedding (``decoder.embed``) serves training and SeACo's hotword
  encoder only.
* SeACo: ``bias_encoder`` (LSTM), ``lstm_proj`` (bidirectional only), ``seaco_decoder`` (a SANM
  decoder without output layer, attending over the hotwords), ``hotword_output_layer``.

Padding: encoder outputs past each row's length are zeroed before the predictor and the
timestamp head's BLSTM runs packed, so a row's result does not depend on the rows it is batched
with: every row gets what FunASR gives for that input decoded alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers import Conv1d, LayerNorm, Linear, attention
from oasr.layers.conformer import DepthwiseConv1d

LN_EPS = 1e-12  # FunASR's LayerNorm


@dataclass(frozen=True)
class EncoderConfig:
    input_size: int = 560
    output_size: int = 512
    attention_heads: int = 4
    linear_units: int = 2048
    num_blocks: int = 50
    kernel_size: int = 11
    sanm_shfit: int = 0


@dataclass(frozen=True)
class DecoderConfig:
    attention_heads: int = 4
    linear_units: int = 2048
    num_blocks: int = 16
    att_layer_num: int = 16
    kernel_size: int = 11
    sanm_shfit: int = 0
    use_output_layer: bool = True
    wo_input_layer: bool = False


@dataclass(frozen=True)
class SeacoConfig:
    """SeACo-Paraformer's bias path: an LSTM over hotword token embeddings, a SANM decoder
    attending over the hotwords, and an output layer whose ``no_bias`` class keeps the
    decoder's own distribution."""

    inner_dim: int = 512
    bias_encoder_bid: bool = False
    no_bias: int = 8377
    decoder: DecoderConfig = DecoderConfig()


@dataclass(frozen=True)
class PredictorConfig:
    kind: str = "CifPredictorV2"  # or "CifPredictorV3"
    idim: int = 512
    l_order: int = 1
    r_order: int = 1
    threshold: float = 1.0
    smooth_factor: float = 1.0
    noise_threshold: float = 0.0
    tail_threshold: float = 0.45
    tail_mask: bool = True
    # V3 (BiCif timestamp head)
    smooth_factor2: float = 1.0
    noise_threshold2: float = 0.0
    upsample_times: int = 3
    upsample_type: str = "cnn"
    use_cif1_cnn: bool = True


def sinusoid_positions(
    t: int, depth: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """FunASR's ``SinusoidalPositionEncoder.encode`` for positions 1..t: (t, depth)."""
    pos = torch.arange(1, t + 1, device=device).to(dtype)
    inc = torch.log(torch.tensor([10000.0], dtype=dtype, device=device)) / (depth / 2 - 1)
    inv = torch.exp(torch.arange(depth / 2, device=device).to(dtype) * (-inc))
    scaled = pos[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class FeedForward(nn.Module):
    """``w_2(relu(w_1 x))`` (encoder)."""

    def __init__(self, d: int, units: int) -> None:
        super().__init__()
        self.w_1 = Linear(d, units)
        self.w_2 = Linear(units, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.relu(self.w_1(x)))


class FeedForwardDecoder(nn.Module):
    """``w_2(norm(relu(w_1 x)))``, ``w_2`` without bias (decoder)."""

    def __init__(self, d: int, units: int) -> None:
        super().__init__()
        self.w_1 = Linear(d, units)
        self.w_2 = Linear(units, d, bias=False)
        self.norm = LayerNorm(units, eps=LN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.norm(F.relu(self.w_1(x))))


def fsmn_pads(kernel_size: int, shift: int) -> tuple[int, int]:
    """FunASR's FSMN zero padding: ``left = (k-1)//2 + shift``, ``right = k-1-left``."""
    left = (kernel_size - 1) // 2 + (shift if shift > 0 else 0)
    return left, kernel_size - 1 - left


def fsmn_block(d: int, kernel_size: int, pads: tuple[int, int]) -> DepthwiseConv1d:
    """The FSMN convolution; symmetric zero padding goes into the convolution itself (no padded
    copy of the input), asymmetric padding is applied by :func:`fsmn_memory`."""
    return DepthwiseConv1d(d, kernel_size, padding=pads[0] if pads[0] == pads[1] else 0, bias=False)


def fsmn_memory(
    block: DepthwiseConv1d, pads: tuple[int, int], x: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """The FSMN memory: a depthwise convolution (no bias) over the masked input, plus it.

    FunASR also zeroes the result past each length; here those frames are left as they come
    (they feed only other padded frames: the next FSMN masks its input, attention masks padded
    keys, and the encoder / decoder outputs past the lengths are masked or dropped), which
    saves one pass over the activations per layer and leaves every valid frame's value
    unchanged."""
    if mask is not None:
        x = x * mask
    xt = x.transpose(1, 2)
    if block.padding == 0 and pads != (0, 0):
        xt = F.pad(xt, pads)
    return block(xt).transpose(1, 2) + x


def key_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) key validity -> (B, 1, 1, S) additive attention mask (0 / -inf) in ``dtype``.

    Built once per forward for every layer: given a boolean mask, SDPA converts it to this on
    every call, and its memory-efficient CUDA kernel pads a mask whose row stride is not a
    multiple of 8 on every call; this one is a slice of rows padded to a multiple of 8."""
    b, s = valid.shape
    bias = torch.full((b, 1, 1, -(-s // 8) * 8), float("-inf"), dtype=dtype, device=valid.device)
    bias = bias[..., :s]
    return bias.masked_fill_(valid[:, None, None, :], 0.0)


class SANMAttention(nn.Module):
    """``MultiHeadedAttentionSANM``: attention over ``linear_q_k_v`` projections plus the FSMN
    memory of the values."""

    def __init__(self, heads: int, in_feat: int, d: int, kernel_size: int, shift: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, d // heads
        self.linear_q_k_v = Linear(in_feat, 3 * d)
        self.linear_out = Linear(d, d)
        self.pads = fsmn_pads(kernel_size, shift)
        self.fsmn_block = fsmn_block(d, kernel_size, self.pads)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.linear_q_k_v(x).split(self.h * self.d_k, dim=-1)
        mem = fsmn_memory(self.fsmn_block, self.pads, v, mask)
        qh, kh, vh = (z.reshape(b, t, self.h, self.d_k).transpose(1, 2) for z in (q, k, v))
        out = attention(qh, kh, vh, attn_mask, scale=self.d_k**-0.5)
        out = self.linear_out(out.transpose(1, 2).reshape(b, t, self.h * self.d_k))
        return out + mem


class EncoderLayer(nn.Module):
    def __init__(self, in_size: int, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.output_size
        self.residual = in_size == d
        self.self_attn = SANMAttention(
            cfg.attention_heads, in_size, d, cfg.kernel_size, cfg.sanm_shfit
        )
        self.feed_forward = FeedForward(d, cfg.linear_units)
        self.norm1 = LayerNorm(in_size, eps=LN_EPS)
        self.norm2 = LayerNorm(d, eps=LN_EPS)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.norm1(x), mask, attn_mask)
        x = x + a if self.residual else a
        return x + self.feed_forward(self.norm2(x))


class SANMEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoders0 = nn.ModuleList([EncoderLayer(cfg.input_size, cfg)])
        self.encoders = nn.ModuleList(
            [EncoderLayer(cfg.output_size, cfg) for _ in range(cfg.num_blocks - 1)]
        )
        self.after_norm = LayerNorm(cfg.output_size, eps=LN_EPS)
        self._positions: dict[tuple, torch.Tensor] = {}

    def positions(self, t: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The first ``t`` rows of a cached position table (each row is computed on its own,
        so a slice equals the table of ``t`` rows; no host-to-device copy per call, which a
        CUDA graph capture would refuse)."""
        key = (dim, device, dtype)
        table = self._positions.get(key)
        if table is None or table.shape[0] < t:
            n = max(t, 2 * table.shape[0] if table is not None else 1024)
            table = sinusoid_positions(n, dim, device, torch.float32).to(dtype)
            self._positions[key] = table
        return table[:t]

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, T, input_size) -> (B, T, d), zero past each row's length."""
        b, t, dim = feats.shape
        valid = torch.arange(t, device=feats.device)[None, :] < lengths[:, None]
        mask = valid[:, :, None].to(feats.dtype)
        attn_mask = key_bias(valid, feats.dtype)
        x = feats * self.cfg.output_size**0.5
        x = x + self.positions(t, dim, feats.device, x.dtype)
        for layer in self.encoders0:
            x = layer(x, mask, attn_mask)
        for layer in self.encoders:
            x = layer(x, mask, attn_mask)
        return self.after_norm(x) * mask


class CifPredictor(nn.Module):
    """CIF predictor V2 / V3: per-frame weights from a convolution over the encoder output;
    V3 adds the upsampled timestamp head (``upsample_cnn`` + ``cif_output2``)."""

    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.idim
        # symmetric context: the zero padding inside the convolution (no padded copy)
        pad = cfg.l_order if cfg.l_order == cfg.r_order else 0
        self.cif_conv1d = Conv1d(d, d, cfg.l_order + cfg.r_order + 1, padding=pad)
        self.cif_output = Linear(d, 1)
        if cfg.kind == "CifPredictorV3":
            if cfg.upsample_type not in ("cnn", "cnn_blstm"):
                from oasr.errors import CheckpointError

                raise CheckpointError(
                    f"CifPredictorV3 upsample_type {cfg.upsample_type!r} is not supported "
                    f"(only 'cnn' and 'cnn_blstm')"
                )
            self.upsample_cnn = nn.ConvTranspose1d(d, d, cfg.upsample_times, cfg.upsample_times)
            if cfg.upsample_type == "cnn_blstm":
                self.blstm = nn.LSTM(d, d, 1, bias=True, batch_first=True, bidirectional=True)
            self.cif_output2 = Linear(2 * d if cfg.upsample_type == "cnn_blstm" else d, 1)

    def _conv(self, hidden: torch.Tensor) -> torch.Tensor:
        ctx = hidden.transpose(1, 2)
        if self.cif_conv1d.padding == 0:
            ctx = F.pad(ctx, (self.cfg.l_order, self.cfg.r_order))
        return F.relu(self.cif_conv1d(ctx))  # (B, d, T)

    def forward(
        self, hidden: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, d) -> (conv output (B, d, T), alphas (B, T), zero past each length)."""
        c = self.cfg
        conv = self._conv(hidden)
        alphas = torch.sigmoid(self.cif_output(conv.transpose(1, 2)))
        alphas = F.relu(alphas * c.smooth_factor - c.noise_threshold).squeeze(-1)
        valid = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]
        return conv, alphas * valid.to(alphas.dtype)

    def upsampled_alphas(
        self,
        hidden: torch.Tensor,
        conv: torch.Tensor,
        lengths: torch.Tensor,
        token_num: torch.Tensor,
    ) -> torch.Tensor:
        """V3's timestamp weights (B, T * upsample_times), rescaled to sum to ``token_num``."""
        c = self.cfg
        src = conv if c.use_cif1_cnn else hidden.transpose(1, 2)
        out2 = self.upsample_cnn(src).transpose(1, 2)
        up = lengths * c.upsample_times
        if c.upsample_type == "cnn_blstm":
            # packed: each row's backward pass starts at its own end, as for an input alone
            packed = nn.utils.rnn.pack_padded_sequence(
                out2, up.cpu(), batch_first=True, enforce_sorted=False
            )
            out2 = nn.utils.rnn.pad_packed_sequence(
                self.blstm(packed)[0], batch_first=True, total_length=out2.shape[1]
            )[0]
        a2 = torch.sigmoid(self.cif_output2(out2))
        a2 = F.relu(a2 * c.smooth_factor2 - c.noise_threshold2).squeeze(-1)
        t = hidden.shape[1]
        valid = torch.arange(t, device=hidden.device)[None, :] < lengths[:, None]
        a2 = a2 * valid.repeat_interleave(c.upsample_times, dim=1).to(a2.dtype)
        total = a2.sum(-1)
        return a2 * (token_num / total)[:, None]


class CrossAttention(nn.Module):
    def __init__(self, heads: int, d: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, d // heads
        self.linear_q = Linear(d, d)
        self.linear_k_v = Linear(d, 2 * d)
        self.linear_out = Linear(d, d)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, mem_mask: torch.Tensor
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.linear_q(x).reshape(b, n, self.h, self.d_k).transpose(1, 2)
        k, v = self.linear_k_v(memory).split(self.h * self.d_k, dim=-1)
        k = k.reshape(b, -1, self.h, self.d_k).transpose(1, 2)
        v = v.reshape(b, -1, self.h, self.d_k).transpose(1, 2)
        out = attention(q, k, v, mem_mask, scale=self.d_k**-0.5)
        return self.linear_out(out.transpose(1, 2).reshape(b, n, self.h * self.d_k))


class DecoderSelfMemory(nn.Module):
    """``MultiHeadedAttentionSANMDecoder``: the FSMN memory alone."""

    def __init__(self, d: int, kernel_size: int, shift: int) -> None:
        super().__init__()
        self.pads = fsmn_pads(kernel_size, shift)
        self.fsmn_block = fsmn_block(d, kernel_size, self.pads)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return fsmn_memory(self.fsmn_block, self.pads, x, mask)


class DecoderLayer(nn.Module):
    def __init__(
        self, d: int, cfg: DecoderConfig, self_attn: bool, src_attn: bool, shift: int
    ) -> None:
        super().__init__()
        self.feed_forward = FeedForwardDecoder(d, cfg.linear_units)
        self.norm1 = LayerNorm(d, eps=LN_EPS)
        self.self_attn = DecoderSelfMemory(d, cfg.kernel_size, shift) if self_attn else None
        if self_attn:
            self.norm2 = LayerNorm(d, eps=LN_EPS)
        self.src_attn = CrossAttention(cfg.attention_heads, d) if src_attn else None
        if src_attn:
            self.norm3 = LayerNorm(d, eps=LN_EPS)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, memory: torch.Tensor, mem_mask: torch.Tensor
    ) -> torch.Tensor:
        residual = x
        t = self.feed_forward(self.norm1(x))
        if self.self_attn is None:
            x = t
        else:
            x = residual + self.self_attn(self.norm2(t), mask)
        if self.src_attn is not None:
            x = x + self.src_attn(self.norm3(x), memory, mem_mask)
        return x


class ParaformerDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig, d: int, vocab_size: int) -> None:
        super().__init__()
        # the token embedding serves training and SeACo's hotword encoder
        self.embed = None if cfg.wo_input_layer else nn.Sequential(nn.Embedding(vocab_size, d))
        shift = cfg.sanm_shfit if cfg.sanm_shfit is not None else (cfg.kernel_size - 1) // 2
        self.decoders = nn.ModuleList(
            [DecoderLayer(d, cfg, True, True, shift) for _ in range(cfg.att_layer_num)]
        )
        n2 = cfg.num_blocks - cfg.att_layer_num
        self.decoders2 = (
            nn.ModuleList([DecoderLayer(d, cfg, True, False, 0) for _ in range(n2)])
            if n2 > 0
            else None
        )
        self.decoders3 = nn.ModuleList([DecoderLayer(d, cfg, False, False, 0)])
        self.after_norm = LayerNorm(d, eps=LN_EPS)
        self.output_layer = Linear(d, vocab_size) if cfg.use_output_layer else None

    @staticmethod
    def _masks(
        memory: torch.Tensor, mem_lens: torch.Tensor, embeds: torch.Tensor, lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token mask (B, N, 1) in the embeddings' dtype, memory key mask (B, 1, 1, T): an
        additive one, :func:`key_bias`)."""
        n = embeds.shape[1]
        mask = (torch.arange(n, device=embeds.device)[None, :] < lens[:, None])[:, :, None]
        mem_valid = torch.arange(memory.shape[1], device=memory.device)[None, :] < mem_lens[:, None]
        return mask.to(embeds.dtype), key_bias(mem_valid, memory.dtype)

    def forward(
        self, memory: torch.Tensor, mem_lens: torch.Tensor, embeds: torch.Tensor, lens: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits (B, N, V) or None without an output layer, hidden (B, N, d)) of the token
        embeddings ``embeds`` (B, N, d) attending over ``memory``."""
        mask, mem_mask = self._masks(memory, mem_lens, embeds, lens)
        x = embeds
        for layer in self.decoders:
            x = layer(x, mask, memory, mem_mask)
        for layer in self.decoders2 or ():
            x = layer(x, mask, memory, mem_mask)
        for layer in self.decoders3:
            x = layer(x, mask, memory, mem_mask)
        hidden = self.after_norm(x)
        return (self.output_layer(hidden) if self.output_layer is not None else None), hidden

    def cross_attention_weights(
        self,
        memory: torch.Tensor,
        mem_lens: torch.Tensor,
        embeds: torch.Tensor,
        lens: torch.Tensor,
        layer: int,
    ) -> torch.Tensor:
        """Softmaxed cross-attention weights (B, H, N, T) of decoder layer ``layer`` (FunASR's
        ``forward_asf6`` with ``layer`` 5: SeACo's hotword filter)."""
        mask, mem_mask = self._masks(memory, mem_lens, embeds, lens)
        x = embeds
        for lay in self.decoders[:layer]:
            x = lay(x, mask, memory, mem_mask)
        lay = self.decoders[layer]
        t = lay.feed_forward(lay.norm1(x))
        x = x + lay.self_attn(lay.norm2(t), mask)
        q_in = lay.norm3(x)
        att = lay.src_attn
        b, n, _ = q_in.shape
        q = att.linear_q(q_in).reshape(b, n, att.h, att.d_k).transpose(1, 2) * att.d_k**-0.5
        k = att.linear_k_v(memory).split(att.h * att.d_k, dim=-1)[0]
        k = k.reshape(b, -1, att.h, att.d_k).transpose(1, 2)
        padded = torch.isinf(mem_mask)  # the additive mask's -inf: padded memory frames
        scores = (q @ k.transpose(-2, -1)).masked_fill(padded, float("-inf"))
        return torch.softmax(scores, dim=-1).masked_fill(padded, 0.0)


class ParaformerNet(nn.Module):
    """Encoder + CIF predictor + decoder, with FunASR's state-dict names."""

    #: kept in the model dtype under quantization: the CIF weight heads, the output layers
    #: and the hotword bias path
    quantization_keep = ("predictor.*", "decoder.output_layer", "seaco_decoder.output_layer",
                         "hotword_output_layer", "lstm_proj")

    def __init__(
        self,
        enc: EncoderConfig,
        dec: DecoderConfig,
        pred: PredictorConfig,
        vocab_size: int,
        seaco: SeacoConfig | None = None,
    ) -> None:
        super().__init__()
        self.encoder = SANMEncoder(enc)
        self.predictor = CifPredictor(pred)
        self.decoder = ParaformerDecoder(dec, enc.output_size, vocab_size)
        self.vocab_size = vocab_size
        self.seaco = seaco
        if seaco is not None:
            inner = seaco.inner_dim
            self.bias_encoder = nn.LSTM(
                inner, inner, 2, batch_first=True, bidirectional=seaco.bias_encoder_bid
            )
            self.lstm_proj = Linear(2 * inner, inner) if seaco.bias_encoder_bid else None
            self.seaco_decoder = ParaformerDecoder(seaco.decoder, inner, vocab_size)
            self.hotword_output_layer = Linear(inner, vocab_size)

    def hotword_states(self, hotwords: list[list[int]]) -> torch.Tensor:
        """SeACo's hotword representation: the bias LSTM over each hotword's token embeddings
        (the decoder's embedding table), its output at the hotword's last token (H, inner)."""
        dev = self.decoder.embed[0].weight.device
        lens = torch.tensor([len(h) for h in hotwords])
        pad = torch.zeros(len(hotwords), int(lens.max()), dtype=torch.long)
        for i, h in enumerate(hotwords):
            pad[i, : len(h)] = torch.tensor(h)
        emb = self.decoder.embed(pad.to(dev))
        packed = nn.utils.rnn.pack_padded_sequence(
            emb, lens, batch_first=True, enforce_sorted=False
        )
        out, _ = self.bias_encoder(packed)
        out = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
        if self.lstm_proj is not None:
            out = self.lstm_proj(out)
        return out[torch.arange(len(hotwords), device=out.device), (lens - 1).to(out.device)]

    @property
    def device(self) -> torch.device:
        return self.encoder.after_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.after_norm.weight.dtype


def num_parameters(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


__all__ = [
    "DecoderConfig",
    "EncoderConfig",
    "ParaformerNet",
    "PredictorConfig",
    "SeacoConfig",
    "num_parameters",
    "sinusoid_positions",
]
