"""Spec of the `elementwise` template (elementwise.cu.j2): any fused chain of elementwise,
broadcast and layout ops with one output. A chain `Chain` expresses (operands read whole, by
row, as a scalar or as whole columns of a wider tensor: the pieces of a split along the last
dimension; views that regroup the leading dimensions; floating values) gets vector loads and stores
where rows hold whole vectors and every piece starts on one: VEC elements a thread, 16 bytes of the
widest tensor (a bf16 residual added into an fp32 output: 8-byte loads of it, 16-byte stores); any
other (a layout op, a broadcast of another shape, integer or boolean values, an embedding gather)
is an `IndexedChain`, scalar loads, one or four elements a thread (``unroll``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.codegen import Chain, IndexedChain, NotFusable
from stof_cc.ir.graph import Graph, TensorSpec
from stof_cc.passes.fusion import FusionGroup
from stof_cc.templates.group import (
    GroupProblem,
    GroupTemplate,
    chain_operands,
    moved_bytes,
    output_problem,
)
from stof_cc.templates.pricing import memory_bound_us
from stof_cc.templates.registry import Launch

THREAD_COUNTS = (128, 256)
UNROLLS = (1, 4)  # scalar path: elements per thread, THREADS apart: four 2-byte loads in flight per operand, not one
VECTOR_TYPES = {16: "uint4", 8: "uint2", 4: "uint32_t", 2: "uint16_t", 1: "uint8_t"}  # a vector's bytes -> one access


@dataclass(frozen=True)
class ElementwiseDetails:
    """What `ElementwiseTemplate.match` works out beside the operands."""

    chain: Chain | IndexedChain  # the group's nodes, one output element per evaluation (C++ indented per point)


Problem = GroupProblem[ElementwiseDetails]


class ElementwiseTemplate(GroupTemplate[ElementwiseDetails]):
    name = "elementwise"
    source_file = "elementwise.cu.j2"
    waits_for_producers = True  # the kernel waits first (dependent_launch.j2)
    kinds = ("elementwise",)
    any_dtype = True

    def match(self, graph: Graph, group: FusionGroup) -> Problem:
        problem = output_problem(graph, group, any_dtype=True)
        if not problem.shape:
            raise NotFusable(f"group {group.name}: a 0-d output is not worth a kernel")
        try:
            chain: Chain | IndexedChain = Chain(graph, group.nodes, {}, problem.shape, layouts=True)
        except NotFusable:  # the general form: any layout op, broadcast and value type
            chain = IndexedChain(graph, group.nodes, problem.shape, index="idx")
        operands = chain_operands(graph, group, chain, any_dtype=True)
        if not operands:
            raise NotFusable(f"group {group.name}: reads no tensor (canonicalize folds such chains)")
        return problem.with_operands(operands, ElementwiseDetails(chain))

    def example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return _BiasGeluResidual(), (torch.randn(4, 64, dtype=torch.float16), torch.randn(4, 64, dtype=torch.float16))

    def space(self, problem: Problem) -> list[dict[str, Any]]:
        scalar = [{"threads": t, "vec": 1, "unroll": u} for t in THREAD_COUNTS for u in UNROLLS]
        if isinstance(problem.details.chain, IndexedChain):  # index arithmetic per element: no vectors
            return scalar
        vec = 16 // max(spec.dtype.itemsize for spec in self._vector_specs(problem))
        row = problem.shape[-1]
        pieces = [n for op in problem.operands if op.access == "columns" for n in (op.offset, op.row_stride)]
        whole = vec > 1 and math.prod(problem.shape) % vec == 0 and row % vec == 0 and all(n % vec == 0 for n in pieces)
        return scalar + ([{"threads": t, "vec": vec} for t in THREAD_COUNTS] if whole else [])

    def _vector_specs(self, problem: Problem) -> list[TensorSpec]:
        """The specs of the tensors read and written in vectors: the output and every operand but the scalars
        (read once, at 0: an fp32 gain beside bf16 tensors leaves the vectors 8 wide)."""
        refs = [op.ref for op in problem.operands if op.access != "scalar"] + [problem.output]
        return [problem.graph.node(r).spec for r in refs]

    def estimate(self, problem: Problem, params: dict[str, Any], sm_count: int) -> float:
        """Bandwidth-bound; scalar accesses reach about 60% of it one element a thread, more with four."""
        return memory_bound_us(moved_bytes(problem), 1.0 if params["vec"] > 1 else SCALAR_SHARE[unroll_of(params)])

    def aligned_operands(self, problem: Problem, params: dict[str, Any]) -> list[str]:
        if params["vec"] == 1:
            return []
        return [op.ref for op in problem.operands if op.access not in ("scalar", "gather")]

    def kernel_name(self, problem: Problem, params: dict[str, Any]) -> str:
        unroll = unroll_of(params)
        return f"stof_elementwise_t{params['threads']}_v{params['vec']}" + (f"_u{unroll}" if unroll > 1 else "")

    def context(self, problem: Problem, params: dict[str, Any]) -> dict[str, Any]:
        chain = problem.details.chain
        graph, vec = problem.graph, params["vec"]
        return {"n": math.prod(problem.shape), "row": problem.shape[-1],
                "chain": chain.code(" " * 12 if vec > 1 else " " * 16), "result": chain.result, "per_thread": unroll_of(params),
                # each operand's VEC elements move as one access of their bytes
                "vector_type": {op.name: VECTOR_TYPES[vec * graph.node(op.ref).spec.dtype.itemsize]
                                for op in problem.operands if op.access != "scalar"},
                "out_vector_type": VECTOR_TYPES[vec * problem.dtype.itemsize]}

    def launch(self, problem: Problem, params: dict[str, Any]) -> Launch:
        per_cta = params["threads"] * params["vec"] * unroll_of(params)
        return (min(-(-math.prod(problem.shape) // per_cta), 2**31 - 1), 1, 1), params["threads"], 0


SCALAR_SHARE = {1: 0.6, 4: 0.8}  # of the bandwidth, by elements per thread (stage 1's prior; stage 2 measures)


def unroll_of(params: dict[str, Any]) -> int:
    """The scalar path's elements per thread (1 in points recorded before there was a choice)."""
    return params.get("unroll", 1)


class _BiasGeluResidual(torch.nn.Module):
    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x + 1.0) * 0.5 + r


ELEMENTWISE = ElementwiseTemplate()
