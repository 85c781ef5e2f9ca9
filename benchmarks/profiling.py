"""Where one call's time goes: the family benchmarks' ``--profile`` (torch profiler, CPU and the
device), printed to stderr and returned for the JSON report.

``profile_call(fn, device)`` runs ``fn`` once (after the benchmark's own warm-up) under
``torch.profiler`` and returns the wall seconds, the host seconds spent launching / waiting in the
CUDA runtime, the device's busy seconds (sum of kernel and copy times) and the operators taking
the most device time (or host time on the CPU)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any


def profile_call(fn: Callable[[], Any], device: str, rows: int = 20,
                 all_threads: bool = False) -> dict[str, Any]:  # fmt: skip
    """``all_threads``: also the operators of other threads (an engine's scheduler thread), where
    this torch's profiler can (``_ExperimentalConfig(profile_all_threads=True)``); the device's
    kernels are recorded from every thread either way."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    # OASR_PROFILE_SHAPES=1: one row per operator and input shapes (which tensor a copy is)
    shapes = os.environ.get("OASR_PROFILE_SHAPES", "") not in ("", "0")
    extra: dict[str, Any] = {}
    if all_threads:
        try:
            from torch._C._profiler import _ExperimentalConfig

            extra["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
        except (ImportError, TypeError):
            pass
    with profile(activities=activities, record_shapes=shapes, **extra) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages(group_by_input_shape=shapes)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(averages.table(sort_by=key, row_limit=rows, max_name_column_width=70,
                         max_shapes_column_width=110), file=sys.stderr)
    top = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:rows]
    runtime = sum(e.self_cpu_time_total for e in averages
                  if e.key.startswith("cuda") or e.key.startswith("cudaStream"))  # fmt: skip
    device_busy = sum(e.self_device_time_total for e in averages) if cuda else 0
    return {
        "wall_s": round(wall, 4),
        "cuda_runtime_host_s": round(runtime / 1e6, 4),
        "device_busy_s": round(device_busy / 1e6, 4),
        "launches": int(sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC"))),
        "graph_replays": int(sum(e.count for e in averages if e.key == "cudaGraphLaunch")),
        # where the host's time goes as well (launches, syncs, Python-side ops)
        "top_host": [{"op": e.key, "count": e.count, "ms": round(e.self_cpu_time_total / 1e3, 2)}
                     for e in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]],
        "top": [{"op": e.key, "count": e.count, "ms": round(getattr(e, key) / 1e3, 2),
                 **({"shapes": str(e.input_shapes)[:200]} if shapes else {})} for e in top],
    }  # fmt: skip
