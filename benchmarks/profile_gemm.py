"""One GEMM, for a profiler: a `gemm_epilogue` point or cuBLAS (`F.linear`), launched a few times.

    ncu --kernel-name regex:stof_gemm --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/profile_gemm.py co_m128_n256_s4 --m 4096 --k 4096 --n 4096
    ncu --launch-skip 1 --launch-count 1 --section SpeedOfLight python benchmarks/profile_gemm.py cublas

POINT is a point's tag (``co_m128_n256_s4``: schedule, block_m, block_n, stages; `gemm_points.py`
lists them with their times) or ``cublas``. fp16, no epilogue. ncu locks the clocks to base by
default, so the kernels compare at equal clocks there: that is how the generated GEMM was found
to match cuBLAS's time while issuing 1.85x its instructions (docs/decisions.md#mainloop-instructions).
Needs an NVIDIA Hopper GPU, PyCUDA and nvcc.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm import EPILOGUES, gemm_group  # noqa: E402

from stof_cc.templates.gemm_epilogue import GEMM_EPILOGUE, Problem, point_tag  # noqa: E402


def gemm_problem(m: int, k: int, n: int) -> tuple[torch.nn.Module, Problem, Any]:
    """(the module, its GEMM group's problem, the graph) for x [m, k] W[n, k]^T, fp16, lowered on
    the CPU as `benchmarks/gemm.py` lowers it."""
    module = EPILOGUES["none"](k, n).half()
    x, r = torch.randn(m, k, dtype=torch.float16), torch.randn(m, n, dtype=torch.float16)
    graph, group = gemm_group(module, x, r)
    return module, GEMM_EPILOGUE.match(graph, group), graph


def point_named(problem: Problem, tag: str) -> dict[str, Any]:
    """The point of ``problem``'s space whose tag is ``tag``; a clear error listing them if none."""
    points = {point_tag(params): params for params in GEMM_EPILOGUE.space(problem)}
    if tag not in points:
        raise SystemExit(f"no point {tag!r} for this shape; its points: {', '.join(points)}")
    return points[tag]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("point", help="a gemm_epilogue point's tag, or 'cublas'")
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--launches", type=int, default=3, help="launches (profile one after the first)")
    args = parser.parse_args()
    module, problem, graph = gemm_problem(args.m, args.k, args.n)
    x = torch.randn(args.m, args.k, dtype=torch.float16, device="cuda")
    weight = module.fc.weight.detach().cuda()
    if args.point == "cublas":
        run = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
    else:
        from stof_cc.backends.group_launch import GroupLaunch

        launch = GroupLaunch(GEMM_EPILOGUE, problem, point_named(problem, args.point))
        values = {graph.inputs[0].name: x} | {name: t.cuda() for name, t in graph.constants.items()}
        run = lambda: launch(values)  # noqa: E731
    for _ in range(args.launches):
        run()
    torch.cuda.synchronize()
    print(f"{args.point}: {args.launches} launches of M={args.m} K={args.k} N={args.n}")


if __name__ == "__main__":
    main()
