"""A recogniser as data: a `Rule` names a pattern of primitive ops that one IR op computes
exactly, finds it at a node and builds the node that replaces it. `passes/patterns.py` holds
the table of rules and the one pass that applies them; each rule's module (norms.py,
rotary.py, overflow_clamp.py) holds its matcher and its reasoning."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stof_cc.ir.graph import Graph, Node
from stof_cc.passes.canonicalize import replace_matches


@dataclass(frozen=True)
class Rule:
    """``match(graph, node)``: the pattern's operands when it ends at ``node``, else None;
    ``build(graph, node, answer)``: the replacement, named like ``node`` (its readers stay)."""

    name: str
    match: Callable[[Graph, Node], Any]
    build: Callable[[Graph, Node, Any], Node]
    does: str


@dataclass
class RulesReport:
    """The nodes each rule replaced, by rule name."""

    rewritten: dict[str, list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        found = [f"{len(names)} {rule} ({', '.join('%' + n for n in names)})"
                 for rule, names in self.rewritten.items() if names]
        return f"recognise_patterns: {'; '.join(found) if found else 'nothing recognised'}"


def apply_rules(graph: Graph, rules: tuple[Rule, ...], report: RulesReport | None = None) -> Graph:
    """A copy of ``graph`` in which each node where a rule matches (the first in ``rules``
    order) is that rule's replacement, and what only the old nodes read goes away."""
    report = report if report is not None else RulesReport()
    for rule in rules:
        report.rewritten.setdefault(rule.name, [])

    def match(graph: Graph, node: Node) -> tuple[Rule, Any] | None:
        for rule in rules:
            answer = rule.match(graph, node)
            if answer is not None:
                report.rewritten[rule.name].append(node.name)
                return rule, answer
        return None

    return replace_matches(graph, match, lambda node, found: found[0].build(graph, node, found[1]), [])
