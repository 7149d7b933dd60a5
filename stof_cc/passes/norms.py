"""The norms rule (passes/patterns.py): norms written out in primitives become one node, so
that `row_reduce` generates them in one pass over the row. RMSNorm as HuggingFace writes it:

    variance = x.pow(2).mean(-1, keepdim=True)          # pow(x, 2) or x * x
    x = x * torch.rsqrt(variance + eps)                 # (or rsqrt(...) * x)

becomes one ``rms_norm(x, [hidden], None, eps)`` node (aten.rms_norm, the same arithmetic),
named like the final multiplication so its readers do not change. T5's variant, the variance
of ``x.float()`` times ``x`` itself, becomes ``rms_norm(x.float(), ...)`` (the same fp32
arithmetic). The weight and the casts
around it (HF casts to the model's dtype, then multiplies by the weight) stay as they are:
elementwise ops that fusion folds into the norm's epilogue. LayerNorm written out (Cohere):

    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    x = (x - mean) * torch.rsqrt(variance + eps)        # x - mean once or twice

becomes ``layer_norm(x, [hidden], None, None, eps)`` (aten.layer_norm: the same biased
variance). Every intermediate must have no reader outside the norm. Pure: the input graph is
not modified.
"""

from __future__ import annotations

import torch

from stof_cc.ir.graph import Graph, Node, Ref
from stof_cc.passes.rules import Rule


def _build(graph: Graph, node: Node, found: tuple[str, Ref, float]) -> Node:
    kind, x, eps = found
    hidden = graph.node(x.name).spec.shape[-1]
    if kind == "layer_norm":
        return Node(node.name, "layer_norm", "aten.layer_norm.default", (x, [hidden], None, None, eps), {}, node.spec)
    return Node(node.name, "rms_norm", "aten.rms_norm.default", (x, [hidden], None, eps), {}, node.spec)


def _match(graph: Graph, mul: Node) -> tuple[str, Ref, float] | None:
    """("rms_norm", x, eps) when ``mul`` is x * rsqrt(mean(x^2, -1, keepdim) + eps),
    ("layer_norm", x, eps) when it is (x - m) * rsqrt(mean((x - m)^2, -1, keepdim) + eps) with
    m = mean(x, -1, keepdim), else None."""
    if mul.op != "mul" or len(mul.args) != 2 or not all(isinstance(a, Ref) for a in mul.args):
        return None
    for x, other in (mul.args, mul.args[::-1]):
        chain = _only_reader_chain(graph, other, ("rsqrt", "add", "mean"))
        if chain is None:
            continue
        rsqrt, add, mean = chain
        if not _plain(add):  # var + alpha * eps
            continue
        eps = add.args[1] if isinstance(add.args[0], Ref) else add.args[0]
        if not isinstance(eps, (int, float)) or not _row_mean(mean):
            continue
        square = graph.node(mean.args[0].name)
        if len(graph.users(square.name)) != 1:
            continue
        if _squares(square, x):
            centred = _centred(graph, x, square, mul)
            return ("rms_norm", x, float(eps)) if centred is None else ("layer_norm", centred, float(eps))
        widened = _widened(graph, square, x)
        if widened is not None:  # T5: the variance of x.float(), times x itself (fp32 by promotion)
            return "rms_norm", widened, float(eps)
        source = square.args[0] if square.args else None
        if isinstance(source, Ref) and _squares(square, source) \
                and (centred := _centred(graph, x, square, mul, graph.node(source.name))) is not None:
            return "layer_norm", centred, float(eps)  # x - m written twice, once for each use
    return None


def _plain(node: Node) -> bool:
    """``node`` (an add or sub) is a + b or a - b: not rsub (b - a, which the IR's sub also holds)
    and no ``alpha`` (a - alpha b). Read as plain, torch.rsub(x, m) normalised to -layer_norm
    (found by review)."""
    return not (node.target or "").startswith("aten.rsub") and node.kwargs.get("alpha", 1) == 1


def _row_mean(mean: Node) -> bool:
    """``mean`` averages its tensor input over the last dimension alone, keeping it."""
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    return mean.op == "mean" and isinstance(mean.args[0], Ref) and bool(keepdim) and "dtype" not in mean.kwargs \
        and list(dims or []) in ([-1], [len(mean.spec.shape) - 1])


def _centred(graph: Graph, scaled: Ref, square: Node, mul: Node, other: Node | None = None) -> Ref | None:
    """x when ``scaled`` (and ``other``, the squared copy, if given) is x - mean(x, -1, keepdim)
    and the mean and the differences are read by the norm alone; else None."""
    subs = [graph.node(scaled.name)] + ([other] if other is not None else [])
    if any(s.op != "sub" or not _plain(s) or len(s.args) != 2 or not all(isinstance(a, Ref) for a in s.args)
           for s in subs) \
            or any(s.args != subs[0].args for s in subs):
        return None
    x, m = subs[0].args
    mean = graph.node(m.name)
    if not _row_mean(mean) or mean.args[0] != x:
        return None
    readers = {mul.name, square.name}
    if any({u.name for u in graph.users(s.name)} - readers or graph.is_output(s.name) for s in subs) \
            or {u.name for u in graph.users(mean.name)} - {s.name for s in subs} or graph.is_output(mean.name):
        return None
    return x


def _widened(graph: Graph, square: Node, x: Ref) -> Ref | None:
    """``c`` when ``square`` squares c = x.to(float32) and c's type is what x * rsqrt(...) has
    (T5's norm): rms_norm(c) then computes exactly what the original does."""
    source = square.args[0] if square.args else None
    if not isinstance(source, Ref) or not _squares(square, source):
        return None
    cast = graph.node(source.name)
    if cast.op != "cast" or cast.args[:1] != (x,) or cast.spec.dtype != torch.float32:
        return None
    return source


def _only_reader_chain(graph: Graph, ref: Ref, ops: tuple[str, ...]) -> list[Node] | None:
    """The nodes ``ops`` walking up first arguments from ``ref``, each read only once."""
    chain, current = [], ref
    for op in ops:
        node = graph.node(current.name)
        if node.op != op or len(graph.users(node.name)) != 1 or graph.is_output(node.name):
            return None
        chain.append(node)
        refs = [a for a in node.args if isinstance(a, Ref)]
        if len(refs) != 1:
            return None
        current = refs[0]
    return chain


def _squares(node: Node, x: Ref) -> bool:
    if node.op == "pow":
        return node.args[0] == x and node.args[1] == 2
    return node.op == "mul" and node.args == (x, x)


NORMS = Rule("norms", _match, _build, "RMSNorm and LayerNorm written out -> one rms_norm / layer_norm node")
