"""BlockMask: the unified storage format every stof-cc attention kernel reads."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

import stof_cc.masks.lists as lists
from stof_cc.masks.bits import n_words, pack, popcount, unpack
from stof_cc.masks.errors import MaskError, check_int
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL
from stof_cc.masks.row_origins import key_blocks
from stof_cc.masks.runs import MAX, ClassRuns, spread

INT32_MAX = 2**31 - 1
RUNS_CHUNK = 1 << 22  # stored blocks read at once by `block_runs`
_TENSORS = (
    "full_ptr",
    "full_cols",
    "part_ptr",
    "part_cols",
    "part_bits",
    "any_ptr",
    "any_cols",
    "any_tile",
)


@dataclass(frozen=True, eq=False, repr=False)
class BlockMask:
    """A mask [Bm, Hm, seq_q, seq_k] cut into block_m x block_n blocks, each FULL (every
    in-range element attends), PARTIAL (some do) or EMPTY (none do; stored nowhere).

    Layout (kernels index these tensors directly; all int32 except part_bits):
      batch, heads     leading mask dims Bm in {1, B}, Hm in {1, H}: 1 when the mask is the
                       same for every batch element / head (kernels use b * (Bm > 1)).
      n_rb, n_cb       ceil(seq_q / block_m) block rows, ceil(seq_k / block_n) block columns;
                       under ``row_origins`` (masks.row_origins: tiles that start where documents
                       start), block row i covers the block_m queries from row_origins[i] instead
                       of i * block_m, and n_rb is their count. Windows may overlap: every row of a
                       window is classified with the whole mask, so overlapping rows agree.
      row              block row r = (b * Hm + h) * n_rb + i, for R = Bm * Hm * n_rb rows.
      full_ptr  [R+1]  CSR offsets; full_cols[full_ptr[r]:full_ptr[r+1]] are the FULL block
                       columns of row r, ascending. A FULL block in the ragged last block
                       row/column is full over its in-range part: kernels still bounds-check.
      part_ptr  [R+1], part_cols: the same for PARTIAL blocks. The n-th PARTIAL block (CSR
                       order) has the tile part_bits[n].
      part_bits        uint32 [n_part, words], words = ceil(block_m * block_n / 32): element
                       (r, c) of the tile is bit idx = r * block_n + c, in word idx // 32 at
                       bit idx % 32 (LSB first). Out-of-range positions are 0.
      any_ptr   [R+1], any_cols: every non-empty block, columns ascending (the merge of the
                       two lists above), for single-loop kernels; any_tile[n] is the
                       part_bits row of that block, or -1 when it is FULL.
      row_keys         under row origins, per block row the keys [start, end) of the one document
                       holding all its rows (`masks.row_origins.window_keys`), or (-1, -1): the tile
                       schedule hands such a tile that key range instead of its block list, and the
                       warp-specialised kernel walks it in FULL blocks from the document's start.

    Classification is exact: no PARTIAL tile is all ones or all zeros over its in-range part.
    A query row with no attended key is legal; its attention output is defined as 0
    (FlexAttention's convention; SDPA would give NaN). Kernels use block sizes that are
    multiples of 16; the format itself accepts any positive block size.
    """

    seq_q: int
    seq_k: int
    block_m: int
    block_n: int
    batch: int
    heads: int
    full_ptr: torch.Tensor
    full_cols: torch.Tensor
    part_ptr: torch.Tensor
    part_cols: torch.Tensor
    part_bits: torch.Tensor
    any_ptr: torch.Tensor
    any_cols: torch.Tensor
    any_tile: torch.Tensor
    row_origins: tuple[int, ...] | None = None
    row_keys: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def from_classes(
        cls,
        classes: torch.Tensor,
        bits: torch.Tensor,
        seq_q: int,
        seq_k: int,
        block_m: int,
        block_n: int,
    ) -> BlockMask:
        """Assemble the CSR arrays from an exact class grid [Bm, Hm, n_rb, n_cb] and the tiles
        of its PARTIAL blocks in row-major order (int32 [n_part, words])."""
        return cls.from_runs(ClassRuns.from_dense(classes), bits, seq_q, seq_k, block_m, block_n)

    @classmethod
    def from_runs(
        cls,
        runs: ClassRuns,
        bits: torch.Tensor,
        seq_q: int,
        seq_k: int,
        block_m: int,
        block_n: int,
        row_origins: tuple[int, ...] | None = None,
    ) -> BlockMask:
        """Assemble the CSR arrays from exact classes as runs and the tiles of the PARTIAL
        blocks in row-major order (int32 [n_part, words]); the work and memory are those of
        the blocks stored."""
        nonempty = runs.total(FULL, PARTIAL)
        if nonempty > INT32_MAX:
            raise MaskError(
                f"block_mask: {nonempty} non-empty blocks of {block_m} x {block_n} at {seq_q} x {seq_k} "
                f"are past the format's int32 offsets ({INT32_MAX}); use larger blocks")
        full_ptr, full_cols = runs.csr(FULL)
        part_ptr, part_cols = runs.csr(PARTIAL)
        any_ptr, any_cols = runs.csr(FULL, PARTIAL)
        stored = runs.cls != EMPTY
        length, partial = runs.length[stored], runs.cls[stored] == PARTIAL
        owner, offset = spread(length[partial])  # the PARTIAL blocks' places in the any_* list
        places = (length.cumsum(0) - length)[partial][owner] + offset
        any_tile = torch.full((nonempty,), -1, dtype=torch.int32)
        any_tile[places] = torch.arange(len(places), dtype=torch.int32)
        return cls(
            seq_q,
            seq_k,
            block_m,
            block_n,
            runs.batch,
            runs.heads,
            full_ptr,
            full_cols,
            part_ptr,
            part_cols,
            bits.view(torch.uint32),
            any_ptr,
            any_cols,
            any_tile,
            row_origins,
        )

    @classmethod
    def from_grid(
        cls,
        classes: torch.Tensor,
        tiles: torch.Tensor,
        seq_q: int,
        seq_k: int,
        block_m: int,
        block_n: int,
        ranked_on_device: bool = False,
        ranked: tuple[torch.Tensor, np.ndarray] | None = None,
    ) -> BlockMask:
        """Assemble the block mask from ``classes`` (exact, int8 [Bm, Hm, n_rb, n_cb]) and ``tiles``
        (every block's tile, int32 [Bm, Hm, n_rb, n_cb, words]) on the device that evaluated the
        mask. ``ranked`` are the lists already ranked from these very ``classes`` (`lists.read`'s
        buffer and offsets: the graph that made the grid ranked it too). With ``ranked_on_device`` (a mask built per call, whose grid
        a compiled form made) the lists are ranked on the GPU by a graph captured per grid shape
        (masks/lists.py), the one wait reading their offsets; otherwise (a one-off mask, whose shapes would each cost a compile and a
        capture that it never earns back) the class
        grid (a byte per block) comes to the host, the one wait, where numpy lays out the CSR
        arrays (0.04 ms for 4096 blocks, 0.3 ms for 65536 on a 2-core EPYC), and they go back in
        one copy (the same arrays made on the GPU by eight or more launches took 0.24-0.93 ms of
        the lent H100's host at S = 8192-32768: benchmarks/history/26-2026-11-27.md). The PARTIAL
        blocks' tiles are gathered where they are. `from_runs` makes the lists from runs instead,
        the way for masks too large to hold a class per block."""
        batch, heads, n_rb, n_cb = classes.shape
        rows, blocks = batch * heads * n_rb, batch * heads * n_rb * n_cb
        if ranked is None and ranked_on_device and blocks <= INT32_MAX:
            ranked = lists.block_lists(classes.reshape(rows, n_cb))
        if ranked is not None:  # ranked on the GPU, the offsets read on the host (masks/lists.py)
            buffer, ptrs = ranked
            arrays, any_ptr_host = lists.views(buffer, ptrs, rows, blocks), ptrs[2]
        else:
            any_ptr_host, arrays = _host_lists(classes.reshape(rows, n_cb), f"{block_m} x {block_n} at {seq_q} x {seq_k}")
        full_ptr, full_cols, part_ptr, part_cols, any_ptr, any_cols, any_tile, part_at = arrays
        bits = tiles.reshape(blocks, -1).index_select(0, part_at)
        mask = cls(seq_q, seq_k, block_m, block_n, batch, heads, full_ptr, full_cols, part_ptr, part_cols,
                   bits.view(torch.uint32), any_ptr, any_cols, any_tile)
        mask.__dict__["any_ptr_host"] = any_ptr_host  # the cached property, from the copy made here
        return mask

    # -- shape and statistics -------------------------------------------------------------

    @property
    def n_rb(self) -> int:
        return -(-self.seq_q // self.block_m) if self.row_origins is None else len(self.row_origins)

    def row_starts(self) -> np.ndarray:
        """int64 [n_rb]: each block row's first query row (what the tile schedule hands the kernels)."""
        if self.row_origins is None:
            return np.arange(self.n_rb, dtype=np.int64) * self.block_m
        return np.asarray(self.row_origins, dtype=np.int64)

    def key_spans(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(keys int64 [n_rb, 2], blocks int64 [n_rb]) under ``row_keys``: each block row's key range
        ((-1, -1) where it keeps its block list) and the blocks of block_n keys that walk it from its
        start (0 where it keeps its list); None without row keys."""
        return None if self.row_keys is None else key_blocks(self.row_keys, self.block_n)

    @property
    def n_cb(self) -> int:
        return -(-self.seq_k // self.block_n)

    @property
    def words(self) -> int:
        return n_words(self.block_m, self.block_n)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of `to_dense()`: (Bm, Hm, seq_q, seq_k)."""
        return self.batch, self.heads, self.seq_q, self.seq_k

    @property
    def n_full(self) -> int:
        return self.full_cols.numel()

    @property
    def n_partial(self) -> int:
        return self.part_cols.numel()

    @property
    def n_nonempty(self) -> int:
        return self.any_cols.numel()

    @property
    def n_empty(self) -> int:
        return self.n_blocks - self.n_nonempty

    @property
    def n_blocks(self) -> int:
        """All blocks over all mask slices: Bm * Hm * n_rb * n_cb."""
        return self.batch * self.heads * self.n_rb * self.n_cb

    @property
    def n_attended(self) -> int:
        """Number of True elements over all slices: per block row, its height times the width of
        its FULL blocks (only a row's last column can be ragged), plus the PARTIAL tiles' bits.
        Under row origins each query row counts once, in the first window that covers it."""
        ptr = self.full_ptr.cpu().long()
        counts = ptr[1:] - ptr[:-1]
        ends_at_edge = torch.zeros_like(counts, dtype=torch.bool)
        stored = counts > 0
        ends_at_edge[stored] = self.full_cols.cpu()[ptr[1:][stored] - 1] == self.n_cb - 1
        width = counts * self.block_n - ends_at_edge * (self.n_cb * self.block_n - self.seq_k)
        if self.row_origins is None:
            height = (self.seq_q - torch.arange(len(counts)) % self.n_rb * self.block_m).clamp(max=self.block_m)
            return int((height * width).sum()) + popcount(self.part_bits.cpu())
        owned = self._owned_rows()
        full = int((owned.sum(1)[torch.arange(len(counts)) % self.n_rb] * width).sum())
        owned_words = pack(owned[:, :, None].expand(-1, -1, self.block_n).contiguous())
        tile_rows = self._rows(self.part_ptr.cpu()) % self.n_rb
        return full + popcount(self.part_bits.cpu().view(torch.int32) & owned_words[tile_rows])

    def _owned_rows(self) -> torch.Tensor:
        """bool [n_rb, block_m]: under row origins, which of each window's rows no earlier window covers."""
        owner = torch.full((self.seq_q,), -1, dtype=torch.long)
        rows = torch.tensor(self.row_origins).view(-1, 1) + torch.arange(self.block_m)
        for window in range(self.n_rb - 1, -1, -1):  # the earliest window covering a row writes it last
            owner[rows[window]] = window
        return owner[rows] == torch.arange(self.n_rb).view(-1, 1)

    @property
    def element_density(self) -> float:
        """Attended elements / in-range elements."""
        return self.n_attended / (self.batch * self.heads * self.seq_q * self.seq_k)

    @property
    def block_density(self) -> float:
        """Non-empty blocks / (n_rb * n_cb), averaged over the mask slices."""
        return self.n_nonempty / self.n_blocks

    @property
    def partial_share(self) -> float:
        """PARTIAL / non-empty blocks (0 when all blocks are empty)."""
        return self.n_partial / self.n_nonempty if self.n_nonempty else 0.0

    @property
    def nbytes(self) -> int:
        """The memory its tensors hold: each storage once, whole (lists ranked on the GPU are views
        of one buffer padded to the grid's block count: masks/lists.py)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._tensors()}
        return sum(storages.values())

    def __repr__(self) -> str:
        return (
            f"BlockMask(seq {self.seq_q}x{self.seq_k}, block {self.block_m}x{self.block_n}, "
            f"dims {self.batch}x{self.heads}, grid {self.n_rb}x{self.n_cb}"
            f"{' (block rows from document starts)' if self.row_origins is not None else ''}: "
            f"{self.n_full} full, {self.n_partial} partial, {self.n_empty} empty; "
            f"density {self.element_density:.2%} of elements, {self.block_density:.2%} of blocks, "
            f"partial share {self.partial_share:.2%}; {self.nbytes / 1024:.1f} KiB)"
        )

    # -- conversions ----------------------------------------------------------------------

    def to(self, device: torch.device | str) -> BlockMask:
        """The same mask with every tensor on `device` (itself where they are all there)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # as torch's .to("cuda"): the current device
            device = torch.device("cuda", torch.cuda.current_device())
        if all(getattr(self, name).device == device for name in _TENSORS):
            return self  # without a .to per tensor: a per-call build asks this every call
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in _TENSORS})

    @functools.cached_property
    def any_ptr_host(self) -> np.ndarray:
        """``any_ptr`` on the host (int64), read once: what the tile schedule costs tiles by.
        `from_grid` hands over the copy it made, so a mask built per call is not read back (each
        read is a wait: about 0.3 ms a call on the lent H100's host)."""
        return self.any_ptr.cpu().numpy().astype(np.int64)

    def block_runs(self) -> ClassRuns:
        """The block map as runs per block row, read off the merged list (any_*) a chunk at a
        time: the work is that of the blocks stored, and no tensor over every block of the grid
        (nor a temporary over every stored one) is made."""
        shape = (self.batch, self.heads, self.n_rb, self.n_cb)
        cols, tile = self.any_cols.cpu(), self.any_tile.cpu()
        ptr, stored = self.any_ptr.cpu().long(), len(cols)
        if not stored:
            return ClassRuns.filled(shape, EMPTY)
        firsts = [ptr[:-1][ptr[:-1] < stored]]  # runs open at a row's first block,
        for start in range(1, stored, RUNS_CHUNK):  # at a gap and at a change of class
            near, partial = cols[start - 1 : start + RUNS_CHUNK], tile[start - 1 : start + RUNS_CHUNK] >= 0
            opens = (near[1:] != near[:-1] + 1) | (partial[1:] != partial[:-1])
            firsts.append(opens.nonzero().squeeze(1) + start)
        first = torch.unique(torch.cat(firsts))
        last = torch.cat([first[1:], first.new_tensor([stored])]) - 1
        row = torch.searchsorted(ptr, first, right=True) - 1
        code = torch.where(tile[first] >= 0, PARTIAL, FULL)
        return ClassRuns.paint(shape, row, cols[first].long(), cols[last].long() + 1, code, MAX)

    def block_classes(self) -> torch.Tensor:
        """int8 [Bm, Hm, n_rb, n_cb] of EMPTY / PARTIAL / FULL (the block map)."""
        return self.block_runs().to_dense()

    def to_dense(self) -> torch.Tensor:
        """bool [Bm, Hm, seq_q, seq_k], True = attend (on the CPU)."""
        return self._dense(range(self.batch * self.heads)).view(self.shape)

    def dense_slice(self, b: int = 0, h: int = 0) -> torch.Tensor:
        """bool [seq_q, seq_k] of mask slice (b, h), without densifying the others."""
        b = check_int("dense_slice", "b", b, 0, self.batch - 1)
        h = check_int("dense_slice", "h", h, 0, self.heads - 1)
        return self._dense([b * self.heads + h])[0]

    def _dense(self, slices: range | list[int]) -> torch.Tensor:
        bm, bn, n_rb, n_cb = self.block_m, self.block_n, self.n_rb, self.n_cb
        classes = self.block_classes().view(-1, n_rb, n_cb)[list(slices)]
        tiles = torch.zeros(len(classes), n_rb, n_cb, bm, bn, dtype=torch.bool)
        tiles[classes == FULL] = True
        if self.n_partial:
            chosen = torch.zeros(self.batch * self.heads, dtype=torch.bool)
            chosen[list(slices)] = True
            rows = self._rows(self.part_ptr.cpu())
            keep = chosen[rows // n_rb]
            where = (classes == PARTIAL).nonzero(as_tuple=True)
            tiles[where] = unpack(self.part_bits.cpu()[keep], bm, bn)
        dense = tiles.permute(0, 1, 3, 2, 4).reshape(len(classes), n_rb * bm, n_cb * bn)
        if self.row_origins is not None:  # each window's rows where they lie (overlapping rows agree)
            rows = torch.tensor(self.row_origins).view(-1, 1) + torch.arange(bm)
            placed = torch.zeros(len(classes), self.seq_q, n_cb * bn, dtype=torch.bool)
            placed[:, rows.reshape(-1)] = dense
            dense = placed
        return dense[:, : self.seq_q, : self.seq_k].contiguous()

    def _rows(self, ptr: torch.Tensor) -> torch.Tensor:
        """Block row of every CSR entry, int64 [nnz]."""
        counts = (ptr[1:] - ptr[:-1]).long()
        return torch.repeat_interleave(torch.arange(len(counts), device=ptr.device), counts)

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in _TENSORS]


def coarse_counts(classes: ClassRuns | torch.Tensor, block_m: int, block_n: int, seq_q: int, seq_k: int,
                  shapes: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[torch.Tensor, int]]:
    """The block counts a mask with these classes (runs, or a dense int8 [Bm, Hm, n_rb, n_cb]) at
    block_m x block_n would have at each coarser block shape of ``shapes`` (multiples of it),
    without building it: per shape, int64 [Bm * Hm * ceil(seq_q / coarse_m)] non-empty blocks
    per block row (BlockMask row order) and the number of PARTIAL blocks. A coarse block is
    EMPTY when all its fine blocks are, FULL when all its in-range fine blocks are FULL; the
    fine blocks past the matrix edge count as neither. The cost model prices every candidate
    shape from one fine classification this way, instead of evaluating the mask once per shape;
    on runs the cost follows the runs, not the blocks."""
    runs = classes if isinstance(classes, ClassRuns) else ClassRuns.from_dense(classes)
    assert (runs.n_rb, runs.n_cb) == (-(-seq_q // block_m), -(-seq_k // block_n))
    out = {}
    for coarse_m, coarse_n in shapes:
        if coarse_m % block_m or coarse_n % block_n:
            raise ValueError(f"block {coarse_m} x {coarse_n} is not a multiple of this mask's {block_m} x {block_n}")
        coarse = runs.coarsen(coarse_m // block_m, coarse_n // block_n)
        out[(coarse_m, coarse_n)] = coarse.per_row(FULL, PARTIAL), coarse.total(PARTIAL)
    return out


def _host_lists(classes: torch.Tensor, what: str) -> tuple[np.ndarray, tuple[torch.Tensor, ...]]:
    """`from_grid`'s lists laid out by numpy from a class grid int8 [rows, n_cb] (its one wait),
    then copied back in one go: (any_ptr on the host, int64; full_ptr, full_cols, part_ptr,
    part_cols, any_ptr, any_cols, any_tile and the PARTIAL blocks' flat indices, int32 on the
    grid's device)."""
    rows, n_cb = classes.shape
    grid = classes.reshape(-1).cpu().numpy()
    any_at = np.flatnonzero(grid)  # FULL and PARTIAL: every stored block, row-major
    if len(any_at) > INT32_MAX:
        raise MaskError(f"block_mask: {len(any_at)} non-empty blocks of {what} are past the format's int32 "
                        f"offsets ({INT32_MAX}); use larger blocks")
    partial = grid[any_at] == PARTIAL
    block_rows, cols = np.divmod(any_at, n_cb)
    pieces = []  # ptr and cols of the FULL, PARTIAL and merged lists, then any_tile, the PARTIAL blocks' places
    for chosen in (~partial, partial, None):
        chosen_rows, chosen_cols = (block_rows, cols) if chosen is None else (block_rows[chosen], cols[chosen])
        ptr = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(np.bincount(chosen_rows, minlength=rows), out=ptr[1:])
        pieces += [ptr, chosen_cols]
    pieces += [np.where(partial, np.cumsum(partial) - 1, -1), any_at[partial]]
    arrays = torch.from_numpy(np.concatenate(pieces).astype(np.int32)).to(classes.device).split(
        [len(piece) for piece in pieces])
    return pieces[4], arrays
