"""Run one fusion group's generated kernel on torch tensors: render, compile and load a
template point once, then check the operands and launch it per call. `stof_cc.compile`'s
kernel steps and stage 2 of the search (`tune/model.py`) both launch through here."""

from __future__ import annotations

from typing import Any

import torch

from stof_cc.backends.nvcc import compile_many
from stof_cc.backends.pycuda_backend import Kernel, device_arch, load_kernel
from stof_cc.backends.tensor_map import TENSOR_MAP_FORMAT, encode_2d
from stof_cc.templates.group import MIRROR_MAP, OUTPUT_MAP, GroupProblem, GroupTemplate

_kernels: dict[tuple[str, str], Kernel] = {}
MAX_CACHED_MAPS = 16  # per launch; a key is an operand's address (shapes and strides are fixed per launch)


class GroupInputError(ValueError):
    """A tensor handed to a group kernel does not match what the kernel was generated for."""


class GroupLaunch:
    """A group kernel rendered, compiled and loaded once; calling it checks the inputs and launches."""

    def __init__(self, template: GroupTemplate, problem: GroupProblem, params: dict[str, Any]) -> None:
        self.problem, self.params = problem, params
        source = template.render(problem, params)
        name = template.kernel_name(problem, params)
        self.maps = template.tensor_maps(problem, params)
        arg_format = TENSOR_MAP_FORMAT * len(self.maps) + "P" * (len(problem.operands) + 1)
        if (name, source) not in _kernels:
            _kernels[(name, source)] = load_kernel(source, name, arg_format, arch_features=template.arch_features,
                                                   waits_for_producers=template.waits_for_producers)
        self.kernel = _kernels[(name, source)]
        self.geometry = template.launch(problem, params)
        self.aligned = set(template.aligned_operands(problem, params))
        self.mirrors = any(index == MIRROR_MAP for index, _, _ in self.maps)  # gemm_epilogue's `mirrored`
        self._encoded: dict[tuple, bytes] = {}  # (operand, address) -> tensor map: weights and reused buffers

    def __call__(self, values: dict[str, torch.Tensor], mirror: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``values`` (IR value name -> tensor); return the group's output, a new tensor. A mirrored
        GEMM (gemm_epilogue's `mirrored`) also stores it into ``mirror``: a tensor of the output's shape and
        dtype, contiguous, which may live on another GPU (a peer's buffer mapped here)."""
        operands = self.problem.operands
        tensors = [_checked(self.problem, op.ref, values) for op in operands]
        # a contiguous view at an odd offset (``buf[1:].view(...)``) is read from an aligned copy, as
        # `stof_cc.attention` does: the kernel's 16-byte accesses need an aligned address
        tensors = [t.clone() if op.ref in self.aligned and t.data_ptr() % 16 else t
                   for op, t in zip(operands, tensors, strict=True)]
        out = torch.empty(self.problem.shape, dtype=self.problem.dtype, device=tensors[0].device)
        if self.mirrors:
            _check_mirror(self.problem, mirror)
        elif mirror is not None:
            raise GroupInputError(f"group {self.problem.group.name}: a mirror tensor for a kernel that stores its output once")
        grid, threads, shared = self.geometry
        self.kernel.launch(grid, threads, shared, *self.tensor_map_args(tensors, out, mirror),
                           *(t.data_ptr() for t in tensors), out.data_ptr())
        return out

    def tensor_map_args(self, tensors: list[torch.Tensor], out: torch.Tensor,
                        mirror: torch.Tensor | None = None) -> list[bytes]:
        """The tensor maps the kernel takes first, for these operand tensors, output and mirror
        (encoded once per tensor address)."""
        maps = []
        for index, box_rows, box_cols in self.maps:
            tensor = out if index == OUTPUT_MAP else mirror if index == MIRROR_MAP else tensors[index]
            key = (index, tensor.data_ptr())
            encoded = self._encoded.get(key)  # one lookup: another thread may clear the cache meanwhile
            if encoded is None:
                if len(self._encoded) >= MAX_CACHED_MAPS:
                    self._encoded.clear()
                encoded = self._encoded[key] = encode_2d(tensor, box_rows, box_cols)
            maps.append(encoded)
        return maps


def _check_mirror(problem: GroupProblem, mirror: torch.Tensor | None) -> None:
    """A mirrored kernel's second destination: the output's shape and dtype, contiguous (TMA reads
    its rows at the output's pitch), 16-byte aligned."""
    name = problem.group.name
    if mirror is None:
        raise GroupInputError(f"group {name}: the kernel mirrors its output, and no mirror tensor was given")
    if tuple(mirror.shape) != tuple(problem.shape) or mirror.dtype != problem.dtype:
        raise GroupInputError(f"group {name}: mirror {tuple(mirror.shape)} {mirror.dtype}, the output is "
                              f"{tuple(problem.shape)} {problem.dtype}")
    if not mirror.is_contiguous() or mirror.data_ptr() % 16:
        raise GroupInputError(f"group {name}: the mirror tensor must be contiguous and 16-byte aligned")


def precompile(template: GroupTemplate, problem: GroupProblem, points: list[dict[str, Any]]) -> None:
    """Compile ``points`` of ``template`` for this GPU in parallel (one nvcc process each) into
    the cache, so that launching them one by one finds them compiled. Failures are left for
    the launch to report (it raises the compiler's message)."""
    arch = device_arch() + template.arch_features
    compile_many([(template.render(problem, params), arch) for params in points])


def run_group(template: GroupTemplate, problem: GroupProblem, params: dict[str, Any],
              values: dict[str, torch.Tensor]) -> torch.Tensor:
    """Launch ``template``'s kernel for ``problem`` once (see `GroupLaunch`)."""
    return GroupLaunch(template, problem, params)(values)


def _checked(problem: GroupProblem, ref: str, values: dict[str, torch.Tensor]) -> torch.Tensor:
    if ref not in values:
        raise GroupInputError(f"group {problem.group.name} reads %{ref}, which was not given")
    tensor, spec = values[ref], problem.graph.node(ref).spec
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise GroupInputError(f"%{ref}: expected a CUDA tensor, got {type(tensor).__name__}"
                              f"{'' if not isinstance(tensor, torch.Tensor) else ' on ' + str(tensor.device)}")
    if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
        raise GroupInputError(f"%{ref}: expected {spec}, got {tuple(tensor.shape)} {tensor.dtype}")
    return tensor.contiguous()  # the kernels index flat, row-major
