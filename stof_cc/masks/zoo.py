"""The mask zoo: full, causal, sliding window, dilated, Sparse Transformer (strided, fixed),
global tokens, random blocks, Longformer, BigBird, document (packed sequences), key padding.

Each pattern states its definition twice, and both must agree: `_eval` elementwise (the
mask_mod) and `_classify` block row by block row, as the column ranges (`BlockGrid.touching`,
`BlockGrid.inside`) of its PARTIAL and FULL blocks: run-length encoded classes whose size
follows the blocks that exist, never the n_rb x n_cb grid. Classification may answer PARTIAL
when unsure, never FULL or EMPTY wrongly.

Lengths given as parameters (a window, a stride, a count of tokens) are stored clamped to
MAX_SEQ: one that reaches past every position means the same whatever its size, and index
arithmetic stays in range. Nothing is allocated in proportion to a parameter's value.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from stof_cc.masks.bits import bit_at, interval_words, pack_last
from stof_cc.masks.description import MaskDescription, Union
from stof_cc.masks.errors import MaskError, MaskTypeError, check_int, check_int_list, check_values
from stof_cc.masks.geometry import FULL, MAX_SEQ, PARTIAL, BlockGrid, Extent, Tiles, classes_from
from stof_cc.masks.runs import MAX, MIX, ClassRuns, spread, stretches

Piece = tuple[Tensor, Tensor, Tensor, int]  # block rows, first column, stop column, class
SEED_LIMIT = (2**64 - 1, "the largest seed torch.Generator takes")
# The head of the choice groups (`choice_group`) of packed documents and of segment ids: the runtime reads it to
# tell per-call documents, which cu_seqlens / position_ids would read on the device, from other per-call masks.
PACKED_GROUP, SEGMENTS_GROUP = "document", "document segments"
UNORDERED_DOCUMENT_BLOCKS = 1 << 27  # blocks classified densely for interleaved segment ids (a few bytes each)


def _label(fn: str, **params: object) -> str:
    return f"{fn}(" + ", ".join(f"{k}={v!r}" for k, v in params.items()) + ")"


def _span(value: int) -> int:
    """A length parameter as stored: from MAX_SEQ on, every length reaches past every position."""
    return min(value, MAX_SEQ)


def _paint(shape: tuple[int, int, int, int], pieces: list[Piece]) -> ClassRuns:
    """The classes of PARTIAL and FULL pieces on a grid of ``shape`` (FULL where they overlap),
    EMPTY elsewhere."""
    parts = []
    for row, first, stop, code in pieces:
        row, first, stop = torch.broadcast_tensors(*(torch.as_tensor(t) for t in (row, first, stop)))
        parts.append((row, first, stop, torch.full_like(row, code)))
    row, first, stop, code = (torch.cat(t) for t in zip(*parts, strict=True))
    return ClassRuns.paint(shape, row, first, stop, code)


def _holding(grid: BlockGrid, row: Tensor, lo: Tensor, hi: Tensor) -> list[Piece]:
    """Keys lo..hi attended in rows ``row``: PARTIAL where a block holds some, FULL where it
    holds only them."""
    return [(row, *grid.touching(lo, hi), PARTIAL), (row, *grid.inside(lo, hi), FULL)]


def _near(grid: BlockGrid, lo: int, hi: int) -> Piece:
    """PARTIAL: the blocks of each row holding some element with lo <= q - k <= hi."""
    return grid.rows, *grid.touching(grid.q_lo - hi, grid.q_hi - lo), PARTIAL


def _band(grid: BlockGrid, lo: int, hi: int) -> list[Piece]:
    """lo <= q - k <= hi: PARTIAL where some element of a block is in the band, FULL where all are."""
    return [_near(grid, lo, hi), (grid.rows, *grid.inside(grid.q_hi - hi, grid.q_lo - lo), FULL)]


def _diagonals(grid: BlockGrid, step: int, first: int, last: int) -> Piece:
    """PARTIAL: the blocks each diagonal q - k = m * step (first <= m <= last) crosses in each
    block row, a piece per diagonal that meets the row. For steps longer than a block's span of
    q - k, where most blocks between the diagonals hold none of them."""
    low = torch.clamp(-((grid.ext.seq_k - 1 - grid.q_lo) // step), min=first)  # the diagonals meeting the row
    high = torch.clamp(grid.q_hi // step, max=last)
    row, offset = spread((high - low + 1).clamp(min=0))
    d = (low[row] + offset) * step
    return row, *grid.touching(grid.q_lo[row] - d, grid.q_hi[row] - d), PARTIAL


class _Labelled(MaskDescription):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def __repr__(self) -> str:
        return self.label


class _Full(_Labelled):
    """Every element attends: the mask of unmasked attention."""

    invariant = True

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return torch.ones_like(q - k, dtype=torch.bool)

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        return ClassRuns.filled(grid.shape(), FULL)


class _Band(_Labelled):
    """lo <= q - k (<= hi): causal and sliding windows."""

    invariant = True

    def __init__(self, lo: int, hi: int | None, label: str) -> None:
        super().__init__(label)
        self.lo, self.hi = lo, hi

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        d = q - k
        return d >= self.lo if self.hi is None else (d >= self.lo) & (d <= self.hi)

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        return _paint(grid.shape(), _band(grid, self.lo, MAX_SEQ if self.hi is None else self.hi))


class _Dilated(_Labelled):
    """|q - k| <= w * dilation and (q - k) % dilation == 0."""

    invariant = True

    def __init__(self, w: int, dilation: int, label: str) -> None:
        super().__init__(label)
        self.reach, self.dilation = _span(w * dilation), _span(dilation)
        self._residue_mask = sliding_window(w)  # one object: plans and choices are cached per description

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        d = q - k
        return (d.abs() <= self.reach) & (d % self.dilation == 0)

    def strided_split(self) -> tuple[int, MaskDescription]:
        """Positions r, r + d, r + 2d, ... attend each other within w steps: a sliding window."""
        return self.dilation, self._residue_mask

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        if self.dilation == 1:
            return _paint(grid.shape(), _band(grid, -self.reach, self.reach))
        if self.dilation < grid.block_m + grid.block_n:  # every whole block of the band holds a multiple
            return _paint(grid.shape(), [_near(grid, -self.reach, self.reach)])
        reach = self.reach // self.dilation
        return _paint(grid.shape(), [_diagonals(grid, self.dilation, -reach, reach)])


class _Strided(_Labelled):
    """Sparse Transformer 'strided': q >= k and (q - k < stride or (q - k) % stride == 0)."""

    invariant = True

    def __init__(self, stride: int, label: str) -> None:
        super().__init__(label)
        self.stride = stride

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        d = q - k
        return (d >= 0) & ((d < self.stride) | (d % self.stride == 0))

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        s = self.stride
        beyond = (_near(grid, s, MAX_SEQ) if s < grid.block_m + grid.block_n  # a multiple in every whole block
                  else _diagonals(grid, s, 1, MAX_SEQ))
        return _paint(grid.shape(), [*_band(grid, 0, s - 1), beyond])


class _Fixed(_Labelled):
    """Sparse Transformer 'fixed': q >= k and (k // stride == q // stride or
    k % stride >= stride - c, the c 'summary' columns at the end of every stride)."""

    def __init__(self, stride: int, c: int, label: str) -> None:
        super().__init__(label)
        self.stride, self.c = stride, c

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        s = self.stride
        return (q >= k) & ((q // s == k // s) | (k % s >= s - self.c))

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        s, gap = self.stride, self.stride - self.c
        if gap == 0:  # every key is a summary key: causal
            return _paint(grid.shape(), _band(grid, 0, MAX_SEQ))
        rows, q_lo, q_hi = grid.rows, grid.q_lo, grid.q_hi
        chunk_lo, chunk_hi = q_lo // s * s, q_hi // s * s
        pieces = [(rows, *grid.touching(chunk_lo, q_hi), PARTIAL),  # the row's own chunks, k <= q
                  (rows, *grid.inside(chunk_lo, torch.where(chunk_lo == chunk_hi, q_lo, chunk_lo - 1)), FULL)]
        if gap < grid.block_n:  # every whole block holds a summary key
            pieces.append((rows, *grid.touching(torch.zeros_like(q_hi), q_hi), PARTIAL))
        else:
            pieces.append(self._summaries(grid, q_hi, grid.touching, PARTIAL))
        if self.c >= grid.block_n:  # a block may lie inside one chunk's summary keys
            pieces.append(self._summaries(grid, q_lo, grid.inside, FULL))
        return _paint(grid.shape(), pieces)

    def _summaries(self, grid: BlockGrid, limit: Tensor, columns: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
                   code: int) -> Piece:
        """The summary keys t * stride + stride - c .. t * stride + stride - 1 up to key
        ``limit[i]`` of each block row i, a piece per t, as ``columns`` (touching or inside)."""
        first = self.stride - self.c
        row, t = spread(((limit - first) // self.stride + 1).clamp(min=0))
        lo = t * self.stride + first
        return row, *columns(lo, torch.minimum(lo + self.c - 1, limit[row])), code


class _GlobalTokens(_Labelled):
    """q or k is a global token; the tokens are sorted disjoint position intervals
    [starts[t], stops[t]) (the first n positions are one interval, whatever n)."""

    def __init__(self, starts: Tensor, stops: Tensor, label: str) -> None:
        super().__init__(label)
        self.starts, self.stops = starts, stops
        self.before = torch.nn.functional.pad((stops - starts).cumsum(0), (1, 0))  # tokens before interval t

    def _contains(self, x: Tensor) -> Tensor:
        if not len(self.starts):
            return torch.zeros_like(x, dtype=torch.bool)
        if len(self.starts) == 1:  # a count of tokens, or neighbouring positions: no search
            return (x >= int(self.starts[0])) & (x < int(self.stops[0]))
        starts = self._on("starts", x.device, lambda: self.starts)
        stops = self._on("stops", x.device, lambda: self.stops)
        t = torch.searchsorted(starts, x, right=True) - 1
        return (t >= 0) & (x < stops[t.clamp(min=0)])

    def _count_below(self, x: Tensor) -> Tensor:
        """Tokens at positions < x."""
        whole = torch.searchsorted(self.stops, x, right=True)  # intervals ending at or before x
        last = whole.clamp(max=max(len(self.starts) - 1, 0))
        cut = (x - self.starts[last]).clamp(min=0) if len(self.starts) else torch.zeros_like(x)
        return self.before[whole] + torch.where(whole < len(self.starts), cut, 0)

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return self._contains(q) | self._contains(k)

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        last = self.stops - 1
        columns = _paint((1, 1, 1, grid.n_cb), _holding(grid, torch.tensor(0), self.starts, last))
        columns = columns.take_rows(torch.zeros_like(grid.rows), 1, 1, grid.n_rb)  # the same in every row
        in_row = self._count_below(grid.q_hi + 1) - self._count_below(grid.q_lo)
        rows = _paint(grid.shape(), [(grid.rows[in_row > 0], 0, grid.n_cb, PARTIAL),  # global queries: the whole row
                             (grid.rows[in_row == grid.q_hi - grid.q_lo + 1], 0, grid.n_cb, FULL)])
        return ClassRuns.combine([columns, rows], MAX)


class _RandomBlocks(_Labelled):
    """A random grid of `block` x `block` cells, each on with probability
    min(1, random_blocks / n_cols), drawn from torch.Generator().manual_seed(seed)."""

    size_dependent = True
    SLAB = 1 << 22  # random draws per slab of cell rows
    TABLE_CELLS = 1 << 26  # up to this many cells they are looked up in a bool table, past it in bits

    def __init__(self, random_blocks: int, block: int, seed: int, label: str) -> None:
        super().__init__(label)
        self.random_blocks, self.block, self.seed = _span(random_blocks), _span(block), seed
        self._draws: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # per (seq_q, seq_k), on the CPU

    def _shape(self, seq_q: int, seq_k: int) -> tuple[int, int]:
        return -(-seq_q // self.block), -(-seq_k // self.block)

    def _draw(self, seq_q: int, seq_k: int) -> tuple[Tensor, Tensor]:
        """(on, lookup): the cells that are on as ascending int64 keys row * n_cols + col, and
        every cell as a bool table [n_rows, n_cols] (up to TABLE_CELLS) or row-packed bits
        [n_rows, ceil(n_cols / 32)] past it. Drawn a slab of rows at a time, as one
        torch.rand(n_rows, n_cols) would draw them: no larger tensor per cell is made."""
        rows, cols = self._shape(seq_q, seq_k)
        generator = torch.Generator().manual_seed(self.seed)
        per_slab = max(1, self.SLAB // cols)
        on, lookup = [], []
        for first in range(0, rows, per_slab):
            slab = torch.rand(min(per_slab, rows - first), cols, generator=generator) < self.random_blocks / cols
            row, col = slab.nonzero(as_tuple=True)
            on.append((row + first) * cols + col)
            lookup.append(slab if rows * cols <= self.TABLE_CELLS else pack_last(slab))
        return torch.cat(on), torch.cat(lookup)

    def on_cells(self, seq_q: int, seq_k: int) -> Tensor:
        """The cells that are on, as ascending int64 keys row * n_cols + col."""
        return self._drawn(Extent(seq_q, seq_k), torch.device("cpu"))[0]

    def cells(self, seq_q: int, seq_k: int) -> Tensor:
        """The on/off cell grid [ceil(seq_q/block), ceil(seq_k/block)]: deterministic."""
        rows, cols = self._shape(seq_q, seq_k)
        grid = torch.zeros(rows * cols, dtype=torch.bool)
        grid[self.on_cells(seq_q, seq_k)] = True
        return grid.view(rows, cols)

    def _drawn(self, ext: Extent, device: torch.device) -> tuple[Tensor, Tensor]:
        """`_draw` for these sizes, made once and kept on each device it is used on."""
        sizes = (ext.seq_q, ext.seq_k)
        if sizes not in self._draws:
            self._draws[sizes] = self._draw(*sizes)
        on, lookup = self._draws[sizes]
        return on, self._on(("cells", *sizes), device, lambda: lookup)

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        assert ext is not None, "size-dependent masks are evaluated with their extent"
        lookup, row, col = self._drawn(ext, q.device)[1], q // self.block, k // self.block
        return lookup[row, col] if lookup.dtype == torch.bool else bit_at(lookup, (row,), col)

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        ext, size = grid.ext, self.block
        n_rows, n_cols = self._shape(ext.seq_q, ext.seq_k)
        keys = self.on_cells(ext.seq_q, ext.seq_k)
        opens = torch.ones(len(keys), dtype=torch.bool)  # runs of neighbouring on cells in a cell row
        opens[1:] = (keys[1:] != keys[:-1] + 1) | (keys[1:] // n_cols != keys[:-1] // n_cols)
        first, last = (keys[t] for t in stretches(opens))
        lo, hi = first % n_cols * size, (last % n_cols + 1) * size - 1
        cell_rows = _paint((1, 1, n_rows, grid.n_cb), _holding(grid, first // n_cols, lo, hi))  # at our columns
        top = grid.q_lo // size
        owner, offset = spread(grid.q_hi // size - top + 1)  # the cell rows of each block row
        parts = cell_rows.take_rows(top[owner] + offset, 1, 1, len(owner))
        row, start, stop, code = parts.intervals()
        return ClassRuns.paint(grid.shape(), owner[row], start, stop, code, MIX)


class _Documents(_Labelled):
    """doc(q) == doc(k) >= 0, with one row of document ids per batch element or one for all.
    Padding (no document) attends nothing. A subclass says where the documents are
    (`_ranges`); classification reads, per block of positions, the range of its ids."""

    ordered = True  # whether ids never decrease along the positions (padding aside)
    takes_row_origins = True

    def _ranges(self, seq: int, block: int) -> tuple[Tensor, Tensor, Tensor]:
        """(lo, hi, clean), each [rows, n_blocks]: the smallest and largest id in each block of
        ``block`` positions (hi < 0 for a block of padding only), and whether it holds no padding."""
        raise NotImplementedError

    def _window_ranges(self, first: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
        """`_ranges` of the windows of ``block`` positions from each of ``first`` (each inside the
        sequence): a grid's block rows under row origins."""
        raise NotImplementedError

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        q_lo, q_hi, q_clean = (self._ranges(grid.ext.seq_q, grid.block_m) if grid.row_origins is None
                               else self._window_ranges(grid.q_lo, grid.block_m))
        k_lo, k_hi, k_clean = self._ranges(grid.ext.seq_k, grid.block_n)
        if not self.ordered:
            return self._dense_classes(grid, (q_lo, q_hi, q_clean), (k_lo, k_hi, k_clean))
        padding_only = k_hi < 0
        k_hi = torch.cummax(k_hi, dim=1).values  # a padding-only block takes the id before it,
        k_lo = torch.where(padding_only, k_hi, k_lo)  # so both bounds ascend along the columns
        batch, n_rb = q_lo.shape
        row = torch.arange(batch)[:, None] * n_rb + grid.rows
        valid = q_hi >= 0
        first = torch.searchsorted(k_hi, q_lo)  # the columns whose ids meet the row's ids
        stop = torch.searchsorted(k_lo, q_hi, right=True)
        pieces = [(row[valid], first[valid], stop[valid], PARTIAL),
                  self._full(grid, q_lo, q_clean & (q_lo == q_hi) & valid, k_lo, k_hi, k_clean)]
        return _paint(grid.shape(batch), pieces)

    @staticmethod
    def _full(grid: BlockGrid, q_id: Tensor, q_one: Tensor, k_lo: Tensor, k_hi: Tensor,
              k_clean: Tensor) -> Piece:
        """FULL: in a block row of one document and no padding (``q_one``), the columns of
        that document alone and no padding: the stretches of such columns among the columns
        of the document, which padding may cut."""
        batch, n_cb = k_lo.shape
        alone = torch.where(k_clean & (k_lo == k_hi), k_lo, -1).reshape(-1)  # a column's one document, or -1
        opens = torch.ones(len(alone), dtype=torch.bool)
        opens[1:] = alone[1:] != alone[:-1]
        opens[::n_cb] = True
        stretch = opens.long().cumsum(0) - 1  # the stretch of equal `alone` each column is in
        firsts = opens.nonzero().squeeze(1)
        stops = torch.cat([firsts[1:], firsts.new_tensor([len(alone)])])
        base = torch.arange(batch)[:, None] * n_cb
        first = torch.searchsorted(k_lo, q_id) + base  # the columns of the row's document, flat
        stop = torch.searchsorted(k_hi, q_id, right=True) + base
        b, i = (q_one & (stop > first)).nonzero(as_tuple=True)
        first, stop, doc = first[b, i], stop[b, i], q_id[b, i]
        owner, offset = spread(stretch[stop - 1] - stretch[first] + 1)
        chosen = stretch[first][owner] + offset
        keep = alone[firsts[chosen]] == doc[owner]
        owner, chosen = owner[keep], chosen[keep]
        column = base.view(-1)[b[owner]]
        return (b * grid.n_rb + i)[owner], firsts[chosen] - column, stops[chosen] - column, FULL

    def _dense_classes(self, grid: BlockGrid, q: tuple[Tensor, Tensor, Tensor],
                       k: tuple[Tensor, Tensor, Tensor]) -> ClassRuns:
        """Interleaved documents, block by block (one byte per block, so refused past
        UNORDERED_DOCUMENT_BLOCKS)."""
        blocks = q[0].shape[0] * grid.n_rb * grid.n_cb
        if blocks > UNORDERED_DOCUMENT_BLOCKS:
            raise MaskError(
                f"{self!r}: documents that interleave (segment ids not ascending along the positions, "
                f"padding aside) are classified block by block: {blocks} blocks of {grid.block_m} x "
                f"{grid.block_n} at {grid.ext.seq_q} x {grid.ext.seq_k}, over {UNORDERED_DOCUMENT_BLOCKS}; "
                "number the documents in order of position, or use larger blocks")
        (q_lo, q_hi, q_clean), (k_lo, k_hi, k_clean) = ((t[:, :, None] for t in q), (t[:, None, :] for t in k))
        full = q_clean & k_clean & (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
        empty = (q_hi < 0) | (k_hi < 0) | (q_hi < k_lo) | (k_hi < q_lo)
        return ClassRuns.from_dense(classes_from(full, empty).transpose(0, 1))


def _interval_tile_bits(grid: BlockGrid, tiles: Tiles, start: Tensor, end: Tensor) -> Tensor:
    """Tiles whose every query row attends one interval of keys, [start, end) ([N, block_m]
    absolute key positions, start == end for none): the words come from the bounds
    (`interval_words`), not from every element. Packed sequences build a new mask per call
    (issue 35): with this and exact classes the document block mask built 1.6-2.6x faster on
    the host (2026-11-26; history/14-2026-11-26.md)."""
    first_key = (tiles.j * grid.block_n).view(-1, 1).to(start.device)
    lo = (start - first_key).clamp(0, grid.block_n)
    hi = (end - first_key).clamp(0, grid.block_n)
    words = interval_words(lo, torch.maximum(hi, lo), grid.block_n).reshape(len(tiles), grid.words)
    return words & grid.valid_words(tiles)


class _Packed(_Documents):
    """Documents of the given lengths, one after another from position 0; positions past
    their sum are padding. Held as the documents' ends, not an id per position."""

    def __init__(self, lengths: list[int], label: str) -> None:
        super().__init__(label)
        self.ends = torch.tensor([_span(n) for n in lengths]).cumsum(0)

    def _doc(self, x: Tensor) -> Tensor:
        """The document holding position x (len(ends) past the last)."""
        return torch.searchsorted(self._on("ends", x.device, lambda: self.ends), x, right=True)

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        doc_q = self._doc(q)
        return (doc_q == self._doc(k)) & (doc_q < len(self.ends))

    def choice_group(self) -> object | None:
        """Packed sequences of one total length and about as many documents (the count's power
        of two) share a kernel choice: their boundaries move every call."""
        return PACKED_GROUP, int(self.ends[-1]), len(self.ends).bit_length()

    def exact_classes(self, grid: BlockGrid) -> bool:
        """Exact where no position is padding: a block's documents are consecutive ids, each
        present in it, so blocks whose id ranges meet share a document (not EMPTY) and only
        blocks of one document on both sides are FULL (padding keys break the first: a
        padding-only key block takes the id before it)."""
        return int(self.ends[-1]) >= max(grid.ext.seq_q, grid.ext.seq_k)

    def _tile_bits(self, grid: BlockGrid, tiles: Tiles) -> Tensor:
        """Each query row attends its document's keys, one interval: `_interval_tile_bits`."""
        if grid.block_n % 32:
            return super()._tile_bits(grid, tiles)
        q, _ = grid.positions(tiles)
        ends = self._on("ends", q.device, lambda: self.ends)
        starts = self._on("starts", q.device, lambda: torch.cat([self.ends.new_zeros(1), self.ends[:-1]]))
        doc = self._doc(q[..., 0])
        real = doc < len(self.ends)
        doc = doc.clamp(max=len(self.ends) - 1)
        return _interval_tile_bits(grid, tiles, torch.where(real, starts[doc], 0), torch.where(real, ends[doc], 0))

    def document_starts(self, seq: int) -> list[int] | None:
        """The documents' starts below ``seq``, then the padding's past their sum."""
        ends = self.ends.tolist()
        starts = [start for start in [0, *ends[:-1]] if start < seq]
        return starts + ([ends[-1]] if ends[-1] < seq else [])

    def document_keys(self, seq: int) -> list[tuple[int, int]] | None:
        """Each document's own positions; the padding past their sum attends nothing."""
        starts = self.document_starts(seq)
        total = int(self.ends[-1])
        return [(start, end) if start < total else (start, start)
                for start, end in zip(starts, [*starts[1:], seq], strict=True)]

    def _ranges(self, seq: int, block: int) -> tuple[Tensor, Tensor, Tensor]:
        first = torch.arange(-(-seq // block)) * block
        return self._spans(first, (first + block).clamp(max=seq) - 1)

    def _window_ranges(self, first: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
        return self._spans(first, first + block - 1)

    def _spans(self, first: Tensor, last: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`_ranges` of the positions first[i] ... last[i]."""
        total = int(self.ends[-1])
        lo, hi = self._doc(first), self._doc(last.clamp(max=total - 1))
        padding_only = first >= total
        return (torch.where(padding_only, -1, lo)[None], torch.where(padding_only, -1, hi)[None],
                (last < total)[None])


class _Segments(_Documents):
    """Documents given by segment ids [Bd, L] (Bd = 1 or one row per batch element), which
    must cover every position; a negative id is padding."""

    def __init__(self, ids: Tensor, label: str) -> None:
        super().__init__(label)
        self.ids = ids
        real = ids >= 0
        risen = torch.cummax(torch.where(real, ids, -1), dim=1).values
        self.ordered = bool((ids[real] == risen[real]).all())
        self._intervals: tuple[Tensor, Tensor] | None = None  # each position's document [start, end), made once

    def _document_intervals(self) -> tuple[Tensor, Tensor] | None:
        """int64 [Bd, L] start and end of each position's document (start == end for padding),
        or None where a document's positions are not one run (padding between them)."""
        if self._intervals is None:
            ids = self.ids.long()
            rows, size = ids.shape
            position = torch.arange(size).expand(rows, size)
            change = torch.ones(rows, size, dtype=torch.bool)
            change[:, 1:] = ids[:, 1:] != ids[:, :-1]
            run_start = torch.cummax(torch.where(change, position, 0), dim=1).values
            last = torch.ones(rows, size, dtype=torch.bool)
            last[:, :-1] = change[:, 1:]
            run_end = torch.flip(torch.cummin(torch.flip(torch.where(last, position + 1, size), [1]), dim=1).values, [1])
            real = ids >= 0
            runs = [int(((change & real)[r]).sum()) for r in range(rows)]
            documents = [int(torch.unique(ids[r][real[r]]).numel()) for r in range(rows)]
            one_run_each = runs == documents
            self._intervals = (torch.where(real, run_start, 0), torch.where(real, run_end, 0)) if one_run_each \
                else (torch.empty(0), torch.empty(0))
        return None if self._intervals[0].numel() == 0 else self._intervals

    def exact_classes(self, grid: BlockGrid) -> bool:
        """Exact where each document is one run and no position in range is padding: as for
        `_Packed`, a block then holds every existing id between its lowest and highest."""
        size = max(grid.ext.seq_q, grid.ext.seq_k)
        return self.ordered and self._document_intervals() is not None and bool((self.ids[:, :size] >= 0).all())

    def _tile_bits(self, grid: BlockGrid, tiles: Tiles) -> Tensor:
        """Where each document is one run of positions, its keys are one interval per query row:
        `_interval_tile_bits`."""
        intervals = self._document_intervals() if grid.block_n % 32 == 0 else None
        if intervals is None:
            return super()._tile_bits(grid, tiles)
        q, _ = grid.positions(tiles)
        starts, ends = (self._on(name, q.device, lambda t=t: t) for name, t in zip(("starts", "ends"), intervals,
                                                                                   strict=True))
        row = (tiles.b if self.ids.shape[0] > 1 else torch.zeros_like(tiles.b)).view(-1, 1).to(q.device)
        position = q[..., 0].clamp(max=self.ids.shape[1] - 1)
        return _interval_tile_bits(grid, tiles, starts[row, position], ends[row, position])

    def _fixed(self) -> tuple[int | None, int | None]:
        return (self.ids.shape[0] if self.ids.shape[0] > 1 else None), None

    def choice_group(self) -> object | None:
        """Segment ids of one shape and about as many documents (the largest id's power of two)
        share a kernel choice (transformers' packed sequences: new ids every call)."""
        return SEGMENTS_GROUP, tuple(self.ids.shape), int(self.ids.max()).bit_length()

    def _dims(self, ext: Extent) -> tuple[int, int]:
        rows, size = self.ids.shape
        if size < max(ext.seq_q, ext.seq_k):
            raise MaskError(
                f"document: segment_ids cover {size} positions, but the mask is "
                f"{ext.seq_q} x {ext.seq_k}"
            )
        if rows > 1 and rows != ext.batch:
            raise MaskError(
                f"document: segment_ids has {rows} rows (one per batch element), "
                f"but batch={ext.batch}"
            )
        return rows, 1

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        size = self.ids.shape[1]
        table = self._on(
            "ids", q.device, lambda: torch.nn.functional.pad(self.ids, (0, 1), value=-1)
        )
        row = b if self.ids.shape[0] > 1 else torch.zeros_like(b)
        doc_q, doc_k = table[row, q.clamp(max=size)], table[row, k.clamp(max=size)]
        return (doc_q == doc_k) & (doc_q >= 0)

    def document_starts(self, seq: int) -> list[int] | None:
        """Where the ids change (padding runs included), for ids shared by every batch element."""
        if self.ids.shape[0] > 1:
            return None
        ids = self.ids[0, :seq]
        return [0, *((ids[1:] != ids[:-1]).nonzero().squeeze(1) + 1).tolist()]

    def document_keys(self, seq: int) -> list[tuple[int, int]] | None:
        """Each run's own positions where its id occurs nowhere else; a run of padding attends nothing."""
        starts = self.document_starts(seq)
        if starts is None:
            return None
        ids = self.ids[0, :seq]
        present, counts = torch.unique(ids, return_counts=True)
        occurrences = dict(zip(present.tolist(), counts.tolist(), strict=True))
        keys = []
        for start, end in zip(starts, [*starts[1:], seq], strict=True):
            doc = int(ids[start])
            if doc >= 0 and occurrences[doc] != end - start:
                return None  # the id recurs: its rows attend keys outside their run
            keys.append((start, end) if doc >= 0 else (start, start))
        return keys

    def _ranges(self, seq: int, block: int) -> tuple[Tensor, Tensor, Tensor]:
        n = -(-seq // block)
        ids = self.ids[:, :seq]  # the ragged tail repeats the last id (out of range, not padding)
        ids = torch.cat([ids, ids[:, -1:].expand(-1, n * block - seq)], dim=1).view(-1, n, block)
        return self._id_ranges(ids)

    def _window_ranges(self, first: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
        return self._id_ranges(self.ids[:, first[:, None] + torch.arange(block)])

    @staticmethod
    def _id_ranges(ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`_ranges` of id windows [rows, n_blocks, block]."""
        padding = ids < 0
        lo = torch.where(padding, torch.iinfo(torch.long).max, ids).amin(-1)
        hi = torch.where(padding, -1, ids).amax(-1)
        return torch.where(hi < 0, -1, lo), hi, ~padding.any(-1)


class _KeyPadding(_Labelled):
    """k < lengths[b]: each batch element attends to its first lengths[b] keys. ``keys``, where
    given, is the only seq_k it fits (`from_padding`'s padding covers that many keys); ``fn`` names
    the public function in its errors."""

    def __init__(self, lengths: Tensor, label: str, keys: int | None = None, fn: str = "key_padding") -> None:
        super().__init__(label)
        self.lengths, self.keys, self.fn = lengths, keys, fn

    def _fixed(self) -> tuple[int | None, int | None]:
        return self.lengths.numel(), None

    def _dims(self, ext: Extent) -> tuple[int, int]:
        if ext.batch != self.lengths.numel():
            raise MaskError(
                f"{self.fn}: {self.lengths.numel()} lengths given (one per batch element), "
                f"but batch={ext.batch}"
            )
        if self.keys is not None and ext.seq_k != self.keys:
            raise MaskError(f"{self.fn}: the padding covers {self.keys} keys, but seq_k={ext.seq_k}")
        return ext.batch, 1

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return k < self._on("lengths", k.device, lambda: self.lengths)[b]

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        batch = len(self.lengths)
        row = (torch.arange(batch)[:, None] * grid.n_rb + grid.rows).reshape(-1)
        last = self.lengths.repeat_interleave(grid.n_rb) - 1
        return _paint(grid.shape(batch), _holding(grid, row, torch.zeros_like(last), last))


# -- the public constructors: validate, then build ------------------------------------------


def full() -> MaskDescription:
    """No masking: every query attends to every key (all blocks FULL)."""
    return _Full("full()")


def causal() -> MaskDescription:
    """q >= k."""
    return _Band(0, None, "causal()")


def sliding_window(w: int, causal: bool = False) -> MaskDescription:
    """|q - k| <= w; with causal=True, 0 <= q - k <= w. A window as long as the sequence
    attends everything (causal: everything up to the diagonal)."""
    w = check_int("sliding_window", "w", w)
    if not isinstance(causal, bool):
        raise MaskTypeError(f"sliding_window: causal must be a bool, got {causal!r}")
    label = _label("sliding_window", w=w, causal=True) if causal else _label("sliding_window", w=w)
    return _Band(0 if causal else -_span(w), _span(w), label)


def band_of(mask: MaskDescription) -> tuple[int, int | None] | None:
    """(lo, hi) of a band of positions (lo <= q - k <= hi, hi None: no upper limit): `causal()` and
    `sliding_window`; None for any other mask."""
    return (mask.lo, mask.hi) if isinstance(mask, _Band) else None


def dilated(w: int, dilation: int) -> MaskDescription:
    """|q - k| <= w * dilation and (q - k) % dilation == 0: w keys each side, every
    dilation-th position."""
    w = check_int("dilated", "w", w)
    dilation = check_int("dilated", "dilation", dilation)
    return _Dilated(w, dilation, _label("dilated", w=w, dilation=dilation))


def strided(stride: int) -> MaskDescription:
    """Child et al.'s strided pattern: q >= k and (q - k < stride or (q - k) % stride == 0)."""
    stride = check_int("strided", "stride", stride)
    return _Strided(_span(stride), _label("strided", stride=stride))


def fixed(stride: int, c: int) -> MaskDescription:
    """Child et al.'s fixed pattern: q >= k and (k // stride == q // stride or
    k % stride >= stride - c)."""
    stride = check_int("fixed", "stride", stride)
    c = check_int("fixed", f"c (stride={stride})", c, 1, stride)
    return _Fixed(_span(stride), _span(c), _label("fixed", stride=stride, c=c))


def _token_positions(fn: str, arg: str, tokens: object) -> tuple[tuple[Tensor, Tensor], object]:
    """Global tokens as sorted disjoint intervals (starts, stops) of positions, and as shown in
    the label: an int n means the first n positions, one interval whatever n is."""
    if isinstance(tokens, Tensor) and tokens.dim() == 0 or isinstance(tokens, (int, np.integer)):
        count = check_int(fn, arg, tokens, 0)
        bounds = torch.tensor([[0, _span(count)]] if count else [], dtype=torch.long).view(-1, 2)
        return tuple(bounds.unbind(1)), count
    shown = check_int_list(fn, arg, tokens, 0)
    positions = torch.tensor(sorted({_span(p) for p in shown}))
    opens = torch.ones(len(positions), dtype=torch.bool)
    opens[1:] = positions[1:] != positions[:-1] + 1
    first, last = stretches(opens)
    return (positions[first], positions[last] + 1), shown


def _global(intervals: tuple[Tensor, Tensor], shown: object) -> MaskDescription:
    return _GlobalTokens(*intervals, _label("global_tokens", tokens=shown))


def _random(r: int, block: int, seed: int) -> MaskDescription:
    return _RandomBlocks(
        r, block, seed, _label("random_blocks", random_blocks=r, block=block, seed=seed)
    )


def global_tokens(tokens: int | list[int] | Tensor) -> MaskDescription:
    """q or k is a global token; `tokens` is a count n (the first n positions) or positions."""
    return _global(*_token_positions("global_tokens", "tokens", tokens))


def random_blocks(random_blocks: int, block: int = 64, seed: int = 0) -> MaskDescription:
    """Random cells of block x block: each on with probability random_blocks / n_cols (about
    random_blocks cells per block row), deterministic for given sizes and seed."""
    r = check_int("random_blocks", "random_blocks", random_blocks, 0)
    block = check_int("random_blocks", "block", block)
    seed = check_int("random_blocks", "seed", seed, 0, limit=SEED_LIMIT)
    return _random(r, block, seed)


def longformer(w: int, global_tokens: int | list[int] | Tensor) -> MaskDescription:
    """Longformer: |q - k| <= w, or q or k is a global token (a count n or positions)."""
    w = check_int("longformer", "w", w)
    positions, shown = _token_positions("longformer", "global_tokens", global_tokens)
    return Union(
        (sliding_window(w), _global(positions, shown)),
        label=_label("longformer", w=w, global_tokens=shown),
    )


def bigbird(
    w: int, n_global: int, random_blocks: int, block: int = 64, seed: int = 0
) -> MaskDescription:
    """BigBird: longformer(w, n_global) or a random block grid at `block` granularity, each
    cell on with probability random_blocks / n_block_cols (seeded; depends on the sizes)."""
    w = check_int("bigbird", "w", w)
    n_global = check_int("bigbird", "n_global", n_global, 0)
    r = check_int("bigbird", "random_blocks", random_blocks, 0)
    block = check_int("bigbird", "block", block)
    seed = check_int("bigbird", "seed", seed, 0, limit=SEED_LIMIT)
    label = _label("bigbird", w=w, n_global=n_global, random_blocks=r, block=block, seed=seed)
    return Union((longformer(w, n_global), _random(r, block, seed)), label=label)


def document(
    lengths: list[int] | Tensor | None = None, *, segment_ids: Tensor | None = None
) -> MaskDescription:
    """Packed sequences: doc(q) == doc(k). Either `lengths` of consecutive documents
    (positions past their sum are padding; a document of length 0 holds no position, as an empty
    one in ``cu_seqlens`` does), or `segment_ids`, an integer tensor [S] or [B, S] (one row per
    batch element) where a negative id marks padding."""
    if (lengths is None) == (segment_ids is None):
        raise MaskTypeError("document: give exactly one of lengths or segment_ids")
    if lengths is not None:
        sizes = [n for n in check_int_list("document", "lengths", lengths, 0) if n]
        if not sizes:
            raise MaskError(f"document: lengths {lengths!r} hold no position (every document is empty)")
        return _Packed(sizes, _label("document", lengths=sizes))
    if (
        not isinstance(segment_ids, Tensor)
        or segment_ids.dtype.is_floating_point
        or segment_ids.dtype == torch.bool
    ):
        raise MaskTypeError(f"document: segment_ids must be an integer tensor, got {segment_ids!r}")
    if segment_ids.dim() not in (1, 2) or 0 in segment_ids.shape:  # [0, S]: no batch element to describe
        raise MaskError(
            f"document: segment_ids must have shape [S] or [B, S], got {tuple(segment_ids.shape)}"
        )
    check_values("document", "segment_ids", segment_ids)
    # a copy: a description does not change (ids written later broke its exact classes: found by review)
    ids = segment_ids.reshape(-1, segment_ids.shape[-1]).to("cpu", torch.long, copy=True)
    return _Segments(ids, f"document(segment_ids=<{'x'.join(map(str, segment_ids.shape))}>)")


def key_padding(lengths: list[int] | Tensor) -> MaskDescription:
    """Per batch element b: k < lengths[b] (padded keys are never attended; a length past the
    keys pads none)."""
    sizes = check_int_list("key_padding", "lengths", lengths, 0)
    return _KeyPadding(torch.tensor([_span(n) for n in sizes]), _label("key_padding", lengths=sizes))


def right_padding(lengths: list[int], keys: int) -> MaskDescription:
    """`key_padding` of a padding tensor that covers ``keys`` keys (`user.from_padding`'s right
    padding): it fits that seq_k only, and its errors name from_padding."""
    return _KeyPadding(torch.tensor(lengths), _label("key_padding", lengths=lengths, keys=keys), keys, "from_padding")
