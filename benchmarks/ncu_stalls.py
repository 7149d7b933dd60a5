"""Where a kernel's warps wait, from Nsight Compute's source page: the stall samples by opcode, then
the instructions with the most samples, each with its top stall reasons and the instructions
before it (a wait loop's branch says little alone: the `SYNCS...TRYWAIT` before it names the
mbarrier).

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass --launch-count 1 > kernel.csv
    python benchmarks/ncu_stalls.py kernel.csv [--top 12] [--context 6]

The report needs the SourceCounters section (`profile_attention.py` shows a whole command). Runs
anywhere (no GPU): it reads the CSV only.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass
class Instruction:
    address: str
    source: str
    samples: float
    reasons: dict[str, float]

    @property
    def opcode(self) -> str:
        """The opcode's first part (``BRA``, ``HGMMA``, ``SYNCS``), past any predicate."""
        words = [w for w in self.source.split() if not w.startswith("@")]
        return words[0].split(".")[0] if words else "?"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: Path) -> list[Instruction]:
    """The instructions of ncu's source-page CSV, in address order."""
    with path.open(errors="replace") as page:
        rows = list(csv.reader(page))
    header_at = next((i for i, row in enumerate(rows) if "Address" in row and "Source" in row), None)
    if header_at is None or SAMPLES not in rows[header_at]:
        raise SystemExit(f"{path}: not ncu's source page with stall sampling (columns 'Address', 'Source', "
                         f"'{SAMPLES}'; profile with --section SourceCounters)")
    header = rows[header_at]
    address, source, samples = header.index("Address"), header.index("Source"), header.index(SAMPLES)
    reasons = [(i, name) for i, name in enumerate(header) if name.startswith("stall_") and "(Not Issued)" not in name]
    return [Instruction(row[address], row[source].strip(), _number(row[samples]),
                        {name: _number(row[i]) for i, name in reasons if _number(row[i]) > 0})
            for row in rows[header_at + 1:] if len(row) == len(header)]


def summary(instructions: list[Instruction], top: int, context: int) -> str:
    total = sum(i.samples for i in instructions) or 1.0
    by_opcode = collections.Counter()
    for instruction in instructions:
        by_opcode[instruction.opcode] += instruction.samples
    lines = [f"{len(instructions)} instructions, {total:.0f} samples",
             "by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_opcode.most_common(12))]
    ranked = sorted(range(len(instructions)), key=lambda k: -instructions[k].samples)[:top]
    for k in ranked:
        instruction = instructions[k]
        reasons = sorted(instruction.reasons.items(), key=lambda item: -item[1])[:3]
        lines.append(f"\n{100 * instruction.samples / total:5.1f}%  {instruction.address}  {instruction.source}  "
                     + ", ".join(f"{name} {n:.0f}" for name, n in reasons))
        lines += [f"        {before.samples:6.0f}  {before.source}" for before in instructions[max(0, k - context):k]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=12, help="instructions to show")
    parser.add_argument("--context", type=int, default=6, help="instructions before each")
    args = parser.parse_args()
    print(summary(read(args.csv), args.top, args.context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
