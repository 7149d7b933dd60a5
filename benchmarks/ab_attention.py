"""A/B of the warp-specialised attention kernel in one process: the templates in a folder (a copy of
`stof_cc/templates` from another commit, e.g. `git archive HEAD~1 stof_cc/templates | tar -x -C /tmp/old`)
against the working tree's, at the cost model's two best ws points per case, each one CTA per tile
and persistent, both orders, min of two medians; every launch's first call is checked against the
fp32 reference, and cuDNN's and FA4's causal times (FA4 where it imports) and the dense floor are
printed beside them. Side-by-side
evidence for a kernel change, where run-to-run noise on the H100 (2-7%) hides the difference
between two separate `mha.py` runs.

    python benchmarks/ab_attention.py --old /tmp/old/stof_cc/templates [--cases causal:8192:64,bigbird:8192:128]
    python benchmarks/ab_attention.py --one-section   # the tile schedule without L2 sections as "old"

Cases are mask:S:D with D = 64 (fp16, H = 12) or 128 (bf16, H = 16), B = 4096 // S (1 at least,
8 up to S = 512).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stof_cc.masks.workloads import grid_batch, grid_mask  # noqa: E402
from stof_cc.templates.attention import WGMMA_WS, WarpSpecialisedWgmmaAttention  # noqa: E402

DEFAULT_CASES = ("causal:512:64,causal:1024:64,causal:8192:64,sliding:8192:64,longformer:8192:64,bigbird:8192:64,"
                 "document:8192:64,causal:1024:128,causal:4096:128,causal:8192:128,sliding:8192:128,"
                 "longformer:8192:128,bigbird:8192:128")
TOLERANCE = 1e-2


def case_inputs(case: str, batch: int | None = None) -> tuple[str, int, object, tuple[torch.Tensor, ...]]:
    """(mask name, S, its description, random q, k, v on the GPU) of a case "mask:S:D": D = 64 fp16
    with H = 12, D = 128 bf16 with H = 16, B = ``batch`` or the grid's (also profile_attention.py's)."""
    name, seq, d = case.split(":")
    seq, d = int(seq), int(d)
    heads, dtype = (12, torch.float16) if d == 64 else (16, torch.bfloat16)
    batch = batch or grid_batch(seq)
    return name, seq, grid_mask(name, seq), tuple(torch.randn(batch, heads, seq, d, device="cuda", dtype=dtype)
                                                  for _ in range(3))


def old_template(folder: str) -> WarpSpecialisedWgmmaAttention:
    """The ws template read from ``folder`` (its kernels keep their names: a separate module)."""
    if not (Path(folder) / WarpSpecialisedWgmmaAttention.source_file).is_file():
        raise SystemExit(f"{folder} has no {WarpSpecialisedWgmmaAttention.source_file}")

    class Old(WarpSpecialisedWgmmaAttention):
        name = "attention_wgmma_ws_old"
        template_dir = folder

    return Old()


_ONE_SECTION_SCHEDULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def one_section(active: bool):
    """While ``active``, launch plans schedule their tiles without L2 sections (one section),
    cached apart from the sectioned schedules."""
    from stof_cc.backends import tile_schedule

    saved = tile_schedule.pairs_per_section, tile_schedule._schedules
    if active:
        tile_schedule.pairs_per_section = lambda *args: None
        tile_schedule._schedules = _ONE_SECTION_SCHEDULES
    try:
        yield
    finally:
        tile_schedule.pairs_per_section, tile_schedule._schedules = saved


def run_case(case: str, old: WarpSpecialisedWgmmaAttention, one_section_old: bool = False) -> int:
    """Print one case's A/B (``one_section_old``: "old" is the working tree's template without L2
    sections); the number of wrong launches."""
    from mha import bench, dense_floors, fa4_available, fa4_peer, under
    from torch.nn.attention import SDPBackend

    from stof_cc.backends.attention_launch import launch_plan
    from stof_cc.ir.reference import masked_attention, relative_error
    from stof_cc.templates.attention import config_label, problem_of
    from stof_cc.tune.attention import cached_block_mask, choose

    name, seq, desc, (q, k, v) = case_inputs(case)
    problem = problem_of(q, k, v)
    ref = masked_attention(q, k, v, desc.to_dense(seq, seq).cuda()).float()
    floor = min(bench(lambda fn=fn: fn(q, k, v)) for fn in dense_floors().values()) \
        * desc.block_mask(seq, seq, 128, 128).element_density
    cudnn = bench(lambda: under(SDPBackend.CUDNN_ATTENTION, is_causal=True)(q, k, v)) if name == "causal" else math.nan
    fa4 = math.nan
    if name == "causal" and fa4_available():
        fa4_causal = fa4_peer(causal=True)
        fa4 = bench(lambda: fa4_causal(q, k, v))
    points = []
    for estimate in choose(problem, desc).estimates:
        base = {key: value for key, value in estimate.params.items() if key != "persistent"}
        if estimate.params["strategy"] == "wgmma_ws" and base not in points:
            points.append(base)
        if len(points) == 2:
            break
    times: dict[tuple, list[float]] = {}
    wrong = 0
    for rep in range(2):
        for base in points:
            block_mask = cached_block_mask(desc, problem, base | {"persistent": False}, q.device)
            for label, template in (("old", old), ("new", WGMMA_WS))[:: 1 if rep == 0 else -1]:
                for persistent in (False, True):
                    params = base | {"persistent": persistent}
                    with one_section(label == "old" and one_section_old):
                        plan = launch_plan(q, k, v, problem, template, params, block_mask, None)
                    if rep == 0:
                        err = relative_error(plan.launch(q, k, v).float(), ref)
                        if not err < TOLERANCE:
                            wrong += 1
                            print(f"  WRONG {label} {case} {config_label(params)}: relative error {err:.2e}", flush=True)
                    times.setdefault((config_label(params), label), []).append(bench(lambda plan=plan: plan.launch(q, k, v)))
    print(f"{case}: cuDNN causal {cudnn:.4f} ms, FA4 causal {fa4:.4f} ms, floor {floor:.4f} ms", flush=True)
    for base in points:
        for persistent in (False, True):
            label = config_label(base | {"persistent": persistent})
            before, after = min(times[(label, "old")]), min(times[(label, "new")])
            print(f"  {label:40s} old {before:.4f}  new {after:.4f}  new/old {after / before:.3f}", flush=True)
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--old", help="folder of the templates to compare against")
    what.add_argument("--one-section", action="store_true",
                      help="compare against the tile schedule without L2 sections (same templates)")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="mask:S:D, comma separated")
    args = parser.parse_args()
    old = WGMMA_WS if args.one_section else old_template(args.old)
    wrong = sum(run_case(case, old, args.one_section) for case in args.cases.split(","))
    print(f"{wrong} wrong launches")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
