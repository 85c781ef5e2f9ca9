"""``oasr.layers``: the narrow waist every OASR model is written against.

Models build themselves only from these pieces, so quantization, kernels and CUDA graphs apply to
every architecture at once. Each op has a plain-PyTorch implementation (``forward_native``) that
runs on CPU and CUDA in fp32/fp16/bf16.

Modules
    :class:`Linear` (the class quantization replaces), :class:`LayerNorm`, :class:`Conv1d`,
    :class:`Embedding` (with ``unembed`` for tied output projections), :class:`GELUMLP`,
    :class:`SinusoidalPositionalEmbedding` / :func:`sinusoids`,
    :class:`MultiHeadAttention` (self-attention with an incremental :class:`KVCache`,
    cross-attention over precomputed K/V via ``project_kv`` + ``static_kv``, key padding masks,
    causal masks with a cache offset, ``need_weights=True`` for alignment weights).

Functional ops
    :func:`attention` (``scaled_dot_product_attention``), :func:`attention_with_weights`,
    :func:`paged_decode_attention` (one decode step over a paged KV cache), :func:`gelu`,
    :func:`position_bias` (relative-position attention's position term as an SDPA mask).

Op overrides (for kernel providers)
    Every op has a name: ``linear``, ``layer_norm``, ``conv1d``, ``embedding``, ``gelu``,
    ``attention``, ``paged_decode_attention``, ... (``KNOWN_OPS``).
    ``register_override(op_name, device_type, fn)`` makes every call of that op on tensors of
    that device type go to ``fn`` instead of the native code:

    * module ops call ``fn(module, *forward_args)`` (e.g. ``fn(linear, x)``; read
      ``module.weight`` / ``module.bias``);
    * functional ops call ``fn(*args)`` with the native function's arguments
      (``attention``: ``q, k, v, mask, is_causal, scale``).

    ``fn`` may return ``NotImplemented`` to fall back to native code for inputs it does not
    handle. :func:`override` scopes one to a ``with`` block; :func:`unregister_override`
    removes one; ``OASR_DISABLE_OVERRIDES=1`` or :func:`set_overrides_enabled(False)
    <set_overrides_enabled>` disables all of them (reference runs), :func:`native_ops` for a ``with`` block. Kernel providers registered
    by plugins are installed by :func:`install_kernel_providers` (``oasr.checkpoint.load_model``
    calls it for the model's device). See ``docs/layers.md``.

Importing ``oasr.layers`` imports torch; ``import oasr`` does not import this package.
"""

from __future__ import annotations

from oasr.kernel_providers import install_kernel_providers
from oasr.layers._dispatch import (
    KNOWN_OPS,
    call_op,
    get_override,
    list_overrides,
    native_ops,
    override,
    register_override,
    set_overrides_enabled,
    unregister_override,
)
from oasr.layers.attention import (
    KVCache,
    MultiHeadAttention,
    attention,
    attention_with_weights,
    build_mask,
    causal_mask,
    fixed_shape_attention,
    paged_decode_attention,
    position_bias,
)
from oasr.layers.basic import (
    GELUMLP,
    Conv1d,
    Embedding,
    LayerNorm,
    Linear,
    Op,
    SinusoidalPositionalEmbedding,
    gelu,
    sinusoids,
)
from oasr.layers.dtypes import DTYPE_NAMES, default_dtype, resolve_dtype

__all__ = [
    "DTYPE_NAMES",
    "KNOWN_OPS",
    "Conv1d",
    "Embedding",
    "GELUMLP",
    "KVCache",
    "LayerNorm",
    "Linear",
    "MultiHeadAttention",
    "Op",
    "SinusoidalPositionalEmbedding",
    "attention",
    "attention_with_weights",
    "fixed_shape_attention",
    "build_mask",
    "call_op",
    "causal_mask",
    "default_dtype",
    "gelu",
    "get_override",
    "list_overrides",
    "native_ops",
    "install_kernel_providers",
    "override",
    "paged_decode_attention",
    "position_bias",
    "register_override",
    "resolve_dtype",
    "set_overrides_enabled",
    "sinusoids",
    "unregister_override",
]

# Conformer building blocks (appended by the WeNet issue). Imported here so that their ops
# (conv2d, depthwise_conv1d, batch_norm, glu, swish) are declared, and can be overridden by a
# kernel provider, before any model is loaded.
from oasr.layers.conformer import (  # noqa: E402
    BatchNorm1d,
    ConformerConvModule,
    Conv2d,
    Conv2dSubsampling,
    DepthwiseConv1d,
    PositionwiseFeedForward,
    RelPositionalEncoding,
    RelPositionMultiHeadAttention,
    glu,
    rel_position_table,
    swish,
)

__all__ += [
    "BatchNorm1d",
    "ConformerConvModule",
    "Conv2d",
    "Conv2dSubsampling",
    "DepthwiseConv1d",
    "PositionwiseFeedForward",
    "RelPositionMultiHeadAttention",
    "RelPositionalEncoding",
    "glu",
    "rel_position_table",
    "swish",
]

# Decoder-only language-model pieces (the speech-LLM issue): RMSNorm (op rms_norm, declared
# here so a kernel provider can override it before any model is loaded), rotary positions, the
# gated SiLU feed-forward block, and attention with grouped key/value heads.
from oasr.layers.attention import grouped_attention  # noqa: E402
from oasr.layers.llm import (  # noqa: E402
    RMSNorm,
    RotaryEmbedding,
    SiLUGatedMLP,
    apply_rotary,
    apply_rotary_signed,
    signed_rotary_sin,
)

__all__ += ["RMSNorm", "RotaryEmbedding", "SiLUGatedMLP", "apply_rotary", "apply_rotary_signed", "grouped_attention",
            "signed_rotary_sin"]

# Fused ops (the kernels issue): several native ops in one call that a kernel provider can run
# as one kernel; paged attention for a block of new tokens (prefill).
from oasr.layers.attention import paged_prefill_attention  # noqa: E402
from oasr.layers.fused import add_norm, bias_act, glu_depthwise_conv1d, log_mel_power  # noqa: E402

__all__ += ["add_norm", "bias_act", "glu_depthwise_conv1d", "log_mel_power", "paged_prefill_attention"]
