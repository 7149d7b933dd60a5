"""A block mask's lists (CSR offsets, columns, PARTIAL tiles' places) from its class grid on the GPU,
replayed from a CUDA graph.

`BlockMask.from_grid` lays the lists out with numpy on the host: the class grid comes over, numpy
ranks the stored blocks, and the arrays go back. That took 0.16-0.26 ms of the lent H100's host per
call at S = 8192 (copies, a dozen numpy steps, the split), a third of a per-call mask_mod build
(docs/decisions.md#per-call-masks-replayed). Here one compiled function ranks the blocks on the
GPU into one int32 buffer of fixed size (every list padded to the grid's block count), the three
offset arrays are copied into pinned host memory in the same graph, and the host reads the sizes
there after its one wait. Where the grid form itself is replayed (one chunk of block rows:
masks/replayed.py), `rank` runs inside that graph, after the form: one replay makes the grid and its
lists (`compiled.grid`). Elsewhere `BlockMask.from_grid` replays `block_lists`' own graph per grid
shape (a copy in, a replay, a clone and a wait), and only for a grid a form compiled for per-call
masks made (the function's one compile costs seconds and each shape's capture milliseconds, which a
mask built once never earns back, nor the cost model's one-off builds of candidate shapes); the
latest `KEPT_GRAPHS` shapes are kept.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

import stof_cc.masks.replayed as replayed
from stof_cc.masks.geometry import FULL, PARTIAL

KEPT_GRAPHS = 8  # grid shapes (and devices) whose graphs are kept, the latest used

_graphs: OrderedDict[tuple, _Graph] = OrderedDict()
_refused: OrderedDict[tuple, None] = OrderedDict()  # shapes failed or evicted: numpy's lists from then on


def block_lists(classes: Tensor) -> tuple[Tensor, np.ndarray] | None:
    """For a CUDA class grid int8 [rows, n_cb]: (`lists(classes)`'s buffer, a copy of its own;
    its three offset arrays on the host, int64 [3, rows + 1]) from the shape's graph, or None
    where the caller lays the lists out itself (a build inside another capture, a capture or replay
    that failed)."""
    if classes.device.type not in replayed.DEVICE_TYPES or replayed.capturing(classes.device):
        return None
    key = (tuple(classes.shape), classes.device)
    return replayed.replay(_graphs, _refused, key, lambda: _Graph(classes), lambda graph: graph.run(classes),
                           KEPT_GRAPHS)


def lists(classes: Tensor) -> Tensor:
    """int32 [3 (rows + 1) + 5 N] for a class grid int8 [rows, n_cb] (N = rows * n_cb blocks):
    full_ptr, part_ptr, any_ptr (rows + 1 each), then full_cols, part_cols, any_cols, any_tile and
    the PARTIAL blocks' flat indices, each padded to N. The lists are in row-major order, so a
    block's place in a list is the count of chosen blocks before it in the flattened grid."""
    rows, n_cb = classes.shape
    blocks = rows * n_cb
    flat = classes.reshape(blocks)
    full, part = flat == FULL, flat == PARTIAL
    stored = full | part
    index = torch.arange(blocks, dtype=torch.int32, device=classes.device)
    column = index % n_cb

    def placed(chosen: Tensor, values: Tensor) -> Tensor:
        place = torch.where(chosen, torch.cumsum(chosen.to(torch.int32), 0, dtype=torch.int32) - 1, blocks)
        return torch.zeros(blocks + 1, dtype=torch.int32, device=classes.device).scatter(
            0, place.to(torch.int64), values)[:blocks]  # the unchosen go to the last slot, dropped

    def offsets(chosen: Tensor) -> Tensor:
        counts = chosen.view(rows, n_cb).sum(1, dtype=torch.int32)
        return torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))

    tile = torch.where(part, torch.cumsum(part.to(torch.int32), 0, dtype=torch.int32) - 1, -1)
    return torch.cat([offsets(full), offsets(part), offsets(stored), placed(full, column), placed(part, column),
                      placed(stored, column), placed(stored, tile), placed(part, index)])


@functools.cache
def _ranker() -> Callable[[Tensor], Tensor]:
    """`lists` compiled once for every grid shape (dynamic sizes): one compile per process, not one
    per shape (Triton's compile of each took seconds, which a serving run's new shapes would pay
    again and again); dynamo may add a variant or two (sizes it specialises, another device). Its
    kernels are slower than a static shape's (50-60 us against 17 at 64 x 64 blocks on the H100):
    where the grid form is compiled for the shape anyway, `compiled.grid` ranks with a static copy."""
    return torch.compile(lists, fullgraph=True, dynamic=True)


def host_offsets(rows: int, device: torch.device) -> Tensor:
    """Where a graph copies the offsets of `lists` for ``rows`` block rows: int32 [3 (rows + 1)] on
    the host, pinned for a CUDA device (the copy then runs inside the graph, without a wait)."""
    return torch.empty(3 * (rows + 1), dtype=torch.int32, pin_memory=device.type == "cuda")


def rank(classes: Tensor, host: Tensor, ranker: Callable[[Tensor], Tensor]) -> Tensor:
    """Inside a graph: ``ranker(classes)`` (`lists` compiled), its offsets copied to ``host``
    (`host_offsets`) without a wait."""
    buffer = ranker(classes)
    host.copy_(buffer[:host.numel()], non_blocking=True)
    return buffer


def read(buffer: Tensor, host: Tensor) -> tuple[Tensor, np.ndarray]:
    """After a replay of `rank`, under its lock (no replay between): a copy of the buffer and, after
    the one wait, the offsets on the host (int64 [3, rows + 1])."""
    copy = buffer.clone()
    if buffer.is_cuda:
        torch.cuda.current_stream().synchronize()  # the one wait: the offsets are on the host
    return copy, host.numpy().astype(np.int64).reshape(3, -1)


def views(buffer: Tensor, ptrs: np.ndarray, rows: int, blocks: int) -> tuple[Tensor, ...]:
    """The lists of `read`'s buffer as `from_grid` takes them: full_ptr, full_cols, part_ptr,
    part_cols, any_ptr, any_cols, any_tile and the PARTIAL blocks' flat indices (views, each as long
    as its offsets say)."""
    n_full, n_part, n_any = (int(n) for n in ptrs[:, -1])
    sizes = [3 * (rows + 1)]  # one split for every view: each list, then the padding after it
    for size in (n_full, n_part, n_any, n_any, n_part):
        sizes += [size, blocks - size]
    offsets, full_cols, _, part_cols, _, any_cols, _, any_tile, _, part_at, _ = buffer.split(sizes)
    full_ptr, part_ptr, any_ptr = offsets.split(rows + 1)
    return full_ptr, full_cols, part_ptr, part_cols, any_ptr, any_cols, any_tile, part_at


class _Graph:
    """One grid shape's capture: the class grid copied in, `lists` compiled, its offsets copied
    to pinned host memory."""

    def __init__(self, classes: Tensor):
        self.classes = classes.clone()
        self.host = host_offsets(classes.shape[0], classes.device)
        self.captured = replayed.Captured(replayed.indexed(classes.device),
                                          lambda: rank(self.classes, self.host, _ranker()))

    def run(self, classes: Tensor) -> tuple[Tensor, np.ndarray]:
        return self.captured.replay(lambda: self.classes.copy_(classes), lambda buffer: read(buffer, self.host))
