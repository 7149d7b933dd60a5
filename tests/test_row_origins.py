"""Tiles that start where documents start (masks.row_origins): the windows, the document masks
classified on them, the tile schedule and the cost model's counts (CPU; the kernels on the GPU:
tests/test_attention_gpu.py's document-tile test)."""

from __future__ import annotations

import pytest
import torch

from stof_cc import masks
from stof_cc.backends.tile_schedule import TILE_ENTRY, tile_schedule
from stof_cc.masks.errors import MaskError
from stof_cc.masks.row_origins import document_row_origins
from stof_cc.templates.attention import AttentionProblem
from stof_cc.tune.attention import cached_block_mask, candidates, choose, row_origins


def _ws_point(problem: AttentionProblem, block_m: int, block_n: int) -> dict:
    """The persistent warp-specialised point of this tile shape."""
    return next(p for t, p in candidates(problem, (9, 0))
                if t.walks_tile_schedule and p["persistent"] and (p["block_m"], p["block_n"]) == (block_m, block_n))


CASES = [  # (description, S, block_m)
    (masks.document([100, 50, 850, 200]), 1200, 192),  # a window over two short documents and into a third
    (masks.document(segment_ids=torch.arange(8192) // 2048), 8192, 192),  # the MHA grid's documents
    (masks.document([300, 500]), 1000, 128),  # a padded tail
    (masks.document(segment_ids=torch.tensor([0] * 300 + [-1] * 100 + [1] * 500 + [2] * 100)), 1000, 192),
    (masks.document([700, 296]), 1000, 192),  # a short last document: its window reaches back
]


@pytest.mark.parametrize(("description", "seq", "block_m"), CASES)
def test_windows_cover_every_row_and_stay_in_their_document_where_it_is_long_enough(description, seq, block_m):
    starts = description.document_starts(seq)
    origins = document_row_origins(starts, seq, block_m)
    rows = torch.tensor(origins).view(-1, 1) + torch.arange(block_m)
    assert 0 <= min(origins) and max(origins) + block_m <= seq
    covered = torch.zeros(seq, dtype=torch.bool)
    covered[rows.reshape(-1)] = True
    assert covered.all()
    ends = [*starts[1:], seq]
    for start, end in zip(starts, ends, strict=True):
        # a long document's rows lie in windows of its own, but for those a window of earlier rows ran into
        reached = max([o + block_m for o in origins if o < start], default=start)
        if end - start >= block_m and reached < end:
            own = [o for o in origins if start <= o and o + block_m <= end]
            inside = torch.zeros(seq, dtype=torch.bool)
            for o in own:
                inside[o:o + block_m] = True
            assert inside[max(start, reached):end].all(), (start, end, origins)


@pytest.mark.parametrize(("description", "seq", "block_m"), CASES)
@pytest.mark.parametrize("block_n", [64, 128])
def test_a_block_mask_on_windows_holds_each_rows_true_mask(description, seq, block_m, block_n):
    """Every window row classified with the whole mask (bits included): the block mask densified
    (windows placed where they lie, overlapping rows agreeing) is the dense mask."""
    origins = document_row_origins(description.document_starts(seq), seq, block_m)
    block_mask = description.block_mask(seq, seq, block_m, block_n, row_origins=origins)
    assert block_mask.n_rb == len(origins) and block_mask.row_origins == origins
    assert torch.equal(block_mask.to_dense(), description.to_dense(seq, seq))
    runs = description.block_runs(seq, seq, block_m, block_n, row_origins=origins)
    assert runs.total(masks.geometry.FULL, masks.geometry.PARTIAL) == block_mask.n_nonempty


def test_the_grid_documents_lose_their_partial_blocks():
    """Four documents of 2048 at S = 8192 with 192-row tiles: 704 blocks, none partial, where tiles
    at multiples of 192 hold 720, 64 of them partial; at block_m 128 the plain tiles already fit."""
    description = masks.document(segment_ids=torch.arange(8192) // 2048)
    problem = AttentionProblem(1, 12, 8192, 8192, 64, torch.float16)
    params = _ws_point(problem, 192, 128)
    origins = row_origins(description, problem, params)
    block_mask = cached_block_mask(description, problem, params, torch.device("cpu"))
    assert block_mask.row_origins == origins and (block_mask.n_nonempty, block_mask.n_partial) == (704, 0)
    plain = description.block_mask(8192, 8192, 192, 128)
    assert (plain.n_nonempty, plain.n_partial) == (720, 64)
    assert row_origins(description, problem, _ws_point(problem, 128, 128)) is None  # the plain tiles fit
    wgmma = next(p for t, p in candidates(problem, (9, 0)) if p["strategy"] == "wgmma")
    assert row_origins(description, problem, wgmma) is None  # reads no schedule
    assert row_origins(masks.causal(), problem, params) is None
    assert row_origins(masks.causal() & description, problem, params) is None  # documents alone only
    estimates = {(e.params["strategy"], e.params["block_m"], e.params["block_n"], e.params.get("persistent")): e
                 for e in choose(problem, description, own=True).estimates}
    assert estimates[("wgmma_ws", 192, 128, True)].blocks == 704 * 12


def test_windows_the_model_prices_above_the_plain_tiles_are_not_taken():
    """A padding run between documents: windows over it reach into the next document, and the
    windows hold more blocks (31 of 192 x 128 against 22); the model prices them higher, so the
    plain tiles run."""
    description = masks.document(segment_ids=torch.tensor([0] * 300 + [-1] * 100 + [1] * 500 + [2] * 100))
    problem = AttentionProblem(1, 2, 1000, 1000, 64, torch.float16)
    assert row_origins(description, problem, _ws_point(problem, 192, 128)) is None


def test_the_schedule_hands_each_tile_its_first_row():
    description = masks.document([700, 296])
    problem = AttentionProblem(2, 3, 996, 996, 64, torch.float16)
    block_mask = cached_block_mask(description, problem, _ws_point(problem, 192, 128), torch.device("cpu"))
    assert block_mask.row_origins is not None
    schedule = tile_schedule(block_mask, 2, 3, None)
    entries = schedule.table[schedule.ctas + 1:].view(-1, TILE_ENTRY).tolist()
    assert sorted(q0 for _, _, q0, _, _ in entries) == sorted(block_mask.row_origins * 6)
    any_ptr = block_mask.any_ptr.tolist()
    # windows inside one document (here all: 0, 192, 384, 508; 700, 804) carry its keys, -(start + 1) and end
    assert block_mask.row_keys == ((0, 700),) * 4 + ((700, 996),) * 2
    for _, _, q0, first, last in entries:
        row = block_mask.row_origins.index(q0)
        start, end = block_mask.row_keys[row]
        assert (first, last) == ((-(start + 1), end) if start >= 0 else (any_ptr[row], any_ptr[row + 1]))


def test_document_keys_are_each_documents_own_positions():
    """A run's keys where its rows attend exactly its own positions (padding: none); an id that recurs
    has no such range, and other masks have none."""
    assert masks.document([3, 2]).document_keys(7) == [(0, 3), (3, 5), (5, 5)]
    ids = torch.tensor([0, 0, 1, 1, 2, -1, -1])
    assert masks.document(segment_ids=ids).document_keys(7) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert masks.document(segment_ids=torch.tensor([0, 0, 1, 1, 0, -1, -1])).document_keys(7) is None
    assert masks.document(segment_ids=torch.stack([ids, ids.flip(0)])).document_keys(7) is None  # per batch element
    assert masks.causal().document_keys(7) is None


def test_windows_inside_one_document_walk_its_keys_from_its_start():
    """Four documents of 4096 at d = 128 with 160-key blocks: every 128-row window lies in one
    document, so it walks that document in 26 blocks from its start (4096 keys), none PARTIAL, where
    blocks at multiples of 160 take 27, two of them PARTIAL; the model prices it so and picks it."""
    from stof_cc.backends.tile_schedule import tile_costs
    from stof_cc.masks.row_origins import window_keys

    description = masks.document(segment_ids=torch.arange(16384) // 4096)
    problem = AttentionProblem(1, 16, 16384, 16384, 128, torch.bfloat16)
    params = _ws_point(problem, 128, 160)
    origins = row_origins(description, problem, params)
    assert origins == tuple(range(0, 16384, 128))  # the plain tiles' rows, as windows
    block_mask = cached_block_mask(description, problem, params, torch.device("cpu"))
    assert block_mask.row_keys == tuple((4096 * (o // 4096), 4096 * (o // 4096 + 1)) for o in origins)
    assert (tile_costs(block_mask, 1, 16) == 26).all()
    plain = description.block_mask(16384, 16384, 128, 160)
    assert plain.any_ptr[33] - plain.any_ptr[32] == 27 and plain.n_partial > 0
    choice = choose(problem, description, own=True)
    assert (choice.params["block_n"], choice.document_tiles, choice.key_walks) == (160, 128, 128)
    assert "128 of them lie in one document and walk its keys" in choice.explain()
    assert next(e for e in choice.estimates if e.params == params).partial_blocks == 0
    starts = description.document_starts(16384)
    assert window_keys(starts, description.document_keys(16384), (0, 4000), 128) == ((0, 4096), (-1, -1))
    assert window_keys(starts, description.document_keys(16384), (4000,), 128) is None
    short = masks.document([100, 50, 850, 200])  # the first window holds two short documents and part of a third
    short_origins = document_row_origins(short.document_starts(1200), 1200, 192)
    keys = window_keys(short.document_starts(1200), short.document_keys(1200), short_origins, 192)
    assert keys == ((-1, -1),) + ((150, 1000),) * 5 + ((1000, 1200),) * 2


def test_row_origins_are_refused_for_other_masks_and_where_they_leave_rows_out():
    with pytest.raises(MaskError, match="document masks"):
        masks.causal().block_mask(1000, 1000, 192, 128, row_origins=(0, 192))
    document = masks.document([700, 296])
    with pytest.raises(MaskError, match="query row 192 in no window"):
        document.block_mask(996, 996, 192, 128, row_origins=(0, 500))
    with pytest.raises(MaskError, match="whole 192-row window inside 996"):
        document.block_mask(996, 996, 192, 128, row_origins=(0, 900))
    with pytest.raises(MaskError, match="sequence of ints"):
        document.block_mask(996, 996, 192, 128, row_origins=("a",))
    origins = document_row_origins(document.document_starts(996), 996, 192)
    assert document.block_mask(996, 996, 192, 128, row_origins=list(origins)).row_origins == origins


@pytest.mark.parametrize(("lengths", "seq", "block_m", "block_n"), [([200] * 5, 1000, 192, 128), ([700, 296], 996, 192, 128),
                                                                    ([100, 200], 300, 192, 64)])
def test_a_window_mask_counts_each_attended_element_once(lengths, seq, block_m, block_n):
    """Rows two windows share count once (n_attended, the density in the repr); pictures refuse such a mask."""
    from stof_cc.masks.picture import render

    document = masks.document(lengths)
    origins = document_row_origins(document.document_starts(seq), seq, block_m)
    block_mask = document.block_mask(seq, seq, block_m, block_n, row_origins=origins)
    assert block_mask.n_attended == int(document.to_dense(seq, seq).sum())
    assert "block rows from document starts" in repr(block_mask)
    with pytest.raises(MaskError, match="row_origins"):
        render(block_mask)


def test_explain_says_where_the_tiles_start():
    from stof_cc.tune.attention import explain_attention

    text = explain_attention(1, 12, 8192, 8192, 64, masks.document(segment_ids=torch.arange(8192) // 2048)).explain()
    assert "its 44 tiles per (batch, head) are laid out from the documents' starts" in text
    assert "documents' starts" not in explain_attention(1, 12, 8192, 8192, 64, masks.causal()).explain()
