"""The driver-API launcher without a GPU: parameter packing and the calls it makes (a fake libcuda)."""

from __future__ import annotations

import ctypes
import struct

import pytest

from stof_cc.backends.stream_launch import DriverError, DriverKernel, pack_arguments


def test_packing_follows_the_cuda_parameter_layout():
    # pointers 8-aligned, int32 4, int64 8-aligned (padding after an odd number of ints), float 4
    packed = pack_arguments("PPiiqf", (0x1000, 0x2000, 7, 9, 1 << 40, 0.5))
    assert len(packed) == 8 + 8 + 4 + 4 + 8 + 4
    assert struct.unpack_from("@q", packed, 24)[0] == 1 << 40
    padded = pack_arguments("Piq", (1, 2, 3))
    assert len(padded) == 8 + 4 + 4 + 8  # the int64 starts 8-aligned


class FakeLib:
    """Records driver calls; cuLaunchKernel reads the packed buffer back like the driver would."""

    def __init__(self, fail: str = "") -> None:
        self.calls, self.fail, self.seen = [], fail, None

    def _result(self, name):
        self.calls.append(name)
        return 1 if name == self.fail else 0

    def cuModuleLoadData(self, module, image):
        return self._result("cuModuleLoadData")

    def cuModuleGetFunction(self, function, module, name):
        return self._result("cuModuleGetFunction")

    def cuFuncSetAttribute(self, function, attribute, value):
        self.attribute = (attribute, value)
        return self._result("cuFuncSetAttribute")

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        size = ctypes.cast(extra[3], ctypes.POINTER(ctypes.c_size_t)).contents.value
        self.seen = ((gx, gy, gz), (bx, by, bz), shared, stream.value, ctypes.string_at(extra[1], size), extra[4])
        return self._result("cuLaunchKernel")

    def cuGetErrorString(self, result, text):
        return 0


def test_launch_passes_grid_stream_and_the_packed_buffer():
    lib = FakeLib()
    kernel = DriverKernel(b"\x7fELF-cubin", "k", "PPi", lib=lib)
    kernel.launch((3, 2, 1), 128, 64 * 1024, 0xABC, 0x10, 0x20, 5)
    grid, block, shared, stream, buffer, end = lib.seen
    assert grid == (3, 2, 1) and block == (128, 1, 1) and shared == 64 * 1024 and stream == 0xABC
    assert buffer == pack_arguments("PPi", (0x10, 0x20, 5)) and end is None  # CU_LAUNCH_PARAM_END
    assert lib.attribute == (8, 64 * 1024)  # more than 48 KiB of dynamic shared memory: opted in once
    kernel.launch((1, 1, 1), 32, 64 * 1024, 0xABC, 1, 2, 3)
    assert lib.calls.count("cuFuncSetAttribute") == 1


def test_a_failing_driver_call_is_named():
    with pytest.raises(DriverError, match=r"cuModuleGetFunction\(k\) failed with CUDA error 1"):
        DriverKernel(b"cubin", "k", "P", lib=FakeLib(fail="cuModuleGetFunction"))
