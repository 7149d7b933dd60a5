"""canonicalize: identities bypassed, checks dropped, constants folded, dead code removed; values unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from stof_cc import interpret, trace
from stof_cc.loading import load_factory
from stof_cc.passes import CanonicalizeReport, canonicalize


def _tensors(value):
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _same_outputs(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b), strict=True))


@pytest.mark.parametrize("example", ["tiny_bert", "gpt2_block", "encoder_layer"])
def test_examples_compute_the_same_after_canonicalize(example, example_path):
    module, args, kwargs = load_factory(example_path(example))
    graph = trace(module, args, kwargs)
    before = str(graph)
    report = CanonicalizeReport()
    result = canonicalize(graph, report=report)
    result.verify()
    assert str(graph) == before, "the pass must not modify its input"
    assert len(result) < len(graph)
    assert not {"dropout", "assert_metadata"} & set(result.op_histogram())
    with torch.no_grad():
        assert _same_outputs(interpret(graph, *args, **kwargs), interpret(result, *args, **kwargs))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1]).unsqueeze(0) * 2  # depends on no input value
        y = self.drop(self.proj(x)).to(torch.float32)           # dropout (eval) and a no-op cast
        return y + positions.unsqueeze(-1)


def test_structure_after_canonicalize():
    module, x = _Block().eval(), torch.randn(2, 8, 16)
    graph = trace(module, (x,))
    report = CanonicalizeReport()
    result = canonicalize(graph, report=report)
    ops = result.op_histogram()
    assert "dropout" not in ops and "cast" not in ops and "arange" not in ops
    assert ops.get("linear") == 1 and report.folded and report.identities and report.dead
    assert "nodes folded to constants" in str(report)
    with torch.no_grad():
        assert torch.equal(interpret(result, x), module(x))


def test_fold_limit_keeps_large_results_computed():
    graph = trace(_Block().eval(), (torch.randn(2, 8, 16),))
    report = CanonicalizeReport()
    result = canonicalize(graph, fold_limit=0, report=report)
    assert report.folded == [] and "arange" in result.op_histogram()


class _FilledMask(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(4, 4)
        mask[:, :2] = 1  # export keeps this as an in-place fill_ on a slice
        return x + mask


def test_graphs_with_in_place_ops_are_left_alone():
    x = torch.randn(4, 4)
    graph = trace(_FilledMask(), (x,))
    report = CanonicalizeReport()
    result = canonicalize(graph, report=report)
    assert "in-place ops" in str(report) and str(result) == str(graph)
    assert torch.equal(interpret(result, x), _FilledMask()(x))
