"""Bit packing of mask tiles into the uint32 words that kernels read.

Element (r, c) of a block_m x block_n tile is bit index idx = r * block_n + c, stored in
word idx // 32 at bit idx % 32 (least significant bit first). numpy's little-endian
packbits produces exactly this byte order, so packing is one library call.
"""

from __future__ import annotations

import numpy as np
import torch


def n_words(block_m: int, block_n: int) -> int:
    """Words per packed tile: ceil(block_m * block_n / 32)."""
    return -(-block_m * block_n // 32)


def pack(tiles: torch.Tensor) -> torch.Tensor:
    """bool [N, m, n] -> int32 [N, ceil(m*n/32)] (the bit pattern of the uint32 words)."""
    count, m, n = tiles.shape
    flat = tiles.reshape(count, m * n)
    pad = n_words(m, n) * 32 - m * n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(count, pad)], dim=1)
    packed = np.packbits(flat.numpy(), axis=1, bitorder="little")
    return torch.from_numpy(packed.view("<i4").astype(np.int32, copy=False))


def unpack(words: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """int32 or uint32 [N, W] -> bool [N, m, n]; the inverse of `pack`."""
    raw = words.view(torch.int32).numpy().astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, : m * n]
    return torch.from_numpy(bits.astype(bool)).view(-1, m, n)


def popcount(words: torch.Tensor) -> int:
    """Number of set bits in int32 or uint32 words (counted unsigned: numpy counts the
    absolute value of signed ints)."""
    return int(np.bitwise_count(words.view(torch.int32).numpy().view(np.uint32)).sum())
