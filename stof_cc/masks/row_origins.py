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
"""

from __future__ import annotations

from collections.abc import Sequence


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
