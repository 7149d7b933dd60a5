"""Which CTA runs which attention tile, for the kernels that walk a list of tiles
(attention_wgmma_ws). A tile is one (head, batch element, block row); its cost is the number of
non-empty key blocks in its row of the block mask plus a fixed share for its prologue and store.

Two schedules, both longest tile first:
* ``grid``: one CTA per tile; the hardware hands CTAs to SMs as they free up.
* ``persistent``: one CTA per SM, each running its share of the tiles back to back (largest
  first onto the least-loaded CTA), so the producer warpgroup loads a tile's Q and first K/V
  blocks while the consumers still finish the one before: no per-CTA start-up on the critical
  path, and no partly filled last wave.

A persistent point whose tiles' work only the device knows (per-call row windows) takes the tiles
in turn instead: the grid's order, each CTA taking the next tile from a counter (``in_turn``).

All run the tiles in L2 sections: consecutive (batch, head) pairs whose K and V fit in L2
together (`pairs_per_section`), one section after another, longest first inside each. Longest
first over all pairs had every CTA on a different head at once: at S = 8192, d = 128, 16 heads
(64 MB of K and V) a causal launch hit L2 for 77% of its reads, FlashAttention-4 with its
sections 90% (ncu on the H100, benchmarks/history/25-2026-11-27.md).

The schedule is one int32 tensor on the mask's device: ``ctas + 1`` offsets, then per tile,
CTA by CTA, ``TILE_ENTRY`` ints: head, batch, the tile's first query row (its block row times
block_m, or the mask's row origin: tiles that start where documents start), and the tile's range
[first, last) in the block mask's ``any_cols`` / ``any_tile`` (so a kernel reads one entry, not the mask's row
pointers after it), or, for a tile inside one document (the mask's ``row_keys``), -(start + 1) and end: the
document's keys, walked in blocks from its start. Kernels read it in place of ``row_order``. Taken in turn, the offsets are 0 but
the last, which counts every tile.
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from stof_cc.masks.block_mask import BlockMask

TILE_FIXED_BLOCKS = 1  # a tile's prologue and output store, in key blocks (for balancing only)
TILE_ENTRY = 5  # ints per tile: head, batch, first query row, first, last
ROUND_AT_LEAST = 8  # tiles a round of `_longest_first_onto_least_loaded` places before the heap takes over
HEAP_TILES = 2  # rounds' worth of tiles the heap then places


@dataclass(frozen=True)
class TileSchedule:
    """``table`` (int32, on the mask's device) for a grid of ``ctas`` CTAs."""

    ctas: int
    table: torch.Tensor


_schedules: weakref.WeakKeyDictionary[BlockMask, dict[tuple, TileSchedule]] = weakref.WeakKeyDictionary()


def tile_costs(block_mask: BlockMask, batch: int, heads: int) -> np.ndarray:
    """int64 [block rows, batch, heads]: each tile's non-empty key blocks, or the blocks that walk
    its key range (``row_keys``), mask slices broadcast over the batch and heads they serve."""
    counts = np.diff(block_mask.any_ptr_host)
    counts = counts.reshape(block_mask.batch, block_mask.heads, block_mask.n_rb)
    spans = block_mask.key_spans()
    if spans is not None:
        keys, blocks = spans
        counts = np.where(keys[:, 0] >= 0, blocks, counts)
    return np.broadcast_to(counts, (batch, heads, block_mask.n_rb)).transpose(2, 0, 1)


def pairs_per_section(kv_bytes: float, l2_bytes: int) -> int:
    """(batch, head) pairs per L2 section: as many consecutive query heads as whose K and V
    (``kv_bytes`` each) fit in ``l2_bytes``, rounded down to a power of two, at least 1 (as
    FlashAttention's LPT scheduler rounds; it assumes 50 MB and a whole K/V head per query head)."""
    fitting = int(l2_bytes // max(kv_bytes, 1.0))
    return 1 << (fitting.bit_length() - 1) if fitting > 1 else 1


def tile_schedule(block_mask: BlockMask, batch: int, heads: int, ctas: int | None, sms: int | None = None,
                  kv_bytes: int | None = None, l2_bytes: int | None = None, in_turn: bool = False) -> TileSchedule:
    """The schedule of every (head, batch, block row) tile: one CTA each when ``ctas`` is None
    (grid, run ``sms`` at a time), else at most ``ctas`` persistent CTAs, each with its share or,
    ``in_turn``, taking the grid's order one tile at a time. Given ``kv_bytes`` (a query head's
    whole K and V: a K/V head's over the query heads that share it), ``l2_bytes`` and ``ctas`` or
    ``sms``, the tiles run in L2 sections (`pairs_per_section`, `balanced_section`); else in one.
    Cached per mask."""
    key = (batch, heads, ctas, sms, kv_bytes, l2_bytes, in_turn)
    cached = _schedules.setdefault(block_mask, {})
    if key not in cached:
        cached[key] = _build(block_mask, batch, heads, ctas, sms, kv_bytes, l2_bytes, in_turn)
    return cached[key]


def balanced_section(costs: np.ndarray, section: int | None, workers: int | None) -> int:
    """The section actually used for tiles of ``costs`` [block rows, pairs] (at most the pairs):
    ``section`` evened out over the pairs, then doubled until no section's longest tile exceeds
    that section's work shared over ``workers`` CTAs, else every pair in one section. A long tile (a Longformer or BigBird
    global row) that starts only with its section ends after everything else: with sections of 4
    heads, Longformer at S = 16384, d = 128 ran 1.08-1.29x slower on the H100 (history/25)."""
    pairs = costs.shape[1]
    if section is None or workers is None or section >= pairs:
        return pairs
    costs = costs + TILE_FIXED_BLOCKS
    while section < pairs:
        section = -(-pairs // -(-pairs // section))  # as many sections, as even as widths allow (12: 6 + 6, not 8 + 4)
        starts = np.arange(0, pairs, section)
        work = np.add.reduceat(costs.sum(axis=0), starts)
        longest = np.maximum.reduceat(costs.max(axis=0), starts)
        if np.all(longest * workers <= work):
            return section
        section *= 2
    return pairs


def _build(block_mask: BlockMask, batch: int, heads: int, ctas: int | None, sms: int | None,
           kv_bytes: int | None, l2_bytes: int | None, in_turn: bool) -> TileSchedule:
    """On the host, in numpy: a mask built per call pays this every call. Inside such a call on
    the lent H100's host (S = 32768, 16 heads, 4096 tiles) the torch version's own time was 27 ms
    (cProfile) and the call took 36 ms, 12 ms with numpy; alone, both take about 4 ms there, most
    of it the LPT loop (benchmarks/history/24-2026-11-27.md)."""
    costs = tile_costs(block_mask, batch, heads)
    n_rb = block_mask.n_rb
    # every head's whole K and V counts: longest first runs the tiles of every document (every row
    # of a causal mask) of every head at once. Counting only the longest tile's span left a document
    # mask in one section, where sections of 4 heads measured 3-4% faster (history/25).
    section = pairs_per_section(kv_bytes, l2_bytes) if kv_bytes and l2_bytes else None
    section = balanced_section(costs.reshape(n_rb, batch * heads), section, ctas or sms)
    # tile index z * (B * H) + b * H + h; by section, then longest first, ties in row-major order
    # (heads fastest)
    flat = costs.reshape(-1)
    pair = np.arange(flat.size) % (batch * heads)
    order = np.lexsort((-flat, pair // section))
    row = order // (batch * heads)
    b = (order // heads) % batch
    h = order % heads
    # the tile's row of the block mask (a mask of one batch element or head serves them all)
    mask_row = ((b if block_mask.batch > 1 else 0) * block_mask.heads + (h if block_mask.heads > 1 else 0)) * n_rb + row
    any_ptr = block_mask.any_ptr_host
    first, last = any_ptr[mask_row], any_ptr[mask_row + 1]
    spans = block_mask.key_spans()
    if spans is not None:  # a tile inside one document: its key range, the start encoded as -(start + 1)
        keys = spans[0][row]
        first, last = np.where(keys[:, 0] >= 0, -(keys[:, 0] + 1), first), np.where(keys[:, 0] >= 0, keys[:, 1], last)
    entries = np.stack((h, b, block_mask.row_starts()[row], first, last), 1).astype(np.int32)
    n_tiles = n_rb * batch * heads
    if ctas is None or (ctas >= n_tiles and not in_turn):
        offsets = np.arange(n_tiles + 1, dtype=np.int32)
        return _on_device(block_mask, n_tiles, offsets, entries)
    if in_turn:
        ctas = min(ctas, n_tiles)
        offsets = np.zeros(ctas + 1, dtype=np.int32)
        offsets[-1] = n_tiles
        return _on_device(block_mask, ctas, offsets, entries)
    owner = _longest_first_onto_least_loaded(flat[order] + TILE_FIXED_BLOCKS, ctas)
    by_cta = np.argsort(owner, kind="stable")  # each CTA's tiles keep the longest-first order
    offsets = np.zeros(ctas + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(np.bincount(owner, minlength=ctas))
    return _on_device(block_mask, ctas, offsets, entries[by_cta])


def _longest_first_onto_least_loaded(costs: np.ndarray, ctas: int) -> np.ndarray:
    """LPT: each tile in turn (the costs longest first) goes to the CTA with the least work so far,
    ties to the lowest index, as a heap of (load, CTA) hands them out. Here a round at a time: the
    next tiles go to the least-loaded CTAs in order for as long as each such CTA is below every
    CTA the round has loaded already (exactly the heap's choice), so causal and document masks take
    about one round per ``ctas`` tiles; rounds that place few tiles (loads far apart against the
    costs) go on with the heap. In Python, tile by tile, 4096 tiles took 1.3 ms on a 2-core EPYC,
    about 4 ms on the lent H100's host, in every call of a mask built per call."""
    owner = np.empty(len(costs), dtype=np.int64)
    loads = np.zeros(ctas, dtype=np.int64)
    start = 0
    while start < len(costs):
        cost = costs[start:start + ctas]
        order = np.argsort(loads, kind="stable")[:len(cost)]  # least loaded first, ties by index
        before = loads[order] * ctas + order  # (load, CTA) as one sortable number
        after = np.minimum.accumulate((loads[order] + cost) * ctas + order)
        fits = np.flatnonzero(before[1:] >= after[:-1])
        take = len(cost) if len(fits) == 0 else int(fits[0]) + 1
        owner[start:start + take] = order[:take]
        loads[order[:take]] += cost[:take]
        start += take
        if take < ROUND_AT_LEAST and start < len(costs):
            start = _by_heap(costs, start, min(len(costs), start + HEAP_TILES * ctas), loads, owner)
    return owner


def longest_first_makespan(costs: np.ndarray, ctas: int) -> int:
    """The busiest CTA's work when tiles of ``costs`` (longest first) go out as the persistent
    schedule deals them (`_longest_first_onto_least_loaded`): what the cost model prices."""
    return int(np.bincount(_longest_first_onto_least_loaded(costs, ctas), weights=costs, minlength=ctas).max())


def _by_heap(costs: np.ndarray, start: int, stop: int, loads: np.ndarray, owner: np.ndarray) -> int:
    """Tiles [start, stop) one at a time off a heap of (load, CTA); ``loads`` updated. Returns stop."""
    heap = sorted((int(load), cta) for cta, load in enumerate(loads))
    for n in range(start, stop):
        load, cta = heap[0]
        owner[n] = cta
        heapq.heapreplace(heap, (load + int(costs[n]), cta))
    for load, cta in heap:
        loads[cta] = load
    return stop


def _on_device(block_mask: BlockMask, ctas: int, offsets: np.ndarray, entries: np.ndarray) -> TileSchedule:
    table = torch.from_numpy(np.concatenate((offsets, entries.reshape(-1))))
    return TileSchedule(ctas, table.to(block_mask.any_ptr.device))
