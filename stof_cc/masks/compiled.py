"""User mask_mods evaluated and bit-packed by one generated kernel (torch.compile).

Evaluated eagerly, a mask_mod runs one torch kernel per operation over every (q, k), each reading
and writing S_q x S_k values, and the booleans are then packed into the 32-bit words the builder
reads: 2-45 ms for one mask at S = 8192-32768 on the H100 (benchmarks/RESULTS.md, "User masks built
on the GPU"), paid on every call where the mask changes per call (a packed batch's documents, a
mask_mod over per-request tables). Compiled, the evaluation, the keys past the end and the packing
are one kernel that reads the index vectors and writes the words. Two forms: `packer`, row-packed
bits (what `to_dense`, combinations and the cost model's fine grid read), and `grid`, the launch's
block grid itself (every block's tile and class, what `BlockMask.from_grid` assembles): a mask built
per call for a launch takes the second, one call where the first took a dozen more steps.

Compiling costs about a second, which a mask built once never earns back: a mask_mod's code is
compiled for a shape (keys, rows per chunk, batch and head dims) from its `COMPILE_FROM`-th build at
that shape on, on the devices of `DEVICE_TYPES` (CUDA), and never while torch.compile traces
something else. So a mask built per call with new tables (a closure of the same code over new
tensors) is compiled once and its kernel reused, and a decode step's mask, one key longer each step,
is never compiled. Each mask_mod code gets its own compiled function per shape: one guard set each,
so the shapes of a serving run (packed batches of new lengths every call) do not add up to dynamo's
recompile limit (with one function per code, the ninth shape and every one after it were evaluated
eagerly, with a warning), no call checks the guards of other shapes first, and one mask's shapes do
not use up another's. Within a shape dynamo's guards still recompile for captured tables of new
sizes or dtypes (a table of document boundaries whose length changes at the same S): past the limit
such a build falls back to the eager path for that build only. Each shape built twice costs a
compile (about a second; where its grid is replayed, a second one for the lists' ranker at that
grid shape, shared by every code); the latest `KEPT_FORMS` copies are kept, so a run cycling through more
shapes than that compiles again. A mask_mod torch.compile cannot take whole (a
graph break, data-dependent control flow, a non-bool result) is evaluated eagerly from then on, with
one warning naming it; the eager path is where a wrong mask_mod gets the error that names its fault.
A grid of one chunk is replayed from a CUDA graph from then on (masks/replayed.py). Why (and what is
measured): docs/decisions.md#user-masks-compiled-when-built-per-call, #per-call-grid-form and
#per-call-masks-replayed.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

import stof_cc.masks.lists as lists
import stof_cc.masks.replayed as replayed
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL
from stof_cc.masks.kept import keep

COMPILE_FROM = 2  # builds of one mask_mod code at one shape (per form) before it is compiled for that shape
DEVICE_TYPES = ("cuda",)  # where compiling pays; tests add "cpu"
KEPT_COUNTS = 256  # (code, shape) build counts kept, the latest
KEPT_INDICES = 8  # shapes whose grid-form index tensors are kept, the latest
KEPT_FORMS = 64  # compiled copies kept (a form per code and shape, the lists' ranker per grid shape), the latest used
GRID_CHUNK_ELEMENTS = 1 << 30  # (q, k) pairs of the grid form per compiled call (S = 32768: one call)
#: Inductor options per form. The grid form's 32 calls of the function exceed Inductor's limits on
#: the reads and operations a fused expression may hold, so it stored partial words between
#: several kernels: 0.54 / 5.1 / 2.5 ms for causal / document / BigBird at S = 32768 on the H100,
#: 0.30 / 1.38 / 1.37 with the limits raised (one kernel for the words, one for the classes).
FORM_OPTIONS = {"_evaluate_classify_pack": {"realize_opcount_threshold": 1 << 20, "realize_reads_threshold": 1 << 20,
                                            "realize_acc_reads_threshold": 1 << 20}}

Packer = Callable[[Tensor, Tensor, Tensor], "Tensor | None"]

_builds: OrderedDict[tuple, int] = OrderedDict()
_refused: set[object] = set()  # (form, code key) pairs torch.compile could not take
_warned: set[object] = set()
_functions: OrderedDict[tuple, Callable] = OrderedDict()  # (form, code key, shape) -> its compiled copy of the form
_indices: OrderedDict[tuple, tuple] = OrderedDict()  # the grid form's index tensors, per device and shape
_copies = 0  # compiled copies made (their code names: a profile tells them apart)


def packer(fn: Callable, name: str, device: torch.device, seq_k: int, rows: int, batch: int,
           heads: int) -> Packer | None:
    """For one build of ``fn``'s mask (chunks of ``rows`` query rows against ``seq_k`` keys, mask
    dims ``batch`` x ``heads``, on ``device``): the compiled packer, or None where this build
    evaluates eagerly. The packer takes the int32 index tensors b [B, 1, 1, 1], h [1, H, 1, 1] and
    q [1, 1, rows, 1] and returns the chunk as `bits.pack_last` packs it (int32 [batch, heads, rows,
    ceil(seq_k / 32)], keys past seq_k 0), or None where torch.compile failed (evaluate it eagerly)."""
    function = _compiled_form(_evaluate_and_pack, fn, device, (seq_k, rows, batch, heads))
    if function is None:
        return None
    key = ("_evaluate_and_pack", _code_key(fn))
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
            _fell_back(key, f"from_mask_mod({name})", exc)
            return None
    return pack


def grid(fn: Callable, name: str, device: torch.device, seq_q: int, seq_k: int, block_m: int, block_n: int,
         batch: int, heads: int) -> tuple[Tensor, Tensor, tuple[Tensor, np.ndarray] | None] | None:
    """``fn``'s mask on the block_m x block_n grid over seq_q x seq_k (mask dims ``batch`` x
    ``heads``), evaluated, classified and packed tile by tile in one compiled call per chunk of
    block rows: (classes int8 [batch, heads, n_rb, n_cb], every block's tile int32 [batch, heads,
    n_rb, n_cb, block_m * block_n / 32], bits past the ends 0), as `_Evaluated.grid_classes` reads
    them off row-packed bits in several more steps; then the block lists where they were ranked with
    the grid (`lists.read`'s buffer and offsets), else None. None where this build evaluates eagerly
    (not yet compiled at this shape, or torch.compile failed) or block_n is not a multiple of 32.
    What a mask_mod built per call pays on the host: this call, the index tensors kept per shape; a
    grid of one chunk is replayed from a CUDA graph where the mask_mod allows it (masks/replayed.py),
    its block lists ranked in the same graph (`_RankedGrid`)."""
    if block_n % 32:
        return None
    n_rb = -(-seq_q // block_m)
    function = _compiled_form(_evaluate_classify_pack, fn, device, (seq_q, seq_k, block_m, block_n, batch, heads))
    if function is None:
        return None
    b, h, words, chunks = _grid_indices(device, seq_q, seq_k, block_m, block_n, batch, heads)
    try:
        if len(chunks) == 1 and device.type in replayed.DEVICE_TYPES:  # one call: replayed from a CUDA graph where allowed
            q, q_valid = chunks[0]
            held = replayed.grid((function, seq_q, seq_k, block_m, block_n, batch, heads), device, fn,
                                 lambda: _RankedGrid(function, (b, h, q, q_valid, words, seq_k, batch, heads, block_m,
                                                                block_n), n_rb, (batch * heads * n_rb, -(-seq_k // block_n)), device),
                                 batch * heads * q.shape[2] * words.shape[3] * 4)  # the tiles' bytes
            if held is not None:
                return held
        parts = [function(fn, b, h, q, q_valid, words, seq_k, batch, heads, block_m, block_n) for q, q_valid in chunks]
    except Exception as exc:  # noqa: BLE001 (whatever torch.compile raises: the eager path decides)
        _fell_back(("_evaluate_classify_pack", _code_key(fn)), f"from_mask_mod({name})", exc)
        return None
    classes, tiles = parts[0] if len(parts) == 1 else (torch.cat(part, 2) for part in zip(*parts, strict=True))
    return classes[:, :, :n_rb], tiles[:, :, :n_rb], None


class _RankedGrid:
    """What `replayed.grid` captures for a grid of one chunk: the compiled grid form, then the block
    lists ranked from its classes (`lists.rank`, offsets copied to pinned host memory), so that one
    replay and one wait make a per-call block mask. Holds the form's index tensors, which the graph
    reads."""

    def __init__(self, function: Callable, args: tuple, n_rb: int, lists_shape: tuple[int, int],
                 device: torch.device):
        """``function(fn, *args)`` makes the grid (``n_rb`` block rows per mask slice); ``lists_shape``
        is (block rows over every slice, block columns)."""
        self.function, self.args, self.n_rb = function, args, n_rb
        self.host = lists.host_offsets(lists_shape[0], device)
        # static shapes, like the form's: the dynamic-size ranker's kernels took 50-60 us a call on the H100, these 17
        self.ranker = per_shape(lists.lists, (lists.lists, *lists_shape))

    def __call__(self, fn: Callable) -> tuple[Tensor, Tensor, Tensor]:
        classes, tiles = self.function(fn, *self.args)
        classes, tiles = classes[:, :, :self.n_rb], tiles[:, :, :self.n_rb]
        return classes, tiles, lists.rank(classes.reshape(-1, classes.shape[-1]), self.host, self.ranker)

    def read(self, outputs: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, tuple[Tensor, np.ndarray]]:
        classes, tiles, buffer = outputs
        return classes.clone(), tiles.clone(), lists.read(buffer, self.host)


def _compiled_form(form: Callable, fn: Callable, device: torch.device, shape: tuple) -> Callable | None:
    """``form`` compiled for ``fn``'s code at ``shape`` (a copy of the form per code and shape: a code
    object of its own, so its own guards and recompile count), or None where this build evaluates
    eagerly."""
    if torch.compiler.is_compiling() or device.type not in DEVICE_TYPES:
        return None
    key = _code_key(fn)
    if (form.__name__, key) in _refused or not _count_build((form.__name__, key, *shape)):
        return None
    return per_shape(form, (form, key, *shape))


def per_shape(form: Callable, entry: tuple) -> Callable:
    """``form`` compiled (fullgraph, static shapes) as its own copy for ``entry`` (the form, and what
    tells its uses apart: a code, a shape): a code object of its own, so its own guards and recompile
    count; the latest `KEPT_FORMS` copies are kept."""
    found = _functions.get(entry)  # one lookup: another thread may evict it meanwhile
    if found is not None:
        with contextlib.suppress(KeyError):
            _functions.move_to_end(entry)
        return found
    global _copies
    _copies += 1
    code = form.__code__.replace(co_name=f"{form.__name__}_{_copies}")
    clone = types.FunctionType(code, form.__globals__, code.co_name)
    return keep(_functions, entry, torch.compile(clone, fullgraph=True, dynamic=False,
                                                options=FORM_OPTIONS.get(form.__name__)), KEPT_FORMS)


def _grid_indices(device: torch.device, seq_q: int, seq_k: int, block_m: int, block_n: int, batch: int,
                  heads: int) -> tuple:
    """The grid form's arguments but the function, made once per shape (a few small launches each,
    which a per-call build would pay every call): b, h, each 32-key word's first key, and per chunk
    of whole block rows (q clamped to the last row, q_valid), every chunk the same shape so that one
    compiled kernel runs them all."""
    key = (device, seq_q, seq_k, block_m, block_n, batch, heads)
    found = _indices.get(key)
    if found is not None:
        with contextlib.suppress(KeyError):
            _indices.move_to_end(key)
        return found
    n_rb, n_cb = -(-seq_q // block_m), -(-seq_k // block_n)
    index = {"dtype": torch.int32, "device": device}
    keys = torch.arange(n_cb * block_n, **index)
    rows = block_m * max(1, min(n_rb, GRID_CHUNK_ELEMENTS // (batch * heads * block_m * keys.numel())))
    chunks = []
    for start in range(0, n_rb * block_m, rows):
        q = torch.arange(start, start + rows, **index)
        chunks.append(((q.clamp(max=seq_q - 1)).view(1, 1, -1, 1), (q < seq_q).view(1, 1, -1, 1)))
    return keep(_indices, key, (torch.arange(batch, **index).view(-1, 1, 1, 1),
                                 torch.arange(heads, **index).view(1, -1, 1, 1), keys[::32].view(1, 1, 1, -1), chunks),
                 KEPT_INDICES)


def _count_build(count_key: tuple) -> bool:
    """Count a build at a shape; whether it is the COMPILE_FROM-th or later."""
    return keep(_builds, count_key, _builds.pop(count_key, 0) + 1, KEPT_COUNTS) >= COMPILE_FROM


def _fell_back(key: object, subject: str, exc: Exception) -> None:
    """Evaluate eagerly this time; never again through this form for this code (``key``: form and
    code) where torch.compile refused it (not for running out of memory, or of recompiles for new
    shapes: those can pass)."""
    passing = isinstance(exc, torch.OutOfMemoryError | torch._dynamo.exc.FailOnRecompileLimitHit)
    if not passing:
        _refused.add(key)
    if (key, passing) in _warned:
        return
    _warned.add((key, passing))
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    warnings.warn(f"stof-cc: {subject} is evaluated eagerly{' this time' if passing else ''}: "
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


def _evaluate_classify_pack(fn: Callable, b: Tensor, h: Tensor, q: Tensor, q_valid: Tensor, words: Tensor,
                              seq_k: int, batch: int, heads: int, block_m: int,
                              block_n: int) -> tuple[Tensor, Tensor]:
    """The grid form, compiled: (classes int8 [batch, heads, rows / block_m, n_cb], tiles int32
    [batch, heads, rows / block_m, n_cb, block_m * block_n / 32], element (r, c) of a tile at bit
    (r * block_n + c) % 32 of word (r * block_n + c) // 32, as `bits.pack` packs it). ``words`` holds
    each 32-key word's first key: the function is called once per bit, on the keys word + bit, so
    Inductor makes one pointwise kernel that computes a word per thread (a row's own reads shared
    by its 32 keys; FORM_OPTIONS keeps it one kernel). Evaluated per element and packed by a sum
    over 8 bits, the kernel took 2.2-4.2 ms at S = 32768 on the H100, 0.14-0.27 ms at 8192; this
    form 0.30-1.38 and 0.02-0.10 (history/26-2026-11-27.md). A block is FULL where every in-range
    element attends, EMPTY where none does."""
    word = None
    for bit in range(32):
        keys = words + bit
        allowed = fn(b, h, q, keys.clamp(max=seq_k - 1))  # the function never sees a key past the end
        if allowed.dtype != torch.bool:  # known while tracing: refused, and the eager path names the fault
            raise TypeError(f"returned {allowed.dtype}, not torch.bool")
        term = (allowed & (keys < seq_k)).to(torch.int64) << bit
        word = term if word is None else word | term
    rows, n_cb = q.shape[2], words.shape[3] * 32 // block_n
    word = torch.where(q_valid, word, 0).to(torch.int32).expand(batch, heads, rows, words.shape[3])
    tiles = word.reshape(batch, heads, rows // block_m, block_m, n_cb, block_n // 32).permute(0, 1, 2, 4, 3, 5)
    tiles = tiles.reshape(batch, heads, rows // block_m, n_cb, block_m * block_n // 32)
    bits = tiles.to(torch.int64) & 0xFFFFFFFF  # popcount of the 32-bit words in int64: no sign to mind
    pairs = bits - ((bits >> 1) & 0x55555555)
    nibbles = (pairs & 0x33333333) + ((pairs >> 2) & 0x33333333)
    attending = ((((nibbles + (nibbles >> 4)) & 0x0F0F0F0F) * 0x01010101) >> 24 & 0xFF).sum(-1)
    keys_in_range = (seq_k - words).clamp(0, 32).reshape(n_cb, block_n // 32).sum(-1)
    in_range = q_valid.reshape(rows // block_m, block_m).sum(-1, dtype=torch.int64)[:, None] * keys_in_range[None, :]
    classes = torch.where(attending == in_range, FULL, torch.where(attending == 0, EMPTY, PARTIAL)).to(torch.int8)
    return classes, tiles


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
