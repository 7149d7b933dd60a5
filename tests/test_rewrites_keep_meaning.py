"""Rewrites that must keep what the model computes, each on an input that once broke it: every
graph after the passes, interpreted, against the module itself (NaN where, and only where, the
module gives NaN)."""

from __future__ import annotations

import math

import pytest
import torch

import stof_cc
from stof_cc.passes import cast_floating, lower

B, H, S, D = 2, 3, 5, 8


def _same(module: torch.nn.Module, *args, dtype: torch.dtype | None = None, atol: float = 1e-4):
    """The lowered graph's output against the module's, in ``dtype`` when given (the module
    cast to it, as `stof_cc.compile` does); the graph for further checks."""
    module = module.eval()
    graph, _ = lower(module, args, {}, dtype=dtype)
    if dtype is not None:
        module, args = module.to(dtype), cast_floating(args, dtype)
    with torch.no_grad():
        want = module(*args)
    got = stof_cc.interpret(graph, *args)
    torch.testing.assert_close(got.float(), want.float(), rtol=atol, atol=atol, equal_nan=True)
    return graph


def _qkv(dtype=torch.float32, scale=1.0):
    torch.manual_seed(0)
    return tuple((torch.randn(B, H, S, D) * scale).to(dtype) for _ in range(3))


class _IgnoredInput(torch.nn.Module):
    """baddbmm with beta = 0 ignores its input (GPTBigCode passes torch.empty there)."""

    def forward(self, q, k, v, junk):
        q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
        scores = torch.baddbmm(junk, q3, k3.transpose(1, 2), beta=0.0, alpha=0.25)
        probs = torch.softmax(scores.view(B, H, S, S), -1).view(B * H, S, S)
        return torch.bmm(probs, v3).view(B, H, S, D)


def test_baddbmm_with_beta_zero_adds_nothing():
    graph = _same(_IgnoredInput(), *_qkv(), torch.full((B * H, S, S), float("nan")))
    (node,) = [n for n in graph.nodes() if n.op == "attention"]
    assert "bias" not in node.kwargs


class _Fp32Mask(torch.nn.Module):
    """fp16 scores plus a mask built in fp32 (finfo(fp32).min): the add promotes to fp32."""

    def forward(self, q, k, v, keep):
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        mask = torch.zeros(keep.shape, dtype=torch.float32).masked_fill(~keep, torch.finfo(torch.float32).min)
        return torch.matmul(torch.softmax(scores + mask, -1, dtype=torch.float32).to(q.dtype), v)


class _SoftcapFp16Mask(torch.nn.Module):
    """Softcapped fp16 scores plus fp16's lowest value where hidden (Gemma 2's eager chain)."""

    def forward(self, q, k, v, mask):
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * 0.5 / 20.0) * 20.0
        return torch.matmul(torch.softmax(scores + mask, -1, dtype=torch.float32).to(q.dtype), v)


def test_a_fully_masked_row_keeps_the_chains_own_arithmetic():
    keep = torch.rand(B, 1, S, S) > 0.5
    keep[0, 0, 1, :] = False
    _same(_Fp32Mask(), *_qkv(torch.float16), keep, atol=1e-2)
    mask = torch.zeros(B, 1, S, S, dtype=torch.float16)
    mask[0, 0, 1, :] = -65504.0
    _same(_SoftcapFp16Mask(), *_qkv(torch.float16, scale=3.0), mask, atol=1e-2)


class _Upcast(torch.nn.Module):
    """q and k upcast to fp32, the probabilities cast to v's fp16 (GPT-J's eager attention in
    transformers 5.17): one attention, the upcasts being exact."""

    def forward(self, q, k, v):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * 0.3
        return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v)


class _BoolAdded(torch.nn.Module):
    """A boolean mask added to the scores adds 1 where True: not an attend-mask."""

    def forward(self, q, k, v, m):
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) + m, -1), v)


class _UpcastBatched(torch.nn.Module):
    """The same with the product a bmm on [B*H, S, D] views of the upcast q and k."""

    def forward(self, q, k, v):
        q3, k3 = (t.float().reshape(B * H, S, D) for t in (q, k))
        scores = torch.bmm(q3, k3.transpose(1, 2)).view(B, H, S, S) * 0.3
        return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v)


class _AllUpcast(torch.nn.Module):
    """q, k and v upcast: the attention runs in fp32 between the casts."""

    def forward(self, q, k, v):
        return torch.matmul(torch.softmax(torch.matmul(q.float(), k.float().transpose(-1, -2)) * 0.3, -1), v.float())


@pytest.mark.parametrize("module", [_Upcast, _UpcastBatched])
def test_q_and_k_upcast_to_fp32_are_one_attention(module):
    graph = _same(module(), *_qkv(), dtype=torch.float16, atol=1e-2)
    ops = [n.op for n in graph.nodes()]
    assert ops.count("attention") == 1 and "cast" not in ops and "matmul" not in ops, ops


class _UpcastMasked(torch.nn.Module):
    """q and k upcast, a float mask added to the fp32 scores (GPT-J with a mask)."""

    def forward(self, q, k, v, mask):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * 0.3
        return torch.matmul(torch.softmax(scores + mask, -1).to(v.dtype), v)


def test_q_and_k_upcast_under_a_mask_keep_fp32_scores():
    """With the upcasts dropped, the node said its scores were held in q's fp16 (found by review): the
    reference rounded scores 1024-1025.5 to whole numbers, and a row hidden everywhere by fp16's -65504
    became the mean of V where the model's fp32 sum keeps the scores' differences."""
    q = torch.full((1, 1, 1, 2), 32.0, dtype=torch.float16)
    k = torch.tensor([[16.0, 16.0 + i / 64] for i in range(4)], dtype=torch.float16).view(1, 1, 4, 2)
    v = torch.arange(8.0, dtype=torch.float16).view(1, 1, 4, 2)
    graph = _same(_UpcastMasked(), q, k, v, torch.zeros(1, 1, 1, 4), atol=1e-3)
    (node,) = [n for n in graph.nodes() if n.op == "attention"]
    assert node.kwargs["scores_dtype"] == torch.float32
    q, k, v = _qkv(torch.float16)
    mask = torch.zeros(B, 1, S, S, dtype=torch.float16)
    mask[0, 0, 1, :] = -65504.0
    _same(_UpcastMasked(), q, k, v + 1, mask, atol=1e-2)


class _DoubledScores(torch.nn.Module):
    def forward(self, q, k, v):
        scores = q @ k.transpose(-1, -2)
        return torch.softmax(scores + scores, -1) @ v


class _HeadsFirst(torch.nn.Module):
    """3-d q, k and v ([H, S, D]) under a [B, 1, 1, S] padding mask: the mask widens the output to 4-d."""

    def forward(self, q, k, v, padding):
        keep = padding.bool()[:, None, None, :]
        return torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~keep, float("-inf")), -1) @ v


def test_chains_whose_mask_is_the_scores_or_widens_the_output_stay_plain():
    """softmax(s + s) took the product for its own mask and left a graph reading a removed node; a mask
    broadcasting 3-d q, k, v to a 4-d output became key padding of the wrong batch (both crashed
    inside `lower` or the interpreter; found by review)."""
    graph = _same(_DoubledScores(), *_qkv())
    assert not any(n.op == "attention" for n in graph.nodes())
    q, k, v = (t[0] for t in _qkv())
    padding = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    graph = _same(_HeadsFirst(), q, k, v, padding)
    assert not any(n.op == "attention" for n in graph.nodes())


def test_q_k_and_v_upcast_keep_their_casts():
    graph = _same(_AllUpcast(), *_qkv(), dtype=torch.float16, atol=1e-2)
    ops = [n.op for n in graph.nodes()]
    assert ops.count("attention") == 1 and ops.count("cast") == 3, ops


def test_chains_that_are_not_one_attention_stay_as_they_are():
    graph = _same(_BoolAdded(), *_qkv(), torch.rand(B, 1, S, S) > 0.5)
    assert not any(n.op == "attention" for n in graph.nodes())


class _Variances(torch.nn.Module):
    def forward(self, x):
        return x.var(dim=1, unbiased=False, keepdim=True) + torch.var(x, 1, True, True) \
            + torch.var(x, dim=1, correction=0, keepdim=True)


class _Fp32Variance(torch.nn.Module):
    """A norm whose variance is averaged in fp32 (mean(..., dtype=float32)) in an fp16 model."""

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True, dtype=torch.float32) + 1e-5)


def test_reductions_keep_their_arguments():
    _same(_Variances(), torch.randn(2, 6, 4))
    _same(_Fp32Variance(), torch.randn(2, 6, 16), dtype=torch.float16, atol=1e-2)


class _TensorBound(torch.nn.Module):
    def forward(self, x, r):
        return torch.clamp_min(x * 2, r) + 1


def test_a_tensor_bound_is_refused_by_name_not_a_crash(tmp_path):
    from stof_cc.runtime.build import build_groups
    from stof_cc.tune.scheme import choose_scheme

    x, r = torch.randn(4, 16), torch.randn(4, 16)
    graph = _same(_TensorBound(), x, r)
    builds = build_groups(graph, choose_scheme(graph, lower(_TensorBound(), (x, r), {})[1]), tmp_path,
                          compile_kernels=False)
    refused = [b.note for b in builds if b.template is None]
    assert any("min is a tensor" in note for note in refused), refused


@pytest.mark.parametrize("module", [_Variances(), _Fp32Variance()])
def test_the_graphs_verify(module):
    lower(module, (torch.randn(2, 6, 16),), {}, dtype=torch.float16)[0].verify()
