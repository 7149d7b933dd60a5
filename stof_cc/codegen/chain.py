"""Elementwise chains -> C++ statements: the shared code generator of the fused templates.

A fusion group's prologue or epilogue is a run of elementwise/broadcast nodes. `Chain`
turns such a run into straight-line C++ over ``float`` values (one output element per
evaluation), reading each outside tensor through one of three access patterns:

* ``full``: the same shape as the chain's output, read at the element's flat index;
* ``row``: a vector over the last dimension (a bias, a LayerNorm weight) broadcast over the
  leading ones, read at ``index % row_length``;
* ``scalar``: a one-element tensor, read at 0;
* ``columns`` (only where the template asks for it: ``layouts=True``): a run of whole columns of a
  wider tensor, a piece of a split or a slice along the last dimension (the halves of a fused
  gate and up projection, which a mixture of experts' grouped GEMM returns as one tensor), read at
  ``(index / row_length) * row_stride + offset + index % row_length``.

With ``layouts=True`` a value may also have another shape of as many elements and the same last
dimension (a view that only regroups the leading dimensions, as ``[T, H]`` back to ``[B, S, H]``):
over contiguous tensors its flat index is the output's, so such views cost nothing.

Reads are emitted as ``LOAD_FULL(in0)``, ``LOAD_ROW(in1)``, ``LOAD_SCALAR(in2)``,
``LOAD_COLUMNS(in3, offset, row_stride)``: each template defines these macros for its own indexing
(a vector buffer, a GEMM tile's row and column), so one generator serves all of them.

Anything else (other broadcasts, boolean ops, integer math, layout changes) raises
`NotFusable` with the node and the reason (`indexed.IndexedChain` takes most of it), and the
group runs through torch instead. Values are computed in fp32 and rounded once, at the store,
but for the inputs of an op whose result jumps or that keeps them (`rounds_its_inputs`), rounded as eager
holds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec
from stof_cc.ir.ops import split_piece


class NotFusable(Exception):
    """A node the chain generator cannot express; the message names it and says why."""


class NotItsPattern(NotFusable):
    """A template's refusal of a group it is not written for at all (another anchor op, no norm
    after the GEMM): when another template got further, that one's reason is the one to show."""


@dataclass(frozen=True)
class Operand:
    """A tensor the chain reads from outside: its graph value, C name and access pattern."""

    ref: Ref
    name: str
    access: str  # "full" | "row" | "scalar" | "columns"
    offset: int = 0  # columns: the first column read, and the source's row length
    row_stride: int = 0


def _float(value: Any) -> str:
    value = float(value)
    if math.isinf(value):
        return "INFINITY" if value > 0 else "-INFINITY"
    if math.isnan(value):  # repr's "nan" + "f" is no C (nvcc refused the kernel: found by review)
        return 'nanf("")'
    return f"{value!r}f"


def _gelu(node: Node, a: list[str]) -> str:
    if node.kwargs.get("approximate", "none") == "tanh":
        return f"0.5f * {a[0]} * (1.f + tanhf(0.7978845608f * ({a[0]} + 0.044715f * {a[0]} * {a[0]} * {a[0]})))"
    return f"gelu_erf({a[0]})"  # group_common.j2's prelude


def _pow(node: Node, a: list[str]) -> str:
    """x ** y. --use_fast_math turns powf into exp2(y * log2(x)), NaN for every negative x (GPT-2's
    tanh-GELU cubes negative values): small integer powers multiply, other integer powers take
    |x| and the sign, and anything else runs pow in double precision, which fast math leaves
    exact."""
    exponent = node.args[1] if len(node.args) > 1 else None
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and float(exponent).is_integer():
        n = int(exponent)
        if abs(n) <= 4:
            product = " * ".join([a[0]] * abs(n)) or "1.f"
            return f"({product})" if n >= 0 else f"(1.f / ({product}))"
        magnitude = f"powf(fabsf({a[0]}), {_float(n)})"
        return f"copysignf({magnitude}, {a[0]})" if n % 2 else magnitude
    if exponent == 0.5:  # torch takes sqrt and rsqrt here: sqrt(-inf) is NaN, rsqrt(-0) is -inf
        return f"(float)sqrt((double)({a[0]}))"
    if exponent == -0.5:
        return f"(float)(1.0 / sqrt((double)({a[0]})))"
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        # a finite negative base to a fractional power is NaN; -inf to one is C's pow's (+inf or +0), as
        # torch gives it (found by review: NaN before)
        return f"({a[0]} < 0.f && {a[0]} != -INFINITY ? NAN : (float)pow((double)({a[0]}), {_float(exponent)}))"
    return f"(float)pow((double)({a[0]}), (double)({a[1]}))"  # a tensor exponent: C's pow, per element


def _add(node: Node, a: list[str]) -> str:
    alpha = node.kwargs.get("alpha", 1)
    return f"{a[0]} + {a[1]}" if alpha == 1 else f"{a[0]} + {_float(alpha)} * {a[1]}"


def _sub(node: Node, a: list[str]) -> str:
    alpha = node.kwargs.get("alpha", 1)
    lhs, rhs = (a[1], a[0]) if (node.target or "").startswith("aten.rsub") else (a[0], a[1])
    return f"{lhs} - {rhs}" if alpha == 1 else f"{lhs} - {_float(alpha)} * {rhs}"


def _div(node: Node, a: list[str]) -> str:
    mode = node.kwargs.get("rounding_mode")
    if mode not in (None, "floor", "trunc"):
        raise NotFusable(f"%{node.name}: div with rounding_mode={mode!r}")
    if mode is None:
        return f"div_rn({a[0]}, {a[1]})"  # group_common.j2: IEEE division under fast math
    if mode == "floor":
        return f"floor_divide({a[0]}, {a[1]})"
    quotient = f"div_rn({a[0]}, {a[1]})"
    if all(isinstance(x, Ref) for x in node.args[:2]):  # eager's CUDA kernel divides two fp16 / bf16 tensors
        quotient = rounded_to(quotient, node.spec.dtype)  # in their dtype, then truncates
    return f"truncf({quotient})"


def _remainder(node: Node, a: list[str]) -> str:
    """torch.remainder (group_common.j2's ``remainder_of``); a number beside an fp16 / bf16 tensor is
    rounded to its dtype first, as eager's kernel takes it (0.7 is 0.7002 in fp16: every result
    near a multiple moved, found on the GPU)."""
    args = [_float(in_dtype(x, node.spec.dtype)) if isinstance(x, int | float) and not isinstance(x, bool) else v
            for x, v in zip(node.args[:2], a, strict=True)]
    return f"remainder_of({args[0]}, {args[1]})"


def in_dtype(number: float, dtype: Any) -> float:
    """``number`` as ``dtype`` holds it, for fp16 and bf16 (else as it is)."""
    return torch.tensor(number, dtype=dtype).item() if dtype in (torch.float16, torch.bfloat16) else number


def _dropout(node: Node, args: list[str]) -> str:
    """Dropout in eval mode is the identity; in training mode (``train`` True) it is random, which no
    generated chain draws: refused (it was generated as the identity: found by review)."""
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False)
    if train is not False:
        raise NotFusable(f"%{node.name}: dropout in training mode (train={train}) has no generated code")
    return args[0]


def _clamp(node: Node, a: list[str]) -> str:
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    if isinstance(low, Ref) or isinstance(high, Ref):  # a clear refusal, not a TypeError (found by review)
        raise NotFusable(f"%{node.name}: clamp with tensor bounds has no code generator here")
    out = a[0]
    if low is not None:
        out = f"max_nan({out}, {_float(low)})"
    if high is not None:
        out = f"min_nan({out}, {_float(high)})"
    return out


def _identity(node: Node, a: list[str]) -> str:
    return a[0]


def _cast(node: Node, a: list[str]) -> str:
    """fp32 inside, but a cast to fp16 or bf16 rounds there, as torch's does (``y - y.half().float()``
    is the rounding error: read as a no-op it came out 0, found by review); the store rounds to the
    output dtype too."""
    return rounded_to(a[0], node.spec.dtype if isinstance(node.spec, TensorSpec) else None)


def rounded_to(expr: str, dtype: Any) -> str:
    """The fp32 value ``expr`` rounded to ``dtype`` where that is fp16 or bf16 (as eager holds a
    value of that dtype), still a float; ``expr`` itself for any other dtype."""
    rounding = {"torch.float16": "__half2float(__float2half_rn({}))",
                "torch.bfloat16": "__bfloat162float(__float2bfloat16_rn({}))"}.get(str(dtype))
    return expr if rounding is None else rounding.format(expr)


def held(expr: str, dtype: Any, node: Node) -> str:
    """An fp32 input value ``expr`` of ``dtype`` as ``node`` (`rounds_its_inputs`) takes it: rounded to
    ``dtype`` (as eager holds it), then, for an op that computes in its result's dtype (remainder, a
    rounding division), to that (``x_fp16 % t`` with a 0-d fp32 ``t`` divides by fp16's ``t``: found by
    review)."""
    expr = rounded_to(expr, dtype)
    if node.op in ("remainder", "div") and isinstance(node.spec, TensorSpec) and node.spec.dtype != dtype:
        expr = rounded_to(expr, node.spec.dtype)
    return expr


def rounds_its_inputs(node: Node) -> bool:
    """Whether ``node`` reads each fp32 input that eager holds in fp16 / bf16 rounded to it first: an op
    whose result jumps where its input crosses a value (a comparison, a logical op, floor or trunc
    division, remainder) and every cast (to an integer or bool it jumps; to fp32 it keeps the value, so
    ``(x + m).float()`` must keep eager's fp16 sum: unrounded, a softmax row hidden at finfo.min came out
    softmax(x), found by review). Unrounded, ``(x * 10.7).long()`` differed from eager by one in 90 of
    4096 fp16 elements (found by review); elsewhere one rounding, at the store, is within the dtype's
    own error."""
    if node.op in ("compare", "remainder", "logical", "logical_not", "cast"):
        return True
    return node.op == "div" and node.kwargs.get("rounding_mode") is not None


def _call(function: str) -> tuple[int, Callable[[Node, list[str]], str]]:
    """A one-argument C math function applied to the value: ``function(x)``."""
    return 1, lambda node, a: f"{function}({a[0]})"


def _argument(node: Node, position: int, name: str, default: float) -> float:
    """A number argument of ``node``, positional or keyword, else ``default``."""
    value = node.args[position] if len(node.args) > position else node.kwargs.get(name, default)
    if value is not None and not isinstance(value, (int, float)):
        raise NotFusable(f"%{node.name}: {node.op}'s {name} is a tensor, not a number")
    return float(default if value is None else value)


SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _softplus(node: Node, a: list[str]) -> str:
    """torch's: x once beta * x passes the threshold, else log1p(exp(beta * x)) / beta."""
    beta, threshold = _argument(node, 1, "beta", 1.0), _argument(node, 2, "threshold", 20.0)
    return (f"({_float(beta)} * {a[0]} > {_float(threshold)} ? {a[0]} : "
            f"log1pf(expf({_float(beta)} * {a[0]})) / {_float(beta)})")


def _elu(node: Node, a: list[str]) -> str:
    alpha, scale = _argument(node, 1, "alpha", 1.0), _argument(node, 2, "scale", 1.0)
    input_scale = _argument(node, 3, "input_scale", 1.0)
    return (f"({a[0]} > 0.f ? {_float(scale)} * {a[0]} : "
            f"{_float(scale * alpha)} * expm1f({_float(input_scale)} * {a[0]}))")


def _clamp_side(keep: str, bound: str) -> Callable[[Node, list[str]], str]:
    """clamp_min / clamp_max: one bound (argument ``bound``), NaN kept."""
    return lambda node, a: f"{keep}_nan({a[0]}, {_float(_argument(node, 1, bound, 0.0))})"


FLAT_VIEWS = ("view", "squeeze", "unsqueeze", "contiguous")  # with ``layouts``: between `Chain._whole` shapes

# op -> (number of leading value arguments, C expression); the tensor-valued arguments
# arrive as C expressions in `a`
EMITTERS: dict[str, tuple[int, Callable[[Node, list[str]], str]]] = {
    "add": (2, _add),
    "sub": (2, _sub),
    "mul": (2, lambda n, a: f"{a[0]} * {a[1]}"),
    "div": (2, _div),
    "maximum": (2, lambda n, a: f"max_nan({a[0]}, {a[1]})"),  # group_common.j2: NaN in, NaN out, as torch
    "minimum": (2, lambda n, a: f"min_nan({a[0]}, {a[1]})"),
    "relu": (1, lambda n, a: f"max_nan({a[0]}, 0.f)"),
    "gelu": (1, _gelu),
    "silu": (1, lambda n, a: f"{a[0]} / (1.f + expf(-{a[0]}))"),
    "sigmoid": (1, lambda n, a: f"1.f / (1.f + expf(-{a[0]}))"),
    "tanh": _call("tanhf"),
    "exp": _call("expf"),
    "erf": _call("erff"),
    "sqrt": _call("sqrtf"),
    "rsqrt": _call("rsqrtf"),
    "neg": (1, lambda n, a: f"-{a[0]}"),
    "pow": (2, _pow),
    "clamp": (1, _clamp),
    "dropout": (1, _dropout),  # canonicalize bypasses eval dropout; one in training mode is refused
    "cast": (1, _cast),
    "clone": (1, _identity),
    "remainder": (2, _remainder),
    "abs": _call("fabsf"),
    "exp2": _call("exp2f"),
    "expm1": _call("expm1f"),
    "log": _call("logf"),
    "log1p": _call("log1pf"),
    "sin": (1, lambda n, a: f"sinf(reduced_angle({a[0]}))"),  # group_common.j2: fast math's sinf is exact
    "cos": (1, lambda n, a: f"cosf(reduced_angle({a[0]}))"),  # only within [-pi, pi]
    "reciprocal": (1, lambda n, a: f"div_rn(1.f, {a[0]})"),
    "square": (1, lambda n, a: f"{a[0]} * {a[0]}"),
    "softplus": (1, _softplus),
    "mish": (1, lambda n, a: f"{a[0]} * tanhf({a[0]} > 20.f ? {a[0]} : log1pf(expf({a[0]})))"),
    "elu": (1, _elu),
    "selu": (1, lambda n, a: f"({a[0]} > 0.f ? {_float(SELU_SCALE)} * {a[0]} : "
                             f"{_float(SELU_SCALE * SELU_ALPHA)} * expm1f({a[0]}))"),
    "leaky_relu": (1, lambda n, a: f"({a[0]} > 0.f ? {a[0]} : {a[0]} * {_float(_argument(n, 1, 'negative_slope', 0.01))})"),
    "hardtanh": (1, lambda n, a: (f"min_nan(max_nan({a[0]}, {_float(_argument(n, 1, 'min_val', -1.0))}), "
                                  f"{_float(_argument(n, 2, 'max_val', 1.0))})")),
    "clamp_min": (1, _clamp_side("max", "min")),
    "clamp_max": (1, _clamp_side("min", "max")),
}


class Chain:
    """C++ for ``nodes`` (graph order), given C expressions for values computed before it.

    ``known`` maps a value (node name) to its C expression, e.g. the GEMM accumulator of an
    epilogue. ``shape`` is the shape every ``full`` operand and the result share. With ``layouts``
    (a template that reads every operand as a contiguous row-major tensor and defines
    ``LOAD_COLUMNS``) the pieces of a split or slice along the last dimension of a tensor read from
    memory are ``columns`` operands, and views that keep the flat index cost nothing.
    """

    def __init__(self, graph: Graph, nodes: Sequence[str], known: dict[str, str], shape: tuple[int, ...],
                 operand_prefix: str = "in", layouts: bool = False) -> None:
        self.graph, self.shape = graph, tuple(shape)
        self.operands: list[Operand] = []
        self.lines: list[str] = []
        self._values = dict(known)
        self._prefix = operand_prefix
        self._layouts = layouts
        self._splits: set[str] = set()  # split nodes whose pieces are read as columns of their input
        for name in nodes:
            self._emit(graph.node(name))
        self.result = self._values[nodes[-1]] if nodes else next(iter(known.values()))

    def _emit(self, node: Node) -> None:
        if self._layouts and (self._column_piece(node) or self._flat_view(node)):
            return
        if node.op not in EMITTERS:
            raise NotFusable(f"%{node.name}: op {node.op} ({node.target}) has no elementwise code generator")
        count, emit = EMITTERS[node.op]
        spec = node.spec
        if not isinstance(spec, TensorSpec) or not spec.dtype.is_floating_point:
            raise NotFusable(f"%{node.name}: only floating-point tensors are generated (got {spec})")
        if not self._whole(spec) and not self._broadcasts_to_row(spec):
            raise NotFusable(f"%{node.name}: shape {tuple(spec.shape)} is neither the output's {self.shape} nor a row")
        args = [self._value(node, a) for a in node.args[:count]]
        if rounds_its_inputs(node):  # each input as eager holds it
            args = [held(v, self.graph.node(a.name).spec.dtype, node) if isinstance(a, Ref) else v
                    for v, a in zip(args, node.args[:count], strict=True)]
        # positional (prefixed: a kernel may hold two chains), not the node's name, so that identical groups
        # render identical code
        var = f"{self._prefix}_v{len(self.lines)}"
        self.lines.append(f"const float {var} = {emit(node, args)};")
        self._values[node.name] = var

    def _value(self, node: Node, arg: Any) -> str:
        if isinstance(arg, (bool, int, float)):
            return _float(arg)
        if not isinstance(arg, Ref):
            raise NotFusable(f"%{node.name}: argument {arg!r} is neither a tensor nor a number")
        if arg.name in self._values:
            return self._values[arg.name]
        return self._load(node, arg)

    def _load(self, node: Node, ref: Ref) -> str:
        spec = self.graph.node(ref.name).spec
        if not isinstance(spec, TensorSpec) or not spec.dtype.is_floating_point:
            raise NotFusable(f"%{node.name}: operand %{ref.name} is not a floating-point tensor")
        if math.prod(spec.shape) == 1:
            access = "scalar"
        elif self._whole(spec):
            access = "full"
        elif self._broadcasts_to_row(spec):
            access = "row"
        else:
            raise NotFusable(f"%{node.name}: operand %{ref.name} of shape {tuple(spec.shape)} broadcasts to "
                             f"{self.shape} in a way the generator does not read (only full, row and scalar)")
        operand = Operand(ref, f"{self._prefix}{len(self.operands)}", access)
        self.operands.append(operand)
        expr = f"LOAD_{access.upper()}({operand.name})"
        self._values[ref.name] = expr
        return expr

    def _whole(self, spec: TensorSpec) -> bool:
        """Whether a value of ``spec`` is read at the output's flat index: the output's shape, or with
        ``layouts`` as many elements in rows of the same length."""
        shape = tuple(spec.shape)
        return shape == self.shape or (self._layouts and bool(shape) and bool(self.shape)
                                       and shape[-1] == self.shape[-1] and math.prod(shape) == math.prod(self.shape))

    def _flat_view(self, node: Node) -> bool:
        """A view, squeeze, unsqueeze or contiguous copy between two `_whole` shapes: the same flat
        index, so the value passes through (an outside tensor read as ``full``)."""
        source = node.args[0] if node.args else None
        if node.op not in FLAT_VIEWS or not isinstance(source, Ref) or not isinstance(node.spec, TensorSpec):
            return False
        inner = self.graph.node(source.name).spec
        if not isinstance(inner, TensorSpec) or not self._whole(node.spec) or not self._whole(inner) \
                or not node.spec.dtype.is_floating_point or inner.dtype != node.spec.dtype:
            return False
        self._values[node.name] = self._value(node, source)
        return True

    def _column_piece(self, node: Node) -> bool:
        """Whether ``node`` is a split of a tensor from memory along its last dimension (emits nothing:
        its pieces are read) or a piece of one (a getitem of such a split, or a slice of the last
        dimension with step 1), its rows the output's: a ``columns`` operand. False for anything else."""
        source = node.args[0] if node.args else None
        if not isinstance(source, Ref) or source.name in self._values:
            return False  # a value the chain computes: its pieces are not in memory
        if node.op == "getitem":
            if source.name not in self._splits:
                return False
            split = self.graph.node(source.name)
            whole = split.args[0]
            _, offset, size = split_piece(split, tuple(self.graph.node(whole.name).spec.shape), node.args[1])
        elif node.op in ("split", "slice"):
            whole = source
            shape = tuple(self.graph.node(whole.name).spec.shape)
            dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) if node.op == "split" \
                else (node.args[1] if len(node.args) > 1 else 0)
            if not shape or not isinstance(dim, int) or dim % len(shape) != len(shape) - 1 \
                    or math.prod(shape[:-1]) != math.prod(self.shape[:-1]) or (node.target or "").startswith("aten.unbind"):
                return False
            if node.op == "split":
                self._splits.add(node.name)
                return True
            start, end, step = (list(node.args[2:]) + [None, None, 1])[:3]
            if (step or 1) != 1 or not all(bound is None or isinstance(bound, int) for bound in (start, end)):
                return False  # a strided slice, or bounds that are not numbers: the indexed chain's
            width = shape[-1]
            offset = 0 if start is None else (max(0, start + width) if start < 0 else min(start, width))
            stop = width if end is None else (max(0, end + width) if end < 0 else min(end, width))
            size = stop - offset
        else:
            return False
        spec = node.spec
        if not isinstance(spec, TensorSpec) or not self._whole(spec) or size != self.shape[-1] \
                or not spec.dtype.is_floating_point:
            return False
        width = self.graph.node(whole.name).spec.shape[-1]
        operand = Operand(whole, f"{self._prefix}{len(self.operands)}", "columns", offset, width)
        self.operands.append(operand)
        self._values[node.name] = f"LOAD_COLUMNS({operand.name}, {offset}LL, {width}LL)"
        return True

    def _broadcasts_to_row(self, spec: TensorSpec) -> bool:
        shape = tuple(spec.shape)
        return bool(self.shape) and shape[-1:] == self.shape[-1:] and math.prod(shape) == self.shape[-1]

    def code(self, indent: str = "    ") -> str:
        return "\n".join(indent + line for line in self.lines)
