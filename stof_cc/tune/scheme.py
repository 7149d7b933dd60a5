"""Choosing between fusion schemes: take each of the plan's alternative merges (GEMM + LayerNorm
as one group) where a template generates the merged group and it is faster than the two groups
it replaces. Faster by measurement where the tuning database holds measured winners for the
merged group and for every group it replaces (`stof-cc tune` / `tune_model` measure both
sides: stage 2 over schemes), else by stage 1's estimates.

Merges are independent of each other (each folds one reduction group into the GEMM group
that alone feeds it), so they are judged one at a time and applied together.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from stof_cc.codegen import NotFusable
from stof_cc.ir.graph import Graph
from stof_cc.passes.fusion import FusionGroup, FusionPlan, FusionScheme, in_dependency_order
from stof_cc.templates.group import group_templates
from stof_cc.templates.pricing import sm_count

H100 = (9, 0)  # the target when no GPU is visible (kernels are written and compiled for sm_90)


def best_estimate(graph: Graph, group: FusionGroup, capability: tuple[int, int], sms: int) -> float:
    """The lowest stage-1 estimate (us) of any template point for ``group`` on this GPU;
    infinity when no template generates it (it would run in torch)."""
    best = math.inf
    for template in group_templates(group.kind):
        if not template.runs_on(capability):
            continue
        try:
            problem = template.match(graph, group)
        except NotFusable:
            continue
        best = min([best] + [template.estimate(problem, params, sms) for params in template.space(problem)])
    return best


def choose_scheme(graph: Graph, plan: FusionPlan, capability: tuple[int, int] | None = None,
                  measured: Callable[[FusionGroup], float | None] | None = None) -> FusionPlan:
    """Set ``plan.chosen`` (and ``plan.choices``, one line per alternative saying what was
    decided and why) and return the plan. ``capability``: the GPU's when one is visible, else
    the H100's. ``measured``: a group's measured best time (us) or None, e.g.
    `stof_cc.tune.model.measured_times` over a tuning database."""
    if capability is None:
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else H100
    sms = sm_count()
    groups = list(plan.default.groups)
    plan.choices = []
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
            plan.choices.append(f"{label}: merged ({fused_us:.1f} us {how} against {apart_us:.1f} us apart)")
        else:
            why = "no template generates it" if math.isinf(fused_us) else f"{fused_us:.1f} us {how} against {apart_us:.1f}"
            plan.choices.append(f"{label}: kept apart ({why})")
    plan.chosen = FusionScheme(in_dependency_order(graph, groups))  # the merged group may read later ones
    return plan
