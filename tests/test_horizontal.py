"""merge_parallel_linears: sibling linears become one linear + split; values unchanged."""

from __future__ import annotations

import pytest
import torch

from stof_cc import interpret, trace
from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec, assert_structural_equal
from stof_cc.passes import HorizontalReport, canonicalize, merge_parallel_linears


class _Siblings(torch.nn.Module):
    """Q/K/V-style projections of one input, one of another width, two without bias; one whose
    output feeds elementwise work (kept: its epilogue fuses), one applied twice (a tied weight:
    kept), one graph output (kept), one of another input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(16, 24) for _ in range(3))
        self.wide = torch.nn.Linear(16, 40)
        self.plain, self.plain2 = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 8, bias=False)
        self.gated, self.tied, self.returned = (torch.nn.Linear(16, 8) for _ in range(3))
        self.other = torch.nn.Linear(16, 24)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (lin(x).view(2, 5, 2, 12) for lin in (self.q, self.k, self.v))
        mixed = (q * k + v).sum((-1, -2)) + self.wide(x).view(2, 5, 4, 10).sum((-1, -2))
        mixed = mixed + (self.plain(x).view(2, 5, 2, 4) - self.plain2(x).view(2, 5, 2, 4)).sum((-1, -2))
        mixed = mixed + torch.relu(self.gated(x)).sum(-1) + self.other(y).view(2, 5, 2, 12).sum((-1, -2))
        mixed = mixed + (self.tied(x).view(2, 5, 8) * self.tied(x).view(2, 5, 8)).sum(-1)
        return mixed, self.returned(x)


def _merged(graph, report):
    return {name: graph.node(name) for name in report.merged}


def test_siblings_merge_into_one_linear_and_split_with_the_same_values():
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    graph = canonicalize(trace(_Siblings(), (x, y)))
    report = HorizontalReport()
    result = merge_parallel_linears(graph, report=report)
    result.verify()
    merged = _merged(result, report)
    assert len(merged) == 2  # q, k, v, wide (with bias, one input) and plain, plain2; `other` reads y
    widths = sorted(node.spec.shape[-1] for node in merged.values())
    assert widths == [16, 3 * 24 + 40]
    splits = [n for n in result.nodes() if n.op == "split"]
    assert {n.target for n in splits} == {"aten.split.Tensor", "aten.split_with_sizes.default"}
    assert result.op_histogram()["linear"] == 7  # two merged; gated, tied twice, returned, other
    for original in report.merged.values():  # each replaced linear keeps its name, as a getitem
        assert all(result.node(name).op == "getitem" for name in original)
    with torch.no_grad():
        torch.testing.assert_close(interpret(result, x, y), interpret(graph, x, y))


def test_a_lone_linear_is_left_as_it_is():
    layer = torch.nn.Linear(16, 16)
    graph = canonicalize(trace(layer, (torch.randn(3, 16),)))
    report = HorizontalReport()
    result = merge_parallel_linears(graph, report=report)
    assert not report.merged and str(result) == str(graph) and "no sibling linears" in str(report)


# -- before / expected ---------------------------------------------------------------------


def _f32(*shape: int) -> TensorSpec:
    return TensorSpec(shape, torch.float32)


class _QK(torch.nn.Module):
    """Two projections of x viewed into heads (merged) and one followed by relu (kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = torch.nn.Linear(4, 6), torch.nn.Linear(4, 6), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor):
        return self.q(x).view(2, 3, 2, 3), self.k(x).view(2, 3, 2, 3), torch.relu(self.o(x))


def test_before_expected_siblings_become_one_linear_and_a_split():
    module = _QK()
    before = canonicalize(trace(module, (torch.randn(2, 3, 4),)))
    expected = Graph()
    expected.in_spec, expected.out_spec = before.in_spec, before.out_spec
    expected.add_constant("o_weight", module.o.weight.detach(), "o.weight")  # q's and k's constants are gone
    expected.add_constant("o_bias", module.o.bias.detach(), "o.bias")
    expected.add_input("x", _f32(2, 3, 4))
    expected.add_constant("qk_weight", torch.cat([module.q.weight, module.k.weight]).detach())
    expected.add_constant("qk_bias", torch.cat([module.q.bias, module.k.bias]).detach())
    expected.add_node(Node("qk", "linear", "aten.linear.default", (Ref("x"), Ref("qk_weight"), Ref("qk_bias")),
                           spec=_f32(2, 3, 12)))
    expected.add_node(Node("split", "split", "aten.split.Tensor", (Ref("qk"), 6, -1),
                           spec=(_f32(2, 3, 6), _f32(2, 3, 6))))
    expected.add_node(Node("q", "getitem", "operator.getitem", (Ref("split"), 0), spec=_f32(2, 3, 6)))
    expected.add_node(Node("q_heads", "view", "aten.view.default", (Ref("q"), [2, 3, 2, 3]), spec=_f32(2, 3, 2, 3)))
    expected.add_node(Node("k", "getitem", "operator.getitem", (Ref("split"), 1), spec=_f32(2, 3, 6)))
    expected.add_node(Node("k_heads", "view", "aten.view.default", (Ref("k"), [2, 3, 2, 3]), spec=_f32(2, 3, 2, 3)))
    expected.add_node(Node("o", "linear", "aten.linear.default", (Ref("x"), Ref("o_weight"), Ref("o_bias")),
                           spec=_f32(2, 3, 2)))
    expected.add_node(Node("relu", "relu", "aten.relu.default", (Ref("o"),), spec=_f32(2, 3, 2)))
    expected.outputs = [Ref("q_heads"), Ref("k_heads"), Ref("relu")]
    assert_structural_equal(merge_parallel_linears(before), expected)


class _Unequal(torch.nn.Module):
    """Two projections without bias and of different widths: split_with_sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 2, bias=False), torch.nn.Linear(4, 6, bias=False)

    def forward(self, x: torch.Tensor):
        return self.a(x).transpose(0, 1), self.b(x).transpose(0, 1)


def test_before_expected_unequal_widths_without_bias():
    module = _Unequal()
    before = canonicalize(trace(module, (torch.randn(3, 4),)))
    expected = Graph()
    expected.in_spec, expected.out_spec = before.in_spec, before.out_spec
    expected.add_input("x", _f32(3, 4))
    expected.add_constant("ab_weight", torch.cat([module.a.weight, module.b.weight]).detach())
    expected.add_node(Node("ab", "linear", "aten.linear.default", (Ref("x"), Ref("ab_weight")), spec=_f32(3, 8)))
    expected.add_node(Node("split", "split", "aten.split_with_sizes.default", (Ref("ab"), [2, 6], -1),
                           spec=(_f32(3, 2), _f32(3, 6))))
    expected.add_node(Node("a", "getitem", "operator.getitem", (Ref("split"), 0), spec=_f32(3, 2)))
    expected.add_node(Node("a_t", "transpose", "aten.transpose.int", (Ref("a"), 0, 1), spec=_f32(2, 3)))
    expected.add_node(Node("b", "getitem", "operator.getitem", (Ref("split"), 1), spec=_f32(3, 6)))
    expected.add_node(Node("b_t", "transpose", "aten.transpose.int", (Ref("b"), 0, 1), spec=_f32(6, 3)))
    expected.outputs = [Ref("a_t"), Ref("b_t")]
    assert_structural_equal(merge_parallel_linears(before), expected)


class _Gated(torch.nn.Module):
    """Siblings whose outputs feed elementwise work: each keeps it in its own GEMM's epilogue."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x)) * torch.sigmoid(self.b(x))


@pytest.mark.parametrize("module", [_Gated(), torch.nn.Linear(4, 4)], ids=["gated_siblings", "lone_linear"])
def test_before_expected_nothing_to_merge_is_unchanged(module):
    before = canonicalize(trace(module, (torch.randn(3, 4),)))
    assert_structural_equal(merge_parallel_linears(before), before, map_free_names=False)
