"""Key padding: turn an attention mask computed from an ``attention_mask`` input into a
``key_padding`` operand (run after `recognise_attention`).

transformers builds BERT's mask from ``attention_mask`` [B, S] (1 = token, 0 = padding)
through casts, unsqueezes, expands and arithmetic into a [B, 1, S, S] boolean or additive
tensor. This pass does not pattern-match those spellings (they change between versions): it
*probes* the mask subgraph. When the attention node's mask depends on exactly one graph
input ``p`` of shape [B, S_k] (and on constants), the subgraph is evaluated for random 0/1
values of ``p`` (every row keeping at least one key) and for all ones; if every time the
attended positions are exactly ``p[b, k] != 0`` for every head and query (a boolean mask, or
an additive one that is 0 where attended and below -1e4 elsewhere, i.e. no bias), the node
becomes ``attention(q, k, v, None, scale=..., is_causal=..., key_padding=p)`` and the mask
subgraph goes away unless something else reads it.

One semantic difference, documented: a batch element whose keys are all padding now gives 0
(stof-cc's kernels, and the op's reference), where the additive original gave the mean of V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch

from stof_cc.ir.graph import INPUT, Graph, Node, Ref
from stof_cc.ir.interpret import evaluate_node
from stof_cc.passes.attention import attention_arguments
from stof_cc.passes.canonicalize import remove_dead_nodes

PROBES = 4
HIDDEN_BELOW = -1e4  # an additive mask hides a key by adding less than this


@dataclass
class KeyPaddingReport:
    rewritten: dict[str, str] = field(default_factory=dict)  # attention node -> padding input
    refused: dict[str, str] = field(default_factory=dict)  # attention node -> reason

    def __str__(self) -> str:
        lines = [f"key_padding: {len(self.rewritten)} attention mask(s) -> key_padding"]
        lines += [f"  %{node} <- %{source}" for node, source in self.rewritten.items()]
        lines += [f"  kept the mask tensor of %{node}: {why}" for node, why in self.refused.items()]
        return "\n".join(lines)


def describe_key_padding(graph: Graph, report: KeyPaddingReport | None = None) -> Graph:
    """A copy of ``graph`` with key-padding masks of `attention` nodes as ``key_padding`` operands."""
    report = report if report is not None else KeyPaddingReport()
    sources = {}
    for node in graph.nodes():
        mask = attention_arguments(node).get("attn_mask") if node.op == "attention" else None
        if not isinstance(mask, Ref):
            continue
        source, why = _padding_source(graph, node, mask)
        if source is None:
            report.refused[node.name] = why
        else:
            sources[node.name] = report.rewritten[node.name] = source
    if not sources:
        return graph.copy()
    def rewrite(node: Node, _: Graph) -> Node:
        if node.name not in sources:
            return node
        return Node(node.name, node.op, node.target, (*node.args[:3], None),
                    {**node.kwargs, "key_padding": Ref(sources[node.name])}, node.spec)

    return remove_dead_nodes(graph.rebuild(rewrite))


def _padding_source(graph: Graph, node: Node, mask: Ref) -> tuple[str | None, str]:
    """(the padding input, "") when the mask is key padding, else (None, why not)."""
    dag = graph.nx_graph
    upstream = nx.ancestors(dag, mask.name) | {mask.name}
    inputs = [n for n in upstream if graph.node(n).op == INPUT]
    if len(inputs) != 1:
        return None, f"the mask depends on {len(inputs)} inputs ({', '.join(sorted(inputs)) or 'none'}), not one"
    source = inputs[0]
    spec = graph.node(source).spec
    q_spec, k_spec = (graph.node(attention_arguments(node)[n].name).spec for n in ("query", "key"))
    batch, seq_k = k_spec.shape[0], k_spec.shape[-2]
    if tuple(spec.shape) != (batch, seq_k):
        return None, f"its input %{source} is {spec}, not [batch, keys] = [{batch}, {seq_k}]"
    order = [n.name for n in graph.nodes() if n.name in upstream and n.name != source]
    generator = torch.Generator().manual_seed(0)
    for probe in range(PROBES):
        keep = torch.ones(batch, seq_k, dtype=torch.bool) if probe == 0 else \
            torch.rand(batch, seq_k, generator=generator) < 0.6
        keep[:, 0] = True  # no row without a key: there the original and key padding differ by design
        env = {source: keep.to(spec.dtype)}
        try:
            for name in order:
                env[name] = evaluate_node(graph, graph.node(name), env, torch.device("cpu"))
        except Exception as exc:  # the subgraph cannot run on the CPU probe: leave the mask as it is
            return None, f"probing the mask failed ({exc})"
        value = env[mask.name]
        allowed = _allowed(value)
        if allowed is None:
            return None, "the additive mask is not 0 / hidden (it biases the scores)"
        shape = (batch, q_spec.shape[1], q_spec.shape[-2], seq_k)
        try:
            same = torch.equal(allowed.expand(shape), keep[:, None, None, :].expand(shape))
        except RuntimeError:
            return None, f"the mask's shape {tuple(value.shape)} does not broadcast to {shape}"
        if not same:
            return None, "the attended positions are not a function of the key's padding bit alone"
    return source, ""


def _allowed(value: torch.Tensor) -> torch.Tensor | None:
    if value.dtype == torch.bool:
        return value
    hidden = value < HIDDEN_BELOW
    return None if bool((value[~hidden] != 0).any()) else ~hidden

