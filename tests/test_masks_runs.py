"""Classes as runs per block row (issue 32, item 7): the analytic classification of every zoo
pattern and combination against the classes read off the dense mask, at several sizes with
ragged ends; the run operations against their dense definitions; and planning and showing
masks of a million tokens in bounded memory and a few seconds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_masks_block import check_layout

from stof_cc import masks
from stof_cc.masks import block_mask as block_mask_module
from stof_cc.masks import build, zoo
from stof_cc.masks.block_mask import coarse_counts
from stof_cc.masks.geometry import BlockGrid, Extent
from stof_cc.masks.runs import MAX, MIN, MIX, ClassRuns


def _zoo(seq: int) -> dict[str, masks.MaskDescription]:
    """Every pattern, with parameters on both sides of each classification's shortcuts (a
    step shorter or longer than a block, tokens as a count or scattered, documents padded
    inside, segment ids out of order), and combinations of them."""
    w = max(3, seq // 16)
    ids = torch.arange(seq) // max(5, seq // 6)
    padded = torch.where((torch.arange(seq) % 29 == 3) | (torch.arange(seq) > seq - 9), -1, ids)
    return {
        "full": masks.full(), "causal": masks.causal(), "sliding": masks.sliding_window(w),
        "sliding_causal": masks.sliding_window(w, causal=True), "dilated_1": masks.dilated(w, 1),
        "dilated_short": masks.dilated(w // 3 + 1, 3), "dilated_long": masks.dilated(4, 211),
        "strided_short": masks.strided(7), "strided_long": masks.strided(max(2, seq // 5)),
        "fixed": masks.fixed(max(4, seq // 7), 3), "fixed_wide": masks.fixed(150, 100),
        "fixed_all": masks.fixed(40, 40), "fixed_short": masks.fixed(6, 2),
        "global_count": masks.global_tokens(37), "global_scattered": masks.global_tokens([0, 5, 6, 7, 200, seq - 1]),
        "longformer": masks.longformer(w, 19), "bigbird": masks.bigbird(w, 7, 3, block=48, seed=2),
        "bigbird_7": masks.bigbird(w, 0, 2, block=7, seed=1), "random": masks.random_blocks(2, 33, 4),
        "document": masks.document([seq // 3 + 1, seq // 4 + 5, 11]),
        "segments": masks.document(segment_ids=torch.stack([ids, padded])),
        "segments_interleaved": masks.document(segment_ids=torch.arange(seq) % 3),
        "key_padding": masks.key_padding([seq, seq // 2, 0, 17]),
        "union": masks.sliding_window(w) | masks.strided(max(2, seq // 11)),
        "intersection": masks.causal() & ~masks.sliding_window(max(1, w // 2)),
        "mixed_dims": masks.longformer(w, 3) & masks.key_padding([max(0, seq - 5), seq // 3, seq, 1]),
        "complement": ~masks.document([seq // 2 + 1, 7]),
    }


def _dense_classes(dense: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """int8 [B, H, n_rb, n_cb] read off a dense mask: the definition the runs must meet."""
    batch, heads, seq_q, seq_k = dense.shape
    n_rb, n_cb = -(-seq_q // block_m), -(-seq_k // block_n)
    padded = torch.zeros(batch, heads, n_rb * block_m, n_cb * block_n)
    padded[..., :seq_q, :seq_k] = dense.float()
    inside = torch.zeros(n_rb * block_m, n_cb * block_n)
    inside[:seq_q, :seq_k] = 1
    count = padded.view(batch, heads, n_rb, block_m, n_cb, block_n).sum((3, 5))
    area = inside.view(n_rb, block_m, n_cb, block_n).sum((1, 3))
    return torch.where(count == area, masks.FULL, torch.where(count == 0, masks.EMPTY, masks.PARTIAL)).to(torch.int8)


SIZES = [(1, 1), (100, 77), (257, 300), (1000, 1000), (2065, 1999)]
BLOCKS = [(16, 16), (64, 64), (128, 64), (7, 33)]


@pytest.mark.parametrize("seq_q, seq_k", SIZES)
def test_the_runs_equal_the_classes_of_the_dense_mask(seq_q, seq_k):
    """Per pattern and block shape: the analytic runs never claim FULL or EMPTY wrongly, the
    exact runs (`block_runs`) equal the classes of the dense mask, the block mask built from
    them has the dense mask's layout, and the counts at every coarser shape the cost model
    reads equal those of the block mask built at that shape."""
    for name, desc in _zoo(max(seq_q, seq_k)).items():
        batch = 4 if name in ("key_padding", "mixed_dims") else 2 if name == "segments" else None
        dense = desc.to_dense(seq_q, seq_k, batch=batch)
        dims = desc.mask_dims(seq_q, seq_k, batch=batch)
        dense = dense.expand(*dims, seq_q, seq_k)
        for block_m, block_n in BLOCKS:
            want = _dense_classes(dense, block_m, block_n)
            grid = BlockGrid(Extent(seq_q, seq_k, batch or 1), block_m, block_n)
            analytic = grid.classes(desc).expand(*dims).to_dense()
            sure = analytic != masks.PARTIAL
            assert torch.equal(analytic[sure], want[sure]), (name, block_m, block_n, "analytic")
            runs = desc.block_runs(seq_q, seq_k, block_m, block_n, batch=batch)
            assert torch.equal(runs.to_dense(), want), (name, block_m, block_n)
            assert torch.equal(ClassRuns.from_dense(want).key, runs.key)  # one canonical form
            check_layout(desc.block_mask(seq_q, seq_k, block_m, block_n, batch=batch),
                         desc.to_dense(seq_q, seq_k, batch=batch))
        fine = desc.block_runs(seq_q, seq_k, 16, 16, batch=batch)
        for shape, (rows, partial) in coarse_counts(fine, 16, 16, seq_q, seq_k, [(64, 32), (192, 128)]).items():
            coarse = desc.block_mask(seq_q, seq_k, *shape, batch=batch)
            per_row = (coarse.any_ptr[1:] - coarse.any_ptr[:-1]).long().view(coarse.batch, coarse.heads, -1)
            assert torch.equal(rows.view(*dims, -1), per_row.expand(*dims, -1)), (name, shape)
            assert partial * coarse.batch * coarse.heads == coarse.n_partial * dims[0] * dims[1], (name, shape)


@st.composite
def class_grids(draw: st.DrawFn) -> torch.Tensor:
    """Random dense class grids with long stretches of one class (as masks have) or noise."""
    batch, heads = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    n_rb, n_cb = draw(st.integers(1, 30)), draw(st.integers(1, 30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    stretch = draw(st.sampled_from([1, 4, 40]))
    codes = torch.randint(0, 3, (batch, heads, n_rb, -(-n_cb // stretch)), generator=gen)
    return codes.repeat_interleave(stretch, 3)[..., :n_cb].to(torch.int8)


def _reference(rule, grids: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(torch.broadcast_tensors(*grids))
    if rule is MAX:
        return stacked.amax(0)
    if rule is MIN:
        return stacked.amin(0)
    first = stacked[0]
    return torch.where((stacked == first).all(0), first, masks.PARTIAL).to(torch.int8)


@settings(max_examples=60, deadline=None)
@given(grid=class_grids(), other=class_grids(), fm=st.integers(1, 5), fn=st.integers(1, 5))
def test_run_operations_equal_their_dense_definitions(grid, other, fm, fn):
    runs = ClassRuns.from_dense(grid)
    assert torch.equal(runs.to_dense(), grid)
    assert torch.equal(runs.invert().to_dense(), (masks.FULL - grid).to(torch.int8))
    batch, heads, n_rb, n_cb = grid.shape
    # combinations, broadcasting a one-slice grid over the other's dims
    single = other[:1, :1, :1, :1].expand(1, 1, n_rb, n_cb).contiguous()
    for rule in (MAX, MIN, MIX):
        got = ClassRuns.combine([runs, ClassRuns.from_dense(single)], rule).to_dense()
        assert torch.equal(got, _reference(rule, [grid, single])), rule.__name__
    # coarser blocks: FULL where every fine block is, EMPTY where every one is
    padded = torch.full((batch, heads, -(-n_rb // fm) * fm, -(-n_cb // fn) * fn), -1, dtype=torch.int8)
    padded[..., :n_rb, :n_cb] = grid
    cells = padded.view(batch, heads, -(-n_rb // fm), fm, -(-n_cb // fn), fn).permute(0, 1, 2, 4, 3, 5).flatten(-2)
    present = cells >= 0
    full = ((cells == masks.FULL) | ~present).all(-1)
    empty = ((cells == masks.EMPTY) | ~present).all(-1)
    want = torch.where(full, masks.FULL, torch.where(empty, masks.EMPTY, masks.PARTIAL)).to(torch.int8)
    assert torch.equal(runs.coarsen(fm, fn).to_dense(), want)
    # reading: counts, CSR, enumeration in row-major order, lookups, slices
    flat = grid.reshape(-1, n_cb)
    assert torch.equal(runs.per_row(masks.FULL, masks.PARTIAL), (flat != masks.EMPTY).sum(1))
    ptr, cols = runs.csr(masks.PARTIAL)
    assert torch.equal(cols.long(), (flat == masks.PARTIAL).nonzero()[:, 1])
    assert torch.equal(ptr[1:].long(), (flat == masks.PARTIAL).sum(1).cumsum(0))
    total = runs.total(masks.PARTIAL)
    tiles = [runs.tiles(masks.PARTIAL, first, min(7, total - first)) for first in range(0, total, 7)]
    if tiles:
        found = torch.stack([torch.cat([getattr(t, f) for t in tiles]) for f in "bhij"], 1)
        assert torch.equal(found, (grid == masks.PARTIAL).nonzero())
    b, h, i, j = (torch.randint(0, n, (50,)) for n in grid.shape)
    assert torch.equal(runs.at(b, h, i, j), grid[b, h, i, j])
    for axis in (0, 1):
        first = grid.narrow(axis, 0, 1)
        assert runs.equal_slices(axis) == bool((grid == first).all())
        assert torch.equal(runs.first(axis).to_dense(), first)


def test_past_the_budgets_the_refusals_name_the_mask_and_what_to_do(monkeypatch):
    """A user mask is evaluated element by element: past EVALUATION_BUDGET it is refused before
    any evaluation, saying how to describe it instead. Interleaved segment ids are classified
    block by block, refused past UNORDERED_DOCUMENT_BLOCKS; a block mask past the format's
    int32 offsets is refused too."""
    monkeypatch.setattr(build, "EVALUATION_BUDGET", 64 * 64 * 100)
    monkeypatch.setattr(masks.user, "PACKED_BUDGET", 0)
    calls = []
    mod = masks.from_mask_mod(lambda b, h, q, k: calls.append(q.numel()) or q >= k, name="mine")
    with pytest.raises(masks.MaskError, match=r"from_mask_mod\(mine\) at 1024 x 1024: 256 blocks of 64 x 64 may "
                       r"be partial.*EVALUATION_BUDGET.*masks.sliding_window\(w\) & from_mask_mod\(fn\)"):
        mod.block_mask(1024)
    assert set(calls) == {1}  # probes of its batch and head dims only
    assert (masks.sliding_window(20) & mod).block_mask(1024).n_partial > 0  # few blocks left to evaluate
    monkeypatch.setattr(zoo, "UNORDERED_DOCUMENT_BLOCKS", 100)
    with pytest.raises(masks.MaskError, match=r"segment ids not ascending.*256 blocks of 64 x 64 at 1024 x 1024"):
        masks.document(segment_ids=torch.arange(1024) % 3).block_mask(1024)
    masks.document(segment_ids=torch.arange(1024) // 100).block_mask(1024)  # in order: no limit
    monkeypatch.setattr(block_mask_module, "INT32_MAX", 100)
    with pytest.raises(masks.MaskError, match=r"block_mask: 136 non-empty blocks .* int32 offsets \(100\)"):
        masks.causal().block_mask(1024)


def _fresh_process(code: str) -> dict:
    """What ``code`` prints (JSON) run in a fresh interpreter, with its peak memory above the
    import of stof_cc (MiB) and its wall time (s) around ``code``."""
    wrapped = f"""
import json, resource, time
import stof_cc
from stof_cc import masks
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
out = {{}}
{code}
out["seconds"] = time.perf_counter() - start
out["grown_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("mask", ["masks.sliding_window(256)", "masks.causal()"])
def test_planning_a_million_tokens_is_small_and_quick(mask):
    """explain_attention at S = 1,048,576 (the 16 x 16 class grid alone would be 4 GiB; it peaked
    near 9 GB and 32 s at S = 262144 and was killed at 524288). Measured on the 2-core CPU:
    under 1 s and about 100 MiB alone; 25 s once with the whole suite on 8 workers sharing the
    2 cores. Memory is the guard; the time bound only catches the quadratic build (minutes)."""
    got = _fresh_process(f"""
choice = stof_cc.explain_attention(1, 1, 1 << 20, 1 << 20, 64, {mask})
out["blocks"] = choice.estimates[0].blocks
""")
    assert got["blocks"] > 0
    assert got["grown_mib"] < 512 and got["seconds"] < 120, got


def test_showing_a_million_tokens_draws_from_the_runs(tmp_path):
    """`masks show` at S = 1,000,000 (a window; causal there is a 1.4 GB block mask of 122 M
    FULL blocks, which it draws in seconds too): the build and the picture read runs, never a
    class per block."""
    out = tmp_path / "m.png"
    got = _fresh_process(f"""
from stof_cc.masks.cli import main
out["rc"] = main(["show", "sliding:w=256", "--seq", "1000000", "--out", {str(out)!r}])
""")
    assert got["rc"] == 0 and out.stat().st_size > 0
    assert got["grown_mib"] < 512 and got["seconds"] < 30, got
