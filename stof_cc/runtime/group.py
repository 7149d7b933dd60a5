"""Run one fusion group's generated kernel on torch tensors (the GPU path of the group
templates; `stof_cc.compile`'s CompiledModule, issue 7, will sequence these)."""

from __future__ import annotations

from typing import Any

import torch

from stof_cc.backends.pycuda_backend import Kernel, load_kernel
from stof_cc.templates.group import GroupProblem, GroupTemplate

_kernels: dict[tuple[str, str], Kernel] = {}


class GroupInputError(ValueError):
    """A tensor handed to a group kernel does not match what the kernel was generated for."""


def run_group(template: GroupTemplate, problem: GroupProblem, params: dict[str, Any],
              values: dict[str, torch.Tensor]) -> torch.Tensor:
    """Launch ``template``'s kernel for ``problem`` reading ``values`` (IR value name -> tensor)
    and return the group's output, a new tensor on the inputs' device."""
    tensors = [_checked(problem, op["ref"], values) for op in problem.details["operands"]]
    vec = params.get("vec", 1)
    misaligned = [op["ref"] for op, t in zip(problem.details["operands"], tensors, strict=True)
                  if vec > 1 and t.data_ptr() % 16]
    if misaligned:
        raise GroupInputError(f"group {problem.group.name}: %{misaligned[0]} is not 16-byte aligned; "
                              "use the vec=1 variant")
    out = torch.empty(problem.shape, dtype=problem.dtype, device=tensors[0].device)
    source = template.render(problem, params)
    name = template.kernel_name(problem, params)
    if (name, source) not in _kernels:
        _kernels[(name, source)] = load_kernel(source, name, "P" * (len(tensors) + 1),
                                               arch_features=template.arch_features)
    grid, threads, shared = template.launch(problem, params)
    _kernels[(name, source)].launch(grid, threads, shared, *(t.data_ptr() for t in tensors), out.data_ptr())
    return out


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
