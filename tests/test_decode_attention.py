"""The decode-attention kernel (templates/decode_attention.py, backends/decode_launch.py): a few
queries per sequence against a long KV cache, split over the keys. On the CPU: what it takes and
refuses, its split rule, and every source compiling for sm_90 without spills; on the GPU: against a
float32 reference for GQA, masks (none, causal, causal and symmetric windows), key padding, positions
into the cache, a strided cache, one to three tokens, both dtypes and head dims."""

from __future__ import annotations

import math

import pytest
import torch

from stof_cc import masks
from stof_cc.backends.decode_launch import DecodeInputError, decode_attention, decode_unsupported
from stof_cc.backends.nvcc import compile_cubin
from stof_cc.masks.zoo import band_of
from stof_cc.templates.decode_attention import DECODE_ATTENTION, TILE_KEYS, DecodeProblem


def test_every_key_counts_where_each_query_sees_the_whole_cache():
    from stof_cc.backends.decode_launch import every_key_counts

    assert every_key_counts(1, 100, None, 0, 0)
    assert every_key_counts(1, 100, masks.causal(), 99, 0)  # the last query over its cache
    assert not every_key_counts(2, 100, masks.causal(), 98, 0)  # the first of two does not see the last key
    assert every_key_counts(1, 8, masks.sliding_window(7, causal=True), 107, 100)  # a full window cache
    assert not every_key_counts(1, 9, masks.sliding_window(7, causal=True), 108, 100)
    assert not every_key_counts(1, 100, masks.dilated(2, 2), 99, 0)


def test_bands_are_what_it_takes():
    assert band_of(masks.causal()) == (0, None)
    assert band_of(masks.sliding_window(4095, causal=True)) == (0, 4095)
    assert band_of(masks.sliding_window(7)) == (-7, 7)
    assert band_of(masks.dilated(2, 2)) is None and band_of(masks.document([3, 5])) is None
    q, k = torch.zeros(1, 8, 1, 128), torch.zeros(1, 2, 10, 128)
    assert "CUDA" in decode_unsupported(q, k, None)  # a CPU tensor
    with pytest.raises(DecodeInputError, match="CUDA fp16/bf16"):
        decode_attention(q, k, k)
    meta = {"device": "meta", "dtype": torch.float16}
    empty = torch.empty(1, 2, 0, 128, **meta)
    assert "no empty dim" in _shape_check(torch.empty(1, 8, 1, 128, **meta), empty)
    assert "at most 16 rows" in _shape_check(torch.empty(1, 32, 1, 128, **meta), torch.empty(1, 1, 10, 128, **meta))
    assert "head dims" in _shape_check(torch.empty(1, 8, 1, 96, **meta), torch.empty(1, 2, 10, 96, **meta))


def _shape_check(q, k):
    """decode_unsupported's answer past its device check (meta tensors stand for CUDA ones)."""
    from unittest import mock

    with mock.patch.object(torch.Tensor, "is_cuda", property(lambda self: True)):
        return decode_unsupported(q, k, None)


def test_the_splits_bring_about_two_ctas_per_sm_in_whole_tiles():
    from stof_cc.templates.pricing import sm_count

    for batch, kv_heads, seq_k in ((1, 8, 4096), (8, 8, 4096), (1, 1, 100), (64, 8, 128), (1, 8, 1)):
        problem = DecodeProblem(batch, kv_heads, 4, 1, seq_k, 128, torch.float16)
        (params,) = DECODE_ATTENTION.space(problem)
        assert params["keys_per_split"] % TILE_KEYS == 0
        assert (params["splits"] - 1) * params["keys_per_split"] < seq_k <= params["splits"] * params["keys_per_split"]
        assert (params["splits"] - 1) * batch * kv_heads < 2 * sm_count()


@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_source_compiles_without_spills(dtype, head_dim):
    for heads_per_kv, tokens in ((1, 1), (4, 1), (8, 2), (16, 1)):
        problem = DecodeProblem(2, 2, heads_per_kv, tokens, 1000, head_dim, dtype)
        params = DECODE_ATTENTION.space(problem)[0]
        name = DECODE_ATTENTION.kernel_name(problem, params)
        compiled = compile_cubin(DECODE_ATTENTION.render(problem, params), arch="sm_90")
        for entry in (name, name + "_combine"):
            report = compiled.resources[entry]
            assert report.spill_stores == 0 and report.registers <= 255, (entry, report)


def _reference(q, k, v, mask, scale, q_position, k_position, key_padding, sinks=None):
    """float32 attention with the mask and padding dense; zeros where a row allows no key; ``sinks``
    a column of one logit per head that every row's softmax counts, as GPT-OSS's eager code writes it."""
    batch, heads, tokens, dim = q.shape
    kf = k.float().repeat_interleave(heads // k.shape[1], dim=1)
    vf = v.float().repeat_interleave(heads // k.shape[1], dim=1)
    allowed = torch.ones(batch, 1, tokens, k.shape[2], dtype=torch.bool, device=q.device)
    if mask is not None:
        lo, hi = band_of(mask)
        distance = (q_position + torch.arange(tokens, device=q.device))[:, None] \
            - (k_position + torch.arange(k.shape[2], device=q.device))[None, :]
        allowed = allowed & ((distance >= lo) & (distance <= (hi if hi is not None else distance.max())))
    if key_padding is not None:
        allowed = allowed & key_padding[:, None, None, :]
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.float().view(1, heads, 1, 1).expand(batch, heads, tokens, 1)
        return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ vf
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vf


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_matches_the_reference(dtype, head_dim, with_sinks):
    torch.manual_seed(0)
    cases = [  # batch, heads, kv heads, tokens, keys, mask, key padding
        (1, 8, 2, 1, 4097, masks.causal(), False),
        (3, 4, 4, 1, 1000, masks.sliding_window(99, causal=True), True),
        (2, 16, 2, 2, 777, masks.causal(), True),
        (2, 6, 2, 3, 130, masks.sliding_window(40), False),
        (4, 8, 8, 1, 1, None, False),
        (2, 8, 1, 1, 5000, None, True),
        (8, 16, 8, 2, 2000, masks.sliding_window(699, causal=True), True),  # several tiles per CTA: the rescaling
    ]
    for batch, heads, kv_heads, tokens, keys, mask, padded in cases:
        cache = torch.randn(batch, kv_heads, keys + 64, head_dim, device="cuda", dtype=dtype)  # a static cache
        k = cache[:, :, :keys]
        v = torch.randn_like(cache)[:, :, :keys]
        q = torch.randn(batch, heads, tokens, head_dim, device="cuda", dtype=dtype)
        padding = None
        if padded:  # left padding of a different length per sequence, one sequence with no key
            starts = torch.randint(0, keys, (batch,), device="cuda")
            padding = torch.arange(keys, device="cuda")[None, :] >= starts[:, None]
            padding[-1] = False
            v[~padding[:, None, :, None].expand_as(v)] = float("nan")  # an unwritten cache slot: never read
        k_position = 3 if mask is not None else 0
        q_position = k_position + keys - tokens  # the queries are the cache's last positions
        scale = 1 / math.sqrt(head_dim)
        # GPT-OSS's sinks (model dtype, one per query head): some far above the scores, some far below
        sinks = (torch.randn(heads, device="cuda") * 4).to(dtype) if with_sinks else None
        got = decode_attention(q, k, v, mask, scale=scale, q_position=q_position, k_position=k_position,
                               key_padding=padding, sinks=sinks)
        want = _reference(q, k, v if padding is None else v.nan_to_num(0.0), mask, scale, q_position, k_position,
                          padding, sinks)
        assert got.shape == (batch, heads, tokens, head_dim) and got.is_contiguous()
        error = float((got.float() - want).norm() / want.norm().clamp(min=1e-3))
        assert error < 1e-2, (batch, heads, kv_heads, tokens, keys, mask, padded, error)
        if padded:
            assert not got[-1].any()  # no key allowed: zeros


@pytest.mark.gpu
def test_a_scale_the_softmax_cannot_take_and_another_batch_of_keys_are_refused():
    """A negative, zero or NaN scale went straight into the kernel (a review), as did keys of another batch;
    both are refused naming the culprit, as stof_cc.attention refuses them."""
    q = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.float16)
    for scale in (-0.125, 0.0, float("nan"), float("inf")):
        with pytest.raises(DecodeInputError, match="scale must be positive"):
            decode_attention(q, k, k, masks.causal(), scale=scale, q_position=99)
    assert decode_unsupported(q[:1], k, None) == "q's batch 1 is not k's 2"
    with pytest.raises(ValueError, match="sinks must be a floating tensor of 4 logits"):
        decode_attention(q, k, k, masks.causal(), q_position=99, sinks=torch.zeros(3, device="cuda"))
