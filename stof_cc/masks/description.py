"""The mask description: what a mask is, independent of sizes, and the combinators.

A description has `mask_mod(b, h, q, k) -> bool` semantics (FlexAttention's convention:
broadcastable integer index tensors in, a bool tensor out, True = attend), and it can
classify blocks of a grid as EMPTY / FULL / PARTIAL from the blocks' index ranges alone, as
runs per block row (ClassRuns). That classification is what keeps planning and building a
BlockMask proportional to the blocks that exist: only blocks that may be partial get their
elements evaluated, and no step holds a class per block of the grid.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stof_cc.masks.bits import pack
from stof_cc.masks.block_mask import BlockMask
from stof_cc.masks.build import build_block_mask, build_block_runs
from stof_cc.masks.errors import MaskError, check_int
from stof_cc.masks.geometry import MAX_BLOCK, MAX_SEQ, PARTIAL, BlockGrid, Extent, Tiles
from stof_cc.masks.runs import MAX, MIN, ClassRuns, Rule

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: Elements evaluated at once: bounds the temporaries of one chunk (a few tens of MB).
CHUNK_ELEMENTS = 1 << 22
BUILT_KEPT = 8  # block masks a description keeps (the cost model asks for a few block shapes per problem)


class MaskDescription:
    """Base class of every mask. Subclasses implement `_eval` and `_classify`.

    Flags a subclass sets:
      invariant       its value depends on q - k only (no batch, head or absolute position),
                      so equal block offsets give equal tiles and are evaluated once;
      size_dependent  it needs the sequence lengths (BigBird's random block grid), so plain
                      `mask_mod` is refused and `mask_mod_for(seq_q, seq_k)` must be used.
    """

    invariant = False
    size_dependent = False
    takes_row_origins = False  # classifies block rows that start anywhere (BlockGrid's row_origins)

    def __init__(self) -> None:
        self._device_memo: dict[tuple[object, str], torch.Tensor] = {}
        self._built: dict[tuple, BlockMask | ClassRuns] = {}  # block_mask's and block_runs' results, the
        # latest BUILT_KEPT

    # -- what a subclass implements ------------------------------------------------------

    def _eval(
        self, ext: Extent | None, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        """Elementwise mask on broadcastable index tensors (ext is None only when the
        description is not size-dependent)."""
        raise NotImplementedError

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        """Classes on the grid, with dims (B|1, H|1): EMPTY or FULL only where certain, PARTIAL
        otherwise."""
        raise NotImplementedError

    def _dims(self, ext: Extent) -> tuple[int, int]:
        """Leading mask dims (Bm, Hm), each 1 or ext.batch / ext.heads; checks `ext` fits."""
        return 1, 1

    def _fixed(self) -> tuple[int | None, int | None]:
        """Batch size and head count the description itself fixes (e.g. one length per
        batch element), used when the caller gives none."""
        return None, None

    def _tile_bits(self, grid: BlockGrid, tiles: Tiles) -> torch.Tensor:
        """Packed bits of tiles by evaluating every element (clamped, then masked to range)."""
        q, k = grid.positions(tiles)
        m = self._eval(grid.ext, tiles.b.view(-1, 1, 1), tiles.h.view(-1, 1, 1), q, k)
        return pack(m.expand(len(tiles), grid.block_m, grid.block_n)) & grid.valid_words(tiles)

    def _on(
        self, key: object, device: torch.device, make: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """A lookup tensor made once on the CPU, copied once to each device it is used on
        (so a mask_mod traced under vmap on the GPU never re-runs `make`)."""
        slot, cpu_slot = (key, str(device)), (key, "cpu")
        if slot not in self._device_memo:
            if cpu_slot not in self._device_memo:
                self._device_memo[cpu_slot] = make()
            self._device_memo[slot] = self._device_memo[cpu_slot].to(device)
        return self._device_memo[slot]

    # -- what the builder calls ----------------------------------------------------------

    def strided_split(self) -> tuple[int, MaskDescription] | None:
        """(d, sub) when the mask connects only positions equal modulo d (q % d == k % d) and,
        on each residue's strided subsequence (positions r, r + d, ...), is ``sub`` (in that
        subsequence's own positions): d independent attentions over strided views then
        compute it, each with a denser mask. None for masks without that structure."""
        return None

    def document_starts(self, seq: int) -> list[int] | None:
        """Where each run of positions begins over ``seq`` positions (a document, or a run of
        padding between or after them), the same in every batch element and head, for a mask that
        is documents alone; None (the default) for any other mask. Such a mask's tiles can start
        where documents start (`masks.row_origins`)."""
        return None

    def document_keys(self, seq: int) -> list[tuple[int, int]] | None:
        """Per run of `document_starts(seq)`, the keys [start, end) its rows attend when they are
        that run itself (an empty range for a run of padding); None for any other mask, or where a
        document's keys are not its one run (an id that recurs further on). Tiles inside one such run
        walk its keys in blocks from the run's start (`masks.row_origins.window_keys`)."""
        return None

    def choice_group(self) -> object | None:
        """A key shared by masks of one kind that change every call (documents with new
        boundaries): they share the cost model's kernel choice (`tune.attention.choose`),
        which would otherwise be priced again for each new mask (12-110 ms on a host CPU at
        S = 8192-32768); their block masks are still built per mask. None (the default): the
        choice is this mask's own."""
        return None

    def grid_classes(self, grid: BlockGrid) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(exact classes int8 [Bm, Hm, n_rb, n_cb], every block's tile int32 [Bm, Hm, n_rb, n_cb,
        words]) where the description holds them on its evaluation device (an evaluated mask's
        packed bits), so that a block mask can be built there in one go (`BlockMask.from_grid`);
        None (the default) where it classifies by runs."""
        return None

    def grid_built_per_call(self, grid: BlockGrid) -> bool:
        """Whether `grid_classes` came from a form compiled for masks built per call (a mask_mod's
        grid form): their block lists are then ranked on the GPU too (`BlockMask.from_grid`)."""
        return False

    def grid_ranked(self, grid: BlockGrid) -> tuple[torch.Tensor, np.ndarray] | None:
        """The block lists of `grid_classes` (as they are, before the builder collapses equal
        slices) where the graph that made them ranked them too (`lists.read`'s buffer and offsets:
        compiled.py's `_RankedGrid`); None (the default) where `BlockMask.from_grid` ranks them itself."""
        return None

    def exact_classes(self, grid: BlockGrid) -> bool:
        """Whether `_classify` is exact on this grid (its PARTIAL blocks are all partial, as
        when they were read off evaluated bits), so the builder need not re-check tiles."""
        return False

    def tiles_per_chunk(self, grid: BlockGrid) -> int | None:
        """How many PARTIAL tiles the builder hands `tile_bits` at once (None: all): chunks of
        CHUNK_ELEMENTS elements bound an evaluation's temporaries. A translation-invariant
        mask evaluates one tile per distinct block offset of the chunk (a band has a few), so
        its chunks are bounded by the words they gather instead: 32 x as many tiles."""
        return max(1, CHUNK_ELEMENTS // (grid.words if self.invariant else grid.block_m * grid.block_n))

    def evaluates_on(self, device: torch.device) -> bool:
        """Whether the tiles are evaluated on ``device`` (a user mask on the GPU): a block
        mask wanted there is then best built there, not on the CPU and copied."""
        return device.type == "cpu"

    def tile_bits_on(self, grid: BlockGrid, tiles: Tiles, device: torch.device) -> torch.Tensor:
        """`tile_bits` on ``device`` (the tiles' indices are on the CPU): evaluated on the
        CPU and copied, unless the description keeps its tiles on a device already."""
        return self.tile_bits(grid, tiles).to(device)

    def tile_bits(self, grid: BlockGrid, tiles: Tiles) -> torch.Tensor:
        """int32 [N, words] on the CPU: packed bits of `tiles`, all of which are PARTIAL in this
        description's class grid (combinators rely on that). Translation-invariant masks
        evaluate one tile per distinct block offset i*block_m - j*block_n."""
        if not self.invariant:
            return self._tile_bits(grid, tiles)
        offsets = tiles.i * grid.block_m - tiles.j * grid.block_n
        unique, inverse = torch.unique(offsets, return_inverse=True)
        q = unique.view(-1, 1, 1) + torch.arange(grid.block_m).view(1, -1, 1)
        k = torch.arange(grid.block_n).view(1, 1, -1)
        zero = torch.zeros(1, 1, 1, dtype=torch.long)
        m = self._eval(grid.ext, zero, zero, q, k).expand(len(unique), grid.block_m, grid.block_n)
        return pack(m)[inverse] & grid.valid_words(tiles)

    def _extent(
        self, fn: str, seq_q: int, seq_k: int | None, batch: int | None, heads: int | None
    ) -> tuple[Extent, tuple[int, int]]:
        limit = (MAX_SEQ, "positions are int32 indices")
        seq_q = check_int(fn, "seq_q", seq_q, limit=limit)
        seq_k = seq_q if seq_k is None else check_int(fn, "seq_k", seq_k, limit=limit)
        fixed_batch, fixed_heads = self._fixed()
        batch = (fixed_batch or 1) if batch is None else check_int(fn, "batch", batch)
        heads = (fixed_heads or 1) if heads is None else check_int(fn, "heads", heads)
        ext = Extent(seq_q, seq_k, batch, heads)
        return ext, self._dims(ext)

    # -- public --------------------------------------------------------------------------

    @functools.cached_property
    def mask_mod(self) -> MaskMod:
        """FlexAttention-style `mask_mod(b, h, q, k)` (True = attend), a plain function of
        four arguments as `create_block_mask` requires (a bound method would count five)."""
        if self.size_dependent:
            raise MaskError(
                f"{self!r}: the mask depends on the sequence lengths; "
                "use .mask_mod_for(seq_q, seq_k) instead of .mask_mod"
            )
        return self._bound_mask_mod(None)

    def mask_mod_for(
        self,
        seq_q: int,
        seq_k: int | None = None,
        batch: int | None = None,
        heads: int | None = None,
    ) -> MaskMod:
        """A mask_mod bound to these sizes: works for every description, BigBird included. Without
        ``batch`` and ``heads`` (and none the description fixes) it answers any b and h, as FlexAttention's
        `create_block_mask` asks (`Extent.open`)."""
        ext, _ = self._extent("mask_mod_for", seq_q, seq_k, batch, heads)
        fixed_batch, fixed_heads = self._fixed()
        if (batch is None and fixed_batch is None) or (heads is None and fixed_heads is None):
            ext = dataclasses.replace(ext, open=True)
        index = torch.zeros(1, dtype=torch.long)  # build lookup tables (and evaluate a user mask)
        self._eval(ext, index, index, index, index)  # now: FlexAttention calls us under vmap
        return self._bound_mask_mod(ext)

    def _bound_mask_mod(self, ext) -> MaskMod:
        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
        ) -> torch.Tensor:
            return self._eval(ext, b, h, q, k)

        return mask_mod

    def mask_dims(
        self,
        seq_q: int,
        seq_k: int | None = None,
        batch: int | None = None,
        heads: int | None = None,
    ) -> tuple[int, int]:
        """(Bm, Hm): whether the mask varies over batch and heads (B or H) or not (1), before
        `to_dense` / `block_mask` collapse slices that turn out equal."""
        return self._extent("mask_dims", seq_q, seq_k, batch, heads)[1]

    def to_dense(
        self,
        seq_q: int,
        seq_k: int | None = None,
        batch: int | None = None,
        heads: int | None = None,
    ) -> torch.Tensor:
        """bool [Bm, Hm, seq_q, seq_k], True = attend. batch/heads default to what the
        description fixes (key_padding lengths, a batched from_dense mask), else 1."""
        ext, (nb, nh) = self._extent("to_dense", seq_q, seq_k, batch, heads)
        b = torch.arange(nb).view(-1, 1, 1, 1)
        h = torch.arange(nh).view(1, -1, 1, 1)
        q = torch.arange(ext.seq_q).view(1, 1, -1, 1)
        k = torch.arange(ext.seq_k).view(1, 1, 1, -1)
        return collapse_dense(self._eval(ext, b, h, q, k).expand(nb, nh, ext.seq_q, ext.seq_k))

    def block_mask(
        self,
        seq_q: int,
        seq_k: int | None = None,
        block_m: int = 64,
        block_n: int = 64,
        batch: int | None = None,
        heads: int | None = None,
        device: torch.device | str = "cpu",
        row_origins: tuple[int, ...] | None = None,
    ) -> BlockMask:
        """The mask in the unified storage format (see BlockMask) for these sizes, its tensors
        on ``device``; built there once per (sizes, block shape, device, row origins) and kept (a
        description does not change). ``row_origins``: block row i covers the block_m queries
        from row_origins[i] (a mask that `takes_row_origins`)."""
        device = torch.device(device)
        return self._kept("block_mask", seq_q, seq_k, block_m, block_n, batch, heads, str(device),
                          lambda grid, dims: build_block_mask(self, grid, dims, device), row_origins)

    def block_runs(
        self,
        seq_q: int,
        seq_k: int | None = None,
        block_m: int = 64,
        block_n: int = 64,
        batch: int | None = None,
        heads: int | None = None,
        row_origins: tuple[int, ...] | None = None,
    ) -> ClassRuns:
        """The exact classes (EMPTY / PARTIAL / FULL) of the blocks for these sizes, run-length
        encoded per block row (dims [Bm, Hm] as `mask_dims`, not collapsed), without building
        the block mask (no CSR arrays, no tiles); kept like `block_mask`'s results. The cost
        model counts blocks on them: memory follows the runs, not the n_rb x n_cb grid."""
        return self._kept("block_runs", seq_q, seq_k, block_m, block_n, batch, heads, "runs",
                          lambda grid, dims: build_block_runs(self, grid, dims), row_origins)

    def block_classes(
        self,
        seq_q: int,
        seq_k: int | None = None,
        block_m: int = 64,
        block_n: int = 64,
        batch: int | None = None,
        heads: int | None = None,
    ) -> torch.Tensor:
        """`block_runs` as the dense class grid int8 [Bm, Hm, n_rb, n_cb] (a byte per block)."""
        return self.block_runs(seq_q, seq_k, block_m, block_n, batch, heads).to_dense()

    def _kept(self, fn: str, seq_q: int, seq_k: int | None, block_m: int, block_n: int, batch: int | None,
              heads: int | None, kind: str, build: Callable[[BlockGrid, tuple[int, int]], Any],
              row_origins: tuple[int, ...] | None = None) -> Any:
        """``build(grid, dims)`` for these sizes, block shape and row origins, checked as ``fn``'s
        arguments; kept per (sizes, block shape, ``kind``, row origins), the latest BUILT_KEPT."""
        ext, dims = self._extent(fn, seq_q, seq_k, batch, heads)
        limit = (MAX_BLOCK, "a tile is block_m x block_n bits")
        block_m = check_int(fn, "block_m", block_m, limit=limit)
        block_n = check_int(fn, "block_n", block_n, limit=limit)
        if row_origins is not None:
            row_origins = _checked_origins(self, fn, row_origins, block_m, ext.seq_q)
        key = (ext, dims, block_m, block_n, kind, row_origins)
        if key not in self._built:
            if len(self._built) >= BUILT_KEPT:
                self._built.pop(next(iter(self._built)))
            self._built[key] = build(BlockGrid(ext, block_m, block_n, row_origins), dims)
        return self._built[key]

    def __or__(self, other: object) -> MaskDescription:
        return Union((self, other)) if isinstance(other, MaskDescription) else _not_combinable(self, "|", other)

    def __and__(self, other: object) -> MaskDescription:
        return Intersection((self, other)) if isinstance(other, MaskDescription) else _not_combinable(self, "&", other)

    __ror__, __rand__ = __or__, __and__

    def __invert__(self) -> MaskDescription:
        return Complement(self)


def _checked_origins(mask: MaskDescription, fn: str, row_origins: object, block_m: int,
                     seq_q: int) -> tuple[int, ...]:
    """``row_origins`` as a tuple of ints, checked: a document mask's, each a whole block_m-row
    window inside the queries, and every query row in one (a row no window covers is never computed)."""
    if not mask.takes_row_origins:
        raise MaskError(f"{mask!r}: {fn}: row_origins are for document masks (document_starts)")
    try:
        origins = tuple(int(o) for o in row_origins)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise MaskError(f"{fn}: row_origins must be a sequence of ints, got {row_origins!r}") from None
    if not origins or min(origins) < 0 or max(origins) + block_m > seq_q:
        raise MaskError(f"{fn}: row_origins must each start a whole {block_m}-row window inside {seq_q} queries")
    starts = np.sort(np.asarray(origins, dtype=np.int64))
    reach = np.maximum.accumulate(starts + block_m)  # the windows so far cover [0, reach) unless one left a gap
    gaps = np.flatnonzero(starts[1:] > reach[:-1])
    if starts[0] > 0 or len(gaps):
        raise MaskError(f"{fn}: row_origins leave query row {0 if starts[0] > 0 else int(reach[gaps[0]])} in no window")
    if reach[-1] < seq_q:
        raise MaskError(f"{fn}: row_origins leave query row {int(reach[-1])} in no window")
    return origins


def _not_combinable(mask: MaskDescription, operator: str, other: object) -> object:
    """A boolean tensor next to a description: a TypeError that says how to combine them (Python's
    own named an internal class); NotImplemented for anything else, as Python expects."""
    if isinstance(other, torch.Tensor):
        raise TypeError(f"a mask description combines with another description, not a tensor: describe the tensor "
                        f"with masks.from_dense(tensor), then {mask!r} {operator} masks.from_dense(tensor)")
    return NotImplemented


def collapse_dense(mask: torch.Tensor) -> torch.Tensor:
    """Shrink the batch and head dims of a [B, H, S_q, S_k] mask to 1 where all slices agree."""
    if mask.shape[0] > 1 and bool((mask == mask[:1]).all()):
        mask = mask[:1]
    if mask.shape[1] > 1 and bool((mask == mask[:, :1]).all()):
        mask = mask[:, :1]
    return mask.contiguous()


class _Combination(MaskDescription):
    """Elementwise OR / AND of masks. Classes combine by max / min (EMPTY < PARTIAL < FULL),
    so a block that is PARTIAL for the combination is, for each part, either PARTIAL or the
    neutral class (EMPTY for OR, FULL for AND): only the PARTIAL parts need evaluating."""

    symbol: str
    rule: Rule
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(self, parts: tuple[MaskDescription, ...], label: str | None = None) -> None:
        super().__init__()
        flat: list[MaskDescription] = []
        for part in parts:
            nested = type(part) is type(self) and part.label is None  # type: ignore[attr-defined]
            flat.extend(part.parts if nested else (part,))  # type: ignore[attr-defined]
        self.parts = tuple(flat)
        self.label = label
        self.invariant = all(p.invariant for p in self.parts)
        self.size_dependent = any(p.size_dependent for p in self.parts)

    def __repr__(self) -> str:
        return self.label or "(" + f" {self.symbol} ".join(map(repr, self.parts)) + ")"

    def choice_group(self) -> object | None:
        """The parts' groups, a part without one standing for its repr (causal() & new documents:
        a user writes ``causal()`` anew each call too; two masks that print alike only share a
        choice, which is valid for any mask of the problem)."""
        groups = [part.choice_group() for part in self.parts]
        if all(group is None for group in groups):
            return None
        return self.symbol, tuple(repr(part) if group is None else group for part, group in zip(self.parts, groups,
                                                                                                 strict=True))

    def _neutral(self, grid: BlockGrid, tiles: Tiles) -> torch.Tensor:
        raise NotImplementedError

    def _dims(self, ext: Extent) -> tuple[int, int]:
        dims = [p._dims(ext) for p in self.parts]
        return max(d[0] for d in dims), max(d[1] for d in dims)

    def _fixed(self) -> tuple[int | None, int | None]:
        fixed = [p._fixed() for p in self.parts]
        batch = next((f[0] for f in fixed if f[0] is not None), None)
        heads = next((f[1] for f in fixed if f[1] is not None), None)
        return batch, heads

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        return ClassRuns.combine([grid.classes(p) for p in self.parts], type(self).rule)

    def _eval(
        self, ext: Extent | None, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return functools.reduce(type(self).combine, [p._eval(ext, b, h, q, k) for p in self.parts])

    def _tile_bits(self, grid: BlockGrid, tiles: Tiles) -> torch.Tensor:
        acc = self._neutral(grid, tiles)
        for part in self.parts:
            sub = (grid.classes(part).at(tiles.b, tiles.h, tiles.i, tiles.j) == PARTIAL).nonzero().squeeze(1)
            if len(sub):
                acc[sub] = type(self).combine(acc[sub], part.tile_bits(grid, tiles.select(sub)))
        return acc


class Union(_Combination):
    """Attend where any part attends (`a | b`)."""

    symbol = "|"
    rule = MAX
    combine = operator.or_

    def _neutral(self, grid: BlockGrid, tiles: Tiles) -> torch.Tensor:
        return torch.zeros(len(tiles), grid.words, dtype=torch.int32)


class Intersection(_Combination):
    """Attend where every part attends (`a & b`)."""

    symbol = "&"
    rule = MIN
    combine = operator.and_

    def _neutral(self, grid: BlockGrid, tiles: Tiles) -> torch.Tensor:
        return grid.valid_words(tiles).clone()  # may be an expanded view


class Complement(MaskDescription):
    """Attend exactly where the part does not (`~a`); FULL and EMPTY swap."""

    def __init__(self, part: MaskDescription) -> None:
        super().__init__()
        self.part = part
        self.invariant = part.invariant
        self.size_dependent = part.size_dependent

    def __repr__(self) -> str:
        return f"~{self.part!r}"

    def _dims(self, ext: Extent) -> tuple[int, int]:
        return self.part._dims(ext)

    def _fixed(self) -> tuple[int | None, int | None]:
        return self.part._fixed()

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        return grid.classes(self.part).invert()

    def _eval(
        self, ext: Extent | None, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return ~self.part._eval(ext, b, h, q, k)

    def _tile_bits(self, grid: BlockGrid, tiles: Tiles) -> torch.Tensor:
        return ~self.part.tile_bits(grid, tiles) & grid.valid_words(tiles)
