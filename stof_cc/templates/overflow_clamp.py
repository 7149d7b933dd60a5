"""Spec of the `overflow_clamp` template (overflow_clamp.cu.j2): T5's fp16 overflow guard
(``ir.ops.overflow_clamp_reference``) as one kernel and one pass over x. An element's result
depends on the whole-tensor ``any(isinf(x))`` only when the two caps clamp it differently and
it is finite (fp16 magnitudes above 64512, in practice never): a CTA holding such an element that
saw no infinity itself scans x for one before it writes those elements again. So the common
case reads x once and writes the output once, with no grid-wide synchronisation. An
epilogue that reads no other tensor (the cast before T5's final RMSNorm) is fused."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.codegen import Chain, NotFusable, NotItsPattern
from stof_cc.ir.graph import Graph, Ref
from stof_cc.passes.fusion import FusionGroup
from stof_cc.templates.group import (
    AnchorInput,
    GroupProblem,
    GroupTemplate,
    anchor_input,
    c_type,
    moved_bytes,
    output_problem,
)
from stof_cc.templates.pricing import memory_bound_us
from stof_cc.templates.registry import Launch

THREADS = 256
MAX_CTAS = 1024  # grid-stride beyond: bounds the rare slow path's whole-tensor scans


@dataclass(frozen=True)
class OverflowClampDetails:
    """The chains around the clamp: how x is read (a prologue computes it, or x is read
    directly, with 16-byte vectors where they fit) and the epilogue from the clamped value ``c``."""

    read: AnchorInput
    epilogue: Chain


Problem = GroupProblem[OverflowClampDetails]


class OverflowClampTemplate(GroupTemplate[OverflowClampDetails]):
    name = "overflow_clamp"
    source_file = "overflow_clamp.cu.j2"
    waits_for_producers = True  # the kernel waits first (dependent_launch.j2)
    kinds = ("reduction",)

    def match(self, graph: Graph, group: FusionGroup) -> Problem:
        anchor = graph.node(group.anchor)
        if anchor.op != "overflow_clamp":
            raise NotItsPattern(f"%{anchor.name}: {anchor.op} is not an overflow_clamp")
        problem = output_problem(graph, group)
        x = anchor.args[0]
        if not isinstance(x, Ref) or tuple(graph.node(x.name).spec.shape) != problem.shape:
            raise NotFusable(f"%{anchor.name}: its input is not a tensor of the output's shape")
        read = anchor_input(graph, group, x.name, problem.shape)
        epilogue = Chain(graph, read.after, {anchor.name: "c"}, problem.shape, operand_prefix="ep")
        if epilogue.operands:
            raise NotFusable(f"group {group.name}: the epilogue after overflow_clamp reads other tensors")
        return problem.with_operands(read.operands, OverflowClampDetails(read, epilogue))

    def example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return _GuardedResidual(), (torch.randn(4, 64, dtype=torch.float16), torch.randn(4, 64, dtype=torch.float16))

    def space(self, problem: Problem) -> list[dict[str, Any]]:
        vec = 16 // problem.dtype.itemsize
        vectors = problem.details.read.prologue is None and math.prod(problem.shape) % vec == 0 \
            and problem.graph.node(problem.operands[0].ref).spec.dtype.itemsize == problem.dtype.itemsize
        return [{"vec": v} for v in ((1, vec) if vectors else (1,))]

    def estimate(self, problem: Problem, params: dict[str, Any], sm_count: int) -> float:
        return memory_bound_us(moved_bytes(problem), 1.0 if params["vec"] > 1 else 0.6)

    def aligned_operands(self, problem: Problem, params: dict[str, Any]) -> list[str]:
        return [problem.operands[0].ref] if params["vec"] > 1 else []

    def kernel_name(self, problem: Problem, params: dict[str, Any]) -> str:
        return f"stof_overflow_clamp_v{params['vec']}"

    def context(self, problem: Problem, params: dict[str, Any]) -> dict[str, Any]:
        x, *caps = problem.graph.node(problem.group.anchor).args
        # torch.clamp rounds its bounds to x's dtype (fp16: 64504 -> 64512), so the clamped value is one of x's
        cap_if_inf, cap = (torch.tensor(c, dtype=problem.graph.node(x.name).spec.dtype).item() for c in caps)
        read, epilogue = problem.details.read, problem.details.epilogue
        return {"n": math.prod(problem.shape), "row": problem.shape[-1], "threads": THREADS,
                "x_type": c_type(problem.graph.node(x.name).spec.dtype, f"%{x.name}"),
                "cap_if_inf": f"{float(cap_if_inf)!r}f", "cap": f"{float(cap)!r}f",
                "prologue": read.code(" " * 12),
                "input": read.expression,
                "epilogue": epilogue.code(" " * 4), "result": epilogue.result}

    def launch(self, problem: Problem, params: dict[str, Any]) -> Launch:
        per_cta = THREADS * params["vec"]
        return (max(1, min(-(-math.prod(problem.shape) // per_cta), MAX_CTAS)), 1, 1), THREADS, 0


class _GuardedResidual(torch.nn.Module):
    """A residual add with T5's guard, as transformers writes it."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = x + r
        bound = torch.where(torch.isinf(y).any(), torch.finfo(y.dtype).max - 1000, torch.finfo(y.dtype).max)
        return torch.clamp(y, min=-bound, max=bound)


OVERFLOW_CLAMP = OverflowClampTemplate()
