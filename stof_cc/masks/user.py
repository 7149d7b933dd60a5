"""Masks the user brings: a dense boolean tensor, or a FlexAttention-style mask_mod function.

Neither has structure to classify blocks analytically, so each is evaluated over every (q, k)
once per extent: on a GPU when there is one (a mask_mod on the device of the tensors it
captures; one that captures CPU tensors on the CPU), in row chunks (never an S x S tensor at
once), into row-packed bits [Bm, Hm, S_q, ceil(S_k / 32)] int32. Every block shape's classes
and tiles are views of those bits, and a mask_mod's `to_dense` and its part in combinations
read them too, so the kernel's block mask, the cost model's candidates, `explain_attention`
and `to_dense` share one evaluation (a mask_mod whose answers change from call to call still
gives one mask). Above PACKED_BUDGET bytes (long contexts) the bits are not kept: every
block is classified PARTIAL and its tile evaluated, in chunks, within the builder's
EVALUATION_BUDGET.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

import stof_cc.masks.compiled as compiled
import stof_cc.masks.replayed as replayed
from stof_cc.masks.bits import bit_at, pack_last
from stof_cc.masks.description import MaskDescription, MaskMod
from stof_cc.masks.errors import MaskError, MaskTypeError, check_values
from stof_cc.masks.geometry import PARTIAL, BlockGrid, Extent, Tiles, classes_from
from stof_cc.masks.kept import keep
from stof_cc.masks.runs import ClassRuns
from stof_cc.masks.zoo import right_padding

PACKED_BUDGET = 1 << 29  # bytes of row-packed bits kept, all extents together (S = 32768 with Bm = Hm = 1: 128 MiB)
ROW_CHUNK_ELEMENTS = {"cpu": 1 << 23, "cuda": 1 << 26}  # (q, k) pairs evaluated at once
KIND_ITEMS = 16  # a captured tuple or list up to this long is part of a mask_mod's kind item by item
KEPT_PROBES = 8  # (device, batch, heads) whose dims-probe index tensors are kept, the latest

_probes: OrderedDict[tuple, tuple[Tensor, Tensor, Tensor]] = OrderedDict()
_replayed_dims: OrderedDict[tuple, tuple[int, int]] = OrderedDict()  # (replay signature, extent) -> dims, the latest KEPT_PROBES


class _Evaluated(MaskDescription):
    """A mask classified by evaluating it: row-packed bits of the latest extents, on the
    evaluation device, kept while they fit PACKED_BUDGET together; `_classify` and `tile_bits`
    read them for block_n a multiple of 32 or 16 (the cost model's fine grid). A subclass
    implements `_evaluate`, the mask itself."""

    def __init__(self) -> None:
        super().__init__()
        self._bits: dict[Extent, torch.Tensor] = {}  # oldest first
        self._tiles: dict[tuple[Extent, int, int], torch.Tensor] = {}
        self._classes: dict[tuple[Extent, int, int], torch.Tensor] = {}  # where evaluated with the tiles
        self._ranked: dict[tuple[Extent, int, int], tuple] = {}  # lists ranked with the tiles (`grid_ranked`)
        self._per_call_grid: tuple[Extent, int, int] | None = None  # the grid `_evaluate_grid` made, if any

    def _evaluate(
        self, ext: Extent | None, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        """The mask at these indices, evaluated afresh (what `_eval` is, unless a subclass
        reads a kept evaluation instead)."""
        raise NotImplementedError

    def _eval(
        self, ext: Extent | None, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return self._evaluate(ext, b, h, q, k)

    def _evaluation_device(self) -> torch.device:
        """Where to evaluate: a GPU when there is one, unless the mask needs the CPU."""
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def packed_bits(self, ext: Extent) -> Tensor | None:
        """bool mask over every (q, k) of ``ext``, row-packed: int32 [Bm, Hm, S_q, ceil(S_k / 32)]
        on the evaluation device; None above PACKED_BUDGET. Kept with the latest other
        extents' while all fit PACKED_BUDGET together."""
        if ext not in self._bits:
            batch, heads = self._dims(ext)
            words = -(-ext.seq_k // 32)
            size = batch * heads * ext.seq_q * words * 4
            if size > PACKED_BUDGET:
                return None
            while sum(kept.numel() * 4 for kept in self._bits.values()) + size > PACKED_BUDGET:
                evicted = next(iter(self._bits))
                del self._bits[evicted]
                self._tiles = {key: tiles for key, tiles in self._tiles.items() if key[0] != evicted}
                self._classes = {key: classes for key, classes in self._classes.items() if key in self._tiles}
                self._ranked = {key: ranked for key, ranked in self._ranked.items() if key in self._tiles}
            held = self._rows_of_tiles(ext)
            if held is not None:
                self._bits[ext] = held
                return held
            device = self._evaluation_device()
            bits = torch.empty(batch, heads, ext.seq_q, words, dtype=torch.int32, device=device)
            rows = min(ext.seq_q, max(1, ROW_CHUNK_ELEMENTS.get(device.type, 1 << 23) // (batch * heads * ext.seq_k)))
            index = {"dtype": torch.int32, "device": device}  # FlexAttention's index dtype: half the bytes of int64
            b = torch.arange(batch, **index).view(-1, 1, 1, 1)
            h = torch.arange(heads, **index).view(1, -1, 1, 1)
            pack = self._row_packer(ext, rows, batch, heads, device)
            for start in range(0, ext.seq_q, rows):
                # every chunk the same shape (the last one's rows past the end repeat the last row, then are
                # dropped): one compiled kernel serves them all
                q = torch.arange(start, start + rows, **index).clamp(max=ext.seq_q - 1).view(1, 1, -1, 1)
                count = min(rows, ext.seq_q - start)
                bits[:, :, start:start + count] = pack(b, h, q)[:, :, :count]
            self._bits[ext] = bits
        return self._bits[ext]

    def _row_packer(self, ext: Extent, rows: int, batch: int, heads: int,
                    device: torch.device) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """For one `packed_bits` build: rows q (int32 [1, 1, rows, 1]) -> the mask at every key,
        packed (int32 [batch, heads, rows, words])."""
        k = torch.arange(ext.seq_k, dtype=torch.int32, device=device).view(1, 1, 1, -1)
        return lambda b, h, q: pack_last(self._evaluate(ext, b, h, q, k).expand(batch, heads, q.shape[2], ext.seq_k))

    def _rows_of_tiles(self, ext: Extent) -> Tensor | None:
        """`packed_bits` read off tiles evaluated whole (`_evaluate_grid`) at ``ext``: one evaluation
        serves every use, as a mask_mod whose answers change between calls needs."""
        for (held, bm, bn), tiles in self._tiles.items():
            if held == ext and bn % 32 == 0:
                batch, heads, n_rb, n_cb, _ = tiles.shape
                rows = tiles.view(batch, heads, n_rb, n_cb, bm, bn // 32).permute(0, 1, 2, 4, 3, 5)
                rows = rows.reshape(batch, heads, n_rb * bm, n_cb * bn // 32)
                return rows[:, :, :ext.seq_q, :-(-ext.seq_k // 32)].contiguous()
        return None

    def _evaluate_grid(self, grid: BlockGrid) -> tuple[Tensor, Tensor, tuple[Tensor, np.ndarray] | None] | None:
        """(classes, tiles) as `grid_classes` returns them, evaluated tile by tile in one go where
        a subclass can (a mask_mod built per call), and the block lists where they were ranked with
        them (`grid_ranked`); None: read them off the row-packed bits."""
        return None

    def _grid_tiles(self, grid: BlockGrid) -> Tensor | None:
        """int32 [Bm, Hm, n_rb, n_cb, words]: every block's packed tile (bits past the ends 0),
        on the evaluation device; None where the packed bits are not kept or block_n does not
        split into whole or half words."""
        key = (grid.ext, grid.block_m, grid.block_n)
        if key in self._tiles:
            return self._tiles[key]
        for held_ext, _, _ in list(self._tiles):  # tiles evaluated whole are kept as rows before they go
            if held_ext not in self._bits:
                self.packed_bits(held_ext)
        batch, heads = self._dims(grid.ext)
        size = batch * heads * grid.n_rb * grid.n_cb * grid.words * 4
        fresh = grid.ext not in self._bits and size <= PACKED_BUDGET  # else read off the rows evaluated before
        held = self._evaluate_grid(grid) if fresh else None
        if held is not None:  # the latest block shape only, as below
            self._classes, self._tiles = {key: held[0]}, {key: held[1]}
            self._ranked = {} if held[2] is None else {key: held[2]}
            self._per_call_grid = key
            return held[1]
        bits = self.packed_bits(grid.ext)
        bm, bn = grid.block_m, grid.block_n
        if bits is None or (bn % 32 and bn != 16) or (bm * bn) % 32:
            return None
        batch, heads, seq_q, words = bits.shape
        rows = torch.nn.functional.pad(bits, (0, 0, 0, grid.n_rb * bm - seq_q))
        if bn == 16:  # two tile rows per word: the low and high halves of the row words
            halves = torch.stack((rows & 0xFFFF, (rows >> 16) & 0xFFFF), -1).flatten(-2)  # a half-word per 16 keys
            halves = torch.nn.functional.pad(halves, (0, grid.n_cb - halves.shape[-1]))
            tiles = halves.view(batch, heads, grid.n_rb, bm // 2, 2, grid.n_cb).permute(0, 1, 2, 5, 3, 4)
            tiles = tiles[..., 0] | (tiles[..., 1] << 16)
        else:
            per_row = bn // 32
            rows = torch.nn.functional.pad(rows, (0, grid.n_cb * per_row - words))
            tiles = rows.view(batch, heads, grid.n_rb, bm, grid.n_cb, per_row).permute(0, 1, 2, 4, 3, 5)
        tiles = tiles.reshape(batch, heads, grid.n_rb, grid.n_cb, grid.words)
        # the latest block shape only: the cost model walks the shapes in turn
        self._classes, self._tiles, self._ranked = {}, {key: tiles}, {}
        return tiles

    def grid_classes(self, grid: BlockGrid) -> tuple[Tensor, Tensor] | None:
        """(classes int8 [Bm, Hm, n_rb, n_cb], every block's tile) read off the packed bits, both
        on the evaluation device; None where `_grid_tiles` is (the bits are not kept)."""
        tiles = self._grid_tiles(grid)
        if tiles is None:
            return None
        key = (grid.ext, grid.block_m, grid.block_n)
        if key not in self._classes:
            valid = grid.valid_grid(tiles.device)
            self._classes[key] = classes_from((tiles == valid).all(-1), (tiles == 0).all(-1))
        return self._classes[key], tiles

    def grid_built_per_call(self, grid: BlockGrid) -> bool:
        return self._per_call_grid == (grid.ext, grid.block_m, grid.block_n)

    def grid_ranked(self, grid: BlockGrid) -> tuple[Tensor, np.ndarray] | None:
        return self._ranked.get((grid.ext, grid.block_m, grid.block_n))  # kept only beside the tiles ranked

    def _classify(self, grid: BlockGrid) -> ClassRuns:
        read = self.grid_classes(grid)
        if read is None:
            return ClassRuns.filled(grid.shape(), PARTIAL)
        return ClassRuns.from_dense(read[0].cpu())

    def exact_classes(self, grid: BlockGrid) -> bool:
        return self._grid_tiles(grid) is not None  # read off the evaluated bits

    def tiles_per_chunk(self, grid: BlockGrid) -> int | None:
        """Every tile at once where they are read from the packed bits (a gather, no evaluation)."""
        return None if self._grid_tiles(grid) is not None else super().tiles_per_chunk(grid)

    def evaluates_on(self, device: torch.device) -> bool:
        def ordinal(d: torch.device) -> int | None:
            return torch.cuda.current_device() if d.type == "cuda" and d.index is None else d.index
        evaluation = self._evaluation_device()
        return device.type == evaluation.type and ordinal(device) == ordinal(evaluation)

    def tile_bits(self, grid: BlockGrid, tiles: Tiles) -> Tensor:
        return self.tile_bits_on(grid, tiles, torch.device("cpu"))

    def tile_bits_on(self, grid: BlockGrid, tiles: Tiles, device: torch.device) -> Tensor:
        """Gathered from the packed bits (or evaluated) on the evaluation device, then moved
        to ``device``: no copy when the block mask is built where the mask was evaluated."""
        packed = self._grid_tiles(grid)
        if packed is None:  # evaluate the tiles themselves, on the evaluation device
            on_device = Tiles(*(t.to(self._evaluation_device()) for t in (tiles.b, tiles.h, tiles.i, tiles.j)))
            return self._tile_bits(grid, on_device).to(device)
        b = tiles.b * int(packed.shape[0] > 1)
        h = tiles.h * int(packed.shape[1] > 1)
        index = [t.to(packed.device) for t in (b, h, tiles.i, tiles.j)]
        return packed[index[0], index[1], index[2], index[3]].to(device)  # bits past the ends are 0 already


class _Dense(_Evaluated):
    """A bool mask [B|1, H|1, S_q, S_k] held as is; the only description that is dense."""

    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.mask = mask

    def __repr__(self) -> str:
        return f"from_dense(<{'x'.join(map(str, self.mask.shape))}>)"

    def _fixed(self) -> tuple[int | None, int | None]:
        batch, heads = self.mask.shape[:2]
        return (batch if batch > 1 else None), (heads if heads > 1 else None)

    def _dims(self, ext: Extent) -> tuple[int, int]:
        batch, heads, seq_q, seq_k = self.mask.shape
        if (seq_q, seq_k) != (ext.seq_q, ext.seq_k):
            raise MaskError(
                f"from_dense: the mask is {seq_q} x {seq_k}, "
                f"but seq_q={ext.seq_q}, seq_k={ext.seq_k}"
            )
        for name, have, want in (("batch", batch, ext.batch), ("heads", heads, ext.heads)):
            if have not in (1, want):
                raise MaskError(f"from_dense: the mask has {name} dim {have}, but {name}={want}")
        return batch, heads

    def _evaluate(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        mask = self._on("mask", q.device, lambda: self.mask)
        batch, heads = mask.shape[:2]
        return mask[b.clamp(max=batch - 1), h.clamp(max=heads - 1), q, k]


class _MaskMod(_Evaluated):
    """A user mask_mod, evaluated on every block and checked on every call. It runs on the
    device of the tensors it captures (FlexAttention users index CUDA tables in their
    mask_mods): index tensors go there and the result comes back to the caller's device.
    Wherever sizes are known, its values are read from the kept evaluation (`packed_bits`),
    so a function whose answers change between calls still gives one mask everywhere."""

    def __init__(self, fn: MaskMod, name: str, device: torch.device | None) -> None:
        super().__init__()
        self.fn, self.name, self.device = fn, name, device
        self._probed: dict[Extent, tuple[int, int]] = {}

    def __repr__(self) -> str:
        return f"from_mask_mod({self.name})"

    def choice_group(self) -> object | None:
        """mask_mods of one kind (`mask_mod_kind`: one code over tables of the same shapes, the
        same scalars) share the cost model's kernel choice, as packed documents do: a mask_mod
        over per-call tables is a new description every call, and pricing it again took 17-46 ms
        at S = 8192 on the lent H100's host (benchmarks/user_mask_build.py, "first choose"). None
        (its own choice) where what it captures has no usable kind (unhashable, unreadable)."""
        try:
            group = "mask_mod", mask_mod_kind(self.fn)
            hash(group)
        except Exception:  # noqa: BLE001 (whatever a captured object raises: the choice stays the mask's own)
            return None
        return group

    def _dims(self, ext: Extent) -> tuple[int, int]:
        """Probe the function with b = arange(batch), h = arange(heads): a result that does
        not grow along a dim does not depend on it. Probed once per extent, on the device of
        what the function captures (the CPU if nothing), with index tensors kept per device: no
        copy to the GPU and back, no wait. (Not kept per `mask_mod_kind`: a bound method's object
        and a callable's attributes are not part of a kind, yet decide the dims.) Kept per replay
        signature (`replayed.signature`: no objects, every table's shape) once a graph replays it:
        its compiled form took the code whole, so the result's shape is its guards', and a
        mask_mod built per call skips the probe's launches (a dozen for BigBird's mask_mod, about a
        quarter of its per-call build on the lent H100's host)."""
        if ext not in self._probed:
            kind = replayed.signature(self.fn)
            if kind is not None and replayed.replays(kind) and (kind, ext) in _replayed_dims:
                self._probed[ext] = _replayed_dims[kind, ext]  # a mask_mod built per call: no probe
                return self._probed[ext]
            device = self.device if self.device is not None else torch.device("cpu")
            key = (device, ext.batch, ext.heads)
            if key not in _probes:
                keep(_probes, key, (torch.arange(ext.batch, device=device).view(-1, 1, 1, 1),
                                    torch.arange(ext.heads, device=device).view(1, -1, 1, 1),
                                    torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)), KEPT_PROBES)
            b, h, zero = _probes[key]
            shape = self._evaluate(ext, b, h, zero, zero).shape
            shape = (1,) * (4 - len(shape)) + tuple(shape)
            self._probed[ext] = shape[0], shape[1]
            if kind is not None:
                keep(_replayed_dims, (kind, ext), self._probed[ext], KEPT_PROBES)
        return self._probed[ext]

    def _evaluate_grid(self, grid: BlockGrid) -> tuple[Tensor, Tensor, tuple[Tensor, np.ndarray] | None] | None:
        """Compiled, in one call per chunk of block rows, once `compiled.grid` says it pays (a
        mask_mod built per call)."""
        batch, heads = self._dims(grid.ext)
        return compiled.grid(self.fn, self.name, self._evaluation_device(), grid.ext.seq_q, grid.ext.seq_k,
                             grid.block_m, grid.block_n, batch, heads)

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        """The kept bits where the extent names every b and h it is asked; the mask_mod itself for an open
        one (`mask_mod_for` with no batch or heads), since bits kept for slice 0 answered every b and h
        with it (FlexAttention's create_block_mask got b = 0's mask for every b, alone and, through
        `&`, `|`, `~` and regions, in combinations: found by reviews)."""
        bits = None if ext is None or ext.open else self.packed_bits(ext)
        if bits is None:
            return self._evaluate(ext, b, h, q, k)
        return bit_at(bits, (b * int(bits.shape[0] > 1), h * int(bits.shape[1] > 1), q), k).to(q.device)

    def _row_packer(self, ext: Extent, rows: int, batch: int, heads: int,
                    device: torch.device) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """Compiled (evaluation and packing in one kernel) where `compiled.packer` says it pays, with
        the eager packer for a chunk it could not run."""
        eager = super()._row_packer(ext, rows, batch, heads, device)
        fast = compiled.packer(self.fn, self.name, device, ext.seq_k, rows, batch, heads)
        if fast is None:
            return eager

        def pack(b: Tensor, h: Tensor, q: Tensor) -> Tensor:
            words = fast(b, h, q)
            return words if words is not None else eager(b, h, q)
        return pack

    def _evaluate(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        home = q.device
        if self.device is not None and self.device != home:
            b, h, q, k = (t.to(self.device) for t in (b, h, q, k))
        try:
            out = self.fn(b, h, q, k)
        except RuntimeError as exc:
            if "ambiguous" in str(exc):  # `if q >= k:` on many positions (a newcomer's: Python's error alone)
                raise MaskError(f"from_mask_mod: {self.name} branches in Python on a tensor ({exc}); write it with "
                                "tensor ops (torch.where, &, |), as FlexAttention's mask_mod is") from None
            if "same device" not in str(exc):
                raise
            raise MaskError(
                f"from_mask_mod: {self.name} mixes devices ({exc}); pass "
                "from_mask_mod(fn, device=...) naming the device of the tensors it captures"
            ) from None
        except IndexError as exc:  # a table shorter than the sequence (a newcomer's: Python's error alone)
            where = "" if ext is None else f" at {ext.seq_q} queries and {ext.seq_k} keys"
            raise MaskError(f"from_mask_mod: {self.name} indexed past a table it reads{where}: {exc}") from None
        if not isinstance(out, Tensor):
            raise MaskTypeError(
                f"from_mask_mod: {self.name} returned {type(out).__name__}, not a bool tensor"
                + (" (a Python branch on the indices, `if q >= k:`, answers one position: use tensor ops)"
                   if isinstance(out, bool) else "")
            )
        if out.dtype != torch.bool:
            raise MaskTypeError(
                f"from_mask_mod: {self.name} returned dtype {out.dtype}; it must return torch.bool "
                "(a comparison such as q >= k)"
            )
        index_shape = _broadcast(b.shape, h.shape, q.shape, k.shape)
        if index_shape is None or _broadcast(out.shape, index_shape) != index_shape:
            raise MaskError(
                f"from_mask_mod: {self.name} returned shape {tuple(out.shape)}, which does not "
                f"broadcast to the index shape {'of its arguments' if index_shape is None else index_shape}"
            )
        return out.to(home)

    def _evaluation_device(self) -> torch.device:
        """The device of the tensors the function captures; the CPU if it captures CPU tensors."""
        return self.device if self.device is not None else super()._evaluation_device()


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to (torch.broadcast_shapes' rule), or None where they do not
    broadcast. torch's own takes about 60 us a call on the lent H100's host (its symbolic-shape
    checks), and a mask_mod built per call is probed twice per build."""
    ndim = max(len(shape) for shape in shapes)
    out = [1] * ndim
    for shape in shapes:
        for axis, size in enumerate(shape, ndim - len(shape)):
            if size != 1:
                if out[axis] not in (1, size):
                    return None
                out[axis] = size
    return tuple(out)


def from_dense(mask: Tensor) -> MaskDescription:
    """A bool tensor [S_q, S_k] or [B|1, H|1, S_q, S_k] (True = attend) as a description."""
    if not isinstance(mask, Tensor):
        raise MaskTypeError(f"from_dense: mask must be a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise MaskTypeError(f"from_dense: mask must have dtype torch.bool, got {mask.dtype}"
                            + (" (an additive float mask is a bias: stof_cc.attention(..., bias=) adds it to the "
                               "scores)" if mask.is_floating_point() else ""))
    if mask.dim() not in (2, 4) or 0 in mask.shape:
        raise MaskError(
            f"from_dense: mask must have shape [S_q, S_k] or [B|1, H|1, S_q, S_k] with no empty "
            f"dim, got {tuple(mask.shape)}"
        )
    check_values("from_dense", "mask", mask)
    # a copy: a description does not change (the caller's tensor written later left kept bits stale
    # beside a live to_dense: found by review)
    return _Dense((mask if mask.dim() == 4 else mask[None, None]).to("cpu", copy=True).contiguous())


def from_mask_mod(
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    name: str | None = None,
    device: torch.device | str | None = None,
) -> MaskDescription:
    """A vectorised FlexAttention-style `fn(b, h, q, k) -> bool tensor` on broadcastable
    int64 index tensors. What it returns is checked (a bool tensor of the broadcast shape).
    Its batch/head dependence is read from how its result broadcasts over b and h; slices
    that come out equal are collapsed when the mask is built. ``fn`` runs on ``device``,
    by default the device of the tensors it captures (closure cells, defaults, globals it
    names), else wherever its index tensors are. It is evaluated once per extent on int32
    indices, as FlexAttention does (index arithmetic must stay within int32), and block masks,
    `to_dense` and combinations all read that evaluation (`_MaskMod`); a meta device is
    refused (its tensors hold no values)."""
    if not callable(fn):
        raise MaskTypeError(f"from_mask_mod: fn must be callable, got {fn!r}")
    if name is not None and not isinstance(name, str) or device is not None and not isinstance(device, str | int | torch.device):
        raise MaskTypeError(f"from_mask_mod(fn, name=None, device=None): got name={name!r}, device={device!r}; the "
                            "sizes come when the mask is used (FlexAttention's create_block_mask takes them here: "
                            "stof-cc reads them from q and k)")
    name = name or getattr(fn, "__name__", type(fn).__name__)
    _check_takes_four(fn, name)
    if device is None:
        device = captured_device(fn)
    if device is not None and torch.device(device).type == "meta":
        raise MaskError(f"from_mask_mod: {name} would run on the meta device (the tensors it captures, or "
                        "device=, are meta tensors, which hold no values); give it CPU or CUDA tensors")
    return _MaskMod(fn, name, None if device is None else torch.device(device))


def _check_takes_four(fn: Callable, name: str) -> None:
    """Refuse, when the mask is made, a function that cannot take (b, h, q_idx, kv_idx): it failed at
    its first evaluation, five frames deep, with Python's bare TypeError (a newcomer's ``lambda q, k``)."""
    try:
        inspect.signature(fn).bind(0, 0, 0, 0)
    except TypeError as why:
        raise MaskTypeError(f"from_mask_mod: {name} must take (b, h, q_idx, kv_idx), as FlexAttention's "
                            f"mask_mod does: {why}") from None
    except ValueError:  # no signature to read (some builtins): its first evaluation says
        pass


def captured_device(fn: Callable) -> torch.device | None:
    """The device of the tensors ``fn`` captures (through its closure, default arguments, the
    globals it names, and for a functools.partial its bound arguments): the one GPU they are
    on, the CPU when all are CPU tensors, None when it captures none or several GPUs; meta
    when any is a meta tensor."""
    _, seen = _captures(fn)
    devices = {t.device for t in seen if isinstance(t, Tensor)}
    if torch.device("meta") in devices:  # no values to evaluate with: `from_mask_mod` says so
        return torch.device("meta")
    gpus = devices - {torch.device("cpu")}
    if len(gpus) == 1:
        return gpus.pop()
    return torch.device("cpu") if devices == {torch.device("cpu")} else None


def _captures(fn: Callable) -> tuple[Callable, list[object]]:
    """``fn`` without its functools.partial layers, and what it captures: its closure, default
    arguments, the globals it names, and a partial's bound arguments."""
    seen: list[object] = []
    while isinstance(fn, functools.partial):
        seen += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is not None:
        seen += [_cell_value(c) for c in fn.__closure__ or ()]
        seen += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        seen += [fn.__globals__[n] for n in code.co_names if n in fn.__globals__]
    return fn, seen


def mask_mod_kind(fn: Callable, depth: int = 2) -> object:
    """What a mask_mod is apart from the contents of its tables: its code, and per captured value
    a tensor's shape, dtype and device, a scalar's value, a short tuple's or list's items and a
    captured function's own kind (two levels deep). Closures of one code over new tables of the same shapes (a packed batch's
    document ids, per-request lengths) are one kind; a different window (a captured int) is not."""
    fn, seen = _captures(fn)
    return getattr(fn, "__code__", type(fn)), tuple(_value_kind(value, depth) for value in seen)


def _value_kind(value: object, depth: int) -> object:
    if isinstance(value, Tensor):
        return "tensor", tuple(value.shape), value.dtype, value.device
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list) and len(value) <= KIND_ITEMS and depth:
        return tuple(_value_kind(item, depth - 1) for item in value)
    if callable(value) and not isinstance(value, type):
        return mask_mod_kind(value, depth - 1) if depth else getattr(value, "__code__", type(value))
    return type(value)


def _cell_value(cell: object) -> object:
    try:
        return cell.cell_contents  # type: ignore[attr-defined]
    except ValueError:  # an empty cell: a name the function's scope assigns later
        return None



def from_padding(padding: Tensor, seq_q: int | None = None) -> MaskDescription:
    """The mask of an ``attention_mask``-style tensor [B, S_k] (nonzero = a real token), for any
    number of queries: `key_padding` with per-row lengths when every row is ones then zeros (the
    usual right padding), else a mask_mod over the keys kept (dims [B, 1]); either fits the padding's
    own batch and key count only (a clear MaskError for another). ``seq_q`` is not
    needed; it is accepted for calls written when the second form was a dense [B, 1, seq_q, S_k]
    mask fixed to that many queries."""
    if not isinstance(padding, Tensor) or padding.dim() != 2 or 0 in padding.shape:
        raise MaskTypeError(f"from_padding: padding must be a [batch, keys] tensor with a row and a key at least, "
                            f"got {getattr(padding, 'shape', padding)}")
    check_values("from_padding", "padding", padding)
    keep = (padding != 0).cpu()
    lengths = keep.sum(1)
    prefix = torch.arange(keep.shape[1])[None, :] < lengths[:, None]
    if torch.equal(keep, prefix):
        return right_padding(lengths.tolist(), keep.shape[1])
    return _KeptKeys(keep)


class _KeptKeys(_MaskMod):
    """`from_padding`'s mask for padding that is not ones then zeros: the keys kept per batch
    element [B, S_k], for any number of queries. It fixes its batch (dims [B, 1]) and its keys, as
    the right-padding form does: as a bare mask_mod it fixed neither, dropped every batch row but the
    first when no batch was given, and indexed past its table with another batch or seq_k (found by
    review); one row applied to any batch while the right-padding form refused (found by review)."""

    def __init__(self, keep: Tensor) -> None:  # evaluated where its table is (a GPU's indices into the CPU
        super().__init__(lambda b, h, q, k: keep[b, k], "padding", keep.device)  # table raised: found by review)
        self.keep = keep

    def _fixed(self) -> tuple[int | None, int | None]:
        return self.keep.shape[0], None

    def _dims(self, ext: Extent) -> tuple[int, int]:
        batch, keys = self.keep.shape
        if ext.seq_k != keys:
            raise MaskError(f"from_padding: the padding covers {keys} keys, but seq_k={ext.seq_k}")
        if batch != ext.batch:
            raise MaskError(f"from_padding: the padding has {batch} batch rows, but batch={ext.batch}")
        return batch, 1
