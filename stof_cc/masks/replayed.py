"""A per-call mask_mod's grid build replayed from a CUDA graph.

A mask_mod built per call (new tables, same code and shapes) runs its compiled grid form
(`compiled.grid`) every call, and on the lent H100's host the call itself costs more than its
kernels: dynamo's guards, AOT's wrappers and Inductor's launcher took 0.13-0.22 ms a call at
S = 8192, the kernels 0.02-0.10 (docs/decisions.md#per-call-masks-replayed). So the call is
captured once in a CUDA graph, reading copies of the tables ("statics") that a *proxy* of the
mask_mod captures in their place; each later call copies its own tables into the statics and
replays the graph. The graph goes on past the grid form: the block lists are ranked from the
class grid in it too (`compiled.grid`, masks/lists.py), so one replay and one wait make a block
mask. What is handed on is copied out first (the form's `read`): a description keeps its class
grid and tiles, and the next replay overwrites the graph's.

Only a mask_mod whose every input is visible is replayed: what it captures (closure cells,
defaults, a partial's arguments, recursively through the functions it captures) may be tensors,
scalars, strings, None, short tuples and lists of those, and functions; the globals its code names
(its nested functions' and lambdas' too) may be scalars (their values are part of the graph's key),
functions that capture nothing and name only such globals, classes of the torch / math /
operator / numpy / functools modules or of Python, builtin functions (not a method bound to an
object), and those modules. Anything else (a captured module or object, a global tensor, a class attribute,
whose contents the graph would bake in) keeps the compiled call, as does a build during another
capture, a grid over more than one chunk of rows, and outputs over REPLAY_BYTES. `Captured` (the
capture itself, and replays one at a time, each after the last one's outputs were read) also
serves masks/lists.py.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from stof_cc.masks.kept import keep

KEPT_GRAPHS = 8  # captured (form, code, shape, table signature) graphs kept, the latest used (as many as index sets)
REPLAY_BYTES = 1 << 25  # the largest tiles a graph holds (the classes and lists add 20-60 B a block): S = 16384 at Bm = Hm = 1
MAX_DEPTH = 4  # functions captured within functions, followed this deep
ITEMS = 16  # a captured tuple or list up to this long is followed item by item
MODULES = ("torch", "math", "operator", "numpy", "functools")  # global modules (and their classes) a mask_mod may name
KEPT_REFUSALS = 256  # keys refused (a failed capture or replay, an eviction), the latest
SCALARS = (bool, int, float, str)  # captured values taken by value (exactly these types)
DEVICE_TYPES = ("cuda",)  # where graphs are captured (tests add "cpu", with an eager stand-in for `Captured`)

_graphs: OrderedDict[tuple, _Graph] = OrderedDict()
_refused: OrderedDict[tuple, None] = OrderedDict()  # keys failed or evicted: the compiled call from then on
_lock = threading.Lock()  # the caches of graphs and refusals, here and in masks/lists.py
# One CUDA-graph capture at a time in this process, these and the compiled modules' (runtime/compiled.py):
# torch.cuda.graph synchronises the device on entry, which invalidates any capture in flight on another
# thread (both would fail, and each failure is remembered: graphs lost for good)
CAPTURE_LOCK = threading.RLock()
_warned: set[tuple] = set()  # (what failed, exception type) already warned about


class _NotReplayable(Exception):
    """The mask_mod reads something a graph would bake in."""


class Captured:
    """``work()`` captured in a CUDA graph on ``device`` (an indexed CUDA device): run once outside
    the capture (a first run compiles and allocates), then captured on a stream of that device (not
    torch's default capture stream, which lives on whichever device captured first: a capture for
    another device would record nothing), in thread-local mode (other threads' CUDA calls go on), an
    empty graph counting as a failed capture. `replay` runs one replay at a time (a lock), each after
    the previous one's outputs were read on whatever stream read them (an event), so the statics it
    fills are never overwritten under a replay still reading them."""

    def __init__(self, device: torch.device, work: Callable[[], object]):
        self.device = device
        with CAPTURE_LOCK, torch.cuda.device(device):
            stream = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                work()
            stream.wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("error", message=".*CUDA Graph is empty")
                    with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                        self.outputs = work()
            finally:  # a capture torch ends with an error leaves its capture stream current
                torch.cuda.set_stream(stream)
        self.done = torch.cuda.Event()
        self.lock = threading.Lock()

    def replay(self, fill: Callable[[], None], read: Callable[[object], object]) -> object:
        """``fill()`` the statics, replay, and ``read(outputs)`` (copies of them): on the device's
        current stream."""
        with self.lock, torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()
            stream.wait_event(self.done)
            fill()
            self.graph.replay()
            out = read(self.outputs)
            self.done.record(stream)
        return out

    def release(self) -> None:
        """Wait for the last replay's reads before the statics and the graph's memory go (a replay
        another thread is enqueuing first)."""
        with self.lock:
            self.done.synchronize()


class GridForm(Protocol):
    """What `grid` captures: ``form(fn)`` runs the compiled grid form (and whatever follows it in the
    graph) on the mask_mod ``fn``, ``form.read(outputs)`` copies what a caller keeps out of the
    graph's outputs. The form holds what the graph reads besides the statics (index tensors)."""

    def __call__(self, fn: Callable) -> tuple[Tensor, ...]: ...

    def read(self, outputs: tuple[Tensor, ...]) -> object: ...


class _Graph:
    """One capture of a grid form: the statics the proxy reads, and the form (which holds the
    index tensors the graph reads)."""

    def __init__(self, device: torch.device, form: GridForm, fn: Callable, tensors: list[Tensor]):
        self.statics = [torch.empty_like(t).copy_(t) for t in tensors]
        self.form = form
        proxy = _walk(fn, iter(self.statics).__next__, [], 0)
        self.captured = Captured(device, lambda: form(proxy))

    def run(self, tensors: list[Tensor]) -> object:
        def fill() -> None:
            for static, table in zip(self.statics, tensors, strict=True):
                static.copy_(table)
        return self.captured.replay(fill, self.form.read)


def grid(key: tuple, device: torch.device, fn: Callable, make_form: Callable[[], GridForm],
         output_bytes: int) -> object | None:
    """``make_form()(fn)`` (the compiled grid form over one chunk on ``device``, whose compiled copy
    ``key`` names, and what follows it) replayed from its graph, captured (with the form made then)
    on the first call of this table signature, and read by the form; None where it is not replayed
    (the caller runs the form itself)."""
    if output_bytes > REPLAY_BYTES or capturing(device):
        return None
    tensors: list[Tensor] = []
    try:
        signature = _walk(fn, None, tensors, 0)
        hash(signature)
    except (_NotReplayable, TypeError):
        return None
    device = indexed(device)
    if any(t.device != device for t in tensors):  # evaluated where its tables are, or not replayed
        return None
    return replay(_graphs, _refused, _key(key, device, signature), lambda: _Graph(device, make_form(), fn, tensors),
                  lambda graph: graph.run(tensors), KEPT_GRAPHS)


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: "cuda" is the current CUDA device, as torch reads it."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (a build inside the
    user's own capture makes no graph of its own)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def replay(graphs: OrderedDict, refused: OrderedDict, key: object, capture: Callable[[], object],
           run: Callable[[object], object], kept: int) -> object | None:
    """``run(graphs[key])``, the graph made by ``capture()`` where missing (kept as the latest of
    ``kept``; an evicted one is released after its last replay and refused from then on, since a
    capture costs milliseconds and keys taking turns past ``kept`` would pay one every call); None
    where ``key`` is refused, or its capture or replay raises (running out of memory included; one
    warning per kind of failure): the caller's own path, as before, and never this graph again (the
    latest `KEPT_REFUSALS` refusals remembered). A capture takes `CAPTURE_LOCK` before the caches'
    lock, as a compiled module's capture (holding it) may build such a mask: one order, no deadlock."""
    with _lock:
        if key in refused:
            return None
        graph = graphs.get(key)
        if graph is not None:
            graphs.move_to_end(key)
    if graph is None:
        with CAPTURE_LOCK, _lock:
            if key in refused:  # another thread's capture of this key failed meanwhile
                return None
            graph = graphs.get(key)
            if graph is None:
                try:
                    graph = capture()
                except Exception as exc:  # noqa: BLE001 (whatever torch raises for a capture it refuses)
                    _refuse(refused, key)
                    _warn_once("captured", exc)
                    return None
                while len(graphs) >= kept:  # the evicted key is not captured again: keys that take turns past
                    evicted, old = graphs.popitem(last=False)  # `kept` would pay a capture every call
                    old.captured.release()
                    _refuse(refused, evicted)
                graphs[key] = graph
            graphs.move_to_end(key)
    try:
        return run(graph)
    except Exception as exc:  # noqa: BLE001 (a replay that fails gives way to the path it stands in for)
        with _lock:
            graphs.pop(key, None)
            _refuse(refused, key)
        _warn_once("replayed", exc)
        return None


def _warn_once(what: str, exc: Exception) -> None:
    """One warning per failure and exception type: the build goes on, as fast as before the graphs."""
    if (what, type(exc)) in _warned:
        return
    _warned.add((what, type(exc)))
    first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    warnings.warn(f"stof-cc: a per-call mask build could not be {what} as a CUDA graph ({type(exc).__name__}: "
                  f"{first_line}); such builds run as before (the compiled call, numpy's lists)", stacklevel=3)


def _refuse(refused: OrderedDict, key: object) -> None:
    keep(refused, key, None, KEPT_REFUSALS)


def signature(fn: Callable) -> object | None:
    """What a graph of ``fn`` is captured for (its codes, scalars, and its tables' shapes, strides,
    dtypes and devices); None where ``fn`` is not replayed."""
    try:
        found = _walk(fn, None, [], 0)
        hash(found)
    except (_NotReplayable, TypeError):  # TypeError: something unhashable in it
        return None
    return found


def replays(fn_signature: object) -> bool:
    """Whether a kept graph was captured for this signature: the compiled form took the mask_mod
    whole (fullgraph), so what it returns has shapes its guards decide, not its tables' values."""
    with _lock:  # another thread may add or evict a graph meanwhile
        keys = tuple(_graphs)
    return any(key[-1] == fn_signature for key in keys)


def _key(form: tuple, device: torch.device, fn_signature: object) -> tuple:
    """A grid graph's key: the compiled copy and its shape, the device, the mask_mod's signature (last)."""
    return form, device, fn_signature


def _walk(value: object, swap: Callable[[], Tensor] | None, tensors: list[Tensor], depth: int) -> object:
    """With ``swap`` None: ``value``'s signature (codes, scalars, tensors' shapes, strides, dtypes
    and devices), its tensors appended to ``tensors`` in order. With ``swap``: ``value`` rebuilt
    with each tensor replaced by ``swap()`` (the statics, in the same order). Raises
    _NotReplayable for what a graph cannot follow."""
    if isinstance(value, Tensor):
        if value.layout != torch.strided or type(value) is not Tensor:  # sparse, a subclass: not copied as is
            raise _NotReplayable
        if swap is not None:
            return swap()
        tensors.append(value)
        return "tensor", tuple(value.shape), value.stride(), value.dtype, value.device
    if value is None or type(value) in SCALARS:  # exactly: a subclass may compare or hash otherwise
        return value if swap is not None else (type(value), value)
    if isinstance(value, tuple | list) and len(value) <= ITEMS:
        items = [_walk(item, swap, tensors, depth) for item in value]
        return type(value)(items) if swap is not None else (type(value), *items)
    if depth >= MAX_DEPTH:
        raise _NotReplayable
    if isinstance(value, functools.partial):
        func = _walk(value.func, swap, tensors, depth + 1)
        args = _walk(value.args, swap, tensors, depth + 1)
        keywords = _keywords(value.keywords, swap, tensors, depth + 1)
        return functools.partial(func, *args, **dict(keywords)) if swap is not None else ("partial", func, args, keywords)
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
    kwdefaults = _keywords(fn.__kwdefaults__ or {}, swap, tensors, depth + 1)
    named = _named_globals(fn, depth)
    if swap is None:
        return fn.__code__, tuple(cells), defaults, kwdefaults, named
    proxy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults or None,
                               tuple(types.CellType(item) for item in cells) or None)
    proxy.__kwdefaults__ = dict(kwdefaults) or None
    return proxy


def _keywords(keywords: dict, swap: Callable[[], Tensor] | None, tensors: list[Tensor], depth: int) -> tuple:
    """A partial's keywords or a function's keyword defaults, walked in sorted order (so closures that
    name them in another order still fill the same statics): ((name, walked value), ...)."""
    return tuple((name, _walk(keywords[name], swap, tensors, depth)) for name in sorted(keywords))


def _named_globals(fn: types.FunctionType, depth: int) -> tuple:
    """The globals ``fn``'s code names, its nested functions' and lambdas' included (their code
    objects are constants of its own), as signature items."""
    names, codes = [], [fn.__code__]
    while codes:
        code = codes.pop()
        names += [name for name in code.co_names if name in fn.__globals__]
        codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return tuple((name, _global(fn.__globals__[name], depth)) for name in names)


def _global(value: object, depth: int) -> object:
    """A global the mask_mod names, as part of the signature: the proxy reads the globals
    themselves, so only what cannot hold a table passes."""
    if value is None or type(value) in SCALARS:
        return type(value), value
    if isinstance(value, types.ModuleType):
        if value.__name__.split(".")[0] not in MODULES:
            raise _NotReplayable
        return value.__name__
    if isinstance(value, type):  # a class's attributes could hold a table: only torch's and the like
        if value.__module__.split(".")[0] not in (*MODULES, "builtins"):
            raise _NotReplayable
        return value
    if isinstance(value, types.BuiltinFunctionType):  # not a bound method of a tensor (ids.index_select)
        if not (value.__self__ is None or isinstance(value.__self__, types.ModuleType)):
            raise _NotReplayable
        return value
    if isinstance(value, types.FunctionType) and depth < MAX_DEPTH:
        if value.__closure__ or value.__defaults__ or value.__kwdefaults__:
            raise _NotReplayable  # what it captures is not rebuilt in the proxy
        return value.__code__, _named_globals(value, depth + 1)
    raise _NotReplayable
