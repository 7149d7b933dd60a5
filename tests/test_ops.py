"""The op registry: kinds, aliases, shape rules from the torch reference."""

from __future__ import annotations

import pytest
import torch

from stof_cc.ir.graph import Graph, GraphError, Node, Ref, TensorSpec
from stof_cc.ir.ops import (
    OPAQUE,
    PATTERN_KINDS,
    OpDef,
    all_ops,
    canonical_op,
    infer_spec,
    pattern_kind,
    register_op,
    resolve_target,
)


def test_every_op_has_a_known_kind_and_resolvable_aliases():
    for op in all_ops():
        assert op.kind in PATTERN_KINDS
        for packet in op.aten:
            assert canonical_op(packet) == op.name
            assert resolve_target(packet) is not None


@pytest.mark.parametrize(
    ("target", "op", "kind"),
    [
        ("aten.add.Tensor", "add", "broadcast"),
        ("aten.add.Scalar", "add", "broadcast"),
        ("aten.add_.Tensor", "add", "broadcast"),
        ("aten.linear.default", "linear", "gemm"),
        ("aten.matmul.default", "matmul", "gemm"),
        ("aten.softmax.int", "softmax", "reduction"),
        ("aten.layer_norm.default", "layer_norm", "reduction"),
        ("aten.gelu.default", "gelu", "elementwise"),
        ("aten.view.default", "view", "injective"),
        ("aten.permute.default", "transpose", "injective"),
        ("aten.scaled_dot_product_attention.default", "scaled_dot_product_attention", "attention"),
        ("operator.getitem", "getitem", "injective"),
        ("aten.cumsum.default", OPAQUE, OPAQUE),
    ],
)
def test_aliases_normalise_to_one_op(target, op, kind):
    assert canonical_op(target) == op
    assert pattern_kind(op) == kind


def test_registration_errors():
    with pytest.raises(ValueError, match="already registered"):
        register_op(OpDef("linear", "gemm"))
    with pytest.raises(ValueError, match="unknown pattern kind"):
        register_op(OpDef("new_op", "fancy"))
    with pytest.raises(ValueError, match="already belongs to 'add'"):
        register_op(OpDef("plus", "broadcast", ("aten.add",)))


def test_resolve_target_errors_name_the_target():
    with pytest.raises(GraphError, match="aten.no_such_op.default"):
        resolve_target("aten.no_such_op.default")


def test_shape_rule_comes_from_the_reference():
    g = Graph()
    g.add_input("a", TensorSpec((4, 1, 8), torch.float16))
    g.add_input("b", TensorSpec((3, 8), torch.float16))
    add = g.add_node(Node("c", "add", "aten.add.Tensor", (Ref("a"), Ref("b"))))
    assert infer_spec(g, add) == TensorSpec((4, 3, 8), torch.float16)
    bad = g.add_node(Node("d", "matmul", "aten.matmul.default", (Ref("a"), Ref("b"))))
    with pytest.raises(GraphError, match=r"%d \(matmul"):
        infer_spec(g, bad)


def test_a_dtype_only_the_cpu_kernel_lacks_still_has_a_shape():
    """transformers' MoE routing (5.17) takes the histogram of int32 expert ids, which CUDA computes and
    the CPU kernel refuses: the shape rule, run on CPU fakes, failed a GPU model's compile."""
    g = Graph()
    g.add_input("ids", TensorSpec((512,), torch.int32))
    histc = g.add_node(Node("h", OPAQUE, "aten.histc.default", (Ref("ids"), 8, 0, 7)))
    assert infer_spec(g, histc) == TensorSpec((8,), torch.int32)


def test_a_view_as_another_dtype_is_opaque_not_a_reshape():
    """x.view(torch.int32) reinterprets bits: taken as a reshape, a kernel converted every value."""
    from stof_cc import trace
    from stof_cc.passes import canonicalize

    assert canonical_op("aten.view.dtype") == OPAQUE and canonical_op("aten.view.default") == "view"

    class Bits(torch.nn.Module):
        def forward(self, x):
            return (x * 2).view(torch.int32) + 1

    graph = canonicalize(trace(Bits(), (torch.randn(4, 8),), {}))
    assert [n.op for n in graph.nodes() if (n.target or "").startswith("aten.view")] == [OPAQUE]
