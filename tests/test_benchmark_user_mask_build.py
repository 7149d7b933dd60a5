"""benchmarks/user_mask_build.py's plumbing on the CPU: run in fresh processes, its table gives each
row's per-call figure as the median and range over them (the GPU run itself needs CUDA)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_across_processes_reports_each_rows_median_and_range():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "user_mask_build.py"), "--seqs", "256",
                          "--device", "cpu", "--processes", "2"], check=True, capture_output=True, text=True).stdout
    assert "2 processes: median [lowest-highest] of their medians" in out
    rows = [line for line in out.splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 8 and any("longformer \\| causal()" in row for row in rows)  # the union's | escaped
    for row in rows:
        median, low, high = map(float, re.search(r"\| ([\d.]+) \[([\d.]+)-([\d.]+)\] \|", row).groups())
        assert 0 < low <= median <= high
    assert out.rstrip().endswith("per process: (0, 0), (0, 0)")  # no CUDA graphs on the CPU
