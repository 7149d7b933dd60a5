"""Mask descriptions against their written definitions, built densely and independently here
(plain torch broadcasts of each formula), plus mask_mod / FlexAttention compatibility, batch
and head dependence, and every bad argument."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stof_cc import masks
from stof_cc.masks.errors import MaskTypeError
from stof_cc.masks.workloads import GRID_MASKS, grid_mask


def _qk(seq_q: int, seq_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(seq_q).view(-1, 1), torch.arange(seq_k).view(1, -1)


def _doc_ids(lengths: list[int], size: int) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return torch.cat([ids, torch.full((max(0, size - len(ids)),), -1)])[:size]


def _random_cells(seq_q: int, seq_k: int, r: int, block: int, seed: int) -> torch.Tensor:
    """BigBird's random part as documented: cell (i, j) on with probability r / n_cols."""
    rows, cols = math.ceil(seq_q / block), math.ceil(seq_k / block)
    cells = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) < r / cols
    return cells.repeat_interleave(block, 0).repeat_interleave(block, 1)[:seq_q, :seq_k]


def reference(name: str, p: dict, seq_q: int, seq_k: int) -> torch.Tensor:
    """The written definition of pattern `name`, dense [S_q, S_k] (or [B, 1, S_q, S_k])."""
    q, k = _qk(seq_q, seq_k)
    if name == "full":
        return torch.ones(seq_q, seq_k, dtype=torch.bool)
    if name == "causal":
        return q >= k
    if name == "sliding":
        return ((q - k >= 0) & (q - k <= p["w"])) if p["causal"] else (q - k).abs() <= p["w"]
    if name == "dilated":
        return ((q - k).abs() <= p["w"] * p["dilation"]) & ((q - k) % p["dilation"] == 0)
    if name == "strided":
        s = p["stride"]
        return (q >= k) & (((q - k) < s) | ((q - k) % s == 0))
    if name == "fixed":
        s, c = p["stride"], p["c"]
        return (q >= k) & ((k // s == q // s) | (k % s >= s - c))
    if name == "longformer":
        g = p["global_tokens"]
        is_global = (
            (lambda x: x < g) if isinstance(g, int) else (lambda x: torch.isin(x, torch.tensor(g)))
        )
        return ((q - k).abs() <= p["w"]) | is_global(q) | is_global(k)
    if name == "bigbird":
        longformer = reference(
            "longformer", {"w": p["w"], "global_tokens": p["n_global"]}, seq_q, seq_k
        )
        return longformer | _random_cells(seq_q, seq_k, p["random_blocks"], p["block"], p["seed"])
    if name == "document":
        ids = _doc_ids(p["lengths"], max(seq_q, seq_k))
        return (ids[:seq_q, None] == ids[None, :seq_k]) & (ids[:seq_q, None] >= 0)
    if name == "key_padding":
        lengths = torch.tensor(p["lengths"]).view(-1, 1, 1, 1)
        return (k[None, None] < lengths).expand(-1, 1, seq_q, seq_k)
    raise AssertionError(name)


FACTORIES = {
    "full": lambda p: masks.full(),
    "causal": lambda p: masks.causal(),
    "sliding": lambda p: masks.sliding_window(p["w"], causal=p["causal"]),
    "dilated": lambda p: masks.dilated(p["w"], p["dilation"]),
    "strided": lambda p: masks.strided(p["stride"]),
    "fixed": lambda p: masks.fixed(p["stride"], p["c"]),
    "longformer": lambda p: masks.longformer(p["w"], p["global_tokens"]),
    "bigbird": lambda p: masks.bigbird(
        p["w"], p["n_global"], p["random_blocks"], p["block"], p["seed"]
    ),
    "document": lambda p: masks.document(p["lengths"]),
    "key_padding": lambda p: masks.key_padding(p["lengths"]),
}

small = st.integers(1, 40)


@st.composite
def zoo_params(draw: st.DrawFn) -> tuple[str, dict]:
    """A pattern name and random valid parameters for it."""
    name = draw(st.sampled_from(sorted(FACTORIES)))
    p: dict = {}
    if name in ("sliding", "dilated", "longformer", "bigbird"):
        p["w"] = draw(small)
    if name == "sliding":
        p["causal"] = draw(st.booleans())
    if name == "dilated":
        p["dilation"] = draw(st.integers(1, 6))
    if name in ("strided", "fixed"):
        p["stride"] = draw(st.integers(1, 48))
    if name == "fixed":
        p["c"] = draw(st.integers(1, p["stride"]))
    if name == "longformer":
        p["global_tokens"] = draw(
            st.integers(0, 40) | st.lists(st.integers(0, 150), min_size=1, max_size=6)
        )
    if name == "bigbird":
        p["n_global"] = draw(st.integers(0, 20))
        p["random_blocks"] = draw(st.integers(0, 4))
        p["block"] = draw(st.sampled_from([7, 16, 32, 64]))
        p["seed"] = draw(st.integers(0, 3))
    if name == "document":
        p["lengths"] = draw(st.lists(st.integers(1, 70), min_size=1, max_size=5))
    if name == "key_padding":
        p["lengths"] = draw(st.lists(st.integers(0, 160), min_size=1, max_size=3))
    return name, p


def _expand(dense: torch.Tensor) -> torch.Tensor:
    return dense if dense.dim() == 4 else dense[None, None]


@settings(max_examples=100, deadline=None)
@given(case=zoo_params(), seq_q=st.integers(1, 150), seq_k=st.integers(1, 150))
def test_every_pattern_matches_its_written_definition(case, seq_q, seq_k):
    name, p = case
    desc = FACTORIES[name](p)
    want = _expand(reference(name, p, seq_q, seq_k))
    got = desc.to_dense(seq_q, seq_k)
    assert torch.equal(got.expand_as(want), want), f"{desc!r} at {seq_q}x{seq_k}"
    mod = desc.mask_mod_for(seq_q, seq_k)
    b = torch.arange(want.shape[0]).view(-1, 1, 1, 1)
    q, k = (t[None, None] for t in _qk(seq_q, seq_k))
    assert torch.equal(mod(b, torch.zeros_like(b), q, k).expand_as(want), want)


def _grid_definition(name: str, seq: int) -> torch.Tensor:
    """benchmarks/WORKLOADS.md, table 'Masked multi-head attention', transcribed."""
    q, k = _qk(seq, seq)
    w = max(64, seq // 16)
    longformer = ((q - k).abs() <= w) | (q < 32) | (k < 32)
    if name == "causal":
        return q >= k
    if name == "sliding":
        return (q - k).abs() <= w
    if name == "dilated":
        return ((q - k).abs() <= 4 * w) & ((q - k) % 4 == 0)
    if name == "longformer":
        return longformer
    if name == "bigbird":
        return longformer | _random_cells(seq, seq, 3, 64, 0)
    if name == "document":
        doc = max(128, seq // 4)
        return q // doc == k // doc
    raise AssertionError(name)


@pytest.mark.parametrize("seq", [128, 1000, 2048])
@pytest.mark.parametrize("name", GRID_MASKS)
def test_grid_masks_match_workloads_md(name, seq):
    want = _grid_definition(name, seq)
    desc = grid_mask(name, seq)
    assert torch.equal(desc.to_dense(seq)[0, 0], want)
    assert torch.equal(desc.block_mask(seq, block_m=64, block_n=128).to_dense()[0, 0], want)


def test_bigbird_random_blocks_are_deterministic_and_about_r_per_row():
    a = masks.bigbird(64, 0, 3, seed=5).to_dense(4096)
    assert torch.equal(a, masks.bigbird(64, 0, 3, seed=5).to_dense(4096))
    assert not torch.equal(a, masks.bigbird(64, 0, 3, seed=6).to_dense(4096))
    cells = masks.random_blocks(3, 64, 5).to_dense(4096)[0, 0, ::64, ::64]
    assert 1.5 < cells.sum(1).float().mean() < 4.5  # 3 per block row expected (band aside)


def test_combinators_are_elementwise_or_and_not():
    a, b = masks.sliding_window(5), masks.strided(7)
    da, db = a.to_dense(60, 50), b.to_dense(60, 50)
    assert torch.equal((a | b).to_dense(60, 50), da | db)
    assert torch.equal((a & b).to_dense(60, 50), da & db)
    assert torch.equal((~a).to_dense(60, 50), ~da)
    assert torch.equal(
        (~(a | b) & masks.causal()).block_mask(60, 50, 16, 32).to_dense(),
        ~(da | db) & masks.causal().to_dense(60, 50),
    )
    assert repr(a | b | masks.causal()) == "(sliding_window(w=5) | strided(stride=7) | causal())"


def test_segment_ids_per_batch_and_padding():
    ids = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 1, 1, 2, 2, 2]])
    desc = masks.document(segment_ids=ids)
    assert desc.mask_dims(6) == (2, 1)
    dense = desc.to_dense(6)
    assert dense.shape == (2, 1, 6, 6)
    want = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    assert torch.equal(dense[:, 0], want)
    assert not dense[0, 0, 5].any()  # a padding query attends nothing
    assert torch.equal(desc.block_mask(6, block_m=4, block_n=4).to_dense(), dense)


def test_key_padding_depends_on_batch_and_collapses_when_equal():
    assert masks.key_padding([3, 5]).to_dense(6).shape == (2, 1, 6, 6)
    assert masks.key_padding([4, 4]).to_dense(6).shape == (1, 1, 6, 6)
    assert masks.key_padding([4, 4]).mask_dims(6) == (2, 1)
    assert masks.key_padding([3, 5]).to_dense(6, heads=8).shape == (2, 1, 6, 6)


def test_from_mask_mod_dependence_is_read_from_broadcasting():
    per_head = masks.from_mask_mod(lambda b, h, q, k: (q - k) % 3 == h)
    assert per_head.mask_dims(20, batch=2, heads=3) == (1, 3)
    dense = per_head.to_dense(20, batch=2, heads=3)
    assert dense.shape == (1, 3, 20, 20)
    q, k = _qk(20, 20)
    for h in range(3):
        assert torch.equal(dense[0, h], (q - k) % 3 == h)
    # uses b, but every slice is equal: collapsed after evaluation
    same = masks.from_mask_mod(lambda b, h, q, k: q + 0 * b >= k)
    assert same.mask_dims(20, batch=4) == (4, 1)
    assert same.to_dense(20, batch=4).shape == (1, 1, 20, 20)
    assert same.block_mask(20, batch=4, block_m=16, block_n=16).batch == 1


def test_from_dense_per_batch_and_head():
    mask = torch.rand(2, 3, 30, 40, generator=torch.Generator().manual_seed(0)) < 0.5
    desc = masks.from_dense(mask)
    assert desc.mask_dims(30, 40) == (2, 3)
    assert torch.equal(desc.to_dense(30, 40), mask)
    assert torch.equal(
        masks.from_dense(mask[0, 0]).to_dense(30, 40, batch=5, heads=2), mask[:1, :1]
    )


def test_mask_mod_scalar_indices_and_size_dependence():
    sliding = masks.sliding_window(3)
    t = torch.tensor
    assert sliding.mask_mod(t(0), t(0), t(10), t(7)).item() is True
    assert sliding.mask_mod(t(0), t(0), t(10), t(6)).item() is False
    with pytest.raises(masks.MaskError, match=r"mask_mod_for\(seq_q, seq_k\)"):
        masks.bigbird(8, 2, 1, block=16).mask_mod(t(0), t(0), t(1), t(2))
    assert masks.bigbird(8, 2, 1, block=16).mask_mod_for(64)(t(0), t(0), t(1), t(0)).item() is True


def test_flex_attention_create_block_mask_agrees_with_block_counts():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    seq = 384
    for desc in (
        masks.causal(),
        masks.longformer(40, 5),
        masks.document([100, 200, 84]),
        masks.dilated(20, 3),
    ):
        ours = desc.block_mask(seq, block_m=128, block_n=128)
        theirs = flex.create_block_mask(
            desc.mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=128
        )
        full = theirs.full_kv_num_blocks.view(-1).tolist()
        partial = theirs.kv_num_blocks.view(-1).tolist()
        assert full == (ours.full_ptr[1:] - ours.full_ptr[:-1]).tolist(), repr(desc)
        assert partial == (ours.part_ptr[1:] - ours.part_ptr[:-1]).tolist(), repr(desc)


_TABLE = torch.arange(50)  # a per-position table shorter than the sequence it is used at


def _branches(b, h, q, k):  # a Python branch on index tensors, as a newcomer first writes a mask_mod
    if q >= k:
        return torch.ones_like(q, dtype=torch.bool)
    return torch.zeros_like(q, dtype=torch.bool)


BAD_ARGUMENTS = [
    (lambda: masks.sliding_window(0), "sliding_window: w must be a positive int, got 0"),
    (lambda: masks.sliding_window(2.5), "sliding_window: w must be a positive int, got 2.5"),
    (lambda: masks.sliding_window(True), "sliding_window: w must be a positive int, got True"),
    (lambda: masks.sliding_window(4, causal="yes"), "sliding_window: causal must be a bool"),
    (lambda: masks.dilated(4, 0), "dilated: dilation must be a positive int, got 0"),
    (lambda: masks.dilated(-1, 2), "dilated: w must be a positive int, got -1"),
    (lambda: masks.strided(0), "strided: stride must be a positive int, got 0"),
    (lambda: masks.fixed(0, 1), "fixed: stride must be a positive int, got 0"),
    (lambda: masks.fixed(8, 0), r"fixed: c \(stride=8\) must be an int in 1..8, got 0"),
    (lambda: masks.fixed(8, 9), r"fixed: c \(stride=8\) must be an int in 1..8, got 9"),
    (lambda: masks.longformer(0, 4), "longformer: w must be a positive int, got 0"),
    (
        lambda: masks.longformer(8, -1),
        "longformer: global_tokens must be a non-negative int, got -1",
    ),
    (
        lambda: masks.longformer(8, [3, -2]),
        r"longformer: global_tokens\[1\] must be a non-negative int",
    ),
    (lambda: masks.longformer(8, "all"), "longformer: global_tokens must be a non-empty list"),
    (lambda: masks.global_tokens([]), "global_tokens: tokens must be a non-empty list"),
    (lambda: masks.bigbird(0, 2, 3), "bigbird: w must be a positive int, got 0"),
    (lambda: masks.bigbird(8, -2, 3), "bigbird: n_global must be a non-negative int, got -2"),
    (lambda: masks.bigbird(8, 2, -3), "bigbird: random_blocks must be a non-negative int, got -3"),
    (lambda: masks.bigbird(8, 2, 3, block=0), "bigbird: block must be a positive int, got 0"),
    (lambda: masks.bigbird(8, 2, 3, seed=-1), "bigbird: seed must be a non-negative int, got -1"),
    (
        lambda: masks.random_blocks(2, block=-4),
        "random_blocks: block must be a positive int, got -4",
    ),
    (lambda: masks.document(), "document: give exactly one of lengths or segment_ids"),
    (lambda: masks.document([4, -1]), r"document: lengths\[1\] must be a non-negative int, got -1"),
    (lambda: masks.document([0, 0]), r"document: lengths \[0, 0\] hold no position"),
    (
        lambda: masks.document(segment_ids=torch.zeros(4)),
        "document: segment_ids must be an integer tensor",
    ),
    (
        lambda: masks.document(segment_ids=torch.zeros(2, 2, 2, dtype=torch.long)),
        r"document: segment_ids must have shape \[S\] or \[B, S\], got \(2, 2, 2\)",
    ),
    (
        lambda: masks.document(segment_ids=torch.zeros(0, 5, dtype=torch.long)),  # no batch element
        r"document: segment_ids must have shape \[S\] or \[B, S\], got \(0, 5\)",
    ),
    (
        lambda: masks.document(segment_ids=torch.zeros(8, dtype=torch.long)).to_dense(10),
        "document: segment_ids cover 8 positions, but the mask is 10 x 10",
    ),
    (
        lambda: masks.document(segment_ids=torch.zeros(3, 8, dtype=torch.long)).block_mask(
            8, batch=2
        ),
        r"document: segment_ids has 3 rows \(one per batch element\), but batch=2",
    ),
    (lambda: masks.key_padding([]), "key_padding: lengths must be a non-empty list"),
    (
        lambda: masks.key_padding([3, -1]),
        r"key_padding: lengths\[1\] must be a non-negative int, got -1",
    ),
    (
        lambda: masks.key_padding([3, 4]).to_dense(8, batch=3),
        r"key_padding: 2 lengths given \(one per batch element\), but batch=3",
    ),
    (
        lambda: masks.from_dense(torch.ones(4, 4)),
        r"from_dense: mask must have dtype torch.bool, got torch.float32 \(an additive float mask is a bias: "
        r"stof_cc.attention\(..., bias=\) adds it",
    ),
    (lambda: masks.from_dense([[True]]), "from_dense: mask must be a bool tensor, got list"),
    (
        lambda: masks.from_dense(torch.ones(2, 4, 4, dtype=torch.bool)),
        r"from_dense: mask must have shape \[S_q, S_k\] or \[B\|1, H\|1, S_q, S_k\]",
    ),
    (
        lambda: masks.from_dense(torch.ones(4, 5, dtype=torch.bool)).block_mask(4),
        "from_dense: the mask is 4 x 5, but seq_q=4, seq_k=4",
    ),
    (
        lambda: masks.from_dense(torch.ones(3, 1, 4, 4, dtype=torch.bool)).to_dense(4, batch=2),
        "from_dense: the mask has batch dim 3, but batch=2",
    ),
    (lambda: masks.from_mask_mod(3), "from_mask_mod: fn must be callable, got 3"),
    (lambda: masks.from_mask_mod(lambda q, k: q >= k), r"from_mask_mod: <lambda> must take \(b, h, q_idx, kv_idx\)"),
    (lambda: masks.from_mask_mod(_branches).to_dense(8), "from_mask_mod: _branches branches in Python on a tensor"),
    (lambda: masks.from_mask_mod(lambda b, h, q, k: _TABLE[q] == _TABLE[k]).to_dense(64),
     "from_mask_mod: <lambda> indexed past a table it reads at 64 queries and 64 keys"),
    (
        lambda: masks.from_mask_mod(lambda b, h, q, k: q - k).to_dense(8),
        "from_mask_mod: <lambda> returned dtype torch.int64; it must return torch.bool",
    ),
    (
        lambda: masks.from_mask_mod(lambda b, h, q, k: [True]).to_dense(8),
        "from_mask_mod: <lambda> returned list, not a bool tensor",
    ),
    (
        lambda: masks.from_mask_mod(lambda b, h, q, k: torch.ones(3, dtype=torch.bool)).to_dense(8),
        r"from_mask_mod: <lambda> returned shape \(3,\), which does not broadcast to the index",
    ),
    (
        lambda: masks.causal().block_mask(64, block_m=0),
        "block_mask: block_m must be a positive int, got 0",
    ),
    (
        lambda: masks.causal().block_mask(64, block_n=-16),
        "block_mask: block_n must be a positive int, got -16",
    ),
    (lambda: masks.causal().block_mask(0), "block_mask: seq_q must be a positive int, got 0"),
    (lambda: masks.causal().to_dense(8, 0), "to_dense: seq_k must be a positive int, got 0"),
    (lambda: masks.causal().to_dense(8, batch=0), "to_dense: batch must be a positive int, got 0"),
    (
        lambda: masks.causal().mask_mod_for(8, heads=-1),
        "mask_mod_for: heads must be a positive int, got -1",
    ),
    (lambda: grid_mask("banded", 128), "grid_mask: name must be one of causal, sliding"),
    (lambda: grid_mask("causal", 0), "grid_mask: seq must be a positive int, got 0"),
]


@pytest.mark.parametrize("make, message", BAD_ARGUMENTS)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(masks.MaskError, match=message):
        make()


def test_type_errors_are_also_type_errors():
    with pytest.raises(TypeError):
        masks.sliding_window("8")
    with pytest.raises(ValueError):
        masks.sliding_window(-8)
    with pytest.raises(TypeError):
        masks.causal() | 3


def test_bigbird_mask_mod_works_under_flex_vmap():
    """FlexAttention evaluates mask_mods under vmap, where random draws are refused: the
    random block grid must be built before, in mask_mod_for."""
    from torch.nn.attention.flex_attention import create_mask

    mask = masks.bigbird(32, 4, 2, block=32, seed=3)
    flex_dense = create_mask(mask.mask_mod_for(256, 256), None, None, 256, 256, device="cpu")
    assert torch.equal(flex_dense, mask.to_dense(256, 256))


@pytest.mark.parametrize("seq", [256, 1000, 2048])
def test_the_user_written_mask_mods_are_the_grid_masks(seq):
    """benchmarks' FlexAttention peer runs the mask_mods a user writes (benchmarks/WORKLOADS.md):
    they attend exactly what the grid's descriptions do."""
    from stof_cc.masks.workloads import GRID_MASKS, grid_mask, user_mask_mod

    for name in GRID_MASKS:
        assert torch.equal(masks.from_mask_mod(user_mask_mod(name, seq)).to_dense(seq), grid_mask(name, seq).to_dense(seq))


@pytest.mark.parametrize("w, dilation", [(3, 2), (5, 4), (1, 3)])
def test_a_dilated_window_is_sliding_windows_on_its_residues(w, dilation):
    """strided_split: the positions r, r + d, ... of a dilated window attend each other as the
    sliding window of the split, and no position attends another residue."""
    seq = 12 * dilation
    desc = masks.dilated(w, dilation)
    d, sub = desc.strided_split()
    dense = desc.to_dense(seq)[0, 0]
    assert d == dilation
    for r in range(d):
        for r2 in range(d):
            block = dense[r::d, r2::d]
            assert torch.equal(block, sub.to_dense(seq // d)[0, 0]) if r == r2 else not block.any()
    assert masks.causal().strided_split() is None


def test_from_mask_mod_given_sizes_as_flexattention_takes_them_says_where_sizes_come_from():
    with pytest.raises(MaskTypeError, match="the sizes come when the mask is used"):
        masks.from_mask_mod(lambda b, h, q, k: q >= k, 128, 128)


def test_a_description_next_to_a_tensor_says_how_to_combine_them():
    """`causal() | bool_tensor` raised Python's own TypeError naming an internal class (found by a
    newcomer's read); it names masks.from_dense now, either side of the operator."""
    dense = torch.ones(8, 8, dtype=torch.bool)
    for combine in (lambda: masks.causal() | dense, lambda: dense & masks.causal()):
        with pytest.raises(TypeError, match=r"masks.from_dense\(tensor\)"):
            combine()
    assert (masks.causal() | masks.from_dense(dense)).to_dense(8, 8).all()


def test_an_empty_document_holds_no_position_as_in_cu_seqlens():
    """lengths from cu_seqlens.diff() may hold an empty document, which cu_seqlens itself takes
    (document_windows); document(lengths) refused it (a helper's audit)."""
    with_empty, without = masks.document([3, 0, 4, 0]), masks.document([3, 4])
    assert torch.equal(with_empty.to_dense(9), without.to_dense(9))
    assert repr(with_empty) == repr(without)
