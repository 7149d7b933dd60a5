"""Structural tests of the IR: building, verifying, printing, copying, determinism, structural equality."""

from __future__ import annotations

import pytest
import torch

from stof_cc.ir.frontend import trace
from stof_cc.ir.graph import (
    Graph,
    GraphError,
    Node,
    Ref,
    TensorSpec,
    assert_structural_equal,
    structural_equal,
)


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


def test_a_fresh_name_during_rebuild_avoids_the_source_graphs_later_names():
    """A pass adding a node before y under a fresh name "z" must not take the name of the
    source's later node z (its add would then fail as defined twice)."""
    g = _linear_graph()

    def rewrite(node: Node, out: Graph) -> Node:
        if node.name == "y":
            extra = out.add_node(Node(out.fresh_name("z"), "relu", "aten.relu.default", (Ref("x"),),
                                      spec=TensorSpec((2, 3), torch.float32)))
            assert extra.name == "z_1"
        return node

    rebuilt = g.rebuild(rewrite)
    assert [n.name for n in rebuilt.nodes()] == ["x", "w", "z_1", "y", "z"]
    assert rebuilt.fresh_name("z_2") == "z_2"  # the reservation ends with the rebuild


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


# -- structural equality ---------------------------------------------------------------------


def _renamed_linear_graph() -> Graph:
    """`_linear_graph` with every node under another name and the same weight values."""
    g = Graph("other")
    g.add_input("inp", TensorSpec((2, 3), torch.float32))
    g.add_constant("weight", _linear_graph().constants["w"].clone())
    g.add_node(Node("mm", "linear", "aten.linear.default", (Ref("inp"), Ref("weight")), spec=TensorSpec((2, 4), torch.float32)))
    g.add_node(Node("act", "relu", "aten.relu.default", (Ref("mm"),), spec=TensorSpec((2, 4), torch.float32)))
    g.outputs = [Ref("act")]
    return g


def test_equal_copies_are_structurally_equal():
    g = _linear_graph()
    assert structural_equal(g, g) and structural_equal(g, g.copy())
    assert_structural_equal(g.copy(), g)
    traced_module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    x = torch.randn(2, 3)
    assert_structural_equal(trace(traced_module, (x,)), trace(traced_module, (x,)))  # in_spec/out_spec too


def test_renamed_nodes_are_equal_unless_names_must_match():
    torch.manual_seed(0)  # _linear_graph draws its weight: both calls must draw the same one
    g = _linear_graph()
    torch.manual_seed(0)
    renamed = _renamed_linear_graph()
    assert structural_equal(g, renamed)
    assert not structural_equal(g, renamed, map_free_names=False)
    with pytest.raises(AssertionError, match=r"%x and %inp differ: names differ"):
        assert_structural_equal(g, renamed, map_free_names=False)


def _changed(edit) -> Graph:
    torch.manual_seed(0)
    g = _linear_graph()
    edit(g)
    return g


@pytest.mark.parametrize("edit, message", [
    (lambda g: setattr(g.node("z"), "op", "gelu"), r"%z and %z differ: op 'relu' against 'gelu'"),
    (lambda g: setattr(g.node("z"), "target", "aten.gelu.default"), r"%z and %z differ: target"),
    (lambda g: setattr(g.node("y"), "spec", TensorSpec((2, 4), torch.float16)), r"%y and %y differ: spec f32\[2,4\] against f16\[2,4\]"),
    (lambda g: setattr(g.node("y"), "args", (Ref("w"), Ref("x"))), r"%y and %y differ: arg 0: %x against %w"),
    (lambda g: setattr(g.node("z"), "kwargs", {"inplace": False}), r"%z and %z differ: kwargs \[\] against \['inplace'\]"),
    (lambda g: g.constants.__setitem__("w", g.constants["w"] + 1), r"%w and %w differ: tensor values differ first at \[0, 0\]"),
    (lambda g: g.constants.__setitem__("w", g.constants["w"].double()), r"%w and %w differ: tensor f32\[4,3\] against f64\[4,3\]"),
    (lambda g: setattr(g, "outputs", [Ref("y")]), r"output 0: %z against %y"),
    (lambda g: setattr(g, "outputs", [Ref("z"), Ref("y")]), r"1 outputs against 2"),
    (lambda g: g.add_node(Node("t", "tanh", "aten.tanh.default", (Ref("z"),), spec=TensorSpec((2, 4), torch.float32))),
     r"rhs has 1 more node\(s\), from %t"),
    (lambda g: setattr(g, "out_spec", "a tuple"), r"out_spec differs"),
])
def test_a_change_makes_graphs_unequal_and_the_message_names_it(edit, message):
    same, changed = _changed(lambda g: None), _changed(edit)
    assert structural_equal(same, _changed(lambda g: None))
    assert not structural_equal(same, changed)
    with pytest.raises(AssertionError, match=message):
        assert_structural_equal(same, changed)


def test_output_order_matters():
    a, b = _linear_graph(), _linear_graph()
    b.constants["w"] = a.constants["w"]
    a.outputs, b.outputs = [Ref("y"), Ref("z")], [Ref("z"), Ref("y")]
    assert structural_equal(a, a.copy()) and not structural_equal(a, b)


def test_literals_compare_by_type_and_value():
    def graph(size, dim=-1, nan=float("nan")) -> Graph:
        g = Graph()
        g.add_input("x", TensorSpec((2, 6), torch.float32))
        g.add_node(Node("v", "view", "aten.view.default", (Ref("x"), size), spec=TensorSpec((2, 2, 3), torch.float32)))
        g.add_node(Node("s", "softmax", "aten._softmax.default", (Ref("v"), dim, False), spec=TensorSpec((2, 2, 3), torch.float32)))
        g.add_node(Node("f", "add", "aten.add.Scalar", (Ref("s"), nan), spec=TensorSpec((2, 2, 3), torch.float32)))
        g.outputs = [Ref("f")]
        return g

    assert structural_equal(graph([2, 2, 3]), graph([2, 2, 3]))  # NaN literals are the same literal
    assert not structural_equal(graph([2, 2, 3]), graph((2, 2, 3)))  # a list is not a tuple
    assert not structural_equal(graph([2, 2, 3]), graph([2, 2, 3], dim=-1.0))  # int is not float
    assert not structural_equal(graph([2, 2, 3]), graph([2, 2, 3], dim=True))  # nor bool
    assert not structural_equal(graph([2, 2, 3]), graph([2, 2, 3], nan=0.0))
    with pytest.raises(AssertionError, match=r"%v and %v differ: arg 1: \[2\]: 3 against 4"):
        assert_structural_equal(graph([2, 2, 3]), graph([2, 2, 4]))


def test_kwargs_order_and_constant_identity_do_not_matter():
    def graph(kwargs, weight) -> Graph:
        g = Graph()
        g.add_input("x", TensorSpec((2, 3), torch.float32))
        g.add_constant("w", weight)
        g.add_node(Node("y", "linear", "aten.linear.default", (Ref("x"),), dict(kwargs, weight=Ref("w")),
                        TensorSpec((2, 4), torch.float32)))
        g.outputs = [Ref("y")]
        return g

    weight = torch.randn(4, 3)
    assert structural_equal(graph({"bias": None}, weight), graph({"bias": None}, weight.clone()))
    a = graph({"bias": None}, weight)
    b = Graph()
    b.add_input("x", TensorSpec((2, 3), torch.float32))
    b.add_constant("w", weight.clone())
    b.add_node(Node("y", "linear", "aten.linear.default", (Ref("x"),), {"weight": Ref("w"), "bias": None},
                    TensorSpec((2, 4), torch.float32)))
    b.outputs = [Ref("y")]
    assert structural_equal(a, b)


def test_independent_nodes_must_come_in_the_same_order():
    """Node order is part of the structure: it is what prints, hashes and names kernels."""
    def graph(first: str) -> Graph:
        g = Graph()
        g.add_input("x", TensorSpec((4,), torch.float32))
        ops = {"relu": "aten.relu.default", "tanh": "aten.tanh.default"}
        second = "tanh" if first == "relu" else "relu"
        for op in (first, second):
            g.add_node(Node(op, op, ops[op], (Ref("x"),), spec=TensorSpec((4,), torch.float32)))
        g.add_node(Node("sum", "add", "aten.add.Tensor", (Ref("relu"), Ref("tanh")), spec=TensorSpec((4,), torch.float32)))
        g.outputs = [Ref("sum")]
        return g

    assert not structural_equal(graph("relu"), graph("tanh"))


def test_the_message_prints_both_graphs_and_marks_the_node():
    a, b = _changed(lambda g: None), _changed(lambda g: setattr(g.node("z"), "op", "gelu"))
    with pytest.raises(AssertionError) as caught:
        assert_structural_equal(a, b)
    text = str(caught.value)
    assert "lhs: %z: f32[2,4] = relu(%y)" in text and "rhs: %z: f32[2,4] = gelu(%y)" in text
    assert "  -> %z: f32[2,4] = relu(%y)" in text and "  -> %z: f32[2,4] = gelu(%y)" in text


def test_a_graph_traced_on_a_gpu_verifies_with_its_device_literals():
    """torch.export records the example's device in checks and casts (device=cuda:0); the
    shape rules run on fake CPU tensors, so they read every device literal as the CPU."""
    from dataclasses import replace

    import stof_cc

    class ToHalf(torch.nn.Module):
        def forward(self, x):
            return x.to(device=x.device, dtype=torch.float16) * 2

    graph = stof_cc.trace(ToHalf(), (torch.randn(3, 4),))
    on_gpu = graph.rebuild(lambda node, _: replace(node, kwargs={
        k: torch.device("cuda", 0) if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}))
    assert any(v == torch.device("cuda", 0) for n in on_gpu.nodes() for v in n.kwargs.values())
    on_gpu.verify()


def _layer_norm_graph(stats_dtype: torch.dtype, stats_shape=(2, 5, 1)) -> Graph:
    """native_layer_norm as AOTAutograd traces it: (out, mean, rstd)."""
    g = Graph("norm")
    g.add_input("x", TensorSpec((2, 5, 8), torch.float16))
    g.add_constant("w", torch.ones(8, dtype=torch.float16))
    g.add_constant("b", torch.zeros(8, dtype=torch.float16))
    spec = (TensorSpec((2, 5, 8), torch.float16), TensorSpec(stats_shape, stats_dtype), TensorSpec(stats_shape, stats_dtype))
    g.add_node(Node("ln", "layer_norm", "aten.native_layer_norm.default", (Ref("x"), [8], Ref("w"), Ref("b"), 1e-5),
                    spec=spec))
    g.add_node(Node("y", "getitem", "operator.getitem", (Ref("ln"), 0), spec=spec[0]))
    g.outputs = [Ref("y")]
    return g


def test_a_layer_norm_traced_on_a_gpu_keeps_its_float32_statistics():
    """On CUDA native_layer_norm keeps fp16 inputs' mean and rstd in fp32, on the CPU (where shape
    rules run) in fp16: the GPU's record verifies; a wrong shape still does not."""
    _layer_norm_graph(torch.float32).verify()
    _layer_norm_graph(torch.float16).verify()
    with pytest.raises(GraphError, match="recorded spec"):
        _layer_norm_graph(torch.float32, stats_shape=(2, 5, 2)).verify()
