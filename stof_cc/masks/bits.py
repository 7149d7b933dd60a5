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
    """bool [N, m, n] -> int32 [N, ceil(m*n/32)] (the bit pattern of the uint32 words), on
    the tensor's device."""
    count, m, n = tiles.shape
    return pack_last(tiles.reshape(count, m * n))


_BYTE_SHIFTS: dict[torch.device, torch.Tensor] = {}


def pack_last(bits: torch.Tensor) -> torch.Tensor:
    """bool [..., n] -> int32 [..., ceil(n/32)]: bit c in word c // 32 at bit c % 32 (least
    significant first), padded with zeros. numpy's packbits on the CPU; shifts and a byte sum
    elsewhere (a GPU packs what it evaluated without a round trip)."""
    pad = -bits.shape[-1] % 32
    if pad:
        bits = torch.cat([bits, bits.new_zeros(*bits.shape[:-1], pad)], dim=-1)
    if bits.device.type == "cpu":
        packed = np.packbits(bits.contiguous().numpy(), axis=-1, bitorder="little")
        return torch.from_numpy(np.ascontiguousarray(packed).view("<i4").astype(np.int32, copy=False))
    if bits.device not in _BYTE_SHIFTS:
        _BYTE_SHIFTS[bits.device] = torch.arange(8, dtype=torch.uint8, device=bits.device)
    octets = bits.reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8).to(torch.uint8) << _BYTE_SHIFTS[bits.device]
    return octets.sum(-1, dtype=torch.uint8).view(torch.int32)  # four bytes per word, little-endian


def interval_words(lo: torch.Tensor, hi: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [..., width / 32]: rows of ``width`` bits (a multiple of 32) with bits [lo, hi) set,
    as `pack_last` lays them out, for int64 bounds [...] with 0 <= lo <= hi <= width. Word
    arithmetic, 32 x fewer elements than evaluating and packing each bit."""
    start = torch.arange(0, width, 32, device=lo.device)
    low, high = ((bound[..., None] - start).clamp(0, 32) for bound in (lo, hi))
    words = ((1 << high) - 1) ^ ((1 << low) - 1)  # int64: bits [low, high) of each word
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def bit_at(words: torch.Tensor, rows: tuple[torch.Tensor, ...], col: torch.Tensor) -> torch.Tensor:
    """Bits of row-packed words [..., ceil(n / 32)] (as `pack_last` makes them) at leading
    indices ``rows`` and column ``col``, broadcast together: bool, on the words' device."""
    col = col.to(words.device)
    bit = (1 << (col % 32)).to(words.dtype)  # on the columns' shape, before the gather broadcasts
    return words[(*(r.to(words.device) for r in rows), col // 32)] & bit != 0


def unpack(words: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """int32 or uint32 [N, W] -> bool [N, m, n]; the inverse of `pack`."""
    raw = words.view(torch.int32).numpy().astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, : m * n]
    return torch.from_numpy(bits.astype(bool)).view(-1, m, n)


def popcount(words: torch.Tensor) -> int:
    """Number of set bits in int32 or uint32 words (counted unsigned: numpy counts the
    absolute value of signed ints)."""
    return int(np.bitwise_count(words.view(torch.int32).numpy().view(np.uint32)).sum())
