"""Compile-on-first-use for oasr-kernels' CUDA sources, and launches on torch's stream.

A :class:`KernelModule` is one ``.cu`` file (with ``csrc/common.cuh`` prepended: NVRTC runs
with no include path). The first launch of any of its kernels compiles the whole file with NVRTC
through CuPy (``cupy.RawModule``) for the current GPU's architecture; CuPy keeps the binary on
disk keyed by the source text, the options, the architecture and the NVRTC version
(``~/.cupy/kernel_cache``, ``CUPY_CACHE_DIR``), so later processes only load it.

:meth:`KernelModule.launch` returns ``False`` (the caller then runs the native op) when the kernel
cannot run here: no CuPy, a compile or load failure (logged once per module, after which the
module stays off for the process), or a first call made inside CUDA graph capture (compiling
and loading cannot be captured; logged once). A failure of a kernel that has run before is a
real error and raises.

Launches use raw ``data_ptr()`` pointers on torch's current stream and read nothing back, so
they are captured in CUDA graphs like any torch op.
"""

from __future__ import annotations

import logging
import threading
from importlib import resources
from typing import Any

import torch

__all__ = ["DTYPE_TAGS", "KernelModule", "torch_stream"]

log = logging.getLogger(__name__)

DTYPE_TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_OPTIONS = ("-std=c++17",)


class _StreamHandle:
    """A raw stream pointer in the CUDA stream protocol (``cupy.cuda.Stream.from_external``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


_streams: dict[int, Any] = {}


def torch_stream(device: torch.device) -> Any:
    """CuPy's view of torch's current stream on ``device`` (inside ``torch.cuda.graph`` that
    is the stream being captured)."""
    ptr = torch.cuda.current_stream(device).cuda_stream
    stream = _streams.get(ptr)
    if stream is None:
        import cupy

        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:  # CuPy >= 14 (ExternalStream is deprecated there)
            stream = from_external(_StreamHandle(ptr))
        else:
            stream = cupy.cuda.ExternalStream(ptr, device.index)
        _streams[ptr] = stream
    return stream


def read_source(filename: str) -> str:
    """``csrc/common.cuh`` followed by ``csrc/<filename>``."""
    root = resources.files("oasr_kernels").joinpath("csrc")
    return root.joinpath("common.cuh").read_text() + "\n" + root.joinpath(filename).read_text()


class KernelModule:
    """One CUDA source file, compiled on the first launch of any of its kernels."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self._lock = threading.Lock()
        self._module: Any = None
        self._kernels: dict[tuple[str, int], Any] = {}
        self._local = threading.local()  # .ready: kernels launched by this thread outside capture
        #: why the module was turned off for this process (empty while it works)
        self.disabled: list[str] = []
        self._warned_capture = False

    def _function(self, name: str, device_index: int) -> Any:
        key = (name, device_index)
        kernel = self._kernels.get(key)
        if kernel is not None:
            return kernel
        with self._lock:
            import cupy

            if self._module is None:
                self._module = cupy.RawModule(code=read_source(self.filename), options=_OPTIONS)
            kernel = self._module.get_function(name)  # compiles (or reads the disk cache), loads
            kernel.kernel  # noqa: B018 - older CuPy versions load on first use: load it now
            self._kernels[key] = kernel
        return kernel

    def compile(self) -> None:
        """Compile and load the whole module now (for warm-up; raises on failure)."""
        import cupy

        with self._lock:
            if self._module is None:
                self._module = cupy.RawModule(code=read_source(self.filename), options=_OPTIONS)
            self._module.compile()

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple, device: torch.device,
               shared_mem: int = 0) -> bool:  # fmt: skip
        """Launch kernel ``name`` on torch's current stream of ``device``. ``False``: it cannot
        run in this process or context (the caller falls back to the native op)."""
        if self.disabled:
            return False
        ready = getattr(self._local, "ready", None)
        if ready is None:
            ready = self._local.ready = set()
        key = (name, device.index)
        first = key not in ready
        if first and torch.cuda.is_current_stream_capturing():
            if not self._warned_capture:
                self._warned_capture = True
                log.warning("oasr-kernels: first call of %s in this thread is inside CUDA graph "
                            "capture; the native op is used there (run the model once eagerly "
                            "before capturing)", name)  # fmt: skip
            return False
        try:
            if device.index == torch.cuda.current_device():
                self._function(name, device.index)(grid, block, args, shared_mem=shared_mem,
                                                   stream=torch_stream(device))  # fmt: skip
            else:  # CuPy compiles, loads and launches on its current device
                with torch.cuda.device(device):
                    self._function(name, device.index)(grid, block, args, shared_mem=shared_mem,
                                                       stream=torch_stream(device))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - never stop inference for a kernel
            if not first:
                raise  # it ran before: a real launch failure, not a missing compiler
            self.disabled.append(f"{type(exc).__name__}: {exc}")
            log.warning("oasr-kernels: %s unavailable (%s: %s); the native ops are used",
                        self.filename, type(exc).__name__, exc)  # fmt: skip
            return False
        if first:
            ready.add(key)
        return True
