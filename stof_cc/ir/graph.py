"""The graph IR: a small dataflow graph of torch (ATen) operators over networkx.

Why our own IR and not torch.fx: passes here must be pure (Graph -> Graph), keyed by
pattern kind, printable and hashable for cache keys; an fx.Graph is mutable, carries
Python callables everywhere and has no notion of fusion kinds. The IR keeps what later
stages need and nothing else:

* every value is produced by exactly one `Node` (graph inputs and constants included);
* a node's arguments are ATen-style positional ``args`` and ``kwargs`` in which a use of
  another node's value is a `Ref`; everything else is a literal (int, float, list, dtype...);
* ``target`` names the ATen overload (``"aten.linear.default"``) the node computes, which
  is also its torch reference; ``op`` is the canonical registry name (``"linear"``) that
  gives the pattern kind.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import networkx as nx
import torch

from stof_cc.ir.node import (
    CONSTANT,
    INPUT,
    GraphError,
    Node,
    Ref,
    TensorSpec,
    format_arg,
    format_spec,
)
from stof_cc.ir.ops import infer_spec, matches_on_some_device, pattern_kind


class Graph:
    """A dataflow graph of `Node`s kept in a networkx.DiGraph.

    Edges run producer -> consumer. Insertion order is the stable tie-break of the
    topological order, so the same model always prints (and hashes) the same way.
    ``constants`` holds the tensors of CONSTANT nodes (parameters and buffers);
    ``outputs`` are the values the graph returns, flattened; ``in_spec``/``out_spec``
    are the pytree specs that turn user arguments into the flat inputs and the flat
    outputs back into the module's return structure.
    """

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self._g = nx.DiGraph()
        self._order: dict[str, int] = {}
        self._topological: list[Node] | None = None  # nodes() until the next add_node
        self._counter = itertools.count()
        self.constants: dict[str, torch.Tensor] = {}
        self.outputs: list[Any] = []  # Refs, or literals a module returns as is
        self.in_spec: Any = None
        self.out_spec: Any = None
        self._reserved: frozenset[str] = frozenset()  # names fresh_name avoids beyond the graph's own

    # -- building -------------------------------------------------------------------
    def add_node(self, node: Node) -> Node:
        if node.name in self._g:
            raise GraphError(f"node %{node.name} is defined twice")
        self._g.add_node(node.name, node=node)
        self._order[node.name] = next(self._counter)
        self._topological = None
        for ref in node.refs():
            if ref.name not in self._g:
                raise GraphError(f"node %{node.name} reads %{ref.name}, which is not defined before it")
            self._g.add_edge(ref.name, node.name)
        return node

    def add_input(self, name: str, spec: TensorSpec) -> Node:
        return self.add_node(Node(name, INPUT, spec=spec))

    def add_constant(self, name: str, value: torch.Tensor, target: str | None = None) -> Node:
        """A constant node holding ``value``; ``target``: the parameter's or buffer's qualified name."""
        self.constants[name] = value
        return self.add_node(Node(name, CONSTANT, target=target, spec=TensorSpec.of(value)))

    def fresh_name(self, base: str) -> str:
        """A node name not yet used, derived from ``base``; during `rebuild`, not one of the
        source graph's names either (a node added later under it would clash)."""
        taken = lambda name: name in self._g or name in self._reserved  # noqa: E731
        if not taken(base):
            return base
        for i in itertools.count(1):
            candidate = f"{base}_{i}"
            if not taken(candidate):
                return candidate
        raise AssertionError("unreachable")

    # -- reading --------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._g

    def __len__(self) -> int:
        return self._g.number_of_nodes()

    def node(self, name: str) -> Node:
        try:
            return self._g.nodes[name]["node"]
        except KeyError:
            raise GraphError(f"no node named %{name} in graph {self.name!r}") from None

    def nodes(self) -> list[Node]:
        """All nodes in deterministic topological order (computed once per change: a compiled
        model's every call reads it, and sorting a 12-layer BERT took milliseconds)."""
        if self._topological is None:
            order = nx.lexicographical_topological_sort(self._g, key=self._order.__getitem__)
            self._topological = [self._g.nodes[n]["node"] for n in order]
        return list(self._topological)

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes() if n.op == INPUT]

    def users(self, name: str) -> list[Node]:
        """Consumers of ``name``'s value, in insertion order."""
        return [self.node(u) for u in sorted(self._g.successors(name), key=self._order.__getitem__)]

    def is_output(self, name: str) -> bool:
        """Whether the graph returns the value of node ``name``."""
        return any(isinstance(r, Ref) and r.name == name for r in self.outputs)

    def producers(self, name: str) -> list[Node]:
        return [self.node(p) for p in sorted(self._g.predecessors(name), key=self._order.__getitem__)]

    @property
    def nx_graph(self) -> nx.DiGraph:
        """A read-only view of the underlying networkx graph (node attribute ``node``)."""
        return self._g.copy(as_view=True)

    def op_histogram(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes():
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    # -- copying --------------------------------------------------------------------
    def rebuild(self, rewrite: Callable[[Node, Graph], Node | None]) -> Graph:
        """A new graph with the same inputs, constants and outputs whose computed nodes are
        ``rewrite(node, new_graph)``: the node itself, a replacement, or None to drop it (the
        callback may add nodes of its own to ``new_graph`` first). Passes build on this."""
        out = Graph(self.name)
        out.in_spec, out.out_spec = self.in_spec, self.out_spec
        out._reserved = frozenset(self._g.nodes)
        for node in self.nodes():
            if node.op == INPUT:
                out.add_input(node.name, node.spec)
            elif node.op == CONSTANT:
                out.add_constant(node.name, self.constants[node.name], node.target)
            else:
                new = rewrite(node, out)
                if new is not None:
                    out.add_node(new)
        out.outputs = list(self.outputs)
        out._reserved = frozenset()
        return out

    def copy(self) -> Graph:
        """A deep copy of the structure; constant tensors are shared (they are never mutated)."""
        out = Graph(self.name)
        for n in self.nodes():
            out.add_node(replace(n, args=copy.deepcopy(n.args), kwargs=copy.deepcopy(n.kwargs)))
        out.constants = dict(self.constants)
        out.outputs = list(self.outputs)
        out.in_spec, out.out_spec = self.in_spec, self.out_spec
        return out

    # -- checking -------------------------------------------------------------------
    def verify(self, check_shapes: bool = True) -> None:
        """Raise GraphError naming the first node that breaks an invariant.

        Invariants: acyclic; every Ref names a node; graph outputs exist; each constant
        node has its tensor with the recorded spec; and (``check_shapes``) each op's
        recorded spec equals what its shape rule infers from its inputs' specs.
        """
        # Dependencies are read from the nodes' own arguments, not the stored edges, so a
        # node whose args were edited after insertion is still checked.
        deps = nx.DiGraph()
        deps.add_nodes_from(self._g.nodes)
        for node in self.nodes():
            for ref in node.refs():
                if ref.name not in self._g:
                    raise GraphError(f"node %{node.name} reads undefined value %{ref.name}")
                deps.add_edge(ref.name, node.name)
        if not nx.is_directed_acyclic_graph(deps):
            cycle = nx.find_cycle(deps)
            raise GraphError(f"graph {self.name!r} has a cycle through %{cycle[0][1]}")
        for node in self.nodes():
            if node.op == CONSTANT:
                if node.name not in self.constants:
                    raise GraphError(f"constant %{node.name} has no tensor in graph.constants")
                if TensorSpec.of(self.constants[node.name]) != node.spec:
                    raise GraphError(f"constant %{node.name}: tensor does not match spec {node.spec}")
            elif node.op != INPUT and check_shapes:
                expected = infer_spec(self, node)
                if not matches_on_some_device(node, node.spec, expected):
                    raise GraphError(
                        f"node %{node.name} ({node.op}): recorded spec {format_spec(node.spec)} "
                        f"but its inputs give {format_spec(expected)}"
                    )
        for ref in self.outputs:
            if isinstance(ref, Ref) and ref.name not in self._g:
                raise GraphError(f"graph output %{ref.name} is not a node")
        if not self.outputs:
            raise GraphError(f"graph {self.name!r} has no outputs")

    def spec_of(self, value: Any) -> Any:
        """The spec behind a Ref (or the literal itself): what shape rules see."""
        if isinstance(value, Ref):
            return self.node(value.name).spec
        return value

    # -- printing -------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"graph {self.name}:"]
        lines += [f"  {n}" for n in self.nodes()]
        lines.append("  return " + ", ".join(format_arg(r) for r in self.outputs))
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz DOT text, nodes coloured by pattern kind."""
        lines = [f'digraph "{self.name}" {{', "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="monospace"];']
        for n in self.nodes():
            kind = pattern_kind(n.op)
            colour = _KIND_COLOURS.get(kind, "#dddddd")
            label = f"{n.name}\\n{n.op} [{kind}]\\n{format_spec(n.spec)}"
            lines.append(f'  "{n.name}" [label="{label}", fillcolor="{colour}"];')
        for src, dst in self._g.edges:
            lines.append(f'  "{src}" -> "{dst}";')
        for i, ref in enumerate(r for r in self.outputs if isinstance(r, Ref)):
            lines.append(f'  "out{i}" [shape=ellipse, fillcolor="#ffffff"];')
            lines.append(f'  "{ref.name}" -> "out{i}";')
        lines.append("}")
        return "\n".join(lines) + "\n"


_KIND_COLOURS = {
    "input": "#ffffff",
    "constant": "#eeeeee",
    "elementwise": "#c6e5b3",
    "broadcast": "#a8d8a0",
    "injective": "#dbe9f6",
    "reduction": "#fdd49e",
    "gemm": "#f4a582",
    "attention": "#d6604d",
    "opaque": "#bababa",
}


# -- structural equality ------------------------------------------------------------------
# TVM's tvm.ir.structural_equal for this IR: what pass tests compare a pass's output with.


def structural_equal(a: Graph, b: Graph, map_free_names: bool = True) -> bool:
    """Whether graphs ``a`` and ``b`` compute the same thing in the same way.

    The nodes of both, in topological order (`Graph.nodes`: insertion order breaks ties, so
    independent nodes must come in the same order, as they print and hash), are paired one
    to one; two graphs are equal when every pair has the same

    * ``op`` and ``target`` (for a constant, the parameter's qualified name);
    * ``spec`` (shapes and dtypes; tuples for multi-output nodes);
    * ``args`` and ``kwargs`` (kwargs by key, in any order): a `Ref` matches the `Ref` to the
      node paired with the one it names; literals match by type and value (``1``, ``1.0`` and
      ``True`` differ, a list is not a tuple, NaN equals NaN, tensors compare like constants);
    * for constants, the tensor in ``graph.constants``: same dtype and shape, equal values
      (NaNs in the same places), compared on the CPU wherever either lives;

    and when the graphs return the same ``outputs`` (the paired nodes, or equal literals, in
    order) and have equal pytree ``in_spec`` and ``out_spec``. Inputs are nodes, so their
    specs and order are compared by the pairing. With ``map_free_names`` (the default) node
    names may differ; without it, paired nodes must have the same name too. Not compared: the
    graph's ``name``, and tensors in ``graph.constants`` that no constant node holds.
    """
    return _first_difference(a, b, map_free_names) is None


def assert_structural_equal(a: Graph, b: Graph, map_free_names: bool = True) -> None:
    """Raise AssertionError unless `structural_equal(a, b)`; the message names the first pair
    of nodes that differ, says how, and prints both graphs with that node marked."""
    difference = _first_difference(a, b, map_free_names)
    if difference is None:
        return
    index, why = difference
    lines = [f"graphs {a.name!r} and {b.name!r} are not structurally equal: {why}"]
    if index is not None:  # else the pytree specs differ, as the message says
        for side, graph in (("lhs", a), ("rhs", b)):
            lines.append(f"  {side}: {_marked_lines(graph, index)[1].removeprefix('  -> ')}")
        for side, graph in (("lhs", a), ("rhs", b)):
            lines.append(f"{side}:")
            lines += _marked_lines(graph, index)[0]
    raise AssertionError("\n".join(lines))


_CONTEXT = 12  # printed lines either side of the differing node in assert_structural_equal


def _marked_lines(graph: Graph, index: int) -> tuple[list[str], str]:
    """``graph`` printed with ``->`` before node ``index`` (or before its return line when it has
    no such node), around it only for large graphs; and the marked line."""
    body = [f"     {n}" for n in graph.nodes()] + ["     return " + ", ".join(format_arg(r) for r in graph.outputs)]
    at = min(index, len(body) - 1)
    body[at] = "  -> " + body[at][5:]
    if len(body) <= 2 * _CONTEXT + 1:
        return body, body[at]
    low, high = max(0, at - _CONTEXT), min(len(body), at + _CONTEXT + 1)
    window = ([f"     ... {low} lines"] if low else []) + body[low:high] + \
        ([f"     ... {len(body) - high} lines"] if high < len(body) else [])
    return window, body[at]


def _first_difference(a: Graph, b: Graph, map_free_names: bool) -> tuple[int | None, str] | None:
    """(index of the first differing node pair or None, what differs), or None when equal."""
    left, right = a.nodes(), b.nodes()
    paired: dict[str, str] = {}  # a's node name -> b's
    for index, (x, y) in enumerate(zip(left, right, strict=False)):
        why = _node_difference(a, b, x, y, paired, map_free_names)
        if why is not None:
            return index, f"%{x.name} and %{y.name} differ: {why}"
        paired[x.name] = y.name
    if len(left) != len(right):
        index = min(len(left), len(right))
        extra = left[index] if len(left) > len(right) else right[index]
        side = "lhs" if len(left) > len(right) else "rhs"
        return index, f"{side} has {abs(len(left) - len(right))} more node(s), from %{extra.name}"
    if len(a.outputs) != len(b.outputs):
        return len(left), f"{len(a.outputs)} outputs against {len(b.outputs)}"
    for i, (x, y) in enumerate(zip(a.outputs, b.outputs, strict=True)):
        why = _value_difference(x, y, paired)
        if why is not None:
            return len(left), f"output {i}: {why}"
    if a.in_spec != b.in_spec:
        return None, f"in_spec differs: {a.in_spec} against {b.in_spec}"
    if a.out_spec != b.out_spec:
        return None, f"out_spec differs: {a.out_spec} against {b.out_spec}"
    return None


def _node_difference(a: Graph, b: Graph, x: Node, y: Node, paired: dict[str, str],
                     map_free_names: bool) -> str | None:
    if not map_free_names and x.name != y.name:
        return "names differ (map_free_names=False)"
    for field_name in ("op", "target"):
        if getattr(x, field_name) != getattr(y, field_name):
            return f"{field_name} {getattr(x, field_name)!r} against {getattr(y, field_name)!r}"
    if x.spec != y.spec:
        return f"spec {format_spec(x.spec)} against {format_spec(y.spec)}"
    if len(x.args) != len(y.args):
        return f"{len(x.args)} args against {len(y.args)}"
    for i, (u, v) in enumerate(zip(x.args, y.args, strict=True)):
        why = _value_difference(u, v, paired)
        if why is not None:
            return f"arg {i}: {why}"
    if set(x.kwargs) != set(y.kwargs):
        return f"kwargs {sorted(x.kwargs)} against {sorted(y.kwargs)}"
    for key in x.kwargs:
        why = _value_difference(x.kwargs[key], y.kwargs[key], paired)
        if why is not None:
            return f"kwarg {key}: {why}"
    if x.op == CONSTANT:
        if (x.name in a.constants) != (y.name in b.constants):
            return "only one constant has a tensor in graph.constants"
        if x.name in a.constants:
            return _tensor_difference(a.constants[x.name], b.constants[y.name])
    return None


def _value_difference(u: Any, v: Any, paired: dict[str, str]) -> str | None:
    """How literal-or-Ref ``u`` (of the left graph) differs from ``v`` (of the right), or None."""
    if type(u) is not type(v):
        return f"{format_arg(u)} ({type(u).__name__}) against {format_arg(v)} ({type(v).__name__})"
    if isinstance(u, Ref):
        # A Ref to an earlier node must name its partner; any other (undefined) name must match as is.
        if paired.get(u.name, u.name) != v.name:
            return f"{u} against {v}"
        return None
    if isinstance(u, (list, tuple)):
        if len(u) != len(v):
            return f"{format_arg(u)} against {format_arg(v)} (lengths {len(u)} and {len(v)})"
        for i, (p, q) in enumerate(zip(u, v, strict=True)):
            why = _value_difference(p, q, paired)
            if why is not None:
                return f"[{i}]: {why}"
        return None
    if isinstance(u, dict):
        if set(u) != set(v):
            return f"keys {sorted(map(str, u))} against {sorted(map(str, v))}"
        for key in u:
            why = _value_difference(u[key], v[key], paired)
            if why is not None:
                return f"[{key!r}]: {why}"
        return None
    if isinstance(u, torch.Tensor):
        return _tensor_difference(u, v)
    if isinstance(u, float) and u != u and v != v:  # NaN: the same literal
        return None
    return None if bool(u == v) else f"{format_arg(u)} against {format_arg(v)}"


def _tensor_difference(u: torch.Tensor, v: torch.Tensor) -> str | None:
    if u.dtype != v.dtype or u.shape != v.shape:
        return f"tensor {TensorSpec.of(u)} against {TensorSpec.of(v)}"
    u, v = u.detach().cpu(), v.detach().cpu()
    same = torch.equal(u, v) or (u.is_floating_point() and torch.allclose(u, v, rtol=0.0, atol=0.0, equal_nan=True))
    if same:
        return None
    where = (u != v) & ~(u.isnan() & v.isnan()) if u.is_floating_point() else u != v
    first = tuple(int(i) for i in where.nonzero()[0])
    return f"tensor values differ first at {list(first)}: {u[first].item()!r} against {v[first].item()!r}"
