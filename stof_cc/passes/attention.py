"""Recognise attention: rewrite each attention computation into one `attention` node.

Two forms are found:

* ``scaled_dot_product_attention`` (with ``dropout_p == 0``): its mask, ``is_causal`` and
  scale carry over (the default scale becomes explicit, 1 / sqrt(head_dim)).
* The hand-written chain, as in transformers' eager BERT and GPT-2 (run `canonicalize`
  first, so eval-mode dropout is gone)::

      scores = matmul(q, transpose(k, -2, -1))      # or bmm
      scores = scores * c  |  scores / c            # optional, c a number
      scores = scores + mask                        # optional additive mask, or
      scores = masked_fill(scores, masked, -inf)    # a boolean mask of what is hidden
      out    = matmul(softmax(scores, -1), v)

  Every intermediate must have no other reader (else it is needed elsewhere and the chain
  stays as it is); the reason a softmax was not rewritten is recorded in the report.
  GPT-OSS's form with attention sinks is the same chain with one more column of scores:
  ``softmax(cat([scores, sinks], -1) [- its row maximum])[..., :-1]``, the column one finite
  logit per head (the node's ``sinks``, fp32 [H]; docs/decisions.md#attention-sinks).

The new node keeps the name of the node it replaces (the SDPA call or the final matmul),
so its readers are untouched: ``attention(q, k, v, mask, scale=..., is_causal=...)`` with
SDPA's conventions for ``mask`` (boolean: True = attend; floating: added to the scores).
A hidden-positions mask becomes its negation (a folded constant when the mask is one, else
a ``logical_not`` node), with ``empty_rows="nan"``: the chain's softmax over a row whose keys
are all -inf is NaN, and the node must keep that meaning (`ir.ops.attention_reference`); a
constant lower triangle becomes ``is_causal=True`` with no mask operand. Other masks stay tensor
operands here; `describe_key_padding` (key_padding.py) then turns those built from an
``attention_mask`` input into key padding. Pure: the input graph is never modified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from stof_cc.ir.graph import CONSTANT, Graph, Node, Ref, TensorSpec
from stof_cc.passes.canonicalize import mutating_nodes, remove_dead_nodes

_MATMULS = ("matmul", "bmm")
HIDDEN_BELOW = -1e4  # a fill or added value below this hides a key (exp underflows in any dtype)


@dataclass(frozen=True)
class AttentionMatch:
    """One attention computation: operands, attributes and the nodes it replaces."""

    root: str  # the node the attention node replaces (keeps its name)
    q: Ref
    k: Ref
    v: Ref
    mask: Ref | None
    mask_hides: bool  # mask marks hidden positions (masked_fill): the node needs its negation
    scale: float
    is_causal: bool
    covered: tuple[str, ...]  # nodes of the chain other than the root, removed
    bias: AddedBias | None = None  # a term the chain adds to the scores besides its mask (ALiBi)
    empty_rows: str | None = None  # what a fully hidden row gives: "nan" (-inf fill), "mean" (a finite one)
    softcap: float | None = None  # scores capped as c * tanh(s / c) before the mask (Gemma 2)
    scores_dtype: torch.dtype | None = None  # a chain's: its q k^T product's (fp32 where q and k were upcast)
    sinks: torch.Tensor | None = None  # fp32 [H]: a logit per head concatenated to the scores (GPT-OSS)


@dataclass(frozen=True)
class AddedBias:
    """``scale * source`` added to the scores; ``source`` is [B*H, ...] (baddbmm's), viewed as
    [B, H, ...] with ``heads`` = (B, H), or (``heads`` None) already broadcastable to the scores."""

    source: Ref
    heads: tuple[int, int] | None
    scale: float


@dataclass
class AttentionReport:
    matched: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # softmax or SDPA node -> reason

    def __str__(self) -> str:
        lines = [f"recognise_attention: {len(self.matched)} attention node(s)"]
        lines += [f"  not rewritten: %{name}: {why}" for name, why in self.refused.items()]
        return "\n".join(lines)


def recognise_attention(graph: Graph, report: AttentionReport | None = None) -> Graph:
    """A copy of ``graph`` with every recognised attention computation as one node."""
    report = report if report is not None else AttentionReport()
    mutating = mutating_nodes(graph)
    if mutating:  # a mutation could feed or read the chain's intermediates: leave the graph alone
        report.refused["<graph>"] = f"in-place ops ({', '.join('%' + n for n in mutating[:3])})"
        return graph.copy()
    matches: dict[str, AttentionMatch] = {}
    for node in graph.nodes():
        match = _match_sdpa(graph, node, report) or _match_chain(graph, node, report)
        if match is not None and (why := _operands_refused(graph, match)) is not None:
            report.refused[match.root] = why
            match = None
        if match is not None:
            matches[match.root] = match
            report.matched.append(match.root)
    covered = {name for m in matches.values() for name in m.covered}

    def rewrite(node: Node, out: Graph) -> Node | None:
        if node.name in matches:
            m = matches[node.name]
            mask, is_causal = _allowed_mask(graph, out, m) if m.mask_hides else (m.mask, m.is_causal)
            # masked_fill then softmax: a row with every key hidden is NaN (-inf) or the mean of V (a finite
            # fill), or 0 beside a sink (which takes the whole row)
            empty = {"empty_rows": m.empty_rows} if m.mask_hides and mask is not None and m.sinks is None else {}
            bias = {"bias": _bias_operand(graph, out, m)} if m.bias is not None else {}
            written = {"scores_dtype": m.scores_dtype} if m.covered and not m.mask_hides and mask is not None \
                and m.sinks is None else {}
            softcap = {"softcap": m.softcap} if m.softcap is not None else {}
            sinks = {} if m.sinks is None else \
                {"sinks": Ref(out.add_constant(out.fresh_name(f"{m.root}_sinks"), m.sinks).name)}
            return Node(node.name, "attention", None, (m.q, m.k, m.v, mask),
                        {"scale": m.scale, "is_causal": is_causal} | empty | bias | written | softcap | sinks,
                        node.spec)
        return None if node.name in covered else node

    return remove_dead_nodes(graph.rebuild(rewrite))  # e.g. a hidden-positions constant replaced by its negation


SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def attention_arguments(node: Node) -> dict[str, Any]:
    """The arguments of an SDPA node or a recognised `attention` node by SDPA's names (query,
    key, value, attn_mask, is_causal, scale...), positional or keyword."""
    given = dict(zip(SDPA_ARGUMENTS, node.args, strict=False)) | node.kwargs
    return given | ({"attn_mask": given.pop("mask")} if "mask" in given else {})


def is_bias(graph: Graph, mask: Any) -> bool:
    """Whether an attention node's ``attn_mask`` is an additive bias: a floating tensor, which
    the kernels add to the scores (a boolean mask says what to attend)."""
    if not isinstance(mask, Ref):
        return False
    spec = graph.node(mask.name).spec
    return isinstance(spec, TensorSpec) and spec.dtype.is_floating_point


def added_biases(graph: Graph, node: Node) -> tuple[Ref, ...]:
    """What the kernels add to an attention node's scores: its float ``attn_mask`` and its
    ``bias`` operand (ALiBi), in that order (empty: none)."""
    given = attention_arguments(node)
    return tuple(r for r in (given.get("attn_mask") if is_bias(graph, given.get("attn_mask")) else None,
                             given.get("bias")) if isinstance(r, Ref))


def _operands_refused(graph: Graph, match: AttentionMatch) -> str | None:
    """Why the attention node cannot take a match's q, k and v (None: it can). It reads heads at
    dim -3 and takes fewer K/V heads as grouped (a divisor of q's): 2-d operands, or q broadcast
    over more K/V heads, crashed its shape rule (found by a helper's fuzzing); they stay plain ops."""
    specs = [graph.node(r.name).spec for r in (match.q, match.k, match.v)]
    if any(not isinstance(spec, TensorSpec) or len(spec.shape) < 3 for spec in specs):
        return "q, k and v must have a head or batch dimension before [S, D] (2-d operands stay plain ops)"
    heads = [spec.shape[-3] for spec in specs]
    if heads[1] != heads[2] or heads[0] % heads[1]:
        return (f"{heads[0]} query heads over {heads[1]} key and {heads[2]} value heads (the node takes K/V "
                "heads that divide the query heads)")
    q, k, v = (tuple(spec.shape) for spec in specs)
    try:
        batch = tuple(torch.broadcast_shapes(q[:-3], k[:-3], v[:-3]))
    except RuntimeError:
        return "q, k and v have batch dimensions that do not broadcast"
    out = graph.node(match.root).spec
    if isinstance(out, TensorSpec) and tuple(out.shape) != (*batch, q[-3], q[-2], v[-1]):
        return (f"the mask widens the output to {list(out.shape)} beyond q, k and v's "
                f"{[*batch, q[-3], q[-2], v[-1]]} (the node's output is theirs)")
    return None


def _match_sdpa(graph: Graph, node: Node, report: AttentionReport) -> AttentionMatch | None:
    if node.op != "scaled_dot_product_attention":
        return None
    given = attention_arguments(node)
    if given.get("dropout_p", 0.0) != 0.0:
        report.refused[node.name] = "dropout_p is not 0 (training-mode attention)"
        return None
    q = given["query"]  # enable_gqa's K/V heads: `_operands_refused` checks them (passes/gqa.py reads them)
    head_dim = graph.node(q.name).spec.shape[-1]
    scale = given.get("scale")
    return AttentionMatch(node.name, q, given["key"], given["value"], given.get("attn_mask"), False,
                          1.0 / math.sqrt(head_dim) if scale is None else float(scale),
                          bool(given.get("is_causal", False)), ())


def _match_chain(graph: Graph, node: Node, report: AttentionReport) -> AttentionMatch | None:
    """Match from the attention's output back to q and k; None (with a reason) when it is not the form.
    The output is ``matmul(P, v)`` on [B, H, S, D], or (BLOOM, Falcon) ``bmm`` on [B*H, S, D] views
    of 4-d tensors viewed back to [B, H, S, D]; P may be cast after the softmax (an fp32 softmax
    cast back to the model's dtype, as eager Llama writes it)."""
    pv, merged = node, False
    if node.op == "view" and isinstance(node.args[0], Ref) and graph.node(node.args[0].name).op == "bmm":
        pv, merged = graph.node(node.args[0].name), True
        if not _splits_batch(graph, pv, node) or not _reads_only(graph, pv, node):
            return None
    if pv.op not in _MATMULS or not isinstance(pv.args[0], Ref) or not isinstance(pv.args[1], Ref):
        return None
    v = _batch_source(graph, pv.args[1]) if merged else pv.args[1]
    readers = [pv]  # from the PV product back to the softmax: the batch-merging view, a cast
    probs = graph.node(pv.args[0].name)
    if merged:
        readers.append(probs)
        probs = _merged_input(graph, probs)
        if probs is None:
            return None
    sliced = None  # GPT-OSS: the sinks' column dropped after the softmax (a cast may sit on either side)
    if not merged and probs.op == "cast" and isinstance(probs.args[0], Ref) \
            and graph.node(probs.args[0].name).op == "slice":
        readers.append(probs)
        probs = graph.node(probs.args[0].name)
    if not merged and _drops_last_column(graph, probs):
        readers.append(probs)
        sliced, probs = probs, graph.node(probs.args[0].name)
    if probs.op == "cast" and isinstance(probs.args[0], Ref) and graph.node(probs.args[0].name).op == "softmax":
        readers.append(probs)
        probs = graph.node(probs.args[0].name)
    if probs.op != "softmax" or v is None:
        return None

    def refuse(why: str) -> None:
        report.refused[probs.name] = why

    read = [*readers[1:], probs]
    if not all(_reads_only(graph, producer, reader) for producer, reader in zip(read, readers, strict=True)):
        return refuse("the probabilities are read elsewhere too")
    chain = [r.name for r in readers[1:]] if not merged else [r.name for r in readers]
    if not _is_last_dim(graph, probs):
        return refuse("softmax is not over the last dimension")
    chain.append(probs.name)
    scores, reader = graph.node(probs.args[0].name), probs
    sinks = None
    if sliced is not None:  # a softcap under sinks is refused below (no kernel or reference has both)
        found = _sink_column(graph, probs)
        if isinstance(found, str):
            return refuse(found)
        covered, scores, reader, sinks = found
        chain += covered
    mask, mask_hides, factor, batch_view = None, False, 1.0, None
    empty_rows = bias = softcap = None

    def take(next_node: Node) -> Node:
        chain.append(scores.name)
        return next_node

    while True:
        if not _reads_only(graph, scores, reader):
            return refuse(f"the intermediate %{scores.name} ({scores.op}) is read elsewhere too")
        outside = factor == 1.0 and batch_view is None and softcap is None  # nothing scaled it yet
        if mask is None and outside and scores.op == "masked_fill" and isinstance(scores.args[1], Ref) \
                and (empty_rows := _hiding_fill(scores.args[2])) is not None:
            mask, mask_hides = scores.args[1], True
        elif outside and bias is None and scores.op == "add" and all(isinstance(a, Ref) for a in scores.args[:2]) \
                and scores.kwargs.get("alpha", 1) == 1:  # add(s, m, alpha=a) scales the mask: not matched
            inner, added = _split_mask(graph, scores)
            if inner is None:
                return refuse("the added term is not a mask beside a q k^T product")
            if not is_bias(graph, added):  # a boolean or integer term adds 1 where True: no attend-mask
                return refuse(f"the added term %{added.name} is not floating")
            if mask is None:
                mask = added
            else:  # a second term (MPT's ALiBi under its masked_fill): a bias
                bias = AddedBias(added, None, 1.0)
            reader, scores = scores, take(inner)
            continue
        elif outside and (capped := _softcapped(graph, scores)) is not None:  # Gemma 2: c * tanh(s / c)
            softcap, inner = capped
            chain += [scores.name, graph.node(scores.args[0].name).name, inner.name]
            reader, scores = inner, graph.node(inner.args[0].name)
            continue
        elif (scale := _scale(scores)) is not None:
            factor *= scale
        elif batch_view is None and scores.op == "view" and isinstance(scores.args[0], Ref) \
                and _splits_batch(graph, graph.node(scores.args[0].name), scores):
            batch_view = scores
        else:
            break
        reader, scores = scores, take(graph.node(scores.args[0].name))
    product = scores.op in ("bmm", "baddbmm") if batch_view is not None else scores.op == "matmul"
    if not product:
        return refuse(f"the scores come from {scores.op}, not a q k^T product")
    if not _reads_only(graph, scores, reader):
        return refuse("the q k^T product is read elsewhere too")
    first = 1 if scores.op == "baddbmm" else 0
    q, key_t = scores.args[first], scores.args[first + 1]
    key_t = graph.node(key_t.name) if isinstance(key_t, Ref) else None
    if key_t is None or not _is_last_two_transpose(graph, key_t) or not _reads_only(graph, key_t, scores):
        return refuse("the second operand of q k^T is not a transposed key read only there")
    k = key_t.args[0]
    q_reader, k_reader = scores, key_t
    if batch_view is not None:
        q_reader, k_reader = graph.node(q.name), graph.node(k.name)
        q, k = _batch_source(graph, q), _batch_source(graph, k)
        if q is None or k is None:
            return refuse("q or k of the batched product is not a [B*H, S, D] view of a [B, H, S, D] tensor")
    chain += [scores.name, key_t.name]
    outer = factor  # what scales the whole scores; a scale on q or k scales the product alone
    for side, reader_of in (("q", q_reader), ("k", k_reader)):  # scaling written on q or k (GPT-NeoX, Falcon)
        ref = q if side == "q" else k
        scaled = graph.node(ref.name)
        batched_view = reader_of if reader_of.op == "view" else None  # [B*H, S, D] view of the scaled tensor
        if (scale := _scale(scaled)) is not None and isinstance(scaled.args[0], Ref) \
                and _reads_only(graph, scaled, reader_of) \
                and (batched_view is None or _reads_only(graph, batched_view, scores if side == "q" else key_t)):
            factor *= scale
            chain += [scaled.name] + ([batched_view.name] if batched_view is not None else [])
            q, k = (scaled.args[0], k) if side == "q" else (q, scaled.args[0])
            q_reader, k_reader = (scaled, k_reader) if side == "q" else (q_reader, scaled)
    v_dtype = graph.node(v.name).spec.dtype
    for side, reader_of in (("q", q_reader), ("k", k_reader)):  # GPT-J: q k^T in fp32 of fp16 q and k
        upcast = graph.node((q if side == "q" else k).name)
        batched_view = reader_of if reader_of.op == "view" else None  # [B*H, S, D] view of the upcast
        if _exact_upcast(graph, upcast) and graph.node(upcast.args[0].name).spec.dtype == v_dtype \
                and _reads_only(graph, upcast, reader_of) \
                and (batched_view is None or _reads_only(graph, batched_view, scores if side == "q" else key_t)):
            # exact, and the kernels' product accumulates in fp32 already; kept where v stays fp32 too
            chain += [upcast.name] + ([batched_view.name] if batched_view is not None else [])
            q, k = (upcast.args[0], k) if side == "q" else (q, upcast.args[0])
    beta = float(scores.kwargs.get("beta", 1.0)) if scores.op == "baddbmm" else 0.0
    if beta != 0.0:  # beta * bias + alpha * q k^T (BLOOM's ALiBi); beta = 0 ignores the input, as torch does
        added = scores.args[0] if isinstance(scores.args[0], Ref) else None
        heads = tuple(batch_view.spec.shape[:2])
        if added is None or len(graph.node(added.name).spec.shape) != 3 \
                or graph.node(added.name).spec.shape[0] not in (1, heads[0] * heads[1]):
            return refuse("baddbmm's added term is not a [B*H | 1, S | 1, S] tensor")
        if bias is not None:
            return refuse("baddbmm adds a term and so does the chain")
        bias = AddedBias(scores.args[0], heads, outer * beta)
    if scores.op == "baddbmm":
        factor *= float(scores.kwargs.get("alpha", 1.0))
    if (merged or batch_view is not None) and any(  # [B*H] split the same way round everywhere
            tuple(graph.node(r.name).spec.shape[:2]) != tuple(node.spec.shape[:2]) for r in (q, k, v)):
        return refuse("q, k, v and the output split their [B*H] batch differently")
    dtypes = {graph.node(r.name).spec.dtype for r in (q, k, v)}
    if len(dtypes) > 1:  # e.g. q and k upcast to fp32, the probabilities cast to v's fp16
        return refuse(f"q, k and v have different dtypes ({', '.join(sorted(map(str, dtypes)))})")
    if {r.name for r in (mask, bias.source if bias else None) if r is not None} & set(chain):
        return refuse("the added term is the scores themselves (softmax(s + s))")
    if sinks is not None and softcap is not None:
        return refuse("softcapped scores beside attention sinks (no kernel computes both)")
    return AttentionMatch(node.name, q, k, v, mask, mask_hides, factor, False, tuple(chain), bias, empty_rows,
                          softcap, scores.spec.dtype, sinks)


def _drops_last_column(graph: Graph, node: Node) -> bool:
    """``node`` is ``x[..., :-1]`` of a 4-d ``x``: every column of the last dim but the last."""
    if node.op != "slice" or not isinstance(node.args[0], Ref):
        return False
    spec = graph.node(node.args[0].name).spec
    if not isinstance(spec, TensorSpec) or len(spec.shape) != 4:
        return False
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    width = spec.shape[-1]
    return dim % 4 == 3 and start in (0, None) and step == 1 and end is not None \
        and (end if end >= 0 else width + end) == width - 1


def _sink_column(graph: Graph, softmax: Node) -> tuple[list[str], Node, Node, torch.Tensor] | str:
    """What GPT-OSS's softmax reads: ``cat([scores, sinks], -1)``, the row maximum subtracted or not,
    with ``sinks`` one logit per head broadcast over batch and rows. (the nodes covered, the scores
    node, the cat that reads it, the logits as fp32 [H]), or why not."""
    combined, covered = graph.node(softmax.args[0].name), []
    if combined.op == "sub" and all(isinstance(a, Ref) for a in combined.args[:2]):
        shifted, row_max = (graph.node(a.name) for a in combined.args[:2])
        taken = graph.node(row_max.args[0].name) if row_max.target == "operator.getitem" and row_max.args[1] == 0 \
            else row_max
        read_once = _reads_only(graph, combined, softmax) and _reads_only(graph, row_max, combined) \
            and (taken is row_max or _reads_only(graph, taken, row_max)) \
            and sorted(u.name for u in graph.users(shifted.name)) == sorted({taken.name, combined.name})
        if not _row_maximum(taken, shifted) or not read_once:
            return "the softmax reads a difference that is not its scores less their row maximum, read there alone"
        covered += [combined.name] + ([row_max.name] if taken is not row_max else []) + [taken.name]
        combined = shifted
    elif not _reads_only(graph, combined, softmax):
        return f"the intermediate %{combined.name} ({combined.op}) is read elsewhere too"
    pieces = combined.args[0] if combined.op == "cat" and combined.args else None
    dim = combined.args[1] if len(combined.args) > 1 else combined.kwargs.get("dim", 0)
    if not isinstance(pieces, (list, tuple)) or len(pieces) != 2 or not all(isinstance(p, Ref) for p in pieces) \
            or dim % 4 != 3:
        return "the softmax reads no [scores, sinks] concatenation over the keys"
    scores, column = (graph.node(p.name) for p in pieces)
    heads = scores.spec.shape[1]
    logits = _per_head(graph, column, heads)
    if logits is None:
        return f"the column concatenated to the scores (%{column.name}) is not one constant logit per head"
    covered.append(combined.name)
    if column.op != CONSTANT and _reads_only(graph, column, combined):
        covered.append(column.name)
    return covered, scores, combined, logits


def _row_maximum(node: Node, of: Node) -> bool:
    """``node`` is the maximum of each row of ``of`` over its last dim, kept as a dim of 1 (what a softmax
    may subtract and give the same; a maximum over another dim would not)."""
    if node.op != "amax" or not node.args or not isinstance(node.args[0], Ref) or node.args[0].name != of.name:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else []
    rank = len(of.spec.shape) if isinstance(of.spec, TensorSpec) else 0
    return bool(keepdim) and len(dims) == 1 and rank > 0 and dims[0] % rank == rank - 1


def _per_head(graph: Graph, column: Node, heads: int) -> torch.Tensor | None:
    """A [B|1, H, S|1, 1] constant (or an expand of one) holding one value per head, as fp32 [H]."""
    if column.op == "expand" and isinstance(column.args[0], Ref):
        column = graph.node(column.args[0].name)
    if column.op != CONSTANT:
        return None
    value = graph.constants[column.name]
    if value.dim() != 4 or value.shape[1] != heads or value.shape[3] != 1 or not value.is_floating_point() \
            or not bool(torch.isfinite(value).all()):  # an infinite or NaN sink: eager's NaN rows, as written
        return None
    first = value[:1, :, :1, :]
    if not torch.equal(value, first.expand_as(value)):
        return None
    return first.reshape(heads).to(torch.float32).cpu().clone()


def _exact_upcast(graph: Graph, node: Node) -> bool:
    """``node`` casts an fp16 or bf16 value to fp32 (every value kept exactly)."""
    return node.op == "cast" and isinstance(node.args[0], Ref) and node.spec.dtype == torch.float32 \
        and graph.node(node.args[0].name).spec.dtype in (torch.float16, torch.bfloat16)


def _splits_batch(graph: Graph, batched: Node, view: Node) -> bool:
    """``view`` reads the 3-d ``batched`` [B*H, S, T] as [B, H, S, T]."""
    inner, outer = graph.node(batched.name).spec.shape, view.spec.shape
    return len(inner) == 3 and len(outer) == 4 and tuple(inner[1:]) == tuple(outer[2:]) \
        and inner[0] == outer[0] * outer[1]


def _merged_input(graph: Graph, view: Node) -> Node | None:
    """The [B, H, S, T] node that ``view`` reads as [B*H, S, T], or None."""
    if view.op != "view" or not isinstance(view.args[0], Ref):
        return None
    source = graph.node(view.args[0].name)
    return source if _splits_batch(graph, view, source) else None


def _batch_source(graph: Graph, ref: Ref) -> Ref | None:
    """The 4-d tensor a [B*H, S, D] bmm operand is a view of, or None."""
    source = _merged_input(graph, graph.node(ref.name))
    return None if source is None else Ref(source.name)


def _between(graph: Graph, pv: Node, probs: Node) -> list[str]:
    """The nodes from the softmax to the PV product (a cast, the batch-merging view), outermost first."""
    names, node = [], graph.node(pv.args[0].name)
    while node.name != probs.name:
        names.append(node.name)
        node = graph.node(node.args[0].name)
    return names


def _hiding_fill(value: Any) -> str | None:
    """What a row gets whose every key is filled with ``value``: "nan" for -inf, "mean" (of V)
    for a finite value low enough to hide a key (finfo.min, MPT's); None for anything else."""
    if not isinstance(value, (int, float)) or value > HIDDEN_BELOW:
        return None
    return "nan" if value == float("-inf") else "mean"


def _softcapped(graph: Graph, node: Node) -> tuple[float, Node] | None:
    """(c, the node computing s / c) when ``node`` is c * tanh(s / c) (or tanh(s * (1 / c)))
    with the tanh read only there."""
    if node.op != "mul" or not isinstance(node.args[0], Ref) or not isinstance(node.args[1], (int, float)):
        return None
    tanh = graph.node(node.args[0].name)
    if tanh.op != "tanh" or not isinstance(tanh.args[0], Ref) or not _reads_only(graph, tanh, node):
        return None
    inner, cap = graph.node(tanh.args[0].name), float(node.args[1])
    scale = _scale(inner)
    if scale is None or scale == 0.0 or not _reads_only(graph, inner, tanh):
        return None
    return (cap, inner) if math.isclose(1.0 / scale, cap, rel_tol=1e-6) else None


def _scale(node: Node) -> float | None:
    """The factor ``node`` multiplies its first argument by, where it is a mul or a true div by a
    number (a div with a rounding mode floors or truncates: not a scale), else None."""
    if node.op not in ("mul", "div") or len(node.args) < 2 or not isinstance(node.args[1], (int, float)) \
            or isinstance(node.args[1], bool):
        return None
    if node.op == "mul":
        return float(node.args[1])
    if node.kwargs.get("rounding_mode") is not None or float(node.args[1]) == 0.0:
        return None
    return 1.0 / float(node.args[1])


def _allowed_mask(graph: Graph, out: Graph, match: AttentionMatch) -> tuple[Ref | None, bool]:
    """(mask operand, is_causal) for a mask of hidden positions: its negation, or causal."""
    hidden = graph.node(match.mask.name)
    if hidden.op == CONSTANT:
        allowed = ~graph.constants[hidden.name]
        rows, cols = graph.node(match.root).spec.shape[-2], graph.node(match.k.name).spec.shape[-2]
        if rows == cols and allowed.shape[-2:] == (rows, cols) \
                and torch.equal(allowed, torch.ones(rows, cols, dtype=torch.bool, device=allowed.device).tril().expand_as(allowed)):
            return None, True
        name = out.fresh_name(f"{match.root}_allowed")
        out.add_constant(name, allowed)
        return Ref(name), False
    name = out.fresh_name(f"{match.root}_allowed")
    out.add_node(Node(name, "logical_not", "aten.logical_not.default", (match.mask,), {}, hidden.spec))
    return Ref(name), False


def _bias_operand(graph: Graph, out: Graph, match: AttentionMatch) -> Ref:
    """The chain's added term as the node's ``bias``: [B*H, ...] viewed as [B, H, ...], scaled."""
    added = match.bias
    spec = graph.node(added.source.name).spec
    if added.heads is None:
        bias, shape = added.source, tuple(spec.shape)
    else:
        shape = (*added.heads, *spec.shape[1:]) if spec.shape[0] == added.heads[0] * added.heads[1] \
            else (1, 1, *spec.shape[1:])
        bias = Ref(out.add_node(Node(out.fresh_name(f"{match.root}_bias"), "view", "aten.view.default",
                                     (added.source, list(shape)), {}, TensorSpec(shape, spec.dtype))).name)
    if added.scale == 1.0:
        return bias
    return Ref(out.add_node(Node(out.fresh_name(f"{match.root}_bias_scaled"), "mul", "aten.mul.Tensor",
                                 (bias, added.scale), {}, TensorSpec(shape, spec.dtype))).name)


def _split_mask(graph: Graph, add: Node) -> tuple[Node | None, Ref | None]:
    """(the scores side, the mask side) of ``scores + mask`` in either order."""
    for scores_ref, mask_ref in (add.args[:2], add.args[1::-1]):
        producer = graph.node(scores_ref.name)
        if producer.op in (*_MATMULS, "baddbmm") \
                or (producer.op in ("mul", "div") and isinstance(producer.args[1], (int, float))) \
                or (producer.op == "view" and isinstance(producer.args[0], Ref)
                    and _splits_batch(graph, graph.node(producer.args[0].name), producer)):
            return producer, mask_ref
    return None, None


def _reads_only(graph: Graph, producer: Node, reader: Node) -> bool:
    """True when ``reader`` is the only consumer of ``producer`` and it is not a graph output."""
    outputs = {r.name for r in graph.outputs if isinstance(r, Ref)}
    return [u.name for u in graph.users(producer.name)] == [reader.name] and producer.name not in outputs


def _is_last_dim(graph: Graph, softmax: Node) -> bool:
    rank = len(graph.node(softmax.args[0].name).spec.shape)
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    return isinstance(dim, int) and dim % rank == rank - 1


def _is_last_two_transpose(graph: Graph, node: Node) -> bool:
    if node.op != "transpose" or not isinstance(node.args[0], Ref):
        return False
    spec: Any = graph.node(node.args[0].name).spec
    if not isinstance(spec, TensorSpec):
        return False
    rank = len(spec.shape)
    if isinstance(node.args[1], (list, tuple)):  # permute: every dim in place but the last two, swapped
        return [d % rank for d in node.args[1]] == [*range(rank - 2), rank - 1, rank - 2]
    dims = sorted(d % rank for d in node.args[1:3])
    return dims == [rank - 2, rank - 1]
