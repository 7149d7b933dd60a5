"""Choosing between fusion schemes: take each of the plan's alternative merges (GEMM + LayerNorm
as one group) where a template generates the merged group and it is faster than the two groups
it replaces. Faster by measurement where the tuning database holds measured winners for the
merged group and for every group it replaces (`stof-cc tune` / `tune_model` measure both
sides: stage 2 over schemes), else by stage 1's estimates.

Merges are independent of each other (each folds one reduction group into the GEMM group
that alone feeds it), so they are judged one at a time and applied together.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from stof_cc.ir.graph import Graph
from stof_cc.passes.fusion import FusionGroup, FusionPlan, FusionScheme, in_dependency_order
from stof_cc.templates.group import applicable_templates
from stof_cc.templates.pricing import sm_count, target_capability


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
            why = "no template generates it" if math.isinf(fused_us) else f"{fused_us:.1f} us {how} against {apart_us:.1f}"
            choices.append(f"{label}: kept apart ({why})")
    # the merged group may read later ones: dependency order
    return dataclasses.replace(plan, chosen=FusionScheme(in_dependency_order(graph, groups)), choices=choices)
