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


def _segment_ids(rng: random.Random, rows: int, size: int, contiguous: bool, padded: bool) -> torch.Tensor:
    """Ordered ids in runs, with ``padded`` padding (-1) between some runs; with
    ``contiguous=False`` one document comes back after padding (two runs: the generic path)."""
    out = []
    for _ in range(rows):
        ids, doc = [], 0
        while len(ids) < size:
            ids += [doc] * rng.randint(1, max(1, size // 4))
            if padded and rng.random() < 0.3:
                ids += [-1] * rng.randint(1, 9)
            doc += 1
        if not contiguous:
            ids[size // 2: size // 2 + 3] = [-1, -1, -1]  # splits whichever document runs there
        out.append(ids[:size])
    return torch.tensor(out)


@pytest.mark.parametrize("seed", range(30))
def test_segment_ids_tile_bits_match_the_generic_evaluation(seed):
    rng = random.Random(seed)
    seq = rng.choice([64, 257, 1000, 2048])
    rows = rng.choice([1, 1, 3])
    block_m, block_n = rng.choice([(64, 64), (128, 128), (64, 128), (192, 128), (32, 48)])
    ids = _segment_ids(rng, rows, seq + rng.choice([0, 5]), contiguous=seed % 5 != 0,
                       padded=seed % 2 == 0)  # unpadded and contiguous: exact classes
    got = masks.document(segment_ids=ids).block_mask(seq, seq, block_m, block_n, batch=rows)
    generic = masks.document(segment_ids=ids)  # every element evaluated, every class checked
    generic._tile_bits = lambda grid, tiles: MaskDescription._tile_bits(generic, grid, tiles)
    generic.exact_classes = lambda grid: False
    want = generic.block_mask(seq, seq, block_m, block_n, batch=rows)
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), (field, seq, rows, block_m, block_n, seed)
