"""Programmatic dependent launch (PDL) without a GPU: only kernels whose source waits for their
producer grids before touching global memory are launched with the attribute, and the launch
carries it in the layout cuda.h gives (a fake libcuda reads it back)."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from group_cases import CASES, GEMM_CASES, build

from stof_cc.backends.stream_launch import (
    LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
    DriverKernel,
    LaunchAttribute,
    LaunchConfig,
    dependent_launches,
)
from stof_cc.templates.attention import ATTENTION_TEMPLATES, AttentionProblem
from stof_cc.templates.registry import KernelTemplate

WAIT = "wait_for_producer_grids();"


def _body_before_wait(source: str, kernel_name: str) -> str:
    """The kernel function's text from its parameter list to its first wait call."""
    start = source.index(f"{kernel_name}(")
    assert WAIT in source[start:], f"{kernel_name} never waits for its producer grids"
    return source[start:source.index(WAIT, start)]


def _split_parameters(text: str) -> tuple[list[str], str]:
    """The parameter names of the list opening ``text`` (at its "("), and the text after the list."""
    start = end = text.index("(")
    depth = 1
    while depth:
        end += 1
        depth += {"(": 1, ")": -1}.get(text[end], 0)
    parameters = re.sub(r"//[^\n]*", "", text[start + 1:end])
    return [re.findall(r"(\w+)\s*$", p.strip())[0] for p in parameters.split(",") if p.strip()], text[end + 1:]


def _assert_waits_before_touching_parameters(source: str, kernel_name: str) -> None:
    names, body = _split_parameters(_body_before_wait(source, kernel_name))
    body = re.sub(r"//[^\n]*", "", body)
    assert len(names) >= 2 and "out" in names or "O" in names, names
    for name in names:
        assert not re.search(rf"\b{name}\b", body), f"{kernel_name} uses {name} before waiting for its producers"


@pytest.mark.parametrize("module_type,template,kind", CASES + GEMM_CASES)
def test_group_kernels_wait_before_their_first_global_access(module_type, template, kind):
    assert template.waits_for_producers
    _, _, graph, group = build(module_type, kind, (3, 333, 264), torch.float16)
    problem = template.match(graph, group)
    for params in template.space(problem):
        _assert_waits_before_touching_parameters(template.render(problem, params), template.kernel_name(problem, params))


@pytest.mark.parametrize("template", ATTENTION_TEMPLATES, ids=lambda t: t.name)
def test_attention_kernels_wait_before_their_first_global_access(template):
    assert template.waits_for_producers
    problem = AttentionProblem(2, 3, 300, 300, 64, torch.bfloat16)
    for params in template.space(problem):
        _assert_waits_before_touching_parameters(template.render(problem, params), template.kernel_name(problem, params))


def test_templates_are_not_launched_programmatically_unless_they_say_so():
    assert KernelTemplate.waits_for_producers is False  # a user's template that never heard of PDL


def test_launch_structures_have_cuda_h_layout():
    assert ctypes.sizeof(LaunchAttribute) == 72  # id, 4 bytes of padding, a 64-byte value union
    assert ctypes.sizeof(LaunchConfig) == 56
    assert LaunchConfig.stream.offset == 32 and LaunchConfig.attrs.offset == 40 and LaunchConfig.num_attrs.offset == 48


def test_building_the_launch_attribute_leaves_the_interpreter_alone():
    """The attribute's 1 once went into the interpreter's shared empty bytes object (ctypes hands
    out a char-array field as new bytes): compiling any empty file then raised "source code string
    cannot contain null bytes" (empty __init__.py files of numpy.testing, triton...)."""
    DriverKernel(b"\x7fELF", "k", "P", lib=FakeLib(), waits_for_producers=True)
    compile(b"", "empty.py", "exec")  # raised "source code string cannot contain null bytes" with the corruption


class FakeLib:
    """Records which launch call a kernel made and reads a cuLaunchKernelEx config back."""

    def __init__(self) -> None:
        self.launches = []

    def cuModuleLoadData(self, module, image):
        return 0

    def cuModuleGetFunction(self, function, module, name):
        return 0

    def cuFuncSetAttribute(self, function, attribute, value):
        return 0

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append(("plain", (gx, gy, gz), bx, shared, stream.value))
        return 0

    def cuLaunchKernelEx(self, config_ref, function, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(LaunchConfig)).contents
        attribute = config.attrs[0]
        value = attribute.value.programmatic_stream_serialization
        self.launches.append(("programmatic", (config.grid_x, config.grid_y, config.grid_z),
                              (config.block_x, config.block_y, config.block_z), config.shared_bytes,
                              config.stream, config.num_attrs, attribute.id, value))
        return 0

    def cuGetErrorString(self, result, text):
        return 0


def test_a_kernel_that_waits_is_launched_with_programmatic_stream_serialization():
    lib = FakeLib()
    kernel = DriverKernel(b"cubin", "k", "PPi", lib=lib, waits_for_producers=True)
    kernel.launch((4, 2, 1), 256, 1024, 0xABC, 1, 2, 3)
    assert lib.launches == [("programmatic", (4, 2, 1), (256, 1, 1), 1024, 0xABC, 1,
                             LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)]
    with dependent_launches(False):  # the benchmarks' switch (STOF_CC_PDL=0 sets the default)
        kernel.launch((1, 1, 1), 32, 0, 0xABC, 1, 2, 3)
    kernel.launch((1, 1, 1), 32, 0, 0xABC, 1, 2, 3)
    assert [launch[0] for launch in lib.launches] == ["programmatic", "plain", "programmatic"]


def test_a_kernel_that_does_not_wait_is_launched_plainly():
    lib = FakeLib()
    DriverKernel(b"cubin", "k", "P", lib=lib).launch((1, 1, 1), 32, 0, 0xABC, 1)
    assert lib.launches == [("plain", (1, 1, 1), 32, 0, 0xABC)]
