"""``QuantizedLinear``: the W8A8 replacement of :class:`oasr.layers.Linear` (int8 or fp8).

It holds the quantized weight (``qweight`` (N, K): int8, or float8 e4m3 stored as its bytes so a
model-wide ``.half()`` / ``.double()`` cannot convert it), one float32 scale per output channel
(``weight_scale``), the bias in the compute dtype, and optionally a per-input-channel
``input_scale`` (SmoothQuant's divisor, when it could not be folded into the layer before).
Activations are quantized per token on every call (``act_terms=2``, int8 only: two int8 terms
per token, the second quantizing the first's rounding error; a tied output projection uses it).
The math and its float64 reference are in :mod:`oasr.quantization.numerics`.

GEMM paths (``forward_native``; op ``quantized_linear``, overridable like every op):

* int8, CPU: oneDNN's int8 matmul (``torch.ops.onednn.qlinear_pointwise``, AMX / VNNI), else
  ``torch._int_mm``; on an x86 CPU without VNNI / AMX, float32 matmuls of the int8 values, and
  for two-term layers FBGEMM's AVX2 kernels with 7-bit terms (:mod:`oasr.layers.int8_avx2`);
* int8, CUDA: ``torch._int_mm`` (int8 x int8 -> int32). cuBLASLt wants more than 16 rows
  and K, N multiples of 8: fewer rows are padded to 17 (a decode step of a few rows); a layer
  whose K or N is not a multiple of 8 computes the same quantized values with a float32 matmul
  instead (logged once per layer);
* fp8, CUDA (compute capability >= 8.9) and CPU: ``torch._scaled_mm`` with row-wise scales
  (the per-token and per-channel scales applied inside the GEMM); K and N must be multiples of
  16, else the float32 matmul of the quantized values (logged once);
* fp8, and int8 on CUDA, a layer that keeps a dense copy (:meth:`QuantizedLinear.keep_dense_weight`;
  Whisper's step model on CUDA for the decode step's linears): calls of at most 256 rows are one
  GEMM in the compute dtype over the dequantized weight (faster than quantizing and the
  quantized GEMM at a decode step's few rows, and the activations keep their precision);
* float64 inputs: :func:`~oasr.quantization.numerics.reference_linear` (the parity reference;
  :func:`~oasr.quantization.numerics.reference_dense_linear` for the dense copy's rows).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers._dispatch import call_op, declare_op
from oasr.layers.basic import Linear, Op
from oasr.layers.int8_avx2 import avx2_int8_linear, fbgemm_int8_applies
from oasr.quantization.numerics import (
    AVX2_ACT_QMAX,
    FP8_DTYPE,
    dequantize_weight,
    quantize_activation_terms,
    quantize_activations,
    quantize_weight,
    reference_dense_linear,
    reference_linear,
)

__all__ = [
    "FORMATS",
    "QuantizedLinear",
    "dense_rows_limit",
    "dequantize_blocks",
    "dequantize_kv_op",
    "keep_dense_weights",
    "prepack_in_background",
    "quantize_kv_into",
]

log = logging.getLogger(__name__)

#: method name -> element format
FORMATS = {"int8_w8a8": "int8", "fp8_w8a8": "fp8"}

#: (device type, compute dtype) -> the out_dtype ``_scaled_mm`` accepts with row-wise scales
_SCALED_MM_OUT: dict[tuple[str, torch.dtype], torch.dtype] = {}


class QuantizedLinear(Op):
    """``y = dequant(quant(x / input_scale) quant(W * input_scale)^T) + b`` (module docstring)."""

    op_name = declare_op("quantized_linear")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        method: str,
        bias: bool = True,
        *,
        smoothed: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        act_terms: int = 1,
    ) -> None:
        super().__init__()
        if method not in FORMATS:
            raise ValueError(f"unknown quantization method {method!r}; known: {', '.join(FORMATS)}")
        if act_terms not in (1, 2) or (act_terms == 2 and FORMATS[method] != "int8"):
            raise ValueError(f"act_terms is 1, or 2 for int8; got {act_terms} for {method}")
        #: int8 terms per activation row: 2 adds the row's rounding error quantized again
        #: (``x ~ s1 q1 + s2 q2``, numerics.quantize_activation_terms), both in one GEMM call
        self.act_terms = act_terms
        self.in_features = in_features
        self.out_features = out_features
        self.method = method
        self.fmt = FORMATS[method]
        storage = torch.int8 if self.fmt == "int8" else torch.uint8
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=storage, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        if smoothed:
            self.register_buffer("input_scale", torch.ones(in_features, dtype=torch.float32, device=device))
        else:
            self.input_scale: torch.Tensor | None = None
        self._compute_dtype = dtype or torch.float32
        #: the dequantized weight in the compute dtype, for calls of at most ``dense_rows`` rows
        #: (:meth:`keep_dense_weight`; not saved with the state dict)
        self.register_buffer("dense_weight", None, persistent=False)
        self.dense_rows = 0
        self._fallback_logged = False
        #: the CPU's int8 GEMM is ~1.6x faster with the weight as a row-major (K, N) matrix:
        #: a transposed copy, made on first use and remade when ``qweight`` changes or moves
        self._kn: tuple[Any, torch.Tensor] | None = None
        self._onednn: tuple[Any, Any, torch.Tensor] | None = None

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: Linear | nn.Module, method: str,
                    input_scale: torch.Tensor | None = None) -> QuantizedLinear:  # fmt: skip
        """Quantize ``linear``'s weight (per output channel). ``input_scale`` (K,): SmoothQuant's
        per-input-channel divisor; the weight is multiplied by it before quantization."""
        return cls.from_weight(linear.weight, linear.bias, method, input_scale)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, method: str,
                    input_scale: torch.Tensor | None = None, act_terms: int = 1) -> QuantizedLinear:  # fmt: skip
        """:meth:`from_linear` from a weight (N, K) and an optional bias (N,): also for a tied
        output projection, whose weight is an embedding table."""
        weight = weight.detach()
        if method not in FORMATS:
            raise ValueError(f"unknown quantization method {method!r}; known: {', '.join(FORMATS)}")
        w = weight.float()
        s = None
        if input_scale is not None:
            s = input_scale.to(device=weight.device, dtype=torch.float32)
            w = w * s[None, :]
        qw, scale = quantize_weight(w, FORMATS[method])
        return cls.from_quantized(qw, scale, bias, method, dtype=weight.dtype, input_scale=s, act_terms=act_terms)

    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       method: str, *, dtype: torch.dtype, input_scale: torch.Tensor | None = None,
                       act_terms: int = 1) -> QuantizedLinear:  # fmt: skip
        """A layer from an already quantized weight (N, K) (int8, or e4m3 / its uint8 bytes for
        fp8) and its per-channel scales (N,), as :func:`~oasr.quantization.numerics.quantize_weight`
        returns them: what :meth:`from_weight` and the quantized-weight cache use. The weight and
        scales are adopted, not copied; the bias (small) is copied."""
        out_features, in_features = qweight.shape
        q = cls(in_features, out_features, method, bias is not None, smoothed=input_scale is not None,
                device="meta", dtype=dtype, act_terms=act_terms)  # fmt: skip
        storage = torch.int8 if q.fmt == "int8" else torch.uint8
        q.qweight = qweight.detach().view(storage)
        q.weight_scale = weight_scale.detach().to(torch.float32).reshape(out_features)
        if input_scale is not None:
            q.input_scale = input_scale.detach().to(device=qweight.device, dtype=torch.float32)
        if bias is not None:
            b = bias.detach().to(device=qweight.device, dtype=dtype, copy=True)
            q.bias = nn.Parameter(b, requires_grad=False)
        return q

    # -- views ---------------------------------------------------------------------------------
    @property
    def weight_q(self) -> torch.Tensor:
        """The quantized weight in its element type (int8 or float8_e4m3fn), (N, K)."""
        return self.qweight if self.fmt == "int8" else self.qweight.view(FP8_DTYPE)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (N, K) in the compute dtype, with the smoothing undone: for
        code that reads a linear's ``weight`` for its shape, device or dtype. It is computed on
        every access; the forward pass never uses it."""
        w = dequantize_weight(self.weight_q, self.weight_scale, torch.float32)
        if self.input_scale is not None:
            w = w / self.input_scale[None, :]
        return w.to(self.compute_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.bias.dtype if self.bias is not None else self._compute_dtype

    def keep_dense_weight(self, rows: int | None = None) -> int:
        """Keep the dequantized weight (:attr:`weight`: compute dtype, smoothing undone) for calls
        of at most ``rows`` rows (default :func:`dense_rows_limit`: 256, ``OASR_FP8_DENSE_ROWS``),
        which then run one GEMM in the compute dtype (the weight quantized, the activations not:
        W8A16) instead of the quantization kernel and the quantized GEMM. For layers whose calls
        are mostly a decode step's few rows: on the H200 cuBLASLt's fp8 GEMM with row-wise scales
        is 1.4-2x slower than fp16 there (docs/quantization.md), before the quantization
        kernel's launch; int8's pads a step to 17 rows and rescales in separate kernels. For
        int8 on CUDA it is also what keeps real tiny.en's GPU WER in budget: per-token int8
        activations in every decode step moved near-tie tokens (6.52 % against fp16's 5.95 % on
        the English clips; docs/quantization.md). Costs the weight again in the compute dtype.
        Returns the copy's bytes (made once; 0 when the limit is 0, or for an int8 layer off
        CUDA: a CPU with an int8 dot product runs its int8 GEMM faster than float, one without
        keeps such layers float)."""
        rows = dense_rows_limit() if rows is None else rows
        if rows <= 0 or self.qweight.device.type == "meta":
            return 0
        if self.fmt == "int8" and self.qweight.device.type != "cuda":
            return 0
        self.dense_rows = rows
        if self.dense_weight is None:
            self.dense_weight = self.weight.contiguous()
        return self.dense_weight.numel() * self.dense_weight.element_size()

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedLinear:
        # scales stay float32 through a model-wide .half() (rounding them would change every
        # output); float64 (the reference copy) is exact and allowed
        scales = {n: t for n in ("weight_scale", "input_scale") if (t := getattr(self, n, None)) is not None}
        super()._apply(fn, recurse)
        for name, old in scales.items():
            new = getattr(self, name)
            if new.dtype not in (torch.float32, torch.float64):
                setattr(self, name, old.to(new.device))
        probe = fn(torch.empty(0, dtype=self._compute_dtype))
        if probe.is_floating_point():
            self._compute_dtype = probe.dtype
        return self

    # -- forward -------------------------------------------------------------------------------
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        dense = self.dense_weight is not None and x.numel() <= self.dense_rows * self.in_features
        if x.dtype == torch.float64:
            if dense:  # the reference of the dense path: the quantized weight, x unquantized
                return reference_dense_linear(x, self.weight_q, self.weight_scale, self.bias, self.input_scale)
            return reference_linear(x, self.weight_q, self.weight_scale, self.bias, self.fmt, self.input_scale,
                                    self.act_terms, self.act_qmax(x.device))  # fmt: skip
        if dense and x.dtype == self.dense_weight.dtype:
            return F.linear(x, self.dense_weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            x2 = (x2.float() / self.input_scale).to(x.dtype)
        if self.fmt == "int8":
            y = self._int8(x2)
        else:
            y = self._fp8(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def act_qmax(self, device: torch.device | str) -> float | None:
        """The largest magnitude of this layer's int8 activation values on ``device``: 64 where
        FBGEMM's AVX2 path runs it (:mod:`oasr.layers.int8_avx2`: a two-term int8 layer on an
        x86 CPU without VNNI / AMX), else None (the format's 127). The float64 reference path
        uses it, so ``layer(x.double())`` is the reference of what ``layer(x)`` computes here."""
        if self.fmt == "int8" and self.act_terms == 2 and torch.device(device).type == "cpu":
            return AVX2_ACT_QMAX if fbgemm_int8_applies() else None
        return None

    def _dequantized(self, x2: torch.Tensor, why: str) -> torch.Tensor:
        """The same quantized math without a fused GEMM: activations quantized per token and
        dequantized, the weight dequantized, one float32 matmul (for shapes the GEMMs refuse)."""
        if not self._fallback_logged:
            self._fallback_logged = True
            log.info("quantized_linear %dx%d (%s): %s; using a float32 matmul of the dequantized "
                     "values", self.out_features, self.in_features, self.method, why)  # fmt: skip
        xq, sx = quantize_activation_terms(x2, self.fmt, self.act_terms, self.act_qmax(x2.device))
        w = dequantize_weight(self.weight_q, self.weight_scale, torch.float32)
        bias = self.bias.float() if self.bias is not None else None
        y = F.linear(xq.float() * sx, w)
        if self.act_terms == 2:
            m = x2.shape[0]
            y = y[:m] + y[m:]
        return (y if bias is None else y + bias).to(x2.dtype)

    def _int8(self, x2: torch.Tensor) -> torch.Tensor:
        dev = x2.device.type
        m, k = x2.shape
        n = self.out_features
        if dev not in ("cpu", "cuda"):
            return self._dequantized(x2, f"no int8 GEMM on {dev}")
        if dev == "cuda" and (k % 8 or n % 8):
            return self._dequantized(x2, "cuBLASLt's int8 GEMM needs K and N multiples of 8")
        if dev == "cpu" and self.act_qmax(dev) is not None:
            # an x86 CPU without VNNI / AMX: FBGEMM with 7-bit terms (int8_avx2), for two-term
            # layers only (one 7-bit term cost tiny.en's WER 1.7 points)
            return avx2_int8_linear(self, x2)
        # float32 matmuls as this CPU's int8 GEMM: the rounded activations stay float32 (the
        # same integers, without an int8 copy and its conversion back: ~7 % of tiny.en's encoder)
        float_gemm = dev == "cpu" and _int8_gemm_takes_float32()
        # two terms: (2m, K) rows, the second m the first's rounding errors; one GEMM reads the
        # weight once for both
        if self.act_terms == 1 and dev == "cuda":
            xq, sx = quantize_activations_op(x2, "int8")
        else:
            xq, sx = quantize_activation_terms(x2, "int8", self.act_terms, as_float=float_gemm)
        rows = xq.shape[0]
        if dev == "cuda" and rows <= 16:  # cuBLASLt's int8 GEMM wants more than 16 rows
            xq = F.pad(xq, (0, 0, 0, 17 - rows))
        y = _onednn_int8_gemm(self, xq) if dev == "cpu" and not float_gemm else None
        if y is not None:  # the per-channel weight scales are applied inside
            # (a fused ``addcmul(bias, y, sx)`` would save a pass over the output, but its
            # multiply-add rounds once where this rounds twice: a different last bit moves
            # tiny.en's int8 WER by 0.3 points, the size of the whole int8 budget)
            y = y.mul_(sx)
        else:
            if dev == "cpu":
                acc = _int_mm_cpu(self, xq)
            else:
                acc = torch._int_mm(xq, self.qweight.t())[:rows]
            # int32 -> float32 first: a mixed int32 * float32 multiply is ~15x slower on the CPU
            y = acc.to(torch.float32).mul_(sx).mul_(self.weight_scale)
        if self.act_terms == 2:
            y = y[:m].add_(y[m:])
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.to(x2.dtype)

    def _packed(self) -> Any:
        """oneDNN's packed form of ``qweight`` (CPU), remade when ``qweight`` changes. A
        :func:`prepack_in_background` thread may be making it: one lock per layer, so it is
        packed once."""
        key = (self.qweight.device, self.qweight._version, self.qweight.data_ptr())
        got = self._onednn
        if got is not None and got[0] == key:
            return got
        with _pack_lock(self):
            if self._onednn is None or self._onednn[0] != key:
                packed = torch.ops.onednn.qlinear_prepack(self.qweight, None)
                zero = torch.zeros(self.out_features, dtype=torch.long)
                self._onednn = (key, packed, zero)
            return self._onednn

    def _weight_kn(self) -> torch.Tensor:
        key = (self.qweight.device, self.qweight._version, self.qweight.data_ptr())
        if self._kn is None or self._kn[0] != key:
            self._kn = (key, self.qweight.t().contiguous())
        return self._kn[1]

    def _fp8(self, x2: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        if k % 16 or n % 16:
            return self._dequantized(x2, "torch._scaled_mm needs K and N multiples of 16")
        xq, sx = quantize_activations_op(x2, "fp8")
        out_dtype = _scaled_mm_out_dtype(x2.device.type, x2.dtype)
        fused = (self.bias is not None and out_dtype == x2.dtype
                 and _scaled_mm_takes_bias(x2.device.type, out_dtype))  # fmt: skip
        # A row-major (M, K), B column-major (the transposed row-major weight): what cuBLASLt /
        # CUTLASS want, no copy
        y = torch._scaled_mm(xq, self.weight_q.t(), scale_a=sx, scale_b=self.weight_scale[None, :],
                             bias=self.bias if fused else None, out_dtype=out_dtype)  # fmt: skip
        if self.bias is not None and not fused:
            y = y + self.bias.to(out_dtype)
        return y if y.dtype == x2.dtype else y.to(x2.dtype)

    def extra_repr(self) -> str:
        smooth = ", smoothed" if self.input_scale is not None else ""
        terms = ", act_terms=2" if self.act_terms == 2 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method}{smooth}{terms}")  # fmt: skip


#: whether oneDNN's int8 linear (torch.ops.onednn.qlinear_pointwise) works in this torch build
_ONEDNN_INT8: list[bool] = []

#: one lock per layer for its oneDNN packing (the forward pass and the background thread)
_PACK_LOCKS: weakref.WeakKeyDictionary[QuantizedLinear, threading.Lock] = weakref.WeakKeyDictionary()
_PACK_LOCKS_GUARD = threading.Lock()


def _pack_lock(module: QuantizedLinear) -> threading.Lock:
    with _PACK_LOCKS_GUARD:
        lock = _PACK_LOCKS.get(module)
        if lock is None:
            lock = _PACK_LOCKS[module] = threading.Lock()
        return lock


def prepack_in_background(modules: Iterable[QuantizedLinear]) -> threading.Thread | None:
    """Make oneDNN's packed weights of the CPU int8 layers among ``modules`` (in their order) on
    a daemon thread, so that the first forward pass finds them made; None when there is none to
    make or oneDNN's int8 linear is known not to be used here (its one-time check already
    failed). Packing is a single-threaded reorder (tiny.en: about 0.25 s, half of it the 51
    864-row tied output projection) that the first pass would otherwise do inline while the
    other cores wait; torch releases the GIL inside it, so the thread overlaps with what the
    process does next (engine start, audio decoding, features, the first layers). The same
    packed weights either way: only when they are made differs.

    On an x86 CPU without VNNI / AMX (:func:`_x86_without_int8_dot`), where oneDNN's int8 linear
    is not used, the same for FBGEMM's packed weights of the two-term layers
    (:mod:`oasr.layers.int8_avx2`; Whisper's tied output projection: 0.25 to 0.5 s on a 2-core
    AVX2 EPYC, done inline in the first decode step before)."""
    from oasr.layers.int8_avx2 import fbgemm_packed

    todo = [m for m in modules if isinstance(m, QuantizedLinear) and m.fmt == "int8"
            and m.qweight.device.type == "cpu"]  # fmt: skip
    fbgemm = _x86_without_int8_dot()
    if fbgemm:  # oneDNN's int8 linear saturates here; FBGEMM runs the two-term layers
        todo = [m for m in todo if m.act_terms == 2]
    elif _ONEDNN_INT8 and not _ONEDNN_INT8[0]:
        return None  # oneDNN's int8 linear is known not to be used here: nothing to pack
    if not todo:
        return None

    def run() -> None:
        try:
            if fbgemm:
                if not fbgemm_int8_applies():
                    return
            else:
                if not _onednn_int8_usable():
                    return
            for m in todo:
                if _PREPACK_STOP.is_set():
                    return
                if fbgemm:
                    fbgemm_packed(m)
                else:
                    m._packed()
        except Exception as exc:  # noqa: BLE001 - the forward pass packs (and reports) itself
            log.info("background int8 weight packing stopped (%s: %s); layers pack on first use",
                     type(exc).__name__, exc)  # fmt: skip

    with _PACK_LOCKS_GUARD:
        if not _PREPACK_ATEXIT:
            _PREPACK_ATEXIT.append(atexit.register(_stop_prepacking))
        _PREPACK_THREADS[:] = [t for t in _PREPACK_THREADS if t.is_alive()]
        thread = threading.Thread(target=run, name="oasr-int8-prepack", daemon=True)
        _PREPACK_THREADS.append(thread)
    thread.start()
    return thread


#: set at interpreter exit: packing threads stop after their current layer
_PREPACK_STOP = threading.Event()
_PREPACK_THREADS: list[threading.Thread] = []
_PREPACK_ATEXIT: list[Any] = []


def _stop_prepacking() -> None:
    """At exit, before the interpreter finalizes: stop the packing threads and wait for the
    layer each is packing. A daemon thread still inside oneDNN when the process's C++ static
    objects are destroyed aborts the process ("terminate called without an active exception")."""
    _PREPACK_STOP.set()
    for thread in list(_PREPACK_THREADS):
        thread.join()


def _onednn_int8_gemm(module: QuantizedLinear, xq: torch.Tensor) -> torch.Tensor | None:
    """``(x_q W_q^T) * s_w`` in float32 through oneDNN's int8 matmul primitive (the one torch's
    x86 quantization uses; AMX / VNNI kernels: 2.5x ``torch._int_mm``'s speed for 1500 rows on a
    Sapphire Rapids core). Activations enter with scale 1 and zero point 0 (the per-token scales
    are applied by the caller), so the integer products are the same. None when this torch has
    no such op or it refuses the inputs (the caller then uses ``torch._int_mm``)."""
    if not _onednn_int8_usable():
        return None
    try:
        _, packed, zero = module._packed()
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, packed, module.weight_scale, zero, None, 1.0, 0,
                                               torch.float32, "none", [], "")  # fmt: skip
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        log.info("oneDNN int8 linear refused a %s input (%s); using torch._int_mm", tuple(xq.shape), exc)
        _ONEDNN_INT8[:] = [False]
        return None
    return y


def _onednn_int8_usable() -> bool:
    """:func:`_onednn_int8_works`, checked once (``_ONEDNN_INT8``; a refused call turns it off)."""
    if not _ONEDNN_INT8:
        _ONEDNN_INT8.append(_onednn_int8_works())
    return _ONEDNN_INT8[0]


def _int8_gemm_takes_float32() -> bool:
    """Whether this CPU's int8 GEMM is :func:`_int_mm_cpu`'s float32 matmuls (oneDNN's int8
    linear unusable here and ``torch._int_mm`` slow), which take the activations as float32."""
    return not _onednn_int8_usable() and int8_gemm_is_float32()


def _onednn_int8_works() -> bool:
    """Whether oneDNN's int8 linear exists here and gives exact integer products for int8
    (signed) activations on this CPU (checked once against an int64 matmul; never on an x86 CPU
    without an int8 dot-product instruction, :func:`_x86_without_int8_dot`)."""
    if _x86_without_int8_dot():
        log.info("no int8 dot-product instruction (VNNI / AMX) on this CPU: oneDNN's int8 linear "
                 "is inexact for signed activations here and is not used")  # fmt: skip
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(-127, 128, (5, 64), generator=g, dtype=torch.int8)
        w = torch.randint(-127, 128, (24, 64), generator=g, dtype=torch.int8)
        scale = torch.rand(24, generator=g) + 0.5
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        got = torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, packed, scale, torch.zeros(24, dtype=torch.long),
                                                 None, 1.0, 0, torch.float32, "none", [], "")  # fmt: skip
        want = (x.long() @ w.long().t()).double() * scale.double()
        ok = bool(((got.double() - want).abs() <= 1e-5 * want.abs().max()).all())
    except (AttributeError, RuntimeError, TypeError, NotImplementedError) as exc:
        log.info("oneDNN int8 linear unavailable (%s: %s); using torch._int_mm", type(exc).__name__, exc)
        return False
    if not ok:
        log.info("oneDNN int8 linear gives inexact products for signed activations here; using torch._int_mm")
    return ok


#: whether this is an x86 CPU without an int8 dot-product instruction (read once)
_NO_INT8_DOT: list[bool] = []


def _x86_without_int8_dot() -> bool:
    """Whether this is an x86 CPU with none of AVX-512 VNNI, AVX-VNNI, AMX-INT8 (e.g. an AVX2
    EPYC). oneDNN's int8 kernels there multiply byte pairs into saturating 16-bit sums
    (``vpmaddubsw``), so its int8 linear is inexact for signed activations: it is not used, and
    its weights are not packed. Known from the CPU's flags, without running oneDNN."""
    if not _NO_INT8_DOT:
        import platform

        cpu = torch.cpu
        no_dot = False
        if platform.machine().lower() in ("x86_64", "amd64"):
            try:
                caps = cpu.get_capabilities()
                no_dot = not any(caps.get(k, False) for k in ("avx512_vnni", "avx_vnni", "amx_int8"))
            except (AttributeError, RuntimeError):  # an older torch: its own VNNI / AMX checks
                try:
                    no_dot = not (cpu._is_vnni_supported() or cpu._is_amx_tile_supported())
                except (AttributeError, RuntimeError):
                    no_dot = False
        _NO_INT8_DOT.append(no_dot)
    return _NO_INT8_DOT[0]


#: whether ``torch._int_mm`` is slow on this CPU (probed once; see :func:`_int_mm_cpu`)
_INT_MM_SLOW: list[bool] = []
#: int8 x int8 products summed over at most this many terms are exact in float32:
#: |sum| <= 128 * 128 * 1024 = 2**24, and every integer up to 2**24 is a float32
_F32_EXACT_K = 1024


def _int_mm_cpu(module: QuantizedLinear, xq: torch.Tensor) -> torch.Tensor:
    """``xq @ W_q^T``, the exact integer products, on the CPU: ``torch._int_mm``, or where that is
    slow here (a CPU without VNNI, e.g. an AVX2 EPYC: oneDNN's reference int8 kernel, 40x a
    float32 matmul of the same shape) the same integers through float32 matmuls over K chunks of
    at most :data:`_F32_EXACT_K`, where every partial sum is exact (``xq`` may then hold its
    integers in float32 already). int32, or float32 holding the int32 values: the caller
    converts to float32 either way, so the outputs are identical."""
    if not int8_gemm_is_float32():
        return torch._int_mm(xq, module._weight_kn())
    key = (module.qweight.device, module.qweight._version, module.qweight.data_ptr(), "float32")
    if module._kn is None or module._kn[0] != key:  # the (K, N) slot holds the float32 copy here
        module._kn = (key, module.qweight.t().to(torch.float32).contiguous())
    w = module._kn[1]
    xf = xq.to(torch.float32)
    k = xq.shape[1]
    if k <= _F32_EXACT_K:
        return torch.mm(xf, w)
    acc = torch.mm(xf[:, :_F32_EXACT_K], w[:_F32_EXACT_K]).to(torch.int32)
    for start in range(_F32_EXACT_K, k, _F32_EXACT_K):
        end = start + _F32_EXACT_K
        acc.add_(torch.mm(xf[:, start:end], w[start:end]).to(torch.int32))
    return acc


def int8_gemm_is_float32() -> bool:
    """Whether CPU int8 GEMMs here run as float32 matmuls of the int8 values (:func:`_int_mm_cpu`:
    an x86 CPU without VNNI / AMX, or ``OASR_INT8_FLOAT32_GEMM=1``); decided once."""
    if not _INT_MM_SLOW:
        _INT_MM_SLOW.append(_int_mm_is_slow())
    return _INT_MM_SLOW[0]


def _int_mm_is_slow() -> bool:
    """Whether ``torch._int_mm`` lacks a fast kernel here: an x86 CPU without an int8 dot-product
    instruction (:func:`_x86_without_int8_dot`), where oneDNN runs its reference int8 GEMM (an
    AVX2 EPYC: 5x to 40x a float32 matmul of the same shape), and the float32 matmul gives the
    exact integer products (checked against int64). ``OASR_INT8_FLOAT32_GEMM=1`` / ``0`` forces
    the float32 / ``_int_mm`` path."""
    import os

    forced = os.environ.get("OASR_INT8_FLOAT32_GEMM")
    if forced in ("0", "1"):
        return forced == "1"
    if not _x86_without_int8_dot():
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (8, _F32_EXACT_K), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (_F32_EXACT_K, 16), generator=g, dtype=torch.int8)
    x[0].fill_(-128)
    w[:, 0].fill_(-127)  # the largest sum, near 2**24
    products = torch.mm(x.to(torch.float32), w.to(torch.float32)).to(torch.int64)
    exact = torch.equal(products, x.long() @ w.long())
    if exact:
        log.info("no VNNI on this CPU (torch._int_mm has no fast kernel): int8 GEMMs run as exact "
                 "float32 matmuls of the int8 values")  # fmt: skip
    return bool(exact)


#: the environment variable that sets :func:`dense_rows_limit`
DENSE_ROWS_ENV = "OASR_FP8_DENSE_ROWS"
_DENSE_ROWS_DEFAULT = 256


def dense_rows_limit() -> int:
    """Rows up to which an fp8 (or CUDA int8) layer with a dense copy
    (:meth:`QuantizedLinear.keep_dense_weight`) uses it: ``OASR_FP8_DENSE_ROWS``, default 256 (a
    decode step of up to 256 rows, a prefill of 64 rows x 4 prompt tokens); 0 makes no copies
    (every call on the quantized GEMM, and the quantized weights' memory only)."""
    value = os.environ.get(DENSE_ROWS_ENV, "").strip()
    if not value:
        return _DENSE_ROWS_DEFAULT
    try:
        return max(0, int(value))
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", DENSE_ROWS_ENV, value, _DENSE_ROWS_DEFAULT)
        return _DENSE_ROWS_DEFAULT


def keep_dense_weights(modules: Iterable[nn.Module], rows: int | None = None) -> int:
    """:meth:`QuantizedLinear.keep_dense_weight` on each :class:`QuantizedLinear` among
    ``modules`` (other modules are skipped; it decides which formats and devices keep one).
    Returns the copies' bytes."""
    return sum(m.keep_dense_weight(rows) for m in modules if isinstance(m, QuantizedLinear))


_QUANT_ACT = declare_op("quantize_activations")


def quantize_activations_op(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~oasr.quantization.numerics.quantize_activations` of a 2-D ``x`` as an overridable
    op (``"quantize_activations"``): on CUDA oasr-kernels' one-launch kernel gives the same bytes
    and scales as the native five ops. ``OASR_FP8_FUSED_QUANT=0`` keeps the native ops (an A/B
    in one process: read on every call)."""
    if not x.is_cuda or os.environ.get("OASR_FP8_FUSED_QUANT") == "0":
        return quantize_activations(x, fmt)
    return call_op(_QUANT_ACT, "cuda", quantize_activations, x, fmt)


#: (device type, dtype) -> whether ``_scaled_mm`` with row-wise scales adds a bias of that dtype
_SCALED_MM_BIAS: dict[tuple[str, torch.dtype], bool] = {}


def _scaled_mm_takes_bias(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales takes ``bias=`` (added in its epilogue,
    one pass over the output fewer) and gives ``gemm + bias`` rounded once, as the separate add
    of the unrounded sum would: probed once per (device type, dtype) on small integers, where
    both are exact (a rounding fewer than the separate add, closer to the float64 reference).
    ``OASR_FP8_FUSED_QUANT=0`` says no (the separate add, as before)."""
    if os.environ.get("OASR_FP8_FUSED_QUANT") == "0":
        return False
    key = (device_type, dtype)
    got = _SCALED_MM_BIAS.get(key)
    if got is None:
        got = False
        try:
            a = torch.arange(-8, 8, device=device_type, dtype=torch.float32).repeat(16, 1)
            bias = torch.arange(16, device=device_type, dtype=torch.float32).to(dtype)
            a8 = a.to(FP8_DTYPE)
            # powers of two: exact either way, and a bias added before the scales would show
            two_a = torch.full((16, 1), 2.0, device=device_type)
            quarter_b = torch.full((1, 16), 0.25, device=device_type)
            y = torch._scaled_mm(a8, a8.t(), scale_a=two_a, scale_b=quarter_b, bias=bias,
                                 out_dtype=dtype)  # fmt: skip
            got = bool(torch.equal(y.float(), (a @ a.t()) * 0.5 + bias.float()))
        except (RuntimeError, NotImplementedError, TypeError):
            got = False
        _SCALED_MM_BIAS[key] = got
    return got


def _scaled_mm_out_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The output dtype for ``_scaled_mm`` with row-wise scales: the compute dtype where torch
    accepts it, else bfloat16 (some builds take only bfloat16 with row-wise scales); probed once
    per (device type, dtype)."""
    key = (device_type, dtype)
    got = _SCALED_MM_OUT.get(key)
    if got is not None:
        return got
    a = torch.zeros(16, 16, device=device_type, dtype=FP8_DTYPE)
    one_a = torch.ones(16, 1, device=device_type)
    one_b = torch.ones(1, 16, device=device_type)
    got = torch.bfloat16
    for candidate in (dtype, torch.bfloat16):
        try:
            torch._scaled_mm(a, a.t(), scale_a=one_a, scale_b=one_b, out_dtype=candidate)
        except (RuntimeError, NotImplementedError):
            continue
        got = candidate
        break
    _SCALED_MM_OUT[key] = got
    return got


# --------------------------------------------------------------------------- fp8 KV cache
_QUANT_KV_INTO = declare_op("quantize_kv_into")
_DEQUANT_KV = declare_op("dequantize_kv")


def quantize_kv_into(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor,
                     index: torch.Tensor | None = None) -> None:  # fmt: skip
    """:func:`~oasr.quantization.numerics.quantize_kv` of ``x`` (R, I, H, D), one scale per
    (row, i, head) vector, stored into ``q_out`` (R', I, H, D) uint8 (e4m3 bytes) and ``s_out``
    (R', I, H) float32, which may be strided views (a pool's transposed layout): row ``r`` goes
    to ``index[r]`` (the paged cache's slots), or to row ``r`` when ``index`` is None.
    Overridable op ``"quantize_kv_into"``: on CUDA oasr-kernels does it in one launch with the
    same bytes and scales (the native path is five kernels and a copy or scatter per tensor)."""
    call_op(_QUANT_KV_INTO, x.device.type, _quantize_kv_into_native, x, q_out, s_out, index)


def _quantize_kv_into_native(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor,
                             index: torch.Tensor | None) -> None:  # fmt: skip
    from oasr.quantization.numerics import quantize_kv

    r, i, h, d = x.shape
    q, s = quantize_kv(x.reshape(r * i, h, d))
    q, s = q.view(r, i, h, d), s.view(r, i, h)
    if index is None:
        q_out.copy_(q)
        s_out.copy_(s)
    else:
        q_out.index_copy_(0, index, q)
        s_out.index_copy_(0, index, s)


def dequantize_kv_op(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`~oasr.quantization.numerics.dequantize_kv` as an overridable op (``"dequantize_kv"``):
    on CUDA one launch with the same values (the native path: three kernels and a float32 copy)."""
    from oasr.quantization.numerics import dequantize_kv

    return call_op(_DEQUANT_KV, q.device.type, dequantize_kv, q, scale, dtype)


_PAGED_DECODE_FP8 = declare_op("paged_decode_attention_fp8")


def paged_decode_attention_fp8(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`oasr.layers.paged_decode_attention` over an fp8 KV cache
    (:class:`oasr.kv_cache.PagedKVCache` with ``kv_dtype="fp8"``): ``k_pool`` / ``v_pool``
    (num_blocks, block_size, H, D) hold e4m3 bytes (uint8), ``k_scale`` / ``v_scale``
    (num_blocks, block_size, H) one float32 scale per key/value vector. Returns (B, H, 1, D) in
    ``q``'s dtype. Overridable op ``"paged_decode_attention_fp8"``; the native code dequantizes
    the rows' blocks to ``q``'s dtype and runs ``paged_decode_attention`` over them (no
    synchronisation, static shapes: capturable in a CUDA graph)."""
    return call_op(_PAGED_DECODE_FP8, q.device.type, _paged_decode_fp8_native, q, k_pool, v_pool,
                   k_scale, v_scale, block_tables, lengths, scale)  # fmt: skip


def _paged_decode_fp8_native(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             k_scale: torch.Tensor, v_scale: torch.Tensor, block_tables: torch.Tensor,
                             lengths: torch.Tensor, scale: float | None) -> torch.Tensor:  # fmt: skip
    from oasr.layers.attention import paged_decode_attention

    k, v, tables = dequantize_blocks(k_pool, v_pool, k_scale, v_scale, block_tables, q.dtype)
    return paged_decode_attention(q, k, v, tables, lengths, scale)


def dequantize_blocks(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor,
                      v_scale: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The blocks of ``block_tables`` (B, n) of fp8 K/V pools (num_blocks, block_size, H, D),
    dequantized to ``dtype`` (:func:`dequantize_kv_op`): K and V (B * n, block_size, H, D) and
    the tables into them (B, n)."""
    b, n = block_tables.shape
    flat = block_tables.reshape(-1)
    k = dequantize_kv_op(k_pool.index_select(0, flat), k_scale.index_select(0, flat), dtype)
    v = dequantize_kv_op(v_pool.index_select(0, flat), v_scale.index_select(0, flat), dtype)
    tables = torch.arange(b * n, device=block_tables.device, dtype=block_tables.dtype).view(b, n)
    return k, v, tables


# --------------------------------------------------------------------------- fp8 cross-attention K/V
_CROSS_FP8 = declare_op("cross_attention_fp8")


def cross_attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` (B, H, T, D) over every one of S keys/values held in fp8: ``k`` / ``v``
    (B, H_kv, S, D) e4m3 bytes (uint8), ``k_scale`` / ``v_scale`` (B, H_kv, S) float32, one per
    key / value vector (:func:`~oasr.quantization.numerics.quantize_kv`'s format, heads first so
    that a (row, head) is one contiguous run). Query head ``h`` reads kv head ``h // (H / H_kv)``.
    Returns (B, H, T, D) in ``q``'s dtype. The autoregressive executor's fp8 cross-attention
    pools (``EngineConfig.kv_cache_dtype="fp8"``). Overridable op ``"cross_attention_fp8"``; the
    native code dequantizes to ``q``'s dtype and runs :func:`oasr.layers.attention` (static
    shapes, no synchronisation: capturable in a CUDA graph)."""
    return call_op(_CROSS_FP8, q.device.type, _cross_fp8_native, q, k, v, k_scale, v_scale, scale)


def _cross_fp8_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                      v_scale: torch.Tensor, scale: float | None) -> torch.Tensor:  # fmt: skip
    from oasr.layers.attention import attention

    # a prefill's queries (the kernel takes decode steps): the pools dequantized in one launch each
    kd = dequantize_kv_op(k, k_scale, q.dtype)
    vd = dequantize_kv_op(v, v_scale, q.dtype)
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:  # grouped heads: each key/value head serves H / H_kv query heads
        kd = kd.repeat_interleave(h // hkv, dim=1)
        vd = vd.repeat_interleave(h // hkv, dim=1)
    # cuDNN or flash: the caller's choice (AttentionContext.cross_attention: cuDNN in graph steps)
    return attention(q, kd, vd, scale=scale)
