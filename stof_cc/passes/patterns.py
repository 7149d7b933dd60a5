"""The recognisers, one table (`RULES`) applied by one pass (`recognise_patterns`): what a
model spells out in primitives and one IR op computes exactly, so that a template generates
it whole. A new pattern is a new `Rule` in the table, not a new pass. Pure: the input graph
is not modified. Attention, whose recognition also rewrites masks and operands, keeps its own
pass (attention.py)."""

from __future__ import annotations

from stof_cc.ir.graph import Graph
from stof_cc.passes.norms import NORMS
from stof_cc.passes.overflow_clamp import OVERFLOW_CLAMP
from stof_cc.passes.rotary import ROTARY
from stof_cc.passes.rules import Rule, RulesReport, apply_rules

RULES: tuple[Rule, ...] = (NORMS, ROTARY, OVERFLOW_CLAMP)


def recognise_patterns(graph: Graph, report: RulesReport | None = None,
                       rules: tuple[Rule, ...] = RULES) -> Graph:
    """A copy of ``graph`` with every pattern of ``rules`` (default: all) as its one node."""
    return apply_rules(graph, rules, report)
