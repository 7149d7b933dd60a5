"""Canonical GEMMs: ``addmm`` as GPT-2's Conv1D writes it, ``x @ W.T`` as Falcon's linear
layers write it, and ``mm(x, t(W))`` / ``addmm(b, x, t(W))`` as AOTAutograd writes every linear
(the tensor-parallel route's graphs), become the ``linear`` the GEMM templates generate.

    out = matmul(x, transpose(W))           # W: a constant [N, K]; also mm(x, t(W))
->
    out = linear(x, W)                      # reads the weight itself: no copy

    out = addmm(b, x, t(W))                 # W: a constant [N, K], b: [N]
->
    out = linear(x, W, b)

and a linear read only through pieces of its last dimension (Phi-3's fused ``qkv_proj`` sliced,
its ``gate_up_proj`` chunked) becomes one linear per piece over those rows of W and b, named
like the piece: each then fuses its own epilogue (SiLU, the product) as separate projections do,
and `merge_parallel_linears` joins again those read only through views (Q, K, V).

    flat = view(x, [-1, K])                 # x: [..., K]
    out  = addmm(bias, flat, W)             # W: a constant [K, N]
->
    y    = linear(x, W^T, bias)             # W^T: a new constant [N, K]
    out  = view(y, [M, N])                  # keeps addmm's name: its readers do not change

Exact (the same products and bias); only ``beta = alpha = 1`` and a row-major flattening view
qualify. The view now follows the GEMM, where fusion folds it into the store, instead of
sitting between a LayerNorm and its GEMM. Pure: the input graph is not modified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from stof_cc.ir.graph import CONSTANT, Graph, Node, Ref, TensorSpec
from stof_cc.ir.node import map_refs
from stof_cc.ir.ops import split_piece
from stof_cc.passes.canonicalize import remove_dead_nodes


@dataclass
class GemmFormsReport:
    rewritten: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"canonical_gemms: {len(self.rewritten)} addmm or x @ W.T -> linear"


def canonical_gemms(graph: Graph, report: GemmFormsReport | None = None) -> Graph:
    """A copy of ``graph`` with each qualifying ``addmm`` as a ``linear`` and a view."""
    report = report if report is not None else GemmFormsReport()
    matches = {n.name: m for n in graph.nodes() if (m := _match(graph, n)) is not None}
    products = {n.name: m for n in graph.nodes() if (m := _match_weight_product(graph, n)) is not None}
    cut = {n.name: m for n in graph.nodes() if (m := _match_pieces(graph, n)) is not None}
    pieces = {name: (linear, rows) for linear, found in cut.items() for name, rows in found.items()}
    dropped = set(cut) | {graph.node(name).args[0].name for name in pieces if graph.node(name).op == "getitem"}
    if not matches and not products and not pieces:
        return graph.copy()

    def rewrite(node: Node, out: Graph) -> Node | None:
        if node.name in dropped:
            return None
        if node.name in pieces:
            linear, (start, end) = pieces[node.name]
            report.rewritten.append(node.name)
            x, weight, *bias = graph.node(linear).args
            rows = [out.add_constant(out.fresh_name(f"{c.name}_{start}_{end}"), graph.constants[c.name][start:end]).name
                    for c in (weight, *bias) if c is not None]
            return Node(node.name, "linear", "aten.linear.default", (x, *map(Ref, rows)), {}, node.spec)
        if node.name in products:
            report.rewritten.append(node.name)
            return _linear_on_unflattened(graph, out, node, *products[node.name])
        if node.name not in matches:
            return node
        flat, weight, bias, transpose = matches[node.name]
        if transpose:  # Conv1D's W [K, N]: linear reads W^T, a new constant
            weight = Ref(out.add_constant(out.fresh_name(f"{weight.name}_t"),
                                          graph.constants[weight.name].t().contiguous()).name)
        report.rewritten.append(node.name)
        return _linear_on_unflattened(graph, out, node, flat, weight, bias)

    return _collapse_views(remove_dead_nodes(graph.rebuild(rewrite)))


def _linear_on_unflattened(graph: Graph, out: Graph, node: Node, x: Ref, *params: Ref) -> Node:
    """``node`` (a GEMM over ``x``) as linear(x, *params). Where x only flattens the leading dims
    of an earlier value (Conv1D's and AOTAutograd's view(x, [M, K]) before the product, through
    any chain of views), the linear reads that value and a view under ``node``'s name flattens
    its result: linears of one input then share it (Q, K and V merge), and a view back to
    [..., N] after it collapses (`_collapse_views`)."""
    source = x
    while graph.node(source.name).op == "view" and isinstance(graph.node(source.name).args[0], Ref):
        source = graph.node(source.name).args[0]  # reshapes of reshapes: one reshape
    flat, spec = graph.node(x.name).spec, graph.node(source.name).spec
    if source == x or not isinstance(spec, TensorSpec) or len(spec.shape) < 3 \
            or tuple(flat.shape) != (math.prod(spec.shape[:-1]), spec.shape[-1]):
        return Node(node.name, "linear", "aten.linear.default", (x, *params), {}, node.spec)
    linear = out.add_node(Node(out.fresh_name(f"{node.name}_linear"), "linear", "aten.linear.default",
                               (source, *params), {}, TensorSpec((*spec.shape[:-1], node.spec.shape[-1]),
                                                                 node.spec.dtype)))
    return Node(node.name, "view", "aten.view.default", (Ref(linear.name), list(node.spec.shape)), {}, node.spec)


def _collapse_views(graph: Graph) -> Graph:
    """``view(view(y, s), shape of y)`` is y: the GEMM's flat output viewed back to [..., N]
    (GPT-2 does) reads the GEMM directly, so its epilogue (GELU, a residual add) fuses."""
    renamed: dict[str, Ref] = {}
    for node in graph.nodes():
        if node.op != "view" or not isinstance(node.args[0], Ref):
            continue
        inner = graph.node(node.args[0].name)
        if inner.op == "view" and isinstance(inner.args[0], Ref) \
                and graph.node(inner.args[0].name).spec == node.spec:
            renamed[node.name] = inner.args[0]
    if not renamed:
        return graph

    def rename(ref: Ref) -> Ref:
        return renamed.get(ref.name, ref)

    def rewrite(node: Node, _: Graph) -> Node | None:
        if node.name in renamed:
            return None
        return replace(node, args=map_refs(node.args, rename), kwargs=map_refs(node.kwargs, rename))

    out = graph.rebuild(rewrite)
    out.outputs = [rename(r) if isinstance(r, Ref) else r for r in graph.outputs]
    return remove_dead_nodes(out)


def _match_pieces(graph: Graph, node: Node) -> dict[str, tuple[int, int]] | None:
    """{piece node: (first row, end row)} when ``node`` is linear(x, W[, b]) with constant W and
    b, read only by slices and splits of its last dimension into at least two pieces."""
    if node.op != "linear" or graph.is_output(node.name) or not isinstance(node.spec, TensorSpec) \
            or not all(isinstance(a, Ref) and graph.node(a.name).op == CONSTANT for a in node.args[1:] if a is not None):
        return None
    last, width, found = len(node.spec.shape) - 1, node.spec.shape[-1], {}
    for user in graph.users(node.name):
        if user.op == "slice" and user.args[0] == Ref(node.name) and len(user.args) > 3 \
                and user.args[1] % (last + 1) == last and (len(user.args) < 5 or user.args[4] == 1):
            start, end = (max(0, min(width, b + width if b < 0 else b))
                          for b in (user.args[2] or 0, width if user.args[3] is None else user.args[3]))
            found[user.name] = (start, end)
        elif user.op == "split" and not graph.is_output(user.name) \
                and all(g.op == "getitem" for g in graph.users(user.name)):
            for getitem in graph.users(user.name):
                dim, offset, size = split_piece(user, node.spec.shape, getitem.args[1])
                if dim != last or size is None:
                    return None
                found[getitem.name] = (offset, offset + size)
        else:
            return None
    return found if len(found) > 1 else None


def _transposed_constant(graph: Graph, ref: object) -> Ref | None:
    """W when ``ref`` names transpose(W) / t(W) / permute(W, [1, 0]) of a constant 2-D W."""
    if not isinstance(ref, Ref):
        return None
    node = graph.node(ref.name)
    if node.op != "transpose" or not isinstance(node.args[0], Ref) \
            or graph.node(node.args[0].name).op != CONSTANT or len(node.spec.shape) != 2:
        return None
    if (node.target or "").startswith("aten.t."):
        swapped = True
    elif isinstance(node.args[1], (list, tuple)):  # permute
        swapped = [d % 2 for d in node.args[1]] == [1, 0]
    else:
        swapped = node.args[1] % 2 != node.args[2] % 2
    return Ref(node.args[0].name) if swapped else None


def _match_weight_product(graph: Graph, node: Node) -> tuple[Ref, Ref] | None:
    """(x, W) when ``node`` is matmul(x, W^T) or mm(x, W^T) (AOTAutograd's form of a linear
    without bias) with W a constant [N, K]."""
    if node.op not in ("matmul", "mm") or not all(isinstance(a, Ref) for a in node.args[:2]):
        return None
    x, weight = node.args[0], _transposed_constant(graph, node.args[1])
    x_spec = graph.node(x.name).spec
    if weight is None or not isinstance(x_spec, TensorSpec) or len(x_spec.shape) < 2:
        return None
    return x, weight


def _match(graph: Graph, node: Node) -> tuple[Ref, Ref, Ref, bool] | None:
    """(x, W, bias, transposed) when ``node`` is addmm(bias, x = view(., [-1, K]), W) with W a
    constant [K, N] (GPT-2's Conv1D; ``transposed``: W^T is a new constant), or addmm(bias, x,
    t(W)) with W a constant [N, K] (AOTAutograd's form of a linear with bias)."""
    if node.op != "addmm" or len(node.args) != 3 or node.kwargs.get("beta", 1) != 1 \
            or node.kwargs.get("alpha", 1) != 1 or not all(isinstance(a, Ref) for a in node.args):
        return None
    bias, flat, weight = node.args
    n = node.spec.shape[-1]
    if tuple(graph.node(bias.name).spec.shape) != (n,):  # a broadcast bias ([1], [M, N]) is not linear's
        return None
    read_as_is = _transposed_constant(graph, weight)
    if read_as_is is not None:
        return flat, read_as_is, bias, False
    if graph.node(weight.name).op != CONSTANT or graph.node(flat.name).op != "view":
        return None
    source = graph.node(flat.name).args[0]
    if not isinstance(source, Ref) or not isinstance(graph.node(source.name).spec, TensorSpec):
        return None
    x_shape, k = graph.node(source.name).spec.shape, graph.node(weight.name).spec.shape[0]
    if len(x_shape) < 2 or x_shape[-1] != k or tuple(graph.node(flat.name).spec.shape)[-1] != k:
        return None
    return flat, weight, bias, True
