"""The first pass: remove what inference does not compute, fold what does not depend on inputs.

* ``dropout`` in eval mode (``train=False``) is the identity: its users read its input.
* A ``cast`` whose output has its input's dtype and shape is the identity (device moves
  are no-ops here: the interpreter and the runtime place every value on the run's device).
* ``assert_metadata`` checks (``aten._assert_tensor_metadata``) are dropped when nothing
  reads them.
* A node whose every input is a constant is evaluated once, on the CPU, and becomes a
  constant (transformers builds its mask index grids this way), unless its result is
  larger than ``fold_limit`` elements or it draws random numbers or reads uninitialised
  memory.
* Nodes no output depends on are removed.

In-place ops (``add_``, ``fill_``: torch.export keeps some, e.g. T5's position buckets) are
first made functional where that is exact: the mutated value is a fresh tensor (made by a
computing op, not an input, a constant or a view) that no view reads, so the op becomes its
out-of-place overload and every later reader reads its result. A graph with an in-place op
that cannot be rewritten so (``m[:, :2] = 1`` writes through a view) is returned unchanged,
with the reason in the report: removing or folding around a mutation would change what the
mutated tensor's readers see.

Pure: the input graph is never modified; pass a `CanonicalizeReport` to learn what was done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx
import torch

from stof_cc.ir.graph import (
    CONSTANT,
    INPUT,
    Graph,
    GraphError,
    Node,
    Ref,
    TensorSpec,
)
from stof_cc.ir.node import iter_refs, map_refs
from stof_cc.ir.ops import OPAQUE, reference_of, resolve_target

#: Ops whose result torch makes as a view of their input (no copy).
VIEW_OPS = frozenset({"view", "transpose", "expand", "unsqueeze", "squeeze", "slice", "select", "split", "getitem"})

FOLD_LIMIT = 1 << 20  # elements: larger constant results stay computed at run time
_UNINITIALISED_TARGETS = ("aten.empty", "aten.new_empty")


@dataclass
class CanonicalizeReport:
    """What the pass did, by node name of the input graph."""

    identities: list[str] = field(default_factory=list)  # dropout / no-op casts bypassed
    dropped_checks: list[str] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    skipped: str = ""  # why the graph was left as it is, if it was

    def __str__(self) -> str:
        if self.skipped:
            return f"canonicalize: skipped: {self.skipped}"
        return (f"canonicalize: {len(self.identities)} identities bypassed, {len(self.dropped_checks)} checks "
                f"dropped, {len(self.folded)} nodes folded to constants, {len(self.dead)} dead nodes removed")


def canonicalize(graph: Graph, fold_limit: int = FOLD_LIMIT, report: CanonicalizeReport | None = None) -> Graph:
    """A canonical copy of ``graph``; ``report``, if given, is filled with what changed."""
    report = report if report is not None else CanonicalizeReport()
    graph, refused = functionalize(graph)
    if refused:
        report.skipped = f"in-place ops ({', '.join('%' + n for n in refused[:3])}) mutate values other nodes read"
        return graph.copy()
    out = Graph(graph.name)
    out.in_spec, out.out_spec = graph.in_spec, graph.out_spec
    renamed: dict[str, Any] = {}  # input-graph name -> the Ref (or value) that replaces it

    def rename(ref: Ref) -> Any:
        return renamed.get(ref.name, ref)

    for node in graph.nodes():
        if node.op == INPUT:
            out.add_input(node.name, node.spec)
            continue
        if node.op == CONSTANT:
            out.add_constant(node.name, graph.constants[node.name], node.target)
            continue
        args, kwargs = map_refs(node.args, rename), map_refs(node.kwargs, rename)
        if node.op == "transpose" and len(args) == 1:  # x.t(), x.T: every dim reversed, as a permute
            node = replace(node, target="aten.permute.default")
            args = (args[0], list(reversed(range(len(node.spec.shape)))))
        if node.op == "slice" and (node.target or "").startswith("aten.narrow") and len(args) == 4 \
                and all(isinstance(a, int) for a in args[1:]):  # narrow(x, dim, start, length): a slice's end
            size = out.node(args[0].name).spec.shape[args[1]] if isinstance(args[0], Ref) else None
            if size is not None:  # passes read a slice's args[3] as its end (narrow's length: found by review)
                start = args[2] + size if args[2] < 0 else args[2]
                node, args = replace(node, target="aten.slice.Tensor"), (args[0], args[1], start, start + args[3], 1)
        if node.op == "gather" and (piece := _index_as_slice(out, node, args)) is not None:
            node, args, kwargs = replace(node, op="slice", target="aten.slice.Tensor"), piece, {}
        if node.op == "cat":  # empty pieces add nothing (Phi-3's rotary: q[..., D:] is empty)
            args = (_without_empty_pieces(out, args[0], node.spec.dtype), *args[1:])
        if isinstance(node.spec, TensorSpec) and node.spec.numel == 0:  # no data: whatever computed it
            out.add_constant(node.name, torch.empty(node.spec.shape, dtype=node.spec.dtype))
            report.folded.append(node.name)
        elif node.op == "cat" and len(args[0]) == 1 and isinstance(args[0][0], Ref) \
                and out.node(args[0][0].name).spec == node.spec and not _keeps_its_copy(graph, node, args[0][0]):
            renamed[node.name] = args[0][0]
            report.identities.append(node.name)
        elif _is_identity(graph, node):
            renamed[node.name] = args[0]
            report.identities.append(node.name)
        elif node.op == "assert_metadata" and not graph.users(node.name) and not graph.is_output(node.name):
            report.dropped_checks.append(node.name)
        else:
            value = _fold(out, node, args, kwargs, fold_limit)
            if value is not None:
                out.add_constant(node.name, value)
                report.folded.append(node.name)
            else:
                out.add_node(_over_the_last_dim(out, replace(node, args=args, kwargs=kwargs)))
    out.outputs = [rename(r) if isinstance(r, Ref) else r for r in graph.outputs]
    return remove_dead_nodes(out, report.dead)


def mutating_nodes(graph: Graph) -> list[str]:
    """Names of nodes whose op writes into one of its inputs, as its schema says: an ATen overload's,
    or a registered custom op's (``mutates_args``: one that returns nothing was removed as dead, and
    the write lost, while only ATen was read)."""
    names = []
    for node in graph.nodes():
        if node.target is None or node.target.startswith("operator."):
            continue
        try:
            overload = resolve_target(node.target)
        except GraphError:
            continue
        schema = getattr(overload, "_schema", None)
        if schema is not None and schema.is_mutable:
            names.append(node.name)
    return names


def functionalize(graph: Graph) -> tuple[Graph, list[str]]:
    """``graph`` with its in-place ops made out-of-place where that is exact (see the module
    docstring), and the names of those that are not (then ``graph`` comes back as it is)."""
    mutating = mutating_nodes(graph)
    if not mutating:
        return graph, []
    refused = [name for name in mutating if not _functional_target(graph, graph.node(name))]
    if refused:
        return graph, refused
    order = list(graph.nx_graph.nodes)  # program order (insertion): who reads before or after a write
    out = Graph(graph.name)
    out.in_spec, out.out_spec = graph.in_spec, graph.out_spec
    current: dict[str, str] = {}  # mutated value -> the node holding its latest contents

    def latest(ref: Ref) -> Ref:
        return Ref(current.get(ref.name, ref.name))

    for name in order:
        node = graph.node(name)
        if node.op == INPUT:
            out.add_input(name, node.spec)
        elif node.op == CONSTANT:
            out.add_constant(name, graph.constants[name], node.target)
        else:
            args, kwargs = map_refs(node.args, latest), map_refs(node.kwargs, latest)
            if name in mutating:
                out.add_node(replace(node, target=_functional_target(graph, node), args=args, kwargs=kwargs))
                current[node.args[0].name] = name
            else:
                out.add_node(replace(node, args=args, kwargs=kwargs))
    out.outputs = [latest(r) if isinstance(r, Ref) else r for r in graph.outputs]
    return out, []


def _functional_target(graph: Graph, node: Node) -> str | None:
    """The out-of-place overload of an in-place ``node`` (``aten.add_.Tensor`` -> ``aten.add.Tensor``)
    when rewriting to it is exact: it writes its first argument, a fresh tensor no view reads."""
    namespace, name, overload = node.target.split(".", 2)
    if not name.endswith("_") or not node.args or not isinstance(node.args[0], Ref):
        return None
    target = f"{namespace}.{name[:-1]}.{overload}"
    try:
        functional = resolve_target(target)
    except GraphError:
        return None
    written = graph.node(node.args[0].name)
    if functional._schema.is_mutable or written.op in (INPUT, CONSTANT) or _aliases(written, graph):
        return None
    if _result_dtype(graph, functional, node) != getattr(written.spec, "dtype", None):
        return None  # it promotes where the in-place op casts back (bf16 += fp32): found by a helper's fuzzing
    readers = [u for u in graph.users(written.name) if u.name != node.name]
    return None if any(_aliases(u, graph) for u in readers) else target


def _result_dtype(graph: Graph, functional: Any, node: Node) -> torch.dtype | None:
    """The dtype ``functional`` gives on ``node``'s arguments (run on meta tensors of their specs);
    None where that cannot be told."""
    def meta(ref: Ref) -> Any:
        spec = graph.node(ref.name).spec
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"%{ref.name} is not one tensor")
        return torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    try:
        result = functional(*map_refs(node.args, meta), **map_refs(node.kwargs, meta))
    except Exception:  # noqa: BLE001 (an op meta cannot run, or a non-tensor operand: not rewritten)
        return None
    return result.dtype if isinstance(result, torch.Tensor) else None


# Ops that return their input though their schema does not say so: waiting on a collective hands back its buffer
_UNANNOTATED_ALIASES = frozenset({"_c10d_functional.wait_tensor.default", "c10d_functional.wait_tensor.default"})


def _aliases(node: Node, graph: Graph | None = None) -> bool:
    """Whether ``node``'s result may share memory with an input (a view, or an op with no schema);
    a piece of a multi-output op's result (``getitem``) aliases where that op's result does
    (split's pieces are views, topk's values are fresh). An ATen op or a registered custom op
    (``torch.library``: transformers' ``grouped_mm_fallback``, whose output GPT-OSS adds its expert
    bias to in place) says so in its schema's alias annotations, which torch's own
    functionalization trusts too; before, every custom op counted as a view, so GPT-OSS kept its
    in-place adds and ran every group in torch."""
    if node.target == "operator.getitem" and graph is not None and isinstance(node.args[0], Ref):
        return _aliases(graph.node(node.args[0].name), graph)
    if node.op == "cast" and graph is not None and isinstance(node.args[0], Ref) \
            and isinstance(node.spec, TensorSpec) and graph.node(node.args[0].name).spec.dtype != node.spec.dtype:
        return False  # `.to(dtype)` returns its input only where the dtype is already that one (transformers
        # 5.17's MoE clamps expert ids in place that a `.to(float32)` read: the whole graph kept the clamp)
    if node.target is None or node.target.startswith("operator.") or node.target in _UNANNOTATED_ALIASES:
        return node.op not in (INPUT, CONSTANT)
    try:
        schema = resolve_target(node.target)._schema
    except (GraphError, AttributeError):  # no such op, or a callable with no schema
        return True
    return any(r.alias_info is not None for r in schema.returns)


def _pure_aten(target: str | None) -> bool:
    """An ATen overload that writes none of its inputs and returns no alias of one."""
    if target is None or not target.startswith("aten."):
        return False
    try:
        schema = resolve_target(target)._schema
    except GraphError:
        return False
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def _draws_random(target: str) -> bool:
    try:
        overload = resolve_target(target)
    except GraphError:
        return True  # unknown: do not fold
    return torch.Tag.nondeterministic_seeded in getattr(overload, "tags", ())


def _index_as_slice(out: Graph, node: Node, args: tuple) -> tuple | None:
    """slice(x, dim, start, end) when ``node`` is x[..., idx] (aten.index) with idx a constant run
    of consecutive integers on one dimension (Falcon's ``qkv[..., [-2], :]``): a view, not a gather."""
    if node.target != "aten.index.Tensor" or len(args) != 2 or not isinstance(args[1], (list, tuple)):
        return None
    used = [(d, i) for d, i in enumerate(args[1]) if i is not None]
    if len(used) != 1 or not isinstance(used[0][1], Ref) or out.node(used[0][1].name).op != CONSTANT:
        return None
    dim, index = used[0][0], out.constants[used[0][1].name]
    size = out.node(args[0].name).spec.shape[dim] if isinstance(args[0], Ref) else None
    if size is None or index.dim() != 1 or index.dtype not in (torch.int64, torch.int32) or not len(index):
        return None
    values = [v % size for v in index.tolist()]
    if values != list(range(values[0], values[0] + len(values))):
        return None
    return (args[0], dim, values[0], values[0] + len(values))


ROW_VALUE_OPS = ("sum", "mean", "amax", "var")  # what templates/row_reduce.py reduces to one value per row


# A reduction over a middle dimension shorter than this stays as it is: as rows of a permuted view its
# rows are a few elements each, far apart in memory (an MoE's sum over its 2 experts per token,
# [T, 2, H].sum(1), took 0.95 ms in row_reduce on an H200 where torch's reduction reads it in microseconds)
SHORT_ROW = 32


def _over_the_last_dim(out: Graph, node: Node) -> Node:
    """A sum / mean / amax / var over one dimension that is not the last (mean pooling over
    tokens) as the same reduction over the last dimension of a permuted view (added to ``out``),
    viewed back where keepdim puts the 1 elsewhere: the form row_reduce generates. Else (also where
    that dimension is shorter than `SHORT_ROW`) ``node``."""
    if node.op not in ROW_VALUE_OPS or not isinstance(node.spec, TensorSpec) or not node.args \
            or not isinstance(node.args[0], Ref) or (node.op == "var" and node.target != "aten.var.correction"):
        return node  # (var.dim's third argument is unbiased, not keepdim: left as it is)
    rank = len(out.node(node.args[0].name).spec.shape)
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else dims
    if rank < 2 or not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] % rank == rank - 1:
        return node
    dim = dims[0] % rank
    x_spec = out.node(node.args[0].name).spec
    if x_spec.shape[dim] < SHORT_ROW:  # torch's own reduction then (row_reduce takes the last dim alone)
        return node
    order = [d for d in range(rank) if d != dim] + [dim]
    moved = out.add_node(Node(out.fresh_name(f"{node.name}_moved"), "transpose", "aten.permute.default",
                              (node.args[0], order), {}, TensorSpec(tuple(x_spec.shape[d] for d in order), x_spec.dtype)))
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    args = (Ref(moved.name), *([[-1]] if len(node.args) > 1 else []), *([False] if len(node.args) > 2 else []),
            *node.args[3:])  # each argument where the node had it (var takes keepdim by keyword)
    kwargs = node.kwargs | ({"dim": [-1]} if "dim" in node.kwargs else {}) | (
        {"keepdim": False} if "keepdim" in node.kwargs else {})
    reduced_shape = tuple(s for d, s in enumerate(x_spec.shape) if d != dim)
    reduced = Node(node.name if not keepdim else out.fresh_name(f"{node.name}_last"), node.op, node.target,
                   args, kwargs, TensorSpec(reduced_shape, node.spec.dtype))
    if not keepdim:
        return reduced
    out.add_node(reduced)
    return Node(node.name, "view", "aten.view.default", (Ref(reduced.name), list(node.spec.shape)), {}, node.spec)


def _without_empty_pieces(out: Graph, pieces: list, dtype: torch.dtype) -> list:
    """cat's pieces without those that hold no element, where the rest still promote to its
    ``dtype`` (an empty fp32 KV cache before fp16 keys makes the cat fp32: found by a helper's fuzzing)."""
    specs = [out.node(p.name).spec if isinstance(p, Ref) else None for p in pieces]
    if not all(isinstance(spec, TensorSpec) for spec in specs):
        return list(pieces)
    kept = [p for p, spec in zip(pieces, specs, strict=True) if spec.numel]
    kept_dtypes = [spec.dtype for spec in specs if spec.numel]
    if not kept:
        return list(pieces[:1])
    promoted = kept_dtypes[0]
    for other in kept_dtypes[1:]:
        promoted = torch.promote_types(promoted, other)
    return kept if promoted == dtype else list(pieces)


def _is_identity(graph: Graph, node: Node) -> bool:
    if node.op == "dropout":
        train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
        return train is False
    if node.op in ("clone", "cast"):  # values, not storage: a kernel copies what it must read contiguously;
        source = graph.node(node.args[0].name) if node.args and isinstance(node.args[0], Ref) else None
        if source is None or (node.op == "cast" and not (isinstance(source.spec, TensorSpec) and source.spec == node.spec)):
            return False
        if node.op == "cast" and not _copies(node):  # `w.to(dtype)` of a w in that dtype is w itself, as in eager
            return True
        return not _keeps_its_copy(graph, node, node.args[0])
    return False


def _keeps_its_copy(graph: Graph, copy: Node, source: Ref) -> bool:
    """Whether a copy (a clone, a copying cast, a one-piece cat) must stay one: where it copies an input or
    a weight, or a view of one (a result must never share their storage: a review found `x.to(dtype,
    copy=True)` handing back the caller's x, and `torch.cat([x])` too), or where the copy, or a view of it,
    is a graph output (`y.clone().view(-1), y` made the two outputs share storage: found by review)."""
    if source.name not in graph:  # a piece the rewrite made (an emptied cat's): keep the copy, the safe side
        return True
    node = graph.node(source.name)
    while node.op in VIEW_OPS and node.args and isinstance(node.args[0], Ref):
        node = graph.node(node.args[0].name)
    if node.op in (INPUT, CONSTANT):
        return True
    pending = [copy.name]
    while pending:
        name = pending.pop()
        if graph.is_output(name):
            return True
        pending += [user.name for user in graph.users(name) if user.op in VIEW_OPS]
    return False


def _copies(cast: Node) -> bool:
    """Whether a cast makes a copy: `aten._to_copy`, or `aten.to.dtype(x, dtype, non_blocking, copy)` with copy
    true (`aten.to` and `type_as` of a tensor already in the dtype return it)."""
    if cast.target is not None and cast.target.startswith("aten._to_copy"):
        return True
    return bool(cast.kwargs.get("copy", cast.args[3] if cast.target == "aten.to.dtype" and len(cast.args) > 3 else False))


def _fold(out: Graph, node: Node, args: Any, kwargs: Any, fold_limit: int) -> torch.Tensor | None:
    """The node's value if it depends on constants only and is worth keeping as one."""
    if not isinstance(node.spec, TensorSpec) or node.spec.numel > fold_limit:
        return None
    if node.op == OPAQUE and not _pure_aten(node.target):  # e.g. cos/sin of a rotary table fold; unknown ops do not
        return None
    if node.target is not None and (node.target.startswith(_UNINITIALISED_TARGETS) or _draws_random(node.target)):
        return None
    if any(out.node(r.name).op != CONSTANT for r in iter_refs((args, kwargs))):
        return None
    if node.op == "transpose" and any(out.node(r.name).target is not None for r in iter_refs(args)):
        return None  # a model weight transposed (Falcon's x @ W.T): a copy of it gains nothing, GEMMs read W

    def value_of(ref: Ref) -> torch.Tensor:  # on the CPU, with the device literals: a model traced on a
        return out.constants[ref.name].cpu()  # GPU holds its parameters there (GPT-2's position table)

    cpu = torch.device("cpu")
    on_cpu = lambda v: cpu if isinstance(v, torch.device) else v  # noqa: E731
    call_args = [on_cpu(a) for a in map_refs(args, value_of)]
    call_kwargs = {k: on_cpu(v) for k, v in map_refs(kwargs, value_of).items()}
    with torch.no_grad():
        value = reference_of(node)(*call_args, **call_kwargs)
    if not isinstance(value, torch.Tensor) or TensorSpec.of(value) != node.spec:
        return None
    return value.contiguous() if not value.is_contiguous() else value


def remove_dead_nodes(graph: Graph, removed: list[str] | None = None) -> Graph:
    """A copy keeping inputs and every node an output depends on; appends the others' names
    to ``removed``."""
    live: set[str] = set()
    nxg = graph.nx_graph
    for r in graph.outputs:
        if isinstance(r, Ref):
            live.add(r.name)
            live |= nx.ancestors(nxg, r.name)
    out = Graph(graph.name)
    out.in_spec, out.out_spec = graph.in_spec, graph.out_spec
    for node in graph.nodes():
        if node.op == INPUT or node.name in live:
            if node.op == CONSTANT:
                out.add_constant(node.name, graph.constants[node.name], node.target)
            else:
                out.add_node(node)
        elif removed is not None:
            removed.append(node.name)
    out.outputs = list(graph.outputs)
    return out


def replace_matches(graph: Graph, match: Callable[[Graph, Node], Any],
                    build: Callable[[Node, Any], Node], rewritten: list[str]) -> Graph:
    """A copy of ``graph`` in which each node that ``match(graph, node)`` answers (not None)
    becomes ``build(node, answer)`` (keeping its name, so readers do not change), and the
    nodes only the old ones read go away. The names replaced are appended to ``rewritten``.
    The recognition rules (passes/rules.py) and the GQA pass build on this."""
    found = {}
    for node in graph.nodes():
        answer = match(graph, node)
        if answer is not None:
            found[node.name] = answer
            rewritten.append(node.name)
    if not found:
        return graph.copy()
    return remove_dead_nodes(graph.rebuild(lambda node, _: build(node, found[node.name]) if node.name in found
                                           else node))
