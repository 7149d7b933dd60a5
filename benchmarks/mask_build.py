"""User masks built on the device (issue 23, item 4): `stof_cc.masks.from_mask_mod` with the
mask_mods a FlexAttention user writes (shared/bench/WORKLOADS.md), `from_dense` and a union,
against FlexAttention's `create_block_mask` on the same mask_mod.

    python benchmarks/mask_build.py [--seqs 8192,32768] [--device cuda]

Each row: a fresh description per repeat (nothing cached), `block_mask(S, S, 128, 128)` moved
to the device (what `stof_cc.attention` does on a first call), median of 5 wall-clock
repeats with the device synchronised; then the same description again (the cached repeat);
`create_block_mask(mask_mod, None, None, S, S, device=...)` beside it (BLOCK_SIZE 128). The
block masks are checked to hold the same blocks. On the CPU (--device cpu) FlexAttention is
not run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stof_cc import masks  # noqa: E402

BLOCK = 128


def user_mask_mods(seq: int, device: str) -> dict:
    """WORKLOADS.md's mask_mods, as a user writes them (tables on the device)."""
    w = max(64, seq // 16)
    rnd = torch.rand(-(-seq // 64), -(-seq // 64), generator=torch.Generator().manual_seed(0)) < 3 / (seq / 64)
    rnd = rnd.to(device)
    doc = (torch.arange(seq) // max(128, seq // 4)).to(device)
    return {
        "causal": lambda b, h, q, k: q >= k,
        "sliding": lambda b, h, q, k: (q - k).abs() <= w,
        "dilated": lambda b, h, q, k: ((q - k).abs() <= 4 * w) & (((q - k) % 4) == 0),
        "longformer": lambda b, h, q, k: ((q - k).abs() <= w) | (q < 32) | (k < 32),
        "bigbird": lambda b, h, q, k: ((q - k).abs() <= w) | (q < 32) | (k < 32) | rnd[q // 64, k // 64],
        "document": lambda b, h, q, k: doc[q] == doc[k],
    }


def timed(fn, device: str, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,32768")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    rows = []
    for seq in map(int, args.seqs.split(",")):
        mods = user_mask_mods(seq, device)
        cases = {f"from_mask_mod {name}": (lambda fn=fn: masks.from_mask_mod(fn), fn) for name, fn in mods.items()}
        cases["from_mask_mod longformer | causal()"] = (
            lambda: masks.from_mask_mod(mods["longformer"]) | masks.causal(), None)
        if seq <= 8192:
            dense = torch.rand(seq, seq, generator=torch.Generator().manual_seed(1)) < 0.05
            cases["from_dense (5% random)"] = (lambda: masks.from_dense(dense), None)
        for label, (make, mask_mod) in cases.items():
            build = lambda make=make: make().block_mask(seq, seq, BLOCK, BLOCK).to(device)  # noqa: E731
            first = timed(build, device)
            desc = make()
            kept = desc.block_mask(seq, seq, BLOCK, BLOCK)
            again = timed(lambda desc=desc: desc.block_mask(seq, seq, BLOCK, BLOCK), device)
            row = {"S": seq, "mask": label, "first_ms": first, "repeat_ms": again, "flex_ms": None}
            if mask_mod is not None and device == "cuda":
                from torch.nn.attention.flex_attention import create_block_mask

                flex = lambda mask_mod=mask_mod: create_block_mask(mask_mod, None, None, seq, seq,  # noqa: E731
                                                                   device=device, BLOCK_SIZE=BLOCK)
                flex()  # its first call compiles nothing (no _compile), but warms the allocator
                row["flex_ms"] = timed(flex, device)
                flex_blocks = flex().to_dense()[0, 0].cpu().bool()  # non-empty blocks
                ours = kept.block_classes()[0, 0] != 0
                row["same_blocks"] = bool(torch.equal(flex_blocks, ours)) if flex_blocks.shape == ours.shape else None
            rows.append(row)
            print(f"S={seq:6d} {label:40s} first {first:9.1f} ms  repeat {again:7.2f} ms"
                  + (f"  create_block_mask {row['flex_ms']:8.1f} ms  same blocks: {row['same_blocks']}"
                     if row["flex_ms"] is not None else ""), flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\n{name}, torch {torch.__version__}, block {BLOCK}x{BLOCK}, device {device}")
    print("| S | mask | stof-cc first build ms | repeat ms | create_block_mask ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        same = {True: "", False: " (differs)", None: " (not compared)"}[r.get("same_blocks")]
        flex = "-" if r["flex_ms"] is None else f"{r['flex_ms']:.1f}{same}"
        print(f"| {r['S']} | {r['mask']} | {r['first_ms']:.1f} | {r['repeat_ms']:.2f} | {flex} |")


if __name__ == "__main__":
    main()
