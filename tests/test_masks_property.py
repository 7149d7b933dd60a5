"""Property test of the mask format: random compositions of zoo masks, `from_dense` and
`from_mask_mod` (per batch element and per head, odd sizes, S_q != S_k, every block shape
the attention kernels use) stored as a BlockMask and read back, against a dense reference
written here: each leaf's own formula, combined with plain boolean algebra."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_masks_block import check_layout
from test_masks_zoo import FACTORIES, reference, zoo_params

from stof_cc import masks

KERNEL_BLOCKS_M = [16, 32, 64, 128, 192]  # rowwise 16/32, mma.sync 64/128, wgmma 64/128/192
KERNEL_BLOCKS_N = [32, 64, 128]


def _qk(seq_q: int, seq_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(seq_q).view(1, 1, -1, 1), torch.arange(seq_k).view(1, 1, 1, -1)


@st.composite
def leaves(draw: st.DrawFn, batch: int, heads: int, seq_q: int, seq_k: int):
    """(description, dense reference broadcastable to [batch, heads, seq_q, seq_k])."""
    kind = draw(st.sampled_from(["zoo", "dense", "mask_mod"]))
    q, k = _qk(seq_q, seq_k)
    if kind == "zoo":
        name, p = draw(zoo_params())
        if name == "key_padding":
            p["lengths"] = draw(st.lists(st.integers(0, seq_k + 20), min_size=batch, max_size=batch))
        dense = reference(name, p, seq_q, seq_k)
        return FACTORIES[name](p), dense if dense.dim() == 4 else dense[None, None]
    if kind == "dense":
        # causal-or-not with per-sequence padding (the realistic case), and per-head noise
        lengths = torch.tensor(draw(st.lists(st.integers(0, seq_k), min_size=batch, max_size=batch)))
        dense = (k < lengths.view(-1, 1, 1, 1)).expand(batch, heads, seq_q, seq_k)
        if draw(st.booleans()):
            dense = dense & (q >= k)
        if draw(st.booleans()):
            gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
            dense = dense ^ (torch.rand(1, heads, seq_q, seq_k, generator=gen) < 0.02)
        dense = dense.contiguous()
        return masks.from_dense(dense), dense
    # a FlexAttention-style mask_mod with per-head windows and per-batch lengths
    windows = torch.tensor(draw(st.lists(st.integers(0, 40), min_size=heads, max_size=heads)))
    lengths = torch.tensor(draw(st.lists(st.integers(1, seq_k), min_size=batch, max_size=batch)))

    def per_head_window(b, h, q_idx, k_idx):
        return ((q_idx - k_idx).abs() <= windows[h]) & (k_idx < lengths[b])

    b_idx, h_idx = torch.arange(batch).view(-1, 1, 1, 1), torch.arange(heads).view(1, -1, 1, 1)
    dense = ((q - k).abs() <= windows[h_idx]) & (k < lengths[b_idx])
    return masks.from_mask_mod(per_head_window), dense


@st.composite
def compositions(draw: st.DrawFn, batch: int, heads: int, seq_q: int, seq_k: int, depth: int = 2):
    """A random expression of leaves under |, & and ~, with its dense reference."""
    if depth == 0 or draw(st.booleans()):
        return draw(leaves(batch, heads, seq_q, seq_k))
    op = draw(st.sampled_from(["or", "and", "not"]))
    a_desc, a_dense = draw(compositions(batch, heads, seq_q, seq_k, depth - 1))
    if op == "not":
        return ~a_desc, ~a_dense
    b_desc, b_dense = draw(compositions(batch, heads, seq_q, seq_k, depth - 1))
    if op == "or":
        return a_desc | b_desc, a_dense | b_dense
    return a_desc & b_desc, a_dense & b_dense


@st.composite
def cases(draw: st.DrawFn):
    batch, heads = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4]))
    seq_q, seq_k = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    desc, dense = draw(compositions(batch, heads, seq_q, seq_k))
    block_m, block_n = draw(st.sampled_from(KERNEL_BLOCKS_M)), draw(st.sampled_from(KERNEL_BLOCKS_N))
    return desc, dense.expand(batch, heads, seq_q, seq_k), block_m, block_n


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_compositions_against_dense_reference(case):
    desc, want, block_m, block_n = case
    batch, heads, seq_q, seq_k = want.shape
    bm = desc.block_mask(seq_q, seq_k, block_m, block_n, batch=batch, heads=heads)
    stored = bm.to_dense()
    assert stored.shape[:2] in {(1, 1), (1, heads), (batch, 1), (batch, heads)}
    assert torch.equal(stored.expand_as(want), want), f"{desc!r} {tuple(want.shape)} blocks {block_m}x{block_n}"
    check_layout(bm, stored)
    # a leading dim is collapsed exactly when its slices are equal
    assert (bm.batch == 1) == bool((want == want[:1]).all())
    assert (bm.heads == 1) == bool((want == want[:, :1]).all())


def test_batches_that_differ_with_equal_heads():
    """Causal with per-sequence padding, identical over heads: the batches hold different
    numbers of partial tiles, so collapsing the heads must split the tiles per batch."""
    S = 512
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    padding = torch.arange(S)[None] < torch.tensor([512, 64])[:, None]
    dense = (causal[None, None] & padding[:, None, None, :]).expand(2, 12, S, S).contiguous()
    bm = masks.from_dense(dense).block_mask(S)
    assert (bm.batch, bm.heads) == (2, 1)
    assert torch.equal(bm.to_dense().expand_as(dense), dense)
    check_layout(bm, bm.to_dense())
