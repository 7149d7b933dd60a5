"""Fusion partition: group a graph's nodes around anchors, by pattern kind only.

Reads the pattern kinds of ``ir/ops.py`` and the graph's edges, never op names
(docs/architecture.md, "Pattern kinds drive fusion"). Run after the passes (`run_passes`).

* Every ``gemm``, ``attention`` and ``reduction`` node anchors a group of its own; two
  anchors never share a group in the default scheme.
* Epilogue: an anchor's group absorbs the largest region of elementwise, broadcast or
  injective nodes downstream of it from which one value leaves (a kernel writes one output:
  a chain of single consumers, or a DAG that reads the anchor's value several times and
  meets again, like tanh-GELU written out). Each member has one tensor out (a split ends
  it), no member but the last is a graph output, and no member's other inputs depend on the
  group (that would make a cycle).
* Prologue: an elementwise/broadcast/injective node whose users all sit in one anchored
  group joins that group, if its own inputs do not depend on the group.
* Left-over elementwise/broadcast/injective nodes form anchor-less ``elementwise``
  groups (connected runs); anything else (``opaque``) is a group of its own that torch
  runs.

Where several partitions are legal, `FusionPlan.alternatives` lists the others: today one
kind, a ``reduction`` (LayerNorm, softmax) merged into the GEMM group that produces its
input — GEMM + bias + residual + LayerNorm as one group, against GEMM + bias + residual then
LayerNorm. Whether a template can generate the merged group (a row that fits its CTAs, say)
is the template's question, not the partition's. Each alternative is one such merge applied to the default;
`stof_cc.tune.scheme.choose_scheme` picks by the cost model (``plan.scheme``). Templates (`stof_cc.templates`) then generate the groups they match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from stof_cc.ir.graph import CONSTANT, INPUT, Graph, GraphError, Node, TensorSpec
from stof_cc.ir.ops import pattern_kind
from stof_cc.passes.canonicalize import VIEW_OPS, mutating_nodes

ANCHOR_KINDS = ("gemm", "attention", "reduction")
# layout ops torch makes as views of their input (no kernel, no copy): a group of nothing else
# needs no kernel of its own
FOLDABLE_KINDS = ("elementwise", "broadcast", "injective")
MAX_EPILOGUE = 32  # nodes an epilogue region may grow through before it must have closed


class FusionError(GraphError):
    """The partition would be invalid (a bug in this pass, never the user's graph)."""


@dataclass(frozen=True)
class FusionGroup:
    """One future kernel: an anchor (None for an elementwise run) and its nodes in graph order."""

    name: str
    kind: str  # the anchor's kind, "elementwise" for anchor-less runs, "opaque" for torch
    anchor: str | None
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class FusionScheme:
    """A partition of every computed node (inputs and constants excluded) into groups."""

    groups: tuple[FusionGroup, ...]

    def group_of(self, node: str) -> FusionGroup:
        for group in self.groups:
            if node in group.nodes:
                return group
        raise KeyError(f"%{node} is in no group")


@dataclass
class FusionPlan:
    default: FusionScheme
    alternatives: list[tuple[str, FusionScheme]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # why a neighbour stayed out of a group
    chosen: FusionScheme | None = None  # set by stof_cc.tune.scheme.choose_scheme
    choices: list[str] = field(default_factory=list)  # what it decided per alternative, and why

    @property
    def scheme(self) -> FusionScheme:
        """The scheme to generate: the chosen one, else the default."""
        return self.chosen or self.default

    def __str__(self) -> str:
        lines = [f"{'group':<12} {'kind':<11} {'anchor':<24} fused ops"]
        for group in self.scheme.groups:
            others = [n for n in group.nodes if n != group.anchor]
            lines.append(f"{group.name:<12} {group.kind:<11} {group.anchor or '-':<24} {', '.join(others) or '-'}")
        lines += [f"alternative: {label}" for label, _ in self.alternatives]
        lines += [f"chosen: {line}" for line in self.choices]
        lines += [f"not fused: {why}" for why in self.refused]
        return "\n".join(lines)


def partition(graph: Graph) -> FusionPlan:
    """The default fusion scheme of ``graph`` and its alternatives. A graph with in-place ops left
    (writes through views, which canonicalize could not make functional) is not fused: a group per
    node, in the graph's order, since a mutation has no data edge to the readers it must precede or
    follow (ordered by data edges alone, ``z[:, 0] = 0`` ran after a reader of ``z``)."""
    computed = [n for n in graph.nodes() if n.op not in (INPUT, CONSTANT)]
    kind = {n.name: pattern_kind(n.op) for n in computed}
    mutating = mutating_nodes(graph)
    if mutating:
        order = {n.name: i for i, n in enumerate(computed)}
        return FusionPlan(_scheme({n.name: [n.name] for n in computed}, kind, order),
                          refused=[f"nothing fused: in-place ops ({', '.join('%' + m for m in mutating[:3])}) "
                                   "write through views, and every node keeps its place"])
    dag = graph.nx_graph
    owner: dict[str, str] = {}  # node -> anchor (or run) that owns it
    members: dict[str, list[str]] = {}
    refused: list[str] = []

    def depends_on(group: str, node: str) -> bool:
        return any(nx.has_path(dag, m, node) for m in members[group] if m != node)

    for node in computed:  # anchors and their epilogues, in graph order
        if kind[node.name] not in ANCHOR_KINDS:
            continue
        owner[node.name], members[node.name] = node.name, [node.name]
        for name in _epilogue(graph, node.name, kind, owner, lambda n, a=node.name: depends_on(a, n), refused):
            owner[name] = node.name
            members[node.name].append(name)

    for node in reversed(computed):  # prologues: producers read only by one anchored group
        if node.name in owner or kind[node.name] not in FOLDABLE_KINDS:
            continue
        groups = {owner.get(u.name) for u in graph.users(node.name)}
        if len(groups) != 1 or None in groups or graph.is_output(node.name):
            continue
        (group,) = groups
        if any(p.op not in (INPUT, CONSTANT) and depends_on(group, p.name) for p in graph.producers(node.name)):
            refused.append(f"%{node.name} not in {group}'s prologue: its inputs depend on the group")
            continue
        owner[node.name] = group
        members[group].append(node.name)

    runs: set[str] = set()  # leads of anchor-less elementwise runs
    for node in computed:  # left-overs: elementwise runs (merged where a node joins several), opaque singles
        if node.name in owner:
            continue
        owner[node.name], members[node.name] = node.name, [node.name]
        if kind[node.name] not in FOLDABLE_KINDS:
            continue
        runs.add(node.name)
        for producer in graph.producers(node.name):
            run = owner.get(producer.name)
            if run not in runs or run == owner[node.name]:
                continue
            lead = owner[node.name]
            if _path_outside(dag, members[run], members[lead]) or _path_outside(dag, members[lead], members[run]):
                refused.append(f"%{node.name}: runs {run} and {lead} not merged (a path between them leaves both)")
                continue
            for m in members.pop(lead):  # merge this node's run into the producer's
                owner[m] = run
                members[run].append(m)
            runs.discard(lead)

    order = {n.name: i for i, n in enumerate(computed)}
    default = _scheme(members, kind, order)
    _check_acyclic(graph, default)
    default = FusionScheme(in_dependency_order(graph, default.groups))
    plan = FusionPlan(default, refused=refused)
    plan.alternatives = _reduction_merges(graph, default, kind, order)
    return plan


def _epilogue(graph: Graph, anchor: str, kind: dict[str, str], owner: dict[str, str],
              depends_on_group, refused: list[str]) -> list[str]:
    """The anchor's epilogue: the largest region of foldable nodes, grown from the anchor one
    user at a time in graph order, from which exactly one value leaves (every other member is
    read only inside the region). A chain is the simple case; a DAG that reads the anchor's
    value several times and meets again (tanh-GELU written out: ``0.5 x (1 + tanh(c (x + a
    x^3)))``) is the reason for the region."""
    order = {n.name: i for i, n in enumerate(graph.nodes())}
    region, inside, best, why = [anchor], {anchor}, [], {}

    def addable(user: Node) -> bool:
        if user.name in inside or user.name in owner or kind.get(user.name) not in FOLDABLE_KINDS:
            return False
        if not isinstance(user.spec, TensorSpec):
            why[user.name] = f"it has {len(user.spec or ())} outputs"
            return False
        late = [p.name for p in graph.producers(user.name) if p.name not in inside and p.name not in owner
                and p.op not in (INPUT, CONSTANT) and depends_on_group(p.name)]
        if late:
            why[user.name] = f"its input %{late[0]} depends on the group"
            return False
        return True

    while len(region) <= MAX_EPILOGUE:
        leaving = [m for m in region if graph.is_output(m) or any(u.name not in inside for u in graph.users(m))]
        if len(leaving) == 1 and len(region) > 1:
            best = region[1:]
        outputs = [m for m in leaving if graph.is_output(m)]
        if outputs:  # a graph output must be the region's one value: it cannot be read inside
            why.update({u.name: f"%{outputs[0]} is a graph output" for u in graph.users(outputs[0])
                        if u.name not in inside})
            break
        users = sorted({u.name: u for m in leaving for u in graph.users(m) if addable(u)}.values(),
                       key=lambda u: order[u.name])
        if not users:
            break
        region.append(users[0].name)
        inside.add(users[0].name)
    refused += [f"%{user} not in {anchor}'s epilogue: {reason}" for user, reason in why.items() if user not in best]
    return best


def _path_outside(dag: nx.DiGraph, source: list[str], target: list[str]) -> bool:
    """Whether a path from ``source`` to ``target`` passes through a node in neither: merging
    the two would then make a cycle."""
    both = set(source) | set(target)
    downstream = set().union(*(nx.descendants(dag, n) for n in source)) - both
    upstream = set().union(*(nx.ancestors(dag, n) for n in target)) - both
    return bool(downstream & upstream)


def _scheme(members: dict[str, list[str]], kind: dict[str, str], order: dict[str, int]) -> FusionScheme:
    groups = []
    for lead, nodes in sorted(members.items(), key=lambda item: order[item[0]]):
        lead_kind = kind[lead]
        if lead_kind in ANCHOR_KINDS:
            group_kind, anchor = lead_kind, lead
        elif lead_kind in FOLDABLE_KINDS:
            group_kind, anchor = "elementwise", None
        else:
            group_kind, anchor = "opaque", None
        groups.append(FusionGroup(f"g{len(groups)}", group_kind, anchor, tuple(sorted(nodes, key=order.get))))
    return FusionScheme(tuple(groups))


def is_views(graph: Graph, group: FusionGroup) -> bool:
    """Whether ``group`` holds only ops torch makes as views (`VIEW_OPS`)."""
    return all(graph.node(n).op in VIEW_OPS for n in group.nodes)


def in_dependency_order(graph: Graph, groups: tuple[FusionGroup, ...] | list[FusionGroup]) -> tuple[FusionGroup, ...]:
    """``groups`` ordered so every group runs after the groups it reads from (a topological
    order of the quotient graph; ties keep the given order). Ordering by each group's first
    node is not enough: a merged or prologue-grown group can read a group whose first node
    comes later."""
    position = {g.name: i for i, g in enumerate(groups)}
    by_name = {g.name: g for g in groups}
    quotient = _quotient(graph, FusionScheme(tuple(groups)))
    return tuple(by_name[name] for name in nx.lexicographical_topological_sort(quotient, key=position.get))


def _quotient(graph: Graph, scheme: FusionScheme) -> nx.DiGraph:
    where = {n: g.name for g in scheme.groups for n in g.nodes}
    quotient = nx.DiGraph()
    quotient.add_nodes_from(g.name for g in scheme.groups)
    for producer, consumer in graph.nx_graph.edges:
        if producer in where and consumer in where and where[producer] != where[consumer]:
            quotient.add_edge(where[producer], where[consumer])
    return quotient


def _check_acyclic(graph: Graph, scheme: FusionScheme) -> None:
    quotient = _quotient(graph, scheme)
    if not nx.is_directed_acyclic_graph(quotient):
        cycle = " -> ".join(a for a, _ in nx.find_cycle(quotient))
        raise FusionError(f"fusion groups form a cycle ({cycle}): a bug in stof_cc.passes.fusion")


def _reduction_merges(graph: Graph, scheme: FusionScheme, kind: dict[str, str],
                      order: dict[str, int]) -> list[tuple[str, FusionScheme]]:
    """Each reduction group merged into the GEMM group whose output it alone reads."""
    alternatives = []
    for group in scheme.groups:
        if group.kind != "reduction":
            continue
        reduction = graph.node(group.anchor)
        row = _row_length(reduction)
        source = next((r for r in reduction.refs() if graph.node(r.name).op not in (INPUT, CONSTANT)), None)
        if source is None or row is None:
            continue
        producer = scheme.group_of(source.name)
        if producer.kind != "gemm" or source.name != producer.nodes[-1] or len(graph.users(source.name)) != 1:
            continue
        merged = FusionGroup(producer.name, "gemm", producer.anchor,
                             tuple(sorted(producer.nodes + group.nodes, key=order.get)))
        candidate = FusionScheme(tuple(merged if g is producer else g for g in scheme.groups if g is not group))
        if nx.is_directed_acyclic_graph(_quotient(graph, candidate)):
            candidate = FusionScheme(in_dependency_order(graph, candidate.groups))
            alternatives.append((f"{producer.anchor} + {group.anchor} (row {row})", candidate))
    return alternatives


def _row_length(node: Node) -> int | None:
    spec = node.spec[0] if isinstance(node.spec, tuple) else node.spec
    return spec.shape[-1] if isinstance(spec, TensorSpec) and spec.shape else None


def sub_group(graph: Graph, group: FusionGroup, nodes: tuple[str, ...], suffix: str) -> FusionGroup:
    """``nodes`` of ``group`` as a group of their own: anchored by the group's anchor or by the
    first anchor-kind op among them, else an elementwise run (or one opaque op)."""
    name = f"{group.name}{suffix}"
    if group.anchor in nodes:
        return FusionGroup(name, group.kind, group.anchor, nodes)
    kinds = {n: pattern_kind(graph.node(n).op) for n in nodes}
    anchor = next((n for n in nodes if kinds[n] in ANCHOR_KINDS), None)
    if anchor is not None:
        return FusionGroup(name, kinds[anchor], anchor, nodes)
    kind = "elementwise" if all(k in FOLDABLE_KINDS for k in kinds.values()) else "opaque"
    return FusionGroup(name, kind, None, nodes)
