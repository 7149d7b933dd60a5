"""TMA tensor maps (``CUtensorMap``) for kernels that load tiles with the Hopper tensor memory
accelerator (``cp.async.bulk.tensor``), encoded with the driver's ``cuTensorMapEncodeTiled``
through ctypes.

A tensor map is a 128-byte opaque descriptor holding the tensor's address, shape, strides,
the tile ("box") one copy moves and the shared-memory swizzle. Kernels take it by value as a
``const __grid_constant__`` parameter, so it is packed into the launch's parameter buffer
(format code ``128s``, see `TENSOR_MAP_FORMAT`); such kernels launch through the driver API
(`stream_launch.DriverKernel`), since PyCUDA's prepared calls only pack scalars.
"""

from __future__ import annotations

import ctypes

import torch

from stof_cc.backends.stream_launch import _check, _libcuda

TENSOR_MAP_FORMAT = "128s"  # struct code of one by-value CUtensorMap (alignment 64: put them first)
TENSOR_MAP_BYTES = 128
_DATA_TYPES = {torch.float16: 6, torch.bfloat16: 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO = 0, 3, 3, 0


class TensorMapError(ValueError):
    """A tensor cannot be described by a tensor map (dtype, layout, alignment, box)."""


def encode_2d(tensor: torch.Tensor, box_rows: int, box_cols: int, lib=None) -> bytes:
    """The tensor map of a row-major 2-D view of ``tensor`` (its last dimension the columns,
    the others flattened into rows), copying ``box_rows`` x ``box_cols`` tiles into shared
    memory with the 128-byte swizzle (chunk c of row r lands at chunk c ^ (r % 8)); reads
    past the edges fill zeros."""
    if tensor.dtype not in _DATA_TYPES:
        raise TensorMapError(f"tensor maps are made for fp16/bf16 here, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise TensorMapError(f"a tensor map needs a contiguous tensor, got strides {tensor.stride()}")
    cols = tensor.shape[-1]
    rows = tensor.numel() // cols
    row_bytes = cols * tensor.element_size()
    if tensor.data_ptr() % 16 or row_bytes % 16:
        raise TensorMapError(f"TMA needs a 16-byte aligned address and row pitch; got address "
                             f"{tensor.data_ptr():#x}, {row_bytes}-byte rows")
    if box_cols * tensor.element_size() != 128 or not 0 < box_rows <= 256:
        raise TensorMapError(f"box {box_rows} x {box_cols}: the 128-byte swizzle needs 128-byte box rows "
                             "and at most 256 of them")
    lib = lib or _libcuda()
    out = ctypes.create_string_buffer(TENSOR_MAP_BYTES)
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    element_strides = (ctypes.c_uint32 * 2)(1, 1)
    _check(lib.cuTensorMapEncodeTiled(out, _DATA_TYPES[tensor.dtype], 2, ctypes.c_void_p(tensor.data_ptr()), dims,
                                      strides, box, element_strides, _INTERLEAVE_NONE, _SWIZZLE_128B,
                                      _L2_PROMOTION_256B, _OOB_FILL_ZERO),
           f"cuTensorMapEncodeTiled({tuple(tensor.shape)}, box {box_rows}x{box_cols})", lib)
    return out.raw
