"""Host cost of the hot paths: one `stof_cc.attention` call on a problem too small to be
GPU-bound, and one call of a compiled encoder (CUDA-graph replay, and the plain path).

    python benchmarks/hot_path.py [--tree DIR]... [--repeats 5]

Each ``--tree`` (a checkout of stof-cc; default: this one) is timed in its own subprocess with
that tree first on the import path, so two versions are compared in one run on one GPU; name
each twice, alternating, to see the run-to-run spread.
Times are medians over ``--repeats`` rounds of many calls (wall clock, synchronised at the
end of each round), in microseconds per call. Needs an NVIDIA GPU, PyCUDA and nvcc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def per_call_us(fn, calls: int, repeats: int) -> float:
    import torch

    for _ in range(20):
        fn()
    rounds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(rounds)


def measure(repeats: int) -> dict[str, float]:
    """The figures for the stof_cc found first on sys.path."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from sparse_bert import SparseBert

    import stof_cc
    from stof_cc import masks

    out = {}
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    causal, window = masks.causal(), masks.sliding_window(32)
    with torch.no_grad():
        out["attention causal"] = per_call_us(lambda: stof_cc.attention(q, k, v, causal), 2000, repeats)
        out["attention sliding"] = per_call_us(lambda: stof_cc.attention(q, k, v, window), 2000, repeats)
        torch.manual_seed(0)
        model = SparseBert(layers=2, hidden=256, heads=4, ffn=1024).cuda().half().eval()
        x = torch.randn(2, 128, 256, device="cuda", dtype=torch.float16)
        dense = window.to_dense(128)[0, 0].cuda()
        for label, graphs in (("compiled replay", True), ("compiled plain", False)):
            compiled = stof_cc.compile(model, (x, dense), mask=window, tune=False, cuda_graphs=graphs)
            out[label] = per_call_us(lambda c=compiled: c(x, dense), 300, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", help="a stof-cc checkout to time (repeatable)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    results = []
    for tree in args.tree or [str(ROOT)]:  # a tree named twice is timed twice: order effects show
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)],
                              capture_output=True, text=True, env=env, cwd=tree)
        if proc.returncode != 0:
            print(f"{tree}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append((tree, json.loads(proc.stdout.strip().splitlines()[-1])))
    print("| path | " + " | ".join(f"{Path(t).name} us/call" for t, _ in results) + " |")
    print("|---|" + "---|" * len(results))
    for name in (results[0][1] if results else {}):
        print(f"| {name} | " + " | ".join(f"{r[name]:.1f}" for _, r in results) + " |")

if __name__ == "__main__":
    main()
