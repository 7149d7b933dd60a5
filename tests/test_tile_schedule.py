"""Tile schedules of the warp-specialised attention kernel (CPU): every tile exactly once,
longest first, persistent CTAs balanced, and L2 sections where they keep the balance."""

from __future__ import annotations

import torch

from stof_cc import masks
from stof_cc.backends.tile_schedule import (
    TILE_ENTRY,
    balanced_section,
    pairs_per_section,
    tile_costs,
    tile_schedule,
)
from stof_cc.masks.block_mask import BlockMask
from stof_cc.templates.attention import AttentionProblem
from stof_cc.tune.attention import cached_block_mask


def _block_mask(description, batch: int, heads: int, seq: int) -> BlockMask:
    problem = AttentionProblem(batch, heads, seq, seq, 64, torch.float16)
    return cached_block_mask(description, problem, {"block_m": 128, "block_n": 128}, torch.device("cpu"))


def _decode(table: torch.Tensor, ctas: int, block_mask: BlockMask | None = None,
            block_m: int = 128) -> list[list[tuple[int, int, int]]]:
    """Each CTA's (head, batch, block row) tiles (the entries hold each tile's first query row: a
    multiple of ``block_m``); with ``block_mask``, checks each tile's [first, last) against the
    mask's row pointers."""
    offsets = table[: ctas + 1].tolist()
    entries = table[ctas + 1:].view(-1, TILE_ENTRY).tolist()
    assert offsets[0] == 0 and offsets[-1] == len(entries)
    assert all(q0 % block_m == 0 for _, _, q0, _, _ in entries)
    entries = [[h, b, q0 // block_m, first, last] for h, b, q0, first, last in entries]
    if block_mask is not None:
        any_ptr = block_mask.any_ptr.tolist()
        for h, b, row, first, last in entries:
            mask_row = ((b if block_mask.batch > 1 else 0) * block_mask.heads
                        + (h if block_mask.heads > 1 else 0)) * block_mask.n_rb + row
            assert (first, last) == (any_ptr[mask_row], any_ptr[mask_row + 1])
    return [[tuple(t[:3]) for t in entries[offsets[c]:offsets[c + 1]]] for c in range(ctas)]


def _every_tile_once(per_cta, batch: int, heads: int, rows: int) -> None:
    seen = sorted(t for tiles in per_cta for t in tiles)
    assert seen == sorted((h, b, r) for h in range(heads) for b in range(batch) for r in range(rows))


def test_grid_schedule_is_one_tile_per_cta_longest_first_heads_fastest():
    bm = _block_mask(masks.causal(), 2, 3, 1000)
    schedule = tile_schedule(bm, 2, 3, None)
    assert schedule.ctas == 2 * 3 * bm.n_rb
    per_cta = _decode(schedule.table, schedule.ctas, bm)
    assert all(len(tiles) == 1 for tiles in per_cta)
    _every_tile_once(per_cta, 2, 3, bm.n_rb)
    tiles = [tiles[0] for tiles in per_cta]
    assert tiles[:6] == [(h, b, bm.n_rb - 1) for b in range(2) for h in range(3)]  # the longest row first
    assert tiles[-1] == (2, 1, 0)


def test_persistent_schedule_balances_ctas_and_keeps_each_longest_first():
    batch, heads, ctas = 1, 12, 132
    bm = _block_mask(masks.causal(), batch, heads, 8192)
    costs = tile_costs(bm, batch, heads)
    schedule = tile_schedule(bm, batch, heads, ctas)
    assert schedule.ctas == ctas
    per_cta = _decode(schedule.table, ctas, bm)
    _every_tile_once(per_cta, batch, heads, bm.n_rb)
    loads = [sum(int(costs[r, b, h]) + 1 for h, b, r in tiles) for tiles in per_cta]
    total = int(costs.sum()) + costs.size
    assert max(loads) <= total / ctas + int(costs.max()) + 1  # LPT's bound: one tile above the mean
    assert max(loads) - min(loads) <= 0.05 * total / ctas
    for tiles in per_cta:
        lengths = [int(costs[r, b, h]) for h, b, r in tiles]
        assert lengths == sorted(lengths, reverse=True)


def test_per_head_masks_are_costed_per_head_and_fewer_tiles_than_ctas_fall_back_to_the_grid():
    dense = torch.zeros(1, 2, 512, 512, dtype=torch.bool)
    dense[0, 0] = True  # head 0 attends everything, head 1 only the first key block
    dense[0, 1, :, :128] = True
    bm = _block_mask(masks.from_dense(dense), 1, 2, 512)
    costs = tile_costs(bm, 1, 2)
    assert costs[:, 0, 0].tolist() == [4] * 4 and costs[:, 0, 1].tolist() == [1] * 4
    schedule = tile_schedule(bm, 1, 2, 3)
    per_cta = _decode(schedule.table, 3, bm)
    _every_tile_once(per_cta, 1, 2, 4)
    assert [len(tiles) for tiles in per_cta] == [2, 3, 3]  # 4 + 4 | 4 + 1 + 1 ... balanced by LPT
    assert tile_schedule(bm, 1, 2, 1000).ctas == 8  # one CTA per tile when there are fewer tiles


def test_tiles_taken_in_turn_keep_the_grid_order_behind_one_count():
    """Per-call row windows: every CTA takes the grid's next tile from a counter, so the table holds
    the grid's entries, offsets 0 but the last (the tile count), and at most one CTA per tile."""
    bm = _block_mask(masks.causal(), 2, 3, 1000)
    grid = tile_schedule(bm, 2, 3, None)
    in_turn = tile_schedule(bm, 2, 3, 4, in_turn=True)
    n_tiles = 2 * 3 * bm.n_rb
    assert in_turn.ctas == 4
    assert in_turn.table[:4].tolist() == [0] * 4 and int(in_turn.table[4]) == n_tiles
    assert torch.equal(in_turn.table[5:], grid.table[n_tiles + 1:])
    assert tile_schedule(bm, 2, 3, 1000, in_turn=True).ctas == n_tiles
    assert tile_schedule(bm, 2, 3, 4) is not in_turn  # the shared schedule is another table


MB = 1 << 20


def test_a_section_holds_the_heads_whose_k_and_v_fit_in_l2_a_power_of_two():
    assert pairs_per_section(4 * MB, 50 * MB) == 8  # 12 fit: FlashAttention rounds down to 8
    assert pairs_per_section(8 * MB, 50 * MB) == 4
    assert pairs_per_section(64 * MB, 50 * MB) == 1  # not even one: one head at a time
    assert pairs_per_section(1 * MB, 50 * MB) == 32


def test_sections_are_widened_until_a_long_tile_cannot_outlast_its_section():
    causal = tile_costs(_block_mask(masks.causal(), 1, 16, 16384), 1, 16).reshape(128, 16)
    assert balanced_section(causal, 4, 132) == 4  # 4 heads: 4 x (8256 + 128) tile costs, 254 per CTA >= 129
    assert balanced_section(causal, 1, 132) == 4  # 1 and 2 heads: 64 and 127 per CTA < 129
    assert balanced_section(causal, None, 132) == 16 and balanced_section(causal, 4, None) == 16
    # a global row (every key block) beside a narrow window: its section must hold 132 x its length
    longformer = tile_costs(_block_mask(masks.longformer(w=256, global_tokens=128), 1, 16, 8192), 1, 16)
    assert balanced_section(longformer.reshape(64, 16), 4, 132) == 16


def test_sectioned_schedules_run_one_section_after_another_longest_first_inside():
    batch, heads, ctas = 2, 4, 16
    bm = _block_mask(masks.causal(), batch, heads, 4096)
    costs = tile_costs(bm, batch, heads)
    kv_bytes = 3 * MB
    for persistent in (False, True):
        schedule = tile_schedule(bm, batch, heads, ctas if persistent else None, 16, kv_bytes, 8 * MB)  # 2 pairs
        per_cta = _decode(schedule.table, schedule.ctas, bm)
        _every_tile_once(per_cta, batch, heads, bm.n_rb)
        runs = per_cta if persistent else [[tiles[0] for tiles in per_cta]]  # per CTA, or the launch order
        for tiles in runs:
            keys = [((b * heads + h) // 2, -int(costs[r, b, h])) for h, b, r in tiles]
            assert keys == sorted(keys)  # by section, then longest first
        if persistent:
            loads = [sum(int(costs[r, b, h]) + 1 for h, b, r in tiles) for tiles in per_cta]
            assert max(loads) - min(loads) <= 0.1 * sum(loads) / ctas


def test_a_query_heads_k_and_v_counts_a_shared_kv_head_once_per_group():
    from stof_cc.backends.attention_launch import kv_bytes_per_query_head

    assert kv_bytes_per_query_head(AttentionProblem(1, 16, 8192, 8192, 128, torch.bfloat16)) == 4 * MB
    assert kv_bytes_per_query_head(AttentionProblem(1, 32, 8192, 8192, 128, torch.float16, kv_heads=8)) == MB
    # a strided split's problem: its sequences are S / d long
    assert kv_bytes_per_query_head(AttentionProblem(8, 4, 2048, 2048, 64, torch.float16, residues=4)) == MB // 2


def _heap_lpt(costs, ctas: int) -> list[int]:
    """The rule, one tile at a time: the least-loaded CTA, ties to the lowest index."""
    import heapq

    loads, owner = [(0, cta) for cta in range(ctas)], []
    for cost in costs:
        load, cta = loads[0]
        owner.append(cta)
        heapq.heapreplace(loads, (load + int(cost), cta))
    return owner


def test_lpt_in_rounds_hands_out_every_tile_as_the_heap_does(monkeypatch):
    """Longest first (and sectioned: longest first twice over), equal costs, a few long tiles among
    short ones (rounds place few tiles there and the heap takes over): the same CTA for every tile."""
    import numpy as np

    from stof_cc.backends import tile_schedule

    heap_runs = []
    real = tile_schedule._by_heap
    monkeypatch.setattr(tile_schedule, "_by_heap", lambda *args: heap_runs.append(1) or real(*args))
    rng = np.random.default_rng(0)
    for trial in range(400):
        n, ctas = int(rng.integers(1, 700)), int(rng.integers(1, 140))
        shape = trial % 4
        if shape == 0:
            costs = np.sort(rng.integers(1, 50, n))[::-1]
        elif shape == 1:
            costs = rng.integers(1, 5, n)
        elif shape == 2:
            half = n // 2 + 1
            costs = np.concatenate([np.sort(rng.integers(1, 300, half))[::-1], np.sort(rng.integers(1, 300, n - half))[::-1]])
        else:
            costs = np.sort(np.concatenate([rng.integers(200, 300, 3), rng.integers(2, 5, n)]))[::-1]
        costs = np.ascontiguousarray(costs, dtype=np.int64)
        got = tile_schedule._longest_first_onto_least_loaded(costs, ctas)
        assert got.tolist() == _heap_lpt(costs, ctas), (trial, n, ctas)
    assert heap_runs  # the heap's part ran too


def test_the_makespan_the_cost_model_prices_is_the_persistent_schedules_busiest_cta():
    import numpy as np

    from stof_cc.backends.tile_schedule import TILE_FIXED_BLOCKS, longest_first_makespan

    mask = masks.document(segment_ids=torch.arange(8192) // 2048)
    block_mask = mask.block_mask(8192, 8192, 192, 128)
    schedule = tile_schedule(block_mask, 1, 12, 132)  # one section: the order the model assumes
    table = schedule.table.numpy()
    offsets, entries = table[:133], table[133:].reshape(-1, TILE_ENTRY)
    work = [int(sum(e[4] - e[3] + TILE_FIXED_BLOCKS for e in entries[offsets[c]:offsets[c + 1]])) for c in range(132)]
    costs = np.sort(np.repeat(np.diff(block_mask.any_ptr_host), 12) + TILE_FIXED_BLOCKS)[::-1]
    assert longest_first_makespan(costs, 132) == max(work) == 84
