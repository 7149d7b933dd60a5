"""recognise_attention: SDPA and the hand-written chain become one `attention` node; values unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree

from stof_cc import interpret, trace
from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec, assert_structural_equal
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
    # masked_fill(-inf) then softmax: a row with every key hidden is NaN in the model, and stays so
    assert node.kwargs == {"scale": 1 / 8.0, "is_causal": False, "empty_rows": "nan"}
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


# -- before / expected ---------------------------------------------------------------------

_QKV = TensorSpec((2, 3, 16, 8), torch.float32)


def _qkv_graph(before: Graph, *masks: tuple[str, TensorSpec]) -> Graph:
    """An expected graph with inputs q, k, v (and masks) as in ``before``, its pytree specs too."""
    expected = Graph()
    expected.in_spec, expected.out_spec = before.in_spec, before.out_spec
    for name in ("q", "k", "v"):
        expected.add_input(name, _QKV)
    for name, spec in masks:
        expected.add_input(name, spec)
    return expected


def test_before_expected_chain_with_a_runtime_hidden_mask():
    before = canonicalize(trace(_Chain(), _inputs()))  # matmul(q, k^T) / 8, masked_fill(hidden, -inf), softmax, matmul
    expected = _qkv_graph(before, ("hidden", TensorSpec((2, 1, 16, 16), torch.bool)))
    expected.add_node(Node("allowed", "logical_not", "aten.logical_not.default", (Ref("hidden"),),
                           spec=TensorSpec((2, 1, 16, 16), torch.bool)))
    expected.add_node(Node("out", "attention", None, (Ref("q"), Ref("k"), Ref("v"), Ref("allowed")),
                           {"scale": 0.125, "is_causal": False, "empty_rows": "nan"}, _QKV))
    expected.outputs = [Ref("out")]
    assert_structural_equal(recognise_attention(before), expected)


class _CausalChain(torch.nn.Module):
    """GPT-2's form: a constant triangle of hidden positions, scores multiplied by a number."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("hidden", torch.ones(16, 16, dtype=torch.bool).triu(1))

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(-2, -1)) * 0.25
        return torch.matmul(torch.softmax(scores.masked_fill(self.hidden, float("-inf")), dim=-1), v)


def test_before_expected_constant_triangle_becomes_is_causal():
    before = canonicalize(trace(_CausalChain(), _inputs()[:3]))
    expected = _qkv_graph(before)  # the triangle constant is gone: no mask operand
    expected.add_node(Node("out", "attention", None, (Ref("q"), Ref("k"), Ref("v"), None),
                           {"scale": 0.25, "is_causal": True}, _QKV))
    expected.outputs = [Ref("out")]
    assert_structural_equal(recognise_attention(before), expected)


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_before_expected_sdpa_keeps_its_mask_and_gets_its_scale():
    args = (*_inputs()[:3], torch.randn(2, 1, 16, 16))  # a floating mask: added to the scores
    before = trace(_Sdpa(), args)
    expected = _qkv_graph(before, ("mask", TensorSpec((2, 1, 16, 16), torch.float32)))
    expected.add_node(Node("out", "attention", None, (Ref("q"), Ref("k"), Ref("v"), Ref("mask")),
                           {"scale": 1.0 / math.sqrt(8), "is_causal": False}, _QKV))
    expected.outputs = [Ref("out")]
    assert_structural_equal(recognise_attention(before), expected)


class _DropoutSdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


@pytest.mark.parametrize("module, arity", [(_Chain(leak=True), 4), (_DropoutSdpa(), 3)],
                         ids=["probabilities_read_elsewhere", "sdpa_with_dropout"])
def test_before_expected_attention_that_is_not_the_form_is_unchanged(module, arity):
    before = canonicalize(trace(module, _inputs()[:arity]))
    assert_structural_equal(recognise_attention(before), before, map_free_names=False)


class BatchedAlibi(torch.nn.Module):
    """BLOOM's eager attention: [B*H, S, D] views, baddbmm adding ALiBi, an fp32 softmax cast back."""

    def forward(self, q, k, v, alibi, mask):
        b, h, s, d = q.shape
        scores = torch.baddbmm(alibi, q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(-1, -2),
                               beta=0.5, alpha=0.125)
        probs = torch.softmax(scores.view(b, h, s, s) + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs.view(b * h, s, s), v.reshape(b * h, s, d)).view(b, h, s, d)


def test_batched_chain_with_an_added_bias_becomes_one_node_with_the_bias_as_an_operand():
    b, h, s, d = 2, 3, 8, 16
    inputs = (torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d),
              torch.randn(b * h, 1, s), torch.randn(b, 1, s, s))
    graph = canonicalize(trace(BatchedAlibi(), inputs, {}))
    result = recognise_attention(graph)
    (node,) = _attention_nodes(result)
    assert [a.name for a in node.args[:4]] == ["q", "k", "v", "mask"] and node.kwargs["scale"] == 0.125
    scaled = result.node(node.kwargs["bias"].name)  # alibi viewed as [B, H, 1, S], times beta
    assert (scaled.op, scaled.args[1]) == ("mul", 0.5)
    view = result.node(scaled.args[0].name)
    assert (view.op, view.args[0].name, view.spec.shape) == ("view", "alibi", (b, h, 1, s))
    assert not {"baddbmm", "bmm", "softmax"} & set(result.op_histogram())
    assert _close(interpret(result, *inputs), BatchedAlibi()(*inputs))


class SoftcappedUnderFill(torch.nn.Module):
    """Gemma 2's capped scores, then MPT's finite fill of hidden keys over an added bias."""

    def __init__(self, cap: float | None, fill: float) -> None:
        super().__init__()
        self.cap, self.fill = cap, fill

    def forward(self, q, k, v, bias, hidden):
        scores = torch.matmul(q, k.transpose(-1, -2)) * 0.25
        if self.cap is not None:
            scores = torch.tanh(scores / self.cap) * self.cap
        scores = (scores + bias).masked_fill(hidden, self.fill)
        return torch.matmul(torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("cap, fill, empty", [(None, -3.0e38, "mean"), (30.0, float("-inf"), "nan"),
                                              (30.0, -65504.0, "mean")])
def test_softcap_finite_fills_and_a_bias_under_the_fill_are_kept_on_the_node(cap, fill, empty):
    b, h, s, d = 2, 3, 8, 16
    hidden = torch.rand(b, 1, s, s) < 0.3
    hidden[0, 0, 2] = True  # a row with every key hidden
    inputs = (torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(1, h, 1, s),
              hidden)
    module = SoftcappedUnderFill(cap, fill)
    result = recognise_attention(canonicalize(trace(module, inputs, {})))
    (node,) = _attention_nodes(result)
    assert node.kwargs.get("softcap") == cap and node.kwargs["empty_rows"] == empty and node.kwargs["scale"] == 0.25
    assert node.kwargs["bias"].name == "bias" and not {"softmax", "tanh", "masked_fill"} & set(result.op_histogram())
    got, want = interpret(result, *inputs), module(*inputs)
    torch.testing.assert_close(got, want, equal_nan=True)


class ScaledOperands(torch.nn.Module):
    """GPT-NeoX / Falcon style: the scale written on q (and on k), not on the scores."""

    def __init__(self, batched: bool) -> None:
        super().__init__()
        self.batched = batched

    def forward(self, q, k, v, alibi):
        b, h, s, d = q.shape
        q, k = q / 4.0, k * 0.5
        if self.batched:  # with baddbmm's bias: the bias is not scaled by q's scale
            scores = torch.baddbmm(alibi, q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(1, 2),
                                   beta=2.0, alpha=1.0).view(b, h, s, s)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2))
        return torch.matmul(torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("batched", [False, True])
def test_a_scale_written_on_q_or_k_is_the_nodes_scale(batched):
    b, h, s, d = 2, 3, 8, 16
    inputs = (torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(b * h, 1, s))
    module = ScaledOperands(batched)
    result = recognise_attention(canonicalize(trace(module, inputs, {})))
    (node,) = _attention_nodes(result)
    assert node.kwargs["scale"] == 0.125 and [a.name for a in node.args[:2]] == ["q", "k"]
    histogram = result.op_histogram()  # q's and k's scaling gone; the bias keeps its own (beta)
    assert "div" not in histogram and histogram.get("mul", 0) == (1 if batched else 0), histogram
    torch.testing.assert_close(interpret(result, *inputs), module(*inputs))


class _WrittenOut(torch.nn.Module):
    """softmax(scores) @ v with the scores written as ``kind`` says (a review's cases)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, m):
        if self.kind == "add alpha":  # the mask added at half weight
            scores = torch.add(q @ k.transpose(-1, -2), m, alpha=0.5)
        elif self.kind == "floor div scores":
            scores = torch.div(q @ k.transpose(-1, -2), 0.5, rounding_mode="floor")
        elif self.kind == "floor div q":
            scores = torch.div(q * 4, 2, rounding_mode="floor") @ k.transpose(-1, -2)
        else:  # k^T written as a permute
            scores = q @ k.permute(0, 1, 3, 2) * 0.25
        return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("kind", ["add alpha", "floor div scores", "floor div q", "permute"])
def test_scores_that_are_not_a_scale_and_a_mask_keep_their_meaning(kind):
    """add(s, m, alpha) and a div with a rounding mode are not the node's mask and scale (they were
    taken as such: wrong answers); a permute of k's last two dims is its transpose (it crashed)."""
    inputs = (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 8))
    module = _WrittenOut(kind)
    result = recognise_attention(canonicalize(trace(module, inputs, {})))
    torch.testing.assert_close(interpret(result, *inputs), module(*inputs))
    nodes = _attention_nodes(result)
    assert len(nodes) == (0 if kind in ("add alpha", "floor div scores") else 1)
    if kind == "floor div q":  # attention over the floored q, not over q with a scale
        assert nodes[0].kwargs["scale"] == 1.0 and result.node(nodes[0].args[0].name).op == "div"
