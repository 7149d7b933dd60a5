"""read_kv_heads_directly: repeat_kv before attention is dropped only where it is exactly the
widening HF writes; the result equals the original on fresh random inputs."""

from __future__ import annotations

import torch

from stof_cc.ir.frontend import trace
from stof_cc.ir.interpret import interpret
from stof_cc.passes import GqaReport, read_kv_heads_directly, recognise_attention


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class Gqa(torch.nn.Module):
    def __init__(self, widen=_repeat_kv):
        super().__init__()
        self.widen = widen

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, self.widen(k, 3), self.widen(v, 3), is_causal=True)


def _inputs():
    return torch.randn(2, 6, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)


def test_repeat_kv_is_dropped_and_the_result_is_unchanged():
    module, inputs = Gqa(), _inputs()
    report = GqaReport()
    graph = read_kv_heads_directly(recognise_attention(trace(module, inputs)), report=report)
    (node,) = [n for n in graph.nodes() if n.op == "attention"]
    assert [graph.node(node.args[i].name).spec.shape[1] for i in range(3)] == [6, 2, 2]
    assert list(report.rewritten.values()) == [3] and not any(n.op == "expand" for n in graph.nodes())
    fresh = _inputs()
    torch.testing.assert_close(interpret(graph, *fresh), module(*fresh), rtol=1e-5, atol=1e-5)


def test_a_widening_that_is_not_repeat_kv_stays():
    """repeat (tiling: head h reads h % H_kv), not repeat_interleave: not a grouping of heads."""
    module, inputs = Gqa(lambda x, n: x.repeat(1, n, 1, 1)), _inputs()
    report = GqaReport()
    graph = read_kv_heads_directly(recognise_attention(trace(module, inputs)), report=report)
    assert not report.rewritten
    fresh = _inputs()
    torch.testing.assert_close(interpret(graph, *fresh), module(*fresh), rtol=1e-5, atol=1e-5)


class EnableGqa(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_sdpa_with_enable_gqa_becomes_an_attention_node_reading_the_narrow_heads():
    """SDPA's own grouped form (what AOTAutograd's graphs and HF's sdpa path carry): the attention
    node reads K/V with their H_kv heads, as after `read_kv_heads_directly`, and computes the same
    (torch itself refuses H not a multiple of H_kv)."""
    q, k, v = _inputs()
    graph = trace(EnableGqa(), (q, k, v), {})
    found = recognise_attention(graph)
    (node,) = [n for n in found.nodes() if n.op == "attention"]
    assert [found.node(r.name).spec.shape[1] for r in node.args[:3]] == [6, 2, 2]
    fresh = _inputs()
    torch.testing.assert_close(interpret(found, *fresh), EnableGqa()(*fresh), rtol=1e-5, atol=1e-5)
