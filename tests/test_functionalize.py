"""In-place ops made out-of-place where that is exact (canonicalize's first step): readers before
the write see the old value, readers after it the new one; a write through a view, into an
input or into a value a view reads is refused and leaves the graph as it is."""

from __future__ import annotations

import torch

import stof_cc
from stof_cc.passes import CanonicalizeReport, canonicalize
from stof_cc.passes.canonicalize import functionalize, mutating_nodes


class _FreshAdd(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        before = y + 1  # reads y before the write
        y.add_(x)
        return before * y  # reads the written y


class _ThroughAView(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        y[:, :2] = 0  # a write through a view of y
        return y + 1


def _graph_with_inplace(module, x):
    graph = stof_cc.trace(module, (x,))
    assert mutating_nodes(graph), "the example should keep an in-place op after torch.export"
    return graph


def test_an_inplace_add_on_a_fresh_tensor_becomes_out_of_place():
    x = torch.randn(3, 5)
    graph = _graph_with_inplace(_FreshAdd(), x)
    functional, refused = functionalize(graph)
    assert not refused and not mutating_nodes(functional)
    torch.testing.assert_close(stof_cc.interpret(functional, x), _FreshAdd()(x))
    report = CanonicalizeReport()
    canonical = canonicalize(graph, report=report)
    assert not report.skipped
    torch.testing.assert_close(stof_cc.interpret(canonical, x), _FreshAdd()(x))


def test_a_write_through_a_view_is_refused_and_named():
    x = torch.randn(3, 5)
    graph = _graph_with_inplace(_ThroughAView(), x)  # fill_ on a slice of y
    functional, refused = functionalize(graph)
    assert refused == ["fill_"] and functional is graph
    report = CanonicalizeReport()
    canonicalize(graph, report=report)
    assert "in-place ops (%fill_)" in report.skipped
    torch.testing.assert_close(stof_cc.interpret(canonicalize(graph), x), _ThroughAView()(x))


class _Router(torch.nn.Module):
    """Mixtral's router: top-k weights renormalised in place (``/=`` on a piece of topk's result)."""

    def forward(self, logits):
        weights, experts = torch.topk(logits.softmax(-1), 2, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return weights * 2, experts


def test_an_inplace_op_on_a_fresh_piece_of_a_multi_output_op_becomes_out_of_place():
    x = torch.randn(5, 8)
    graph = stof_cc.trace(_Router(), (x,))
    functional, refused = functionalize(graph)
    assert mutating_nodes(graph) and not refused and not mutating_nodes(functional)
    for got, want in zip(stof_cc.interpret(functional, x), _Router()(x), strict=True):
        torch.testing.assert_close(got, want)
