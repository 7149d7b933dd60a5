"""Pictures of masks: a minimal PNG encoder (stdlib zlib + struct, no imaging library) and
the side-by-side picture `stof-cc masks show` writes: the mask on the left (one pixel per
element where it fits, shaded by density where downsampled), its block map on the right."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from stof_cc.masks.bits import unpack
from stof_cc.masks.block_mask import BlockMask
from stof_cc.masks.errors import check_int
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL

PAPER = (255, 255, 255)  # masked element
INK = (31, 78, 140)  # attended element
BLOCK_COLOURS = {EMPTY: (232, 232, 232), PARTIAL: (240, 150, 40), FULL: (40, 125, 75)}
GAP = 16  # pixels between the two panels
_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def encode_png(rgb: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of a uint8 array [height, width, 3]."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
        raise ValueError(
            f"encode_png: need a non-empty uint8 array [H, W, 3], got {rgb.dtype} {rgb.shape}"
        )
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit truecolour
    return (
        _SIGNATURE
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def write_png(path: str | Path, rgb: np.ndarray) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_png(rgb))
    return path


def render(mask: BlockMask, b: int = 0, h: int = 0, max_px: int = 1024) -> np.ndarray:
    """uint8 [rows, 2 * cols + GAP, 3]: slice (b, h) of the mask beside its block map, each
    panel at most max_px on a side (f x f elements per pixel, f = ceil(S / max_px)).

    Drawn from the block lists, never from a dense seq_q x seq_k tensor: memory is the
    picture plus a chunk of partial tiles, whatever the sequence length."""
    max_px = check_int("render", "max_px", max_px)
    b = check_int("render", "b", b, 0, mask.batch - 1)
    h = check_int("render", "h", h, 0, mask.heads - 1)
    f = max(1, -(-max(mask.seq_q, mask.seq_k) // max_px))
    rows, cols = -(-mask.seq_q // f), -(-mask.seq_k // f)
    full, part, bits = _slice_blocks(mask, b * mask.heads + h)

    count = torch.zeros(rows * cols, dtype=torch.float64)
    _add_full_blocks(count, mask, full, f, cols)
    _add_partial_blocks(count, mask, part, bits, f, cols)
    pixel_h = (torch.arange(1, rows + 1) * f).clamp(max=mask.seq_q) - torch.arange(rows) * f
    pixel_w = (torch.arange(1, cols + 1) * f).clamp(max=mask.seq_k) - torch.arange(cols) * f
    density = (count.view(rows, cols) / (pixel_h[:, None] * pixel_w[None, :])).float()
    paper, ink = torch.tensor(PAPER, dtype=torch.float), torch.tensor(INK, dtype=torch.float)
    left = paper + (ink - paper) * density[..., None]

    y = torch.arange(rows) * f  # first element under each pixel
    x = torch.arange(cols) * f
    classes = _classes_at(mask, full, part, y // mask.block_m, x // mask.block_n)
    palette = torch.zeros(3, 3)
    for code, colour in BLOCK_COLOURS.items():
        palette[code] = torch.tensor(colour, dtype=torch.float)
    right = palette[classes]
    if min(mask.block_m, mask.block_n) >= 4 * f:  # blocks are big enough to outline
        edge = ((y % mask.block_m) < f)[:, None] | ((x % mask.block_n) < f)[None, :]
        right[edge] *= 0.8

    canvas = torch.full((rows, 2 * cols + GAP, 3), 255.0)
    canvas[:, :cols] = left
    canvas[:, cols + GAP :] = right
    return canvas.round().clamp(0, 255).to(torch.uint8).numpy()


def _slice_blocks(
    mask: BlockMask, index: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(rows, cols) of the FULL and of the PARTIAL blocks of slice ``index``, and the
    partial blocks' tiles: read off the CSR lists of that slice's block rows alone."""
    first, last = index * mask.n_rb, (index + 1) * mask.n_rb

    def entries(ptr: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, slice]:
        ptr = ptr[first : last + 1].cpu().long()
        span = slice(int(ptr[0]), int(ptr[-1]))
        rows = torch.repeat_interleave(torch.arange(mask.n_rb), ptr[1:] - ptr[:-1])
        return rows, cols[span].cpu().long(), span

    full_rows, full_cols, _ = entries(mask.full_ptr, mask.full_cols)
    part_rows, part_cols, span = entries(mask.part_ptr, mask.part_cols)
    return (full_rows, full_cols), (part_rows, part_cols), mask.part_bits[span].cpu()


def _add_full_blocks(count: torch.Tensor, mask: BlockMask, blocks: tuple[torch.Tensor, torch.Tensor],
                     f: int, cols: int) -> None:
    """Add each FULL block's in-range elements to the pixels it overlaps (exact: a full block
    is uniform, so a pixel gets the area of its overlap with the block)."""
    i, j = blocks

    def overlaps(index: torch.Tensor, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = index * size
        hi = ((index + 1) * size).clamp(max=seq)
        pixel = (lo // f)[:, None] + torch.arange(-(-size // f) + 1)[None, :]
        length = (torch.minimum(hi[:, None], (pixel + 1) * f) - torch.maximum(lo[:, None], pixel * f)).clamp(min=0)
        return pixel, length

    for start in range(0, len(i), 4096):
        py, ly = overlaps(i[start : start + 4096], mask.block_m, mask.seq_q)
        px, lx = overlaps(j[start : start + 4096], mask.block_n, mask.seq_k)
        area = (ly[:, :, None] * lx[:, None, :]).double()
        keep = area > 0
        count.index_add_(0, (py[:, :, None] * cols + px[:, None, :])[keep], area[keep])


def _add_partial_blocks(count: torch.Tensor, mask: BlockMask, blocks: tuple[torch.Tensor, torch.Tensor],
                        bits: torch.Tensor, f: int, cols: int) -> None:
    """Add each PARTIAL tile's attended elements to their pixels, a chunk of tiles at a time."""
    i, j = blocks
    r = torch.arange(mask.block_m)
    c = torch.arange(mask.block_n)
    per_chunk = max(1, (1 << 22) // (mask.block_m * mask.block_n))
    for start in range(0, len(i), per_chunk):
        chunk = slice(start, start + per_chunk)
        tiles = unpack(bits[chunk], mask.block_m, mask.block_n)  # out-of-range bits are 0
        py = ((i[chunk, None] * mask.block_m + r) // f).clamp(max=count.numel() // cols - 1)
        px = ((j[chunk, None] * mask.block_n + c) // f).clamp(max=cols - 1)
        pixel = py[:, :, None] * cols + px[:, None, :]
        count.index_add_(0, pixel[tiles], torch.ones(int(tiles.sum()), dtype=torch.float64))


def _classes_at(mask: BlockMask, full: tuple[torch.Tensor, torch.Tensor], part: tuple[torch.Tensor, torch.Tensor],
                block_row: torch.Tensor, block_col: torch.Tensor) -> torch.Tensor:
    """int64 [len(block_row), len(block_col)]: the class of block (block_row[y], block_col[x])."""
    keys = torch.cat([full[0] * mask.n_cb + full[1], part[0] * mask.n_cb + part[1]])
    codes = torch.cat([torch.full((len(full[0]),), FULL), torch.full((len(part[0]),), PARTIAL)])
    order = keys.argsort()
    keys, codes = keys[order], codes[order]
    wanted = block_row[:, None] * mask.n_cb + block_col[None, :]
    at = torch.searchsorted(keys, wanted).clamp(max=max(len(keys) - 1, 0))
    if not len(keys):
        return torch.full(wanted.shape, EMPTY, dtype=torch.long)
    return torch.where(keys[at] == wanted, codes[at], torch.full_like(wanted, EMPTY)).long()
