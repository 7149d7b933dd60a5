"""Sizes and block geometry: the extent of one attention call, the block grid laid over it,
the set of tiles being evaluated, and the three block classes.

Every mask pattern classifies blocks from the same few tensors (each block row's query
range, each block column's key range), so they are computed once here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stof_cc.masks.bits import n_words, pack

if TYPE_CHECKING:
    from stof_cc.masks.description import MaskDescription

#: Block classes, as int8 codes. Before a block's elements are evaluated, PARTIAL means
#: "maybe partial"; the builder turns all-ones tiles into FULL and all-zeros into EMPTY.
#: The order matters: a union of masks takes the maximum class, an intersection the minimum.
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Extent:
    """The sizes one mask is evaluated for: sequence lengths and the batch and heads it spans."""

    seq_q: int
    seq_k: int
    batch: int = 1
    heads: int = 1


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

    def gather(self, classes: torch.Tensor) -> torch.Tensor:
        """The entries of a [B|1, H|1, n_rb, n_cb] class grid at these tiles."""
        b = self.b * int(classes.shape[0] > 1)
        h = self.h * int(classes.shape[1] > 1)
        return classes[b, h, self.i, self.j]


def classes_from(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Class grid from two boolean conditions, promoted to 4-D [B|1, H|1, n_rb, n_cb]."""
    out = torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)).to(torch.int8)
    while out.dim() < 4:
        out = out.unsqueeze(0)
    return out


class BlockGrid:
    """The block_m x block_n grid over an extent: per block row the (clipped, inclusive) query
    range q_lo..q_hi as [n_rb, 1], per block column the key range k_lo..k_hi as [1, n_cb]."""

    def __init__(self, ext: Extent, block_m: int, block_n: int) -> None:
        self.ext, self.block_m, self.block_n = ext, block_m, block_n
        self.n_rb = -(-ext.seq_q // block_m)
        self.n_cb = -(-ext.seq_k // block_n)
        self.words = n_words(block_m, block_n)
        rows = torch.arange(self.n_rb) * block_m
        cols = torch.arange(self.n_cb) * block_n
        self.q_lo = rows[:, None]
        self.q_hi = (rows + block_m).clamp(max=ext.seq_q)[:, None] - 1
        self.k_lo = cols[None, :]
        self.k_hi = (cols + block_n).clamp(max=ext.seq_k)[None, :] - 1
        self._classes: dict[int, torch.Tensor] = {}
        self._valid = self._valid_patterns()
        self._aligned = ext.seq_q % block_m == 0 and ext.seq_k % block_n == 0

    def diagonals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Smallest and largest q - k inside each block, [n_rb, n_cb] each."""
        return self.q_lo - self.k_hi, self.q_hi - self.k_lo

    def classes(self, desc: MaskDescription) -> torch.Tensor:
        """`desc`'s class grid [B|1, H|1, n_rb, n_cb] on this grid, computed once."""
        key = id(desc)
        if key not in self._classes:
            classes = desc._classify(self)
            self._classes[key] = classes.expand(-1, -1, self.n_rb, self.n_cb)
        return self._classes[key]

    def positions(self, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
        """Query [N, block_m, 1] and key [N, 1, block_n] positions of the tiles (on their
        device), clamped into range; positions past the ragged tail are masked off by
        `valid_words` afterwards."""
        device = tiles.i.device
        q = tiles.i.view(-1, 1, 1) * self.block_m + torch.arange(self.block_m, device=device).view(1, -1, 1)
        k = tiles.j.view(-1, 1, 1) * self.block_n + torch.arange(self.block_n, device=device).view(1, 1, -1)
        return q.clamp(max=self.ext.seq_q - 1), k.clamp(max=self.ext.seq_k - 1)

    def valid_words(self, tiles: Tiles) -> torch.Tensor:
        """Packed in-range bits of each tile, int32 [N, words] on the tiles' device: all ones
        except in the ragged last block row and column."""
        valid = self._valid.to(tiles.i.device)
        if self._aligned:
            return valid[0].expand(len(tiles), -1)
        pattern = 2 * (tiles.i == self.n_rb - 1).long() + (tiles.j == self.n_cb - 1).long()
        return valid[pattern]

    def valid_grid(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """`valid_words` of every block, int32 [n_rb, n_cb, words], built on ``device`` (at
        S = 32768 with 128 x 128 blocks it is 128 MiB: not a thing to copy there)."""
        last_row = torch.arange(self.n_rb, device=device) == self.n_rb - 1
        last_col = torch.arange(self.n_cb, device=device) == self.n_cb - 1
        pattern = 2 * last_row.long()[:, None] + last_col.long()[None, :]
        return self._valid.to(device)[pattern]

    def _valid_patterns(self) -> torch.Tensor:
        rows_last = self.ext.seq_q - (self.n_rb - 1) * self.block_m
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
