"""One node of the graph IR and the values it holds: `Node`, `Ref`, `TensorSpec`, and how they print."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# Ops with a fixed meaning in every graph; all others come from the op registry.
INPUT = "input"
CONSTANT = "constant"


class GraphError(ValueError):
    """A malformed graph; the message names the offending node."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor value (shapes are static)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(int(d) for d in tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}[{','.join(map(str, self.shape))}]"


# A node's output: one tensor, several (a tuple), or nothing (assertion ops).
Spec = TensorSpec | tuple[TensorSpec | None, ...] | None


@dataclass(frozen=True)
class Ref:
    """A use of the value produced by node ``name``."""

    name: str

    def __str__(self) -> str:
        return f"%{self.name}"


@dataclass
class Node:
    """One operator application. Fields are plain data so graphs copy and print cleanly."""

    name: str
    op: str
    target: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    spec: Spec = None

    def refs(self) -> list[Ref]:
        """Every value this node reads, in argument order (duplicates kept)."""
        return list(iter_refs((self.args, self.kwargs)))

    def __str__(self) -> str:
        parts = [format_arg(a) for a in self.args]
        parts += [f"{k}={format_arg(v)}" for k, v in self.kwargs.items()]
        head = f"%{self.name}: {format_spec(self.spec)} = {self.op}"
        if self.op in (INPUT, CONSTANT):
            return head
        return f"{head}({', '.join(parts)})"


def iter_refs(value: Any) -> Iterator[Ref]:
    """Yield every Ref inside nested tuples, lists and dicts."""
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_refs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_refs(v)


def map_refs(value: Any, fn: Callable[[Ref], Any]) -> Any:
    """Rebuild nested tuples, lists and dicts with every Ref replaced by ``fn(ref)``."""
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_refs(v, fn) for v in value)
    if isinstance(value, list):
        return [map_refs(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_refs(v, fn) for k, v in value.items()}
    return value


_DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def format_spec(spec: Spec) -> str:
    if spec is None:
        return "()"
    if isinstance(spec, tuple):
        return "(" + ", ".join(format_spec(s) for s in spec) + ")"
    return str(spec)


def format_arg(value: Any) -> str:
    if isinstance(value, Ref):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_arg(v) for v in value) + "]"
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return repr(value)
