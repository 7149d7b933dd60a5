"""`stof-cc masks show | list`: look at a mask and its block map, or list the zoo.

The main CLI calls `add_masks_command(subparsers)`; each subcommand stores its handler in
`run` (args -> exit code), as the main CLI expects. `python -m stof_cc.masks.cli ...` runs
the same commands alone.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from stof_cc.masks.errors import MaskError
from stof_cc.masks.picture import render, write_png
from stof_cc.masks.spec import GRID_SYNTAX, PATTERNS, parse_spec


def folder_path(text: str) -> str:
    """An argparse type for ``--build-dir``: an empty path meant the current folder in some commands
    and nothing at all in others (a helper's audit); it is an error in every one."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty (give a folder, e.g. stof_build)")
    return text


def _block_size(text: str) -> tuple[int, int]:
    """'64' -> (64, 64); '64x128' -> (64, 128)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:x\s*(\d+))?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"block must be N or MxN, got {text!r}")
    m = int(match.group(1))
    return m, int(match.group(2) or m)


def add_masks_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `masks show` and `masks list` under an argparse subparsers object."""
    masks = subparsers.add_parser("masks", help="show masks and their block maps, list the zoo")
    commands = masks.add_subparsers(dest="masks_command", metavar="{show,list}", required=True)

    show = commands.add_parser(
        "show",
        help="write a PNG of a mask beside its block map and print its statistics",
        description="SPEC examples: causal, sliding:w=256, longformer:w=128,g=32, grid:bigbird, "
        "causal&sliding:w=64 (see `masks list`).",
    )
    show.add_argument("spec", help="mask spec, e.g. longformer:w=128,g=32")
    show.add_argument("--seq", type=int, required=True, help="query sequence length")
    show.add_argument("--seq-k", type=int, help="key sequence length (default: --seq)")
    show.add_argument("--block", type=_block_size, default=(64, 64), help="N or MxN (default 64)")
    show.add_argument("--max-px", type=int, default=1024, help="largest panel side in pixels (default: %(default)s)")
    show.add_argument("--build-dir", default="stof_build", type=folder_path,
                      help="the PNG goes to <build-dir>/masks/ unless --out says (default: %(default)s)")
    show.add_argument("--out", help="PNG path (default: <build-dir>/masks/mask-<spec>-<seq>.png)")
    show.set_defaults(run=show_command)

    listing = commands.add_parser("list", help="list the mask zoo with its spec syntax")
    listing.set_defaults(run=list_command)
    return masks


def show_command(args: argparse.Namespace) -> int:
    try:
        desc = parse_spec(args.spec, seq=args.seq)
        block_m, block_n = args.block
        mask = desc.block_mask(args.seq, args.seq_k, block_m, block_n)
        image = render(mask, max_px=args.max_px)
    except MaskError as error:
        print(f"stof-cc masks show: error: {error}", file=sys.stderr)
        return 2
    path = write_png(args.out or Path(args.build_dir, "masks", _picture_name(args)), image)  # OSError: main's
    print(f"mask      {desc!r}")
    print(f"storage   {mask!r}")
    print(f"blocks    {mask.n_full} full, {mask.n_partial} partial, {mask.n_empty} empty")
    print(f"density   {mask.element_density:.4f} elements, {mask.block_density:.4f} blocks")
    print(f"partial   {mask.partial_share:.4f} of non-empty blocks")
    if mask.batch * mask.heads > 1:
        print(f"picture   slice b=0, h=0 of {mask.batch} x {mask.heads}")
    print(f"wrote     {path} ({image.shape[1]}x{image.shape[0]} px: mask | block map)")
    return 0


def _picture_name(args: argparse.Namespace) -> str:
    """The default file of ``masks show``: the spec with its operators spelled out (causal|~causal and
    causal&causal must not share a file), the key length where it differs, and a digest in place of
    a spec too long for a file name."""
    spelled = args.spec.replace("|", " or ").replace("&", " and ").replace("~", " not ")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", spelled).strip("-")
    if len(slug) > 80:
        slug = f"{slug[:60]}-{hashlib.sha1(args.spec.encode()).hexdigest()[:10]}"
    keys = f"x{args.seq_k}" if args.seq_k not in (None, args.seq) else ""
    return f"mask-{slug}-{args.seq}{keys}.png"


def list_command(args: argparse.Namespace) -> int:
    rows = [(p.syntax(), p.summary) for p in PATTERNS.values()]
    rows.append((GRID_SYNTAX, "a benchmark grid mask (benchmarks/WORKLOADS.md) at --seq"))
    width = max(len(syntax) for syntax, _ in rows)
    for syntax, summary in rows:
        print(f"{syntax:<{width}}  {summary}")
    print("\ncombine with | (or), & (and), ~ (not), grouped by parentheses: e.g. causal&sliding:w=64, "
          "(causal|sliding:w=64)&~dilated:w=8,d=4")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stof-cc")
    add_masks_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["masks", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.run(args)
    except OSError as error:  # the picture cannot be written (`stof-cc` itself says it as for every --out)
        print(f"stof-cc masks: error: cannot write the picture: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
