"""Text specs, the workload helpers, the PNG writer and `stof-cc masks show | list`."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from stof_cc import masks
from stof_cc.masks.cli import main
from stof_cc.masks.picture import BLOCK_COLOURS, GAP, INK, PAPER, encode_png, render, write_png
from stof_cc.masks.spec import PATTERNS, parse_spec
from stof_cc.masks.workloads import GRID_MASKS, grid_batch, grid_mask, grid_window

ROOT = Path(__file__).resolve().parent.parent

SPECS = [
    ("causal", masks.causal()),
    ("full", masks.full()),
    ("sliding:w=256", masks.sliding_window(256)),
    ("sliding:w=20,causal=1", masks.sliding_window(20, causal=True)),
    ("dilated:w=64,d=4", masks.dilated(64, 4)),
    ("strided:stride=128", masks.strided(128)),
    ("fixed:stride=64,c=8", masks.fixed(64, 8)),
    ("longformer:w=128,g=32", masks.longformer(128, 32)),
    ("bigbird:w=64,g=32,r=3,block=64,seed=0", masks.bigbird(64, 32, 3, block=64, seed=0)),
    ("bigbird: w = 64 , g=32, r=3, seed=4", masks.bigbird(64, 32, 3, seed=4)),
    ("document:lengths=512+512+1024", masks.document([512, 512, 1024])),
    ("key_padding:lengths=700+2048", masks.key_padding([700, 2048])),
    ("causal&sliding:w=100", masks.causal() & masks.sliding_window(100)),
    ("strided:stride=64|~causal", masks.strided(64) | ~masks.causal()),
    ("(causal|sliding:w=64)&~dilated:w=8,d=4",
     (masks.causal() | masks.sliding_window(64)) & ~masks.dilated(8, 4)),
    ("~(causal & sliding:w=16) | full & ((causal))",
     ~(masks.causal() & masks.sliding_window(16)) | (masks.full() & masks.causal())),
]


@pytest.mark.parametrize("spec, desc", SPECS, ids=[s for s, _ in SPECS])
def test_specs_build_the_named_mask(spec, desc):
    assert torch.equal(parse_spec(spec, seq=2048).to_dense(2048), desc.to_dense(2048))


@pytest.mark.parametrize("name", GRID_MASKS)
def test_grid_specs(name):
    assert torch.equal(
        parse_spec(f"grid:{name}", seq=1024).to_dense(1024), grid_mask(name, 1024).to_dense(1024)
    )


def test_workload_helpers():
    assert [grid_batch(s) for s in (128, 256, 512, 1024, 2048, 8192)] == [8, 8, 8, 4, 2, 1]
    assert [grid_window(s) for s in (128, 1024, 2048, 8192)] == [64, 64, 128, 512]


BAD_SPECS = [
    ("", "spec must be a non-empty string"),
    ("banded:w=3", r"unknown mask 'banded'; valid: full, causal, sliding, .*grid"),
    ("sliding:x=3", r"sliding has no key 'x'; valid keys: w, causal"),
    ("sliding:w=abc", "w=abc is not an int"),
    ("sliding:w=", r"w needs a value \(w=INT\)"),
    ("sliding:causal=1", r"sliding needs w \(syntax: sliding:w=INT,\[causal=0\|1\]\)"),
    ("sliding:w=4,w=5", "w is given twice"),
    ("sliding:w=4,causal=maybe", r"causal=maybe is not 0 or 1 \(or true / false\)"),
    ("sliding:w=0", "sliding_window: w must be a positive int, got 0"),
    ("document:lengths=3+x", r"lengths=3\+x is not ints joined by \+"),
    ("causal:w=3", "causal has no key 'w'; valid keys: none"),
    ("grid:causal", "grid masks depend on the sequence length; pass seq"),
    ("(causal|sliding:w=4", r"a '\(' without its '\)'"),
    ("causal)&full", r"a '\)' without its '\('"),
    ("causal~full", r"'~' follows a term with no '\|' or '&' between them"),  # was reported as a ')'
    ("full(causal)", r"'\(' follows a term with no '\|' or '&'"),
    ("()", "an empty term"),
    ("causal&&full", "an empty term"),
    (":w=3", "an empty term"),
    # the separators a newcomer gets wrong, each named (found by a newcomer's read)
    ("key_padding:lengths=700,2048", r"has no key '2048'; valid keys: lengths \(a list is joined by '\+'"),
    ("longformer:w=128;g=32", r"w=128;g=32 is not an int \(keys are separated by ','"),
]


@pytest.mark.parametrize("spec, message", BAD_SPECS)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(masks.MaskError, match=message):
        parse_spec(spec)


def test_bad_grid_name():
    with pytest.raises(masks.MaskError, match="unknown grid mask 'banded'; valid: causal, sliding"):
        parse_spec("grid:banded", seq=128)


def _read_png(data: bytes) -> tuple[int, int, np.ndarray]:
    """Decode our own PNG output (8-bit RGB, filter 0) with nothing but zlib and struct."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind!r}"
        chunks[kind] = body
        pos += 12 + length
    assert list(chunks) == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour) == (8, 2)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()
    return width, height, rows[:, 1:].reshape(height, width, 3)


def test_png_writer_round_trips(tmp_path):
    image = np.random.default_rng(0).integers(0, 256, (7, 13, 3), dtype=np.uint8)
    path = write_png(tmp_path / "sub" / "x.png", image)
    width, height, pixels = _read_png(path.read_bytes())
    assert (width, height) == (13, 7)
    assert (pixels == image).all()
    with pytest.raises(ValueError, match="uint8 array"):
        encode_png(image.astype(np.float32))


def test_render_pixels_match_mask_and_block_map():
    bm = masks.causal().block_mask(100, block_m=32, block_n=32)  # one pixel per element
    image = render(bm)
    assert image.shape == (100, 2 * 100 + GAP, 3)
    assert tuple(image[10, 5]) == INK and tuple(image[5, 10]) == PAPER
    right = image[:, 100 + GAP :]
    assert tuple(right[40, 0]) == tuple(round(c * 0.8) for c in BLOCK_COLOURS[masks.FULL])  # edge
    assert tuple(right[40, 10]) == BLOCK_COLOURS[masks.FULL]
    assert tuple(right[10, 40]) == BLOCK_COLOURS[masks.EMPTY]
    assert tuple(right[50, 50]) == BLOCK_COLOURS[masks.PARTIAL]
    small = render(masks.causal().block_mask(4096), max_px=256)  # downsampled: 16 x 16 per pixel
    assert small.shape == (256, 2 * 256 + GAP, 3)


def test_show_writes_png_and_prints_statistics(tmp_path, capsys):
    out = tmp_path / "longformer.png"
    assert (
        main(
            [
                "show",
                "longformer:w=128,g=32",
                "--seq",
                "2048",
                "--block",
                "64x128",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "longformer(w=128, global_tokens=32)" in printed and "block 64x128" in printed
    assert f"wrote     {out}" in printed
    width, height, _ = _read_png(out.read_bytes())
    assert (width, height) == (2 * 1024 + GAP, 1024)


def test_show_writes_under_the_build_folder_by_default(tmp_path, monkeypatch, capsys):
    """The README's `stof-cc masks show SPEC --seq N` wrote its PNG into the current directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["show", "longformer:w=128,g=32", "--seq", "256"]) == 0
    expected = Path("stof_build", "masks", "mask-longformer-w-128-g-32-256.png")
    assert f"wrote     {expected} " in capsys.readouterr().out
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()] == [expected]
    assert main(["show", "causal", "--seq", "64", "--build-dir", "elsewhere"]) == 0
    assert (tmp_path / "elsewhere" / "masks" / "mask-causal-64.png").is_file()


def test_show_reports_bad_specs(capsys):
    assert main(["show", "sliding:w=-1", "--seq", "64"]) == 2
    assert "sliding_window: w must be a positive int, got -1" in capsys.readouterr().err


def test_list_names_every_pattern(capsys):
    assert main(["list"]) == 0
    printed = capsys.readouterr().out
    for pattern in PATTERNS.values():
        assert pattern.syntax() in printed
    assert "grid:causal|sliding|dilated|longformer|bigbird|document" in printed


def test_module_entry_point(tmp_path):
    out = tmp_path / "mask.png"
    command = ["show", "grid:bigbird", "--seq", "512", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "stof_cc.masks.cli", *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _dense_render_left(dense: torch.Tensor, max_px: int) -> np.ndarray:
    """The mask panel drawn the obvious way, from a dense [S_q, S_k] tensor: the reference."""
    seq_q, seq_k = dense.shape
    f = max(1, -(-max(seq_q, seq_k) // max_px))
    rows, cols = -(-seq_q // f), -(-seq_k // f)
    padded = torch.zeros(rows * f, cols * f)
    padded[:seq_q, :seq_k] = dense.float()
    inside = torch.zeros_like(padded)
    inside[:seq_q, :seq_k] = 1
    density = padded.view(rows, f, cols, f).sum((1, 3)) / inside.view(rows, f, cols, f).sum((1, 3))
    paper, ink = torch.tensor(PAPER, dtype=torch.float), torch.tensor(INK, dtype=torch.float)
    return (paper + (ink - paper) * density[..., None]).round().to(torch.uint8).numpy()


@pytest.mark.parametrize(("desc", "seq_q", "seq_k", "block", "max_px"), [
    (masks.longformer(128, 32), 2048, 2048, (64, 64), 1024),
    (masks.bigbird(64, 32, 2), 2000, 2000, (128, 64), 300),
    (masks.causal(), 1000, 700, (16, 16), 1024),
    (masks.sliding_window(37), 777, 777, (64, 128), 100),
    (masks.dilated(64, 2) | masks.key_padding([1000, 3]), 1500, 1100, (64, 64), 256),
])
def test_render_from_the_block_lists_equals_the_dense_drawing(desc, seq_q, seq_k, block, max_px, monkeypatch):
    bm = desc.block_mask(seq_q, seq_k, *block, batch=2 if "key_padding" in repr(desc) else None)
    want = _dense_render_left(bm.dense_slice(bm.batch - 1, 0), max_px)
    monkeypatch.setattr(masks.BlockMask, "dense_slice", None)  # the picture never densifies
    monkeypatch.setattr(masks.BlockMask, "block_classes", None)
    image = render(bm, b=bm.batch - 1, max_px=max_px)
    assert np.array_equal(image[:, : want.shape[1]], want)


def test_show_draws_a_long_sequence_from_its_block_map(tmp_path, monkeypatch):
    """S = 200000 would be 40 GB as a dense mask; the picture reads the block lists only."""
    monkeypatch.setattr(masks.BlockMask, "dense_slice", None)
    monkeypatch.setattr(masks.BlockMask, "block_classes", None)
    assert main(["show", "sliding:w=8", "--seq", "200000", "--max-px", "1000", "--out", str(tmp_path / "m.png")]) == 0
    width, height, pixels = _read_png((tmp_path / "m.png").read_bytes())
    assert (width, height) == (2 * 1000 + GAP, 1000)  # 200 elements per pixel
    assert tuple(pixels[500, 500]) != PAPER and tuple(pixels[500, 10]) == PAPER  # the band, nothing off it


def test_show_gives_different_masks_different_default_files_and_reports_unwritable_ones(tmp_path, monkeypatch,
                                                                                      capsys):
    """causal|~causal, causal&~causal and causal&causal shared one file (the operators were dropped),
    --seq-k was not in the name, a long spec made a name too long to write, and --out naming a
    folder gave a traceback (found by review)."""
    monkeypatch.chdir(tmp_path)
    for spec in ("causal|~causal", "causal&~causal", "causal&causal"):
        assert main(["show", spec, "--seq", "64"]) == 0
    assert main(["show", "causal", "--seq", "64", "--seq-k", "32"]) == 0
    assert main(["show", "|".join(f"sliding:w={w}" for w in range(1, 40)), "--seq", "64"]) == 0
    names = sorted(p.name for p in (tmp_path / "stof_build" / "masks").iterdir())
    assert len(names) == 5 and "mask-causal-or-not-causal-64.png" in names and "mask-causal-64x32.png" in names
    assert max(len(name) for name in names) < 100
    capsys.readouterr()
    assert main(["show", "causal", "--seq", "64", "--out", str(tmp_path)]) == 2
    assert "cannot write the picture" in capsys.readouterr().err
