"""merge_parallel_linears: sibling linears become one linear + split; values unchanged."""

from __future__ import annotations

import torch

from stof_cc import interpret, trace
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
