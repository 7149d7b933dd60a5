"""A rectangle of a mask with its key columns gathered: what one rank of context parallelism
attends with (stof_cc/distributed.py).

    region(mask, seq, q_start, q_len, key_ranges)

is the mask of queries q_start .. q_start + q_len - 1 of ``mask`` (for sequences of ``seq``)
against the keys of ``key_ranges`` ((start, length) pairs: keys start .. start + length - 1),
laid side by side in that order. Its blocks are classified from the parent's exact classes (the
region's block rows taken from the parent's runs, no element evaluated) wherever the block shape
divides q_start and every range's start and length, so FULL blocks stay FULL (no mask work in the
kernel) and EMPTY ones are skipped; elsewhere every block is evaluated.
"""

from __future__ import annotations

import torch

from stof_cc.masks.description import MaskDescription
from stof_cc.masks.errors import MaskError, check_int
from stof_cc.masks.geometry import PARTIAL, BlockGrid, Extent
from stof_cc.masks.runs import ClassRuns


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
        return Extent(self.seq, self.seq, ext.batch, ext.heads)

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

    def _reads_parent(self, grid: BlockGrid) -> bool:
        """Whether the region's block rows start on the parent's and its key ranges are whole
        parent block columns: then each region block lies in one parent block."""
        return self.q_start % grid.block_m == 0 and all(
            start % grid.block_n == 0 and length % grid.block_n == 0 for start, length in self.key_ranges)

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        dims = self._dims(grid.ext)
        if not self._reads_parent(grid):
            return ClassRuns.filled(grid.shape(*dims), PARTIAL)
        parent = self.parent.block_runs(self.seq, self.seq, grid.block_m, grid.block_n, grid.ext.batch,
                                        grid.ext.heads)
        n_rb = grid.n_rb
        slices = torch.arange(parent.batch * parent.heads).view(-1, 1) * parent.n_rb
        rows = (slices + self.q_start // grid.block_m + torch.arange(n_rb)).flatten()
        mine = parent.take_rows(rows, parent.batch, parent.heads, n_rb).to_dense()  # only the region's rows
        columns = torch.cat([torch.arange(start // grid.block_n, (start + length) // grid.block_n)
                             for start, length in self.key_ranges])
        return ClassRuns.from_dense(mine[..., columns].contiguous())

    def exact_classes(self, grid: BlockGrid) -> bool:
        """Exact where every region block is a whole parent block; a ragged last block row lies
        in a parent block that reaches past the region: its FULL and EMPTY hold, its PARTIAL
        may not (the builder evaluates those tiles)."""
        return self._reads_parent(grid) and self.q_len % grid.block_m == 0


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
    key_ranges = tuple((check_int("region", "key start", start, minimum=0), check_int("region", "key length", length))
                       for start, length in key_ranges)
    if q_start + q_len > seq or not key_ranges or any(start + length > seq for start, length in key_ranges):
        raise MaskError(f"region: queries {q_start}+{q_len} and key ranges {list(key_ranges)} do not fit "
                        f"sequences of {seq}")
    return _Region(mask, seq, q_start, q_len, key_ranges)
