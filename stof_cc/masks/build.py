"""Building a BlockMask from a description: classify every block analytically, evaluate
only the blocks that may be partial (in bounded chunks), make the classes exact, collapse
batch/head slices that are equal, and lay the result out as CSR.

Memory is the class grid (one byte per block) plus the tiles of partial blocks; no step
holds a dense seq_q x seq_k mask unless the description itself is one (from_dense). The
class grid and the CSR offsets are small and made on the CPU; the tiles are gathered where
the block mask is wanted (`tile_bits_on`), so a mask evaluated on the GPU never sends its
tiles to the host and back.
"""

from __future__ import annotations

import torch

from stof_cc.masks.block_mask import BlockMask
from stof_cc.masks.description import MaskDescription
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL, BlockGrid, Tiles

#: Elements evaluated at once: bounds the temporaries of one chunk (a few tens of MB).
CHUNK_ELEMENTS = 1 << 22


def build_block_mask(desc: MaskDescription, grid: BlockGrid, dims: tuple[int, int],
                     device: torch.device) -> BlockMask:
    """The BlockMask of `desc` on `grid`, with leading mask dims `dims` = (Bm, Hm), on `device`."""
    classes, bits = _exact(desc, grid, dims, device, keep_bits=True)
    classes, bits = _collapse(classes, bits)
    return BlockMask.from_classes(
        classes, bits, grid.ext.seq_q, grid.ext.seq_k, grid.block_m, grid.block_n
    ).to(device)  # the CSR arrays follow the tiles (which are there already)


def build_block_classes(desc: MaskDescription, grid: BlockGrid, dims: tuple[int, int]) -> torch.Tensor:
    """`desc`'s exact class grid int8 [Bm, Hm, n_rb, n_cb] on the CPU, without the CSR arrays or
    the PARTIAL blocks' tiles: what the cost model counts. A description whose analytic classes
    are exact evaluates nothing."""
    return _exact(desc, grid, dims, torch.device("cpu"), keep_bits=False)[0]


def _exact(desc: MaskDescription, grid: BlockGrid, dims: tuple[int, int], device: torch.device,
           keep_bits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The class grid with every maybe-PARTIAL block evaluated (unless the classes are exact
    already) and, with ``keep_bits``, the PARTIAL blocks' tiles on `device` in row-major order."""
    classes = grid.classes(desc).expand(*dims, grid.n_rb, grid.n_cb)
    exact = desc.exact_classes(grid)
    if exact and not keep_bits:
        return classes, None
    classes = classes.clone(memory_format=torch.contiguous_format)  # updated in place below
    maybe = (classes == PARTIAL).nonzero()  # row-major: (b, h, i, j) in CSR order
    flat = classes.view(-1)
    strides = torch.tensor(classes.stride())
    per_chunk = desc.tiles_per_chunk(grid) or max(1, len(maybe))
    kept = []
    for start in range(0, len(maybe), per_chunk):
        index = maybe[start : start + per_chunk]
        tiles = Tiles(*index.unbind(1))
        bits = desc.tile_bits_on(grid, tiles, device)
        if exact:  # every PARTIAL block is partial: its bits are kept as they are
            kept.append(bits)
            continue
        full = (bits == grid.valid_words(tiles).to(device)).all(1).cpu()
        empty = (bits == 0).all(1).cpu()
        position = (index * strides).sum(1)
        flat[position[full]] = FULL
        flat[position[empty]] = EMPTY
        if keep_bits:
            kept.append(bits[(~(full | empty)).to(device)])
    if not keep_bits:
        return classes, None
    bits = kept[0] if len(kept) == 1 else torch.cat(kept) if kept else \
        torch.zeros(0, grid.words, dtype=torch.int32, device=device)
    return classes, bits


def _collapse(classes: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shrink the batch and head dims to 1 where every slice has the same classes and tiles.
    Tiles are in row-major (b, h, i, j) order, so each slice's tiles are one contiguous run;
    slices with equal class grids have equal-sized runs (but different batch elements may
    not: causal with per-sequence padding has more partial tiles in a shorter sequence)."""
    words = bits.shape[1]
    batch = classes.shape[0]
    if batch > 1 and bool((classes == classes[:1]).all()):
        runs = bits.view(batch, bits.shape[0] // batch, words)
        if bool((runs == runs[:1]).all()):
            classes, bits = classes[:1], runs[0]
    batch, heads = classes.shape[:2]  # classes on the CPU, bits where the mask is built
    if heads > 1 and bool((classes == classes[:, :1]).all()):
        per_batch = bits.split((classes == PARTIAL).sum((1, 2, 3)).tolist())
        runs = [run.view(heads, run.shape[0] // heads, words) for run in per_batch]
        if all(bool((run == run[:1]).all()) for run in runs):
            classes, bits = classes[:, :1], torch.cat([run[0] for run in runs])
    return classes.contiguous(), bits.contiguous()
