"""Pictures of masks: a minimal PNG encoder (stdlib zlib + struct, no imaging library) and
the side-by-side picture `stof-cc masks show` writes: the mask on the left (one pixel per
element where it fits, shaded by density where downsampled), its block map on the right."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch

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
    panel at most max_px on a side (f x f elements per pixel, f = ceil(S / max_px))."""
    max_px = check_int("render", "max_px", max_px)
    f = max(1, -(-max(mask.seq_q, mask.seq_k) // max_px))
    rows, cols = -(-mask.seq_q // f), -(-mask.seq_k // f)
    padded = torch.zeros(rows * f, cols * f)
    padded[: mask.seq_q, : mask.seq_k] = mask.dense_slice(b, h).float()
    in_range = torch.zeros_like(padded)
    in_range[: mask.seq_q, : mask.seq_k] = 1
    count = padded.view(rows, f, cols, f).sum((1, 3))
    density = count / in_range.view(rows, f, cols, f).sum((1, 3))
    paper, ink = torch.tensor(PAPER, dtype=torch.float), torch.tensor(INK, dtype=torch.float)
    left = paper + (ink - paper) * density[..., None]

    y = torch.arange(rows) * f  # first element under each pixel
    x = torch.arange(cols) * f
    classes = mask.block_classes()[b, h][y // mask.block_m][:, x // mask.block_n].long()
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
