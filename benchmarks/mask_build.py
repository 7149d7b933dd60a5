"""How long building a BlockMask takes for every WORKLOADS.md grid mask (CPU).

A mask is converted once per (mask, sizes, block shape) and cached, but the conversion
sits on the first call's path, so it must stay far below a kernel compile: the target is
well under 100 ms at S = 8192. Each timing covers the whole user-visible step
(`grid_mask(name, S).block_mask(S, block_m=b, block_n=b)`, a fresh description each run so
no memo is reused), median of --repeats runs after one warm-up. Prints a table and appends
it to the work log, benchmarks/history/ (section "Mask build times"), with date, CPU and torch version.

    python benchmarks/mask_build.py [--seqs 2048,8192] [--blocks 64,128] [--repeats 9] [--no-append]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from work_log import append_to_work_log  # noqa: E402  (benchmarks/, the script's folder)

from stof_cc.masks.workloads import GRID_MASKS, grid_mask  # noqa: E402

HEADER = "| mask | S | block | ms (median) | block density | partial share | non-empty blocks | BlockMask bytes |"


def measure(name: str, seq: int, block: int, repeats: int) -> str:
    grid_mask(name, seq).block_mask(seq, block_m=block, block_n=block)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mask = grid_mask(name, seq).block_mask(seq, block_m=block, block_n=block)
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return (
        f"| {name} | {seq} | {block}x{block} | {ms:.2f} | {mask.block_density:.4f} | "
        f"{mask.partial_share:.4f} | {mask.n_nonempty} | {mask.nbytes} |"
    )


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def environment() -> str:
    return (
        f"{datetime.datetime.now().isoformat(timespec='seconds')}, {cpu_name()}, "
        f"{os.cpu_count()} cores ({torch.get_num_threads()} torch threads), torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,8192", help="comma-separated sequence lengths")
    parser.add_argument("--blocks", default="64,128", help="comma-separated square block sizes")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per case")
    parser.add_argument("--no-append", action="store_true", help="do not append to the work log")
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]

    rows = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    print(environment())
    print("\n".join(rows), flush=True)
    for seq in seqs:
        for block in blocks:
            for name in GRID_MASKS:
                rows.append(measure(name, seq, block, args.repeats))
                print(rows[-1], flush=True)
    if not args.no_append:
        append_to_work_log(f"\n## Mask build times\n\n{environment()}. `python benchmarks/mask_build.py`\n\n"
                           + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
