"""A rectangle of a mask with its key columns gathered: what one rank of context parallelism
attends with (stof_cc/distributed.py).

    region(mask, seq, q_start, q_len, chunk, chunks)

is the mask of queries q_start .. q_start + q_len - 1 of ``mask`` (for sequences of ``seq``)
against the keys of chunks ``chunks`` (chunk c: keys c * chunk .. (c + 1) * chunk - 1), laid
side by side in that order. Its blocks are classified from the parent's exact classes (the
region's block rows taken from the parent's runs, no element evaluated) wherever the block shape
divides q_start and the chunk, so FULL blocks stay FULL (no mask work in the kernel) and EMPTY
ones are skipped; elsewhere every block is evaluated.
"""

from __future__ import annotations

import torch

from stof_cc.masks.description import MaskDescription
from stof_cc.masks.errors import MaskError, check_int
from stof_cc.masks.geometry import PARTIAL, BlockGrid, Extent
from stof_cc.masks.runs import ClassRuns


class _Region(MaskDescription):
    def __init__(self, parent: MaskDescription, seq: int, q_start: int, q_len: int, chunk: int,
                 chunks: tuple[int, ...]) -> None:
        super().__init__()
        self.parent, self.seq, self.q_start, self.q_len = parent, seq, q_start, q_len
        self.chunk, self.chunks = chunk, chunks

    def __repr__(self) -> str:
        return (f"region({self.parent!r}, seq={self.seq}, queries {self.q_start}+{self.q_len}, "
                f"key chunks {list(self.chunks)} of {self.chunk})")

    def _parent_extent(self, ext: Extent) -> Extent:
        return Extent(self.seq, self.seq, ext.batch, ext.heads)

    def _dims(self, ext: Extent) -> tuple[int, int]:
        if (ext.seq_q, ext.seq_k) != (self.q_len, self.chunk * len(self.chunks)):
            raise MaskError(f"{self!r} is for {self.q_len} queries and {self.chunk * len(self.chunks)} keys, "
                            f"used with {ext.seq_q} and {ext.seq_k}")
        return self.parent._dims(self._parent_extent(ext))

    def _fixed(self) -> tuple[int | None, int | None]:
        return self.parent._fixed()

    def _key_starts(self, device: torch.device) -> torch.Tensor:
        return self._on("key starts", device, lambda: torch.tensor(self.chunks, dtype=torch.long) * self.chunk)

    def _eval(self, ext: Extent | None, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
              k: torch.Tensor) -> torch.Tensor:
        ext = ext or Extent(self.q_len, self.chunk * len(self.chunks))
        keys = self._key_starts(k.device)[k // self.chunk] + k % self.chunk
        return self.parent._eval(self._parent_extent(ext), b, h, q + self.q_start, keys)

    def _reads_parent(self, grid: BlockGrid) -> bool:
        """Whether the region's block rows start on the parent's and its key chunks are whole
        parent block columns: then each region block lies in one parent block."""
        return self.q_start % grid.block_m == 0 and self.chunk % grid.block_n == 0

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
        per_chunk = self.chunk // grid.block_n
        columns = torch.cat([torch.arange(c * per_chunk, (c + 1) * per_chunk) for c in self.chunks])
        return ClassRuns.from_dense(mine[..., columns].contiguous())

    def exact_classes(self, grid: BlockGrid) -> bool:
        """Exact where every region block is a whole parent block; a ragged last block row lies
        in a parent block that reaches past the region: its FULL and EMPTY hold, its PARTIAL
        may not (the builder evaluates those tiles)."""
        return self._reads_parent(grid) and self.q_len % grid.block_m == 0


def region(mask: MaskDescription, seq: int, q_start: int, q_len: int, chunk: int,
           chunks: list[int] | tuple[int, ...]) -> MaskDescription:
    """Queries q_start .. q_start + q_len - 1 of ``mask`` (sequences of ``seq``) against the key
    chunks ``chunks`` (each ``chunk`` keys long) laid side by side."""
    if not isinstance(mask, MaskDescription):
        raise MaskError(f"region: mask must be a stof_cc.masks description, got {type(mask).__name__}")
    seq = check_int("region", "seq", seq)
    chunk = check_int("region", "chunk", chunk)
    q_len = check_int("region", "q_len", q_len)
    q_start = check_int("region", "q_start", q_start, minimum=0)
    chunks = tuple(int(c) for c in chunks)
    if q_start + q_len > seq or not chunks or any(c < 0 or (c + 1) * chunk > seq for c in chunks):
        raise MaskError(f"region: queries {q_start}+{q_len} and key chunks {list(chunks)} of {chunk} do not fit "
                        f"sequences of {seq}")
    return _Region(mask, seq, q_start, q_len, chunk, chunks)
