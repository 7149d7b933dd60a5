"""Register a template for a pattern stof-cc does not fuse yet, and watch it being used.

The pattern: the SwiGLU gate of a fused projection, ``a, b = x.chunk(2, -1); silu(a) * b``.
stof-cc's own `elementwise` template generates it too (its general indexed form reads the
chunk); a registered template is offered the group first, and where both apply, stage 2
measures both and each group runs the faster (untuned, the registered one). The template is
two files: ``examples/templates/swiglu_split.cu.j2`` (the CUDA source, with stof-cc's shared
macros) and the spec below (which groups it matches, by op names, shapes and wiring; its
parameters; the values its source is rendered with; its launch).

    python examples/custom_template.py            # CPU: register, partition, write + nvcc-compile
                                                  # GPU: also run the kernel against torch and tune it
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

import stof_cc
from stof_cc.codegen import NotFusable
from stof_cc.ir.graph import Graph
from stof_cc.passes import lower
from stof_cc.passes.fusion import FusionGroup
from stof_cc.runtime.build import build_groups, format_builds
from stof_cc.templates.group import kernel_operand, output_problem
from stof_cc.templates.registry import Launch

HERE = Path(__file__).resolve().parent


class SwiGLUGate(torch.nn.Module):
    """What the template generates: silu(first half) * second half of the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b


class SwiGLUSplitTemplate(stof_cc.GroupTemplate[None]):  # None: its problems carry no details
    name = "swiglu_split"
    source_file = "swiglu_split.cu.j2"
    template_dir = HERE / "templates"
    kinds = ("elementwise",)
    min_capability = (7, 0)

    def example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return SwiGLUGate(), (torch.randn(4, 128, dtype=torch.float16),)

    def match(self, graph: Graph, group: FusionGroup) -> stof_cc.GroupProblem:
        ops = [graph.node(n).op for n in group.nodes]
        if ops != ["split", "getitem", "getitem", "silu", "mul"]:
            raise NotFusable(f"group {group.name} is {ops}, not split -> silu(first) * second")
        # the op names alone do not say which pieces: the IR prints chunk(x, 2, -1) and split(x, 2, -1)
        # (pieces of width 2) alike, and silu(b) * a has the same ops. Check the shapes and the wiring.
        split, *pieces, silu, mul = (graph.node(n) for n in group.nodes)
        source = graph.node(split.args[0].name)
        shape = source.spec.shape
        halves = {piece.args[1]: piece for piece in pieces if piece.args[0].name == split.name}
        if shape[-1] % 2 or set(halves) != {0, 1} \
                or any(tuple(piece.spec.shape) != (*shape[:-1], shape[-1] // 2) for piece in pieces):
            raise NotFusable(f"%{split.name}: not two halves of the last dimension")
        if silu.args[0].name != halves[0].name or sorted(a.name for a in mul.args) != sorted((silu.name, halves[1].name)):
            raise NotFusable(f"group {group.name} is not silu(first half) * second half")
        # the one tensor the kernel reads: C parameter in0, the source value, read at the output's index
        return output_problem(graph, group).with_operands([kernel_operand(graph, source.name, "in0", "full")])

    def space(self, problem: stof_cc.GroupProblem) -> list[dict[str, Any]]:
        return [{"threads": 128}, {"threads": 256}]

    def kernel_name(self, problem: stof_cc.GroupProblem, params: dict[str, Any]) -> str:
        return f"stof_swiglu_t{params['threads']}"  # no group name: identical layers share one kernel

    def context(self, problem: stof_cc.GroupProblem, params: dict[str, Any]) -> dict[str, Any]:
        # beside these, the source receives name, header, operands, out_type and the point (threads)
        return {"rows": math.prod(problem.shape[:-1]), "half": problem.shape[-1]}

    def launch(self, problem: stof_cc.GroupProblem, params: dict[str, Any]) -> Launch:
        # grid, threads per CTA, dynamic shared-memory bytes
        return (-(-math.prod(problem.shape) // params["threads"]), 1, 1), params["threads"], 0

    # no estimate(): stage 1 uses the default (bytes read and written once at HBM speed)


def main() -> int:
    template = stof_cc.register_template(SwiGLUSplitTemplate())  # checked here: file, syntax, example
    print(f"registered {template.name} from {template.template_dir / template.source_file}")

    x = torch.randn(8, 512, 2 * 1024, dtype=torch.float16)
    graph, plan = lower(SwiGLUGate(), (x,))
    out_dir = Path("stof_build") / "custom_template"
    compile_kernels = "--no-nvcc" not in sys.argv
    builds = build_groups(graph, plan, out_dir, compile_kernels=compile_kernels)
    print(format_builds(builds, plan))
    (build,) = builds
    assert build.template == "swiglu_split", build.note
    print(f"\nits .cu: {build.path}" + (" (compiled by nvcc for sm_90)" if compile_kernels else ""))
    print("fused graph == reference:",
          torch.equal(stof_cc.interpret(graph, x), SwiGLUGate()(x)))

    if torch.cuda.is_available():
        from stof_cc.backends.group_launch import run_group
        from stof_cc.ir.reference import relative_error
        from stof_cc.tune.database import TuningDatabase
        from stof_cc.tune.model import tune_model

        problem = template.match(graph, plan.default.groups[0])
        got = run_group(template, problem, template.space(problem)[0], {"x": x.cuda()})
        want = SwiGLUGate()(x.cuda().float())
        err = relative_error(got, want)
        print(f"GPU: relative error against torch {err:.2e} -> {'OK' if err < 1e-2 else 'MISMATCH'}")
        _, (report,) = tune_model(graph, plan, (x,), database=TuningDatabase(out_dir / "tuning.sqlite"))
        print(f"chosen by the search: {report.winner.template.name} {report.winner.params}")
        return 0 if err < 1e-2 else 1
    print("no GPU: the kernel was not run (the search needs a GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
