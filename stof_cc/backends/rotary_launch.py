"""Launch the rotary-embedding kernel (`templates/rotary.py`) for an attention group's
``rotary`` node: x [B, H, S, D] in its own strides, cos and sin [1 or B, 1, S, D]; the result
is a new contiguous tensor. Compiled and loaded once per (dtype, head dim)."""

from __future__ import annotations

import torch

from stof_cc.backends.pycuda_backend import Kernel, load_kernel
from stof_cc.templates.attention import SUPPORTED_DTYPES
from stof_cc.templates.rotary import ROTARY, RotaryProblem

_kernels: dict[tuple, Kernel] = {}


class RotaryInputError(ValueError):
    """x, cos or sin are not what the rotary kernel reads; names the argument."""


def rotary_unsupported(x_spec, table_spec) -> str | None:
    """Why the kernel cannot run a rotary node with these specs (TensorSpecs), or None."""
    if x_spec.dtype not in SUPPORTED_DTYPES:
        return f"the rotary kernel is fp16/bf16, x is {x_spec.dtype}"
    if table_spec.dtype != x_spec.dtype:
        return f"cos/sin are {table_spec.dtype}, x is {x_spec.dtype}"
    return None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the GPU, as `ir.ops.rotary_reference`."""
    if x.dim() != 4 or not x.is_cuda or x.dtype not in SUPPORTED_DTYPES or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise RotaryInputError(f"x must be a CUDA fp16/bf16 [B, H, S, D] tensor with D even and unit stride in D; "
                               f"got {x.dtype} {tuple(x.shape)} on {x.device}, strides {x.stride()}")
    b, h, s, d = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 4 or table.shape[0] not in (1, b) or tuple(table.shape[1:]) != (1, s, d) \
                or table.dtype != x.dtype or table.device != x.device:
            raise RotaryInputError(f"{name} must be [1 or {b}, 1, {s}, {d}] {x.dtype} on {x.device}; got "
                                   f"{table.dtype} {tuple(table.shape)} on {table.device}")
    if cos.shape[0] != sin.shape[0] or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = (t.expand(b, 1, s, d).contiguous() for t in (cos, sin))  # one layout for both tables
    problem = RotaryProblem(b, h, s, d, x.dtype)
    point = ROTARY.space(problem)[0]
    table_batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    used_strides = (stride for stride, size in zip(x.stride()[:3], x.shape[:3], strict=True) if size > 1)
    element_offsets = (*(t.data_ptr() // t.element_size() for t in (x, cos, sin)), *used_strides,
                       table_batch_stride, cos.stride(2))
    name, params = ROTARY.entry_point(problem, point, all(o % point["vec"] == 0 for o in element_offsets))
    key = (x.dtype, d, name)
    if key not in _kernels:  # one source holds both entry points
        _kernels[key] = load_kernel(ROTARY.render(problem, point), name, ROTARY.arg_format)
    out = torch.empty(b, h, s, d, dtype=x.dtype, device=x.device)
    grid, threads, shared = ROTARY.launch(problem, params)
    _kernels[key].launch(grid, threads, shared, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                         h, s, *x.stride()[:3], table_batch_stride, cos.stride(2), problem.pairs)
    return out
