"""Summarise a `gemm_points.py` log: per shape, cuBLAS and the fastest points, best first.

    python benchmarks/gemm_points.py ... > points.log; python benchmarks/rank_points.py points.log [TOP]
"""

from __future__ import annotations

import re
import sys


def main() -> None:
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    shape, rows = None, []

    def flush() -> None:
        if shape:
            print(shape)
            for _us, line in sorted(rows)[:top]:
                print("   ", line.strip())

    for line in open(sys.argv[1]):
        if line.startswith("M="):
            flush()
            shape, rows = line.strip(), []
        elif (match := re.match(r"\s+(\S+)\s+([\d.]+) us", line)):
            rows.append((float(match.group(2)), line))
    flush()


if __name__ == "__main__":
    main()
