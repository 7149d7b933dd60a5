"""canonicalize: identities bypassed, checks dropped, constants folded, dead code removed; values unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from stof_cc import interpret, trace
from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec, assert_structural_equal
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
    assert "in-place ops" in str(report)
    assert_structural_equal(result, graph, map_free_names=False)
    assert torch.equal(interpret(result, x), _FilledMask()(x))


# -- before / expected ---------------------------------------------------------------------


def _f32(*shape: int) -> TensorSpec:
    return TensorSpec(shape, torch.float32)


def test_before_expected_identities_bypassed_constants_folded_dead_code_removed():
    module, x = _Block().eval(), torch.randn(2, 8, 16)
    before = trace(module, (x,))  # arange, unsqueeze, mul, linear, dropout, assert, cast, unsqueeze, add
    expected = Graph()
    expected.in_spec, expected.out_spec = before.in_spec, before.out_spec
    expected.add_constant("weight", module.proj.weight.detach(), "proj.weight")
    expected.add_constant("bias", module.proj.bias.detach(), "proj.bias")
    expected.add_input("x", _f32(2, 8, 16))
    expected.add_node(Node("linear", "linear", "aten.linear.default", (Ref("x"), Ref("weight"), Ref("bias")),
                           spec=_f32(2, 8, 16)))
    # arange -> unsqueeze -> mul -> unsqueeze(-1), folded into one constant where the last one was
    expected.add_constant("positions", (torch.arange(8) * 2).view(1, 8, 1))
    expected.add_node(Node("add", "add", "aten.add.Tensor", (Ref("linear"), Ref("positions")), spec=_f32(2, 8, 16)))
    expected.outputs = [Ref("add")]
    assert_structural_equal(canonicalize(before), expected)


class _Plain(torch.nn.Module):
    """Nothing to bypass, fold or remove."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * y


def test_before_expected_a_canonical_graph_is_unchanged():
    before = trace(_Plain(), (torch.randn(2, 3), torch.randn(2, 3)))
    expected = Graph()
    expected.in_spec, expected.out_spec = before.in_spec, before.out_spec
    expected.add_input("x", _f32(2, 3))
    expected.add_input("y", _f32(2, 3))
    expected.add_node(Node("relu", "relu", "aten.relu.default", (Ref("x"),), spec=_f32(2, 3)))
    expected.add_node(Node("mul", "mul", "aten.mul.Tensor", (Ref("relu"), Ref("y")), spec=_f32(2, 3)))
    expected.outputs = [Ref("mul")]
    assert_structural_equal(before, expected, map_free_names=False)
    assert_structural_equal(canonicalize(before), expected, map_free_names=False)


def test_constants_keep_their_qualified_names():
    before = trace(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    assert before.nodes()[0].target == "weight"
    assert_structural_equal(canonicalize(before), before)


class _QkvSplit(torch.nn.Module):
    """Falcon's multi-query split: x[..., [-2], :] picks one head by a constant index list."""

    def forward(self, x):
        return x[..., :-2, :] * 2, x[..., [-2], :] + 1, torch.cat((x[..., :0, :], x[..., [-1], :]), dim=-2)


def test_an_index_by_a_run_of_integers_is_a_slice_and_empty_pieces_leave_a_cat():
    x = torch.randn(2, 5, 6, 4)
    graph = canonicalize(trace(_QkvSplit(), (x,)))
    assert "gather" not in graph.op_histogram()
    # the cat left with one piece stays a copy: it is an output, and its piece a view of the input x (dropped,
    # the output shared the caller's storage: found by review)
    (cat,) = [n for n in graph.nodes() if n.op == "cat"]
    assert len(cat.args[0]) == 1
    fresh = torch.randn(2, 5, 6, 4)
    for got, want in zip(interpret(graph, fresh), _QkvSplit()(fresh), strict=True):
        torch.testing.assert_close(got, want)


class _Pooling(torch.nn.Module):
    """Sentence-embedding mean pooling over tokens, and other reductions over a middle dimension."""

    def forward(self, x, mask):
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return pooled, x.amax(dim=1, keepdim=True), torch.var(x, dim=0, correction=0), x.mean(-1)


def test_a_reduction_over_a_middle_dim_is_one_over_the_last_dim_of_a_permuted_view():
    x, mask = torch.randn(40, 64, 4), (torch.rand(40, 64) > 0.3).float()
    graph = canonicalize(trace(_Pooling(), (x, mask)))
    for node in graph.nodes():
        if node.op in ("sum", "mean", "amax", "var"):
            rank = len(graph.node(node.args[0].name).spec.shape)
            assert node.args[1] in ([-1], [rank - 1]), node
    fresh = (torch.randn(40, 64, 4), (torch.rand(40, 64) > 0.3).float())
    for got, want in zip(interpret(graph, *fresh), _Pooling()(*fresh), strict=True):
        torch.testing.assert_close(got, want)


def test_a_reduction_over_a_short_middle_dim_is_left_to_torch():
    """An MoE's sum over its experts per token ([T, 2, H].sum(1)): rows of 2 elements H apart, which
    row_reduce read at a thousandth of torch's rate; the node stays as the model wrote it."""
    x, mask = torch.randn(2, 6, 4), (torch.rand(2, 6) > 0.3).float()
    graph = canonicalize(trace(_Pooling(), (x, mask)))
    reductions = [n for n in graph.nodes() if n.op in ("sum", "mean", "amax", "var")]
    assert [n.args[1] for n in reductions if n.op != "mean"] == [[1], [1], [1], [0]]
    assert not any(n.name.endswith("_moved") for n in graph.nodes())
    for got, want in zip(interpret(graph, x, mask), _Pooling()(x, mask), strict=True):
        torch.testing.assert_close(got, want)


@torch.library.custom_op("stof_cc_tests::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_doubled.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _AddsIntoACustomOpsOutput(torch.nn.Module):
    """GPT-OSS's experts: a custom op's fresh output with a bias added in place."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.stof_cc_tests.doubled(x)
        y.add_(self.bias)
        return y.relu()


def test_an_in_place_op_on_a_custom_ops_output_is_made_functional():
    """A custom op's schema says its output is fresh (no alias annotation): the add is made
    out-of-place. Before, every op outside ATen counted as a view, the graph kept its mutation,
    and a compiled GPT-OSS ran every group in torch."""
    module, x = _AddsIntoACustomOpsOutput().eval(), torch.randn(3, 4)
    graph = trace(module, (x,))
    assert any(n.target == "aten.add_.Tensor" for n in graph.nodes())
    report = CanonicalizeReport()
    result = canonicalize(graph, report=report)
    assert "in-place ops" not in str(report)
    assert not any(n.target is not None and n.target.endswith("_.Tensor") for n in result.nodes())
    with torch.no_grad():
        assert torch.equal(interpret(result, x), module(x))


class _ClampedAfterAConversion(torch.nn.Module):
    """transformers 5.17's MoE routing: expert ids converted to float, then clamped in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.argsort(x, dim=-1)
        as_float = ids.to(torch.float32)
        ids.clamp_(max=2)
        return as_float + ids


def test_a_conversion_to_another_dtype_is_a_copy_not_a_view():
    """``.to(float32)`` of int64 ids reads them before the clamp and holds its own copy: the clamp is
    made functional. Before, every cast counted as a possible view and the graph kept its mutation."""
    x = torch.randn(3, 5)
    graph = trace(_ClampedAfterAConversion(), (x,))
    report = CanonicalizeReport()
    result = canonicalize(graph, report=report)
    assert "in-place ops" not in str(report)
    assert torch.equal(interpret(result, x), _ClampedAfterAConversion()(x))


@torch.library.custom_op("stof_cc_tests::scaled_in_place", mutates_args=("y",))
def _scaled_in_place(y: torch.Tensor) -> None:
    y.mul_(10)


@_scaled_in_place.register_fake
def _(y: torch.Tensor) -> None:
    return None


class _WritesThroughACustomOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        torch.ops.stof_cc_tests.scaled_in_place(h)
        return h + 1


def test_a_custom_op_that_writes_its_input_counts_as_in_place():
    """Its schema says it mutates (found by review: one that returns nothing was dropped as dead, the write
    lost). The graph is left as it is, and computes what eager does."""
    x = torch.randn(3, 4)
    graph = trace(_WritesThroughACustomOp(), (x,))
    report = CanonicalizeReport()
    result = canonicalize(graph, report=report)
    assert "in-place ops" in str(report)
    assert torch.equal(interpret(result, x), _WritesThroughACustomOp()(x))
