"""Masks as descriptions: turn an attention node's boolean mask tensor into what the kernels
read, a ``key_padding`` operand and a static structure (run after `recognise_attention`).

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

The same probe recognises a static part: decoders build causal (or sliding-window) masks,
alone or and-ed with the padding. When the attended positions are ``keep[b, k] & static[q, k]``
(``keep`` all ones when the mask depends on no input) and ``static`` is every position, the
causal triangle, or a causal band ``0 <= q - k <= w`` (Mistral's window, in its own convention:
``w`` is read off the mask), the node gets ``is_causal=True`` and ``window=w`` as needed and
loses its mask operand. Other static masks stay tensors.

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
    rewritten: dict[str, str] = field(default_factory=dict)  # attention node -> padding input ("" for none)
    structure: dict[str, str] = field(default_factory=dict)  # attention node -> its static mask, in words
    refused: dict[str, str] = field(default_factory=dict)  # attention node -> reason

    def __str__(self) -> str:
        padded = sum(bool(source) for source in self.rewritten.values())
        lines = [f"key_padding: {len(self.rewritten)} attention mask(s) described, {padded} with key_padding"]
        lines += [f"  %{node} <- {'%' + source if source else 'no input'}, {self.structure[node]}"
                  for node, source in self.rewritten.items()]
        lines += [f"  kept the mask tensor of %{node}: {why}" for node, why in self.refused.items()]
        return "\n".join(lines)


def describe_key_padding(graph: Graph, report: KeyPaddingReport | None = None) -> Graph:
    """A copy of ``graph`` with the masks of `attention` nodes described: key padding as a
    ``key_padding`` operand, a causal or windowed structure as ``is_causal`` / ``window``."""
    report = report if report is not None else KeyPaddingReport()
    described: dict[str, tuple[str | None, dict[str, object]]] = {}
    for node in graph.nodes():
        mask = attention_arguments(node).get("attn_mask") if node.op == "attention" else None
        if not isinstance(mask, Ref):
            continue
        source, structure, why = _describe(graph, node, mask)
        if structure is None:
            report.refused[node.name] = why
        else:
            described[node.name] = (source, structure)
            report.rewritten[node.name] = source or ""
            report.structure[node.name] = _label(structure)
    if not described:
        return graph.copy()

    def rewrite(node: Node, _: Graph) -> Node:
        if node.name not in described:
            return node
        source, structure = described[node.name]
        kwargs = {**node.kwargs, **structure} | ({"key_padding": Ref(source)} if source else {})
        return Node(node.name, node.op, node.target, (*node.args[:3], None), kwargs, node.spec)

    return remove_dead_nodes(graph.rebuild(rewrite))


def _label(structure: dict[str, object]) -> str:
    if "window" in structure:
        return f"a causal window of {structure['window']}"
    return "causal" if structure.get("is_causal") else "no static mask"


def _describe(graph: Graph, node: Node, mask: Ref) -> tuple[str | None, dict[str, object] | None, str]:
    """(the padding input or None, the static structure's kwargs, "") when the mask is key
    padding and/or a recognised static structure, else (None, None, why not)."""
    dag = graph.nx_graph
    upstream = nx.ancestors(dag, mask.name) | {mask.name}
    inputs = [n for n in upstream if graph.node(n).op == INPUT]
    if len(inputs) > 1:
        return None, None, f"the mask depends on {len(inputs)} inputs ({', '.join(sorted(inputs))}), not one"
    source = inputs[0] if inputs else None
    q_spec, k_spec = (graph.node(attention_arguments(node)[n].name).spec for n in ("query", "key"))
    batch, seq_q, seq_k = k_spec.shape[0], q_spec.shape[-2], k_spec.shape[-2]
    shape = (batch, q_spec.shape[1], seq_q, seq_k)
    if source is not None and tuple(graph.node(source).spec.shape) != (batch, seq_k):
        return None, None, f"its input %{source} is {graph.node(source).spec}, not [batch, keys] = [{batch}, {seq_k}]"
    order = [n.name for n in graph.nodes() if n.name in upstream and n.name != source]
    generator = torch.Generator().manual_seed(0)
    static = None
    for probe in range(PROBES if source is not None else 1):
        keep = torch.ones(batch, seq_k, dtype=torch.bool) if probe == 0 else \
            torch.rand(batch, seq_k, generator=generator) < 0.6
        keep[:, 0] = True  # no row without a key: there the original and key padding differ by design
        env = {} if source is None else {source: keep.to(graph.node(source).spec.dtype)}
        try:
            for name in order:
                env[name] = evaluate_node(graph, graph.node(name), env, torch.device("cpu"))
        except Exception as exc:  # the subgraph cannot run on the CPU probe: leave the mask as it is
            return None, None, f"probing the mask failed ({exc})"
        allowed = _allowed(env[mask.name])
        if allowed is None:
            return None, None, "the additive mask is not 0 / hidden (it biases the scores)"
        try:
            allowed = allowed.expand(shape)
        except RuntimeError:
            return None, None, f"the mask's shape {tuple(env[mask.name].shape)} does not broadcast to {shape}"
        if static is None:  # all keys kept: what is left is the static part, the same for every (b, h)
            static = allowed[0, 0]
            if not bool((allowed == static).all()):
                return None, None, "the attended positions vary over batch or heads beyond key padding"
        if not bool((allowed == (keep[:, None, None, :] & static)).all()):
            return None, None, "the attended positions are not key padding and one static mask"
    structure = _structure(static)
    if structure is None:
        return None, None, "its static part is not full, causal or a causal window"
    if source is None and not structure:
        return None, {}, ""  # attends everything: no mask at all
    return source, structure, ""


def _structure(static: torch.Tensor) -> dict[str, object] | None:
    """The kwargs of a static [S_q, S_k] mask: {} (full), causal, a causal window; else None."""
    if bool(static.all()):
        return {}
    q = torch.arange(static.shape[0])[:, None]
    k = torch.arange(static.shape[1])[None, :]
    distance = q - k
    if not torch.equal(static, static & (distance >= 0)):
        return None
    reach = int(distance[static].max()) if bool(static.any()) else 0
    if torch.equal(static, distance >= 0):
        return {"is_causal": True}
    if reach >= 1 and torch.equal(static, (distance >= 0) & (distance <= reach)):
        return {"is_causal": True, "window": reach}
    return None


def _allowed(value: torch.Tensor) -> torch.Tensor | None:
    if value.dtype == torch.bool:
        return value
    hidden = value < HIDDEN_BELOW
    return None if bool((value[~hidden] != 0).any()) else ~hidden
