"""Replacing a model's :class:`oasr.layers.Linear` modules with quantized ones.

A loaded model (an :class:`oasr.model.ASRModel`) holds its network(s) as ``torch.nn.Module``
attributes (``model.network``, ``model.net``). Every ``Linear`` in them is replaced by a
:class:`oasr.layers.quantized.QuantizedLinear`, except the ones the family keeps in higher
precision: module names (relative to the network, ``fnmatch`` patterns) listed in a
``quantization_keep`` attribute of the network class or of the model class. Core adds nothing of
its own: convolutions, norms and embeddings are never ``Linear`` and stay as they are.

A tied output projection (logits ``h E^T`` from the embedding table ``E``) is quantized only
where the family asks for it: a ``quantization_tied`` mapping on the network, ``{target module
name: embedding module name}``, makes an int8 :class:`QuantizedLinear` of the embedding's weight
(no bias, one scale per vocabulary row, activations as two int8 terms per token: ``act_terms=2``)
and sets it at the target name, which the family's forward uses when it is set. The embedding
lookup stays float. Only for ``int8_w8a8`` on the CPU (:func:`tied_applies`).

:func:`quantize_model` given the checkpoint it was loaded from (``source``) keeps the quantized
weights in a disk cache (:mod:`oasr.quantization.cache`) and adopts them in a later process; on
the CPU it has oneDNN's int8 weight packing done on a background thread
(:func:`oasr.layers.quantized.prepack_in_background`; ``OASR_INT8_PREPACK_THREAD=0``: on first
use, inline).
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oasr.errors import UnsupportedOptionError
from oasr.layers.attention import MultiHeadAttention
from oasr.layers.basic import Linear
from oasr.layers.quantized import FORMATS, QuantizedLinear, prepack_in_background
from oasr.quantization import check_method

__all__ = ["QuantizationReport", "attention_dtype_applies", "check_device", "keep_patterns", "networks", "no_int8_gemm_keep_applies", "no_int8_gemm_kept", "quantizable_linears",
           "quantize_model", "quantize_module", "start_prepack", "tied_applies"]  # fmt: skip


@dataclass
class QuantizationReport:
    """What :func:`quantize_model` did: the method, the names of the linears it replaced and of
    those it kept (``network_attr.module.path``)."""

    method: str
    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    #: whether the quantized weights came from the disk cache (:mod:`oasr.quantization.cache`)
    cached: bool = False
    #: the thread packing the CPU int8 weights, while it runs (None: none was started)
    prepack: threading.Thread | None = field(default=None, repr=False, compare=False)


def networks(model: Any) -> dict[str, nn.Module]:
    """The ``torch.nn.Module`` attributes of a loaded model by attribute name (the model itself
    under ``""`` when it is a module)."""
    if isinstance(model, nn.Module):
        return {"": model}
    found: dict[str, nn.Module] = {}
    seen: set[int] = set()
    for name, value in vars(model).items():
        if isinstance(value, nn.Module) and id(value) not in seen:
            seen.add(id(value))
            found[name] = value
    return found


def keep_patterns(model: Any, net: nn.Module) -> tuple[str, ...]:
    """The family's keep-in-high-precision patterns: ``quantization_keep`` of the network and
    of the model (class attributes; tuples of ``fnmatch`` patterns over module names)."""
    pats: list[str] = []
    for owner in (net, model):
        pats.extend(getattr(owner, "quantization_keep", ()) or ())
    return tuple(dict.fromkeys(pats))


def _device(net: nn.Module) -> torch.device:
    for t in net.parameters():
        return t.device
    for t in net.buffers():
        return t.device
    return torch.device("cpu")


def check_device(method: str, device: torch.device | str) -> None:
    """A typed error when ``method`` cannot run on ``device``: fp8 needs a CUDA GPU of compute
    capability 8.9 or later (or the CPU, through torch's fp8 GEMM); int8 runs on CPU and CUDA."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise UnsupportedOptionError(
            f"quantization {method} runs on cpu or cuda, not {dev.type}", param="quantization"
        )
    if method == "fp8_w8a8" and dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(dev)
            raise UnsupportedOptionError(
                f"quantization fp8_w8a8 needs a GPU with fp8 tensor cores (compute capability "
                f">= 8.9: Ada, Hopper, Blackwell); {name} is {major}.{minor}. Use int8_w8a8",
                param="quantization",
            )


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


#: switch for quantizing tied output projections on the CPU (``OASR_INT8_TIED_OUTPUT=0``: keep
#: them float)
TIED_ENV = "OASR_INT8_TIED_OUTPUT"


def tied_applies(method: str, device: torch.device | str) -> bool:
    """Whether a family's tied output projection (``quantization_tied``) is quantized: for int8
    on the CPU, where a decode step reads the whole float table (tiny.en: 51 864 x 384 float32,
    80 MB) and the int8 GEMM a quarter of it, unless ``OASR_INT8_TIED_OUTPUT=0``. Not on CUDA
    (unmeasured there) nor for fp8 (a vocabulary size is rarely the multiple of 16 torch's fp8
    GEMM needs)."""
    from oasr.defaults import env_switch

    if not env_switch(TIED_ENV, True):
        return False
    return method == "int8_w8a8" and torch.device(device).type == "cpu"


#: switch for the linears a family keeps float where the CPU has no int8 GEMM
#: (``OASR_INT8_KEEP_WITHOUT_INT8_GEMM=0``: quantize them anyway)
NO_INT8_GEMM_KEEP_ENV = "OASR_INT8_KEEP_WITHOUT_INT8_GEMM"


def no_int8_gemm_keep_applies(method: str, device: torch.device | str) -> bool:
    """Whether the linears a family lists in ``quantization_keep_without_int8_gemm`` stay float:
    for int8 on a CPU whose int8 GEMM runs as float32 matmuls of the int8 values (an x86 CPU
    without VNNI / AMX, :func:`oasr.layers.quantized.int8_gemm_is_float32`). There int8 saves
    neither weight reads nor arithmetic, and a decode step's few rows cost more to quantize than
    to multiply (tiny.en's decoder linears at 9 rows, 2 threads on an AVX2 EPYC: 186 / 371 /
    427 us int8 against 67 / 244 / 220 us float32), so float is faster and exact. Unless
    ``OASR_INT8_KEEP_WITHOUT_INT8_GEMM=0``."""
    from oasr.defaults import env_switch
    from oasr.layers.quantized import int8_gemm_is_float32

    if not env_switch(NO_INT8_GEMM_KEEP_ENV, True):
        return False
    return method == "int8_w8a8" and torch.device(device).type == "cpu" and int8_gemm_is_float32()


def _keep_for(model: Any, net: nn.Module, method: str, no_int8_gemm_keep: bool | None) -> tuple[str, ...]:
    """The keep patterns for ``net``: the family's, plus ``quantization_keep_without_int8_gemm``
    when ``no_int8_gemm_keep`` (None: where :func:`no_int8_gemm_keep_applies`)."""
    keep = keep_patterns(model, net)
    if no_int8_gemm_keep is None:
        no_int8_gemm_keep = no_int8_gemm_keep_applies(method, _device(net))
    if no_int8_gemm_keep:
        keep += tuple(p for p in getattr(net, "quantization_keep_without_int8_gemm", ()) or () if p not in keep)
    return keep


def no_int8_gemm_kept(model: Any) -> set[str]:
    """The full names of the linears a family lists in ``quantization_keep_without_int8_gemm``
    (whatever the CPU): a quantized checkpoint that quantized any of them loads with them
    quantized."""
    out: set[str] = set()
    for attr, net in networks(model).items():
        pats = getattr(net, "quantization_keep_without_int8_gemm", ()) or ()
        for name, module in net.named_modules():
            if isinstance(module, Linear) and _matches(name, pats):
                out.add(f"{attr}.{name}" if attr else name)
    return out


#: switch for bfloat16 long self-attention under int8 on the CPU (``OASR_INT8_BF16_ATTENTION=0``:
#: keep it float32)
ATTENTION_ENV = "OASR_INT8_BF16_ATTENTION"


def _cpu_has_bf16() -> bool:
    """Whether this CPU does bfloat16 arithmetic natively (AVX512-BF16 or AMX): only there is
    bfloat16 attention faster than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def attention_dtype_applies(method: str, device: torch.device | str) -> bool:
    """Whether int8 quantization also runs long self-attention (``MultiHeadAttention``'s
    ``attention_dtype``: an encoder's 1500 x 1500 window) in bfloat16: for int8 on a CPU with
    native bfloat16, unless ``OASR_INT8_BF16_ATTENTION=0``. tiny.en at 1 thread: the encoder's
    flash attention 30 -> 14 ms per layer and window, about half the encoder; the error it adds
    (about 2e-3 absolute on unit-scale attention outputs) is below the int8 activations' own."""
    from oasr.defaults import env_switch

    if not env_switch(ATTENTION_ENV, True):
        return False
    return method == "int8_w8a8" and torch.device(device).type == "cpu" and _cpu_has_bf16()


def _set_module(net: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = net.get_submodule(parent_name) if parent_name else net
    setattr(parent, attr, module)


def quantize_module(
    net: nn.Module,
    method: str,
    keep: Iterable[str] = (),
    input_scales: Mapping[str, torch.Tensor] | None = None,
    prefix: str = "",
    tied: bool | None = None,
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> QuantizationReport:
    """Replace, in place, every :class:`Linear` of ``net`` whose name matches none of ``keep``.
    ``input_scales``: SmoothQuant divisors (K,) by module name for the layers that carry one.
    ``tied``: whether to quantize the network's tied output projections (``quantization_tied``,
    module docstring); None: where :func:`tied_applies`. ``weights``: already quantized weights
    and scales by full name (``prefix.name``; the disk cache's), adopted where their shape fits
    a layer without a SmoothQuant divisor; the others are quantized."""
    canonical = check_method(method)
    assert canonical is not None and canonical in FORMATS
    device = _device(net)
    check_device(canonical, device)
    keep = tuple(keep)
    report = QuantizationReport(canonical)
    targets = [(n, m) for n, m in net.named_modules() if isinstance(m, Linear)]
    for name, module in targets:
        full = f"{prefix}.{name}" if prefix else name
        if _matches(name, keep):
            report.kept.append(full)
            continue
        scale = (input_scales or {}).get(name)
        ready = _ready(weights, full, module.weight) if scale is None else None
        if ready is not None:
            q = QuantizedLinear.from_quantized(*ready, module.bias, canonical, dtype=module.weight.dtype)
        else:
            q = QuantizedLinear.from_linear(module, canonical, scale)
        _set_module(net, name, q)
        report.quantized.append(full)
    if tied is None:
        tied = tied_applies(canonical, device)
    for name, source in (getattr(net, "quantization_tied", None) or {}).items():
        full = f"{prefix}.{name}" if prefix else name
        if not tied or _matches(name, keep):
            report.kept.append(full)
            continue
        weight = net.get_submodule(source).weight
        ready = _ready(weights, full, weight)
        if ready is not None:
            q = QuantizedLinear.from_quantized(*ready, None, canonical, dtype=weight.dtype, act_terms=2)
        else:
            q = QuantizedLinear.from_weight(weight, None, canonical, act_terms=2)
        _set_module(net, name, q)
        report.quantized.append(full)
    if attention_dtype_applies(canonical, device):
        for module in net.modules():
            if isinstance(module, MultiHeadAttention):
                module.attention_dtype = torch.bfloat16
    return report


def _ready(weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None, name: str,
           weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """The cached (qweight, scale) of layer ``name`` when they fit its float ``weight``."""
    got = (weights or {}).get(name)
    if got is None or tuple(got[0].shape) != tuple(weight.shape) or tuple(got[1].shape) != (weight.shape[0],):
        return None
    return got[0].to(weight.device), got[1].to(weight.device)


def _plan(model: Any, nets: Mapping[str, nn.Module], method: str, tied: bool | None,
          no_int8_gemm_keep: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """What :func:`quantize_model` will quantize (the cache's key): networks' dtypes, keep lists,
    whether tied projections are quantized, layer names and shapes."""
    plan: dict[str, Any] = {"nets": {}, "layers": []}
    for attr, net in nets.items():
        keep = _keep_for(model, net, method, no_int8_gemm_keep)
        device = _device(net)
        dtypes = sorted({str(t.dtype) for t in net.parameters()})
        on = tied if tied is not None else tied_applies(method, device)
        plan["nets"][attr] = {"dtypes": dtypes, "keep": list(keep), "tied": on}
        pre = f"{attr}." if attr else ""
        for name, module in net.named_modules():
            if isinstance(module, Linear) and not _matches(name, keep):
                plan["layers"].append([pre + name, list(module.weight.shape)])
        for name, source in (getattr(net, "quantization_tied", None) or {}).items():
            if on and not _matches(name, keep):
                plan["layers"].append([pre + name, list(net.get_submodule(source).weight.shape)])
    return plan


def quantizable_linears(model: Any) -> dict[str, Linear]:
    """The linears :func:`quantize_model` would replace, by ``"<network attr>.<module name>"``."""
    out: dict[str, Linear] = {}
    for attr, net in networks(model).items():
        keep = keep_patterns(model, net)
        for name, module in net.named_modules():
            if isinstance(module, Linear) and not _matches(name, keep):
                out[f"{attr}.{name}" if attr else name] = module
    return out


def quantize_model(
    model: Any,
    method: str,
    input_scales: Mapping[str, torch.Tensor] | None = None,
    tied: bool | None = None,
    source: str | Path | None = None,
    prepack: bool = True,
    no_int8_gemm_keep: bool | None = None,
) -> QuantizationReport:
    """Quantize every network of a loaded model in place (the family's keep list honoured);
    ``input_scales`` are keyed ``"<network attr>.<module name>"``; ``tied`` as
    :func:`quantize_module`. The model's ``quantization`` attribute is set to the report.

    ``source``: the checkpoint the model was loaded from; with it (and no ``input_scales``) the
    quantized weights go through the disk cache (:mod:`oasr.quantization.cache`). ``prepack``:
    start packing CPU int8 weights on a background thread (``report.prepack``) unless
    ``OASR_INT8_PREPACK_THREAD=0``. ``no_int8_gemm_keep``: whether the linears the family keeps
    where the CPU has no int8 GEMM stay float (None: where :func:`no_int8_gemm_keep_applies`;
    a saved quantized checkpoint says which, whatever this CPU)."""
    canonical = check_method(method)
    if canonical is None:
        raise UnsupportedOptionError(f"quantization {method!r}: name a method", param="quantization")
    nets = networks(model)
    if not nets:
        raise UnsupportedOptionError(
            f"{getattr(model, 'name', type(model).__name__)} holds no torch network to quantize",
            param="quantization",
        )
    report = QuantizationReport(canonical)
    entry, cached = (_cache_lookup(model, nets, canonical, tied, source, no_int8_gemm_keep) if not input_scales
                     else (None, None))  # fmt: skip
    for attr, net in nets.items():
        scales = None
        if input_scales:
            pre = f"{attr}." if attr else ""
            scales = {k[len(pre):]: v for k, v in input_scales.items() if k.startswith(pre)}
        r = quantize_module(net, canonical, _keep_for(model, net, canonical, no_int8_gemm_keep), scales, prefix=attr, tied=tied,
                            weights=cached)  # fmt: skip
        report.quantized += r.quantized
        report.kept += r.kept
    if not report.quantized:
        raise UnsupportedOptionError(
            f"{getattr(model, 'name', type(model).__name__)} has no linear layer to quantize",
            param="quantization",
        )
    layers = {name: _module(nets, name) for name in report.quantized}
    report.cached = cached is not None and set(cached) == set(layers)
    if entry is not None and not report.cached:
        from oasr.quantization import cache

        cache.store(*entry, {n: (m.qweight, m.weight_scale) for n, m in layers.items()})
    if prepack:
        start_prepack(report, layers.values())
    try:
        model.quantization = report
    except AttributeError:  # a model with __slots__: the report is still returned
        pass
    return report


#: switch for packing CPU int8 weights on a background thread (``OASR_INT8_PREPACK_THREAD=0``:
#: on first use, inline)
PREPACK_ENV = "OASR_INT8_PREPACK_THREAD"


def start_prepack(report: QuantizationReport, layers: Iterable[nn.Module]) -> None:
    """Start :func:`prepack_in_background` over ``layers`` (in order) unless switched off."""
    from oasr.defaults import env_switch

    if env_switch(PREPACK_ENV, True):
        report.prepack = prepack_in_background(m for m in layers if isinstance(m, QuantizedLinear))


def _module(nets: Mapping[str, nn.Module], name: str) -> nn.Module:
    if "" in nets:
        return nets[""].get_submodule(name)
    attr, _, rest = name.partition(".")
    return nets[attr].get_submodule(rest)


def _cache_lookup(model: Any, nets: Mapping[str, nn.Module], method: str, tied: bool | None,
                  source: str | Path | None, no_int8_gemm_keep: bool | None = None) -> tuple[Any, Any]:  # fmt: skip
    """((entry path, key) or None, cached weights or None) for :func:`quantize_model`."""
    from oasr.quantization import cache

    if source is None or not cache.enabled():
        return None, None
    try:
        device = _device(next(iter(nets.values()))).type
        entry = cache.entry_path(Path(source), method, device, _plan(model, nets, method, tied, no_int8_gemm_keep))
    except OSError:  # the checkpoint's files cannot be listed: no cache
        return None, None
    return entry, cache.load(*entry)
