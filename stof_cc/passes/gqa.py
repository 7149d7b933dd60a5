"""Grouped-query attention without ``repeat_kv`` copies (run after `describe_key_padding`).

HuggingFace's Llama, Mistral and Qwen2 widen K and V from H_kv to H heads before SDPA:

    x[:, :, None, :, :].expand(B, H_kv, n, S, D).reshape(B, H_kv * n, S, D)     # repeat_kv

which torch runs as a copy of each. Where an `attention` node's key or value is exactly that
(unsqueeze at dim 2, expand of the new dim only, reshape merging it into the heads), the node
reads ``x`` with H_kv heads instead: its reference (SDPA's ``enable_gqa``) and stof-cc's
kernels map query head h to key/value head h // n. Key and value must agree on H_kv; the
widening ops go away unless something else reads them. Pure: the input graph is not modified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stof_cc.ir.graph import Graph, Node, Ref
from stof_cc.passes.attention import attention_arguments
from stof_cc.passes.canonicalize import replace_matches


@dataclass
class GqaReport:
    rewritten: dict[str, int] = field(default_factory=dict)  # attention node -> query heads per K/V head

    def __str__(self) -> str:
        return f"read_kv_heads_directly: {len(self.rewritten)} attention node(s)" + "".join(
            f"\n  %{node}: {n} query heads per key/value head" for node, n in self.rewritten.items())


def read_kv_heads_directly(graph: Graph, report: GqaReport | None = None) -> Graph:
    """A copy of ``graph`` whose attention nodes read un-repeated K/V where repeat_kv fed them."""
    report = report if report is not None else GqaReport()
    rewritten: list[str] = []

    def narrowed(graph: Graph, node: Node) -> tuple[Ref, Ref, int] | None:
        if node.op != "attention":
            return None
        given = attention_arguments(node)
        found = [_repeated(graph, given[name]) for name in ("key", "value")]
        if None in found or found[0][1] != found[1][1]:
            return None
        return found[0][0], found[1][0], found[0][1]

    def build(node: Node, found: tuple[Ref, Ref, int]) -> Node:
        key, value, group = found
        report.rewritten[node.name] = group
        return Node(node.name, node.op, node.target, (node.args[0], key, value, *node.args[3:]), node.kwargs,
                    node.spec)

    return replace_matches(graph, narrowed, build, rewritten)


def _repeated(graph: Graph, ref: object) -> tuple[Ref, int] | None:
    """(x, n) when ``ref`` is repeat_kv(x, n) as HF writes it, else None."""
    if not isinstance(ref, Ref):
        return None
    reshape = graph.node(ref.name)
    if reshape.op != "view" or not isinstance(reshape.args[0], Ref):
        return None
    expand = graph.node(reshape.args[0].name)
    if expand.op != "expand" or not isinstance(expand.args[0], Ref):
        return None
    unsqueeze = graph.node(expand.args[0].name)
    if unsqueeze.op != "unsqueeze" or not isinstance(unsqueeze.args[0], Ref) or unsqueeze.args[1:] not in ((2,), (-3,)):
        return None
    source = graph.node(unsqueeze.args[0].name)
    if source.spec is None or len(source.spec.shape) != 4:
        return None
    b, kv_heads, s, d = source.spec.shape
    wide = tuple(expand.spec.shape)
    if len(wide) != 5 or (wide[0], wide[1], wide[3], wide[4]) != (b, kv_heads, s, d) or \
            tuple(reshape.spec.shape) != (b, kv_heads * wide[2], s, d):
        return None
    return Ref(source.name), wide[2]
