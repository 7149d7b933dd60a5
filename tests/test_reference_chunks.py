"""`ir.reference.masked_attention` in pieces of query rows gives what it gives all at once (to rounding)."""

from __future__ import annotations

import torch

from stof_cc.ir import reference


def test_masked_attention_in_pieces_of_query_rows_is_the_same(monkeypatch):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 37, 16)
    k, v = torch.randn(2, 2, 29, 16), torch.randn(2, 2, 29, 16)  # grouped K/V heads
    per_query = torch.rand(2, 1, 37, 29) < 0.7  # one mask row per query row
    per_query[0, 0, 5] = False  # a query with no key
    keys_only = torch.rand(2, 1, 1, 29) < 0.7  # broadcast over the query rows
    bias = torch.randn(1, 4, 37, 29)
    whole = [reference.masked_attention(q, k, v, mask, 0.3, bias=b) for mask, b in ((per_query, bias), (keys_only, None))]
    monkeypatch.setattr(reference, "SCORE_BYTES", 4 * 29 * 2 * 4 * 5)  # five query rows a piece: 8 pieces
    pieces = [reference.masked_attention(q, k, v, mask, 0.3, bias=b) for mask, b in ((per_query, bias), (keys_only, None))]
    for got, want in zip(pieces, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # matmul blocking: last bits differ
    assert torch.equal(whole[0][0, :, 5], torch.zeros(4, 16))


def test_empty_inputs_give_empty_outputs():
    q, k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert reference.masked_attention(q, k, v, None).shape == (1, 2, 0, 8)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8)
    assert torch.equal(reference.masked_attention(q, k, v, None), torch.zeros(1, 2, 3, 8))  # no key: 0


def test_a_row_with_no_key_gives_zero_and_a_nan_from_the_inputs_stays_nan():
    """Only rows whose every score is -inf (mask or bias) are zeroed: a blanket nan_to_num hid a NaN
    query, key or scale as zeros (a helper's hunt), where the kernels and SDPA give NaN."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[0, 0, 1] = False  # query 1 sees no key
    bias = torch.zeros(1, 1, 4, 6)
    bias[0, 0, 2] = float("-inf")  # query 2 neither, through its bias
    out = reference.masked_attention(q, k, v, mask, bias=bias)
    assert not out[0, 0, 1:3].any() and out[0, 0, [0, 3]].abs().sum() > 0
    q[0, 0, 3, 0] = float("nan")
    out = reference.masked_attention(q, k, v, mask)
    assert torch.isnan(out[0, 0, 3]).all() and not torch.isnan(out[0, 0, :3]).any()
    assert torch.isnan(reference.masked_attention(q[..., :1, :], k, v, None, scale=float("nan"))).all()
