"""The block class grid, run-length encoded per block row: what plans and builds read.

A dense grid [Bm, Hm, n_rb, n_cb] of EMPTY / PARTIAL / FULL codes costs a byte per block, 4 GiB
of 16 x 16 blocks at S = 1M, for masks that keep one class over long stretches of a row (a
causal row is FULL up to the diagonal, PARTIAL on it, EMPTY after it). ClassRuns keeps each
block row as its runs of equal class, EMPTY runs included, so that every row is a partition of
its columns; classifying, combining and coarsening then cost memory in proportion to the runs.

One operation does most of the work: `paint` lays column intervals with classes over the rows
and settles overlaps by a rule (MAX for a union, MIN for an intersection, MIX for a coarser block)
from how many intervals of each class cover a column.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL, Tiles

Rule = Callable[[Tensor], Tensor]


def MAX(counts: Tensor) -> Tensor:
    """A union: the largest class covering a column (EMPTY where none does). ``counts`` is
    [N, 3]: how many intervals of class EMPTY, PARTIAL, FULL cover each column."""
    return torch.where(counts[:, FULL] > 0, FULL, torch.where(counts[:, PARTIAL] > 0, PARTIAL, EMPTY))


def MIN(counts: Tensor) -> Tensor:
    """An intersection: the smallest class covering a column (EMPTY where none does)."""
    empty, partial, full = counts.unbind(1)
    return torch.where((empty > 0) | (partial + full == 0), EMPTY, torch.where(partial > 0, PARTIAL, FULL))


def MIX(counts: Tensor) -> Tensor:
    """A coarser block made of the covering ones: FULL where all are, EMPTY where all are (or
    none covers), PARTIAL otherwise."""
    empty, partial, full = counts.unbind(1)
    return torch.where((partial == 0) & (empty == 0) & (full > 0), FULL,
                       torch.where((partial == 0) & (full == 0), EMPTY, PARTIAL))


def spread(counts: Tensor) -> tuple[Tensor, Tensor]:
    """(owner, offset): each n repeated counts[n] times, beside 0 .. counts[n] - 1."""
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
    offset = torch.arange(len(owner)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return owner, offset


def stretches(opens: Tensor) -> tuple[Tensor, Tensor]:
    """(first, last): the first and last index of each stretch of a sequence, given where
    stretches open (``opens[0]`` is True for a non-empty sequence)."""
    first = opens.nonzero().squeeze(1)
    return first, torch.cat([first[1:], first.new_tensor([len(opens)])])[: len(first)] - 1


@dataclass(frozen=True, eq=False)
class ClassRuns:
    """Block classes [batch, heads, n_rb, n_cb] as runs. Block row r = (b * heads + h) * n_rb + i
    is cut into runs of equal class; run n starts at column key[n] % (n_cb + 1) of row
    key[n] // (n_cb + 1) and ends where the next run of its row starts (or at n_cb). Keys
    ascend, every row's first run starts at column 0, and neighbouring runs of a row differ."""

    batch: int
    heads: int
    n_rb: int
    n_cb: int
    key: Tensor  # int64 [n_runs]
    cls: Tensor  # int8 [n_runs]

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def filled(cls, shape: tuple[int, int, int, int], code: int) -> ClassRuns:
        """Every block of a grid of ``shape`` (batch, heads, n_rb, n_cb) in class ``code``."""
        rows = shape[0] * shape[1] * shape[2]
        return cls(*shape, torch.arange(rows) * (shape[3] + 1), torch.full((rows,), code, dtype=torch.int8))

    @classmethod
    def paint(cls, shape: tuple[int, int, int, int], row: Tensor, start: Tensor, stop: Tensor,
              code: Tensor | int, rule: Rule = MAX) -> ClassRuns:
        """The runs of a grid of ``shape`` covered by column intervals [start, stop) of block rows
        ``row`` with classes ``code`` (broadcast together; columns clipped to the row), each
        column's class given by ``rule`` from the classes of the intervals covering it."""
        batch, heads, n_rb, n_cb = shape
        rows, width = batch * heads * n_rb, n_cb + 1
        row, start, stop, code = torch.broadcast_tensors(row, start.clamp(0, n_cb), stop.clamp(0, n_cb),
                                                         torch.as_tensor(code, dtype=torch.long))
        keep = stop > start
        row, start, stop, code = row[keep], start[keep], stop[keep], code[keep]
        keys = torch.cat([torch.arange(rows) * width, row * width + start, row * width + stop])
        delta = torch.zeros(len(keys), 3, dtype=torch.int32)  # per key: intervals opened minus closed, by class
        n = torch.arange(len(row))
        delta[rows + n, code] = 1
        delta[rows + len(row) + n, code] = -1
        unique, inverse = torch.unique(keys, return_inverse=True)
        counts = torch.zeros(len(unique), 3, dtype=torch.int32).index_add_(0, inverse, delta).cumsum(0)
        inside = unique % width < n_cb  # a key at a row's end closes intervals and starts nothing
        return cls(*shape, unique[inside], rule(counts[inside]).to(torch.int8)).merged()

    @classmethod
    def combine(cls, parts: Sequence[ClassRuns], rule: Rule) -> ClassRuns:
        """Parts on one grid (each with dims 1 or the largest), combined column by column."""
        batch, heads = max(p.batch for p in parts), max(p.heads for p in parts)
        parts = [p.expand(batch, heads) for p in parts]
        shape = (batch, heads, parts[0].n_rb, parts[0].n_cb)
        row, start, stop, code = (torch.cat(t) for t in zip(*(p.intervals() for p in parts), strict=True))
        return cls.paint(shape, row, start, stop, code, rule)

    @classmethod
    def from_dense(cls, classes: Tensor) -> ClassRuns:
        """The runs of a dense class grid int8 [Bm, Hm, n_rb, n_cb]."""
        batch, heads, n_rb, n_cb = classes.shape
        flat = classes.reshape(-1, n_cb)
        starts = torch.ones_like(flat, dtype=torch.bool)
        starts[:, 1:] = flat[:, 1:] != flat[:, :-1]
        row, col = starts.nonzero(as_tuple=True)
        return cls(batch, heads, n_rb, n_cb, row * (n_cb + 1) + col, flat[row, col].to(torch.int8))

    def settled(self, keys: Tensor, codes: Tensor) -> ClassRuns:
        """These runs with every PARTIAL block replaced by its evaluated class: ``keys`` (row *
        (n_cb + 1) + column, ascending) are all the PARTIAL blocks, ``codes`` their classes."""
        follows = torch.zeros(len(keys), dtype=torch.bool)  # continues the run of the block before it
        follows[1:] = (keys[1:] == keys[:-1] + 1) & (codes[1:] == codes[:-1])
        other = self.cls != PARTIAL
        key = torch.cat([self.key[other], keys[~follows]])
        code = torch.cat([self.cls[other], codes[~follows].to(torch.int8)])
        key, order = key.sort()
        return dataclasses.replace(self, key=key, cls=code[order]).merged()

    def merged(self) -> ClassRuns:
        """The same runs with neighbours of one class in a row joined (the canonical form)."""
        width = self.n_cb + 1
        joined = torch.zeros(len(self.key), dtype=torch.bool)
        joined[1:] = (self.key[1:] // width == self.key[:-1] // width) & (self.cls[1:] == self.cls[:-1])
        return dataclasses.replace(self, key=self.key[~joined], cls=self.cls[~joined])

    # -- reading ----------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return self.batch * self.heads * self.n_rb

    @property
    def row(self) -> Tensor:
        return self.key // (self.n_cb + 1)

    @property
    def start(self) -> Tensor:
        return self.key % (self.n_cb + 1)

    @functools.cached_property
    def length(self) -> Tensor:
        """Blocks in each run."""
        row_end = self.key - self.start + self.n_cb
        following = torch.cat([self.key[1:], self.key.new_tensor([self.rows * (self.n_cb + 1)])])
        return torch.minimum(following, row_end) - self.key

    def intervals(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(row, start, stop, class) of every run."""
        start = self.start
        return self.row, start, start + self.length, self.cls

    def to_dense(self) -> Tensor:
        """int8 [batch, heads, n_rb, n_cb]."""
        return torch.repeat_interleave(self.cls, self.length).view(self.batch, self.heads, self.n_rb, self.n_cb)

    def block_key(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        """The keys of blocks (b, h, i, j), broadcast (b, h read as 0 where the dim is 1)."""
        row = (b * int(self.batch > 1) * self.heads + h * int(self.heads > 1)) * self.n_rb + i
        return row * (self.n_cb + 1) + j

    def at(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        """The classes of blocks (b, h, i, j), broadcast as `block_key`."""
        return self.cls[torch.searchsorted(self.key, self.block_key(b, h, i, j), right=True) - 1]

    def total(self, *codes: int) -> int:
        """Blocks in these classes."""
        chosen = self._chosen(codes)
        return int(self.length[chosen].sum())

    def per_row(self, *codes: int) -> Tensor:
        """int64 [rows]: blocks in these classes in each block row."""
        chosen = self._chosen(codes)
        return torch.zeros(self.rows, dtype=torch.long).index_add_(0, self.row[chosen], self.length[chosen])

    def tiles(self, code: int, first: int, count: int) -> Tiles:
        """Blocks first .. first + count - 1 of class ``code``, numbered in row-major order."""
        chosen = self.cls == code
        key, length = self.key[chosen], self.length[chosen]
        end = length.cumsum(0)
        n = torch.arange(first, first + count)
        run = torch.searchsorted(end, n, right=True)
        block = key[run] + n - (end[run] - length[run])
        row, j = block // (self.n_cb + 1), block % (self.n_cb + 1)
        rows_per_batch = self.heads * self.n_rb
        return Tiles(row // rows_per_batch, row // self.n_rb % self.heads, row % self.n_rb, j)

    def csr(self, *codes: int) -> tuple[Tensor, Tensor]:
        """int32 (ptr [rows + 1], columns): the blocks in these classes, row by row, as CSR."""
        chosen = self._chosen(codes)
        length, start = self.length[chosen], self.start[chosen]
        counts = torch.zeros(self.rows, dtype=torch.long).index_add_(0, self.row[chosen], length)
        ptr = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
        steps = torch.ones(int(length.sum()), dtype=torch.int32)  # column - previous column, summed up
        if len(start):
            jumps = start.clone()
            jumps[1:] -= start[:-1] + length[:-1] - 1
            steps[length.cumsum(0) - length] = jumps.to(torch.int32)
        return ptr, steps.cumsum_(0)

    def _chosen(self, codes: Sequence[int]) -> Tensor:
        chosen = torch.zeros(len(self.cls), dtype=torch.bool)
        for code in codes:
            chosen |= self.cls == code
        return chosen

    # -- reshaping --------------------------------------------------------------------------

    def take_rows(self, rows: Tensor, batch: int, heads: int, n_rb: int) -> ClassRuns:
        """The grid (batch, heads, n_rb, n_cb) whose block row r is this grid's row rows[r]."""
        width = self.n_cb + 1
        first = torch.searchsorted(self.key, torch.arange(self.rows + 1) * width)
        owner, offset = spread(first[rows + 1] - first[rows])
        index = first[rows][owner] + offset
        return ClassRuns(batch, heads, n_rb, self.n_cb, owner * width + self.start[index], self.cls[index])

    def expand(self, batch: int, heads: int) -> ClassRuns:
        """The grid broadcast to dims (batch, heads) (each of this grid's dims is 1 or that)."""
        if (self.batch, self.heads) == (batch, heads):
            return self
        assert self.batch in (1, batch) and self.heads in (1, heads), (self.batch, self.heads, batch, heads)
        return self._slices(torch.arange(batch) * int(self.batch > 1), torch.arange(heads) * int(self.heads > 1))

    def first(self, axis: int) -> ClassRuns:
        """Slice 0 along ``axis`` (0: batch, 1: heads), that dim made 1."""
        batch, heads = (1, self.heads) if axis == 0 else (self.batch, 1)
        return self._slices(torch.arange(batch), torch.arange(heads))

    def _slices(self, b: Tensor, h: Tensor) -> ClassRuns:
        """The grid of slices (b[x], h[y]) of this one."""
        rows = (b.view(-1, 1, 1) * self.heads + h.view(1, -1, 1)) * self.n_rb + torch.arange(self.n_rb)
        return self.take_rows(rows.reshape(-1), len(b), len(h), self.n_rb)

    def equal_slices(self, axis: int) -> bool:
        """Whether every slice along ``axis`` (0: batch, 1: heads) equals its slice 0."""
        per_slice = self.n_rb * (self.n_cb + 1)
        slice_of = self.key // per_slice
        first = torch.searchsorted(slice_of, torch.arange(self.batch * self.heads + 1))
        counts = first[1:] - first[:-1]
        index = torch.arange(self.batch * self.heads)
        twin = index % self.heads if axis == 0 else index - index % self.heads
        if not torch.equal(counts, counts[twin]):
            return False
        same = first[twin[slice_of]] + torch.arange(len(self.key)) - first[slice_of]
        relative = self.key - slice_of * per_slice
        return torch.equal(relative, relative[same]) and torch.equal(self.cls, self.cls[same])

    def coarsen(self, fm: int, fn: int) -> ClassRuns:
        """The classes at blocks fm x fn times as large (this grid's blocks whole inside them):
        FULL where every in-range block is, EMPTY where every one is, PARTIAL otherwise."""
        n_rb, n_cb = -(-self.n_rb // fm), -(-self.n_cb // fn)
        row, start, stop, code = self.intervals()
        coarse_row = row // self.n_rb * n_rb + row % self.n_rb // fm
        return ClassRuns.paint((self.batch, self.heads, n_rb, n_cb), coarse_row, start // fn, -(-stop // fn),
                               code, MIX)

    def invert(self) -> ClassRuns:
        """FULL and EMPTY swapped: the classes of the complement."""
        return dataclasses.replace(self, cls=(FULL - self.cls).to(torch.int8))
