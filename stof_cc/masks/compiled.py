"""User mask_mods evaluated and bit-packed by one generated kernel (torch.compile).

Evaluated eagerly, a mask_mod runs one torch kernel per operation over every (q, k), each reading
and writing S_q x S_k values, and the booleans are then packed into the 32-bit words the builder
reads: 2-45 ms for one mask at S = 8192-32768 on the H100 (benchmarks/RESULTS.md, "User masks built
on the GPU"), paid on every call where the mask changes per call (a packed batch's documents, a
mask_mod over per-request tables). Compiled, the evaluation, the keys past the end and the packing
are one kernel that reads the index vectors and writes the words.

Compiling costs about a second, which a mask built once never earns back: a mask_mod's code is
compiled for a shape (keys, rows per chunk, batch and head dims) from its `COMPILE_FROM`-th build at
that shape on, on the devices of `DEVICE_TYPES` (CUDA), and never while torch.compile traces
something else. So a mask built per call with new tables (a closure of the same code over new
tensors) is compiled once and its kernel reused, and a decode step's mask, one key longer each step,
is never compiled. Each mask_mod code gets its own compiled function (its own guards and recompile
limit: one mask's shapes do not use up another's). A mask_mod torch.compile cannot take whole (a
graph break, data-dependent control flow, a non-bool result) is evaluated eagerly from then on, with
one warning naming it; the eager path is where a wrong mask_mod gets the error that names its fault.
Why (and what is measured): docs/decisions.md#user-masks-compiled-when-built-per-call.
"""

from __future__ import annotations

import types
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

COMPILE_FROM = 2  # builds of one mask_mod code at one shape before it is compiled for that shape
DEVICE_TYPES = ("cuda",)  # where compiling pays; tests add "cpu"
KEPT_COUNTS = 256  # (code, shape) build counts kept, the latest

Packer = Callable[[Tensor, Tensor, Tensor], "Tensor | None"]

_builds: OrderedDict[tuple, int] = OrderedDict()
_refused: set[object] = set()  # code keys torch.compile could not take
_warned: set[object] = set()
_functions: dict[object, Callable] = {}  # code key -> its own compiled copy of _evaluate_and_pack


def packer(fn: Callable, name: str, device: torch.device, seq_k: int, rows: int, batch: int,
           heads: int) -> Packer | None:
    """For one build of ``fn``'s mask (chunks of ``rows`` query rows against ``seq_k`` keys, mask
    dims ``batch`` x ``heads``, on ``device``): the compiled packer, or None where this build
    evaluates eagerly. The packer takes the int32 index tensors b [B, 1, 1, 1], h [1, H, 1, 1] and
    q [1, 1, rows, 1] and returns the chunk as `bits.pack_last` packs it (int32 [batch, heads, rows,
    ceil(seq_k / 32)], keys past seq_k 0), or None where torch.compile failed (evaluate it eagerly)."""
    if torch.compiler.is_compiling() or device.type not in DEVICE_TYPES:
        return None
    key = _code_key(fn)
    if key in _refused or not _count_build((key, seq_k, rows, batch, heads)):
        return None
    if key not in _functions:
        code = _evaluate_and_pack.__code__.replace(co_name=f"_evaluate_and_pack_{len(_functions)}")
        clone = types.FunctionType(code, _evaluate_and_pack.__globals__, code.co_name)
        _functions[key] = torch.compile(clone, fullgraph=True, dynamic=False)
    function = _functions[key]
    words = -(-seq_k // 32)
    keys = torch.arange(words * 32, dtype=torch.int32, device=device)
    valid = (keys < seq_k).view(1, 1, 1, -1)
    k = keys.clamp(max=seq_k - 1).view(1, 1, 1, -1)  # the function never sees a key past the end
    shifts = torch.arange(8, dtype=torch.uint8, device=device)

    def pack(b: Tensor, h: Tensor, q: Tensor) -> Tensor | None:
        if key in _refused:
            return None
        try:
            return function(fn, b, h, q, k, valid, shifts, batch, heads).view(torch.int32)
        except Exception as exc:  # noqa: BLE001 (whatever torch.compile raises: the eager path decides)
            _fell_back(key, name, exc)
            return None
    return pack


def _count_build(count_key: tuple) -> bool:
    """Count a build at a shape; whether it is the COMPILE_FROM-th or later."""
    count = _builds.pop(count_key, 0) + 1
    _builds[count_key] = count
    while len(_builds) > KEPT_COUNTS:
        _builds.popitem(last=False)
    return count >= COMPILE_FROM


def _fell_back(key: object, name: str, exc: Exception) -> None:
    """Evaluate eagerly this time; the code never again where torch.compile refused it (not for
    running out of memory, or of recompiles for new shapes: those can pass)."""
    passing = isinstance(exc, torch.OutOfMemoryError | torch._dynamo.exc.FailOnRecompileLimitHit)
    if not passing:
        _refused.add(key)
    if (key, passing) in _warned:
        return
    _warned.add((key, passing))
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    warnings.warn(f"stof-cc: from_mask_mod({name}) is evaluated eagerly{' this time' if passing else ''}: "
                  f"torch.compile could not run it ({type(exc).__name__}: {first_line[:200]})", stacklevel=4)


def _evaluate_and_pack(fn: Callable, b: Tensor, h: Tensor, q: Tensor, k: Tensor, valid: Tensor, shifts: Tensor,
                       batch: int, heads: int) -> Tensor:
    """The compiled function: uint8 [batch, heads, rows, keys / 8], bit c of a row in byte c // 8
    at bit c % 8 (so four bytes are `pack_last`'s little-endian word)."""
    allowed = fn(b, h, q, k)
    if allowed.dtype != torch.bool:  # known while tracing: refused, and the eager path names the fault
        raise TypeError(f"returned {allowed.dtype}, not torch.bool")
    allowed = (allowed & valid).expand(batch, heads, q.shape[2], k.shape[3])
    octets = allowed.reshape(batch, heads, q.shape[2], k.shape[3] // 8, 8).to(torch.uint8) << shifts
    return octets.sum(-1, dtype=torch.uint8)


def _code_key(fn: Callable, depth: int = 2) -> object:
    """What identifies a mask_mod's code across the closures made of it: its code object, with the
    codes of the functions it captures (`and_masks(causal, documents)` is not
    `and_masks(causal, branching)`), two levels deep."""
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is None:
        return type(fn)
    if depth == 0:
        return code
    captured = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for item in value if isinstance(value, tuple | list) else (value,):
            if callable(item) and not isinstance(item, torch.Tensor | type):
                captured.append(_code_key(item, depth - 1))
    return (code, *captured) if captured else code
