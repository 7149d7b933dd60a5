"""The six masks of the standard MHA benchmark grid (benchmarks/WORKLOADS.md), exactly as
defined there, so that stof-cc and every peer are measured on the same masks."""

from __future__ import annotations

import torch

from stof_cc.masks.description import MaskDescription
from stof_cc.masks.errors import MaskError, check_int
from stof_cc.masks.zoo import (
    bigbird,
    causal,
    dilated,
    document,
    longformer,
    random_blocks,
    sliding_window,
)

GRID_MASKS = ("causal", "sliding", "dilated", "longformer", "bigbird", "document")
GRID_SEQS = (128, 256, 512, 1024, 2048, 8192)
GRID_HEADS = 12
GRID_HEAD_DIM = 64
GRID_GLOBAL_TOKENS = 32
GRID_DILATION = 4
GRID_RANDOM_BLOCKS = 3
GRID_RANDOM_BLOCK = 64
GRID_SEED = 0


def grid_window(seq: int) -> int:
    """w = max(64, S // 16)."""
    return max(64, seq // 16)


def grid_batch(seq: int) -> int:
    """4096 tokens per call: B = 8 for S <= 512, else 4096 // S (at least 1)."""
    return 8 if seq <= 512 else max(1, 4096 // seq)


def grid_mask(name: str, seq: int) -> MaskDescription:
    """The grid mask `name` at sequence length `seq`:
    causal      q >= k
    sliding     |q - k| <= w
    dilated     |q - k| <= 4w and (q - k) % 4 == 0
    longformer  |q - k| <= w, or q < 32, or k < 32
    bigbird     longformer, or a random 64x64 block, each on with probability 3 / (S/64)
    document    doc(q) == doc(k), doc(x) = x // max(128, S // 4)
    """
    seq = check_int("grid_mask", "seq", seq)
    w = grid_window(seq)
    if name == "causal":
        return causal()
    if name == "sliding":
        return sliding_window(w)
    if name == "dilated":
        return dilated(w, GRID_DILATION)
    if name == "longformer":
        return longformer(w, GRID_GLOBAL_TOKENS)
    if name == "bigbird":
        return bigbird(w, GRID_GLOBAL_TOKENS, GRID_RANDOM_BLOCKS, GRID_RANDOM_BLOCK, GRID_SEED)
    if name == "document":
        return document(segment_ids=torch.arange(seq) // max(128, seq // 4))
    raise MaskError(f"grid_mask: name must be one of {', '.join(GRID_MASKS)}, got {name!r}")


def user_mask_mod(name: str, seq: int, device: torch.device | str = "cpu"):
    """The grid mask `name` as a FlexAttention user writes its mask_mod (benchmarks/WORKLOADS.md):
    plain index arithmetic, BigBird's random blocks and the document ids as tables on ``device``.
    What the FlexAttention peer and the user-mask benchmarks run (not `mask_mod_for`'s table
    lookups, which make FlexAttention slower than it is for its users)."""
    seq = check_int("user_mask_mod", "seq", seq)
    w = grid_window(seq)
    if name == "causal":
        return lambda b, h, q, k: q >= k
    if name == "sliding":
        return lambda b, h, q, k: (q - k).abs() <= w
    if name == "dilated":
        return lambda b, h, q, k: ((q - k).abs() <= GRID_DILATION * w) & (((q - k) % GRID_DILATION) == 0)
    if name == "longformer":
        return lambda b, h, q, k: ((q - k).abs() <= w) | (q < GRID_GLOBAL_TOKENS) | (k < GRID_GLOBAL_TOKENS)
    if name == "bigbird":
        rnd = random_blocks(GRID_RANDOM_BLOCKS, GRID_RANDOM_BLOCK, GRID_SEED).cells(seq, seq).to(device)
        size = GRID_RANDOM_BLOCK
        return lambda b, h, q, k: ((q - k).abs() <= w) | (q < GRID_GLOBAL_TOKENS) | (k < GRID_GLOBAL_TOKENS) \
            | rnd[q // size, k // size]
    if name == "document":
        doc = (torch.arange(seq) // max(128, seq // 4)).to(device)
        return lambda b, h, q, k: doc[q] == doc[k]
    raise MaskError(f"user_mask_mod: name must be one of {', '.join(GRID_MASKS)}, got {name!r}")
