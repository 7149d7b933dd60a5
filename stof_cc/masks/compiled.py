"""User mask_mods evaluated and bit-packed by one generated kernel (torch.compile).

Evaluated eagerly, a mask_mod runs one torch kernel per operation over every (q, k), each reading
and writing S_q x S_k values, and the booleans are then packed into the 32-bit words the builder
reads: 2-45 ms for one mask at S = 8192-32768 on the H100 (benchmarks/RESULTS.md, "User masks built
on the GPU"), paid on every call where the mask changes per call (a packed batch's documents, a
mask_mod over per-request tables). Compiled, the evaluation, the keys past the end and the packing
are one kernel that reads the index vectors and writes the words.

Compiling costs about a second, which a mask built once never earns back: a mask_mod's code is
compiled from its `COMPILE_FROM`-th evaluation on, on the devices of `DEVICE_TYPES` (CUDA), and never
while torch.compile is tracing something else. A mask_mod torch.compile cannot take whole (a graph
break, data-dependent Python control flow, ...) is evaluated eagerly from then on, with one warning
naming it; the eager path is also where a wrong mask_mod gets the error that names its fault. Where
one code object is compiled for closures over new tensors of the same shapes (a mask_mod rebuilt
per batch), dynamo's guards reuse the compiled kernel; other shapes recompile, up to torch's
recompile limit, then run eagerly inside the compiled function's frame (correct, slower).
Why (and what is measured): docs/decisions.md#user-masks-compiled-when-built-per-call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

COMPILE_FROM = 2  # evaluations of one mask_mod code object (all extents) before its kernel is compiled
DEVICE_TYPES = ("cuda",)  # where compiling pays; tests add "cpu"

_evaluations: dict[object, int] = {}  # per code object
_refused: set[object] = set()  # code objects torch.compile could not take
_compiled: Callable | None = None


def wanted(fn: Callable, device: torch.device) -> bool:
    """Count an evaluation of ``fn`` on ``device``; whether to evaluate it compiled."""
    key = _code_key(fn)
    _evaluations[key] = _evaluations.get(key, 0) + 1
    return (device.type in DEVICE_TYPES and key not in _refused and _evaluations[key] >= COMPILE_FROM
            and not torch.compiler.is_compiling())


def packed_words(fn: Callable, name: str, b: Tensor, h: Tensor, q: Tensor, seq_k: int, batch: int,
                 heads: int) -> Tensor | None:
    """``fn`` at every (b, h, q, k < seq_k), packed as `bits.pack_last` packs rows: int32 [batch,
    heads, q rows, ceil(seq_k / 32)] on q's device, keys past seq_k 0. ``b``, ``h``, ``q`` are the
    int32 index tensors [B, 1, 1, 1], [1, H, 1, 1], [1, 1, rows, 1]; ``batch`` and ``heads`` the
    mask's dims (1 where it does not vary). None where torch.compile cannot take ``fn`` (warned
    once; evaluate it eagerly)."""
    global _compiled
    words = -(-seq_k // 32)
    keys = torch.arange(words * 32, dtype=torch.int32, device=q.device)
    valid = (keys < seq_k).view(1, 1, 1, -1)
    k = keys.clamp(max=seq_k - 1).view(1, 1, 1, -1)  # the function never sees a key past the end
    shifts = torch.arange(8, dtype=torch.uint8, device=q.device)
    if _compiled is None:
        _compiled = torch.compile(_evaluate_and_pack, fullgraph=True, dynamic=False)
    try:
        octets = _compiled(fn, b, h, q, k, valid, shifts, batch, heads)
    except Exception as exc:  # noqa: BLE001 (whatever torch.compile raises: the eager path decides)
        _refused.add(_code_key(fn))
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        warnings.warn(f"stof-cc: from_mask_mod({name}) is evaluated eagerly: torch.compile could not compile it "
                      f"({type(exc).__name__}: {first_line[:200]})", stacklevel=3)
        return None
    return octets.view(torch.int32)


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


def _code_key(fn: Callable) -> object:
    """What identifies a mask_mod's code across the closures made of it."""
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    return getattr(fn, "__code__", None) or type(fn)
