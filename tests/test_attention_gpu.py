"""Masked attention kernels against the torch reference on the GPU (fresh random inputs, poisoned outputs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stof_cc import masks
from stof_cc.ir.reference import masked_attention, masked_lse, relative_error
from stof_cc.runtime.attention import _planned, attention
from stof_cc.templates.attention import AttentionInputError, problem_of
from stof_cc.tune.attention import candidates

pytestmark = pytest.mark.gpu

SEQS = (64, 100, 128, 512, 1000, 2048)
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 128)
BATCH, HEADS = 2, 3


def zoo(seq: int) -> dict[str, masks.MaskDescription]:
    """Every zoo pattern at a size-appropriate scale; some with fully masked rows."""
    w = max(8, seq // 16)
    gen = torch.Generator().manual_seed(seq)
    dense = torch.rand(BATCH, HEADS, seq, seq, generator=gen) < 0.1
    dense[0, 1, : seq // 3] = False  # fully masked query rows
    return {
        "causal": masks.causal(),
        "sliding": masks.sliding_window(w),
        "sliding_causal": masks.sliding_window(w, causal=True),
        "dilated": masks.dilated(w, 3),
        "strided": masks.strided(max(4, seq // 8)),
        "fixed": masks.fixed(max(4, seq // 8), 2),
        "longformer": masks.longformer(w, 5),
        "bigbird": masks.bigbird(w, 3, 2, block=16, seed=1),
        "document": masks.document([seq // 3, seq - seq // 3 - 7, 7]),
        "key_padding": masks.key_padding([seq, 0]),  # batch 1 sees no key: all rows give 0
        "dense_per_head": masks.from_dense(dense),
        "mask_mod": masks.from_mask_mod(lambda b, h, q, k: ((q + k + h) % 5 != 0) & (k <= q + 17)),
    }


def _check(out: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    assert not torch.isnan(out).any(), f"{label}: NaN in output"
    err = relative_error(out, ref)
    assert err < 1e-2, f"{label}: relative error {err:.2e}"
    assert (out.float() - ref.float()).abs().max() < 5e-2, f"{label}: max abs error"


def _inputs(seq: int, head_dim: int, dtype: torch.dtype):
    return [torch.randn(BATCH, HEADS, seq, head_dim, device="cuda", dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_zoo_masks_match_reference(seq, dtype, head_dim):
    for name, mask in zoo(seq).items():
        q, k, v = _inputs(seq, head_dim, dtype)
        dense = mask.to_dense(seq, seq, batch=BATCH, heads=HEADS).cuda()
        out = torch.full_like(q, float("nan"))
        attention(q, k, v, mask, out=out)
        _check(out, masked_attention(q, k, v, dense), f"{name} S={seq} {dtype} d={head_dim}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_template_instance_matches_reference(dtype, head_dim):
    seq = 1000  # ragged against every block size
    problem = problem_of(*_inputs(seq, head_dim, dtype))
    mask = masks.longformer(37, 3) | masks.from_mask_mod(lambda b, h, q, k: (q - k) % 7 == h)
    dense = mask.to_dense(seq, seq, batch=BATCH, heads=HEADS).cuda()
    for template, params in candidates(problem):
        q, k, v = _inputs(seq, head_dim, dtype)
        # SDPA's output layout ([B, S, H, D] memory) rather than contiguous: strided stores
        out = torch.full((BATCH, seq, HEADS, head_dim), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
        attention(q, k, v, mask, params=params, out=out)
        _check(out, masked_attention(q, k, v, dense), f"{template.name} {params}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_template_instance_returns_the_log_sum_exp(dtype, head_dim):
    """return_lse at every point of the space: the output as without it, and each row's log-sum-exp
    within 1e-3 of the fp32 reference's, -inf on the rows no key reaches (batch 1's first third)."""
    seq = 1000
    problem = problem_of(*_inputs(seq, head_dim, dtype))
    dense = masks.longformer(37, 3).to_dense(seq, seq).expand(BATCH, HEADS, seq, seq).clone()
    dense[1, :, : seq // 3] = False
    mask = masks.from_dense(dense)
    dense = dense.cuda()
    for template, params in candidates(problem):
        q, k, v = _inputs(seq, head_dim, dtype)
        out, lse = attention(q, k, v, mask, scale=0.2, params=params, return_lse=True)
        label = f"{template.name} {params}"
        _check(out, masked_attention(q, k, v, dense, 0.2), label)
        want = masked_lse(q, k, dense, 0.2)
        assert lse.dtype == torch.float32 and lse.shape == (BATCH, HEADS, seq), label
        assert torch.equal(torch.isinf(lse), torch.isinf(want)), f"{label}: -inf rows differ"
        finite = ~torch.isinf(want)
        assert (lse[finite] - want[finite]).abs().max() < 1e-3, f"{label}: lse off"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_scores_that_climb_from_block_to_block_move_the_softmax_reference(dtype, head_dim):
    """Keys scaled up along the sequence and a large scale: each row's maximum climbs by far more than the
    softmax's slack (2^8) from block to block, and a late block's scores pass an early block's by more
    than fp32's exponent range, which exponentials against a stale reference would overflow. Every point,
    with causal masking, the output and the log-sum-exp; then a bias that climbs along the keys, every
    bias variant."""
    seq = 1000
    problem = problem_of(*_inputs(seq, head_dim, dtype))
    ramp = torch.linspace(0.05, 3.0, seq, device="cuda").view(1, 1, seq, 1)
    causal = masks.causal()
    dense = causal.to_dense(seq).cuda()
    for template, params in candidates(problem):
        q, k, v = _inputs(seq, head_dim, dtype)
        k = (k.float() * ramp).to(dtype)
        out, lse = attention(q, k, v, causal, scale=2.0, params=params, return_lse=True)
        label = f"climbing {template.name} {params}"
        _check(out, masked_attention(q, k, v, dense, 2.0), label)
        want = masked_lse(q, k, dense, 2.0)  # up to about 300 at the last rows
        assert ((lse - want).abs() <= 1e-4 * want.abs() + 1e-3).all(), f"{label}: lse off"
    seq = 300
    # in the inputs' dtype, as the kernels read it (bf16 rounds 0.7 * 299 by a quarter)
    climb = (torch.arange(seq, device="cuda", dtype=torch.float32) * 0.7).expand(1, HEADS, seq, seq).to(dtype)
    q, k, v = _inputs(seq, head_dim, dtype)
    for template, params in candidates(dataclasses.replace(problem_of(q, k, v), bias=True)):
        q, k, v = _inputs(seq, head_dim, dtype)
        out = attention(q, k, v, causal, bias=climb, params=params)
        keep = causal.to_dense(seq).cuda()
        _check(out, _biased_reference(q, k, v, climb, keep), f"climbing bias {template.name} {params}")


def test_a_strided_split_returns_the_log_sum_exp_of_every_position():
    """The dilated window that runs as strided windows writes each residue's rows of the LSE too."""
    from stof_cc.runtime import attention as runtime_attention

    q, k, v = (torch.randn(1, 12, 8192, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    desc = masks.dilated(512, 4)
    dense = desc.to_dense(8192).cuda()
    out, lse = attention(q, k, v, desc, return_lse=True)
    assert runtime_attention._splits[desc][(q.shape, k.shape, v.shape, q.dtype, q.device)] is not None  # it split
    assert relative_error(out, masked_attention(q, k, v, dense)) < 1e-2
    assert (lse - masked_lse(q, k, dense)).abs().max() < 1e-3


def test_partial_results_over_disjoint_keys_merge_into_the_whole():
    """Two kernels' (output, lse) over the first and last keys merge into one call over all of them."""
    from stof_cc.runtime.attention import merge_partials

    q, k, v = (torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = masks.sliding_window(100)
    whole = attention(q, k, v, mask)
    dense = mask.to_dense(512).cuda()
    halves = [attention(q, k[..., cut, :], v[..., cut, :], masks.from_dense(dense[..., cut]), return_lse=True)
              for cut in (slice(0, 256), slice(256, 512))]
    merged, merged_lse = merge_partials([h[0] for h in halves], [h[1] for h in halves])
    assert relative_error(merged, whole) < 1e-2
    assert (merged_lse - masked_lse(q, k, dense)).abs().max() < 1e-3


def test_no_mask_scale_and_rectangular():
    q = torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16)
    _check(attention(q, k, v, scale=0.3), masked_attention(q, k, v, None, 0.3), "rectangular, no mask")
    keep = torch.rand(100, 300, device="cuda") < 0.3
    _check(attention(q, k, v, keep), masked_attention(q, k, v, keep), "rectangular dense mask")


def test_non_contiguous_inputs():
    qkv = torch.randn(2, 128, 3, 4, 64, device="cuda", dtype=torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, S, D] views with odd strides
    mask = masks.causal()
    _check(attention(q, k, v, mask), masked_attention(q, k, v, mask.to_dense(128).cuda()), "strided views")


def test_bad_inputs_are_named():
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(AttentionInputError, match="dtype torch.float32"):
        attention(q.float(), q.float(), q.float())
    with pytest.raises(AttentionInputError, match="head_dim 48"):
        x = torch.randn(1, 2, 64, 48, device="cuda", dtype=torch.float16)
        attention(x, x, x)
    with pytest.raises(AttentionInputError, match="must be 4-D"):
        attention(q[0], q[0], q[0])
    with pytest.raises(AttentionInputError, match="is on cpu"):
        attention(q.cpu(), q.cpu(), q.cpu())
    with pytest.raises(masks.MaskError):
        attention(q, q, q, torch.ones(32, 32, dtype=torch.bool, device="cuda"))


def test_mask_mod_capturing_cuda_tensors():
    """Per-head windows in a CUDA tensor, as FlexAttention users write them: the mask_mod runs
    on the device of what it captures, in attention and in the reference's dense mask alike."""
    windows = torch.tensor([3, 17, 64], device="cuda")
    mask = masks.from_mask_mod(lambda b, h, q, k: (q - k).abs() <= windows[h])
    q, k, v = _inputs(300, 64, torch.float16)
    dense = mask.to_dense(300, batch=BATCH, heads=HEADS).cuda()
    _check(attention(q, k, v, mask), masked_attention(q, k, v, dense), "per-head CUDA windows")


def _paddings(seq: int) -> dict[str, torch.Tensor]:
    """[BATCH, seq] attention_mask-style paddings (1 = attend): right, left, holes, one empty row."""
    right = torch.ones(BATCH, seq, dtype=torch.int64)
    right[1, seq // 3:] = 0
    left = torch.ones(BATCH, seq, dtype=torch.int64)
    left[0, : seq - 70] = 0
    holes = (torch.rand(BATCH, seq, generator=torch.Generator().manual_seed(seq)) < 0.6).long()
    empty = right.clone()
    empty[0] = 0  # batch 0 sees no key: its rows give 0
    return {"right": right, "left": left, "holes": holes, "empty": empty}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_key_padding_on_the_device_matches_reference(dtype, head_dim):
    """key_padding= read by the kernels on the device, combined with static masks, on every
    template instance and any padding pattern (contiguous or with holes)."""
    seq = 1000  # ragged against every block size
    problem = problem_of(*_inputs(seq, head_dim, dtype))
    statics = {"none": None, "causal": masks.causal(), "window": masks.sliding_window(90, causal=True),
               "longformer": masks.longformer(37, 3)}
    cases = [(p, s) for p in _paddings(seq).items() for s in statics.items()]
    points = candidates(problem)
    for i in range(max(len(points), len(cases))):  # every instance and every case, each at least once
        (pad_name, padding), (static_name, static) = cases[i % len(cases)]
        template, params = points[i % len(points)]
        padding = padding.cuda()
        dense = (padding != 0)[:, None, None, :]
        if static is not None:
            dense = dense & static.to_dense(seq, seq).cuda()
        q, k, v = _inputs(seq, head_dim, dtype)
        out = torch.full_like(q, float("nan"))
        attention(q, k, v, static, key_padding=padding, params=params, out=out)
        _check(out, masked_attention(q, k, v, dense), f"{pad_name} + {static_name}: {template.name} {params}")


def test_key_padding_is_captured_in_a_cuda_graph():
    """Padding is data on the device: a captured call replays with new padding copied in."""
    seq = 512
    q, k, v = _inputs(seq, 64, torch.float16)
    padding = torch.ones(BATCH, seq, dtype=torch.int64, device="cuda")
    out, causal = torch.empty_like(q), masks.causal()  # plans are cached per description object
    attention(q, k, v, causal, key_padding=padding, out=out)  # plan built outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention(q, k, v, causal, key_padding=padding, out=out)
    for pad in _paddings(seq).values():
        padding.copy_(pad)
        graph.replay()
        dense = (padding != 0)[:, None, None, :] & masks.causal().to_dense(seq).cuda()
        _check(out, masked_attention(q, k, v, dense), "replayed with new padding")


def test_key_padding_of_the_wrong_size_is_named():
    q, k, v = _inputs(128, 64, torch.float16)
    with pytest.raises(AttentionInputError, match="key_padding is for 2 batch elements of 100 keys"):
        attention(q, k, v, key_padding=torch.ones(BATCH, 100, device="cuda"))
    with pytest.raises(AttentionInputError, match=r"key_padding must be \[batch, keys\]"):
        attention(q, k, v, key_padding=torch.ones(128, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_grouped_query_attention_reads_kv_heads_directly(dtype, head_dim):
    """K/V with fewer heads (3 query heads per K/V head, 12 / 4 as in the Llama benchmark), on
    every template instance, with key padding and causal or no mask."""
    seq, heads, kv_heads = 300, 12, 4
    q = torch.randn(BATCH, heads, seq, head_dim, device="cuda", dtype=dtype)
    problem = problem_of(q, *(torch.randn(BATCH, kv_heads, seq, head_dim, device="cuda", dtype=dtype)
                              for _ in range(2)))
    assert problem.kv_group == 3
    padding = _paddings(seq)["right"].cuda()
    for i, (template, params) in enumerate(candidates(problem)):
        k, v = (torch.randn(BATCH, kv_heads, seq, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        static = masks.causal() if i % 2 else None
        dense = (padding != 0)[:, None, None, :] & (static.to_dense(seq).cuda() if static else True)
        out = torch.full_like(q, float("nan"))
        attention(q, k, v, static, key_padding=padding, params=params, out=out)
        _check(out, masked_attention(q, k, v, dense), f"GQA 12/4 {template.name} {params}")


def _biased_reference(q, k, v, bias, keep=None):
    """softmax(q k^T / sqrt(d) + bias [masked]) v in fp32 (SDPA's float attn_mask)."""
    scores = q.float() @ k.float().transpose(-1, -2) / q.shape[-1] ** 0.5 + bias.float()
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, -1).nan_to_num(0.0) @ v.float()).to(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_an_additive_bias_is_added_by_every_template(dtype, head_dim):
    """A bias per head ([1, H, S, S], T5's relative positions) or per batch element ([B, 1, S, S]),
    in fp32 or the inputs' dtype, alone or with causal masking and key padding."""
    seq = 300
    q, k, v = _inputs(seq, head_dim, dtype)
    points = candidates(dataclasses.replace(problem_of(q, k, v), bias=True))  # the bias variants' space
    padding = _paddings(seq)["right"].cuda()
    causal = masks.causal()
    for i, (template, params) in enumerate(points):
        q, k, v = _inputs(seq, head_dim, dtype)
        shape = (1, HEADS, seq, seq) if i % 2 else (BATCH, 1, seq, seq)
        bias = torch.randn(shape, device="cuda", dtype=torch.float32 if i % 3 else dtype)
        out = torch.full_like(q, float("nan"))
        if i % 4 == 3:  # with causal masking and key padding too
            attention(q, k, v, causal, bias=bias, key_padding=padding, params=params, out=out)
            keep = causal.to_dense(seq).cuda() & (padding != 0)[:, None, None, :]
            want = _biased_reference(q, k, v, bias, keep)
        else:
            _, lse = attention(q, k, v, bias=bias, params=params, out=out, return_lse=True)
            want = _biased_reference(q, k, v, bias)
            # the log-sum-exp counts the bias (in the inputs' dtype, as the kernels read it)
            want_lse = masked_lse(q, k, None, bias=bias.to(dtype))
            assert (lse - want_lse).abs().max() < 1e-2, f"lse with bias {template.name} {params}"
        _check(out, want, f"bias {tuple(shape)} {template.name} {params}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq, w, dilation, splits", [(8192, 512, 4, True), (4096, 256, 2, None)])
def test_a_dilated_window_split_into_strided_windows_matches_reference(dtype, seq, w, dilation, splits):
    """Where the cost model prefers it (S = 8192: 4 windows of 2048 against one sparse 8192), a
    dilated window runs as `dilation` sliding windows over strided positions in one launch (each
    residue a batch slot), writing its rows of one output; with key padding too. Either way it
    matches the reference."""
    from stof_cc.runtime import attention as runtime_attention

    q, k, v = (torch.randn(1, 12, seq, 64, device="cuda", dtype=dtype) for _ in range(3))
    desc = masks.dilated(w, dilation)
    dense = desc.to_dense(seq).cuda()
    got = attention(q, k, v, desc)
    if splits:
        assert runtime_attention._splits[desc][(q.shape, k.shape, v.shape, q.dtype, q.device)] == desc.strided_split()
    assert relative_error(got, masked_attention(q, k, v, dense)) < 1e-2
    padding = torch.ones(1, seq, dtype=torch.long, device="cuda")
    padding[:, seq - 1000:] = 0
    got = attention(q, k, v, desc, key_padding=padding)
    want = masked_attention(q, k, v, dense & padding.bool()[:, None, None, :])
    assert relative_error(got, want) < 1e-2


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_strided_split_runs_every_template_point_in_one_launch(head_dim):
    """A strided split's problem (each residue of each batch element a batch slot) at every point
    of its space, on packed-qkv views with key padding per slot: one launch matches the dilated
    mask's reference."""
    from stof_cc.backends.attention_launch import key_padding_on_device, launch_plan
    from stof_cc.tune.attention import cached_block_mask, residue_problem

    batch, heads, seq, dilation = 2, 3, 1024, 4
    desc = masks.dilated(48, dilation)
    d, sub = desc.strided_split()
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device="cuda", dtype=torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    padding = torch.ones(batch, seq, dtype=torch.int64, device="cuda")
    padding[1, 700:] = 0
    padding[0, :9] = 0
    per_slot = key_padding_on_device(padding.view(batch, -1, d).transpose(1, 2).reshape(batch * d, -1))
    ref = masked_attention(q, k, v, desc.to_dense(seq).cuda() & padding.bool()[:, None, None, :])
    problem = residue_problem(problem_of(q, k, v), d)
    points = candidates(problem)
    assert points, "a strided split has no kernel"
    for template, params in points:
        plan = launch_plan(q, k, v, problem, template, params, cached_block_mask(sub, problem, params, q.device), None)
        assert not plan.copy_inputs  # the views' own strides, residues included
        out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
        _check(plan.launch(q, k, v, out, per_slot), ref, f"strided {template.name} {params}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_persistent_ctas_carry_their_pipelines_from_tile_to_tile(dtype, head_dim):
    """Far more tiles than SMs: each persistent CTA runs many, some of them with no allowed key
    (whole block rows masked, or all keys padded away), and its K/V rings, Q buffer and
    warpgroup turns carry over from one tile to the next; with key padding and with a bias.
    Every warp-specialised point, persistent or one CTA per tile."""
    batch, heads, seq = 2, 8, 3000  # 384 tiles of 128 rows, 256 of 192; ragged at the end
    mask = masks.from_mask_mod(lambda b, h, q, k: (k <= q) & ~((q >= 1000) & (q < 1500) & (h == 2)))
    padding = torch.ones(batch, seq, dtype=torch.int64)
    padding[1, 2000:] = 0
    padding[1, :300] = 0
    dense = mask.to_dense(seq, seq, batch=batch, heads=heads).cuda()
    problem = problem_of(*(torch.empty(batch, heads, seq, head_dim, dtype=dtype, device="cuda") for _ in range(3)))
    points = [(t, p) for t, p in candidates(problem) if t.walks_tile_schedule]
    assert any(p["persistent"] for _, p in points), "no persistent point in the space"
    with_bias_too = [p for t, p in candidates(dataclasses.replace(problem, bias=True)) if t.walks_tile_schedule]
    bias = torch.randn(1, heads, seq, seq, device="cuda", dtype=dtype)
    for template, params in points:
        runs = ((None, False), (padding.cuda(), False)) + (((None, True),) if params in with_bias_too else ())
        for key_padding, with_bias in runs:
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype) for _ in range(3))
            out = torch.full_like(q, float("nan"))
            attention(q, k, v, mask, key_padding=key_padding, bias=bias if with_bias else None, params=params, out=out)
            ref_mask = dense if key_padding is None else dense & (key_padding != 0)[:, None, None, :]
            ref = _biased_reference(q, k, v, bias, ref_mask) if with_bias else masked_attention(q, k, v, ref_mask)
            _check(out, ref, f"{template.name} {params} padding={key_padding is not None} bias={with_bias}")


@pytest.mark.parametrize("head_dim", (64, 128))
def test_tensor_maps_read_strided_views_and_broadcast_inputs_are_copied(head_dim):
    """The warp-specialised kernel loads through tensor maps built on the inputs' own strides: a
    packed qkv ([B, S, 3, H, D] memory) runs without copies; K broadcast over heads (stride 0),
    which a tensor map cannot describe, is copied first. Every warp-specialised point."""
    batch, heads, seq = 2, 4, 700
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device="cuda", dtype=torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    shared_k = torch.randn(batch, 1, seq, head_dim, device="cuda", dtype=torch.float16).expand(batch, heads, seq, head_dim)
    mask = masks.causal()
    dense = mask.to_dense(seq).cuda()
    points = [params for template, params in candidates(problem_of(q, k, v)) if template.loads_with_tma]
    assert points, "no TMA point in the space"
    for params in points:
        _check(attention(q, k, v, mask, params=params), masked_attention(q, k, v, dense), f"packed qkv {params}")
        _check(attention(q, shared_k, v, mask, params=params), masked_attention(q, shared_k, v, dense),
               f"broadcast K {params}")
        assert not _planned(q, k, v, mask, None, params, False).copy_inputs  # the views' own strides
        assert _planned(q, shared_k, v, mask, None, params, False).copy_inputs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_finite_bias_stays_finite_and_one_beyond_q_s_range_saturates(dtype):
    """A row hidden everywhere by the dtype's lowest finite value (HF's mask value) gives what fp32
    softmax gives: bf16's swamps the scores, so the mean of V (it overflowed to -inf in the kernel
    and the row gave 0; at 1e30 the softmax's residue gave NaN; clamped at 2^27, q k + 2^30 rounded
    in steps of 64 and the row was off by up to 2.3), fp16's keeps their differences. An
    fp32 bias of +7e4 on one key attends that key (it became +inf in fp16: NaN). Every template."""
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 200, 64
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
    hidden = torch.zeros(b, 1, s, s, device="cuda", dtype=dtype)
    hidden[:, :, 7] = torch.finfo(dtype).min
    wide = torch.full((b, 1, s, s), -1e9, device="cuda")
    wide[..., 11] = 7e4  # every query attends key 11 alone
    want = _biased_reference(q, k, v, hidden)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(want[:, :, 7].float(), v.float().mean(2), rtol=1e-2, atol=2e-3)  # bf16 rounding
    for _, params in candidates(dataclasses.replace(problem_of(q, k, v), bias=True)):
        out = attention(q, k, v, bias=hidden, params=params)
        assert relative_error(out, want) < 1e-2, params
        if dtype == torch.float16:
            out = attention(q, k, v, bias=wide, params=params)
            torch.testing.assert_close(out, v[:, :, 11:12].expand_as(out), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("lengths", [[1000, 37, 1200, 700, 63], [1000, 37, 1200, 700]])
def test_document_tiles_start_where_documents_start(lengths, dtype, head_dim):
    """Every warp-specialised point on documents whose boundaries no tile height divides: its tiles
    start where documents start (row origins, at every point whose plain tiles hold more blocks), a
    document's last tile overlaps the one before (those rows computed and stored twice, alike), two
    short documents share a tile with the start of the next, a padded tail (63 rows that attend
    nothing) is a run of its own; with key padding, a bias, and the log-sum-exp."""
    from stof_cc.tune.attention import row_origins

    batch, heads, seq = 2, 4, 3000
    description = masks.document(lengths)
    padding = torch.ones(batch, seq, dtype=torch.int64, device="cuda")
    padding[1, 2500:] = 0
    dense = description.to_dense(seq, seq).cuda()
    bias = torch.randn(1, heads, seq, seq, device="cuda", dtype=dtype)
    problem = problem_of(*(torch.empty(batch, heads, seq, head_dim, dtype=dtype, device="cuda") for _ in range(3)))
    points = [(t, p) for t, p in candidates(problem) if t.walks_tile_schedule]
    shifted = [p for _, p in points if row_origins(description, problem, p) is not None]
    assert {p["block_m"] for p in shifted} == {128, 192}, shifted
    with_bias_too = [p for t, p in candidates(dataclasses.replace(problem, bias=True)) if t.walks_tile_schedule]
    for template, params in points:
        runs = ((None, False), (padding, False)) + (((None, True),) if params in with_bias_too else ())
        for key_padding, with_bias in runs:
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype) for _ in range(3))
            out = torch.full_like(q, float("nan"))
            label = f"{template.name} {params} padding={key_padding is not None} bias={with_bias} origins={params in shifted}"
            if with_bias:
                attention(q, k, v, description, bias=bias, params=params, out=out)
                _check(out, _biased_reference(q, k, v, bias, dense), label)
                continue
            _, lse = attention(q, k, v, description, key_padding=key_padding, params=params, out=out, return_lse=True)
            ref_mask = dense if key_padding is None else dense & (key_padding != 0)[:, None, None, :]
            _check(out, masked_attention(q, k, v, ref_mask), label)
            want = masked_lse(q, k, ref_mask)
            assert torch.equal(torch.isinf(lse), torch.isinf(want)), f"{label}: -inf rows differ"
            finite = ~torch.isinf(want)
            assert (lse[finite] - want[finite]).abs().max() < 1e-3, f"{label}: lse off"
