"""Launch a cubin's kernel on any CUDA stream through the driver API (ctypes on libcuda).

PyCUDA launches on the legacy default stream only: it cannot take torch's stream handle. That
is enough for plain calls, and the PyCUDA path stays the one used there; this launcher serves
the rest: a user stream, and CUDA graph capture (`stof_cc.compile(..., cuda_graphs=True)`),
where torch's current stream is a capture stream. It loads the same cubin into the current
(torch's primary) context with ``cuModuleLoadData`` and launches with ``cuLaunchKernel``,
passing the arguments as one packed buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``), packed by
``struct`` with the same format codes the PyCUDA path prepares (P, i, q, f) and native
alignment, as the CUDA ABI lays kernel parameters out.
"""

from __future__ import annotations

import ctypes
import functools
import struct

LAUNCH_PARAM_END, LAUNCH_PARAM_BUFFER_POINTER, LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
DEFAULT_DYNAMIC_SHARED = 48 * 1024


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the error."""


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuFuncSetAttribute",
                 "cuGetErrorString"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(result: int, call: str, lib=None) -> None:
    if result != 0:
        lib = lib or _libcuda()
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        raise DriverError(f"{call} failed with CUDA error {result}: {(text.value or b'?').decode()}")


def pack_arguments(arg_format: str, args: tuple) -> bytes:
    """The kernel's parameters as one buffer: native sizes and alignment, as nvcc lays them out."""
    return struct.pack("@" + arg_format, *args)


class DriverKernel:
    """One kernel of a cubin, launchable on any stream."""

    def __init__(self, cubin: bytes, name: str, arg_format: str, lib=None) -> None:
        self.lib = lib or _libcuda()
        self.name, self.arg_format = name, arg_format
        self._image = ctypes.create_string_buffer(cubin, len(cubin))  # alive as long as the module
        self.module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(self.lib.cuModuleLoadData(ctypes.byref(self.module), self._image), "cuModuleLoadData", self.lib)
        _check(self.lib.cuModuleGetFunction(ctypes.byref(self.function), self.module, name.encode()),
               f"cuModuleGetFunction({name})", self.lib)
        self._max_dynamic_shared = DEFAULT_DYNAMIC_SHARED

    def launch(self, grid: tuple[int, int, int], threads: int, shared_bytes: int, stream: int, *args: object) -> None:
        if shared_bytes > self._max_dynamic_shared:
            _check(self.lib.cuFuncSetAttribute(self.function, FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                               shared_bytes), "cuFuncSetAttribute", self.lib)
            self._max_dynamic_shared = shared_bytes
        packed = pack_arguments(self.arg_format, args)
        buffer = ctypes.create_string_buffer(packed, len(packed))
        size = ctypes.c_size_t(len(packed))
        extra = (ctypes.c_void_p * 5)(LAUNCH_PARAM_BUFFER_POINTER, ctypes.cast(buffer, ctypes.c_void_p),
                                      LAUNCH_PARAM_BUFFER_SIZE, ctypes.cast(ctypes.byref(size), ctypes.c_void_p),
                                      LAUNCH_PARAM_END)
        _check(self.lib.cuLaunchKernel(self.function, *grid, threads, 1, 1, shared_bytes, ctypes.c_void_p(stream),
                                       None, extra), f"cuLaunchKernel({self.name})", self.lib)
