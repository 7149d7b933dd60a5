"""Choosing between fusion schemes: take each of the plan's alternative merges (GEMM + LayerNorm
as one group) where a template generates the merged group and it is faster than the two groups
it replaces. Faster by measurement where the tuning database holds measured winners for the
merged group and for every group it replaces (`stof-cc tune` / `tune_model` measure both
sides: stage 2 over schemes), else by stage 1's estimates.

Merges are independent of each other (each folds one reduction group into the GEMM group
that alone feeds it), so they are judged one at a time and applied together. Where measured
(only then), a GEMM group whose linear and epilogue apart beat it is cut in two, the linear
then running in cuBLAS or the generated GEMM, whichever measured faster (tune/library.py).

Then every group that no template generates whole is split (`split_refused`): a refusal ends
the group at the op a template cannot take, it does not send the whole group to torch. The
largest run of the group's nodes, in graph order and holding its anchor, that a template
generates becomes the group; what is left before and after it is split the same way (an
elementwise run, or a single op that then runs in torch). Cutting a group at a point of its
graph order never makes a cycle: no path leaves the group and comes back. An attention group
keeps only its views and rotary nodes before the attention (what its step runs without torch
kernels); any other op there (Cohere's interleaved rotary, a per-head norm's epilogue) starts
a group of its own, split the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import stof_cc.templates.builtin  # noqa: F401 (registers the built-in templates before they are chosen)
from stof_cc.ir.graph import Graph
from stof_cc.passes.fusion import (
    VIEW_OPS,
    FusionGroup,
    FusionPlan,
    FusionScheme,
    in_dependency_order,
    sub_group,
)
from stof_cc.templates.group import applicable_templates
from stof_cc.templates.pricing import sm_count, target_capability
from stof_cc.tune.library import library_split


def best_estimate(graph: Graph, group: FusionGroup, capability: tuple[int, int], sms: int) -> float:
    """The lowest stage-1 estimate (us) of any template point for ``group`` on this GPU;
    infinity when no template generates it (it would run in torch)."""
    found, _ = applicable_templates(graph, group, capability)
    return min((a.template.estimate(a.problem, params, sms) for a in found for params in a.space), default=math.inf)


def choose_scheme(graph: Graph, plan: FusionPlan, capability: tuple[int, int] | None = None,
                  measured: Callable[[FusionGroup], float | None] | None = None) -> FusionPlan:
    """A copy of ``plan`` with ``chosen`` set (and ``choices``, one line per alternative saying
    what was decided and why); ``plan`` itself is not changed. ``capability``: the target GPU's
    (default: the current one's, else the H100's). ``measured``: a group's measured best time
    (us) or None, e.g. `stof_cc.tune.model.measured_times` over a tuning database."""
    capability = capability or target_capability()
    sms = sm_count()
    groups = list(plan.default.groups)
    choices = []
    for label, alternative in plan.alternatives:
        merged = next(g for g in alternative.groups if g not in plan.default.groups)
        replaced = [g for g in plan.default.groups if g not in alternative.groups]
        times = [measured(g) for g in (merged, *replaced)] if measured is not None else []
        if times and None not in times:
            how, fused_us, apart_us = "measured", times[0], sum(times[1:])
        else:
            how = "estimated"
            fused_us = best_estimate(graph, merged, capability, sms)
            apart_us = sum(best_estimate(graph, g, capability, sms) for g in replaced)
        if fused_us < apart_us:
            at = groups.index(replaced[0])
            groups = [g for g in groups if g not in replaced]
            groups.insert(at, merged)
            choices.append(f"{label}: merged ({fused_us:.1f} us {how} against {apart_us:.1f} us apart)")
        else:
            why = "no template generates it" if math.isinf(fused_us) \
                else f"merged {fused_us:.1f} us {how} against {apart_us:.1f} us apart"
            choices.append(f"{label}: kept apart ({why})")
    if measured is not None:  # cuBLAS and a generated epilogue, where measured faster than the fused GEMM
        groups, apart = library_split(graph, groups, measured)
        choices += apart
    groups, splits = split_refused(graph, groups, capability)
    # a merged or split group may read later ones: dependency order
    return dataclasses.replace(plan, chosen=FusionScheme(in_dependency_order(graph, groups)), choices=choices + splits)


def split_refused(graph: Graph, groups: list[FusionGroup],
                  capability: tuple[int, int]) -> tuple[list[FusionGroup], list[str]]:
    """``groups`` with each one no template generates whole split into the largest generated
    part and the rest (module docstring), and a line per split saying what became of it."""
    out, notes = [], []
    for group in groups:
        pieces = _split(graph, group, capability)
        if len(pieces) > 1:
            made = ", ".join(f"{p.name} [{' '.join(graph.node(n).op for n in p.nodes)}]" for p in pieces)
            notes.append(f"{group.name}: no template generates it whole; split into {made}")
        out += pieces
    return out, notes


def _split(graph: Graph, group: FusionGroup, capability: tuple[int, int]) -> list[FusionGroup]:
    """``group`` itself when a template generates it whole or no part of it is generated either
    (torch runs it the same), else its pieces."""
    nodes = group.nodes
    if group.kind == "attention":
        return _split_attention(graph, group, capability)
    if group.kind == "opaque" or len(nodes) == 1 or _generated(graph, group, capability):
        return [group]
    anchor = nodes.index(group.anchor) if group.anchor is not None else None
    spans = [(i, j) for i in range(len(nodes)) for j in range(i + 1, len(nodes) + 1)
             if (i, j) != (0, len(nodes)) and (anchor is None or i <= anchor < j)]
    spans.sort(key=lambda span: (span[0] - span[1], span[0]))  # largest first, then earliest
    for i, j in spans:
        core = sub_group(graph, group, nodes[i:j], "b")
        if _generated(graph, core, capability):
            break
    else:  # nothing with the anchor is generated: the anchor (or the first op) alone, the rest split
        i = anchor if anchor is not None else 0
        j = i + 1
        core = sub_group(graph, group, nodes[i:j], "b")
    before = _split(graph, sub_group(graph, group, nodes[:i], "a"), capability) if i else []
    after = _split(graph, sub_group(graph, group, nodes[j:], "c"), capability) if j < len(nodes) else []
    pieces = before + [core] + after
    return pieces if any(_generated(graph, p, capability) for p in pieces) else [group]


def _split_attention(graph: Graph, group: FusionGroup, capability: tuple[int, int]) -> list[FusionGroup]:
    """The attention group whole when only views and rotary nodes come before its anchor, else
    what comes before split off as its own (possibly generated) groups."""
    at = group.nodes.index(group.anchor)
    before = group.nodes[:at]
    if all(graph.node(n).op in VIEW_OPS or graph.node(n).op == "rotary" for n in before):
        return [group]
    pieces = [_split(graph, sub_group(graph, group, nodes, f"a{i}"), capability)
              for i, nodes in enumerate(_per_operand(graph, group, before), start=1) if nodes]
    return [p for split in pieces for p in split] + [sub_group(graph, group, group.nodes[at:], "b")]


def _per_operand(graph: Graph, group: FusionGroup, before: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The attention prologue as its shared part (what two operands read, first), then each
    operand's own chain (Cohere's q and k: cast, rotation, cast each), in graph order; the whole
    prologue as one part when some node feeds no operand (it might read an operand's chain)."""
    inside = set(before)
    cones = []
    for ref in graph.node(group.anchor).refs():
        cone, todo = set(), [ref.name]
        while todo:
            name = todo.pop()
            if name in inside and name not in cone:
                cone.add(name)
                todo += [r.name for r in graph.node(name).refs()]
        cones.append(cone)
    if set().union(*cones) != inside:
        return [before]
    shared = {n for n in inside if sum(n in cone for cone in cones) > 1}
    return [tuple(n for n in before if n in shared)] + [tuple(n for n in before if n in cone and n not in shared)
                                                        for cone in cones]


def _generated(graph: Graph, group: FusionGroup, capability: tuple[int, int]) -> bool:
    found, _ = applicable_templates(graph, group, capability)
    return bool(found)
