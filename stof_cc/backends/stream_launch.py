"""Launch a cubin's kernel on any CUDA stream through the driver API (ctypes on libcuda).

PyCUDA launches on the legacy default stream only: it cannot take torch's stream handle. That
is enough for plain calls, and the PyCUDA path stays the one used there; this launcher serves
the rest: a user stream, CUDA graph capture (`stof_cc.compile(..., cuda_graphs=True)`), where
torch's current stream is a capture stream, and kernels taking by-value blobs (TMA tensor maps). It loads the same cubin into the current
(torch's primary) context with ``cuModuleLoadData`` and launches with ``cuLaunchKernel``,
passing one pointer per parameter (``kernelParams``): the driver then places each parameter at
the offset the cubin records, whatever padding the parameters' alignments need. Format codes as in the PyCUDA path (P, i, q, f), plus
``128s`` for a by-value 128-byte blob (a TMA tensor map).

Programmatic dependent launch (PDL, sm_90+): a kernel whose source waits for the grids before
it (``griddepcontrol.wait``) before it touches global memory may be launched with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` through ``cuLaunchKernelEx``. The GPU
then starts its CTAs (barrier set-up, tensor-map fetch) while the kernel before it drains,
instead of after; under CUDA graph capture the edge becomes a programmatic one. Only kernels
that declare the wait are launched so (a kernel that did not wait could read its producer's
output early); ``STOF_CC_PDL=0`` or `dependent_launches(False)` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import struct
import threading
from collections.abc import Iterator

FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
DEFAULT_DYNAMIC_SHARED = 48 * 1024
LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)

_dependent_launches = os.environ.get("STOF_CC_PDL", "1") != "0"


@contextlib.contextmanager
def dependent_launches(enabled: bool) -> Iterator[None]:
    """Launch (or capture) with programmatic dependent launch on or off inside the block: the
    benchmarks time both; a CUDA graph keeps what was in force when it was captured."""
    global _dependent_launches
    before, _dependent_launches = _dependent_launches, enabled
    try:
        yield
    finally:
        _dependent_launches = before


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the error."""


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cuFuncSetAttribute", "cuGetErrorString", "cuTensorMapEncodeTiled"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(result: int, call: str, lib=None) -> None:
    if result != 0:
        lib = lib or _libcuda()
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        raise DriverError(f"{call} failed with CUDA error {result}: {(text.value or b'?').decode()}")


# struct codes (native alignment) of the format codes: P a 64-bit address, i / I 32-bit, q 64-bit, f float32
_STRUCT_CODES = {"P": "Q", "i": "i", "I": "I", "q": "q", "f": "f"}


class ParameterBlock:
    """Storage for one kernel's parameters, typed by ``arg_format`` (``Ns`` takes N bytes), and
    the pointer array ``cuLaunchKernel`` reads; built once and refilled per launch. The values sit
    in one buffer at their C offsets, so a refill is one `struct.pack_into` (1.9 us for an attention
    kernel's 57 parameters on this project's CPU, the size checks included, where a ctypes object per
    parameter took 9.2).
    One block per kernel: `DriverKernel` fills it and launches under a lock, since ctypes lets other
    threads run during the driver call, which reads the values."""

    def __init__(self, arg_format: str) -> None:
        self.codes: list[tuple[str, int]] = []
        for count, code in re.findall(r"(\d*)([PiIqfs])", arg_format):
            self.codes += [(code, int(count))] if code == "s" else [(code, 0)] * int(count or 1)
        fields = [f"{size}s" if code == "s" else _STRUCT_CODES[code] for code, size in self.codes]
        self.layout = struct.Struct("@" + "".join(fields))
        self.buffer = ctypes.create_string_buffer(max(1, self.layout.size))
        base = ctypes.addressof(self.buffer)
        # each field's offset: the packed size up to and including it, less its own size
        offsets = [struct.calcsize("@" + "".join(fields[: i + 1])) - struct.calcsize("@" + field)
                   for i, field in enumerate(fields)]
        self.pointers = (ctypes.c_void_p * len(fields))(*(base + offset for offset in offsets))
        self._blobs = [(i, size) for i, (code, size) in enumerate(self.codes) if code == "s"]

    def fill(self, args: tuple) -> ctypes.Array:
        if len(args) != len(self.codes):
            raise DriverError(f"{len(self.codes)} parameters, got {len(args)} arguments")
        for i, size in self._blobs:  # struct would pad a short blob with zeros
            if len(args[i]) != size:
                raise DriverError(f"a {size}-byte parameter got {len(args[i])} bytes")
        try:
            self.layout.pack_into(self.buffer, 0, *args)
        except struct.error as exc:  # a value out of its type's range, or of the wrong type
            shown = [f"<{len(a)} bytes>" if isinstance(a, bytes) else a for a in args]  # not the tensor maps' bytes
            raise DriverError(f"kernel parameters {shown} do not fit the format {self.layout.format!r}: {exc}") from None
        return self.pointers


class LaunchAttributeValue(ctypes.Union):
    """CUlaunchAttributeValue: 64 bytes; the programmatic-serialization member is an int."""

    _fields_ = [("programmatic_stream_serialization", ctypes.c_int), ("raw", ctypes.c_ubyte * 64)]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h): grid, block, dynamic shared memory, stream, attributes."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _programmatic_attribute() -> LaunchAttribute:
    """Programmatic stream serialization on. (This once memmoved the 1 into ``attribute.value``
    when that was a char array: ctypes hands out such a field as a new ``bytes``, here the
    shared empty one, so the 1 went into the interpreter's ``b""`` - every later import of an
    empty file failed with "source code string cannot contain null bytes" - and the attribute
    stayed 0.)"""
    attribute = LaunchAttribute(id=LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value.programmatic_stream_serialization = 1
    return attribute


class DriverKernel:
    """One kernel of a cubin, launchable on any stream; ``waits_for_producers``: the source calls
    ``griddepcontrol.wait`` before any global memory access, so it may be launched with PDL."""

    def __init__(self, cubin: bytes, name: str, arg_format: str, lib=None, waits_for_producers: bool = False) -> None:
        self.lib = lib or _libcuda()
        self.name, self.arg_format = name, arg_format
        self._image = ctypes.create_string_buffer(cubin, len(cubin))  # alive as long as the module
        self.module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(self.lib.cuModuleLoadData(ctypes.byref(self.module), self._image), "cuModuleLoadData", self.lib)
        _check(self.lib.cuModuleGetFunction(ctypes.byref(self.function), self.module, name.encode()),
               f"cuModuleGetFunction({name})", self.lib)
        self._max_dynamic_shared = DEFAULT_DYNAMIC_SHARED
        self._parameters = ParameterBlock(arg_format)
        self.waits_for_producers = waits_for_producers
        self._attribute = _programmatic_attribute()
        self._config = LaunchConfig(block_y=1, block_z=1, attrs=ctypes.pointer(self._attribute), num_attrs=1)
        # ctypes releases the GIL for the driver call: a second thread's fill would overwrite the parameters
        # (and the launch config) while the driver reads them
        self._lock = threading.Lock()

    def launch(self, grid: tuple[int, int, int], threads: int, shared_bytes: int, stream: int, *args: object) -> None:
        with self._lock:
            if shared_bytes > self._max_dynamic_shared:
                _check(self.lib.cuFuncSetAttribute(self.function, FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   shared_bytes), "cuFuncSetAttribute", self.lib)
                self._max_dynamic_shared = shared_bytes
            parameters = self._parameters.fill(args)
            if self.waits_for_producers and _dependent_launches:
                config = self._config
                config.grid_x, config.grid_y, config.grid_z = grid
                config.block_x, config.shared_bytes, config.stream = threads, shared_bytes, stream
                _check(self.lib.cuLaunchKernelEx(ctypes.byref(config), self.function, parameters, None),
                       f"cuLaunchKernelEx({self.name}, programmatic)", self.lib)
                return
            _check(self.lib.cuLaunchKernel(self.function, *grid, threads, 1, 1, shared_bytes, ctypes.c_void_p(stream),
                                           parameters, None), f"cuLaunchKernel({self.name})", self.lib)
