"""The rotary rule: HF's rotary embedding becomes one ``rotary`` node only where it is exactly
x * cos + rotate_half(x) * sin; the result equals the original on fresh random inputs. On the
GPU the rotary kernel matches the reference for strided inputs, both dtypes and head dims."""

from __future__ import annotations

import pytest
import torch

from stof_cc.ir.frontend import trace
from stof_cc.ir.interpret import interpret
from stof_cc.ir.ops import rotary_reference
from stof_cc.ir.reference import relative_error
from stof_cc.passes import RulesReport, recognise_patterns
from stof_cc.passes.rotary import ROTARY


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(torch.nn.Module):
    """Llama's apply_rotary_pos_emb on a projection's transposed view."""

    def __init__(self, rotate=_rotate_half):
        super().__init__()
        self.rotate = rotate
        self.register_buffer("cos", torch.randn(1, 1, 16, 8))
        self.register_buffer("sin", torch.randn(1, 1, 16, 8))

    def forward(self, x):
        x = x.view(2, 16, 3, 8).transpose(1, 2)
        return x * self.cos + self.rotate(x) * self.sin


def test_the_rotary_embedding_becomes_one_node_with_the_same_result():
    module, x = Rotary(), torch.randn(2, 16, 24)
    report = RulesReport()
    graph = recognise_patterns(trace(module, (x,)), report=report, rules=(ROTARY,))
    assert len(report.rewritten["rotary"]) == 1 and [n.op for n in graph.nodes()].count("rotary") == 1
    assert not any(n.op in ("cat", "neg", "slice") for n in graph.nodes())
    fresh = torch.randn(2, 16, 24)
    torch.testing.assert_close(interpret(graph, fresh), module(fresh), rtol=1e-6, atol=1e-6)


def test_a_different_rotation_stays():
    """The halves swapped without the negation is not the rotary embedding."""
    module, x = Rotary(lambda x: torch.cat((x[..., 4:], x[..., :4]), dim=-1)), torch.randn(2, 16, 24)
    report = RulesReport()
    graph = recognise_patterns(trace(module, (x,)), report=report, rules=(ROTARY,))
    assert not report.rewritten["rotary"]
    torch.testing.assert_close(interpret(graph, x), module(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("table_batch", [1, 3])
@pytest.mark.parametrize("row_pad", [0, 1])  # 1: rows not 16-byte aligned (the one-pair entry point)
def test_the_rotary_kernel_matches_the_reference(dtype, head_dim, table_batch, row_pad):
    from stof_cc.backends.rotary_launch import rotary

    b, h, s = 3, 5, 77
    # a merged Q/K/V output (with row_pad, each row one element longer and the view one element in)
    projection = torch.randn(b, s, 3 * h * head_dim + row_pad, device="cuda", dtype=dtype)[..., row_pad:]
    x = projection[..., h * head_dim: 2 * h * head_dim].view(b, s, h, head_dim).transpose(1, 2)  # strided
    cos, sin = (torch.randn(table_batch, 1, s, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    out = rotary(x, cos, sin)
    want = rotary_reference(x.float(), cos.float(), sin.float())
    assert out.is_contiguous() and relative_error(out, want) < 5e-3
