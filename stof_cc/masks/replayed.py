"""A per-call mask_mod's grid build replayed from a CUDA graph.

A mask_mod built per call (new tables, same code and shapes) runs its compiled grid form
(`compiled.grid`) every call, and on the lent H100's host the call itself costs more than its
kernels: dynamo's guards, AOT's wrappers and Inductor's launcher took 0.13-0.22 ms a call at
S = 8192, the kernels 0.02-0.10 (docs/decisions.md#per-call-masks-replayed). So the call is
captured once in a CUDA graph, reading copies of the tables ("statics") that a *proxy* of the
mask_mod captures in their place; each later call copies its own tables into the statics and
replays the graph. The outputs are cloned before they are handed on: a description keeps its
class grid and tiles, and the next replay overwrites the graph's.

Only a mask_mod whose every input is visible is replayed: what it captures (closure cells,
defaults, a partial's arguments, recursively through the functions it captures) may be tensors,
scalars, strings, None, short tuples and lists of those, and functions; the globals it names may
be scalars (their values are part of the graph's key), functions of the same kind, classes,
builtins and the torch / math / operator / numpy / functools modules. Anything else (a captured
module or object, a global tensor, whose contents the graph would bake in) keeps the compiled
call, as does a build during another capture, a grid over more than one chunk of rows, and
outputs over REPLAY_BYTES.
"""

from __future__ import annotations

import functools
import types
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

KEPT_GRAPHS = 4  # captured (form, code, shape, table signature) graphs kept, the latest used
REPLAY_BYTES = 1 << 26  # the largest outputs (classes and tiles) a graph holds: S = 16384 at Bm = Hm = 1
MAX_DEPTH = 4  # functions captured within functions, followed this deep
ITEMS = 16  # a captured tuple or list up to this long is followed item by item
MODULES = ("torch", "math", "operator", "numpy", "functools")  # global modules a mask_mod may name

_graphs: OrderedDict[tuple, _Graph] = OrderedDict()
_refused: set[tuple] = set()  # keys whose capture failed: the compiled call from then on


class _NotReplayable(Exception):
    """The mask_mod reads something a graph would bake in."""


class _Graph:
    """One capture: the statics the proxy reads, the graph, and its outputs."""

    def __init__(self, call: Callable[[Callable], tuple[Tensor, Tensor]], fn: Callable, tensors: list[Tensor]):
        self.statics = [torch.empty_like(t).copy_(t) for t in tensors]
        proxy = _walk(fn, iter(self.statics).__next__, [], 0)
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            call(proxy)  # outside the capture: a first run compiles or allocates what it needs
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = call(proxy)

    def run(self, tensors: list[Tensor]) -> tuple[Tensor, Tensor]:
        for static, table in zip(self.statics, tensors, strict=True):
            static.copy_(table)
        self.graph.replay()
        return tuple(out.clone() for out in self.outputs)


def grid(key: tuple, fn: Callable, call: Callable[[Callable], tuple[Tensor, Tensor]],
         output_bytes: int) -> tuple[Tensor, Tensor] | None:
    """``call(fn)`` (the compiled grid form over one chunk, whose compiled copy ``key`` names)
    replayed from its graph, captured on the first call of this table signature; None where it
    is not replayed (the caller runs ``call(fn)`` itself)."""
    if output_bytes > REPLAY_BYTES or torch.cuda.is_current_stream_capturing():
        return None
    tensors: list[Tensor] = []
    try:
        signature = _walk(fn, None, tensors, 0)
    except _NotReplayable:
        return None
    if any(t.device.type != "cuda" for t in tensors):
        return None
    key = (key, signature)
    graph = captured(_graphs, _refused, key, lambda: _Graph(call, fn, tensors), KEPT_GRAPHS)
    return None if graph is None else graph.run(tensors)


def captured(graphs: OrderedDict, refused: set, key: object, capture: Callable[[], object], kept: int) -> object | None:
    """``graphs[key]``, made by ``capture()`` where missing, as the latest of the ``kept`` kept; None
    where ``key`` is refused, or its capture fails (whatever torch raises: the caller's own path,
    as before, and never this capture again)."""
    if key in refused:
        return None
    if key not in graphs:
        try:
            graph = capture()
        except Exception:  # noqa: BLE001
            refused.add(key)
            return None
        while len(graphs) >= kept:
            graphs.popitem(last=False)
        graphs[key] = graph
    graphs.move_to_end(key)
    return graphs[key]


def signature(fn: Callable) -> object | None:
    """What a graph of ``fn`` is captured for (its codes, scalars, and its tables' shapes, strides,
    dtypes and devices); None where ``fn`` is not replayed."""
    try:
        return _walk(fn, None, [], 0)
    except _NotReplayable:
        return None


def replays(fn_signature: object) -> bool:
    """Whether a kept graph was captured for this signature: the compiled form took the mask_mod
    whole (fullgraph), so what it returns has shapes its guards decide, not its tables' values."""
    return any(key[1] == fn_signature for key in _graphs)


def _walk(value: object, swap: Callable[[], Tensor] | None, tensors: list[Tensor], depth: int) -> object:
    """With ``swap`` None: ``value``'s signature (codes, scalars, tensors' shapes, strides, dtypes
    and devices), its tensors appended to ``tensors`` in order. With ``swap``: ``value`` rebuilt
    with each tensor replaced by ``swap()`` (the statics, in the same order). Raises
    _NotReplayable for what a graph cannot follow."""
    if isinstance(value, Tensor):
        if swap is not None:
            return swap()
        tensors.append(value)
        return "tensor", tuple(value.shape), value.stride(), value.dtype, value.device
    if value is None or isinstance(value, bool | int | float | str):
        return value if swap is not None else (type(value), value)
    if isinstance(value, tuple | list) and len(value) <= ITEMS:
        items = [_walk(item, swap, tensors, depth) for item in value]
        return type(value)(items) if swap is not None else (type(value), *items)
    if depth >= MAX_DEPTH:
        raise _NotReplayable
    if isinstance(value, functools.partial):
        func = _walk(value.func, swap, tensors, depth + 1)
        args = _walk(value.args, swap, tensors, depth + 1)
        keywords = {name: _walk(item, swap, tensors, depth + 1) for name, item in value.keywords.items()}
        return functools.partial(func, *args, **keywords) if swap is not None else \
            ("partial", func, args, tuple(sorted(keywords.items())))
    if isinstance(value, types.FunctionType):
        return _function(value, swap, tensors, depth)
    raise _NotReplayable


def _function(fn: types.FunctionType, swap: Callable[[], Tensor] | None, tensors: list[Tensor],
              depth: int) -> object:
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_walk(cell.cell_contents, swap, tensors, depth + 1))
        except ValueError:  # an empty cell: a name the enclosing scope assigns later
            raise _NotReplayable from None
    defaults = _walk(fn.__defaults__ or (), swap, tensors, depth + 1)
    kwdefaults = {name: _walk(item, swap, tensors, depth + 1) for name, item in (fn.__kwdefaults__ or {}).items()}
    named = tuple(_global(fn.__globals__[name], depth) for name in fn.__code__.co_names if name in fn.__globals__)
    if swap is None:
        return fn.__code__, tuple(cells), defaults, tuple(sorted(kwdefaults.items())), named
    proxy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults or None,
                               tuple(types.CellType(item) for item in cells) or None)
    proxy.__kwdefaults__ = kwdefaults or None
    return proxy


def _global(value: object, depth: int) -> object:
    """A global the mask_mod names, as part of the signature: the proxy reads the globals
    themselves, so only what cannot hold a table passes."""
    if value is None or isinstance(value, bool | int | float | str):
        return type(value), value
    if isinstance(value, types.ModuleType):
        if value.__name__.split(".")[0] not in MODULES:
            raise _NotReplayable
        return value.__name__
    if isinstance(value, type | types.BuiltinFunctionType):
        return value
    if isinstance(value, types.FunctionType) and depth < MAX_DEPTH:
        if value.__closure__ or value.__defaults__ or value.__kwdefaults__:
            raise _NotReplayable  # what it captures is not rebuilt in the proxy
        return value.__code__, tuple(_global(value.__globals__[name], depth + 1)
                                     for name in value.__code__.co_names if name in value.__globals__)
    raise _NotReplayable
