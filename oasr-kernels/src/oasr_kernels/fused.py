"""CUDA overrides of the fused ``oasr.layers`` ops (``csrc/fused_ops.cu``) and of ``rms_norm``.

Each ``*_cuda`` function is registered as the override of its op on "cuda" by
:func:`oasr_kernels.provider.install`; it returns ``NotImplemented`` (the native op runs) for
inputs it does not take: a dtype other than fp32/fp16/bf16, non-contiguous tensors, shapes
outside the table in ``docs/kernels.md``, or no working compiler (:mod:`oasr_kernels.jit`).

Launch parameters (threads per block, tiles) are read per shape from the autotune cache
(:func:`oasr.tune.tuned_params`), with the defaults below when it has none. :data:`TUNABLES`
describes each op's candidates for :func:`oasr.tune.autotune`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oasr.tune import Tunable, tuned_params
from oasr_kernels.jit import DTYPE_TAGS, KernelModule

__all__ = [
    "TUNABLES", "add_norm_cuda", "bias_act_cuda", "glu_depthwise_conv1d_cuda", "launch_glu_dwconv_btc",
    "log_mel_power_cuda", "rms_norm_cuda",
]  # fmt: skip

MODULE = KernelModule("fused_ops.cu")

#: whether an override takes a shape the autotune cache has no ``use_kernel`` for. From the
#: H200 (benchmarks/kernelbench.py, docs/kernels.md): the RMSNorm, residual add + LayerNorm
#: (rewritten with the row in registers; d = 1280 fp16 in a CUDA graph: 2.5 against 5.4 us at a
#: 64-row decode step, 243 against 419 us at 96 000 encoder rows) and log-mel kernels beat the
#: native ops; the bias + activation and GLU + depthwise kernels did not in their first
#: versions, so they run only where ``oasr.tune.autotune()`` measured them faster on the GPU at
#: hand (``use_kernel: true`` in its cache). The frames-major GLU +
#: depthwise (+ SiLU) kernel takes the place of four native passes (GLU, cuDNN's convolution,
#: its bias add, SiLU) over the Conformer module's frames, so it is on unless tuned off.
USE_BY_DEFAULT = {"layer": True, "rms": True, "bias_act": False, "glu_depthwise_conv1d": False,
                  "glu_depthwise_conv1d_btc": True, "log_mel_power": True}  # fmt: skip
_SMEM_LIMIT = 48 * 1024  # the default dynamic shared memory limit (no opt-in attribute)
MAX_NORM_DIM = _SMEM_LIMIT // 4 - 64  # the row lives in shared memory as fp32
MAX_DWCONV_KERNEL = 2048


def _without_overrides(fn):
    """``fn`` run with every override off (the native op, for autotune's comparison)."""
    import oasr.layers as L

    def run():
        with L.native_ops():
            return fn()

    return run


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _vectorizable(d: int, *tensors: torch.Tensor | None) -> bool:
    """16-byte vector loads: rows of a whole number of vectors, every pointer 16-byte aligned."""
    per_vec = 16 // tensors[0].element_size()
    return d % per_vec == 0 and all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


# ------------------------------------------------------------------ residual add + norm
def norm_key(mode: str, dtype: torch.dtype, d: int, rows: int) -> str:
    """A decode step's few rows and an encoder's many are tuned (and decided) apart."""
    return f"{mode}:{DTYPE_TAGS[dtype]}:d{d}:{'few' if rows <= 1024 else 'many'}"


def _norm_default(d: int, dtype: torch.dtype = torch.float16) -> dict[str, int]:
    """One thread per 16-byte vector of the row (per element when rows are not whole vectors),
    in whole warps, 32 to 1024."""
    per_vec = 16 // torch.empty((), dtype=dtype).element_size()
    units = d // per_vec if d % per_vec == 0 else d
    return {"threads": min(1024, max(32, -(-units // 32) * 32))}


def launch_add_norm(mode: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    bias: torch.Tensor | None, eps: float,
                    params: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """(sum, normalised) from the kernel, or None when it cannot run. ``mode`` "layer" or "rms"."""
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    if params is None:
        params = tuned_params("add_norm", norm_key(mode, x.dtype, d, rows), x.device, _norm_default(d, x.dtype))
    out = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    if rows == 0:
        return s, out
    threads = int(params["threads"])
    args = (_ptr(x), _ptr(residual), _ptr(weight), _ptr(bias), _ptr(s if residual is not None else None),
            _ptr(out), np.int32(d), np.float32(eps))  # fmt: skip
    name = f"oasr_add_{mode}_norm_{DTYPE_TAGS[x.dtype]}"
    smem = 4 * (d + 32)
    if _vectorizable(d, x, residual, weight, bias, s, out):
        # whole 16-byte vectors: the row stays in registers, 1, 2 or 4 vectors per thread
        units = d // (16 // x.element_size())
        threads = min(1024, max(threads, -(-units // 4)))
        threads = -(-threads // 32) * 32
        per_thread = -(-units // threads)
        if per_thread <= 4:
            name += f"_v{1 if per_thread == 1 else 2 if per_thread == 2 else 4}"
            smem = 4 * 32
        else:
            threads = int(params["threads"])
    if not MODULE.launch(name, (rows,), (threads,), args, x.device, shared_mem=smem):
        return None
    return s, out


def _norm_inputs_ok(x: torch.Tensor, residual: torch.Tensor | None, params: list[torch.Tensor]) -> bool:
    if not x.is_cuda or x.dtype not in DTYPE_TAGS or not x.is_contiguous() or x.dim() < 1:
        return False
    d = x.shape[-1]
    if not 1 <= d <= MAX_NORM_DIM or x.numel() // d > 2**31 - 1:
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous() or residual.device != x.device):  # fmt: skip
        return False
    return all(p.shape == (d,) and p.dtype == x.dtype and p.is_contiguous() and p.device == x.device
               for p in params)  # fmt: skip


def add_norm_cuda(x: torch.Tensor, residual: torch.Tensor | None, norm: Any) -> Any:
    """Override of ``add_norm`` for :class:`oasr.layers.LayerNorm` and :class:`oasr.layers.RMSNorm`."""
    from oasr.layers.basic import LayerNorm
    from oasr.layers.llm import RMSNorm

    kind = type(norm)
    if kind is LayerNorm:
        params, mode, bias = [norm.weight, norm.bias], "layer", norm.bias
    elif kind is RMSNorm:
        params, mode, bias = [norm.weight], "rms", None
    else:
        return NotImplemented
    if not _norm_inputs_ok(x, residual, params):
        return NotImplemented
    tuned = _norm_params(mode, x)
    if not tuned.get("use_kernel", True):
        return NotImplemented
    result = launch_add_norm(mode, x, residual, norm.weight, bias, float(norm.eps), tuned)
    return NotImplemented if result is None else result


def _norm_params(mode: str, x: torch.Tensor) -> dict[str, Any]:
    d = x.shape[-1]
    key = norm_key(mode, x.dtype, d, x.numel() // d)
    return tuned_params("add_norm", key, x.device, {**_norm_default(d, x.dtype), "use_kernel": USE_BY_DEFAULT[mode]})


def rms_norm_cuda(module: Any, x: torch.Tensor) -> Any:
    """Override of the ``rms_norm`` module op (no residual): one kernel instead of four."""
    if not _norm_inputs_ok(x, None, [module.weight]):
        return NotImplemented
    tuned = _norm_params("rms", x)
    if not tuned.get("use_kernel", True):
        return NotImplemented
    result = launch_add_norm("rms", x, None, module.weight, None, float(module.eps), tuned)
    return NotImplemented if result is None else result[1]


# ------------------------------------------------------------------ bias + activation
def act_key(act: str, dtype: torch.dtype) -> str:
    return f"{'gelu' if act == 'gelu' else 'silu'}:{DTYPE_TAGS[dtype]}"


_ACT_DEFAULT = {"threads": 256, "blocks_per_sm": 16}


def launch_bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: str,
                    params: dict[str, int] | None = None) -> torch.Tensor | None:  # fmt: skip
    if params is None:
        params = tuned_params("bias_act", act_key(act, x.dtype), x.device, _ACT_DEFAULT)
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    d = x.shape[-1]
    threads = int(params["threads"])
    vec = _vectorizable(d, x, bias, out)
    units = n // (16 // x.element_size()) if vec else n
    grid = max(1, min(-(-units // threads), _sms(x.device) * int(params["blocks_per_sm"])))
    name = f"oasr_bias_{'gelu' if act == 'gelu' else 'silu'}_{DTYPE_TAGS[x.dtype]}{'_v' if vec else ''}"
    args = (_ptr(x), _ptr(bias), _ptr(out), np.int64(n), np.int32(d))
    if not MODULE.launch(name, (grid,), (threads,), args, x.device):
        return None
    return out


def bias_act_cuda(x: torch.Tensor, bias: torch.Tensor | None, act: str) -> Any:
    """Override of ``bias_act``."""
    if not x.is_cuda or x.dtype not in DTYPE_TAGS or not x.is_contiguous() or x.dim() < 1:
        return NotImplemented
    if bias is not None and (bias.shape != (x.shape[-1],) or bias.dtype != x.dtype
                             or not bias.is_contiguous() or bias.device != x.device):  # fmt: skip
        return NotImplemented
    tuned = tuned_params("bias_act", act_key(act, x.dtype), x.device,
                         {**_ACT_DEFAULT, "use_kernel": USE_BY_DEFAULT["bias_act"]})  # fmt: skip
    if not tuned.get("use_kernel", True):
        return NotImplemented
    out = launch_bias_act(x, bias, act, tuned)
    return NotImplemented if out is None else out


# ------------------------------------------------------------------ GLU + depthwise conv1d
def dwconv_key(dtype: torch.dtype, k: int) -> str:
    return f"{DTYPE_TAGS[dtype]}:k{k}"


_CONV_OUTPUTS_PER_THREAD = 4  # kConvOutputsPerThread in the .cu
_BTC_OUTPUTS_PER_THREAD = 8  # kBtcOutputsPerThread in the .cu


def _dwconv_default(t_out: int) -> dict[str, int]:
    """Enough threads for one block to cover the sequence (4 outputs each), 32 to 128."""
    return {"threads": min(128, max(32, -(-t_out // (32 * _CONV_OUTPUTS_PER_THREAD)) * 32))}


def launch_glu_dwconv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: int,
                      params: dict[str, int] | None = None) -> torch.Tensor | None:  # fmt: skip
    b, c2, t_in = x.shape
    c, k = weight.shape[0], weight.shape[-1]
    t_out = t_in + 2 * padding - k + 1
    if params is None:
        params = tuned_params("glu_depthwise_conv1d", dwconv_key(x.dtype, k), x.device, _dwconv_default(t_out))
    out = torch.empty((b, c, max(t_out, 0)), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    threads = int(params["threads"])
    tile = threads * _CONV_OUTPUTS_PER_THREAD
    grid = (-(-t_out // tile), c, b)
    args = (_ptr(x), _ptr(weight), _ptr(bias), _ptr(out), np.int32(c), np.int32(t_in), np.int32(t_out),
            np.int32(k), np.int32(padding))  # fmt: skip
    smem = 4 * (k + tile + k - 1)
    if not MODULE.launch(f"oasr_glu_dwconv_{DTYPE_TAGS[x.dtype]}", grid, (threads,), args, x.device,
                         shared_mem=smem):  # fmt: skip
        return None
    return out


def _frames_major(x: torch.Tensor) -> bool:
    """(B, 2C, T) whose memory is a contiguous (B, T, 2C): the pointwise GEMM's output."""
    b, c2, t = x.shape
    return x.stride(1) == 1 and (t == 1 or x.stride(2) == c2) and (b == 1 or x.stride(0) == t * c2)


def btc_dwconv_key(dtype: torch.dtype, k: int) -> str:
    return f"btc:{DTYPE_TAGS[dtype]}:k{k}"


_BTC_DEFAULT = {"channels": 64, "lanes": 8}


def launch_glu_dwconv_btc(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: int,
                          act: bool, params: dict[str, int] | None = None) -> torch.Tensor | None:  # fmt: skip
    """The frames-major kernel: ``x`` (B, 2C, T) over (B, T, 2C) memory -> (B, C, T') over
    (B, T', C) memory (the layout the next pointwise GEMM reads as it lies)."""
    b, c2, t_in = x.shape
    c, k = weight.shape[0], weight.shape[-1]
    t_out = t_in + 2 * padding - k + 1
    if params is None:
        params = tuned_params("glu_depthwise_conv1d", btc_dwconv_key(x.dtype, k), x.device, _BTC_DEFAULT)
    out = torch.empty((b, max(t_out, 0), c), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.transpose(1, 2)
    cw, lanes = int(params["channels"]), int(params["lanes"])
    tile = lanes * _BTC_OUTPUTS_PER_THREAD
    smem = 4 * cw * (k + tile + k - 1)
    while smem > _SMEM_LIMIT and lanes > 1:  # long kernels: a shorter tile
        lanes //= 2
        tile = lanes * _BTC_OUTPUTS_PER_THREAD
        smem = 4 * cw * (k + tile + k - 1)
    if smem > _SMEM_LIMIT:
        return None
    grid = (-(-t_out // tile), -(-c // cw), b)
    args = (_ptr(x), _ptr(weight), _ptr(bias), _ptr(out), np.int32(c), np.int32(t_in), np.int32(t_out),
            np.int32(k), np.int32(padding), np.int32(1 if act else 0), np.int32(cw))  # fmt: skip
    if not MODULE.launch(f"oasr_glu_dwconv_btc_{DTYPE_TAGS[x.dtype]}", grid, (cw * lanes,), args, x.device,
                         shared_mem=smem):  # fmt: skip
        return None
    return out.transpose(1, 2)


def glu_depthwise_conv1d_cuda(x: torch.Tensor, conv: Any, act: str | None = None) -> Any:
    """Override of ``glu_depthwise_conv1d`` for :class:`oasr.layers.DepthwiseConv1d`. Frames-major
    input (the Conformer module's pointwise GEMM output) takes the frames-major kernel, with the
    SiLU fused when asked (on by default: one pass for the native GLU, convolution, bias add and
    SiLU passes); a contiguous (B, 2C, T) input the channel-major one (where tuned faster)."""
    from oasr.layers.conformer import DepthwiseConv1d

    if type(conv) is not DepthwiseConv1d or act not in (None, "swish"):
        return NotImplemented
    if not x.is_cuda or x.dtype not in DTYPE_TAGS or x.dim() != 3:
        return NotImplemented
    w, bias = conv.weight, conv.bias
    c = conv.channels
    if x.shape[1] != 2 * c or w.dtype != x.dtype or w.shape != (c, 1, conv.kernel_size) or not w.is_contiguous():
        return NotImplemented
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return NotImplemented
    if conv.kernel_size > MAX_DWCONV_KERNEL or x.shape[0] > 65535 or c > 65535 * 32:
        return NotImplemented
    if _frames_major(x) and x.numel() < 2**31:
        tuned = tuned_params("glu_depthwise_conv1d", btc_dwconv_key(x.dtype, conv.kernel_size), x.device,
                             {**_BTC_DEFAULT, "use_kernel": USE_BY_DEFAULT["glu_depthwise_conv1d_btc"]})  # fmt: skip
        if not tuned.get("use_kernel", True):
            return NotImplemented
        out = launch_glu_dwconv_btc(x, w, bias, int(conv.padding), act is not None, tuned)
        return NotImplemented if out is None else out
    if act is not None or not x.is_contiguous() or c > 65535:
        return NotImplemented
    t_out = x.shape[2] + 2 * int(conv.padding) - conv.kernel_size + 1
    tuned = tuned_params("glu_depthwise_conv1d", dwconv_key(x.dtype, conv.kernel_size), x.device,
                         {**_dwconv_default(t_out), "use_kernel": USE_BY_DEFAULT["glu_depthwise_conv1d"]})  # fmt: skip
    if not tuned.get("use_kernel", True):
        return NotImplemented
    out = launch_glu_dwconv(x, w, bias, int(conv.padding), tuned)
    return NotImplemented if out is None else out


# ------------------------------------------------------------------ log-mel from an STFT
def mel_key(m: int, f: int) -> str:
    return f"m{m}:f{f}"


_MEL_DEFAULT = {"frames_per_block": 32, "threads": 256}


def filter_spans(filters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per mel filter, the first and one-past-last bins with a non-zero weight (int32, on the
    filters' device; a few small kernels, no host synchronisation)."""
    nz = filters != 0
    idx = torch.arange(filters.shape[1], device=filters.device)
    hi = torch.where(nz, idx + 1, 0).amax(dim=1)
    lo = torch.minimum(torch.where(nz, idx, filters.shape[1]).amin(dim=1), hi)
    return lo.to(torch.int32), hi.to(torch.int32)


def launch_log_mel(stft: torch.Tensor, filters: torch.Tensor, frames: int,
                   params: dict[str, int] | None = None) -> torch.Tensor | None:  # fmt: skip
    m, f = filters.shape
    lead = stft.shape[:-2]
    # (F, T') -> (1, F, T') is a view whatever the strides; more leading axes need contiguity
    spec = torch.view_as_real(stft.unsqueeze(0) if stft.dim() == 2 else stft.reshape(-1, *stft.shape[-2:]))
    b = spec.shape[0]
    if params is None:
        params = tuned_params("log_mel_power", mel_key(m, f), stft.device, _MEL_DEFAULT)
    out = torch.empty((b, m, frames), dtype=torch.float32, device=stft.device)
    if out.numel() == 0:
        return out.reshape(*lead, m, frames)
    tt, threads = int(params["frames_per_block"]), int(params["threads"])
    while tt > 1 and 4 * f * (tt + 1) > _SMEM_LIMIT:  # the tile's power spectrum is in shared memory
        tt //= 2
    lo, hi = filter_spans(filters)
    sb, sf, st, _ = spec.stride()
    args = (_ptr(spec), np.int64(sb), np.int64(sf), np.int64(st), _ptr(filters), _ptr(lo), _ptr(hi),
            _ptr(out), np.int32(f), np.int32(m), np.int32(frames), np.int32(tt),
            np.int32(1 if abs(sf) < abs(st) else 0))  # fmt: skip
    grid = (-(-frames // tt), b)
    if not MODULE.launch("oasr_log_mel_f32", grid, (threads,), args, stft.device, shared_mem=4 * f * (tt + 1)):
        return None
    return out.reshape(*lead, m, frames)


def log_mel_power_cuda(stft: torch.Tensor, filters: torch.Tensor, frames: int) -> Any:
    """Override of ``log_mel_power`` (complex64 STFT, float32 filters)."""
    if not stft.is_cuda or stft.dtype != torch.complex64 or stft.dim() < 2:
        return NotImplemented
    if filters.dtype != torch.float32 or filters.dim() != 2 or not filters.is_contiguous():
        return NotImplemented
    if filters.device != stft.device or filters.shape[1] != stft.shape[-2]:
        return NotImplemented
    if not 0 <= frames <= stft.shape[-1] or 8 * filters.shape[1] > _SMEM_LIMIT:
        return NotImplemented
    if stft.dim() > 3 and not stft.is_contiguous():
        return NotImplemented
    tuned = tuned_params("log_mel_power", mel_key(*filters.shape), stft.device,
                         {**_MEL_DEFAULT, "use_kernel": USE_BY_DEFAULT["log_mel_power"]})  # fmt: skip
    if not tuned.get("use_kernel", True):
        return NotImplemented
    out = launch_log_mel(stft, filters, frames, tuned)
    return NotImplemented if out is None else out


# ------------------------------------------------------------------ autotuning
def _norm_tunable(mode: str) -> Tunable:
    def make(shape: dict, dtype: torch.dtype, device: torch.device):
        rows, d = int(shape["rows"]), int(shape["dim"])
        x = torch.randn(rows, d, device=device, dtype=dtype)
        r = torch.randn_like(x)
        w, b = torch.randn(d, device=device, dtype=dtype), torch.randn(d, device=device, dtype=dtype)
        return lambda p: launch_add_norm(mode, x, r, w, b if mode == "layer" else None, 1e-5, p)

    def native(shape: dict, dtype: torch.dtype, device: torch.device):
        import oasr.layers as L
        from oasr.layers.llm import RMSNorm

        rows, d = int(shape["rows"]), int(shape["dim"])
        x, r = torch.randn(rows, d, device=device, dtype=dtype), torch.randn(rows, d, device=device, dtype=dtype)
        norm = L.LayerNorm(d, device=device, dtype=dtype) if mode == "layer" else RMSNorm(d, 1e-5, device, dtype)
        return _without_overrides(lambda: L.add_norm(x, r, norm))

    return Tunable(
        op="add_norm",
        key=lambda shape, dtype: norm_key(mode, dtype, int(shape["dim"]), int(shape["rows"])),
        candidates=lambda shape: [{"threads": t} for t in sorted({64, 128, 256, 512, 1024,
                                                                  _norm_default(int(shape["dim"]))["threads"]})],  # fmt: skip
        make=make,
        default=lambda shape: _norm_default(int(shape["dim"])),
        shapes=[{"rows": 96000, "dim": 1280}, {"rows": 64, "dim": 1280}, {"rows": 24000, "dim": 512},
                {"rows": 24000, "dim": 256}, {"rows": 4096, "dim": 3584}],  # fmt: skip
        variant=mode,
        native=native,
    )


def _act_tunable() -> Tunable:
    def make(shape: dict, dtype: torch.dtype, device: torch.device):
        x = torch.randn(int(shape["rows"]), int(shape["dim"]), device=device, dtype=dtype)
        b = torch.randn(int(shape["dim"]), device=device, dtype=dtype)
        return lambda p: launch_bias_act(x, b, shape.get("act", "gelu"), p)

    def native(shape: dict, dtype: torch.dtype, device: torch.device):
        import oasr.layers as L

        x = torch.randn(int(shape["rows"]), int(shape["dim"]), device=device, dtype=dtype)
        b = torch.randn(int(shape["dim"]), device=device, dtype=dtype)
        return _without_overrides(lambda: L.bias_act(x, b, shape.get("act", "gelu")))

    return Tunable(
        op="bias_act",
        key=lambda shape, dtype: act_key(shape.get("act", "gelu"), dtype),
        candidates=lambda shape: [{"threads": t, "blocks_per_sm": k} for t in (128, 256, 512) for k in (4, 8, 16, 32)],
        make=make,
        default=lambda shape: dict(_ACT_DEFAULT),
        shapes=[{"rows": 24000, "dim": 5120, "act": "gelu"}, {"rows": 24000, "dim": 2048, "act": "silu"}],
        native=native,
    )


def _dwconv_tunable() -> Tunable:
    def make(shape: dict, dtype: torch.dtype, device: torch.device):
        b, c, t, k = (int(shape[n]) for n in ("batch", "channels", "frames", "kernel"))
        x = torch.randn(b, 2 * c, t, device=device, dtype=dtype)
        w = torch.randn(c, 1, k, device=device, dtype=dtype)
        bias = torch.randn(c, device=device, dtype=dtype)
        return lambda p: launch_glu_dwconv(x, w, bias, (k - 1) // 2, p)

    def native(shape: dict, dtype: torch.dtype, device: torch.device):
        import oasr.layers as L
        from oasr.layers.conformer import DepthwiseConv1d

        b, c, t, k = (int(shape[n]) for n in ("batch", "channels", "frames", "kernel"))
        x = torch.randn(b, 2 * c, t, device=device, dtype=dtype)
        conv = DepthwiseConv1d(c, k, padding=(k - 1) // 2, device=device, dtype=dtype)
        return _without_overrides(lambda: L.glu_depthwise_conv1d(x, conv))

    return Tunable(
        op="glu_depthwise_conv1d",
        key=lambda shape, dtype: dwconv_key(dtype, int(shape["kernel"])),
        candidates=lambda shape: [{"threads": t} for t in (32, 64, 128, 256)],
        make=make,
        default=lambda shape: _dwconv_default(int(shape["frames"])),
        shapes=[{"batch": 64, "channels": 256, "frames": 375, "kernel": 15},
                {"batch": 64, "channels": 512, "frames": 375, "kernel": 31},
                {"batch": 64, "channels": 1024, "frames": 375, "kernel": 9}],  # fmt: skip
        native=native,
    )


def _dwconv_btc_tunable() -> Tunable:
    def inputs(shape: dict, dtype: torch.dtype, device: torch.device):
        from oasr.layers.conformer import DepthwiseConv1d

        b, c, t, k = (int(shape[n]) for n in ("batch", "channels", "frames", "kernel"))
        x = torch.randn(b, t, 2 * c, device=device, dtype=dtype).transpose(1, 2)  # frames-major
        return x, DepthwiseConv1d(c, k, padding=(k - 1) // 2, device=device, dtype=dtype)

    def make(shape: dict, dtype: torch.dtype, device: torch.device):
        x, conv = inputs(shape, dtype, device)
        return lambda p: launch_glu_dwconv_btc(x, conv.weight, conv.bias, conv.padding, True, p)

    def native(shape: dict, dtype: torch.dtype, device: torch.device):
        import oasr.layers as L

        x, conv = inputs(shape, dtype, device)
        return _without_overrides(lambda: L.glu_depthwise_conv1d(x, conv, "swish"))

    return Tunable(
        op="glu_depthwise_conv1d",
        key=lambda shape, dtype: btc_dwconv_key(dtype, int(shape["kernel"])),
        candidates=lambda shape: [{"channels": c, "lanes": n} for c in (32, 64) for n in (2, 4, 8, 16)],
        make=make,
        default=lambda shape: dict(_BTC_DEFAULT),
        shapes=[{"batch": 64, "channels": 256, "frames": 749, "kernel": 15},
                {"batch": 64, "channels": 512, "frames": 749, "kernel": 15}],  # fmt: skip
        variant="btc",
        native=native,
    )


def _mel_tunable() -> Tunable:
    def make(shape: dict, dtype: torch.dtype, device: torch.device):
        b, m, frames = int(shape["batch"]), int(shape["mels"]), int(shape["frames"])
        stft = torch.randn(b, 201, frames + 1, dtype=torch.complex64, device=device)
        filt = torch.rand(m, 201, device=device)
        return lambda p: launch_log_mel(stft, filt, frames, p)

    def native(shape: dict, dtype: torch.dtype, device: torch.device):
        import oasr.layers as L

        b, m, frames = int(shape["batch"]), int(shape["mels"]), int(shape["frames"])
        stft = torch.randn(b, 201, frames + 1, dtype=torch.complex64, device=device)
        filt = torch.rand(m, 201, device=device)
        return _without_overrides(lambda: L.log_mel_power(stft, filt, frames))

    return Tunable(
        op="log_mel_power",
        key=lambda shape, dtype: mel_key(int(shape["mels"]), 201),
        candidates=lambda shape: [{"frames_per_block": tt, "threads": t} for tt in (16, 32) for t in (128, 256, 512)],
        make=make,
        default=lambda shape: dict(_MEL_DEFAULT),
        shapes=[{"batch": 64, "mels": 128, "frames": 3000}, {"batch": 64, "mels": 80, "frames": 3000}],
        dtypes=(torch.float32,),
        native=native,
    )


TUNABLES = [_norm_tunable("layer"), _norm_tunable("rms"), _act_tunable(), _dwconv_tunable(), _dwconv_btc_tunable(),
            _mel_tunable()]  # fmt: skip
