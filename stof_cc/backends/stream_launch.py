"""Launch a cubin's kernel on any CUDA stream through the driver API (ctypes on libcuda).

PyCUDA launches on the legacy default stream only: it cannot take torch's stream handle. That
is enough for plain calls, and the PyCUDA path stays the one used there; this launcher serves
the rest: a user stream, CUDA graph capture (`stof_cc.compile(..., cuda_graphs=True)`), where
torch's current stream is a capture stream, and kernels taking by-value blobs (TMA tensor maps). It loads the same cubin into the current
(torch's primary) context with ``cuModuleLoadData`` and launches with ``cuLaunchKernel``,
passing one pointer per parameter (``kernelParams``): the driver then places each parameter at
the offset the cubin records, whatever padding the parameters' alignments need. Format codes as in the PyCUDA path (P, i, q, f), plus
``128s`` for a by-value 128-byte blob (a TMA tensor map).
"""

from __future__ import annotations

import ctypes
import functools
import re

FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
DEFAULT_DYNAMIC_SHARED = 48 * 1024


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the error."""


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuFuncSetAttribute",
                 "cuGetErrorString", "cuTensorMapEncodeTiled"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(result: int, call: str, lib=None) -> None:
    if result != 0:
        lib = lib or _libcuda()
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        raise DriverError(f"{call} failed with CUDA error {result}: {(text.value or b'?').decode()}")


_SCALARS = {"P": ctypes.c_uint64, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float}


class ParameterBlock:
    """Storage for one kernel's parameters, typed by ``arg_format`` (``Ns`` takes N bytes), and
    the pointer array ``cuLaunchKernel`` reads; built once and refilled per launch, since
    allocating ctypes objects costs more than the launch. Not for concurrent launches of one
    kernel from several threads (the driver copies the values during the call)."""

    def __init__(self, arg_format: str) -> None:
        self.codes: list[tuple[str, int]] = []
        for count, code in re.findall(r"(\d*)([Piqfs])", arg_format):
            self.codes += [(code, int(count))] if code == "s" else [(code, 0)] * int(count or 1)
        self.objects = [ctypes.create_string_buffer(size) if code == "s" else _SCALARS[code]()
                        for code, size in self.codes]
        self.pointers = (ctypes.c_void_p * len(self.objects))(
            *(ctypes.cast(ctypes.byref(o), ctypes.c_void_p) for o in self.objects))

    def fill(self, args: tuple) -> ctypes.Array:
        if len(args) != len(self.codes):
            raise DriverError(f"{len(self.codes)} parameters, got {len(args)} arguments")
        for obj, (code, size), value in zip(self.objects, self.codes, args, strict=True):
            if code == "s":
                if len(value) != size:
                    raise DriverError(f"a {size}-byte parameter got {len(value)} bytes")
                ctypes.memmove(obj, value, size)
            else:
                obj.value = value
        return self.pointers


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
        self._parameters = ParameterBlock(arg_format)

    def launch(self, grid: tuple[int, int, int], threads: int, shared_bytes: int, stream: int, *args: object) -> None:
        if shared_bytes > self._max_dynamic_shared:
            _check(self.lib.cuFuncSetAttribute(self.function, FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                               shared_bytes), "cuFuncSetAttribute", self.lib)
            self._max_dynamic_shared = shared_bytes
        _check(self.lib.cuLaunchKernel(self.function, *grid, threads, 1, 1, shared_bytes, ctypes.c_void_p(stream),
                                       self._parameters.fill(args), None), f"cuLaunchKernel({self.name})", self.lib)
