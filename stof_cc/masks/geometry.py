"""Sizes and block geometry: the extent of one attention call, the block grid laid over it,
the set of tiles being evaluated, and the three block classes.

Every mask pattern classifies blocks from the same few facts (each block row's query range,
which block columns hold a given range of keys), so they are computed here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stof_cc.masks.bits import n_words, pack

if TYPE_CHECKING:
    from stof_cc.masks.description import MaskDescription
    from stof_cc.masks.runs import ClassRuns

#: Block classes, as int8 codes. Before a block's elements are evaluated, PARTIAL means
#: "maybe partial"; the builder turns all-ones tiles into FULL and all-zeros into EMPTY.
#: The order matters: a union of masks takes the maximum class, an intersection the minimum.
EMPTY, PARTIAL, FULL = 0, 1, 2

#: The longest sequence a mask is built for: positions and their differences fit int32, as
#: FlexAttention's and the kernels' indices do. A mask parameter at least this long (a window,
#: a stride, a length) reaches past every position and is stored as this value.
MAX_SEQ = 2**31 - 1
#: The largest block side: a PARTIAL tile is block_m x block_n bits (8 MiB at this size).
MAX_BLOCK = 8192


@dataclass(frozen=True)
class Extent:
    """The sizes one mask is evaluated for: sequence lengths and the batch and heads it spans."""

    seq_q: int
    seq_k: int
    batch: int = 1
    heads: int = 1
    #: a mask_mod bound to it (`mask_mod_for` given no batch or heads) is called with any b and h, past
    #: ``batch`` and ``heads``: a user mask evaluates there instead of reading bits kept for slice 0
    open: bool = False


@dataclass(frozen=True)
class Tiles:
    """A set of blocks, as parallel int64 index vectors (mask batch, mask head, row, column)."""

    b: torch.Tensor
    h: torch.Tensor
    i: torch.Tensor
    j: torch.Tensor

    def __len__(self) -> int:
        return self.i.numel()

    def select(self, index: torch.Tensor) -> Tiles:
        return Tiles(self.b[index], self.h[index], self.i[index], self.j[index])


def classes_from(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Class grid from two boolean conditions, promoted to 4-D [B|1, H|1, n_rb, n_cb]."""
    out = torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)).to(torch.int8)
    while out.dim() < 4:
        out = out.unsqueeze(0)
    return out


class BlockGrid:
    """The block_m x block_n grid over an extent: per block row i (``rows``) the (clipped,
    inclusive) query range q_lo[i]..q_hi[i], and which block columns hold given keys
    (`touching`, `inside`). Everything here is O(n_rb): a pattern classifies a block row by the
    column ranges its keys fall in, never by a tensor over all blocks.

    Block row i covers queries i * block_m ... unless ``row_origins`` are given: then row i covers
    the block_m queries from row_origins[i], each window whole (inside seq_q), windows in any order
    and overlapping as they may (`masks.row_origins`: tiles that start where documents start)."""

    def __init__(self, ext: Extent, block_m: int, block_n: int, row_origins: tuple[int, ...] | None = None) -> None:
        self.ext, self.block_m, self.block_n = ext, block_m, block_n
        self.row_origins = row_origins  # checked by MaskDescription's builders
        self.n_rb = -(-ext.seq_q // block_m) if row_origins is None else len(row_origins)
        self.n_cb = -(-ext.seq_k // block_n)
        self.words = n_words(block_m, block_n)
        self._classes: dict[int, ClassRuns] = {}
        whole_rows = row_origins is not None or ext.seq_q % block_m == 0
        self._aligned = whole_rows and ext.seq_k % block_n == 0
        self._last_row_ragged = not whole_rows

    # The rows' tensors are made where a pattern reads them: a mask_mod built per call never does,
    # and on the lent H100's host their five small ops took 0.05 ms of that build.
    @functools.cached_property
    def rows(self) -> torch.Tensor:
        return torch.arange(self.n_rb)

    @functools.cached_property
    def q_lo(self) -> torch.Tensor:
        return self.rows * self.block_m if self.row_origins is None else torch.tensor(self.row_origins)

    @functools.cached_property
    def q_hi(self) -> torch.Tensor:
        return (self.q_lo + self.block_m).clamp(max=self.ext.seq_q) - 1

    def shape(self, batch: int = 1, heads: int = 1) -> tuple[int, int, int, int]:
        """(batch, heads, n_rb, n_cb): the shape of a class grid on this grid."""
        return batch, heads, self.n_rb, self.n_cb

    def touching(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block columns [first, stop) holding some key in lo..hi (none where hi < lo)."""
        first = self._reaching(lo)
        stop = self._from(hi + 1)
        return first, torch.where(hi >= lo, stop, first)

    def inside(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block columns [first, stop) whose in-range keys all lie in lo..hi."""
        return self._from(lo), self._reaching(hi + 1)

    def _from(self, x: torch.Tensor) -> torch.Tensor:
        """The first block column whose first key is >= x (n_cb if none)."""
        return (-(-x // self.block_n)).clamp(0, self.n_cb)

    def _reaching(self, x: torch.Tensor) -> torch.Tensor:
        """The first block column whose last in-range key is >= x (n_cb if none)."""
        return torch.where(x >= self.ext.seq_k, self.n_cb, (x // self.block_n).clamp(0, self.n_cb))

    def classes(self, desc: MaskDescription) -> ClassRuns:
        """`desc`'s classes on this grid (dims 1 or the mask's batch / heads), computed once."""
        key = id(desc)
        if key not in self._classes:
            self._classes[key] = desc._classify(self)
        return self._classes[key]

    def positions(self, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
        """Query [N, block_m, 1] and key [N, 1, block_n] positions of the tiles (on their
        device), clamped into range; positions past the ragged tail are masked off by
        `valid_words` afterwards."""
        device = tiles.i.device
        first = tiles.i * self.block_m if self.row_origins is None else self.q_lo.to(device)[tiles.i]
        q = first.view(-1, 1, 1) + torch.arange(self.block_m, device=device).view(1, -1, 1)
        k = tiles.j.view(-1, 1, 1) * self.block_n + torch.arange(self.block_n, device=device).view(1, 1, -1)
        return q.clamp(max=self.ext.seq_q - 1), k.clamp(max=self.ext.seq_k - 1)

    def valid_words(self, tiles: Tiles) -> torch.Tensor:
        """Packed in-range bits of each tile, int32 [N, words] on the tiles' device: all ones
        except in the ragged last block row and column."""
        valid = self._valid.to(tiles.i.device)
        if self._aligned:
            return valid[0].expand(len(tiles), -1)
        pattern = 2 * ((tiles.i == self.n_rb - 1) & self._last_row_ragged).long() + (tiles.j == self.n_cb - 1).long()
        return valid[pattern]

    def valid_grid(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """`valid_words` of every block, int32 [n_rb, n_cb, words], built on ``device`` (at
        S = 32768 with 128 x 128 blocks it is 128 MiB: not a thing to copy there)."""
        last_row = (torch.arange(self.n_rb, device=device) == self.n_rb - 1) & self._last_row_ragged
        last_col = torch.arange(self.n_cb, device=device) == self.n_cb - 1
        pattern = 2 * last_row.long()[:, None] + last_col.long()[None, :]
        return self._valid.to(device)[pattern]

    @functools.cached_property
    def _valid(self) -> torch.Tensor:
        """The four in-range patterns (interior, last column, last row, corner), packed; made
        when first read (a per-call build on the GPU never does)."""
        rows_last = self.ext.seq_q - (self.n_rb - 1) * self.block_m if self._last_row_ragged else self.block_m
        cols_last = self.ext.seq_k - (self.n_cb - 1) * self.block_n
        r = torch.arange(self.block_m).view(-1, 1)
        c = torch.arange(self.block_n).view(1, -1)
        tiles = [
            (r < (rows_last if last_row else self.block_m))
            & (c < (cols_last if last_col else self.block_n))
            for last_row in (False, True)
            for last_col in (False, True)
        ]
        return pack(torch.stack(tiles))
