"""The overflow-clamp rule (passes/patterns.py): T5's fp16 overflow guard, which transformers
applies after every sub-layer:

    w = where(isinf(x).any(), finfo.max - 1000, finfo.max)
    x = clamp(x, -w, w)

becomes one ``overflow_clamp(x, cap_if_inf, cap)`` node (``ir.ops.overflow_clamp_reference``,
the same arithmetic), named like the clamp so its readers do not change. It is a reduction
(the bound depends on every element), so it anchors a group of its own, which the
``overflow_clamp`` template generates as one kernel in place of five torch ops (isinf, any,
where, neg, clamp). The ``isinf``, ``any``, ``where`` and ``neg`` nodes must have no other
reader. Pure: the input graph is not modified.
"""

from __future__ import annotations

from stof_cc.ir.graph import Graph, Node, Ref
from stof_cc.passes.rules import Rule


def _match(graph: Graph, node: Node) -> tuple[Ref, float, float] | None:
    """(x, cap_if_inf, cap) when ``node`` is ``clamp(x, neg(w), w)`` of the guard, else None."""
    if node.op != "clamp" or len(node.args) != 3 or node.kwargs or not all(isinstance(a, Ref) for a in node.args):
        return None
    x, low, high = node.args
    negation, bound = graph.node(low.name), graph.node(high.name)
    if negation.op != "neg" or negation.args != (high,) or bound.op != "where" or len(bound.args) != 3:
        return None
    flag, cap_if_inf, cap = bound.args
    if not isinstance(flag, Ref) or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                            for c in (cap_if_inf, cap)):
        return None
    any_inf = graph.node(flag.name)
    if not _aten(any_inf, "aten.any") or len(any_inf.args) != 1 or any_inf.kwargs:
        return None
    isinf = graph.node(any_inf.args[0].name)
    if not _aten(isinf, "aten.isinf") or isinf.args != (x,):
        return None
    readers = {n.name: [u.name for u in graph.users(n.name)] for n in (negation, bound, any_inf, isinf)}
    expected = {negation.name: [node.name], bound.name: sorted([negation.name, node.name]),
                any_inf.name: [bound.name], isinf.name: [any_inf.name]}
    if {name: sorted(users) for name, users in readers.items()} != expected \
            or any(graph.is_output(name) for name in readers):
        return None
    return x, float(cap_if_inf), float(cap)


def _aten(node: Node, packet: str) -> bool:
    """Whether ``node`` is an overload of the ATen packet (``aten.any`` matches ``aten.any.default``)."""
    return isinstance(node.args[0] if node.args else None, Ref) and (node.target or "").startswith(packet + ".")


OVERFLOW_CLAMP = Rule("overflow_clamp", _match,
                      lambda graph, node, found: Node(node.name, "overflow_clamp", None, found, {}, node.spec),
                      "T5's fp16 isinf().any() guard -> one overflow_clamp node")
