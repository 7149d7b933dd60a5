"""Run generated kernels on the GPU through PyCUDA, on torch tensors.

Compilation goes through `nvcc.compile_cubin` (arch read from the device, a persistent
cubin cache); PyCUDA loads the cubin into the CUDA primary context, which torch uses
too (``pycuda.autoprimaryctx``), so kernels read and write torch tensors by
``data_ptr()`` with no copies.

Streams: PyCUDA cannot wrap a foreign stream handle, so it launches on the legacy default
stream, torch's current stream unless the caller switched streams. Under any other current
stream (a user stream, CUDA graph capture) the same cubin is launched on that stream through
the driver API instead (`stream_launch.DriverKernel`), so the work is ordered with torch's.

Devices: a kernel launches on torch's current device (callers make the inputs' device current:
`runtime.attention`, `CompiledModule`). PyCUDA serves the device whose primary context it
retained (its bookkeeping knows that context only); on any other device the driver-API launcher
loads the cubin into that device's primary context (the one torch uses) once, and launches there.

Threads: PyCUDA keeps its context on the stack of the thread that imported it; another thread has
none, and loading a module there fails. Kernels loaded or launched on any other thread go through
the driver-API launcher too (torch has made the primary context current in every thread it runs in).
Imported first from a thread other than the main one, PyCUDA's context is taken off that thread's
stack again (PyCUDA aborts the process when a thread ends with a context on it), and every kernel
goes through the driver API.
"""

from __future__ import annotations

import atexit
import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stof_cc.backends.nvcc import Resources, compile_cubin
from stof_cc.backends.stream_launch import DriverKernel


class BackendError(RuntimeError):
    """The GPU backend cannot run here (no GPU, no PyCUDA, unsupported stream...)."""


@functools.cache
def _pycuda() -> tuple:
    """PyCUDA's driver module and the device of the primary context it retained (PyCUDA's own:
    its module loads and prepared calls belong there). Importing ``pycuda.autoprimaryctx`` pushes
    that context, which makes its device current: the caller's device is made current again."""
    before = current_device()
    try:
        import pycuda.autoprimaryctx  # noqa: F401  (retains a device's primary context: torch's too)
        import pycuda.driver as drv
    except ImportError as exc:
        raise BackendError("PyCUDA is not installed: pip install 'stof-cc[gpu]'") from exc
    own = current_device()
    torch.cuda.set_device(before)
    global _pycuda_thread
    if threading.current_thread() is threading.main_thread():
        _pycuda_thread = threading.get_ident()
    else:  # a worker's context stack dies with it, and PyCUDA aborts the process when a context is left
        # on it: taken off again, so every kernel goes through the driver API (a server's first call in
        # a request thread aborted the process when that thread ended: found on the GPU)
        drv.Context.pop()
        finish_up = getattr(pycuda.autoprimaryctx, "_finish_up", None)  # it would pop from the main thread's stack
        if finish_up is not None:
            atexit.unregister(finish_up)
        _pycuda_thread = None
    return drv, own


_pycuda_thread: int | None = None  # the main thread, where it imported PyCUDA: its context stack holds PyCUDA's context


def current_device() -> int:
    """torch's current CUDA device (the private getter skips `current_device()`'s lazy-init checks)."""
    getter = getattr(torch._C, "_cuda_getDevice", None)
    return getter() if getter is not None else torch.cuda.current_device()


def current_raw_stream(device: int) -> int:
    """torch's current stream handle on ``device`` (the private getter costs well under a
    microsecond; the public `current_stream()` builds a Stream object)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is None:
        return torch.cuda.current_stream(device).cuda_stream
    return getter(device)


def device_arch(device: torch.device | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@dataclass
class Kernel:
    """A loaded kernel, prepared for one argument format (struct codes: P pointer, i int32,
    q int64, f float32), so a launch is one pack and one driver call."""

    name: str
    source_path: Path
    resources: Resources | None
    _function: object  # PyCUDA's function, or None where PyCUDA serves another device
    cubin: bytes = b""
    arg_format: str = ""
    _max_dynamic_smem: int = 48 * 1024
    loaded_on: int = 0  # the device whose context holds _function (PyCUDA's), -1 for none
    loaded_thread: int | None = None  # PyCUDA's thread: _function launches there only
    # the same kernel through the driver API, per device: launches off the default stream, with
    # by-value blobs, or on a device other than loaded_on
    _on_devices: dict[int, DriverKernel] = field(default_factory=dict)
    waits_for_producers: bool = False  # may be launched with PDL (see `stream_launch`)
    # what `_driver_kernel_on` needs for a device of another architecture than the cubin's
    arch: str = ""  # the cubin's target (``sm_90a``)
    arch_features: str = ""  # the suffix the source asks for (``a``: wgmma)
    source: str = ""
    source_waits: bool = False  # the source waits for producer grids (PDL where the device has it)

    @property
    def by_value_structs(self) -> bool:
        """Takes byte blobs (tensor maps, ``128s``), which PyCUDA's prepared calls cannot pack:
        launched through the driver API on every stream."""
        return "s" in self.arg_format

    def launch(self, grid: tuple[int, int, int], threads: int, shared_bytes: int, *args: object) -> None:
        """Launch on torch's current device and stream; pointers are passed as ints (``tensor.data_ptr()``)."""
        device = current_device()
        stream = current_raw_stream(device)
        if stream != 0 or self.by_value_structs or device != self.loaded_on or threading.get_ident() != self.loaded_thread:
            on_device = self._on_devices.get(device)
            if on_device is None:  # cuModuleLoadData into the current context: this device's primary one
                on_device = self._on_devices[device] = self._driver_kernel_on(device)
            on_device.launch(grid, threads, shared_bytes, stream, *args)
            return
        if shared_bytes > self._max_dynamic_smem:
            drv = _pycuda()[0]
            self._function.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes)
            self._max_dynamic_smem = shared_bytes
        self._function.prepared_call(grid, (threads, 1, 1), *args, shared_size=shared_bytes)


    def _driver_kernel_on(self, device: int) -> DriverKernel:
        """This kernel in ``device``'s primary context: its cubin, or on a device of another architecture
        (a machine with two GPU generations: the launchers' caches hold one kernel per source) the
        source compiled for that one, with PDL only where the device has it. The first device's cubin
        loaded there failed in the driver (found by a review of cache keys)."""
        cubin = self.cubin
        if self.source and (arch := device_arch(torch.device("cuda", device)) + self.arch_features) != self.arch:
            cubin = compile_cubin(self.source, arch=arch).cubin
        waits = self.source_waits and torch.cuda.get_device_capability(device) >= (9, 0)
        return DriverKernel(cubin, self.name, self.arg_format, waits_for_producers=waits)


def load_kernel(source: str, name: str, arg_format: str, source_path: Path | None = None,
                arch_features: str = "", waits_for_producers: bool = False) -> Kernel:
    """Compile (or fetch from the cache) and load kernel ``name`` from ``source``,
    prepared for ``arg_format``; ``arch_features="a"`` targets e.g. sm_90a.
    ``waits_for_producers``: the source waits for the grids before it (``griddepcontrol.wait``,
    the templates' ``wait_for_producer_grids()``) before touching global memory, so its driver-API
    launches (off the default stream, or with tensor maps) may use programmatic dependent launch
    (sm_90 and newer only; PyCUDA's launches on the default stream never do)."""
    if not torch.cuda.is_available():
        raise BackendError("no CUDA device visible to torch")
    torch.cuda.init()
    arch = device_arch() + arch_features
    compiled = compile_cubin(source, arch=arch, source_path=source_path)
    _, pycuda_device = _pycuda()
    if current_device() == pycuda_device and threading.get_ident() == _pycuda_thread:
        kernel = _load(compiled.cubin, name, str(compiled.source_path), compiled.resources.get(name))
        kernel.loaded_on, kernel.loaded_thread = pycuda_device, _pycuda_thread
    else:  # PyCUDA's context is another device's, or another thread's: the driver-API launcher serves this one
        kernel = Kernel(name, compiled.source_path, compiled.resources.get(name), None, loaded_on=-1)
    kernel.cubin, kernel.arg_format = compiled.cubin, arg_format
    kernel.arch, kernel.arch_features, kernel.source, kernel.source_waits = arch, arch_features, source, waits_for_producers
    kernel.waits_for_producers = waits_for_producers and torch.cuda.get_device_capability() >= (9, 0)
    if kernel._function is not None and not kernel.by_value_structs:
        kernel._function.prepare(arg_format)
    return kernel


@functools.lru_cache(maxsize=512)
def _load_module(cubin: bytes):
    return _pycuda()[0].module_from_buffer(cubin)


def _load(cubin: bytes, name: str, source_path: str, resources: Resources | None) -> Kernel:
    module = _load_module(cubin)
    try:
        function = module.get_function(name)
    except Exception as exc:  # pycuda.driver.LogicError
        raise BackendError(f"kernel {name!r} not found in {source_path}") from exc
    return Kernel(name, Path(source_path), resources, function)
