"""Raw kernel time of every `gemm_epilogue` parameter point against cuBLAS (issues 5 and 6).

    python benchmarks/gemm_points.py [REGEX] [SHAPES] [--gelu | --residual] [--m M] [--shapes K:N,...]
                                     [--cold | --sustained] [--raster ROWS]

REGEX filters points by tag (``pp_m64_n256_s4``: schedule, block_m, block_n, stages); SHAPES picks rows of (K, N) by index, comma
separated: 0 = (768, 3072), 1 = (3072, 768), 2 = (768, 768), 3 = (4096, 4096), 4 = (768, 2304) (BERT's merged
Q/K/V projection), or ``--shapes`` names them (``4096:1024,4096:28672``); M = 4096 tokens unless ``--m``,
fp16. The epilogue is none, bias + GELU (``--gelu``, FFN1's) or bias + residual (``--residual``, the
out-projection's and FFN2's, whose residual tile the kernel stages through shared memory). Unlike `benchmarks/fusion.py` only the driver launch runs between launches (no argument
checks, no allocation, tensor maps encoded once): CUDA events around 50 back-to-back launches,
median of 5; a kernel shorter than one launch's host cost would still read as that cost. With ``--cold``
each launch finds its operands in DRAM, as `benchmarks/gemm.py` times them (`triton.testing.do_bench`, which
flushes L2 before every launch): back-to-back launches keep operands under 50 MB in L2. With
``--sustained`` each point and cuBLAS run back to back in a CUDA graph after a second of the same work,
over input sets holding twice the L2 (`kernel_timing.sustained_ms`, as ``gemm.py --sustained``): the
power-limited clocks a model's GEMMs run at. ``--raster``
forces the tile order's band height (`gemm_epilogue.raster_rows`, which the kernels otherwise get
from the shape) to compare orders. Each point
is first checked against ``F.linear``. Needs an NVIDIA Hopper GPU, PyCUDA and nvcc.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fusion import TOKENS, Gemm, GemmBiasGelu, GemmBiasResidual, bench  # noqa: E402
from kernel_timing import sustained_ms  # noqa: E402

from stof_cc.backends.group_launch import GroupLaunch, precompile  # noqa: E402
from stof_cc.ir.frontend import trace  # noqa: E402
from stof_cc.ir.graph import INPUT  # noqa: E402
from stof_cc.ir.reference import relative_error  # noqa: E402
from stof_cc.passes import canonicalize, partition  # noqa: E402
from stof_cc.templates.gemm_epilogue import GEMM_EPILOGUE, point_tag  # noqa: E402
from stof_cc.templates.pricing import sm_count  # noqa: E402
from stof_cc.tune.model import input_set_count  # noqa: E402

SHAPES = [(768, 3072), (3072, 768), (768, 768), (4096, 4096), (768, 2304)]


def timed_ms(fn, launches: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return sorted(times)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("regex", nargs="?", help="points whose tag matches it, e.g. 'co_m128_n256_s3(_mc2)?'")
    parser.add_argument("rows", nargs="?", help="rows of SHAPES by index, comma separated")
    parser.add_argument("--gelu", action="store_true", help="bias + GELU epilogue")
    parser.add_argument("--residual", action="store_true", help="bias + residual epilogue (staged residual)")
    parser.add_argument("--m", type=int, default=TOKENS, help="rows of A (tokens)")
    parser.add_argument("--shapes", help="K:N pairs, comma separated (instead of rows)")
    timing = parser.add_mutually_exclusive_group()
    timing.add_argument("--cold", action="store_true", help="flush L2 before every launch (do_bench)")
    timing.add_argument("--sustained", action="store_true", help="back to back after a second of the same work")
    parser.add_argument("--raster", type=int, help="row tiles per band of the tile order, instead of raster_rows'")
    args = parser.parse_args()
    if args.raster:
        import stof_cc.templates.gemm_epilogue as gemm_epilogue

        gemm_epilogue.raster_rows = lambda *_: args.raster
    module_type = GemmBiasGelu if args.gelu else GemmBiasResidual if args.residual else Gemm
    only = re.compile(args.regex) if args.regex else None
    if args.shapes:
        shapes = [tuple(map(int, pair.split(":"))) for pair in args.shapes.split(",")]
    else:
        shapes = [SHAPES[int(i)] for i in args.rows.split(",")] if args.rows else SHAPES
    tokens = args.m
    for k, n in shapes:
        module = module_type(k, n).half()
        x, r = torch.randn(tokens, k, dtype=torch.float16), torch.randn(tokens, n, dtype=torch.float16)
        graph = canonicalize(trace(module, (x, r), {}))
        problem = GEMM_EPILOGUE.match(graph, partition(graph).default.groups[0])
        x_gpu, r_gpu, w_gpu = x.cuda(), r.cuda(), module.fc.weight.detach().cuda()
        inputs = [node.name for node in graph.nodes() if node.op == INPUT]
        values = dict(zip(inputs, (x_gpu, r_gpu), strict=False)) | {name: t.cuda() for name, t in graph.constants.items()}
        if args.sustained:
            sets = [values] + [{name: torch.randn_like(t) for name, t in values.items()}
                               for _ in range(input_set_count(sum(t.nbytes for t in values.values())) - 1)]
            (weight,) = [name for name, t in graph.constants.items() if tuple(t.shape) == (n, k)]
            cublas = sustained_ms([lambda a=v[inputs[0]], w=v[weight]: torch.nn.functional.linear(a, w) for v in sets])
        else:
            timer = bench if args.cold else timed_ms
            cublas = timer(lambda x_gpu=x_gpu, w_gpu=w_gpu: torch.nn.functional.linear(x_gpu, w_gpu))
        want = module.cuda()(x_gpu, r_gpu).detach().float()
        flops = 2 * tokens * n * k
        print(f"M={tokens} K={k} N={n}: cuBLAS {cublas * 1e3:.1f} us, {flops / cublas / 1e9:.0f} TFLOP/s", flush=True)
        default = GEMM_EPILOGUE.default_params(problem)
        points = [params for params in GEMM_EPILOGUE.space(problem) if not only or only.fullmatch(point_tag(params))]
        precompile(GEMM_EPILOGUE, problem, points)
        for params in points:
            tag = point_tag(params)
            launch = GroupLaunch(GEMM_EPILOGUE, problem, params)
            out = launch(values)
            if args.sustained:
                ms = sustained_ms([lambda launch=launch, v=v: launch(v) for v in sets])
            else:
                operands = [values[op.ref] for op in problem.operands]
                kernel_args = launch.tensor_map_args(operands, out) + [t.data_ptr() for t in operands] + [out.data_ptr()]
                ms = timer(lambda launch=launch, kernel_args=kernel_args: launch.kernel.launch(*launch.geometry, *kernel_args))
            estimate = GEMM_EPILOGUE.estimate(problem, params, sm_count())
            print(f"  {tag:15s} {ms * 1e3:7.1f} us {flops / ms / 1e9:5.0f} TFLOP/s {cublas / ms:.2f}x cuBLAS "
                  f"estimate {estimate:6.1f} us error {relative_error(out, want):.1e}"
                  f"{'  <- default (stage 1 pick)' if params == default else ''}", flush=True)


if __name__ == "__main__":
    main()
