"""Chains over coordinates: any elementwise, broadcast and layout op, of any value type.

`Chain` evaluates every node at the output element's own index and reads operands whole, by
row or as a scalar: that is what a GEMM tile or a vectorised row can afford. `IndexedChain`
is the general form (Inductor's loop-body IR, in miniature): every node is a function of its
coordinates, ``value(node, coords)``, emitted once per distinct (node, coords) into
straight-line C++. So

* a layout op is index arithmetic on the coordinates it passes to its input: view and reshape
  (through the flat index), transpose and permute, expand, unsqueeze and squeeze, slice, select,
  a split's pieces; ``stack`` picks a part by its new coordinate; ``cat`` evaluates each piece at its own coordinates (clamped into range, so
  every load is in bounds) and picks one; ``embedding`` reads its indices, then the table row;
* any broadcast reads its operand at the broadcast coordinates;
* values are typed as their IR dtype: fp32 arithmetic for floating values (loads widen, the
  store rounds once), ``long long`` for integers (exact, as torch), ``bool`` for booleans;
  comparisons, logical ops, ``where``, ``masked_fill`` and casts between them.

Operands are read raw with ``LOAD_AT(p, i)`` (the template defines it; operands are contiguous
and row-major, as the runtime passes them). The template gives the output element's flat
index as a C expression; the chain's ``result`` has the output dtype's C type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stof_cc.codegen.chain import (
    EMITTERS,
    NotFusable,
    Operand,
    _cast,
    _float,
    held,
    in_dtype,
    rounded_to,
    rounds_its_inputs,
)
from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec
from stof_cc.ir.ops import split_piece

C_TYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float",
           torch.int64: "long long", torch.int32: "int", torch.int16: "short", torch.int8: "signed char",
           torch.uint8: "unsigned char", torch.bool: "bool"}
HALF_TYPES = ("__half", "__nv_bfloat16")
COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
# ops whose integer and boolean forms are generated (every floating op of `chain.EMITTERS` is too)
TYPED_OPS = ("add", "sub", "mul", "neg", "maximum", "minimum", "clamp", "compare", "logical", "logical_not",
             "where", "masked_fill", "cast", "clone", "dropout", "full_like", "div", "remainder")
INDEXED_OPS = ("rotary",)  # floating ops that read their input at other coordinates
LAYOUT_OPS = ("view", "transpose", "expand", "repeat_interleave", "unsqueeze", "squeeze", "slice", "select", "split", "getitem",
              "contiguous", "cat", "stack", "embedding", "gather")

Coords = tuple[str, ...]


def value_type(spec: Any, what: str) -> str:
    """The C type a chain computes a value of ``spec`` in: float for every floating dtype."""
    if not isinstance(spec, TensorSpec) or spec.dtype not in C_TYPES:
        raise NotFusable(f"{what}: {spec} is not a tensor of a generated dtype")
    return "float" if spec.dtype.is_floating_point else C_TYPES[spec.dtype]


def convert(expr: str, source: str, target: str) -> str:
    """``expr`` of C type ``source`` as ``target`` (a value type: float, an integer type, bool)."""
    if source == target:
        return expr
    if source in HALF_TYPES:
        expr, source = f"to_float({expr})", "float"
        if target == "float":
            return expr
    if target == "bool":
        return f"(({expr}) != 0)"
    if source == "float" and target == "unsigned char":  # torch goes through int64 (-3.0 is 253); the GPU's
        return f"((unsigned char)(long long)({expr}))"  # direct conversion saturates (found by review)
    return f"(({target})({expr}))"


class IndexedChain:
    """C++ computing the value of ``nodes[-1]`` (graph order) at the element of ``shape`` whose
    flat index is the C expression ``index``; raises NotFusable naming the node it cannot take."""

    def __init__(self, graph: Graph, nodes: Sequence[str], shape: tuple[int, ...], index: str = "idx",
                 operand_prefix: str = "in") -> None:
        self.graph, self.shape, self.members = graph, tuple(shape), set(nodes)
        self.operands: list[Operand] = []
        self.lines: list[str] = []
        self._memo: dict[tuple[str, Coords], tuple[str, str]] = {}
        self._names: dict[str, Operand] = {}
        self._prefix = operand_prefix
        for name in nodes:  # every node must be one this chain can express, read or not
            self._check(graph.node(name))
        coords = self._coordinates(index, self.shape)
        expr, ctype = self._value(nodes[-1], coords)
        out = graph.node(nodes[-1]).spec
        self.result = convert(expr, ctype, value_type(out, f"%{nodes[-1]}"))

    def code(self, indent: str = "    ") -> str:
        return "\n".join(indent + line for line in self.lines)

    # -- coordinates ---------------------------------------------------------------------------
    def _coordinates(self, index: str, shape: tuple[int, ...]) -> Coords:
        """The coordinates of flat ``index`` in ``shape``, one const per dimension."""
        coords, stride = [], 1
        for k in reversed(range(len(shape))):
            name = f"{self._prefix}_c{k}"
            term = index if stride == 1 else f"({index}) / {stride}LL"
            self.lines.append(f"const long long {name} = ({term}) % {shape[k]}LL;" if k else
                              f"const long long {name} = {term};")
            coords.append(name)
            stride *= shape[k]
        return tuple(reversed(coords))

    @staticmethod
    def _flat(coords: Coords, shape: Sequence[int]) -> str:
        terms, stride = [], 1
        for c, size in zip(reversed(coords), reversed(shape), strict=True):
            if size != 1 and c != "0":
                terms.append(c if stride == 1 else f"{c} * {stride}LL")
            stride *= size
        return " + ".join(reversed(terms)) or "0"

    @staticmethod
    def _broadcast(coords: Coords, shape: Sequence[int]) -> Coords:
        """``coords`` of a broadcast result read in an operand of ``shape`` (right-aligned)."""
        tail = coords[len(coords) - len(shape):] if shape else ()
        return tuple("0" if size == 1 else c for c, size in zip(tail, shape, strict=True))

    # -- values --------------------------------------------------------------------------------
    def _check(self, node: Node) -> None:
        if node.op in LAYOUT_OPS:
            return
        if node.op not in EMITTERS and node.op not in TYPED_OPS and node.op not in INDEXED_OPS:
            raise NotFusable(f"%{node.name}: op {node.op} ({node.target}) has no elementwise code generator")
        ctype = value_type(node.spec, f"%{node.name}")
        if ctype != "float" and node.op not in TYPED_OPS:
            raise NotFusable(f"%{node.name}: {node.op} on {node.spec} (only floating values take it)")

    def _value(self, name: str, coords: Coords) -> tuple[str, str]:
        """(C expression, C type) of value ``name`` at ``coords`` (its own shape's)."""
        key = (name, coords)
        if key not in self._memo:
            self._memo[key] = self._load(name, coords) if name not in self.members else \
                self._compute(self.graph.node(name), coords)
        return self._memo[key]

    def _load(self, name: str, coords: Coords) -> tuple[str, str]:
        spec = self.graph.node(name).spec
        ctype = C_TYPES.get(spec.dtype) if isinstance(spec, TensorSpec) else None
        if ctype is None:
            raise NotFusable(f"%{name}: read from outside, {spec} is not a tensor of a generated dtype")
        if name not in self._names:
            access = "scalar" if math.prod(spec.shape) == 1 else "gather"
            self._names[name] = Operand(Ref(name), f"{self._prefix}{len(self.operands)}", access)
            self.operands.append(self._names[name])
        return self._declare(f"LOAD_AT({self._names[name].name}, {self._flat(coords, spec.shape)})", ctype)

    def _declare(self, expr: str, ctype: str) -> tuple[str, str]:
        var = f"{self._prefix}_v{len(self.lines)}"
        self.lines.append(f"const {ctype} {var} = {expr};")
        return var, ctype

    def _arg(self, node: Node, arg: Any, coords: Coords, ctype: str) -> str:
        """Argument ``arg`` of ``node`` (a tensor or a number) at the node's ``coords``, as ``ctype``."""
        if isinstance(arg, bool):
            return {"bool": "true" if arg else "false", "float": "1.f" if arg else "0.f"}.get(ctype, f"{int(arg)}LL")
        if isinstance(arg, (int, float)):
            if ctype == "float":
                return _float(arg)
            if ctype == "bool":
                return "true" if arg else "false"
            if not float(arg).is_integer():
                raise NotFusable(f"%{node.name}: the number {arg} in an integer op")
            # in the op's own type, wrapped as torch converts it: a uint8 tensor's -1 is 255 (found by review)
            return f"{int(arg)}LL" if ctype == "long long" else f"(({ctype})({int(arg)}LL))"
        if not isinstance(arg, Ref):
            raise NotFusable(f"%{node.name}: argument {arg!r} is neither a tensor nor a number")
        spec = self.graph.node(arg.name).spec
        expr, source = self._value(arg.name, self._broadcast(coords, spec.shape))
        if source == "float" and rounds_its_inputs(node):  # as eager holds it (chain.rounds_its_inputs)
            expr = held(expr, spec.dtype, node)
        return convert(expr, source, ctype)

    def _compute(self, node: Node, coords: Coords) -> tuple[str, str]:
        if node.op in LAYOUT_OPS:
            return self._layout(node, coords)
        if node.op == "rotary":
            return self._rotary(node, coords)
        ctype = value_type(node.spec, f"%{node.name}")
        if ctype == "float" and node.op in EMITTERS and node.op not in ("cast", "clone"):
            count, emit = EMITTERS[node.op]
            return self._declare(emit(node, [self._arg(node, a, coords, "float") for a in node.args[:count]]), "float")
        return self._declare(self._typed(node, coords, ctype), ctype)

    def _typed(self, node: Node, coords: Coords, ctype: str) -> str:
        """An integer or boolean op's C expression (and the ops only this chain has: where,
        masked_fill, comparisons and logical ops, for floating values too)."""
        arg: Callable[[Any, str], str] = lambda a, t=ctype: self._arg(node, a, coords, t)  # noqa: E731
        op, args = node.op, node.args
        if op == "cast" and ctype == "float":
            return _cast(node, [arg(args[0])])
        if op in ("cast", "clone", "dropout"):
            return arg(args[0])
        if op == "full_like":  # zeros_like, ones_like, full_like(x, v), empty_like (any value: 0)
            kind = (node.target or "").split(".")[1]
            fill = {"zeros_like": 0, "ones_like": 1, "empty_like": 0}.get(kind, args[1] if len(args) > 1 else 0)
            return arg(fill)
        if op == "neg":
            return f"-({arg(args[0])})"
        if op in ("add", "sub") and node.kwargs.get("alpha", 1) == 1:
            lhs, rhs = (args[1], args[0]) if (node.target or "").startswith("aten.rsub") else (args[0], args[1])
            return f"{arg(lhs)} {'+' if op == 'add' else '-'} {arg(rhs)}"
        if op == "mul":
            return f"{arg(args[0])} * {arg(args[1])}"
        if op in ("maximum", "minimum"):
            a, b = arg(args[0]), arg(args[1])
            return f"({a} {'>' if op == 'maximum' else '<'} {b} ? {a} : {b})"
        if op == "where":
            return f"({self._arg(node, args[0], coords, 'bool')} ? {arg(args[1])} : {arg(args[2])})"
        if op == "masked_fill":
            return f"({self._arg(node, args[1], coords, 'bool')} ? {arg(args[2])} : {arg(args[0])})"
        if op == "compare":  # in torch's promoted dtype, both sides converted to it
            kind = (node.target or "").split(".")[1]
            common = self._promoted(args[:2])
            lhs, rhs = (self._compared(node, a, coords, common) for a in args[:2])
            return f"({lhs} {COMPARE[kind]} {rhs})"
        if op == "logical":
            kind = (node.target or "").split(".")[1].strip("_")
            if ctype == "bool":
                symbol = {"and": "&&", "logical_and": "&&", "or": "||", "logical_or": "||", "xor": "!=",
                          "logical_xor": "!="}.get(kind)
            else:
                symbol = {"and": "&", "or": "|", "xor": "^", "bitwise_and": "&", "bitwise_or": "|",
                          "bitwise_xor": "^"}.get(kind)
            if symbol is None:
                raise NotFusable(f"%{node.name}: logical op {node.target} on {node.spec}")
            return f"({arg(args[0])} {symbol} {arg(args[1])})"
        if op == "logical_not":
            return f"!({self._arg(node, args[0], coords, 'bool')})" if ctype == "bool" else f"~({arg(args[0])})"
        if op == "div" and node.kwargs.get("rounding_mode") in ("floor", "trunc") and ctype != "float":
            a, b = arg(args[0]), arg(args[1])  # C truncates; floor steps down where the signs differ
            if node.kwargs["rounding_mode"] == "trunc":
                return f"({a} / {b})"
            return f"({a} / {b} - (({a} % {b} != 0) && (({a} < 0) != ({b} < 0))))"
        if op == "remainder" and ctype != "float":  # the divisor's sign, as Python's %
            a, b = arg(args[0]), arg(args[1])
            return f"({a} % {b} + ((({a} % {b} != 0) && ((({a} % {b}) < 0) != ({b} < 0))) ? {b} : 0))"
        if op == "clamp" and ctype != "float":
            low = args[1] if len(args) > 1 else node.kwargs.get("min")
            high = args[2] if len(args) > 2 else node.kwargs.get("max")
            value = arg(args[0])
            value = f"({value} < {arg(low)} ? {arg(low)} : {value})" if low is not None else value
            return f"({value} > {arg(high)} ? {arg(high)} : {value})" if high is not None else value
        raise NotFusable(f"%{node.name}: {op} on {node.spec} ({node.target}) has no code generator here")

    def _promoted(self, args: Sequence[Any]) -> torch.dtype:
        """The dtype torch compares ``args`` in (`torch.result_type`: a 0-d tensor or a number beside a
        tensor of the same kind takes that tensor's dtype)."""
        probes = []
        for arg in args:
            if isinstance(arg, Ref):
                spec = self.graph.node(arg.name).spec
                probes.append(torch.empty((1,) * min(len(spec.shape), 1), dtype=spec.dtype))
            else:
                probes.append(arg)
        if not any(isinstance(p, torch.Tensor) for p in probes):
            raise NotFusable(f"comparison of two numbers {args!r}")
        return torch.result_type(*probes)

    def _compared(self, node: Node, arg: Any, coords: Coords, common: torch.dtype) -> str:
        """One side of a comparison converted to ``common`` as torch converts it: a number or a value
        rounded to fp16 / bf16 (``x_fp16 == 0.1`` compares with fp16's 0.1, and a 0-d fp32 threshold or an
        int64 tensor's 2049 too: found by review), an integer wrapped to a narrower type (uint8's -1 is 255)."""
        if not common.is_floating_point:
            return self._arg(node, arg, coords, C_TYPES[common])
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return _float(in_dtype(arg, common))
        return rounded_to(self._arg(node, arg, coords, "float"), common)

    # -- layout --------------------------------------------------------------------------------
    def _layout(self, node: Node, coords: Coords) -> tuple[str, str]:
        """A layout op's value at ``coords``: its input's at the coordinates it maps them to."""
        op, args = node.op, node.args
        source = args[0]
        if op == "cat":
            return self._cat(node, coords)
        if op == "stack":
            return self._stack(node, coords)
        if op == "embedding":
            return self._embedding(node, coords)
        if op == "gather":
            return self._gather(node, coords)
        if not isinstance(source, Ref):
            raise NotFusable(f"%{node.name}: {op} of {source!r}")
        inner = self.graph.node(source.name).spec
        if op == "getitem":
            return self._piece(node, source, coords)
        shape = tuple(inner.shape)
        rank = len(shape)
        if op in ("contiguous", "clone"):
            mapped = coords
        elif op == "view":
            flat = self._flat(coords, node.spec.shape)
            mapped = self._split(flat, shape)
        elif op == "transpose":
            order = list(range(rank))
            if isinstance(args[1], (list, tuple)):
                order = list(args[1])
            else:
                a, b = args[1] % rank, args[2] % rank
                order[a], order[b] = order[b], order[a]
            mapped_list = ["0"] * rank
            for out_dim, in_dim in enumerate(order):
                mapped_list[in_dim % rank] = coords[out_dim]
            mapped = tuple(mapped_list)
        elif op == "expand":
            mapped = self._broadcast(coords, shape)
        elif op == "repeat_interleave":  # x.repeat_interleave(n, dim): output i along dim reads i / n
            repeats = args[1] if len(args) > 1 else node.kwargs.get("repeats")
            dim = args[2] if len(args) > 2 else node.kwargs.get("dim")
            if not isinstance(repeats, int) or dim is None:
                raise NotFusable(f"%{node.name}: repeat_interleave by a tensor or over the flattened input")
            dim %= rank
            mapped = coords[:dim] + (f"({coords[dim]} / {repeats}LL)",) + coords[dim + 1:]
        elif op == "unsqueeze":
            dim = args[1] % (rank + 1)
            mapped = coords[:dim] + coords[dim + 1:]
        elif op == "squeeze" and rank == 0:  # a 0-d tensor squeezes to itself
            mapped = ()
        elif op == "squeeze":
            dims = args[1] if len(args) > 1 else [d for d, s in enumerate(shape) if s == 1]
            dims = {d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims]) if shape[d % rank] == 1}
            it = iter(coords)
            mapped = tuple("0" if d in dims else next(it) for d in range(rank))
        elif op == "slice":
            dim, start, _, step = (list(args[1:]) + [None, None, None, 1])[:4]
            dim = (dim or 0) % rank
            start = 0 if start is None else (max(0, start + shape[dim]) if start < 0 else min(start, shape[dim]))  # as torch clamps
            step = step or 1
            shifted = coords[dim] if start == 0 and step == 1 else f"({start}LL + {coords[dim]} * {step}LL)"
            mapped = coords[:dim] + (shifted,) + coords[dim + 1:]
        elif op == "select":
            dim, index = args[1] % rank, args[2]
            index = index + shape[dim] if index < 0 else index
            mapped = coords[:dim] + (f"{index}LL",) + coords[dim:]
        else:
            raise NotFusable(f"%{node.name}: layout op {op} ({node.target}) has no index rule")
        return self._value(source.name, tuple(mapped))

    def _split(self, flat: str, shape: Sequence[int]) -> Coords:
        """The coordinates of flat index ``flat`` in ``shape`` (view / reshape)."""
        coords, stride = [], 1
        for size in reversed(shape):
            coords.append("0" if size == 1 else f"(({flat}) / {stride}LL) % {size}LL")
            stride *= size
        return tuple(reversed(coords))

    def _piece(self, node: Node, source: Ref, coords: Coords) -> tuple[str, str]:
        """``getitem(split(x, sizes, dim), i)``: x at the piece's offset along dim."""
        split = self.graph.node(source.name)
        if split.op != "split" or not isinstance(split.args[0], Ref):
            raise NotFusable(f"%{node.name}: getitem of {split.op}")
        x = split.args[0]
        dim, offset, size = split_piece(split, self.graph.node(x.name).spec.shape, node.args[1])
        if size is None:  # unbind: piece i is x.select(dim, i)
            return self._value(x.name, coords[:dim] + (f"{offset}LL",) + coords[dim:])
        shifted = coords[dim] if offset == 0 else f"({coords[dim]} + {offset}LL)"
        return self._value(x.name, coords[:dim] + (shifted,) + coords[dim + 1:])

    def _cat(self, node: Node, coords: Coords) -> tuple[str, str]:
        parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        rank = len(node.spec.shape)
        dim %= rank
        ctype = value_type(node.spec, f"%{node.name}")
        pieces, start = [], 0
        for part in parts:
            size = self.graph.node(part.name).spec.shape[dim]
            local = f"({coords[dim]} - {start}LL)" if start else coords[dim]
            # in range for every element, so that every piece's loads stay in bounds
            clamped = f"({local} < 0LL ? 0LL : {local} > {size - 1}LL ? {size - 1}LL : {local})"
            expr, source = self._value(part.name, coords[:dim] + (clamped,) + coords[dim + 1:])
            pieces.append((start + size, convert(expr, source, ctype)))
            start += size
        expr = pieces[-1][1]
        for end, piece in reversed(pieces[:-1]):
            expr = f"({coords[dim]} < {end}LL ? {piece} : {expr})"
        return self._declare(expr, ctype)

    def _stack(self, node: Node, coords: Coords) -> tuple[str, str]:
        """``stack(parts, dim)``: coordinate ``dim`` picks the part, the others index into it."""
        parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim %= len(node.spec.shape)
        ctype = value_type(node.spec, f"%{node.name}")
        inner = coords[:dim] + coords[dim + 1:]
        values = [convert(*self._value(part.name, inner), ctype) for part in parts]
        expr = values[-1]
        for i, value in reversed(list(enumerate(values[:-1]))):
            expr = f"({coords[dim]} == {i}LL ? {value} : {expr})"
        return self._declare(expr, ctype)

    def _rotary(self, node: Node, coords: Coords) -> tuple[str, str]:
        """``rotary(x, cos, sin)`` (`ir.ops.rotary_reference`): x * cos + rotate_half(x) * sin,
        rotate_half reading the other half of the last dimension."""
        x, cos, sin = node.args[:3]
        half = self.graph.node(x.name).spec.shape[-1] // 2
        last = coords[-1]
        low = f"({last} < {half}LL)"
        partner = coords[:-1] + (f"({low} ? {last} + {half}LL : {last} - {half}LL)",)
        straight = self._arg(node, x, coords, "float")
        expr, source = self._value(x.name, partner)
        other = convert(expr, source, "float")
        rotated = f"({low} ? -{other} : {other})"
        return self._declare(f"{straight} * {self._arg(node, cos, coords, 'float')} + "
                             f"{rotated} * {self._arg(node, sin, coords, 'float')}", "float")

    def _index(self, tensor: Ref, coords: Coords, size: int) -> str:
        """An index tensor's value at ``coords`` (broadcast), negative indices wrapped as torch does."""
        spec = self.graph.node(tensor.name).spec
        expr, source = self._value(tensor.name, self._broadcast(coords, spec.shape))
        value = convert(expr, source, "long long")
        return f"({value} < 0 ? {value} + {size}LL : {value})"

    def _gather(self, node: Node, coords: Coords) -> tuple[str, str]:
        """``x[i0, i1, ...]`` with an index tensor for every dim of x (``aten.index``: the
        indices broadcast to the output), or ``torch.gather(x, dim, index)``."""
        x = node.args[0]
        shape = self.graph.node(x.name).spec.shape
        if (node.target or "").startswith("aten.gather"):
            dim, index = node.args[1] % len(shape), node.args[2]
            at = coords[:dim] + (self._index(index, coords, shape[dim]),) + coords[dim + 1:]
            return self._value(x.name, at)
        indices = node.args[1]
        if len(indices) != len(shape) or not all(isinstance(i, Ref) for i in indices):
            raise NotFusable(f"%{node.name}: indexing with {len(indices)} index tensors (or None) of a "
                             f"{len(shape)}-d tensor is not generated")
        return self._value(x.name, tuple(self._index(i, coords, size) for i, size in zip(indices, shape, strict=True)))

    def _embedding(self, node: Node, coords: Coords) -> tuple[str, str]:
        """``embedding(weight, indices)``: row ``indices[coords[:-1]]`` of weight, column coords[-1]."""
        weight, indices = node.args[0], node.args[1]
        index_shape = self.graph.node(indices.name).spec.shape
        row, _ = self._value(indices.name, self._broadcast(coords[:-1], index_shape))
        return self._value(weight.name, (row, coords[-1]))
