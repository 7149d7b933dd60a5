"""recognise_attention: SDPA and the hand-written chain become one `attention` node; values unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from stof_cc import interpret, trace
from stof_cc.loading import load_factory
from stof_cc.passes import AttentionReport, canonicalize, recognise_attention


def _close(a, b) -> bool:
    pairs = zip(pytree.tree_leaves(a), pytree.tree_leaves(b), strict=True)
    return all(torch.allclose(x, y, atol=1e-5, rtol=1e-5) for x, y in pairs if isinstance(x, torch.Tensor))


def _attention_nodes(graph):
    return [n for n in graph.nodes() if n.op == "attention"]


@pytest.mark.parametrize("example, count, causal", [("tiny_bert", 2, False), ("gpt2_block", 1, True),
                                                     ("encoder_layer", 1, False)])
def test_examples(example, count, causal, example_path):
    module, args, kwargs = load_factory(example_path(example))
    graph = canonicalize(trace(module, args, kwargs))
    before = str(graph)
    report = AttentionReport()
    result = recognise_attention(graph, report=report)
    result.verify()
    assert str(graph) == before, "the pass must not modify its input"
    nodes = _attention_nodes(result)
    assert len(nodes) == count == len(report.matched)
    assert all(n.kwargs["is_causal"] == causal for n in nodes)
    if causal:  # GPT-2's constant triangle became is_causal, with no mask operand
        assert all(n.args[3] is None for n in nodes) and "softmax" not in result.op_histogram()
    with torch.no_grad():
        assert _close(interpret(graph, *args, **kwargs), interpret(result, *args, **kwargs))


class _Chain(torch.nn.Module):
    """Hand-written attention hiding positions by a runtime mask; optionally leaking the probabilities."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.leak = leak

    def forward(self, q, k, v, hidden):
        scores = torch.matmul(q, k.transpose(-2, -1)) / 8.0
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out = torch.matmul(probs, v)
        return (out, probs) if self.leak else out


def _inputs():
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    hidden = torch.rand(2, 1, 16, 16) < 0.3
    hidden[..., 0] = False  # every row keeps one key: no NaN rows
    return q, k, v, hidden


def test_runtime_hidden_mask_is_negated():
    args = _inputs()
    graph = canonicalize(trace(_Chain(), args))
    result = recognise_attention(graph)
    (node,) = _attention_nodes(result)
    assert node.kwargs == {"scale": 1 / 8.0, "is_causal": False}
    assert result.node(node.args[3].name).op == "logical_not"
    with torch.no_grad():
        assert _close(interpret(result, *args), _Chain()(*args))


def test_probabilities_read_elsewhere_are_not_rewritten():
    args = _inputs()
    report = AttentionReport()
    result = recognise_attention(canonicalize(trace(_Chain(leak=True), args)), report=report)
    assert not _attention_nodes(result)
    assert "read elsewhere" in str(report)


def test_sdpa_default_scale_becomes_explicit():
    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    args = _inputs()[:3]
    (node,) = _attention_nodes(recognise_attention(trace(Sdpa(), args)))
    assert node.kwargs == {"scale": pytest.approx(8 ** -0.5), "is_causal": True}
