"""The analytical attention model: sane estimates, choices that follow the mask, explain output (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stof_cc import AttentionInputError, explain_attention, masks
from stof_cc.templates.attention import config_label
from stof_cc.tune.cost_model import estimate, occupancy, stof_rule

PARAMS = {"strategy": "blockwise", "block_m": 128, "block_n": 64, "warps": 4, "m_tiles": 2, "stages": 2}


def test_occupancy_takes_the_tightest_limit():
    assert occupancy(128, 55 * 1024, 246) == 2  # the ptxas figures of the H100 profile: 2 CTAs/SM
    assert occupancy(32, 1024, 64) == 32  # many tiny CTAs: the CTA limit
    assert occupancy(128, 300 * 1024, 64) == 0  # does not fit at all


def test_estimate_grows_with_work_and_is_infinite_when_nothing_fits():
    small = estimate(PARAMS, 64, 12, [4] * 16, 0, 55 * 1024, 132, 246)
    large = estimate(PARAMS, 64, 12, [64] * 64, 0, 55 * 1024, 132, 246)
    partial = estimate(PARAMS, 64, 12, [64] * 64, 500, 55 * 1024, 132, 246)
    assert 0 < small.micros < large.micros < partial.micros
    # a warp-specialised point whose consumers read the bit words from L2 pays for each PARTIAL block
    assert estimate(PARAMS, 64, 12, [64] * 64, 500, 55 * 1024, 132, 246, exposed_bit_loads=True).micros > partial.micros
    assert estimate(PARAMS, 64, 12, [4], 0, 300 * 1024, 132, 246).micros == float("inf")


def test_one_long_row_is_the_critical_path():
    even = estimate(PARAMS, 64, 1, [10] * 8, 0, 55 * 1024, 132, 246)
    skewed = estimate(PARAMS, 64, 1, [73] + [1] * 7, 0, 55 * 1024, 132, 246)
    assert skewed.micros > even.micros  # same block count, one CTA must walk them all


def test_a_persistent_point_leads_its_one_cta_per_tile_twin():
    """Measured on the H100 with the TMA producer: persistent CTAs faster or level on the causal
    rows, K and V within the L2 or past it (D = 128, S = 8192: 64 MiB)."""
    twin = {"strategy": "wgmma_ws", "block_m": 128, "block_n": 128, "warps": 8, "m_tiles": 1, "stages": 2,
            "persistent": False}
    rows = list(range(64, 0, -1))  # causal S = 8192
    grid, persistent = (estimate(twin | {"persistent": p}, 128, 16, rows, 64, 160 * 1024, 132, 168, 384).micros
                        for p in (False, True))
    assert persistent < grid


def test_stof_rule_matches_the_paper_threshold():
    rho, tau, pick = stof_rule(nonempty_16=64 * 64, blocks_16=64 * 64)  # S = 1024, all blocks on
    assert (rho, pick) == (1.0, "blockwise") and tau == pytest.approx(1 / 36)
    assert stof_rule(nonempty_16=64, blocks_16=64 * 64)[2] == "rowwise"


def test_explain_lists_every_candidate_best_first():
    choice = explain_attention(2, 12, 2048, 2048, 64, masks.longformer(128, 32))
    micros = [e.micros for e in choice.estimates]
    assert micros == sorted(micros) and len(micros) > 10
    assert choice.params == choice.estimates[0].params
    text = choice.explain()
    assert text.startswith(f"chosen: {choice.template.name} {config_label(choice.params)}")
    assert "STOF's density rule suggests" in text


def test_explain_says_who_overrode_stofs_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the H100's candidates
    choice = explain_attention(1, 12, 4096, 4096, 64, masks.sliding_window(256))
    assert choice.stof_rule[2] == "blockwise" and choice.params["strategy"] != "blockwise"
    assert "; the cost model picks wgmma" in choice.explain()
    measured = dataclasses.replace(choice, measured_us=12.5)  # as `adopt_choice` records a stage 2 winner
    assert "measured 12.5 us (stage 2 of the search)" in measured.explain()
    assert "; stage 2 of the search picks wgmma" in measured.explain()


def test_sparser_masks_are_estimated_cheaper():
    dense = explain_attention(1, 12, 8192, 8192, 64, masks.causal()).estimates[0].micros
    sparse = explain_attention(1, 12, 8192, 8192, 64, masks.sliding_window(256)).estimates[0].micros
    assert sparse < dense / 3


def test_explain_rejects_what_no_kernel_runs():
    with pytest.raises(AttentionInputError, match="head_dim 80"):
        explain_attention(1, 1, 128, 128, 80)
    with pytest.raises(AttentionInputError, match="dtype"):
        explain_attention(1, 1, 128, 128, 64, dtype=torch.float32)
    with pytest.raises(AttentionInputError, match="seq_q=0"):
        explain_attention(1, 1, 0, 128, 64)



def test_whole_tiles_that_do_not_divide_evenly_over_the_sms_are_priced():
    """Document S = 8192 at d = 64 (H = 12, four documents of 2048): 192-row tiles at multiples of 192
    make 516 tiles of 16 or 32 blocks for 132 CTAs, the busiest 84 units of work against an even 69;
    on an H200 they ran 1.15x slower than 128-row tiles (0.142 against 0.124 ms), which the model had
    ranked first. Tiles that start where documents start (masks.row_origins) are 16 blocks each: the
    model picks them now, and they ran 0.110 ms there (history/40)."""
    from stof_cc.templates.attention import AttentionProblem
    from stof_cc.tune.attention import choose, row_origins
    from stof_cc.tune.cost_model import tile_imbalance

    document = masks.document(segment_ids=torch.arange(8192) // 2048)
    rows_192 = [int(c) for c in torch.diff(document.block_mask(8192, 8192, 192, 128).any_ptr)]
    rows_128 = [int(c) for c in torch.diff(document.block_mask(8192, 8192, 128, 128).any_ptr)]
    assert tile_imbalance(tuple(rows_192), 12, 132) == pytest.approx(84 / (9156 / 132))
    assert tile_imbalance(tuple(rows_128), 12, 132) < 1.05
    assert tile_imbalance((8,) * 4096, 12, 132) == 1.0  # many short tiles per SM: even enough, no schedule run
    assert tile_imbalance((3, 50), 1, 132) == 1.0  # a tile per SM: the critical path prices the longest
    problem = AttentionProblem(1, 12, 8192, 8192, 64, torch.float16)
    pick = choose(problem, document).params
    assert pick["block_m"] == 192 and row_origins(document, problem, pick) is not None, config_label(pick)
