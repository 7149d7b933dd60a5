"""Move layout changes off the GEMMs' inputs and from between a GEMM and its epilogue.

A linear acts on the last dimension only, so views and transposes that leave the last
dimension alone commute with it. torch.nn's ``MultiheadAttention`` (batch first) spends that
freedom badly for a fused compiler: its in-projection reads ``transpose(x, 1, 0)`` (a GEMM
prologue no template generates) and its out-projection's value goes through ``view`` and
``transpose(1, 0)`` before the residual add (an add after a layout change, not generated
either), so both GEMMs ran in torch. Three rewrites, each exact:

* ``linear(transpose(x, i, j))`` with i, j leading dims -> ``transpose(linear(x), i, j)``: the
  GEMM reads x as it is and its epilogue's store writes the transposed layout.
* ``linear(y) -> [view | transpose | contiguous]* -> e`` with e an op that reads another tensor
  too (the residual add): the layout chain moves onto y (its last dim in_features instead of
  out_features), so e follows the GEMM directly and joins its epilogue. (A unary e is left: it
  would only undo the first rewrite.)
* The chain of views and permutes feeding a linear's input is collapsed into ``permute`` and
  one ``reshape``, found by running the chain on the indices of its source: MultiheadAttention's
  ``permute(2, 0, 1, 3) -> reshape -> view -> transpose(1, 0)`` of the attention output becomes
  ``permute(0, 2, 1, 3) -> reshape``, a free view of what stof-cc's attention kernels write.

The new nodes take the names of the nodes whose values they produce, so readers do not change.
Pure: the input graph is not modified.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec
from stof_cc.ir.interpret import evaluate_node
from stof_cc.passes.canonicalize import remove_dead_nodes

CHAIN_OPS = ("view", "transpose", "contiguous")  # what MultiheadAttention puts around its projections
SHAPED_VIEWS = ("aten.view.", "aten._unsafe_view.", "aten.reshape.")  # views whose argument is the new shape
MAX_PERMUTED_RANK = 5  # the collapse tries every permutation of the source's dims


@dataclass
class LayoutReport:
    transposed_outputs: list[str] = field(default_factory=list)  # linears that now store transposed
    moved_before: list[str] = field(default_factory=list)  # linears whose output layout chain moved to their input
    collapsed: list[str] = field(default_factory=list)  # linears whose input chain became permute + reshape

    def __str__(self) -> str:
        return (f"simplify_gemm_layouts: {len(self.transposed_outputs)} prologue transpose(s) moved after the GEMM, "
                f"{len(self.moved_before)} layout chain(s) moved before it, {len(self.collapsed)} input chain(s) "
                f"collapsed to permute + reshape")


def simplify_gemm_layouts(graph: Graph, report: LayoutReport | None = None) -> Graph:
    """A copy of ``graph`` with the three rewrites applied in turn."""
    report = report if report is not None else LayoutReport()
    graph = _transpose_outputs(graph, report)
    graph = _move_chains_before(graph, report)
    return _collapse_inputs(graph, report)


def _linear(node: Node) -> bool:
    return node.op == "linear" and not node.kwargs and 2 <= len(node.args) <= 3 and isinstance(node.args[0], Ref)


def _single_reader(graph: Graph, name: str) -> Node | None:
    users = graph.users(name)
    return users[0] if len(users) == 1 and not graph.is_output(name) else None


def _swapped_leading(graph: Graph, node: Node) -> tuple[int, int] | None:
    """(i, j) when ``node`` is transpose(x, i, j) of two dims other than the last."""
    if node.op != "transpose" or not (node.target or "").startswith("aten.transpose") or len(node.args) != 3:
        return None
    rank = len(node.spec.shape)
    i, j = (d % rank for d in node.args[1:3])
    return (i, j) if rank - 1 not in (i, j) else None


def _transpose_outputs(graph: Graph, report: LayoutReport) -> Graph:
    found: dict[str, tuple[Ref, tuple[int, int]]] = {}
    for node in graph.nodes():
        if not _linear(node):
            continue
        producer = graph.node(node.args[0].name)
        dims = _swapped_leading(graph, producer)
        if dims is not None and _single_reader(graph, producer.name) is node:
            found[node.name] = (producer.args[0], dims)
    if not found:
        return graph.copy()

    def rewrite(node: Node, out: Graph) -> Node:
        if node.name not in found:
            return node
        x, (i, j) = found[node.name]
        x_shape = graph.node(x.name).spec.shape
        rows = out.add_node(Node(out.fresh_name(f"{node.name}_rows"), "linear", node.target, (x, *node.args[1:]), {},
                                 TensorSpec((*x_shape[:-1], node.spec.shape[-1]), node.spec.dtype)))
        report.transposed_outputs.append(node.name)
        return Node(node.name, "transpose", "aten.transpose.int", (Ref(rows.name), i, j), {}, node.spec)

    return remove_dead_nodes(graph.rebuild(rewrite))


def _output_chain(graph: Graph, linear: Node) -> list[Node] | None:
    """The layout chain after ``linear`` (single readers, last dim untouched) up to a reader that
    is not a layout op and reads another tensor too, when there is one."""
    chain, name = [], linear.name
    width = linear.spec.shape[-1]
    while (reader := _single_reader(graph, name)) is not None and reader.op in CHAIN_OPS:
        if not isinstance(reader.spec, TensorSpec) or reader.spec.shape[-1:] != (width,):
            return None
        if reader.op == "transpose" and _swapped_leading(graph, reader) is None:
            return None
        if reader.op == "view" and not (reader.target or "").startswith(SHAPED_VIEWS):
            return None  # flatten / unflatten take dims, not a shape to rewrite
        chain.append(reader)
        name = reader.name
    reader = _single_reader(graph, name)
    binary = reader is not None and sum(isinstance(a, Ref) for a in reader.args) >= 2
    return chain if chain and binary else None  # a unary reader commutes with the chain: nothing to gain


def _move_chains_before(graph: Graph, report: LayoutReport) -> Graph:
    chains = {node.name: chain for node in graph.nodes() if _linear(node)
              and (chain := _output_chain(graph, node)) is not None}
    if not chains:
        return graph.copy()
    moved = {n.name for chain in chains.values() for n in chain}

    def rewrite(node: Node, out: Graph) -> Node | None:
        if node.name in moved:
            return None
        if node.name not in chains:
            return node
        chain, value = chains[node.name], node.args[0]
        in_width = graph.node(value.name).spec.shape[-1]
        for step in chain[:-1] + [None]:  # every chain op on the input, then the GEMM named as the chain's end
            original = step or chain[-1]
            shape = (*original.spec.shape[:-1], in_width)
            args = (value, _with_last(original.args[1], in_width), *original.args[2:]) if original.op == "view" \
                else (value, *original.args[1:])
            applied = Node(out.fresh_name(f"{original.name}_in"), original.op, original.target, args, original.kwargs,
                           TensorSpec(shape, original.spec.dtype))
            value = Ref(out.add_node(applied).name)
        report.moved_before.append(node.name)
        return Node(chain[-1].name, "linear", node.target, (value, *node.args[1:]), {}, chain[-1].spec)

    return remove_dead_nodes(graph.rebuild(rewrite))


def _with_last(shape: list[int] | tuple[int, ...], width: int) -> list[int]:
    return [*shape[:-1], shape[-1] if shape[-1] == -1 else width]


def _input_chain(graph: Graph, linear: Node) -> list[Node]:
    """The layout nodes feeding ``linear``'s input, source first, each read only by the next."""
    chain, name = [], linear.args[0].name
    while graph.node(name).op in CHAIN_OPS + ("unsqueeze", "squeeze") and isinstance(graph.node(name).args[0], Ref) \
            and _single_reader(graph, name) is not None:
        chain.insert(0, graph.node(name))
        name = graph.node(name).args[0].name
    return chain


def _as_permute_reshape(graph: Graph, chain: list[Node]) -> tuple[int, ...] | None:
    """The permutation p with ``chain(x) == x.permute(p).reshape(out)``, when there is one."""
    source = chain[0].args[0].name
    shape = tuple(graph.node(source).spec.shape)
    if len(shape) > MAX_PERMUTED_RANK:
        return None
    indices = torch.arange(math.prod(shape)).view(shape)
    env = {source: indices}
    for node in chain:
        env[node.name] = evaluate_node(graph, node, env, torch.device("cpu"))
    composite = env[chain[-1].name]
    for order in itertools.permutations(range(len(shape))):
        if torch.equal(indices.permute(order).reshape(composite.shape), composite):
            return order
    return None


def _collapse_inputs(graph: Graph, report: LayoutReport) -> Graph:
    collapsed: dict[str, tuple[list[Node], tuple[int, ...]]] = {}
    for node in graph.nodes():
        if not _linear(node):
            continue
        chain = _input_chain(graph, node)
        if len(chain) < 3:  # permute + reshape is two nodes: nothing to gain
            continue
        order = _as_permute_reshape(graph, chain)
        if order is not None:
            collapsed[chain[-1].name] = (chain, order)
            report.collapsed.append(node.name)
    if not collapsed:
        return graph.copy()
    inside = {n.name for chain, _ in collapsed.values() for n in chain[:-1]}

    def rewrite(node: Node, out: Graph) -> Node | None:
        if node.name in inside:
            return None
        if node.name not in collapsed:
            return node
        chain, order = collapsed[node.name]
        value = chain[0].args[0]
        if order != tuple(range(len(order))):
            spec = graph.node(value.name).spec
            permuted = Node(out.fresh_name(f"{node.name}_permute"), "transpose", "aten.permute.default",
                            (value, list(order)), {}, TensorSpec(tuple(spec.shape[d] for d in order), spec.dtype))
            value = Ref(out.add_node(permuted).name)
        return Node(node.name, "view", "aten.reshape.default", (value, list(node.spec.shape)), {}, node.spec)

    return remove_dead_nodes(graph.rebuild(rewrite))
