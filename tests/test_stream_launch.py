"""The driver-API launcher without a GPU: parameter typing and the calls it makes (a fake libcuda)."""

from __future__ import annotations

import ctypes

import pytest

from stof_cc.backends.stream_launch import DriverError, DriverKernel, ParameterBlock


def _read(pointer, ctype):
    return ctypes.cast(pointer, ctypes.POINTER(ctype)).contents.value


def test_parameters_are_typed_by_the_format_and_refilled():
    block = ParameterBlock("PPiqf128s")
    pointers = block.fill((0x1000, 0x2000, 7, 1 << 40, 0.5, bytes(range(128))))
    assert [_read(pointers[i], t) for i, t in enumerate((ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32,
                                                          ctypes.c_int64, ctypes.c_float))] == [0x1000, 0x2000, 7, 1 << 40, 0.5]
    assert pointers[3] % 8 == 0 and pointers[2] % 4 == 0  # each value at its C alignment, as the driver reads it
    assert ctypes.string_at(pointers[5], 128) == bytes(range(128))
    pointers = block.fill((1, 2, 3, 4, 1.5, b"x" * 128))
    assert _read(pointers[0], ctypes.c_uint64) == 1 and _read(pointers[4], ctypes.c_float) == 1.5
    assert ctypes.string_at(pointers[5], 128) == b"x" * 128
    mixed = ParameterBlock("128sPiIq")  # an int after a blob, a 64-bit value after a 32-bit one
    pointers = mixed.fill((b"m" * 128, 0xDEAD_BEEF_0000, -3, 0xFFFF_FFFF, -(1 << 40)))
    assert ctypes.string_at(pointers[0], 128) == b"m" * 128 and _read(pointers[1], ctypes.c_uint64) == 0xDEAD_BEEF_0000
    assert _read(pointers[2], ctypes.c_int32) == -3 and _read(pointers[3], ctypes.c_uint32) == 0xFFFF_FFFF
    assert _read(pointers[4], ctypes.c_int64) == -(1 << 40) and pointers[4] % 8 == 0
    assert len(ParameterBlock("128s128sPP").pointers) == 4
    with pytest.raises(DriverError, match="2 parameters, got 3 arguments"):
        ParameterBlock("PP").fill((1, 2, 3))
    with pytest.raises(DriverError, match="128-byte parameter got 5 bytes"):
        ParameterBlock("128s").fill((b"short",))
    with pytest.raises(DriverError, match="do not fit the format"):  # ctypes would have wrapped it silently
        ParameterBlock("i").fill((1 << 40,))


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
        """Reads each parameter back through its pointer, as the driver does."""
        values = [ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64)).contents.value,
                  ctypes.cast(params[1], ctypes.POINTER(ctypes.c_uint64)).contents.value,
                  ctypes.cast(params[2], ctypes.POINTER(ctypes.c_int32)).contents.value]
        self.seen = ((gx, gy, gz), (bx, by, bz), shared, stream.value, values, extra)
        return self._result("cuLaunchKernel")

    def cuGetErrorString(self, result, text):
        return 0


def test_launch_passes_grid_stream_and_a_pointer_per_parameter():
    lib = FakeLib()
    kernel = DriverKernel(b"\x7fELF-cubin", "k", "PPi", lib=lib)
    kernel.launch((3, 2, 1), 128, 64 * 1024, 0xABC, 0x10, 0x20, 5)
    grid, block, shared, stream, values, extra = lib.seen
    assert grid == (3, 2, 1) and block == (128, 1, 1) and shared == 64 * 1024 and stream == 0xABC
    assert values == [0x10, 0x20, 5] and extra is None
    assert lib.attribute == (8, 64 * 1024)  # more than 48 KiB of dynamic shared memory: opted in once
    kernel.launch((1, 1, 1), 32, 64 * 1024, 0xABC, 1, 2, 3)
    assert lib.calls.count("cuFuncSetAttribute") == 1


def test_a_failing_driver_call_is_named():
    with pytest.raises(DriverError, match=r"cuModuleGetFunction\(k\) failed with CUDA error 1"):
        DriverKernel(b"cubin", "k", "P", lib=FakeLib(fail="cuModuleGetFunction"))


def test_launches_of_one_kernel_from_several_threads_each_pass_their_own_parameters():
    """The driver reads the parameters during the call, and ctypes lets other threads run then: a
    second thread's fill used to overwrite the first's values mid-launch (a launch with another
    call's pointers). The fake driver yields (sleeps) before reading, as a real call may."""
    import threading
    import time

    class SlowLib(FakeLib):
        def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            time.sleep(0.002)  # another thread runs here
            values = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_uint64)).contents.value for i in range(2)]
            self.calls.append(("seen", stream.value, values))
            return 0

    lib = SlowLib()
    kernel = DriverKernel(b"\x7fELF-cubin", "k", "PP", lib=lib)

    def launches(tag: int) -> None:
        for i in range(20):
            kernel.launch((1, 1, 1), 32, 0, tag, tag, i)

    threads = [threading.Thread(target=launches, args=(tag,)) for tag in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen = [c for c in lib.calls if isinstance(c, tuple)]
    assert len(seen) == 60
    assert all(stream == values[0] for _, stream, values in seen), "a launch read another thread's parameters"
    assert sorted(values[1] for _, stream, values in seen if stream == 1) == list(range(20))


def test_a_device_of_another_architecture_gets_the_source_compiled_for_it(monkeypatch):
    """The launchers keep one kernel per source, compiled for the device that loaded it first: on a machine
    with two GPU generations the other device got that cubin, which its driver cannot load (found by a
    review of cache keys). A device of another architecture gets the source compiled for its own, and PDL
    only where it has it."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    import stof_cc.backends.pycuda_backend as backend

    made, compiled = [], []

    class Recorded:
        def __init__(self, cubin, name, arg_format, waits_for_producers=False):
            made.append((cubin, waits_for_producers))

        def launch(self, *args):
            pass

    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(backend, "DriverKernel", Recorded)
    monkeypatch.setattr(backend, "current_raw_stream", lambda device: 7)
    monkeypatch.setattr(backend, "device_arch", lambda device: "sm_{}{}".format(*capability[device.index]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[device])
    monkeypatch.setattr(backend, "compile_cubin", lambda source, arch: compiled.append(arch) or SimpleNamespace(
        cubin=f"{arch} cubin".encode()))
    kernel = backend.Kernel("k", Path("k.cu"), None, None, cubin=b"sm_90 cubin", arg_format="P", loaded_on=-1,
                            arch="sm_90", source="__global__ void k(float*) {}", source_waits=True)
    for device in (0, 1, 0):
        monkeypatch.setattr(backend, "current_device", lambda device=device: device)
        kernel.launch((1, 1, 1), 32, 0, 123)
    assert made == [(b"sm_90 cubin", True), (b"sm_80 cubin", False)] and compiled == ["sm_80"]
