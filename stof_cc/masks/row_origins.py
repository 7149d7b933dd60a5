"""Block rows that start where documents start.

A document mask's tiles of block_m query rows cut at multiples of block_m: where a document's
length is no multiple of block_m, the tile over its end holds rows of two documents and walks the
key blocks of both (twice a tile's work for bidirectional documents of S / 4 tokens with 192-row
tiles: 5.5% more blocks at S = 8192, and tiles twice as long as the rest). FlashAttention's varlen
kernels start tiles at every document instead. Here each document gets windows of block_m rows from
its start, and its last window ends at its end, overlapping the one before. The overlapping rows are
computed twice, and both tiles store the same values: every row of a window is classified with the
whole mask, and a key block that one window visits and the other does not is fully masked for the
shared rows, which leaves their running max, sum and output as they were. No tile needs a partial
store. Only a document shorter than block_m (or a rest of one that a window ran into) shares a
window with what follows, as every tile did before.

A window inside one document also needs no block list: its keys are the document's, so it walks
them in blocks from the document's start (`window_keys`), the last block cut at the document's end
by the kernel's per-key test, where key blocks at multiples of block_n would start before the
document and end past it (a PARTIAL block at each end, and 4096 keys in 27 blocks of 160 instead
of 26).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def document_row_origins(starts: Sequence[int], seq: int, block_m: int) -> tuple[int, ...] | None:
    """The first query row of every block row for documents beginning at ``starts`` (ascending,
    the first 0; the last document runs to ``seq``), or None where the plain tiles serve as
    well: every document boundary at a multiple of block_m, or fewer than block_m rows."""
    if seq < block_m or all(start % block_m == 0 for start in starts) and seq % block_m == 0:
        return None
    ends = [*starts[1:], seq]
    origins: list[int] = []
    row = 0  # the first row no window covers yet
    for start, end in zip(starts, ends, strict=True):
        while end - row >= block_m:
            origins.append(row)
            row += block_m
        if row >= end:
            continue
        if end - block_m >= start:  # the document's last window, overlapping its window before
            origins.append(end - block_m)
            row = end
        else:  # a short document (or its rest): its window runs into what follows, or back at the end
            origin = min(row, seq - block_m)
            origins.append(origin)
            row = origin + block_m
    return tuple(origins)


def window_keys(starts: Sequence[int], keys: Sequence[tuple[int, int]], origins: Sequence[int],
                block_m: int) -> tuple[tuple[int, int], ...] | None:
    """Per window (``origins``, block_m rows each), the keys [start, end) its rows attend where they
    all lie in one run of ``starts`` (that run's ``keys``: `MaskDescription.document_keys`), else
    (-1, -1): a window over more than one run keeps its block list. None where no window lies in one."""
    ranges = []
    for origin in origins:
        run = bisect.bisect_right(starts, origin) - 1
        run_end = starts[run + 1] if run + 1 < len(starts) else None
        ranges.append(keys[run] if run_end is None or origin + block_m <= run_end else (-1, -1))
    return tuple(ranges) if any(start >= 0 for start, _ in ranges) else None


def key_blocks(ranges: Sequence[tuple[int, int]], block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys int64 [windows, 2], blocks int64 [windows]) for `window_keys`' ranges: the blocks of
    block_n keys that walk each range from its start, 0 for a window that keeps its block list."""
    keys = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    return keys, np.where(keys[:, 0] >= 0, -(-(keys[:, 1] - keys[:, 0]).clip(min=0) // block_n), 0)
