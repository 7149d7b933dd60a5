"""Masks the user brings: a dense boolean tensor, or a FlexAttention-style mask_mod function.

Neither has structure to classify blocks analytically: a dense mask is classified by
counting each block's True elements, a mask_mod has every block evaluated (in chunks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from stof_cc.masks.description import MaskDescription, MaskMod
from stof_cc.masks.errors import MaskError, MaskTypeError
from stof_cc.masks.geometry import PARTIAL, BlockGrid, Extent, classes_from
from stof_cc.masks.zoo import key_padding


class _Dense(MaskDescription):
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

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        mask = self._on("mask", q.device, lambda: self.mask)
        batch, heads = mask.shape[:2]
        return mask[b.clamp(max=batch - 1), h.clamp(max=heads - 1), q, k]

    def _classify(self, grid: BlockGrid) -> Tensor:
        batch, heads, seq_q, seq_k = self.mask.shape
        bm, bn = grid.block_m, grid.block_n
        padded = self.mask.new_zeros(batch, heads, grid.n_rb * bm, grid.n_cb * bn)
        padded[:, :, :seq_q, :seq_k] = self.mask
        counts = padded.view(batch, heads, grid.n_rb, bm, grid.n_cb, bn).sum((3, 5))
        area = (grid.q_hi - grid.q_lo + 1) * (grid.k_hi - grid.k_lo + 1)
        return classes_from(counts == area, counts == 0)


class _MaskMod(MaskDescription):
    """A user mask_mod, evaluated on every block and checked on every call. It runs on the
    device of the tensors it captures (FlexAttention users index CUDA tables in their
    mask_mods): index tensors go there and the result comes back to the caller's device."""

    def __init__(self, fn: MaskMod, name: str, device: torch.device | None) -> None:
        super().__init__()
        self.fn, self.name, self.device = fn, name, device

    def __repr__(self) -> str:
        return f"from_mask_mod({self.name})"

    def _dims(self, ext: Extent) -> tuple[int, int]:
        """Probe the function with b = arange(batch), h = arange(heads): a result that does
        not grow along a dim does not depend on it."""
        b = torch.arange(ext.batch).view(-1, 1, 1, 1)
        h = torch.arange(ext.heads).view(1, -1, 1, 1)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        shape = self._eval(ext, b, h, zero, zero).shape
        shape = (1,) * (4 - len(shape)) + tuple(shape)
        return shape[0], shape[1]

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        home = q.device
        if self.device is not None and self.device != home:
            b, h, q, k = (t.to(self.device) for t in (b, h, q, k))
        try:
            out = self.fn(b, h, q, k)
        except RuntimeError as exc:
            if "same device" not in str(exc):
                raise
            raise MaskError(
                f"from_mask_mod: {self.name} mixes devices ({exc}); pass "
                "from_mask_mod(fn, device=...) naming the device of the tensors it captures"
            ) from None
        if not isinstance(out, Tensor):
            raise MaskTypeError(
                f"from_mask_mod: {self.name} returned {type(out).__name__}, not a bool tensor"
            )
        if out.dtype != torch.bool:
            raise MaskTypeError(
                f"from_mask_mod: {self.name} returned dtype {out.dtype}; it must return torch.bool "
                "(a comparison such as q >= k)"
            )
        index_shape = torch.broadcast_shapes(b.shape, h.shape, q.shape, k.shape)
        try:
            ok = torch.broadcast_shapes(out.shape, index_shape) == index_shape
        except RuntimeError:
            ok = False
        if not ok:
            raise MaskError(
                f"from_mask_mod: {self.name} returned shape {tuple(out.shape)}, which does not "
                f"broadcast to the index shape {tuple(index_shape)}"
            )
        return out.to(home)

    def _classify(self, grid: BlockGrid) -> Tensor:
        return torch.full((1, 1, grid.n_rb, grid.n_cb), PARTIAL, dtype=torch.int8)


def from_dense(mask: Tensor) -> MaskDescription:
    """A bool tensor [S_q, S_k] or [B|1, H|1, S_q, S_k] (True = attend) as a description."""
    if not isinstance(mask, Tensor):
        raise MaskTypeError(f"from_dense: mask must be a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise MaskTypeError(f"from_dense: mask must have dtype torch.bool, got {mask.dtype}")
    if mask.dim() not in (2, 4) or 0 in mask.shape:
        raise MaskError(
            f"from_dense: mask must have shape [S_q, S_k] or [B|1, H|1, S_q, S_k] with no empty "
            f"dim, got {tuple(mask.shape)}"
        )
    return _Dense((mask if mask.dim() == 4 else mask[None, None]).cpu().contiguous())


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
    names), else wherever its index tensors are."""
    if not callable(fn):
        raise MaskTypeError(f"from_mask_mod: fn must be callable, got {fn!r}")
    if device is None:
        device = captured_device(fn)
    return _MaskMod(fn, name or getattr(fn, "__name__", type(fn).__name__),
                    None if device is None else torch.device(device))


def captured_device(fn: Callable) -> torch.device | None:
    """The device of the tensors ``fn`` captures, if they are on one device other than the
    CPU: through its closure, default arguments, the globals it names, and (for a
    functools.partial) its bound arguments."""
    seen = []
    while isinstance(fn, functools.partial):
        seen += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is not None:
        seen += [_cell_value(c) for c in fn.__closure__ or ()]
        seen += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        seen += [fn.__globals__[n] for n in code.co_names if n in fn.__globals__]
    devices = {t.device for t in seen if isinstance(t, Tensor) and t.device.type != "cpu"}
    return devices.pop() if len(devices) == 1 else None


def _cell_value(cell: object) -> object:
    try:
        return cell.cell_contents  # type: ignore[attr-defined]
    except ValueError:  # an empty cell: a name the function's scope assigns later
        return None



def from_padding(padding: Tensor, seq_q: int) -> MaskDescription:
    """The mask of an ``attention_mask``-style tensor [B, S_k] (nonzero = a real token):
    `key_padding` with per-row lengths when every row is ones then zeros (the usual right
    padding), else the dense [B, 1, seq_q, S_k] mask."""
    if not isinstance(padding, Tensor) or padding.dim() != 2:
        raise MaskTypeError(f"from_padding: padding must be a [batch, keys] tensor, got {getattr(padding, 'shape', padding)}")
    keep = (padding != 0).cpu()
    lengths = keep.sum(1)
    prefix = torch.arange(keep.shape[1])[None, :] < lengths[:, None]
    if torch.equal(keep, prefix):
        return key_padding(lengths.tolist())
    return from_dense(keep[:, None, None, :].expand(keep.shape[0], 1, seq_q, keep.shape[1]).contiguous())
