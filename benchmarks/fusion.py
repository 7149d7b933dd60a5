"""Fused GEMM groups against cuBLAS, torch eager and torch.compile (issue 5), BERT-base shapes.

    python benchmarks/fusion.py [--json out.json] [--append]

M = 4096 tokens, fp16, (K, N) in {(768, 768), (768, 3072), (3072, 768)}. Per shape:

* ``gemm``: the GEMM alone (``linear`` without bias) as stof-cc's `gemm_epilogue`, every
  parameter point, against ``torch.nn.functional.linear`` (cuBLAS): its share of cuBLAS;
* ``gemm_bias_gelu``: x W^T + b then GELU as one `gemm_epilogue` kernel, against eager
  (cuBLAS + GELU kernel) and ``torch.compile``;
* ``gemm_bias_residual_layernorm``: the scheme stage 1 chooses, one `gemm_layernorm` kernel
  (a cluster of CTAs holds whole rows), and the default scheme's two kernels
  (`gemm_epilogue` with bias + residual, then `row_reduce`), against eager and
  ``torch.compile`` (N = 768 only).

The GEMM group's every parameter point is timed and the best kept (the other groups run at
their default points).

Every implementation is checked against the fp32 result first (relative error < 1e-2); times
are medians of ``triton.testing.do_bench`` after warm-up, all in one process on random
inputs. Needs an NVIDIA Hopper GPU (gemm_epilogue is sm_90a), PyCUDA and nvcc.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from work_log import append_to_work_log  # noqa: E402  (benchmarks/, the script's folder)

from stof_cc.backends.group_launch import GroupLaunch, precompile  # noqa: E402
from stof_cc.codegen import NotFusable  # noqa: E402
from stof_cc.ir.frontend import trace  # noqa: E402
from stof_cc.ir.graph import INPUT  # noqa: E402
from stof_cc.ir.reference import relative_error  # noqa: E402
from stof_cc.passes import canonicalize, partition  # noqa: E402
from stof_cc.templates.gemm_epilogue import point_tag  # noqa: E402
from stof_cc.templates.group import group_templates  # noqa: E402
from stof_cc.tune.scheme import choose_scheme  # noqa: E402

TOKENS = 4096
SHAPES = ((768, 768), (768, 3072), (3072, 768))


class Gemm(torch.nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class GemmBiasGelu(torch.nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(k, n)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


class GemmBiasResidual(torch.nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(k, n)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + r


class GemmBiasResidualLayerNorm(torch.nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(k, n)
        self.norm = torch.nn.LayerNorm(n)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x) + r)


def bench(fn) -> float:
    from triton.testing import do_bench

    fn()
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def stof_pipeline(module: torch.nn.Module, x: torch.Tensor, r: torch.Tensor, chosen: bool = True):
    """(median ms, callable running the generated kernels in order, label of the GEMM point) at
    the best GEMM point, for stage 1's chosen scheme or (``chosen=False``) the default one."""
    graph = canonicalize(trace(module, (x.cpu(), r.cpu()), {}))
    plan = choose_scheme(graph, partition(graph))
    groups = plan.scheme.groups if chosen else plan.default.groups
    inputs = [n.name for n in graph.nodes() if n.op == INPUT]
    values = dict(zip(inputs, (x, r), strict=True)) | {k: v.cuda() for k, v in graph.constants.items()}
    steps = [(*_matching_template(graph, group), group) for group in groups]
    gemm_template, gemm_problem, _ = steps[0]
    points = gemm_template.space(gemm_problem)
    best = None
    precompile(gemm_template, gemm_problem, points)
    for params in points:
        launches = [GroupLaunch(gemm_template, gemm_problem, params)]
        launches += [GroupLaunch(t, p, t.default_params(p)) for t, p, _ in steps[1:]]

        def run(launches=launches):
            env = dict(values)
            for launch, (_, _, group) in zip(launches, steps, strict=True):
                env[_output(graph, group)] = launch(env)
            return env[_output(graph, steps[-1][2])]

        ms = bench(run)
        if best is None or ms < best[0]:
            best = (ms, run, f"{gemm_template.name} {point_tag(params)}" + (" + row_reduce" if len(steps) > 1 else ""))
    return best


def _matching_template(graph, group):
    for template in group_templates(group.kind):
        try:
            return template, template.match(graph, group)
        except NotFusable:
            continue
    raise NotFusable(f"no template generates group {group.name}")


def _output(graph, group) -> str:
    from stof_cc.templates.group import group_output

    return group_output(graph, group)


def run_case(name: str, module_type, k: int, n: int, chosen: bool = True) -> dict:
    torch.manual_seed(0)
    module = module_type(k, n).half().cuda().eval()
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.float16)
    r = torch.randn(TOKENS, n, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        want = module.float()(x.float(), r.float())
        module.half()
        eager = lambda: module(x, r)  # noqa: E731
        torch._dynamo.reset()
        compiled_module = torch.compile(module, mode="reduce-overhead", dynamic=False)  # its best mode here
        compiled = lambda: compiled_module(x, r)  # noqa: E731
        ours_ms, ours, point = stof_pipeline(module.cpu(), x, r, chosen)
        module.cuda()
        row = {"case": name, "k": k, "n": n, "stof_ms": ours_ms, "stof_point": point,
               "stof_err": relative_error(ours(), want)}
        for label, fn in (("eager", eager), ("compiled", compiled)):
            row[f"{label}_ms"] = bench(fn)
            row[f"{label}_err"] = relative_error(fn(), want)
    flops = 2 * TOKENS * k * n
    row["stof_tflops"] = flops / row["stof_ms"] / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--append", action="store_true", help="append the table to the work log, benchmarks/history/")
    args = parser.parse_args()
    rows = []
    for k, n in SHAPES:
        rows.append(run_case("gemm", Gemm, k, n))
        rows.append(run_case("gemm_bias_gelu", GemmBiasGelu, k, n))
        if n == 768:
            rows.append(run_case("gemm_bias_residual_layernorm", GemmBiasResidualLayerNorm, k, n))
            rows.append(run_case("gemm_bias_residual_layernorm (default scheme)", GemmBiasResidualLayerNorm, k, n,
                                 chosen=False))
        print(rows[-1], flush=True)
    head = (f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}; M = {TOKENS}, fp16")
    lines = [head, "", "| case | K | N | stof ms | point | eager ms | compiled ms | stof vs eager | stof vs compiled | "
             "stof TFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = all(r[f"{x}_err"] < 1e-2 for x in ("stof", "eager", "compiled"))
        lines.append(f"| {r['case']} | {r['k']} | {r['n']} | {r['stof_ms']:.4f} | {r['stof_point']} | "
                     f"{r['eager_ms']:.4f} | {r['compiled_ms']:.4f} | {r['eager_ms'] / r['stof_ms']:.2f}x | "
                     f"{r['compiled_ms'] / r['stof_ms']:.2f}x | {r['stof_tflops']:.0f} |" + ("" if ok else " (ERROR)"))
    gemm = [r for r in rows if r["case"] == "gemm"]
    share = math.exp(sum(math.log(r["eager_ms"] / r["stof_ms"]) for r in gemm) / len(gemm))
    lines.append(f"\nGEMM alone: geomean {share:.2f} of cuBLAS's speed (eager = F.linear = cuBLAS)")
    table = "\n".join(lines)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.append:
        append_to_work_log(f"\n## Fused GEMM groups\n\n{table}\n")


if __name__ == "__main__":
    main()
