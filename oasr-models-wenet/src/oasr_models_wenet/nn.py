"""The WeNet U2/U2++ network on ``oasr.layers``: Conformer encoder (offline with an optional
chunk mask, or chunk-by-chunk over the history and convolution caches of streams of any ages), CTC head, left-to-right
and right-to-left Transformer decoders.

Parameter names (OASR's, used by the native format) follow WeNet's except: the subsampling
convolutions are ``encoder.embed.conv.{0,1,2}`` and its projection ``encoder.embed.out``; decoder
attention projections are ``q_proj/k_proj/v_proj/out_proj``; the bidirectional decoder's halves
are ``decoder`` and ``r_decoder``; the CTC projection is ``ctc_lo``. :func:`convert_wenet_state`
maps a WeNet state dict to these names.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from oasr.errors import CheckpointError
from oasr.layers import Embedding, LayerNorm, Linear, MultiHeadAttention
from oasr.layers.conformer import (
    ConformerConvModule,
    Conv2dSubsampling,
    PositionwiseFeedForward,
    RelPositionalEncoding,
    RelPositionMultiHeadAttention,
    rel_position_table,
)
from oasr_models_wenet.config import WenetConfig


class GlobalCMVN(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("istd", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) * self.istd


class ConformerLayer(nn.Module):
    def __init__(self, c: WenetConfig) -> None:
        super().__init__()
        d = c.output_size
        eps = c.encoder_norm_eps
        self.self_attn = RelPositionMultiHeadAttention(
            d, c.attention_heads, query_bias=c.query_bias, key_bias=c.key_bias, value_bias=c.value_bias
        )
        self.feed_forward = PositionwiseFeedForward(d, c.linear_units, c.activation_type, c.mlp_bias)
        self.feed_forward_macaron = (
            PositionwiseFeedForward(d, c.linear_units, c.activation_type, c.mlp_bias) if c.macaron_style else None
        )
        self.conv_module = (
            ConformerConvModule(d, c.cnn_module_kernel, causal=c.causal, norm=c.cnn_module_norm,
                                act=c.activation_type, bias=c.conv_bias, norm_eps=c.conv_norm_eps)
            if c.use_cnn_module else None
        )
        self.norm_ff = LayerNorm(d, eps=eps)
        self.norm_mha = LayerNorm(d, eps=eps)
        if self.feed_forward_macaron is not None:
            self.norm_ff_macaron = LayerNorm(d, eps=eps)
            self.ff_scale = 0.5
        else:
            self.ff_scale = 1.0
        if self.conv_module is not None:
            self.norm_conv = LayerNorm(d, eps=eps)
            self.norm_final = LayerNorm(d, eps=eps)
        self.normalize_before = c.normalize_before

    def forward(self, x, pos_emb, mask, valid, att_cache=None, cnn_cache=None, lengths=None):
        pre = self.normalize_before
        if self.feed_forward_macaron is not None:
            r = x
            if pre:
                x = self.norm_ff_macaron(x)
            # alpha: the half step's scale in the add's own pass (r + 0.5 * y, the same values:
            # halving is exact), not a multiply pass of its own
            x = torch.add(r, self.feed_forward_macaron(x), alpha=self.ff_scale)
            if not pre:
                x = self.norm_ff_macaron(x)
        r = x
        if pre:
            x = self.norm_mha(x)
        a, kv = self.self_attn(x, pos_emb, mask, att_cache)
        x = r + a
        if not pre:
            x = self.norm_mha(x)
        new_cnn = None
        if self.conv_module is not None:
            r = x
            if pre:
                x = self.norm_conv(x)
            y, new_cnn = self.conv_module(x, valid, cnn_cache, lengths)
            x = r + y
            if not pre:
                x = self.norm_conv(x)
        r = x
        if pre:
            x = self.norm_ff(x)
        x = torch.add(r, self.feed_forward(x), alpha=self.ff_scale)
        if not pre:
            x = self.norm_ff(x)
        if self.conv_module is not None:
            x = self.norm_final(x)
        return x, kv, new_cnn


def chunk_mask(size: int, chunk: int, left_chunks: int, device) -> torch.Tensor:
    """(size, size) bool: frame i sees frames of its own chunk and ``left_chunks`` chunks
    before it (all before it when < 0)."""
    i = torch.arange(size, device=device)
    ci = i // chunk
    start = torch.zeros_like(i) if left_chunks < 0 else ((ci - left_chunks) * chunk).clamp_min(0)
    end = ((ci + 1) * chunk).clamp_max(size)
    j = i[None, :]
    return (j >= start[:, None]) & (j < end[:, None])


class ConformerEncoder(nn.Module):
    def __init__(self, c: WenetConfig) -> None:
        super().__init__()
        self.config = c
        self.global_cmvn = GlobalCMVN(c.input_dim)
        self.embed = Conv2dSubsampling(c.input_dim, c.output_size, c.subsampling_rate)
        self.pos_enc = RelPositionalEncoding(c.output_size)
        self.encoders = nn.ModuleList([ConformerLayer(c) for _ in range(c.num_blocks)])
        self.after_norm = LayerNorm(c.output_size, eps=c.encoder_norm_eps)

    @property
    def subsampling_rate(self) -> int:
        return self.embed.rate

    @property
    def right_context(self) -> int:
        return self.embed.right_context

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor, chunk_size: int = -1,
                left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Offline: (B, T, F) features -> ((B, T', d), (B,) lengths). ``chunk_size > 0`` applies
        the streaming chunk mask (chunk size in encoder frames, ``left_chunks`` < 0 = all)."""
        x = self.embed(self.global_cmvn(feats))
        out_lens = self.embed.output_length(lengths.to(x.device))
        t = x.shape[1]
        pos = self.pos_enc.range(0, t).to(x.dtype)
        x = self.pos_enc.scale(x)
        valid = torch.arange(t, device=x.device)[None, :] < out_lens[:, None]  # (B, T)
        mask = valid[:, None, :]  # (B, 1, T)
        if chunk_size > 0:
            mask = mask & chunk_mask(t, chunk_size, left_chunks, x.device)[None]
        mask = mask.expand(x.shape[0], t, t)
        for layer in self.encoders:
            x, _, _ = layer(x, pos, mask, valid)
        if self.config.normalize_before:
            x = self.after_norm(x)
        return x, out_lens

    @property
    def history_shape(self) -> tuple[int, int, int, int]:
        """One frame of attention history: (layers, 2 (key, value), heads, head_dim)."""
        c = self.config
        return (len(self.encoders), 2, c.attention_heads, c.output_size // c.attention_heads)

    @property
    def conv_cache_shape(self) -> tuple[int, int, int] | None:
        """Convolution caches of one stream, (layers, channels, lorder); None without causal
        convolutions."""
        lorders = {layer.conv_module.lorder for layer in self.encoders if layer.conv_module is not None}
        if not lorders or lorders == {0}:
            return None
        return (len(self.encoders), self.config.output_size, max(lorders))

    def ensure_positions(self, n: int) -> None:
        """Grow the position table to ``n`` rows (host side, before a step that reads them)."""
        self.pos_enc._ensure(n)

    def forward_chunk(self, feats: torch.Tensor, feat_lens: torch.Tensor, offsets: torch.Tensor,
                      hist: torch.Tensor, hist_lens: torch.Tensor, cnn: torch.Tensor | None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One chunk for each of B streams of any ages, no host synchronisation (CUDA-graph safe).

        ``feats`` (B, W, F) with ``feat_lens`` valid frames; ``offsets`` (B,) encoder frames each
        stream emitted before; ``hist`` (B, S, layers, 2, H, D) each stream's attention history,
        left-aligned, ``hist_lens`` (B,) valid frames of it (the frames just before ``offsets``);
        ``cnn`` (B, layers, C, lorder) convolution caches. The position table must hold
        ``max(offsets) + S + T`` rows (:meth:`ensure_positions`). Returns (output (B, T, d),
        valid output frames (B,), this chunk's keys/values (B, T, layers, 2, H, D), new
        convolution caches)."""
        x = self.embed(self.global_cmvn(feats))
        b, t, _ = x.shape
        s = hist.shape[1]
        dev = x.device
        out_lens = self.embed.output_length(feat_lens)
        x = self.pos_enc.scale(x)
        slot = torch.arange(s, device=dev)[None, :]
        cache_pos = offsets[:, None] - hist_lens[:, None] + slot
        chunk_pos = offsets[:, None] + torch.arange(t, device=dev)[None, :]
        positions = torch.cat([cache_pos, chunk_pos], dim=1).clamp_min(0)  # masked keys may be < 0
        pos = torch.nn.functional.embedding(positions, self.pos_enc.pe).to(x.dtype)  # (B, S + T, d)
        valid = torch.arange(t, device=dev)[None, :] < out_lens[:, None]
        key_valid = torch.cat([slot < hist_lens[:, None], valid], dim=1)  # (B, S + T)
        mask = key_valid[:, None, :].expand(b, t, s + t)
        new_kv, new_cnn = [], []
        for i, layer in enumerate(self.encoders):
            cache = (hist[:, :, i, 0].transpose(1, 2), hist[:, :, i, 1].transpose(1, 2))
            conv = None if cnn is None or layer.conv_module is None or layer.conv_module.lorder == 0 \
                else cnn[:, i, :, : layer.conv_module.lorder]
            x, (k, v), c = layer(x, pos, mask, valid, cache, conv, out_lens)
            new_kv.append(torch.stack([k[:, :, s:], v[:, :, s:]], dim=1))  # (B, 2, H, T, D)
            new_cnn.append(c)
        if self.config.normalize_before:
            x = self.after_norm(x)
        kv = torch.stack(new_kv, dim=1).permute(0, 4, 1, 2, 3, 5)  # (B, T, layers, 2, H, D)
        cnn_out = None
        if cnn is not None:
            cnn_out = torch.stack([c if c is not None else cnn[:, i] for i, c in enumerate(new_cnn)], dim=1)
        return x, out_lens, kv, cnn_out


class DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, act: str, normalize_before: bool) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d, heads)
        self.src_attn = MultiHeadAttention(d, heads)
        self.feed_forward = PositionwiseFeedForward(d, ffn, act)
        self.norm1 = LayerNorm(d, eps=1e-5)
        self.norm2 = LayerNorm(d, eps=1e-5)
        self.norm3 = LayerNorm(d, eps=1e-5)
        self.normalize_before = normalize_before

    def forward(self, x, tgt_pad, mem_kv, mem_pad):
        pre = self.normalize_before
        r = x
        if pre:
            x = self.norm1(x)
        x = r + self.self_attn(x, causal=True, key_padding_mask=tgt_pad)
        if not pre:
            x = self.norm1(x)
        r = x
        if pre:
            x = self.norm2(x)
        x = r + self.src_attn(x, static_kv=mem_kv, key_padding_mask=mem_pad)
        if not pre:
            x = self.norm2(x)
        r = x
        if pre:
            x = self.norm3(x)
        x = r + self.feed_forward(x)
        if not pre:
            x = self.norm3(x)
        return x


class TransformerDecoder(nn.Module):
    def __init__(self, c: WenetConfig, num_blocks: int) -> None:
        super().__init__()
        d = c.output_size
        self.d = d
        self.embed = Embedding(c.vocab_size, d)
        self.decoders = nn.ModuleList([
            DecoderLayer(d, c.decoder_heads, c.decoder_linear_units, c.decoder_activation,
                         c.decoder_normalize_before)
            for _ in range(num_blocks)
        ])
        self.after_norm = LayerNorm(d, eps=1e-5)
        self.output_layer = Linear(d, c.vocab_size)
        self.normalize_before = c.decoder_normalize_before
        self.register_buffer("pe", rel_position_table(64, d), persistent=False)

    def forward(self, memory: torch.Tensor, mem_pad: torch.Tensor | None, tokens: torch.Tensor,
                token_lens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pass: (B, L) tokens -> (B, L, V) logits (float32)."""
        L = tokens.shape[1]
        if L > self.pe.shape[0]:
            self.pe = rel_position_table(max(L, 2 * self.pe.shape[0]), self.d, self.pe.device)
        x = self.embed(tokens) * (self.d**0.5) + self.pe[:L].to(memory.dtype)
        tgt_pad = torch.arange(L, device=tokens.device)[None, :] >= token_lens[:, None]
        for layer in self.decoders:
            kv = layer.src_attn.project_kv(memory)
            x = layer(x, tgt_pad, kv, mem_pad)
        if self.normalize_before:
            x = self.after_norm(x)
        return self.output_layer(x).float()


class WenetNet(nn.Module):
    """Encoder + CTC head + decoder(s)."""

    #: linears W8A8 quantization leaves in the model dtype (docs/quantization.md): the
    #: subsampling's output projection, the CTC head and the attention decoders' output layers
    quantization_keep = ("encoder.embed.out", "ctc_lo", "decoder.output_layer", "r_decoder.output_layer")

    def __init__(self, c: WenetConfig) -> None:
        super().__init__()
        self.config = c
        self.encoder = ConformerEncoder(c)
        self.ctc_lo = Linear(c.output_size, c.vocab_size)
        self.decoder = TransformerDecoder(c, c.decoder_num_blocks)
        self.r_decoder = TransformerDecoder(c, c.decoder_r_num_blocks) if c.decoder_r_num_blocks > 0 else None

    @property
    def device(self) -> torch.device:
        return self.ctc_lo.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.ctc_lo.weight.dtype

    def ctc_log_probs(self, enc: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.ctc_lo(enc).float(), dim=-1)


# -- WeNet state dict -> OASR names ----------------------------------------------------------------

_ATTN = {"linear_q": "q_proj", "linear_k": "k_proj", "linear_v": "v_proj", "linear_out": "out_proj"}


def _map_decoder_key(rest: str) -> str:
    rest = re.sub(r"^embed\.0\.", "embed.", rest)
    m = re.match(r"^(decoders\.\d+\.(?:self_attn|src_attn))\.(linear_q|linear_k|linear_v|linear_out)\.(.*)$", rest)
    if m:
        return f"{m.group(1)}.{_ATTN[m.group(2)]}.{m.group(3)}"
    return rest


def convert_wenet_state(sd: dict[str, torch.Tensor], c: WenetConfig) -> dict[str, torch.Tensor]:
    """Rename a WeNet ``asr_model`` state dict to :class:`WenetNet`'s names; positional tables
    (``*.pe``) and training-only entries are dropped."""
    conv_ix = {"0": "0", "2": "1", "4": "2"}
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if key.startswith("module."):
            key = key[len("module."):]
        if key.endswith(".pe") or key.endswith(".pe_k") or key.startswith("criterion"):
            continue
        new = key
        if key.startswith("encoder.embed."):
            rest = key[len("encoder.embed."):]
            m = re.match(r"^conv\.(\d+)\.(weight|bias)$", rest)
            if m:
                if m.group(1) not in conv_ix:
                    raise CheckpointError(f"unexpected subsampling tensor {key}")
                new = f"encoder.embed.conv.{conv_ix[m.group(1)]}.{m.group(2)}"
            elif rest.startswith("out.0.") or rest.startswith("linear."):
                new = "encoder.embed.out." + rest.split(".")[-1]
            else:
                raise CheckpointError(f"unexpected subsampling tensor {key}")
        elif key.startswith("ctc.ctc_lo."):
            new = "ctc_lo." + key[len("ctc.ctc_lo."):]
        elif key.startswith("decoder.left_decoder."):
            new = "decoder." + _map_decoder_key(key[len("decoder.left_decoder."):])
        elif key.startswith("decoder.right_decoder."):
            if c.decoder_r_num_blocks == 0:
                continue
            new = "r_decoder." + _map_decoder_key(key[len("decoder.right_decoder."):])
        elif key.startswith("decoder."):
            new = "decoder." + _map_decoder_key(key[len("decoder."):])
        out[new] = t
    return out


def build_network(config: WenetConfig, state: dict[str, torch.Tensor], device="cpu",
                  dtype: torch.dtype | None = None) -> WenetNet:
    """Instantiate :class:`WenetNet` and load ``state`` (OASR names) strictly, with a
    :class:`CheckpointError` naming missing / unexpected / misshapen tensors."""
    with torch.device("meta"):
        net = WenetNet(config)
    expected = net.state_dict()
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    if "encoder.global_cmvn.mean" in missing:  # CMVN may come from the file instead
        missing = [k for k in missing if not k.startswith("encoder.global_cmvn.")]
    bad = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
           if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        if bad:
            parts.append(f"wrong shape: {', '.join(bad[:8])}")
        raise CheckpointError("the WeNet weights do not match train.yaml (" + "; ".join(parts) + ")")
    full = dict(state)
    for k, v in expected.items():
        if k not in full:
            if k.endswith("num_batches_tracked"):
                full[k] = torch.zeros((), dtype=torch.long)
            elif k == "encoder.global_cmvn.mean":
                full[k] = torch.zeros(v.shape)
            elif k == "encoder.global_cmvn.istd":
                full[k] = torch.ones(v.shape)
    net.load_state_dict(full, strict=True, assign=True)
    # non-persistent buffers (position tables) are still on meta: rebuild them
    net.encoder.pos_enc.pe = rel_position_table(5000, config.output_size)
    net.decoder.pe = rel_position_table(64, config.output_size)
    if net.r_decoder is not None:
        net.r_decoder.pe = rel_position_table(64, config.output_size)
    if dtype is None:
        dtype = torch.float32 if str(device).startswith("cpu") else torch.float16
    net = net.to(device=device)
    for _name, p in list(net.named_parameters()):
        p.data = p.data.to(dtype)
    for mod in net.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_floating_point() and bname != "pe":
                mod._buffers[bname] = buf.to(dtype)
    net.eval()
    return net
