"""Documents' tile bits from each query row's key interval (`bits.interval_words`) are the bits
the generic evaluation packs, and their classes (exact where nothing is padding) the checked ones:
every field of the block mask, on ragged and padded shapes."""

from __future__ import annotations

import random

import pytest
import torch

from stof_cc import masks
from stof_cc.masks.bits import interval_words, pack_last
from stof_cc.masks.description import MaskDescription

FIELDS = ("any_ptr", "any_cols", "full_ptr", "full_cols", "part_ptr", "part_cols", "part_bits")


def test_interval_words_set_bits_lo_to_hi():
    lo = torch.tensor([0, 0, 5, 31, 32, 64, 10])
    hi = torch.tensor([0, 64, 40, 33, 64, 64, 10])
    columns = torch.arange(64)
    want = pack_last((columns >= lo[:, None]) & (columns < hi[:, None]))
    assert torch.equal(interval_words(lo, hi, 64), want)


@pytest.mark.parametrize("seed", range(40))
def test_documents_tile_bits_match_the_generic_evaluation(seed):
    rng = random.Random(seed)
    seq_q = rng.choice([64, 100, 257, 1000, 2048, 3001])
    seq_k = rng.choice([seq_q, seq_q + 37, max(1, seq_q - 50)])
    count = rng.randint(1, 12)
    lengths = [rng.randint(1, max(1, 2 * seq_q // count)) for _ in range(count)]  # their sum may pass seq: padding
    block_m, block_n = rng.choice([(64, 64), (128, 128), (64, 128), (128, 64), (192, 128), (16, 32), (32, 48)])
    got = masks.document(lengths).block_mask(seq_q, seq_k, block_m, block_n)
    generic = masks.document(lengths)  # every element evaluated, every class checked against the bits
    generic._tile_bits = lambda grid, tiles: MaskDescription._tile_bits(generic, grid, tiles)
    generic.exact_classes = lambda grid: False
    want = generic.block_mask(seq_q, seq_k, block_m, block_n)
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), (field, seq_q, seq_k, lengths, block_m, block_n)
