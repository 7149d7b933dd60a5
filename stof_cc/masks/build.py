"""Building a BlockMask from a description: classify every block row analytically, evaluate
only the blocks that may be partial (in bounded chunks), make the classes exact, collapse
batch/head slices that are equal, and lay the result out as CSR.

Memory is the classes as runs per block row (ClassRuns) plus the tiles of partial blocks: no
step holds a class per block of the grid, nor a dense seq_q x seq_k mask unless the
description itself is one (from_dense). The classes and the CSR offsets are made on the CPU;
the tiles are gathered where the block mask is wanted (`tile_bits_on`), so a mask evaluated on
the GPU never sends its tiles to the host and back. A mask evaluated on the GPU whose packed bits
are kept there (`grid_classes`: a mask_mod or a dense mask up to PACKED_BUDGET) is assembled there
instead, classes, CSR and all (`BlockMask.from_grid`): a mask built per call then costs the GPU's
time and one wait for two counts, not the host's work over every block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stof_cc.masks.block_mask import BlockMask
from stof_cc.masks.errors import MaskError
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL, BlockGrid
from stof_cc.masks.runs import ClassRuns

if TYPE_CHECKING:
    from stof_cc.masks.description import MaskDescription

#: Elements of maybe-partial blocks evaluated for one build, past which it is refused: a mask
#: with so little structure (a user mask over S = 131072 x 131072 is this many) takes minutes.
EVALUATION_BUDGET = 1 << 34
#: Devices on which a description that holds its class grid (`grid_classes`) gets its block mask
#: assembled there (`BlockMask.from_grid`); elsewhere, and on the CPU, from runs. Tests add "cpu".
GRID_DEVICE_TYPES = ("cuda",)


def build_block_mask(desc: MaskDescription, grid: BlockGrid, dims: tuple[int, int],
                     device: torch.device) -> BlockMask:
    """The BlockMask of `desc` on `grid`, with leading mask dims `dims` = (Bm, Hm), on `device`."""
    held = desc.grid_classes(grid) if device.type in GRID_DEVICE_TYPES else None
    if held is not None and held[0].device.type == device.type:  # assembled where the mask was evaluated
        classes, tiles = _collapse_grid(*held)
        ranked = desc.grid_ranked(grid) if classes.shape == held[0].shape else None  # ranked before any collapse
        return BlockMask.from_grid(classes, tiles, grid.ext.seq_q, grid.ext.seq_k, grid.block_m, grid.block_n,
                                   ranked_on_device=desc.grid_built_per_call(grid), ranked=ranked).to(device)
    runs, bits = _exact(desc, grid, dims, device, keep_bits=True)
    runs, bits = _collapse(runs, bits)
    return BlockMask.from_runs(
        runs, bits, grid.ext.seq_q, grid.ext.seq_k, grid.block_m, grid.block_n, grid.row_origins
    ).to(device)  # the CSR arrays follow the tiles (which are there already)


def build_block_runs(desc: MaskDescription, grid: BlockGrid, dims: tuple[int, int]) -> ClassRuns:
    """`desc`'s exact classes with dims `dims`, without the CSR arrays or the PARTIAL blocks'
    tiles: what the cost model counts. A description whose analytic classes are exact
    evaluates nothing."""
    return _exact(desc, grid, dims, torch.device("cpu"), keep_bits=False)[0]


def _exact(desc: MaskDescription, grid: BlockGrid, dims: tuple[int, int], device: torch.device,
           keep_bits: bool) -> tuple[ClassRuns, torch.Tensor | None]:
    """The classes with every maybe-PARTIAL block evaluated (unless the classes are exact
    already) and, with ``keep_bits``, the PARTIAL blocks' tiles on `device` in row-major order."""
    runs = grid.classes(desc).expand(*dims)
    exact = desc.exact_classes(grid)
    if exact and not keep_bits:
        return runs, None
    total = runs.total(PARTIAL)
    if not exact and not desc.invariant:
        _check_budget(desc, grid, total)
    per_chunk = desc.tiles_per_chunk(grid) or max(1, total)
    kept, keys, codes = [], [], []
    for first in range(0, total, per_chunk):
        tiles = runs.tiles(PARTIAL, first, min(per_chunk, total - first))
        bits = desc.tile_bits_on(grid, tiles, device)
        if exact:  # every PARTIAL block is partial: its bits are kept as they are
            kept.append(bits)
            continue
        full = (bits == grid.valid_words(tiles).to(device)).all(1).cpu()
        empty = (bits == 0).all(1).cpu()
        keys.append(runs.block_key(tiles.b, tiles.h, tiles.i, tiles.j))
        codes.append(torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)))
        if keep_bits:
            kept.append(bits[(~(full | empty)).to(device)])
    if not exact and total:
        runs = runs.settled(torch.cat(keys), torch.cat(codes))
    if not keep_bits:
        return runs, None
    bits = kept[0] if len(kept) == 1 else torch.cat(kept) if kept else \
        torch.zeros(0, grid.words, dtype=torch.int32, device=device)
    return runs, bits


def _check_budget(desc: MaskDescription, grid: BlockGrid, blocks: int) -> None:
    elements = blocks * grid.block_m * grid.block_n
    if elements > EVALUATION_BUDGET:
        raise MaskError(
            f"{desc!r} at {grid.ext.seq_q} x {grid.ext.seq_k}: {blocks} blocks of {grid.block_m} x "
            f"{grid.block_n} may be partial, {elements:.3g} elements to evaluate, over the budget of "
            f"{EVALUATION_BUDGET:.3g} (stof_cc.masks.build.EVALUATION_BUDGET). Describe the mask with "
            "the zoo (masks.causal(), masks.sliding_window(w), masks.document(...), ...), whose blocks "
            "are classified without evaluating them, or intersect it with one "
            "(masks.sliding_window(w) & from_mask_mod(fn)) so that fewer blocks stay partial")


def _collapse_grid(classes: torch.Tensor, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_collapse` for a class grid and every block's tile: a dim shrinks to 1 where every slice
    along it is the same (equal classes and tiles; FULL and EMPTY blocks' tiles are equal too)."""
    for dim in (0, 1):
        if classes.shape[dim] > 1:
            first = (slice(None),) * dim + (slice(0, 1),)
            if bool((classes == classes[first]).all() & (tiles == tiles[first]).all()):
                classes, tiles = classes[first], tiles[first]
    return classes.contiguous(), tiles.contiguous()


def _collapse(runs: ClassRuns, bits: torch.Tensor) -> tuple[ClassRuns, torch.Tensor]:
    """Shrink the batch and head dims to 1 where every slice has the same classes and tiles.
    Tiles are in row-major (b, h, i, j) order, so each slice's tiles are one contiguous run;
    slices with equal classes have equal-sized runs (but different batch elements may
    not: causal with per-sequence padding has more partial tiles in a shorter sequence)."""
    words = bits.shape[1]
    batch = runs.batch
    if batch > 1 and runs.equal_slices(0):
        per_batch = bits.view(batch, bits.shape[0] // batch, words)
        if bool((per_batch == per_batch[:1]).all()):
            runs, bits = runs.first(0), per_batch[0]
    if runs.heads > 1 and runs.equal_slices(1):  # classes on the CPU, bits where the mask is built
        per_batch = bits.split(runs.per_row(PARTIAL).view(runs.batch, -1).sum(1).tolist())
        per_head = [run.view(runs.heads, run.shape[0] // runs.heads, words) for run in per_batch]
        if all(bool((run == run[:1]).all()) for run in per_head):
            runs, bits = runs.first(1), torch.cat([run[0] for run in per_head])
    return runs, bits.contiguous()
