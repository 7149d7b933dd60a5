"""Horizontal fusion: linears that read the same input become one wider linear and a split.

Q, K and V projections written as three ``nn.Linear`` (BERT, transformers' encoders) are
three GEMMs of N = hidden over the same A; as one GEMM of N = 3 hidden the tensor cores see
one larger problem (more tiles per wave, A read once) instead of three short ones. The merged
node keeps the first sibling's place; each original node becomes ``getitem(split(merged), i)``
under its own name, so its users do not change, and the split's outputs are views of the
merged result (the attention kernels read such strided Q/K/V without copies).

Only linears whose weight (and bias, all or none) are constants of one dtype, read by nothing
else (a tied weight would be copied), and whose arguments are positional merge; and only
linears whose every user is a layout op (view, transpose...) and that are not graph outputs:
a linear followed by elementwise work keeps that work fused into its own GEMM's epilogue (a
split ends a GEMM epilogue), and a graph output stays a tensor of its own. The concatenated
weight and bias are new constants; the old ones drop out. Run after `canonicalize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stof_cc.ir.graph import CONSTANT, Graph, Node, Ref, TensorSpec
from stof_cc.passes.canonicalize import remove_dead_nodes

LAYOUT_USERS = ("view", "transpose", "contiguous", "unsqueeze", "squeeze")  # users that keep no work to fuse


@dataclass
class HorizontalReport:
    """The merges done: merged node name -> the linears it replaced, in order."""

    merged: dict[str, list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.merged:
            return "merge_parallel_linears: no sibling linears"
        parts = [f"%{name} = {' + '.join('%' + s for s in siblings)}" for name, siblings in self.merged.items()]
        return f"merge_parallel_linears: {len(self.merged)} merge{'s' if len(self.merged) > 1 else ''} ({'; '.join(parts)})"


def merge_parallel_linears(graph: Graph, report: HorizontalReport | None = None) -> Graph:
    """A copy of ``graph`` in which each set of mergeable sibling linears is one linear + split."""
    report = report if report is not None else HorizontalReport()
    sets = _sibling_sets(graph)
    if not sets:
        return graph.copy()
    position = {name: (members, i) for members in sets for i, name in enumerate(members)}
    split_of: dict[tuple[str, ...], str] = {}

    def rewrite(node: Node, out: Graph) -> Node:
        if node.name not in position:
            return node
        members, index = position[node.name]
        if index == 0:
            split_of[members] = _add_merged(graph, out, members, report)
        return Node(node.name, "getitem", "operator.getitem", (Ref(split_of[members]), index), {}, node.spec)

    return remove_dead_nodes(graph.rebuild(rewrite))


def _sibling_sets(graph: Graph) -> list[tuple[str, ...]]:
    """Mergeable linears grouped by (input, weight dtype, K, has bias); sets of two or more."""
    by_key: dict[tuple, list[str]] = {}
    for node in graph.nodes():
        key = _merge_key(graph, node)
        if key is not None:
            by_key.setdefault(key, []).append(node.name)
    return [tuple(names) for names in by_key.values() if len(names) > 1]


def _merge_key(graph: Graph, node: Node) -> tuple | None:
    if node.op != "linear" or node.kwargs or not 2 <= len(node.args) <= 3:
        return None
    source, weight, *rest = node.args
    bias = rest[0] if rest else None
    params = [weight] + ([bias] if bias is not None else [])
    if not isinstance(source, Ref) or not all(isinstance(p, Ref) and graph.node(p.name).op == CONSTANT
                                              and len(graph.users(p.name)) == 1 for p in params):
        return None
    if graph.is_output(node.name) or not all(user.op in LAYOUT_USERS for user in graph.users(node.name)):
        return None
    w = graph.constants[weight.name]
    if w.dim() != 2 or (bias is not None and graph.constants[bias.name].dim() != 1):
        return None
    return source.name, w.dtype, w.shape[1], bias is not None


def _add_merged(graph: Graph, out: Graph, members: tuple[str, ...], report: HorizontalReport) -> str:
    """Add the concatenated constants, the merged linear and its split to ``out``; the split's name."""
    nodes = [graph.node(name) for name in members]
    source = nodes[0].args[0]
    weights = [graph.constants[n.args[1].name] for n in nodes]
    widths = [w.shape[0] for w in weights]
    base = f"{members[0]}_merged"
    args: list = [source, Ref(out.add_constant(out.fresh_name(f"{base}_weight"), torch.cat(weights)).name)]
    if len(nodes[0].args) == 3:
        biases = torch.cat([graph.constants[n.args[2].name] for n in nodes])
        args.append(Ref(out.add_constant(out.fresh_name(f"{base}_bias"), biases).name))
    first = nodes[0].spec
    merged = out.add_node(Node(out.fresh_name(base), "linear", nodes[0].target, tuple(args), {},
                               TensorSpec((*first.shape[:-1], sum(widths)), first.dtype)))
    if len(set(widths)) == 1:
        split_args, target = (Ref(merged.name), widths[0], -1), "aten.split.Tensor"
    else:
        split_args, target = (Ref(merged.name), widths, -1), "aten.split_with_sizes.default"
    split = out.add_node(Node(out.fresh_name(f"{base}_split"), "split", target, split_args, {},
                              tuple(n.spec for n in nodes)))
    report.merged[merged.name] = list(members)
    return split.name
