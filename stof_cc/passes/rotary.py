"""The rotary rule (passes/patterns.py): the rotary position embedding as HuggingFace applies it (Llama, Mistral, Qwen2):

    x * cos + cat(-x[..., D/2:], x[..., :D/2], dim=-1) * sin         # rotate_half, spelled out

becomes one ``rotary(x, cos, sin)`` node (``ir.ops.rotary_reference``, the same arithmetic),
named like the final add so its readers do not change. x is [B, H, S, D] with D even; cos and
sin are [1 or B, 1, S, D]. Every intermediate must have no other reader. An attention group
then runs its query's and key's rotation as one generated kernel each, instead of six torch
ops (`backends/rotary_launch.py`). Pure: the input graph is not modified.
"""

from __future__ import annotations

from stof_cc.ir.graph import Graph, Node, Ref
from stof_cc.passes.rules import Rule

LAST_DIMS = (3, -1)


def _match(graph: Graph, node: Node) -> tuple[Ref, Ref, Ref] | None:
    """(x, cos, sin) when ``node`` is the final add of a rotary embedding, else None."""
    if node.op != "add" or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1 \
            or not all(isinstance(a, Ref) for a in node.args):
        return None
    for straight, rotated in (node.args, node.args[::-1]):
        found = _rotation(graph, graph.node(straight.name), graph.node(rotated.name))
        if found is not None:
            return found
    return None


def _rotation(graph: Graph, straight: Node, rotated: Node) -> tuple[Ref, Ref, Ref] | None:
    if straight.op != "mul" or rotated.op != "mul" or not _private(graph, straight, rotated):
        return None
    for cat_ref, sin in (rotated.args, rotated.args[::-1]):
        if not isinstance(cat_ref, Ref) or graph.node(cat_ref.name).op != "cat":
            continue
        x = _rotated_input(graph, graph.node(cat_ref.name))
        if x is None or not isinstance(sin, Ref):
            continue
        others = [a for a in straight.args if a != x]
        if len(others) != 1 or len(straight.args) != 2 or not isinstance(others[0], Ref):
            continue
        cos = others[0]
        if _broadcast_table(graph, cos, x) and _broadcast_table(graph, sin, x):
            return x, cos, sin
    return None


def _rotated_input(graph: Graph, cat: Node) -> Ref | None:
    """x when ``cat`` is cat([neg(x[..., D/2:]), x[..., :D/2]], -1) with no other readers."""
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim not in LAST_DIMS or not isinstance(parts, (list, tuple)) or len(parts) != 2 \
            or not all(isinstance(p, Ref) for p in parts) or len(graph.users(cat.name)) != 1:
        return None
    neg, low = graph.node(parts[0].name), graph.node(parts[1].name)
    if neg.op != "neg" or not isinstance(neg.args[0], Ref) or not _private(graph, neg, low):
        return None
    high = graph.node(neg.args[0].name)
    if high.op != "slice" or low.op != "slice" or len(high.args) != 4 or len(low.args) != 4 \
            or not _private(graph, high) or high.args[0] != low.args[0] or not isinstance(high.args[0], Ref):
        return None
    x = high.args[0]
    shape = graph.node(x.name).spec.shape
    if len(shape) != 4 or shape[-1] % 2:
        return None
    half = shape[-1] // 2
    if tuple(low.args[1:4]) not in ((d, 0, half) for d in LAST_DIMS) or high.args[1] not in LAST_DIMS \
            or high.args[2] != half or high.args[3] < shape[-1]:
        return None
    return x


def _broadcast_table(graph: Graph, table: Ref, x: Ref) -> bool:
    """A cos/sin table of shape [1 or B, 1, S, D] for x [B, H, S, D], in x's dtype."""
    spec, x_spec = graph.node(table.name).spec, graph.node(x.name).spec
    b, _, s, d = x_spec.shape
    return spec is not None and len(spec.shape) == 4 and spec.shape[0] in (1, b) and spec.shape[1] == 1 \
        and tuple(spec.shape[2:]) == (s, d) and spec.dtype == x_spec.dtype


def _private(graph: Graph, *nodes: Node) -> bool:
    """Each node's value is read by exactly one node (the pattern's next step)."""
    return all(len(graph.users(n.name)) == 1 and not graph.is_output(n.name) for n in nodes)


ROTARY = Rule("rotary", _match, lambda graph, node, found: Node(node.name, "rotary", None, found, {}, node.spec),
              "HF's rotate_half arithmetic -> one rotary node")
