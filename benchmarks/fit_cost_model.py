"""Fit the attention cost model's constants to a measured sweep.

    python benchmarks/mha.py --sweep --json sweep.json      # on the GPU (any --heads/--head-dim/--dtype)
    python benchmarks/fit_cost_model.py sweep.json [more.json ...]   # anywhere (CPU is enough)
    python benchmarks/fit_cost_model.py sweep.json --evaluate   # the current constants' picks only
    python benchmarks/fit_cost_model.py sweep.json --picks      # each pick's time over the case's best

`--evaluate` fits nothing: per case it prints the pick of the constants in cost_model.py, that
pick's time as measured in the sweep, and its speedup over the sweep's best correct peer (all
timings from the one benchmark process), then the geomean: how a refit would have fared in
that run, without a new GPU run.

Random search (log-uniform around the current constants, narrowing) minimising, over the sweep's
cases, log(time of the model's pick / best measured time) plus a small penalty on the
log error of every estimate, so that the estimates stay in microseconds. Prints the
constants to paste into stof_cc/tune/cost_model.py and the loss per case.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stof_cc.masks.workloads import grid_mask  # noqa: E402
from stof_cc.templates.attention import AttentionProblem, config_label  # noqa: E402
from stof_cc.tune import cost_model  # noqa: E402
from stof_cc.tune.attention import cached_block_mask, candidates, residue_problem  # noqa: E402

CONSTANTS = ("TENSOR_FLOPS_PER_US", "WGMMA_FLOPS_PER_US", "FRAGMENT_OVERHEAD", "EXP_PER_US", "BIT_TESTS_PER_US", "TILE_BYTES_PER_US",
             "ITER_US", "WS_ITER_US", "EXPOSED_LOAD_US", "CTA_FIXED_US", "LAUNCH_US")
SM_COUNT = 132  # the H100 SXM the sweeps were measured on


def load_cases(paths: list[str]) -> list[tuple[str, list[tuple]]]:
    """Per case: (label, [(params, model inputs..., measured us)]) for every candidate."""
    cases = []
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            measured = {config_label(m["params"]): m["ms"] * 1e3 for m in row["sweep"] if m["ok"]}
            desc = grid_mask(row["mask"], row["seq"])
            heads, head_dim = row["heads"], row["head_dim"]
            dtype = getattr(torch, row["dtype"].removeprefix("torch."))
            problem = AttentionProblem(row["batch"], heads, row["seq"], row["seq"], head_dim, dtype)
            if row.get("residues", 1) > 1:  # measured as the runtime launches it: the residues' strided attentions
                problem, desc = residue_problem(problem, row["residues"]), desc.strided_split()[1]
            points = []
            for template, params in candidates(problem):
                if config_label(params) not in measured:
                    continue
                bm = cached_block_mask(desc, problem, params, torch.device("cpu"))
                points.append((params, head_dim, row["batch"] * heads // (bm.batch * bm.heads),
                               (bm.any_ptr[1:] - bm.any_ptr[:-1]).tolist(), int(bm.part_cols.numel()),
                               template.shared_bytes(problem, params), template.registers(problem, params),
                               template.launch(problem, params)[1], measured[config_label(params)]))
            cases.append((_label(row), points))
    return cases


def _label(row: dict) -> str:
    """A sweep row's case: mask, sequence, head dim, heads, batch and dtype."""
    return f"{row['mask']} S={row['seq']} d={row['head_dim']} H={row['heads']} B={row['batch']} {row['dtype']}"


def loss(cases, report: bool = False) -> float:
    total = 0.0
    for label, points in cases:
        scored = [(cost_model.estimate(p, d, hb, rows, part, smem, SM_COUNT, regs, threads).micros, us, p)
                  for p, d, hb, rows, part, smem, regs, threads, us in points]
        best = min(us for _, us, _ in scored)
        est, picked_us, params = min(scored, key=lambda s: s[0])
        total += math.log(picked_us / best)
        total += 0.2 * sum(math.log(e / us) ** 2 for e, us, _ in scored) / len(scored)
        if report:
            print(f"{label:>16}: pick {config_label(params)} est {est:.1f} us, measured {picked_us:.1f} us, "
                  f"best {best:.1f} us ({picked_us / best:.3f}x)")
    return total


def picks(cases) -> None:
    """Per case, the current model's pick against the sweep's fastest candidate, then the mean and
    the worst ratio (what the model costs where stage 2 does not run)."""
    ratios = []
    for label, points in cases:
        scored = [(cost_model.estimate(p, d, hb, rows, part, smem, SM_COUNT, regs, threads).micros, us, p)
                  for p, d, hb, rows, part, smem, regs, threads, us in points]
        best = min(us for _, us, _ in scored)
        _, picked_us, params = min(scored, key=lambda s: s[0])
        ratios.append(picked_us / best)
        print(f"{label}: {config_label(params)} {picked_us:.1f} us, best {best:.1f} us ({ratios[-1]:.3f}x)")
    print(f"\nthe pick over the best: mean {sum(ratios) / len(ratios):.4f}, worst {max(ratios):.3f}x, "
          f"{sum(r > 1.05 for r in ratios)} of {len(ratios)} cases above 1.05x")


def evaluate(paths: list[str]) -> None:
    rows = {_label(r): r for path in paths for r in json.loads(Path(path).read_text())}
    speedups = []
    print("| mask | S | d | pick | ms (sweep) | best peer ms | speedup | measured best |")
    print("|---|---|---|---|---|---|---|---|")
    for label, points in load_cases(paths):
        row = rows[label]
        mask, seq, head_dim = row["mask"], row["seq"], row["head_dim"]
        _, picked_us, params = min(((cost_model.estimate(p, d, hb, r, part, smem, SM_COUNT, regs, threads).micros,
                                     us, p) for p, d, hb, r, part, smem, regs, threads, us in points), key=lambda s: s[0])
        speedups.append(row["best_peer_ms"] * 1e3 / picked_us)
        print(f"| {mask} | {seq} | {head_dim} | {config_label(params)} | {picked_us / 1e3:.4f} | "
              f"{row['best_peer_ms']:.4f} | {speedups[-1]:.2f}x | {row['best_kernel']} {row['best_ms']:.4f} |")
    geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
    print(f"\ngeomean {geomean:.3f}x over {len(speedups)} cases; worst {min(speedups):.2f}x")
    print(stage_two_summary(load_cases(paths)))


def stage_two_summary(cases, top_k: int = 8) -> str:
    """What stage 2 over the model's top ``top_k`` would pick, from the sweep's timings: how far
    from the exhaustive best, what share of the candidates it measures, and the Spearman rank
    correlation between estimates and measured times (median over cases)."""
    gaps, shares, correlations = [], [], []
    for _, points in cases:
        scored = sorted((cost_model.estimate(p, d, hb, r, part, smem, SM_COUNT, regs, threads).micros, us)
                        for p, d, hb, r, part, smem, regs, threads, us in points)
        best = min(us for _, us in scored)
        gaps.append(min(us for _, us in scored[:top_k]) / best)
        shares.append(min(top_k, len(scored)) / len(scored))
        correlations.append(spearman([e for e, _ in scored], [us for _, us in scored]))
    within = sum(g <= 1.05 for g in gaps)
    return (f"stage 2 over the top {top_k}: within 5% of the exhaustive best in {within}/{len(gaps)} cases, "
            f"worst {max(gaps):.3f}x; measures {max(shares):.0%} of the candidates at most; "
            f"median Spearman correlation of estimates and times {sorted(correlations)[len(correlations) // 2]:.2f}")


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", help="JSON written by benchmarks/mha.py --sweep --json")
    parser.add_argument("--trials", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evaluate", action="store_true", help="report the current constants' picks, fit nothing")
    parser.add_argument("--picks", action="store_true", help="each pick's time over the case's best, fit nothing")
    args = parser.parse_args()
    if args.evaluate:
        evaluate(args.sweeps)
        return
    if args.picks:
        picks(load_cases(args.sweeps))
        return
    cases = load_cases(args.sweeps)
    best = (loss(cases), {name: getattr(cost_model, name) for name in CONSTANTS})
    print(f"current constants: loss {best[0]:.3f}")
    rng = random.Random(args.seed)
    for width in (2.5, 1.0, 0.4, 0.15):  # search around the best so far, narrowing
        centre = dict(best[1])
        for _ in range(args.trials // 4):
            trial = {name: value * math.exp(rng.uniform(-width, width)) for name, value in centre.items()}
            for name, value in trial.items():
                setattr(cost_model, name, value)
            value = loss(cases)
            if value < best[0]:
                best = (value, trial)
    for name, value in best[1].items():
        setattr(cost_model, name, value)
    print(f"fitted: loss {best[0]:.3f}")
    for name, value in best[1].items():
        print(f"{name} = {value:.3g}")
    loss(cases, report=True)


if __name__ == "__main__":
    main()
