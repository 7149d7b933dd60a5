"""The op registry: canonical op name -> pattern kind, ATen aliases, torch reference.

Fusion reads only the pattern kind (as TVM does), so an op joins fusion by declaring
its kind here. Aliases normalise the many spellings of one op: every overload of
``aten.add`` (``add.Tensor``, ``add.Scalar``, ``add_.Tensor``...) is the op ``add``.

Shape and dtype rules are not written by hand: an op's output spec is what its torch
reference returns when run on fake tensors (``FakeTensorMode``), so the rule can never
disagree with the reference. Ops that have no ATen target (fused nodes created by
passes) register a ``reference`` callable instead.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from stof_cc.ir.node import CONSTANT, INPUT, GraphError, Node, Spec, TensorSpec, map_refs
from stof_cc.ir.reference import fill_empty_rows, masked_attention

if TYPE_CHECKING:
    from stof_cc.ir.graph import Graph

PATTERN_KINDS = ("elementwise", "broadcast", "injective", "reduction", "gemm", "attention", "opaque")
OPAQUE = "opaque"


@dataclass(frozen=True)
class OpDef:
    """One canonical op.

    ``aten`` lists the ATen packets (``"aten.linear"``) whose overloads are this op.
    ``reference`` is only needed for ops with no ATen target; otherwise the node's own
    ``target`` overload is the reference.
    """

    name: str
    kind: str
    aten: tuple[str, ...] = ()
    reference: Callable[..., Any] | None = None
    doc: str = ""


_OPS: dict[str, OpDef] = {}
_BY_PACKET: dict[str, OpDef] = {}


def register_op(op: OpDef) -> OpDef:
    """Add an op to the registry; names and ATen packets must be new."""
    if op.kind not in PATTERN_KINDS:
        raise ValueError(f"op {op.name!r}: unknown pattern kind {op.kind!r}; expected one of {PATTERN_KINDS}")
    if op.name in _OPS or op.name in (INPUT, CONSTANT, OPAQUE):
        raise ValueError(f"op {op.name!r} is already registered")
    for packet in op.aten:
        if packet in _BY_PACKET:
            raise ValueError(f"op {op.name!r}: ATen packet {packet!r} already belongs to {_BY_PACKET[packet].name!r}")
    _OPS[op.name] = op
    for packet in op.aten:
        _BY_PACKET[packet] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; registered ops: {', '.join(sorted(_OPS))}") from None


def all_ops() -> list[OpDef]:
    return sorted(_OPS.values(), key=lambda o: o.name)


#: Overloads of a known packet that mean something else: ``x.view(torch.int32)`` reinterprets the
#: bits (taken as a reshape, every element came out converted instead: found by review). Opaque:
#: they run in torch.
REINTERPRETING = frozenset({"aten.view.dtype"})


def canonical_op(target: str) -> str:
    """Canonical op name for an ATen overload or Python function name; OPAQUE if unknown.

    ``"aten.add.Tensor"`` -> packet ``"aten.add"``; in-place ``"aten.add_.Tensor"`` maps to
    the same op (export functionalises, but hand-built graphs may not).
    """
    if target in _BY_PACKET:
        return _BY_PACKET[target].name
    if target in REINTERPRETING:
        return OPAQUE
    parts = target.split(".")
    packet = ".".join(parts[:2]) if len(parts) >= 2 else target
    if packet in _BY_PACKET:
        return _BY_PACKET[packet].name
    if packet.endswith("_") and packet[:-1] in _BY_PACKET:
        return _BY_PACKET[packet[:-1]].name
    return OPAQUE


def pattern_kind(op: str) -> str:
    """Pattern kind of a canonical op; graph inputs and constants report their own role."""
    if op in (INPUT, CONSTANT, OPAQUE):
        return op
    return get_op(op).kind


@functools.cache
def resolve_target(target: str) -> Callable[..., Any]:
    """The callable behind a target string: ``aten.x.overload`` or ``operator.name`` (cached: a
    compiled model resolves its torch steps' targets on every call)."""
    namespace, _, rest = target.partition(".")
    try:
        if namespace == "operator":
            return getattr(operator, rest)
        fn: Any = torch.ops
        for part in target.split("."):
            fn = getattr(fn, part)
        return fn
    except AttributeError:
        raise GraphError(f"target {target!r} names no torch operator") from None


_STRIDE_FREE = {"aten.view.default": "aten.reshape.default", "aten._unsafe_view.default": "aten.reshape.default"}


def reference_of(node: Node) -> Callable[..., Any]:
    """The torch callable that defines what ``node`` computes.

    ``view`` runs as ``reshape``: the IR is functional (no value is mutated through an alias),
    so the two compute the same values, and kernels that replace eager's ops may return a
    different memory layout than eager did, on which a strict ``view`` would fail."""
    if node.target is not None:
        return resolve_target(_STRIDE_FREE.get(node.target, node.target))
    op = get_op(node.op)
    if op.reference is None:
        raise GraphError(f"node %{node.name} ({node.op}) has neither a target nor a reference")
    return op.reference


def spec_of_value(value: Any) -> Spec:
    """TensorSpec (or tuple of them) of a torch result; None for non-tensor results."""
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(spec_of_value(v) for v in value)
    return None


def infer_spec(graph: Graph, node: Node) -> Spec:
    """Output spec of ``node`` from its inputs' specs, by running its reference on fake tensors:
    CPU ones, then, where the CPU rule refuses, meta ones (a dtype only the CPU kernel lacks:
    ``histc`` of int32, which transformers' MoE routing runs on the GPU)."""
    fn = reference_of(node)
    try:
        return spec_of_value(_run_fake(graph, node, fn, torch.device("cpu")))
    except Exception as on_cpu:  # report which node's rule failed, whatever torch raised
        try:
            return spec_of_value(_run_fake(graph, node, fn, torch.device("meta")))
        except Exception:  # noqa: BLE001 - the CPU's reason is the one to report
            pass
        if node.target in _READS_A_NUMBER:
            raise GraphError(f"node %{node.name} ({node.target}) reads a tensor's value into a Python number "
                             "(.item(), int(t), float(t)); stof-cc compiles graphs of tensors: keep the value a "
                             "tensor (x / x.abs().max() rather than x / x.abs().max().item())") from on_cpu
        raise GraphError(f"node %{node.name} ({node.op}, {node.target}): shape rule failed: {on_cpu}") from on_cpu


def _run_fake(graph: Graph, node: Node, fn: Callable[..., Any], device: torch.device) -> Any:
    """``fn`` on fake tensors of ``node``'s input specs on ``device`` (so are a traced graph's
    device literals)."""
    with FakeTensorMode(allow_non_fake_inputs=True):

        def fake(ref: Any) -> Any:
            spec = graph.spec_of(ref)
            if isinstance(spec, TensorSpec):
                return torch.empty(spec.shape, dtype=spec.dtype, device=device)
            if isinstance(spec, tuple):
                return tuple(torch.empty(s.shape, dtype=s.dtype, device=device) if s else None for s in spec)
            return spec

        def placed(value: Any) -> Any:
            return device if isinstance(value, torch.device) else value

        args = [placed(a) for a in map_refs(node.args, fake)]
        kwargs = {k: placed(v) for k, v in map_refs(node.kwargs, fake).items()}
        was = getattr(_PROBING, "on", False)
        _PROBING.on = True  # fake_tensor logs a refusal's traceback, which `infer_spec` reports or retries
        try:
            return fn(*args, **kwargs)
        finally:
            _PROBING.on = was


_PROBING = threading.local()  # .on: this thread is running a shape rule on fakes


class _QuietWhileProbing(logging.Filter):
    """Drops fake_tensor's records while this thread runs a shape rule (other threads' and other
    times' records pass: a logger level set and restored would race between threads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_PROBING, "on", False)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietWhileProbing())


_READS_A_NUMBER = ("aten.item.default", "aten._local_scalar_dense.default")  # no static value to reason about


# Ops whose outputs after the first are statistics kept in the accumulation type on CUDA (float32
# for fp16 / bf16 inputs) but in the input dtype on the CPU, where the shape rule runs: a graph
# AOTAutograd traced on a GPU records f32 there (the tensor-parallel route's LayerNorm).
_DEVICE_DTYPED_STATS = ("aten.native_layer_norm.", "aten.native_group_norm.")


def matches_on_some_device(node: Node, recorded: Spec, inferred: Spec) -> bool:
    """Whether ``recorded`` is ``inferred`` as another device computes it: the same, or (ops of
    `_DEVICE_DTYPED_STATS`) the same but for float32 statistics where the CPU keeps the input dtype."""
    if recorded == inferred:
        return True
    if not str(node.target).startswith(_DEVICE_DTYPED_STATS) or not isinstance(recorded, tuple) \
            or not isinstance(inferred, tuple) or len(recorded) != len(inferred) or recorded[0] != inferred[0]:
        return False
    return all(r == i or (isinstance(r, TensorSpec) and isinstance(i, TensorSpec) and r.shape == i.shape
                          and r.dtype == torch.float32) for r, i in zip(recorded[1:], inferred[1:], strict=True))


def _ops(kind: str, doc: str, table: dict[str, tuple[str, ...]]) -> None:
    for name, packets in table.items():
        register_op(OpDef(name, kind, packets, doc=doc))


# -- the built-in table ---------------------------------------------------------------
# Covers what torch.export produces for BERT-, GPT-2- and ViT-style blocks.

_ops("gemm", "matrix products: the anchors of GEMM fusion groups", {
    "linear": ("aten.linear",),
    "matmul": ("aten.matmul",),
    "mm": ("aten.mm",),
    "bmm": ("aten.bmm",),
    "addmm": ("aten.addmm",),
    "baddbmm": ("aten.baddbmm",),
})

_ops("attention", "masked multi-head attention", {
    "scaled_dot_product_attention": ("aten.scaled_dot_product_attention",),
})


def split_piece(split: Node, shape: tuple[int, ...], index: int) -> tuple[int, int, int | None]:
    """(dim, offset, size) of piece ``index`` of a ``split`` node (aten.split, split_with_sizes,
    chunk, unbind) over an input of ``shape``; size None for unbind's pieces (a select)."""
    target = split.target or ""
    unbind = target.startswith("aten.unbind")
    if unbind:  # unbind(x) exports without its default dim (found by review: an IndexError)
        dim = split.args[1] if len(split.args) > 1 else split.kwargs.get("dim", 0)
    else:
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    dim = (dim or 0) % len(shape)
    if unbind:
        return dim, index, None
    sizes = split.args[1]
    if target.startswith("aten.chunk"):  # chunk(x, n): n pieces of ceil(size / n)
        sizes = -(-shape[dim] // sizes)
    if isinstance(sizes, int):  # split(x, size): pieces of that size, the last one shorter
        sizes = [min(sizes, shape[dim] - start) for start in range(0, shape[dim], sizes)]
    return dim, sum(sizes[:index]), sizes[index]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                        *, scale: float, is_causal: bool = False, window: int | None = None,
                        key_padding: torch.Tensor | None = None, empty_rows: str | None = None,
                        bias: torch.Tensor | None = None, scores_dtype: torch.dtype | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ additive mask | masked by a boolean mask] [+ bias] [causal]) v:
    what the recognised `attention` node computes, with SDPA's conventions for ``mask``;
    ``bias`` (ALiBi, broadcastable to [B, H, S_q, S_k]) is added to the scores beside any mask. ``window``
    (with ``is_causal``) keeps keys with 0 <= q - k <= window. With ``key_padding`` [B, S_k]
    (nonzero = a real token) keys are attended only where it is nonzero; a float ``mask`` is
    then a bias added where attended (T5's relative positions). ``empty_rows`` is what a query
    that can attend no key gives, as the model's own attention gave it (`reference.EMPTY_ROWS`;
    `passes/key_padding.py` records it when it replaces the model's mask): 0 when unset under
    key padding or a window, as stof-cc's kernels give; with neither and unset, SDPA's own. K
    and V may have fewer heads than q (grouped-query attention: query head h reads key/value
    head h // (H / H_kv)). ``scores_dtype``: the node is a hand-written chain that adds a float mask to
    scores it holds in that dtype (its q k^T product's: q's in eager Llama and BLOOM, fp32 where q and k
    were upcast, as GPT-J's): in fp16 a finite -65504 mask then swamps every score and a fully masked
    row is the mean of V, which fp32 arithmetic would not give.
    ``softcap`` c: the scores are c * tanh(q k^T * scale / c) before any mask (Gemma 2).
    ``sinks`` (H logits, one per query head: GPT-OSS): each row's softmax also holds a key with that
    score and a value of 0, as the model's chain concatenates it to the scores and drops its column
    after the softmax; a row with no allowed key then gives 0 (a finite sink takes all of it)."""
    additive = [t for t in (mask, bias) if t is not None and t.is_floating_point()]
    added = additive[0] if len(additive) == 1 else additive[0] + additive[1] if additive else None
    if sinks is not None:  # in fp32, as `masked_attention` computes (the recogniser takes no softcap beside sinks)
        if softcap is not None:
            raise NotImplementedError("attention_reference: softcapped scores with sinks")
        return masked_attention(q, k, v, _allowed_keys(q, k, mask, is_causal, window, key_padding), scale,
                                bias=None if added is None else added.float(), sinks=sinks)
    if scores_dtype is not None and mask is not None and mask.is_floating_point() and key_padding is None \
            and window is None:
        return _written_out(q, k, v, mask if bias is None else mask + bias, scale, is_causal, dtype=scores_dtype,
                            softcap=softcap)
    if key_padding is None and window is None and empty_rows is None and softcap is None \
            and not (is_causal and (added is not None or mask is not None)):  # SDPA takes one or the other
        if added is not None and mask is not None and mask.dtype == torch.bool:
            added = torch.where(mask, added, float("-inf"))
        return _sdpa(q, k, v, mask if added is None else added, scale, is_causal)
    allowed = _allowed_keys(q, k, mask, is_causal, window, key_padding)
    given = allowed if added is None else torch.where(allowed, added, float("-inf"))
    if softcap is None:
        out = _sdpa(q, k, v, given, scale, False)
    else:
        out = _written_out(q, k, v, given, scale, False, softcap=softcap)
    empty = ~allowed.any(-1, keepdim=True)
    unmasked = None if empty_rows != "unmasked" else attention_reference(q, k, v, scale=scale, softcap=softcap)
    return fill_empty_rows(out.masked_fill(empty, 0), v, empty, empty_rows, unmasked)


def _allowed_keys(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                  window: int | None, key_padding: torch.Tensor | None) -> torch.Tensor:
    """Which keys each query may attend under `attention_reference`'s arguments (a boolean mask,
    causal, 0 <= q - k <= window, key padding), broadcastable to [B, H, S_q, S_k]."""
    allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = allowed.tril()
    if window is not None:
        allowed = allowed.triu(-window)
    if key_padding is not None:
        allowed = allowed & (key_padding != 0)[:, None, None, :]
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    return allowed


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          is_causal: bool) -> torch.Tensor:
    """SDPA, with grouped K/V heads repeated where there is a mask: with a mask and
    ``enable_gqa`` only SDPA's math backend runs, which holds the fp32 scores (32 GiB for 32
    heads at S = 16384), while the memory-efficient one takes the mask at the repeated heads."""
    gqa = k.shape[-3] != q.shape[-3]
    if gqa and mask is not None:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        gqa = False
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                            enable_gqa=gqa)


def _written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 is_causal: bool, *, dtype: torch.dtype = torch.float32, softcap: float | None = None) -> torch.Tensor:
    """Attention as the eager chain writes it: the scores materialised in ``dtype``, capped, masked
    (boolean: attend; floating: added), softmax in fp32."""
    if k.shape[-3] != q.shape[-3]:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # a floating mask adds with type promotion, as the chain's own add (fp16 scores + an fp32 mask: fp32)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v)


register_op(OpDef("attention", "attention", reference=attention_reference,
                  doc="one attention node made by passes/attention.py from SDPA or the hand-written chain"))

def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary position embedding as HF applies it: ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``; cos and sin broadcast to x."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


register_op(OpDef("rotary", "injective", reference=rotary_reference,
                  doc="the rotary embedding, one node made by passes/rotary.py from HF's mul/slice/neg/cat/add"))

def overflow_clamp_reference(x: torch.Tensor, cap_if_inf: float, cap: float) -> torch.Tensor:
    """T5's fp16 overflow guard: ``clamp(x, -w, w)`` with ``w = cap_if_inf`` when any element
    of x is infinite, else ``cap`` (transformers writes it ``where(isinf(x).any(), ...)``)."""
    bound = torch.where(torch.isinf(x).any(), cap_if_inf, cap)
    return torch.clamp(x, -bound, bound)


register_op(OpDef("overflow_clamp", "reduction", reference=overflow_clamp_reference,
                  doc="clamp by a bound chosen by a whole-tensor any(isinf); made by passes/overflow_clamp.py"))

_ops("reduction", "row reductions: softmax and normalisations", {
    "softmax": ("aten.softmax", "aten._softmax"),
    "log_softmax": ("aten.log_softmax", "aten._log_softmax"),
    "layer_norm": ("aten.layer_norm", "aten.native_layer_norm"),
    "rms_norm": ("aten.rms_norm",),
    "sum": ("aten.sum",),
    "mean": ("aten.mean",),
    "amax": ("aten.amax", "aten.max"),
    "var": ("aten.var", "aten.var_mean"),
})

_ops("elementwise", "one output element from the same input element", {
    "gelu": ("aten.gelu",),
    "relu": ("aten.relu",),
    "silu": ("aten.silu",),
    "tanh": ("aten.tanh",),
    "sigmoid": ("aten.sigmoid",),
    "exp": ("aten.exp",),
    "erf": ("aten.erf",),
    "sqrt": ("aten.sqrt",),
    "rsqrt": ("aten.rsqrt",),
    "neg": ("aten.neg",),
    "pow": ("aten.pow",),
    "clamp": ("aten.clamp",),
    "clamp_min": ("aten.clamp_min",),
    "clamp_max": ("aten.clamp_max",),
    "hardtanh": ("aten.hardtanh",),
    "abs": ("aten.abs",),
    "exp2": ("aten.exp2",),
    "expm1": ("aten.expm1",),
    "log": ("aten.log",),
    "log1p": ("aten.log1p",),
    "sin": ("aten.sin",),
    "cos": ("aten.cos",),
    "reciprocal": ("aten.reciprocal",),
    "square": ("aten.square",),
    "softplus": ("aten.softplus",),
    "mish": ("aten.mish",),
    "elu": ("aten.elu",),
    "selu": ("aten.selu",),
    "leaky_relu": ("aten.leaky_relu",),
    "logical_not": ("aten.logical_not", "aten.bitwise_not"),
    "dropout": ("aten.dropout",),  # identity in eval mode (train=False)
    "cast": ("aten.to", "aten._to_copy", "aten.type_as"),
    "clone": ("aten.clone", "aten.alias", "aten.detach", "aten.lift_fresh_copy"),
})

_ops("elementwise", "creation ops: no tensor inputs, folded to constants by canonicalize", {
    "arange": ("aten.arange",),
    "full": ("aten.full", "aten.zeros", "aten.ones", "aten.empty"),
    "full_like": ("aten.full_like", "aten.zeros_like", "aten.ones_like", "aten.empty_like",
                  "aten.new_ones", "aten.new_zeros", "aten.new_full", "aten.new_empty"),
})

_ops("broadcast", "binary elementwise ops whose operands broadcast", {
    "add": ("aten.add",),
    "sub": ("aten.sub", "aten.rsub"),
    "mul": ("aten.mul",),
    "div": ("aten.div",),
    "remainder": ("aten.remainder",),
    # torch.max(x, y) / torch.min(x, y) are elementwise (max.other), not the reduction amax: an exact
    # overload is looked up before its packet (found by review: it anchored a reduction group)
    "maximum": ("aten.maximum", "aten.max.other"),
    "minimum": ("aten.minimum", "aten.min.other"),
    "where": ("aten.where",),
    "masked_fill": ("aten.masked_fill",),
    "compare": ("aten.eq", "aten.ne", "aten.lt", "aten.le", "aten.gt", "aten.ge"),
    "logical": ("aten.__and__", "aten.__or__", "aten.logical_and", "aten.logical_or",
                "aten.bitwise_and", "aten.bitwise_or"),
})

_ops("injective", "layout and indexing: each output element reads one input element", {
    "view": ("aten.view", "aten._unsafe_view", "aten.reshape", "aten.flatten", "aten.unflatten"),
    "transpose": ("aten.transpose", "aten.t", "aten.numpy_T", "aten.permute"),
    "expand": ("aten.expand",),
    "repeat_interleave": ("aten.repeat_interleave.self_int",),
    "unsqueeze": ("aten.unsqueeze",),
    "squeeze": ("aten.squeeze",),
    "slice": ("aten.slice", "aten.narrow"),
    "select": ("aten.select",),
    "contiguous": ("aten.contiguous",),
    "cat": ("aten.cat",),
    "stack": ("aten.stack",),
    "split": ("aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind"),
    "getitem": ("operator.getitem",),
    "embedding": ("aten.embedding",),
    "gather": ("aten.gather", "aten.index"),
})

_ops("opaque", "trace-time checks: no data effect, dropped by canonicalize", {
    "assert_metadata": ("aten._assert_tensor_metadata", "aten._assert_scalar"),
})
