"""BlockMask, the storage format: round trips to dense for random dense masks and random zoo
parameters at every block shape, the exact layout (CSR invariants, bit order, exact
classification), statistics, batch/head collapse, chunked evaluation and memory."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_masks_zoo import FACTORIES, zoo_params

from stof_cc import masks
from stof_cc.masks import user
from stof_cc.masks.block_mask import _TENSORS, coarse_counts
from stof_cc.masks.workloads import GRID_MASKS, grid_mask

BLOCKS = st.sampled_from([16, 32, 64, 128]) | st.integers(1, 40)  # kernels use the former


def _csr(bm: masks.BlockMask, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every entry of one CSR list, after checking its invariants."""
    ptr, cols = getattr(bm, f"{which}_ptr").long(), getattr(bm, f"{which}_cols").long()
    rows = bm.batch * bm.heads * bm.n_rb
    assert ptr.shape == (rows + 1,) and ptr[0] == 0 and ptr[-1] == cols.numel(), which
    assert bool((ptr[1:] >= ptr[:-1]).all()), f"{which}_ptr not monotone"
    assert bool(((cols >= 0) & (cols < bm.n_cb)).all()), f"{which}_cols out of range"
    row = torch.repeat_interleave(torch.arange(rows), ptr[1:] - ptr[:-1])
    same_row = row[1:] == row[:-1]
    assert bool((cols[1:][same_row] > cols[:-1][same_row]).all()), f"{which}_cols not ascending"
    return row, cols


def check_layout(bm: masks.BlockMask, dense: torch.Tensor) -> None:
    """Every documented property of the layout, checked against the dense mask it stores."""
    assert dense.shape == bm.shape
    for name in (
        "full_ptr",
        "full_cols",
        "part_ptr",
        "part_cols",
        "any_ptr",
        "any_cols",
        "any_tile",
    ):
        assert getattr(bm, name).dtype == torch.int32, name
    words = -(-bm.block_m * bm.block_n // 32)
    assert bm.words == words
    assert bm.part_bits.dtype == torch.uint32 and bm.part_bits.shape == (bm.n_partial, words)
    (fr, fc), (pr, pc), (ar, ac) = (_csr(bm, which) for which in ("full", "part", "any"))
    n_cb = bm.n_cb
    # any_* is the ordered merge of full_* and part_*; any_tile points at part_bits rows
    merged = torch.cat([fr * n_cb + fc, pr * n_cb + pc]).sort().values
    assert torch.equal(ar * n_cb + ac, merged)
    tile = bm.any_tile.long()
    is_part = tile >= 0
    assert torch.equal(tile[is_part], torch.arange(bm.n_partial))
    assert torch.equal((ar * n_cb + ac)[is_part], pr * n_cb + pc)
    assert bool((tile[~is_part] == -1).all())
    # classes are exact: from the dense mask, per block
    slices, bm_, bn_ = bm.batch * bm.heads, bm.block_m, bm.block_n
    padded = torch.zeros(slices, bm.n_rb * bm_, n_cb * bn_, dtype=torch.bool)
    padded[:, : bm.seq_q, : bm.seq_k] = dense.reshape(slices, bm.seq_q, bm.seq_k)
    valid = torch.zeros_like(padded[0])
    valid[: bm.seq_q, : bm.seq_k] = True
    blocks = (
        padded.view(-1, bm_, n_cb, bn_).transpose(1, 2).reshape(-1, bm_ * bn_)
    )  # [rows*n_cb, bm*bn]
    valid = valid.view(-1, bm_, n_cb, bn_).transpose(1, 2).reshape(-1, bm_ * bn_).repeat(slices, 1)
    count, area = blocks.sum(1), valid.sum(1)
    assert torch.equal((fr * n_cb + fc), (count == area).nonzero().squeeze(1)), "FULL blocks wrong"
    partial = (count > 0) & (count < area)
    assert torch.equal((pr * n_cb + pc), partial.nonzero().squeeze(1)), "PARTIAL blocks wrong"
    # bits: element (r, c) is bit r*block_n + c, LSB first; out-of-range bits are 0
    raw = bm.part_bits.view(torch.int32).numpy().astype("<i4").view(np.uint8)
    unpacked = torch.from_numpy(
        np.unpackbits(raw, axis=1, bitorder="little")[:, : bm_ * bn_].astype(bool)
    )
    assert torch.equal(unpacked, blocks[partial] & valid[partial]), "tile bits wrong"
    assert bm.n_attended == int(dense.sum())
    assert bm.element_density == pytest.approx(float(dense.float().mean()))
    assert bm.block_density == pytest.approx(len(ac) / (slices * bm.n_rb * n_cb))
    assert bm.partial_share == pytest.approx(bm.n_partial / len(ac) if len(ac) else 0.0)


@st.composite
def dense_masks(draw: st.DrawFn) -> torch.Tensor:
    """Random [B|1, H|1, S_q, S_k] masks: uniform noise at some density, or blocky noise so
    that FULL and EMPTY blocks occur too."""
    batch, heads = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    seq_q, seq_k = draw(st.integers(1, 140)), draw(st.integers(1, 140))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    density = draw(st.sampled_from([0.0, 0.03, 0.5, 0.97, 1.0]))
    cell = draw(st.sampled_from([1, 8, 50]))
    coarse = torch.rand(batch, heads, -(-seq_q // cell), -(-seq_k // cell), generator=gen) < density
    mask = coarse.repeat_interleave(cell, 2).repeat_interleave(cell, 3)[:, :, :seq_q, :seq_k]
    return mask ^ (torch.rand(mask.shape, generator=gen) < draw(st.sampled_from([0.0, 0.01])))


def _broadcast_equal(stored: torch.Tensor, dense: torch.Tensor) -> None:
    assert stored.shape[:2] in {(1, 1), (1, dense.shape[1]), (dense.shape[0], 1), dense.shape[:2]}
    assert torch.equal(stored.expand_as(dense), dense)


@settings(max_examples=80, deadline=None)
@given(dense=dense_masks(), block_m=BLOCKS, block_n=BLOCKS)
def test_from_dense_round_trip(dense, block_m, block_n):
    batch, heads, seq_q, seq_k = dense.shape
    bm = masks.from_dense(dense).block_mask(seq_q, seq_k, block_m, block_n)
    stored = bm.to_dense()
    _broadcast_equal(stored, dense)
    check_layout(bm, stored)
    # a dimension is kept exactly when its slices differ
    assert (bm.batch > 1) == (batch > 1 and not bool((dense == dense[:1]).all()))


@settings(max_examples=100, deadline=None)
@given(
    case=zoo_params(),
    seq_q=st.integers(1, 300),
    seq_k=st.integers(1, 300),
    block_m=BLOCKS,
    block_n=BLOCKS,
)
def test_zoo_round_trip(case, seq_q, seq_k, block_m, block_n):
    name, p = case
    desc = FACTORIES[name](p)
    bm = desc.block_mask(seq_q, seq_k, block_m, block_n)
    dense = desc.to_dense(seq_q, seq_k)
    assert torch.equal(bm.to_dense(), dense), f"{desc!r} {seq_q}x{seq_k} blocks {block_m}x{block_n}"
    check_layout(bm, dense)


@settings(max_examples=30, deadline=None)
@given(
    case=zoo_params(),
    other=zoo_params().filter(lambda c: c[0] != "key_padding"),
    seq=st.integers(1, 200),
    block_m=BLOCKS,
    block_n=BLOCKS,
)
def test_combinations_round_trip(case, other, seq, block_m, block_n):
    a, b = FACTORIES[case[0]](case[1]), FACTORIES[other[0]](other[1])
    for desc in (a | b, a & ~b):
        bm = desc.block_mask(seq, None, block_m, block_n)
        dense = desc.to_dense(seq)
        assert torch.equal(bm.to_dense(), dense), repr(desc)
        check_layout(bm, dense)


def test_per_batch_and_per_head_mask_mod():
    lengths = torch.tensor([5, 70, 33])

    def fn(b, h, q, k):
        return (k < lengths[b]) & ((q - k).abs() <= 4 * (h + 1))

    desc = masks.from_mask_mod(fn)
    bm = desc.block_mask(70, 90, 16, 32, batch=3, heads=2)
    assert (bm.batch, bm.heads) == (3, 2)
    dense = desc.to_dense(70, 90, batch=3, heads=2)
    assert torch.equal(bm.to_dense(), dense)
    check_layout(bm, dense)
    for b in range(3):
        for h in range(2):
            assert torch.equal(bm.dense_slice(b, h), dense[b, h])
    with pytest.raises(masks.MaskError, match="dense_slice: h must be an int in 0..1, got 2"):
        bm.dense_slice(0, 2)


def test_bit_layout_by_hand():
    """Element (r, c) of a tile is bit r * block_n + c, LSB first, in word idx // 32."""
    dense = torch.zeros(16, 16, dtype=torch.bool)
    dense[0, 1] = dense[2, 3] = dense[15, 15] = True  # idx 1, 35, 255
    bm = masks.from_dense(dense).block_mask(16, block_m=16, block_n=16)
    words = bm.part_bits.view(torch.int32)[0].tolist()
    assert len(words) == 8
    assert words[0] == 1 << 1 and words[1] == 1 << 3 and words[7] == -(1 << 31)  # bit 31 = sign
    assert bm.any_tile.tolist() == [0]


def test_ragged_tail_full_block_and_fully_masked_rows():
    bm = masks.causal().block_mask(70, 70, 64, 64)  # last block row/col hold 6 positions
    assert bm.full_ptr.tolist() == [0, 0, 1] and bm.full_cols.tolist() == [0]  # full in range
    assert bm.part_ptr.tolist() == [0, 1, 2] and bm.part_cols.tolist() == [0, 1]
    assert bm.any_cols.tolist() == [0, 0, 1] and bm.any_tile.tolist() == [0, -1, 1]
    kp = masks.key_padding([0, 40]).block_mask(50, block_m=32, block_n=32)
    assert (kp.full_ptr[1:] - kp.full_ptr[:-1]).tolist() == [0, 0, 1, 1]  # batch 0 stores nothing
    assert kp.any_ptr[:3].tolist() == [0, 0, 0]
    assert not kp.dense_slice(0).any()


def test_statistics_and_repr():
    bm = grid_mask("causal", 2048).block_mask(2048)
    assert (bm.n_full, bm.n_partial, bm.n_nonempty) == (32 * 31 // 2, 32, 32 * 33 // 2)
    assert bm.block_density == pytest.approx(528 / 1024)
    assert bm.partial_share == pytest.approx(32 / 528)
    assert bm.element_density == pytest.approx((2048 * 2049 / 2) / 2048**2)
    assert bm.nbytes == sum(t.numel() * t.element_size() for t in bm._tensors())
    text = repr(bm)
    assert "496 full, 32 partial, 496 empty" in text and "block 64x64" in text


def test_to_device_keeps_layout():
    bm = masks.longformer(9, 3).block_mask(100, block_m=32, block_n=16)
    assert bm.to("cpu") is bm  # already there: itself, as Tensor.to returns (its host copies kept)
    moved = bm.to("meta")
    assert moved is not bm and moved.part_bits.dtype == torch.uint32
    assert [t.shape for t in moved._tensors()] == [t.shape for t in bm._tensors()]


def test_beyond_the_packed_budget_only_partial_blocks_are_evaluated(monkeypatch):
    """Where the row-packed bits would not fit (long contexts), a union evaluates the user part
    only on blocks PARTIAL for the union (never inside the FULL blocks of longformer), in chunks
    bounded by CHUNK_ELEMENTS."""
    monkeypatch.setattr("stof_cc.masks.description.CHUNK_ELEMENTS", 4 * 32 * 32)
    monkeypatch.setattr(user, "PACKED_BUDGET", 0)
    seen: list[tuple[int, int]] = []
    sizes: list[int] = []

    def spy(b, h, q, k):
        if q.dim() == 3:  # a chunk of tiles: q [N, 32, 1], k [N, 1, 32]
            seen.extend(zip((q[:, 0, 0] // 32).tolist(), (k[:, 0, 0] // 32).tolist(), strict=True))
            sizes.append(q.shape[0] * q.shape[1] * k.shape[2])
        return (q + k) % 5 == 0

    longformer = masks.longformer(40, 0)
    desc = longformer | masks.from_mask_mod(spy)
    bm = desc.block_mask(256, block_m=32, block_n=32)
    assert torch.equal(bm.to_dense(), desc.to_dense(256))
    full = longformer.block_mask(256, block_m=32, block_n=32).block_classes()[0, 0] == masks.FULL
    assert sorted(seen) == sorted(map(tuple, (~full).nonzero().tolist()))
    assert max(sizes) <= 4 * 32 * 32


def test_a_user_mask_is_evaluated_once_in_row_chunks_for_every_block_shape(monkeypatch):
    """from_mask_mod and from_dense: one evaluation over all (q, k), rows in chunks bounded by
    ROW_CHUNK_ELEMENTS; every block shape (16 for the cost model's fine grid, 32, 64, 128,
    ragged ends) and to_dense are read from it and equal the mask, alone and combined with |,
    & and ~."""
    monkeypatch.setitem(user.ROW_CHUNK_ELEMENTS, "cpu", 3 * 300)
    calls: list[tuple[int, ...]] = []

    def spy(b, h, q, k):
        calls.append(tuple(torch.broadcast_shapes(b.shape, h.shape, q.shape, k.shape)))
        return ((q - k).abs() <= 37) | (k % 7 == 0)

    seq_q, seq_k = 250, 300
    mod = masks.from_mask_mod(spy)
    dense = masks.from_dense(torch.rand(seq_q, seq_k) < 0.3)
    descs = (mod, dense, mod | masks.causal(), mod & masks.sliding_window(50), ~dense)
    calls.clear()
    wants = [desc.to_dense(seq_q, seq_k) for desc in descs]  # to_dense reads the same evaluation
    for desc, want in zip(descs, wants, strict=True):
        for block_m, block_n in ((16, 16), (32, 32), (64, 64), (128, 64), (64, 128)):
            got = desc.block_mask(seq_q, seq_k, block_m=block_m, block_n=block_n).to_dense()
            assert torch.equal(got, want), (desc, block_m, block_n)
    rows = [shape for shape in calls if shape[-1] == seq_k]  # the packed evaluation's chunks: once, for mod
    assert len(rows) == -(-seq_q // 3) and all(shape[2] <= 3 for shape in rows)


def test_long_sequences_never_build_dense():
    """S = 65536 would be 4 GiB as a dense mask; the block build touches only the band."""
    bm = masks.sliding_window(128).block_mask(65536, block_m=128, block_n=128)
    assert bm.n_nonempty == 3 * 512 - 2
    assert bm.nbytes < bm.n_partial * 128 * 128 // 8 + 64 * 1024  # the tiles, plus small CSR


@pytest.mark.parametrize("name", GRID_MASKS)
def test_grid_masks_at_8192_are_exact(name):
    """The benchmark sizes: block classes agree with the mask evaluated block by block."""
    desc = grid_mask(name, 8192)
    bm = desc.block_mask(8192, block_m=128, block_n=128)
    classes = bm.block_classes()[0, 0]
    rows = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(1))
    mask_mod = desc.mask_mod_for(8192)
    zero, k = torch.zeros(1, 1, dtype=torch.long), torch.arange(8192).view(1, -1)
    for i in rows.tolist():
        q = torch.arange(i * 128, (i + 1) * 128).view(-1, 1)
        strip = mask_mod(zero, zero, q, k).view(128, 64, 128)
        counts = strip.sum((0, 2))
        want = torch.where(
            counts == 128 * 128, masks.FULL, torch.where(counts == 0, masks.EMPTY, masks.PARTIAL)
        )
        assert torch.equal(classes[i].long(), want.long()), f"{name} block row {i}"


@pytest.mark.parametrize("seq", (300, 1000, 2065))
def test_counts_at_a_coarser_block_shape_equal_the_coarse_masks_counts(seq):
    """The cost model prices every candidate block shape from one 16 x 16 class grid: for every zoo
    pattern, a per-head dense mask and a combined user mask, at ragged sizes, the counts match the
    block mask built at that shape."""
    w = max(8, seq // 16)
    dense = torch.rand(2, 3, seq, seq, generator=torch.Generator().manual_seed(seq)) < 0.1
    descriptions = [masks.causal(), masks.sliding_window(w), masks.dilated(w, 3), masks.longformer(w, 5),
                    masks.bigbird(w, 3, 2, block=16, seed=1), masks.document([seq // 3, seq - seq // 3 - 7, 7]),
                    masks.key_padding([seq, 0]), masks.from_dense(dense), masks.strided(max(4, seq // 8)),
                    masks.longformer(37, 3) | masks.from_mask_mod(lambda b, h, q, k: (q - k) % 7 == h)]
    shapes = [(16, 32), (64, 64), (128, 64), (128, 128), (192, 128)]
    for description in descriptions:
        fine = description.block_classes(seq, seq, 16, 16, batch=2, heads=3)  # not collapsed: [Bm, Hm, ...]
        counts = coarse_counts(fine, 16, 16, seq, seq, shapes)
        slices = fine.shape[0] * fine.shape[1]
        for block_m, block_n in shapes:
            coarse = description.block_mask(seq, seq, block_m, block_n, batch=2, heads=3)  # collapsed where equal
            rows, partial = counts[(block_m, block_n)]
            want = (coarse.any_ptr[1:] - coarse.any_ptr[:-1]).long().view(coarse.batch, coarse.heads, -1)
            assert torch.equal(rows.view(fine.shape[0], fine.shape[1], -1), want.expand(*fine.shape[:2], -1)), \
                (description, block_m, block_n)
            assert partial == coarse.part_cols.numel() * slices // (coarse.batch * coarse.heads), \
                (description, block_m, block_n)
    with pytest.raises(ValueError, match="not a multiple"):
        coarse_counts(masks.causal().block_classes(seq, seq, 16, 16), 16, 16, seq, seq, [(24, 32)])


@pytest.mark.parametrize("seq_q,seq_k", [(1000, 1000), (1024, 1024), (300, 500)])
def test_a_block_mask_assembled_from_the_class_grid_equals_the_one_from_runs(monkeypatch, seq_q, seq_k):
    """`BlockMask.from_grid` (where an evaluated mask's classes and tiles are, on the GPU; allowed on
    the CPU here) gives every array `from_runs` gives: the grid masks as user mask_mods, a mask over
    batch and heads (kept, and collapsed where it does not depend on them) and a dense mask."""
    from stof_cc.masks import build
    from stof_cc.masks.workloads import user_mask_mod

    lengths, windows = torch.tensor([seq_k - 300, seq_k]), torch.tensor([16, 64, 200])
    cases = [(masks.from_mask_mod(user_mask_mod(name, max(seq_q, seq_k), "cpu")), 1, 1) for name in GRID_MASKS]
    cases += [(masks.from_mask_mod(lambda b, h, q, k: (k < lengths[b]) & ((q - k).abs() <= windows[h])), 2, 3),
              (masks.from_mask_mod(lambda b, h, q, k: (k <= q) | (h < 0)), 2, 3),
              (masks.from_dense(torch.rand(2, 1, seq_q, seq_k, generator=torch.Generator().manual_seed(0)) < 0.3), 2, 4)]
    for desc, batch, heads in cases:
        for block_m, block_n in ((128, 128), (64, 32), (16, 16)):
            monkeypatch.setattr(build, "GRID_DEVICE_TYPES", ("cpu",))
            desc._built.clear()
            got = desc.block_mask(seq_q, seq_k, block_m, block_n, batch=batch, heads=heads)
            monkeypatch.setattr(build, "GRID_DEVICE_TYPES", ())
            desc._built.clear()
            want = desc.block_mask(seq_q, seq_k, block_m, block_n, batch=batch, heads=heads)
            assert (got.batch, got.heads) == (want.batch, want.heads), desc
            for name in ("full_ptr", "full_cols", "part_ptr", "part_cols", "part_bits", "any_ptr", "any_cols",
                         "any_tile"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype and torch.equal(a, b), (desc, block_m, block_n, name)


def test_to_returns_the_mask_itself_only_where_every_tensor_is_there():
    import dataclasses

    mask = masks.causal().block_mask(100, 100, 32, 32)
    assert mask.to("cpu") is mask and mask.to(torch.device("cpu")) is mask
    on_meta = mask.to("meta")
    assert on_meta is not mask and all(getattr(on_meta, name).device.type == "meta" for name in _TENSORS)
    mixed = dataclasses.replace(on_meta, any_cols=mask.any_cols)  # one tensor elsewhere: every tensor moves
    moved = mixed.to("meta")
    assert moved is not mixed and moved.any_cols.device.type == "meta"


@pytest.mark.parametrize("combined", ["alone", "and causal", "or bigbird", "not not", "region"])
@pytest.mark.parametrize("stated", [{}, {"batch": 2}, {"heads": 2}, {"batch": 2, "heads": 2}])
def test_mask_mod_for_answers_every_batch_and_head_of_a_user_mask(stated, combined):
    """A mask_mod over per-sequence / per-head tables through mask_mod_for: without the batch and
    heads stated, the kept bits held slice 0 and answered every b and h from it (found by review),
    alone and, after that fix, still in combinations (found by the next review)."""
    lengths, widths = torch.tensor([3, 8]), torch.tensor([0, 4])
    user = masks.from_mask_mod(lambda b, h, q, k: (k < lengths[b]) & ((q - k).abs() <= widths[h]))
    bigbird = masks.bigbird(1, 0, 1, block=4, seed=0)
    description, seq = {"alone": (user, 8), "and causal": (user & masks.causal(), 8),
                        "or bigbird": (user | bigbird, 8), "not not": (~~user, 8),
                        "region": (masks.region(user, 8, 0, 8, [(0, 8)]), 8)}[combined]
    other = {"and causal": lambda q, k: q >= k, "or bigbird": lambda q, k: bool(bigbird.to_dense(8)[0, 0, q, k])}
    bound = description.mask_mod_for(seq, **stated)
    for b, h, q, k in itertools.product(range(2), range(2), range(seq), range(seq)):
        want = bool(k < lengths[b] and abs(q - k) <= widths[h])
        if combined == "and causal":
            want = want and other[combined](q, k)
        elif combined == "or bigbird":
            want = want or other[combined](q, k)
        assert bool(bound(*(torch.tensor(i) for i in (b, h, q, k)))) == want, (b, h, q, k)


def test_descriptions_copy_the_tensors_they_are_made_of():
    """from_dense and document(segment_ids=) keep copies: the caller's tensor written afterwards
    changes neither the mask nor its block masks (kept bits went stale beside a live to_dense)."""
    dense = torch.zeros(64, 64, dtype=torch.bool)
    ids = torch.tensor([0] * 30 + [1] * 34)
    described = [(masks.from_dense(dense), dense.clone()),
                 (masks.document(segment_ids=ids), ids[:, None] == ids[None, :])]
    dense |= torch.ones_like(dense).tril()
    ids[:] = torch.tensor([1] * 30 + [0] * 34).flip(0)
    for description, want in described:
        assert torch.equal(description.to_dense(64)[0, 0], want)
        for block in (16, 32):
            assert torch.equal(description.block_mask(64, 64, block, block).to_dense()[0, 0], want)


def test_padding_that_is_not_right_padding_fixes_its_batch_and_keys():
    """from_padding of left or gapped padding: dims [B, 1] like key_padding's, and a clear MaskError
    for another batch or seq_k (it dropped every row but the first, or raised a raw IndexError)."""
    padding = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    description = masks.from_padding(padding)
    want = (padding != 0)[:, None, None, :].expand(2, 1, 4, 4)
    assert description.mask_dims(4) == (2, 1)
    assert torch.equal(description.to_dense(4), want)
    assert torch.equal(description.block_mask(4, 4, 16, 16).to_dense(), want)
    with pytest.raises(masks.MaskError, match="2 batch rows, but batch=3"):
        description.to_dense(4, batch=3)
    with pytest.raises(masks.MaskError, match="covers 4 keys, but seq_k=6"):
        description.to_dense(4, 6, batch=2)
