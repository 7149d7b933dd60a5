"""A rectangle of a mask with its key columns gathered: what one rank of context parallelism
attends with (stof_cc/distributed.py).

    region(mask, seq, q_start, q_len, key_ranges)

is the mask of queries q_start .. q_start + q_len - 1 of ``mask`` (for sequences of ``seq``)
against the keys of ``key_ranges`` ((start, length) pairs: keys start .. start + length - 1),
laid side by side in that order. Its blocks are classified from the parent's exact classes, no
element evaluated: on the parent's grid of the largest blocks that tile both the region's blocks and
its rectangle (sides dividing the block shape, q_start and every range's start and length), a region
block is FULL where all its parent blocks are, EMPTY where all are, else PARTIAL. So FULL blocks stay
FULL (no mask work in the kernel) and EMPTY ones are skipped, whatever the kernel's block shape
(a 192-row block at a chunk start of 7 x 65536, say). Only where that grid would have blocks under
16 x 16 is every block evaluated.
"""

from __future__ import annotations

import functools
import math

import torch

from stof_cc.masks.description import MaskDescription
from stof_cc.masks.errors import MaskError, check_int
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL, BlockGrid, Extent
from stof_cc.masks.runs import ClassRuns

SMALLEST_PARENT_BLOCK = 16  # the parent grid's blocks: no side under this (else the region is evaluated)
POOL_BYTES = 1 << 26  # the parent classes a pooling step holds densely at once
_NONE = -1  # a parent block past the region's rows or keys: neither keeps a region block from FULL or EMPTY


class _Region(MaskDescription):
    def __init__(self, parent: MaskDescription, seq: int, q_start: int, q_len: int,
                 key_ranges: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.parent, self.seq, self.q_start, self.q_len = parent, seq, q_start, q_len
        self.key_ranges = key_ranges
        self.keys = sum(length for _, length in key_ranges)

    def __repr__(self) -> str:
        return (f"region({self.parent!r}, seq={self.seq}, queries {self.q_start}+{self.q_len}, "
                f"keys {' '.join(f'{start}+{length}' for start, length in self.key_ranges)})")

    def _parent_extent(self, ext: Extent) -> Extent:
        return Extent(self.seq, self.seq, ext.batch, ext.heads, ext.open)

    def _dims(self, ext: Extent) -> tuple[int, int]:
        if (ext.seq_q, ext.seq_k) != (self.q_len, self.keys):
            raise MaskError(f"{self!r} is for {self.q_len} queries and {self.keys} keys, "
                            f"used with {ext.seq_q} and {ext.seq_k}")
        return self.parent._dims(self._parent_extent(ext))

    def _fixed(self) -> tuple[int | None, int | None]:
        return self.parent._fixed()

    def _parent_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The parent's key position of each region key index."""
        starts, begins, ends = self._on("key ranges", k.device, lambda: _range_table(self.key_ranges))  # [3, ranges]
        which = torch.bucketize(k, ends, right=True)
        return starts[which] + k - begins[which]

    def _eval(self, ext: Extent | None, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
              k: torch.Tensor) -> torch.Tensor:
        ext = ext or Extent(self.q_len, self.keys)
        return self.parent._eval(self._parent_extent(ext), b, h, q + self.q_start, self._parent_keys(k))

    def _parent_blocks(self, grid: BlockGrid) -> tuple[int, int] | None:
        """The parent block shape whose blocks tile the region's: its sides divide the block shape,
        q_start and every key range's start and length (None where a side would be under
        `SMALLEST_PARENT_BLOCK`)."""
        sub_m = math.gcd(grid.block_m, self.q_start)
        sub_n = functools.reduce(math.gcd, (v for pair in self.key_ranges for v in pair), grid.block_n)
        if min(sub_m, sub_n) < SMALLEST_PARENT_BLOCK:
            return None
        return sub_m, sub_n

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        dims = self._dims(grid.ext)
        shape = self._parent_blocks(grid)
        if shape is None:
            return ClassRuns.filled(grid.shape(*dims), PARTIAL)
        sub_m, sub_n = shape
        per_m, per_n = grid.block_m // sub_m, grid.block_n // sub_n
        parent = self.parent.block_runs(self.seq, self.seq, sub_m, sub_n, grid.ext.batch, grid.ext.heads)
        slices = parent.batch * parent.heads
        first_row = self.q_start // sub_m
        rows_in = -(-self.q_len // sub_m)  # parent block rows holding region queries
        columns = torch.cat([torch.arange(start // sub_n, (start + length) // sub_n)
                             for start, length in self.key_ranges])
        step = max(1, POOL_BYTES // max(1, slices * per_m * grid.n_cb * per_n))  # region block rows per step
        pooled = []
        for top in range(0, grid.n_rb, step):
            count = min(step, grid.n_rb - top)
            local = torch.arange(top * per_m, (top + count) * per_m)
            local = local[local < rows_in]
            rows = (torch.arange(slices).view(-1, 1) * parent.n_rb + first_row + local).flatten()
            mine = parent.take_rows(rows, parent.batch, parent.heads, len(local)).to_dense()[..., columns]
            fine = torch.full((parent.batch, parent.heads, count * per_m, grid.n_cb * per_n), _NONE, dtype=torch.int8)
            fine[:, :, :len(local), :len(columns)] = mine
            fine = fine.view(parent.batch, parent.heads, count, per_m, grid.n_cb, per_n)
            full = ((fine == FULL) | (fine == _NONE)).all(5).all(3)
            empty = ((fine == EMPTY) | (fine == _NONE)).all(5).all(3)
            pooled.append(torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)).to(torch.int8))
        return ClassRuns.from_dense(torch.cat(pooled, dim=2).contiguous())

    def exact_classes(self, grid: BlockGrid) -> bool:
        """Exact where the classes are pooled from the parent's and no parent block row reaches past
        the region's last query: a parent block that does holds other queries too, so its FULL and
        EMPTY hold for the region's part, its PARTIAL may not (the builder evaluates those tiles)."""
        shape = self._parent_blocks(grid)
        return shape is not None and self.q_len % shape[0] == 0


def _range_table(key_ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Per key range (a column): its start in the parent, and where it begins and ends among the region's keys."""
    lengths = torch.tensor([length for _, length in key_ranges], dtype=torch.long)
    ends = lengths.cumsum(0)
    return torch.stack((torch.tensor([start for start, _ in key_ranges], dtype=torch.long), ends - lengths, ends))


def region(mask: MaskDescription, seq: int, q_start: int, q_len: int,
           key_ranges: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> MaskDescription:
    """Queries q_start .. q_start + q_len - 1 of ``mask`` (sequences of ``seq``) against the keys
    of ``key_ranges`` ((start, length) pairs) laid side by side."""
    if not isinstance(mask, MaskDescription):
        raise MaskError(f"region: mask must be a stof_cc.masks description, got {type(mask).__name__}")
    seq = check_int("region", "seq", seq)
    q_len = check_int("region", "q_len", q_len)
    q_start = check_int("region", "q_start", q_start, minimum=0)
    if not all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in key_ranges):
        raise MaskError(f"region: key_ranges must be (start, length) pairs, got {list(key_ranges)}")
    key_ranges = tuple((check_int("region", "key start", start, minimum=0), check_int("region", "key length", length))
                       for start, length in key_ranges)
    if q_start + q_len > seq or not key_ranges or any(start + length > seq for start, length in key_ranges):
        raise MaskError(f"region: queries {q_start}+{q_len} and key ranges {list(key_ranges)} do not fit "
                        f"sequences of {seq}")
    return _Region(mask, seq, q_start, q_len, key_ranges)
