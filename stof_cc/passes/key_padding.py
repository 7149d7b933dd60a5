"""Masks as descriptions: turn an attention node's boolean mask tensor into what the kernels
read, a ``key_padding`` operand and a static structure (run after `recognise_attention`).

transformers builds BERT's mask from ``attention_mask`` [B, S] (1 = token, 0 = padding)
through casts, unsqueezes, expands and arithmetic into a [B, 1, S, S] boolean or additive
tensor. This pass does not pattern-match those spellings (they change between versions): it
*probes* the mask subgraph. When the attention node's mask depends on exactly one graph input,
the pass finds the *key vector*: the first boolean node with one value per (batch, key) on
every path from that input to the mask (`_key_vector`: where the model has decided which keys
count, ``attention_mask.bool()``, ``== 1`` or ``> 0`` as the model wrote it). The subgraph is
evaluated from there for random values of the key vector (every row keeping at least one key)
and for all true; if every time the attended positions are exactly the key vector's true ones
for every head and query (a boolean mask, or an additive one that is 0 where attended and
below -1e4 elsewhere, i.e. no bias), the node becomes ``attention(q, k, v, None, scale=...,
is_causal=..., key_padding=<key vector as [B, S_k]>)``. The nodes computing the key vector stay
in the graph and run every call, so the description holds whatever values the input holds where
the mask decides each key from the key vector (what the probes test: all keys, rows of one to three
keys, rows missing one, random halves; a mask built to read more, such as how many keys a row
keeps at a threshold the probes miss, is not told apart);
the [B, 1, S, S] mask goes away unless something else reads it. A mask whose input does not
become such a boolean (``(1 - attention_mask) * -1e9`` on an integer input: at 2 it adds
+1e9) stays a tensor, added by the kernels as a bias.

The same probe recognises a static part: decoders build causal (or sliding-window) masks,
alone or and-ed with the padding. When the attended positions are ``keep[b, k] & static[q, k]``
and ``static`` is every position, the causal triangle, or a causal band ``0 <= q - k <= w``
(Mistral's window, in its own convention: ``w`` is read off the mask), the node gets
``is_causal=True`` and ``window=w`` as needed and loses its mask operand. Other static masks
stay tensors.

A bias rides along: T5 writes ``where(padding_mask, position_bias, finfo.min)``, an additive
mask that is a bias where attended. When the probes show the attended values are one tensor
for every padding (the evaluation with all keys kept, a constant: T5's relative position bias
folded at compile time) and the padded keys get values below HIDDEN_BELOW, the node keeps that
tensor as its float mask, broadcast dims reduced to 1 ([1, H, S, S] for T5, not [B, H, S, S]
rebuilt every layer), and gets ``key_padding`` as above. The kernels add the bias and read the
padding on the device.

torch.nn's convention (a boolean ``key_padding_mask``, True = padding) is probed too: the key
vector then marks padding and the node reads its negation.

A query whose keys are all padding: the kernels give 0 there, the model's own attention may
not (HF's ``finfo.min`` masks give the mean of V, ``masked_fill(-inf)`` NaN, SDPA's backends
differ). The pass runs the node as the model wrote it on a fully padded probe, on the model's
device, and records the answer as ``empty_rows`` ("mean", "nan" or "unmasked"; 0 needs nothing), which
the compiled step writes after the kernel; an answer that is none of these keeps the mask a
tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch

from stof_cc.ir.graph import CONSTANT, INPUT, Graph, Node, Ref, TensorSpec
from stof_cc.ir.interpret import evaluate_node
from stof_cc.ir.ops import attention_reference
from stof_cc.passes.attention import HIDDEN_BELOW, attention_arguments
from stof_cc.passes.canonicalize import remove_dead_nodes

PROBES = 6  # `_probe_keys`: all kept, few kept, one missing, three random
CPU = torch.device("cpu")


@dataclass
class KeyPaddingReport:
    rewritten: dict[str, str] = field(default_factory=dict)  # attention node -> padding input ("" for none)
    structure: dict[str, str] = field(default_factory=dict)  # attention node -> its static mask, in words
    refused: dict[str, str] = field(default_factory=dict)  # attention node -> reason

    def __str__(self) -> str:
        padded = sum(bool(source) for source in self.rewritten.values())
        lines = [f"describe_key_padding: {len(self.rewritten)} attention mask(s) described, {padded} with key_padding"]
        lines += [f"  %{node} <- {'%' + source if source else 'no input'}, {self.structure[node]}"
                  for node, source in self.rewritten.items()]
        lines += [f"  kept the mask tensor of %{node}: {why}" for node, why in self.refused.items()]
        return "\n".join(lines)


def describe_key_padding(graph: Graph, report: KeyPaddingReport | None = None) -> Graph:
    """A copy of ``graph`` with the masks of `attention` nodes described: key padding as a
    ``key_padding`` operand, a causal or windowed structure as ``is_causal`` / ``window``."""
    report = report if report is not None else KeyPaddingReport()
    described: dict[str, Described] = {}
    shapes: dict[str, tuple[int, int]] = {}  # key vector -> (batch, keys)
    probed: dict[tuple, Described | str] = {}  # one probe per mask and attention form, not per layer
    for node in graph.nodes():
        given = attention_arguments(node) if node.op == "attention" else {}
        mask = given.get("attn_mask")
        if not isinstance(mask, Ref):
            continue
        # the layers of a decoder read one mask: probed once (at S = 16384 a probe takes seconds)
        form = (mask.name,) + tuple((name, repr(value) if name not in ("query", "key", "value") else
                                     repr(graph.node(value.name).spec)) for name, value in sorted(given.items())
                                    if name != "attn_mask")
        if form not in probed:
            probed[form] = _describe(graph, node, mask)
        found = probed[form]
        if isinstance(found, str):
            report.refused[node.name] = found
        elif found.bias is not None and found.source is None and graph.node(mask.name).op == CONSTANT:
            continue  # a constant bias and nothing else: already what the kernels read
        else:
            described[node.name] = found
            if found.source:
                k_spec = graph.node(attention_arguments(node)["key"].name).spec
                shapes[found.source] = (k_spec.shape[0], k_spec.shape[-2])
            report.rewritten[node.name] = (f"{found.source} (True = padding)" if found.marks_padding
                                           else found.source) or ""
            report.structure[node.name] = _label(found.structure) + (
                "" if found.bias is None else f", a bias {list(found.bias.shape)}") + (
                f", a query with no key gives {found.empty_rows}" if found.empty_rows not in (None, "zero") else "")
    if not described:
        return graph.copy()

    biases: list[Ref] = []  # one constant per distinct bias (T5's layers share theirs)
    padding_of: dict[tuple[str, bool], Ref] = {}  # (key vector, marks padding) -> what key_padding reads

    def key_padding(found: Described, out: Graph) -> Ref:
        """The key vector as [batch, keys], True = attend (a view and a negation as needed, once)."""
        slot = (found.source, found.marks_padding)
        if slot not in padding_of:
            ref, spec = Ref(found.source), graph.node(found.source).spec
            batch, seq_k = shapes[found.source]
            if tuple(spec.shape) != (batch, seq_k):
                ref = Ref(out.add_node(Node(out.fresh_name(f"{found.source}_keys"), "view", "aten.reshape.default",
                                            (ref, [batch, seq_k]), {}, TensorSpec((batch, seq_k), torch.bool))).name)
            if found.marks_padding:
                ref = Ref(out.add_node(Node(out.fresh_name(f"{found.source}_tokens"), "logical_not",
                                            "aten.logical_not.default", (ref,), {},
                                            TensorSpec((batch, seq_k), torch.bool))).name)
            padding_of[slot] = ref
        return padding_of[slot]

    def rewrite(node: Node, out: Graph) -> Node:
        if node.name not in described:
            return node
        found = described[node.name]
        extra = {"key_padding": key_padding(found, out)} if found.source else {}
        if found.empty_rows not in (None, "zero"):
            extra["empty_rows"] = found.empty_rows
        kwargs = {k: v for k, v in node.kwargs.items() if k != "empty_rows"} | found.structure | extra
        mask = None
        if found.bias is not None:
            bias = found.bias.to(_constant_device(graph, attention_arguments(node)["attn_mask"]))
            mask = next((r for r in biases if out.constants[r.name].dtype == bias.dtype
                         and out.constants[r.name].device == bias.device
                         and torch.equal(out.constants[r.name], bias)), None)
            if mask is None:
                mask = Ref(out.fresh_name(f"{node.name}_bias"))
                out.add_constant(mask.name, bias)
                biases.append(mask)
        return Node(node.name, node.op, node.target, (*node.args[:3], mask), kwargs, node.spec)

    return remove_dead_nodes(graph.rebuild(rewrite))


def _label(structure: dict[str, object]) -> str:
    if "window" in structure:
        return f"a causal window of {structure['window']}"
    return "causal" if structure.get("is_causal") else "no static mask"


@dataclass(frozen=True)
class Described:
    """An attention mask as the kernels read it: the key vector (None: none), whether it
    marks padding (True = hidden, torch.nn's ``key_padding_mask``) rather than tokens, the
    static structure's kwargs, and the bias (None: none)."""

    source: str | None  # the boolean [batch, key] node the kernels read (`_key_vector`)
    marks_padding: bool
    structure: dict[str, object]
    bias: torch.Tensor | None
    empty_rows: str | None = None  # what a query with no allowed key gives in the model


def _describe(graph: Graph, node: Node, mask: Ref) -> Described | str:
    """The mask described when it is key padding (either convention) and/or a recognised
    static structure, plus a bias; else why not."""
    dag = graph.nx_graph
    upstream = nx.ancestors(dag, mask.name) | {mask.name}
    inputs = [n for n in upstream if graph.node(n).op == INPUT]
    if len(inputs) > 1:
        return f"the mask depends on {len(inputs)} inputs ({', '.join(sorted(inputs))}), not one"
    q_spec, k_spec = (graph.node(attention_arguments(node)[n].name).spec for n in ("query", "key"))
    batch, seq_k = k_spec.shape[0], k_spec.shape[-2]
    keys = None
    if inputs:
        keys = _key_vector(graph, dag, upstream, inputs[0], mask.name, batch, seq_k)
        if keys is None:
            return (f"its input %{inputs[0]} does not become one boolean per [batch, key] = [{batch}, {seq_k}] "
                    "before it meets the queries: probing other values cannot be exact, so the mask stays a tensor")
    # evaluate the mask from the key vector (the nodes that compute it from the input stay in the
    # graph, run every call on the device: the model's own test, `== 1` or `> 0`, is kept as written)
    feeding = set() if keys is None else \
        (nx.ancestors(dag, keys) & (nx.descendants(dag, inputs[0]) | {inputs[0]})) | {keys}
    order = [n.name for n in graph.nodes() if n.name in upstream and n.name not in feeding]
    shape = (batch, q_spec.shape[1], q_spec.shape[-2], seq_k)
    device = _constant_device(graph, mask)

    def evaluate(given: torch.Tensor | None, on: torch.device = CPU) -> torch.Tensor | str:
        env = {} if keys is None else {keys: given.to(on).reshape(graph.node(keys).spec.shape)}
        try:
            for name in order:
                env[name] = evaluate_node(graph, graph.node(name), env, on)
        except Exception as exc:  # the subgraph cannot run on the probe: leave the mask as it is
            return f"probing the mask failed ({exc})"
        value = env[mask.name]
        leading = value.dim() - len(shape)  # the mask's dims line up with the shape's last ones
        if leading > 0 or any(d not in (1, shape[i - leading]) for i, d in enumerate(value.shape)):
            return f"the mask's shape {tuple(value.shape)} does not broadcast to {shape}"
        # kept at its own shape (a [1, 1, S, S] mask is not copied per head: at S = 16384 and 32 heads
        # the expanded probes held 8.6 G elements and took minutes per layer on the host)
        return value.reshape((1,) * (len(shape) - value.dim()) + tuple(value.shape))

    found = _probe(evaluate, batch, shape[2], seq_k, keys is not None, marks_padding=False)
    if isinstance(found, str) and keys is not None:  # torch.nn's convention: True = padding
        inverted = _probe(evaluate, batch, shape[2], seq_k, True, marks_padding=True)
        found = inverted if not isinstance(inverted, str) else found
    if isinstance(found, str):
        return found
    structure, bias, marks_padding = found
    if keys is None and not structure and bias is None:
        return Described(None, False, {}, None)  # attends everything: no mask at all
    empty_rows = None
    if keys is not None:
        empty_rows = _empty_rows(graph, node, evaluate, batch, seq_k, marks_padding, device, bias is not None)
        if empty_rows is None:
            return ("a query whose keys are all padding gets neither 0, the mean of V nor NaN from the model's "
                    "attention, so the mask stays a tensor")
    return Described(keys, marks_padding, structure, bias, empty_rows)


def _key_vector(graph: Graph, dag: nx.DiGraph, upstream: set[str], source: str, mask: str,
                batch: int, seq_k: int) -> str | None:
    """The first boolean node, on every path from the input ``source`` to the mask, that holds one
    value per (batch, key): the point where the model has decided which keys count. Probing
    from there (two values) is exact whatever the input holds; probing the input itself with
    0 and 1 would not be (``attention_mask == 1`` and ``!= 0`` differ at 2)."""
    wanted = [d for d in (batch, seq_k) if d != 1]
    below = nx.descendants(dag, source) | {source}
    for name in [n.name for n in graph.nodes() if n.name in upstream and n.name in below]:
        spec = graph.node(name).spec
        if not isinstance(spec, TensorSpec) or spec.dtype != torch.bool or spec.numel != batch * seq_k \
                or [d for d in spec.shape if d != 1] != wanted:
            continue
        rest = dag.subgraph(upstream - {name})
        if name in (source, mask) or not nx.has_path(rest, source, mask):
            return name
    return None


def _empty_rows(graph: Graph, node: Node, evaluate, batch: int, seq_k: int, marks_padding: bool,
                device: torch.device, has_bias: bool) -> str | None:
    """What the model's attention gives a query whose keys are all padding, found by running the
    node as the model wrote it (its mask tensor, SDPA or the recognised chain) on the model's
    device, where the answer is decided (SDPA's backends differ): "zero", "mean" (of V over
    every key), "nan", "unmasked" (the attention with no mask and no bias: a finite fill that
    shifts every score alike, in a kernel that accumulates in fp32), or None for anything else.
    Never "unmasked" beside a bias: such a model's row is the attention with the bias, which the
    fill does not give (a small bias came within the tolerance and its rows lost it: a helper's hunt)."""
    if attention_arguments(node).get("sinks") is not None:  # the sink takes the whole of a row with no key
        return "zero"
    keep = torch.ones(batch, seq_k, dtype=torch.bool)
    keep[0] = False
    value = evaluate(~keep if marks_padding else keep, device)
    if isinstance(value, str):
        return None
    given = attention_arguments(node)
    q_spec, k_spec = (graph.node(given[n].name).spec for n in ("query", "key"))
    dtype, rows, head_dim = q_spec.dtype, min(4, q_spec.shape[-2]), q_spec.shape[-1]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, rows, head_dim, generator=generator).to(device, dtype)
    k = torch.randn(1, 1, seq_k, head_dim, generator=generator).to(device, dtype)
    v = (torch.randn(1, 1, seq_k, head_dim, generator=generator) + 1).to(device, dtype)  # mean far from 0
    kwargs = {name: given[name] for name in ("scale", "is_causal", "empty_rows", "scores_dtype", "softcap") if name in given}
    try:
        out = attention_reference(q, k, v, value[:1, :1, :rows], **kwargs).float()
    except Exception:  # noqa: BLE001 - a probe the op refuses: keep the mask as it is
        return None
    if bool(torch.isnan(out).all()):
        return "nan"
    tolerance = 2e-2 * (1 + v.float().abs().mean())
    if bool((out.abs() <= tolerance).all()):
        return "zero"
    # the mean of V, or the attention with no mask and no bias: at long rows of soft scores the two
    # come close, so the nearer one is the answer where both are within the tolerance
    candidates = {"mean": v.float().mean(-2, keepdim=True)}
    if not has_bias:
        candidates["unmasked"] = attention_reference(q, k, v, scale=kwargs.get("scale"), softcap=kwargs.get("softcap"))
    distance = {name: float((out - value.float()).abs().max()) for name, value in candidates.items()}
    nearest = min(distance, key=distance.get)
    return nearest if distance[nearest] <= tolerance else None


def _probe_keys(probe: int, batch: int, seq_k: int, generator: torch.Generator) -> torch.Tensor:
    """The keys kept [B, S_k] in probe ``probe``: all (0); then rows keeping 1, 2 or 3 keys and rows
    missing one (a mask that also reads how many keys a row keeps, ``kv | (kv.sum(-1) <= 2)``,
    passed four random probes: found by a helper's fuzzing); then random halves. Never a row
    without a key (there the original and key padding differ by design); random places, so that
    every key, the first included, is probed as padding too."""
    if probe == 0:
        return torch.ones(batch, seq_k, dtype=torch.bool)
    order = torch.rand(batch, seq_k, generator=generator).argsort(-1)  # a random rank per key
    if probe == 1:
        return order < (1 + torch.arange(batch)[:, None] % 3)
    if probe == 2:
        return order < max(seq_k - 1, 1)
    keep = torch.rand(batch, seq_k, generator=generator) < 0.6
    keep[torch.arange(batch), torch.randint(seq_k, (batch,), generator=generator)] = True
    return keep


def _probe(evaluate, batch: int, seq_q: int, seq_k: int, has_input: bool, marks_padding: bool) \
        -> tuple[dict[str, object], torch.Tensor | None, bool] | str:
    """(structure, bias, marks_padding) when the mask, evaluated with every key kept and then
    with random padding (in the ``marks_padding`` convention), attends exactly the kept keys
    of one static structure and adds one bias; else why not."""
    generator = torch.Generator().manual_seed(0)
    static = bias = None
    for probe in range(PROBES if has_input else 1):
        keep = _probe_keys(probe, batch, seq_k, generator)
        value = evaluate(~keep if marks_padding else keep)
        if isinstance(value, str):
            return value
        if static is None:  # all keys kept: what is left is the static part, the same for every (b, h)
            allowed, bias = _split(value)
            if allowed is None:
                return "the additive mask is neither 0 / hidden nor a bias / the lowest values"
            if (mixed := _mixed_hiding(value, allowed)) is not None:
                return mixed
            static = allowed[0, 0]
            if not bool((allowed == static).all()):
                return "the attended positions vary over batch or heads beyond key padding"
            continue
        expected = keep[:, None, None, :] & static  # each comparison below broadcasts to [B, H, S_q, S_k]
        if bias is None:
            allowed, appeared = _split(value)
            if allowed is None or appeared is not None or not bool((allowed == expected).all()):
                return "the attended positions are not key padding and one static mask"
        elif not bool(((value < HIDDEN_BELOW) | expected).all()):
            return "the bias does not hide the padded keys and the static mask's"
        elif not bool((torch.where(expected, value, 0) == torch.where(expected, bias, 0)).all()):
            return "the bias changes with the padding input"
        if (mixed := _mixed_hiding(value, expected)) is not None:
            return mixed
    structure = _structure(static, seq_q, seq_k)
    if structure is None:
        return "its static part is not full, causal or a causal window"
    if bias is not None:  # [B or 1, H or 1, S_q, S_k], 0 where the static mask hides
        bias = torch.where(static, bias, 0)
        bias = _narrowed(bias.expand(*bias.shape[:2], seq_q, seq_k))
    return structure, bias, marks_padding


def _structure(static: torch.Tensor, seq_q: int, seq_k: int) -> dict[str, object] | None:
    """The kwargs of a static mask broadcastable to [S_q, S_k]: {} (full), causal, a causal window;
    else None. Boolean triangles only (an int64 distance matrix was 2 GiB at S = 16384)."""
    if bool(static.all()):
        return {}
    static = static.expand(seq_q, seq_k)
    causal = torch.ones(seq_q, seq_k, dtype=torch.bool).tril()
    if bool((static & ~causal).any()):
        return None
    if torch.equal(static, causal):
        return {"is_causal": True}
    rows = torch.arange(seq_q)
    attending = static.any(-1)
    if not bool(attending.any()):
        return None
    first = static.to(torch.uint8).argmax(-1)  # each row's first attended key
    reach = int((rows - first)[attending].max())
    if reach >= 1 and torch.equal(static, causal & ~torch.ones(seq_q, seq_k, dtype=torch.bool).tril(-reach - 1)):
        return {"is_causal": True, "window": reach}
    return None


def _split(value: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(attended positions, the bias or None) of the mask with every key kept: a boolean mask;
    an additive one that is 0 where attended and below HIDDEN_BELOW elsewhere (no bias); or
    else a bias, hidden only where it is the dtype's lowest values (finfo.min, -inf; a bias
    far below HIDDEN_BELOW, ALiBi's at long distances, stays a bias)."""
    if value.dtype == torch.bool:
        return value, None
    hidden = value < HIDDEN_BELOW
    if not bool(((value != 0) & ~hidden).any()):  # no copy of the attended values
        return ~hidden, None
    if not value.is_floating_point():
        return None, None
    return ~(value < torch.finfo(value.dtype).min / 2), value


def _mixed_hiding(value: torch.Tensor, attended: torch.Tensor) -> str | None:
    """Why not, when an additive mask hides keys with more than one value (a causal part at -inf and
    the padding at finfo.min, -1e9 beside finfo.min, a bias beside the fill): a query hidden from
    every key then attends the least hidden ones, which the kernels' key padding and empty-row
    answers do not say (rows of a left-padded sequence gave 0 or the mean of every V: a helper's hunt)."""
    if not value.is_floating_point():
        return None
    lowest = float(torch.where(attended, float("inf"), value).amin())
    highest = float(torch.where(attended, float("-inf"), value).amax())
    if lowest < highest:  # some key hidden, and not all by one value
        return (f"it hides keys with different values ({lowest:.6g} to {highest:.6g}): a query hidden from every "
                "key would attend the least hidden ones, so the mask stays a tensor")
    return None


def _narrowed(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` [B, H, S_q, S_k] with the batch and head dims that do not vary cut to size 1."""
    for dim in (0, 1):
        first = bias.narrow(dim, 0, 1)
        if bool((bias == first).all()):
            bias = first
    return bias.contiguous()


def _constant_device(graph: Graph, mask: Ref) -> torch.device:
    """Where the mask's constants live (the model's device), so the bias constant joins them."""
    upstream = nx.ancestors(graph.nx_graph, mask.name) | {mask.name}
    devices = [graph.constants[n].device for n in upstream if n in graph.constants]
    return devices[0] if devices else torch.device("cpu")
