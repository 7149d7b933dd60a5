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
from stof_cc.masks.errors import MaskError, check_int
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL
from stof_cc.masks.runs import ClassRuns, spread

PAPER = (255, 255, 255)  # masked element
INK = (31, 78, 140)  # attended element
BLOCK_COLOURS = {EMPTY: (232, 232, 232), PARTIAL: (240, 150, 40), FULL: (40, 125, 75)}
GAP = 16  # pixels between the two panels
MAX_PX = 8192  # the largest panel side: the canvas is built in floats, 12 bytes a pixel
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

    Drawn from the block map as runs and the partial tiles, never from a dense seq_q x seq_k
    tensor nor a class per block: a FULL run is one rectangle however long, so the work is the
    picture, the runs and the partial tiles, whatever the sequence length."""
    if mask.row_origins is not None:
        raise MaskError("render: this block mask's rows start where documents start (row_origins); render the "
                        "description's own block mask (description.block_mask(seq_q, seq_k, block_m, block_n))")
    max_px = check_int("render", "max_px", max_px, limit=(MAX_PX, "a panel side in pixels"))
    b = check_int("render", "b", b, 0, mask.batch - 1)
    h = check_int("render", "h", h, 0, mask.heads - 1)
    f = max(1, -(-max(mask.seq_q, mask.seq_k) // max_px))
    rows, cols = -(-mask.seq_q // f), -(-mask.seq_k // f)
    index = b * mask.heads + h
    runs = mask.block_runs().take_rows(index * mask.n_rb + torch.arange(mask.n_rb), 1, 1, mask.n_rb)

    count = torch.zeros(rows, cols, dtype=torch.float64)
    _add_full_runs(count, mask, runs, f)
    _add_partial_blocks(count, mask, *_partial_tiles(mask, index), f)
    pixel_h = (torch.arange(1, rows + 1) * f).clamp(max=mask.seq_q) - torch.arange(rows) * f
    pixel_w = (torch.arange(1, cols + 1) * f).clamp(max=mask.seq_k) - torch.arange(cols) * f
    density = (count / (pixel_h[:, None] * pixel_w[None, :])).float()
    paper, ink = torch.tensor(PAPER, dtype=torch.float), torch.tensor(INK, dtype=torch.float)
    left = paper + (ink - paper) * density[..., None]

    y = torch.arange(rows) * f  # first element under each pixel
    x = torch.arange(cols) * f
    zero = torch.zeros((), dtype=torch.long)
    classes = runs.at(zero, zero, (y // mask.block_m)[:, None], (x // mask.block_n)[None, :]).long()
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


def _partial_tiles(mask: BlockMask, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block rows, block columns, tiles) of the PARTIAL blocks of slice ``index``: read off the
    CSR list of that slice's block rows alone."""
    ptr = mask.part_ptr[index * mask.n_rb : (index + 1) * mask.n_rb + 1].cpu().long()
    span = slice(int(ptr[0]), int(ptr[-1]))
    rows = torch.repeat_interleave(torch.arange(mask.n_rb), ptr[1:] - ptr[:-1])
    return rows, mask.part_cols[span].cpu().long(), mask.part_bits[span].cpu()


def _add_full_runs(count: torch.Tensor, mask: BlockMask, runs: ClassRuns, f: int) -> None:
    """Add each FULL run's in-range elements to the pixels it overlaps (exact: a FULL run is a
    uniform rectangle, so a pixel gets the area of its overlap). Per pixel row a rectangle
    covers, its columns go in as a difference (the pixels it spans whole get f each, summed
    along the row afterwards) plus the two end pixels' shortfall."""
    row, start, stop, code = runs.intervals()
    full = code == FULL
    y0 = row[full] * mask.block_m
    y1 = (y0 + mask.block_m).clamp(max=mask.seq_q)
    x0 = start[full] * mask.block_n
    x1 = (stop[full] * mask.block_n).clamp(max=mask.seq_k)
    owner, offset = spread((y1 - 1) // f - y0 // f + 1)  # the pixel rows of each rectangle
    py = y0[owner] // f + offset
    height = (torch.minimum(y1[owner], (py + 1) * f) - torch.maximum(y0[owner], py * f)).double()
    x0, x1 = x0[owner], x1[owner]
    first, last = x0 // f, (x1 - 1) // f
    spans = torch.zeros(count.shape[0], count.shape[1] + 1, dtype=torch.float64)
    spans.index_put_((py, first), height * f, accumulate=True)
    spans.index_put_((py, last + 1), -height * f, accumulate=True)
    count += spans.cumsum(1)[:, :-1]
    count.index_put_((py, first), height * (torch.minimum(x1, (first + 1) * f) - x0 - f), accumulate=True)
    count.index_put_((py, last), torch.where(last > first, height * (x1 - last * f - f), 0.0), accumulate=True)


def _add_partial_blocks(count: torch.Tensor, mask: BlockMask, i: torch.Tensor, j: torch.Tensor,
                        bits: torch.Tensor, f: int) -> None:
    """Add each PARTIAL tile's attended elements to their pixels, a chunk of tiles at a time."""
    rows, cols = count.shape
    r = torch.arange(mask.block_m)
    c = torch.arange(mask.block_n)
    per_chunk = max(1, (1 << 22) // (mask.block_m * mask.block_n))
    flat = count.view(-1)
    for start in range(0, len(i), per_chunk):
        chunk = slice(start, start + per_chunk)
        tiles = unpack(bits[chunk], mask.block_m, mask.block_n)  # out-of-range bits are 0
        py = ((i[chunk, None] * mask.block_m + r) // f).clamp(max=rows - 1)
        px = ((j[chunk, None] * mask.block_n + c) // f).clamp(max=cols - 1)
        pixel = py[:, :, None] * cols + px[:, None, :]
        flat.index_add_(0, pixel[tiles], torch.ones(int(tiles.sum()), dtype=torch.float64))
