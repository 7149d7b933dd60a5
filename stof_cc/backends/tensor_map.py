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
TENSOR_MAP_ALIGN = 64  # cuTensorMapEncodeTiled's alignment requirement for the map it writes
_DATA_TYPES = {torch.float16: 6, torch.bfloat16: 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO = 0, 3, 3, 0


class TensorMapError(ValueError):
    """A tensor cannot be described by a tensor map (dtype, layout, alignment, box)."""


def encode_2d(tensor: torch.Tensor, box_rows: int, box_cols: int, lib=None) -> bytes:
    """The tensor map of a row-major 2-D view of ``tensor`` (its last dimension the columns,
    the others flattened into rows), copying ``box_rows`` x ``box_cols`` tiles into shared
    memory with the 128-byte swizzle (chunk c of row r lands at chunk c ^ (r % 8)); reads
    past the edges fill zeros."""
    _check_dtype(tensor)
    if not tensor.is_contiguous():
        raise TensorMapError(f"a tensor map needs a contiguous tensor, got strides {tensor.stride()}")
    cols = tensor.shape[-1]
    rows = tensor.numel() // cols
    row_bytes = cols * tensor.element_size()
    if tensor.data_ptr() % 16 or row_bytes % 16:
        raise TensorMapError(f"TMA needs a 16-byte aligned address and row pitch; got address "
                             f"{tensor.data_ptr():#x}, {row_bytes}-byte rows")
    _check_box(tensor, box_rows, box_cols)
    return _encode(tensor, (cols, rows), (row_bytes,), (box_cols, box_rows), lib)


def encode_heads(tensor: torch.Tensor, box_rows: int, residues: int = 1, lib=None) -> bytes:
    """The tensor map of attention operand ``tensor`` [batch, heads, rows, head_dim] (unit
    stride in head_dim; any 16-byte multiple strides otherwise, e.g. a transposed
    [batch, rows, heads, head_dim] view), copying ``box_rows`` x 64 tiles (one 128-byte column
    block) with the 128-byte swizzle; rows past the end of a (batch, head) read as zeros.

    5-D: [batch, heads, residues, rows / residues, head_dim]. With ``residues`` d > 1 (a strided
    split) residue r's rows are r, r + d, r + 2 d, ...: each residue is its own sequence."""
    _check_dtype(tensor)
    if tensor.dim() != 4 or tensor.stride(3) != 1:
        raise TensorMapError(f"an attention tensor map needs [batch, heads, rows, head_dim] with unit stride in "
                             f"head_dim, got shape {tuple(tensor.shape)}, strides {tensor.stride()}")
    size = tensor.element_size()
    batch, heads, rows, cols = tensor.shape
    if rows % residues:
        raise TensorMapError(f"{rows} rows do not split into {residues} residues")
    row_stride, head_stride, batch_stride = (st * size for st in tensor.stride()[2::-1])
    dims = (cols, rows // residues, residues, heads, batch)
    steps = (row_stride * residues, row_stride, head_stride, batch_stride)
    # a dimension of extent 1 is never stepped: give it the extent of everything inside it
    strides, inner = [], cols * size
    for step, extent in zip(steps, dims[1:], strict=True):
        strides.append(step if extent > 1 else inner)
        inner = strides[-1] * extent
    if tensor.data_ptr() % 16 or any(st % 16 or st == 0 for st in strides):
        raise TensorMapError(f"TMA needs a 16-byte aligned address and nonzero 16-byte multiple strides; got "
                             f"address {tensor.data_ptr():#x}, strides {tensor.stride()} ({size}-byte elements)")
    _check_box(tensor, box_rows, 64)
    return _encode(tensor, dims, tuple(strides), (64, box_rows, 1, 1, 1), lib)


def _check_dtype(tensor: torch.Tensor) -> None:
    if tensor.dtype not in _DATA_TYPES:
        raise TensorMapError(f"tensor maps are made for fp16/bf16 here, got {tensor.dtype}")


def _check_box(tensor: torch.Tensor, box_rows: int, box_cols: int) -> None:
    if box_cols * tensor.element_size() != 128 or not 0 < box_rows <= 256:
        raise TensorMapError(f"box {box_rows} x {box_cols}: the 128-byte swizzle needs 128-byte box rows "
                             "and at most 256 of them")


def _encode(tensor: torch.Tensor, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...],
            lib=None) -> bytes:
    """cuTensorMapEncodeTiled over ``dims`` (innermost first), byte ``strides`` of all but the
    innermost, ``box`` per dimension: 128-byte swizzle, 256-byte L2 promotion, zero fill."""
    lib = lib or _libcuda()
    rank = len(dims)
    # The driver requires the map 64-byte aligned (ctypes buffers are 16): encode into an aligned
    # window of a larger buffer.
    raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
    offset = -ctypes.addressof(raw) % TENSOR_MAP_ALIGN
    out = (ctypes.c_char * TENSOR_MAP_BYTES).from_buffer(raw, offset)
    _check(lib.cuTensorMapEncodeTiled(out, _DATA_TYPES[tensor.dtype], rank, ctypes.c_void_p(tensor.data_ptr()),
                                      (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
                                      (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
                                      _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO),
           f"cuTensorMapEncodeTiled({tuple(tensor.shape)}, strides {tensor.stride()}, box {box})", lib)
    return out.raw
