"""Structural tests of the IR: building, verifying, printing, copying, determinism."""

from __future__ import annotations

import pytest
import torch

from stof_cc.ir.graph import Graph, GraphError, Node, Ref, TensorSpec


def _linear_graph() -> Graph:
    g = Graph("tiny")
    g.add_input("x", TensorSpec((2, 3), torch.float32))
    g.add_constant("w", torch.randn(4, 3))
    g.add_node(Node("y", "linear", "aten.linear.default", (Ref("x"), Ref("w")), spec=TensorSpec((2, 4), torch.float32)))
    g.add_node(Node("z", "relu", "aten.relu.default", (Ref("y"),), spec=TensorSpec((2, 4), torch.float32)))
    g.outputs = [Ref("z")]
    return g


def test_build_verify_and_print():
    g = _linear_graph()
    g.verify()
    text = str(g)
    assert "%y: f32[2,4] = linear(%x, %w)" in text
    assert text.strip().endswith("return %z")
    assert [n.name for n in g.nodes()] == ["x", "w", "y", "z"]
    assert [u.name for u in g.users("y")] == ["z"]
    assert [p.name for p in g.producers("y")] == ["x", "w"]
    dot = g.to_dot()
    assert dot.startswith('digraph "tiny"') and '"y" -> "z";' in dot and "[gemm]" in dot


def test_verify_names_node_with_wrong_spec():
    g = _linear_graph()
    g.node("y").spec = TensorSpec((2, 5), torch.float32)
    with pytest.raises(GraphError, match=r"%y \(linear\).*f32\[2,5\].*f32\[2,4\]"):
        g.verify()


def test_verify_names_node_with_wrong_dtype():
    g = _linear_graph()
    g.node("z").spec = TensorSpec((2, 4), torch.float16)
    with pytest.raises(GraphError, match=r"%z \(relu\)"):
        g.verify()


def test_undefined_input_is_refused_when_added():
    g = Graph()
    with pytest.raises(GraphError, match=r"%y reads %nope"):
        g.add_node(Node("y", "relu", "aten.relu.default", (Ref("nope"),)))


def test_duplicate_name_is_refused():
    g = _linear_graph()
    with pytest.raises(GraphError, match=r"%y is defined twice"):
        g.add_node(Node("y", "relu", "aten.relu.default", (Ref("x"),)))


def test_verify_finds_cycle_made_by_editing_args():
    g = _linear_graph()
    g.node("y").args = (Ref("z"), Ref("w"))  # y now reads z, which reads y
    with pytest.raises(GraphError, match="cycle"):
        g.verify()


def test_verify_needs_outputs_and_constant_tensors():
    g = _linear_graph()
    g.outputs = []
    with pytest.raises(GraphError, match="no outputs"):
        g.verify()
    g = _linear_graph()
    g.constants["w"] = torch.randn(4, 4)
    with pytest.raises(GraphError, match=r"constant %w"):
        g.verify()


def test_copy_is_independent():
    g = _linear_graph()
    c = g.copy()
    c.node("z").op = "gelu"
    c.outputs.append(Ref("y"))
    assert g.node("z").op == "relu" and g.outputs == [Ref("z")]
    assert c.constants["w"] is g.constants["w"]


def test_fresh_name():
    g = _linear_graph()
    assert g.fresh_name("q") == "q"
    assert g.fresh_name("y") == "y_1"


def test_unknown_node_lookup_names_it():
    with pytest.raises(GraphError, match=r"%missing"):
        _linear_graph().node("missing")
