"""benchmarks/floor.py on the CPU with a stand-in timer: a GEMM group's floor is its linear's time,
an attention group's the dense time scaled by its mask's density, any other group its bytes at
3 TB/s (the GPU figures need CUDA)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT
from group_cases import H100, LinearResidual, ResidualLayerNormSilu, build

from stof_cc.passes import lower
from stof_cc.tune.scheme import choose_scheme

sys.path.insert(0, str(ROOT / "benchmarks"))
import floor  # noqa: E402


def _timer(calls):
    def timer(fn):
        calls.append(fn())
        return 2.0
    return timer


def test_a_gemm_groups_floor_is_its_linear_in_the_library():
    _, _, graph, group = build(LinearResidual, "gemm", (8, 64, 96), torch.float16)
    calls = []
    assert floor.group_floor_ms(graph, group, _timer(calls), device="cpu") == 2.0
    assert calls[0].shape == (8, 64, 96) and calls[0].dtype == torch.float16  # F.linear on the group's shapes
    reads = 8 * 64 * 96 * 2 * 2 + (96 * 96 + 96) * 2  # x and the residual, the weight and bias
    assert floor.group_bytes(graph, group) == reads + 8 * 64 * 96 * 2


def test_a_memory_bound_groups_floor_is_its_bytes_at_three_terabytes():
    _, _, graph, group = build(ResidualLayerNormSilu, "reduction", (4, 96), torch.float16)
    moved = floor.group_bytes(graph, group)
    assert moved == (3 * 4 * 96 + 3 * 96) * 2  # two inputs and the output; a bias, the norm's weight and bias
    assert floor.group_floor_ms(graph, group, _timer([]), device="cpu") == pytest.approx(moved / 3e12 * 1e3)


class _Causal(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_an_attention_groups_floor_is_the_dense_time_times_the_density():
    q, k, v = (torch.randn(1, 2, 256, 32) for _ in range(3))
    graph, plan = lower(_Causal(), (q, k, v), {})
    (group,) = [g for g in choose_scheme(graph, plan, H100).scheme.groups if g.kind == "attention"]
    calls = []
    got = floor.group_floor_ms(graph, group, _timer(calls), device="cpu")
    assert calls and 0.5 < got / 2.0 < 0.8  # causal over 2 x 2 blocks of 128: 3 of 4 attended, partly
