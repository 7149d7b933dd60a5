"""Packed documents as the row-window attention kernels read them: each query row's window of keys
[start, end), int32 [B, S, 2], built per call on the inputs' device with no host read (so a CUDA graph
replays it with whatever boundaries its buffers hold), from FlashAttention's cumulative lengths
(`document_windows`) or HF's position ids (`position_windows`): one kernel launch each on a GPU, torch
ops on the CPU."""

from __future__ import annotations

import torch

from stof_cc.backends.pycuda_backend import Kernel, current_device, load_kernel
from stof_cc.templates.attention import GRID_YZ_LIMIT, AttentionInputError
from stof_cc.templates.row_windows import INDEX_TYPES, ROW_WINDOWS, RowWindowsProblem

_kernels: dict[str, Kernel] = {}  # by kernel name
MAX_ROWS = 2 ** 31 - 2 ** 16  # 32-bit row indices, with room for the position kernel's steps past the last row


def document_windows(cu_seqlens: torch.Tensor, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Packed documents as the row-window kernels read them, built on ``device`` with no host read:
    ``cu_seqlens`` (FlashAttention's cumulative lengths, int32 or int64 [n + 1]: 0, then each
    document's end) gives every row of document d the keys [cu[d], cu[d + 1]) and a row past the
    last end none; int32 [batch, seq, 2], the same for every batch element. A CUDA graph that
    captured the call replays it with whatever boundaries the same ``cu_seqlens`` buffer holds.
    A CPU tensor is checked (starts at 0, never decreases); a device one is the caller's to keep
    so (as FlashAttention's varlen functions take it): values are clamped to [0, seq], so a bad one
    can give wrong rows but never a read out of bounds."""
    _check_cu_seqlens(cu_seqlens, batch, seq)
    if cu_seqlens.device.type == "cpu":
        if cu_seqlens[0] != 0 or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()) or cu_seqlens[-1] > seq:
            raise AttentionInputError(f"cu_seqlens must start at 0, never decrease and end at most at the "
                                      f"sequence length {seq}; got {cu_seqlens.tolist()[:8]}"
                                      + ("..." if cu_seqlens.numel() > 8 else ""))
        cu_seqlens = cu_seqlens.to(device)
    elif cu_seqlens.device != device:
        raise AttentionInputError(f"cu_seqlens is on {cu_seqlens.device}; the inputs are on {device}")
    if device.type == "cuda":
        return _document_windows_built(cu_seqlens, batch, seq)
    return windows_of(cu_seqlens, batch, seq)


def windows_on_device(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """`windows_of` in one launch of the row-windows kernel (templates/row_windows.py) on
    ``cu_seqlens``' CUDA device and torch's current stream, value for value: the form a CUDA graph
    captures, where each torch op of `windows_of` would add a launch gap."""
    _check_cu_seqlens(cu_seqlens, batch, seq)
    return _document_windows_built(cu_seqlens, batch, seq)


def position_windows_on_device(ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """`windows_of_positions` in one launch of the row-windows kernel's position form on ``ids``'
    CUDA device (integer [1 | batch, seq]), value for value."""
    _check_sizes(batch, seq)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != seq or ids.shape[0] not in (1, batch) \
            or ids.is_floating_point() or ids.dtype == torch.bool:
        raise AttentionInputError(f"position ids must be an integer tensor [1 or {batch}, {seq}], got "
                                  + (f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor)
                                     else type(ids).__name__))
    _check_id_rows(ids, seq)
    return _position_windows_built(ids, batch, seq)


def _document_windows_built(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """`windows_on_device` once its inputs are checked."""
    cu_seqlens = cu_seqlens.contiguous()
    return _built(RowWindowsProblem("cu_seqlens", cu_seqlens.dtype, batch, seq), cu_seqlens, cu_seqlens.numel())


def _position_windows_built(ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """`position_windows_on_device` once its inputs are checked."""
    ids = ids.to(torch.int64).contiguous()
    return _built(RowWindowsProblem("position_ids", torch.int64, batch, seq, ids.shape[0]), ids, ids.shape[0])


def _built(problem: RowWindowsProblem, source: torch.Tensor, count: int) -> torch.Tensor:
    """int32 [batch, seq, 2] windows written by the kernel for ``problem`` from ``source`` (its
    ``count``: cu_seqlens' entries, or the position ids' rows)."""
    point = ROW_WINDOWS.space(problem)[0]
    name = ROW_WINDOWS.kernel_name(problem, point)
    kernel = _kernels.get(name)
    if kernel is None:
        kernel = _kernels[name] = load_kernel(ROW_WINDOWS.render(problem, point), name, ROW_WINDOWS.arg_format,
                                              waits_for_producers=ROW_WINDOWS.waits_for_producers)
    windows = torch.empty(problem.batch, problem.seq, 2, dtype=torch.int32, device=source.device)
    if windows.numel():  # an empty grid is a launch error
        grid, threads, shared = ROW_WINDOWS.launch(problem, point)
        arguments = (source.data_ptr(), count, windows.data_ptr(), problem.batch, problem.seq)
        if source.device.index == current_device():
            kernel.launch(grid, threads, shared, *arguments)
        else:  # kernels launch on torch's current device
            with torch.cuda.device(source.device):
                kernel.launch(grid, threads, shared, *arguments)
    return windows


def _check_sizes(batch: int, seq: int) -> None:
    """The sizes the kernels index with 32-bit rows (their look-arounds step past the last row)."""
    if seq < 1 or seq > MAX_ROWS or batch < 0:
        raise AttentionInputError(f"packed documents need 1 to {MAX_ROWS} rows and a batch of 0 or more, got "
                                  f"{seq} rows and a batch of {batch}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> None:
    """FlashAttention's cumulative lengths as the builders read them, and the sizes."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in INDEX_TYPES:
        raise AttentionInputError("cu_seqlens must be a 1-D int32 or int64 tensor of cumulative document lengths "
                                  "(0, then each document's end), got "
                                  + (f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
                                     if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__))
    _check_sizes(batch, seq)


def _check_id_rows(ids: torch.Tensor, seq: int) -> None:
    """At most a grid's rows of CTAs: the position kernel runs a row of them per row of ids."""
    if ids.shape[0] > GRID_YZ_LIMIT:
        raise AttentionInputError(f"position_ids for {ids.shape[0]} batch elements; the kernels take at most "
                                  f"{GRID_YZ_LIMIT} (pass one row of ids [{seq}] if every element has the same "
                                  "documents)")


def windows_of(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """`document_windows` once the input is checked, by torch ops on ``cu_seqlens``' device with no
    host read: the CPU's form, and the reference `windows_on_device` is tested against. Values are
    clamped to [0, seq]; rows before the first entry or past the last get no key."""
    device = cu_seqlens.device
    bounds = cu_seqlens.clamp(0, seq).to(torch.int32)
    rows = torch.arange(seq, device=device, dtype=torch.int32)
    document = (torch.searchsorted(bounds, rows, right=True) - 1).clamp(0, bounds.numel() - 2)
    inside = (rows >= bounds[0]) & (rows < bounds[-1])
    outside = torch.where(rows < bounds[0], 0, seq)  # no keys, both ends still never decreasing
    start = torch.where(inside, bounds[document], outside)
    end = torch.where(inside, bounds[document + 1], outside)
    return _windows(start, end, batch)


def position_windows(position_ids: torch.Tensor, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Packed documents from position ids (HF's padding-free batches), as `document_windows` gives
    them from cumulative lengths: a document opens at the first row and wherever an id is not its
    predecessor's + 1 (transformers' rule, `find_packed_sequence_indices`: ids that restart at 0,
    at 1, or jump), and row r sees the keys of its own document. ``position_ids`` [seq] (every batch
    element alike) or [batch, seq] (each its own documents), integer, on ``device``; no host read.
    On a GPU one kernel launch, whose CTAs (one per 1024 rows) each look before and after their rows
    8192 rows a step for the nearest openings: one step where documents are shorter than that, and
    up to S / 8192 for one document of S rows (16 at S = 131072)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2) \
            or position_ids.shape[-1] != seq or position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch) \
            or position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        raise AttentionInputError(f"position_ids must be an integer tensor [{seq}] or [{batch}, {seq}] (ids restarting "
                                  "at 0 at each packed document), got "
                                  + (f"{position_ids.dtype} {tuple(position_ids.shape)}"
                                     if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__))
    if position_ids.device != device:
        raise AttentionInputError(f"position_ids is on {position_ids.device}; the inputs are on {device}")
    _check_sizes(batch, seq)  # before the reshape, which cannot infer a dimension beside 0 rows
    ids = position_ids.reshape(-1, seq)
    _check_id_rows(ids, seq)  # the same limits on every device: what runs on the CPU runs on a GPU
    if device.type == "cuda":
        return _position_windows_built(ids, batch, seq)
    return windows_of_positions(ids, batch, seq)


def windows_of_positions(ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """`position_windows` once the input is checked (``ids`` [1 | batch, seq]), by torch ops on
    their device with no host read: the CPU's form, and the reference of `position_windows_on_device`."""
    device = ids.device
    ids = ids.to(torch.int64)
    rows = torch.arange(seq, device=device, dtype=torch.int32).expand(ids.shape[0], seq)
    opens = torch.cat((torch.ones_like(ids[:, :1], dtype=torch.bool), ids[:, 1:] != ids[:, :-1] + 1), 1)
    start = torch.cummax(torch.where(opens, rows, 0), dim=1).values  # the latest opening at or before r
    openings = torch.where(opens, rows, seq)
    later = torch.cat((openings[:, 1:], torch.full_like(openings[:, :1], seq)), 1)  # the rows after each row
    end = torch.flip(torch.cummin(torch.flip(later, [1]), dim=1).values, [1])  # the next opening, or seq
    return _windows(start, end, batch)


def _windows(start: torch.Tensor, end: torch.Tensor, batch: int) -> torch.Tensor:
    """Row windows as the kernels read them: int32 [batch, seq, 2] of (start, end), contiguous, from
    starts and ends [seq] or [1 | batch, seq]."""
    return torch.stack((start, end), -1).to(torch.int32).expand(batch, start.shape[-1], 2).contiguous()
