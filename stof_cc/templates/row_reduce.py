"""Spec of the `row_reduce` template (row_reduce.cu.j2): softmax, LayerNorm or RMSNorm over
the last dimension, with the group's elementwise prologue (e.g. bias + residual) and
epilogue fused, or one value per row (sum, mean, amax, var over the last dimension: a norm
written out in primitives, as Cohere's LayerNorm, with the prologue fused; what reads the
value runs in the next group, which broadcasts it); the row held in registers (at most MAX_ITEMS elements per thread), by one
warp (several rows per CTA, warp-shuffle reductions only) or by a whole CTA (one row per CTA,
CTA-wide reductions), with 16-byte vector loads and stores where rows hold whole vectors (operands
of another item size than the output's read element by element within each vector)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.codegen import Chain, IndexedChain, NotFusable, NotItsPattern, rounded_to
from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec
from stof_cc.passes.fusion import FusionGroup
from stof_cc.templates.group import (
    GroupProblem,
    GroupTemplate,
    KernelOperand,
    anchor_input,
    chain_operands,
    moved_bytes,
    output_problem,
    outside_operand,
)
from stof_cc.templates.pricing import (
    ROW_CTA_VECTOR_RATE,
    ROW_SCALAR_RATE,
    ROW_WARP_VECTOR_RATE,
    row_reduce_us,
    sm_count,
)
from stof_cc.templates.registry import Launch

THREAD_COUNTS = (128, 256, 512)  # the CTA layout: one row per CTA of this many threads
WARP_ROWS = (4, 8)               # the warp layout: one row per warp, this many rows (warps) per CTA
MAX_ITEMS = 32  # row elements per thread kept in registers
ROW_VALUES = ("sum", "mean", "amax", "var")  # reductions to one value per row


@dataclass(frozen=True)
class RowReduceDetails:
    """What `RowReduceTemplate.match` works out beside the operands (which are the prologue's
    operands, then the epilogue's)."""

    reduction: str  # "softmax", "layer_norm", "rms_norm", or a row value: "sum", "mean", "amax", "var"
    eps: float  # the norm's (0 for softmax); var's correction
    row: int  # the reduced (last) dimension of the input
    rows: int  # rows reduced
    indexed: bool  # the prologue is an IndexedChain (layout ops, broadcasts): scalar points only
    prologue_operands: tuple[KernelOperand, ...]  # read before the reduction (or the input itself)
    epilogue_operands: tuple[KernelOperand, ...]  # read after it: the norm's weight and bias, the epilogue's
    weight: str  # the norm weight's C name ("weight"), "" without one
    bias: str  # the norm bias's C name ("bias"), "" without one
    prologue: str  # C++ of the prologue chain, "" without one
    input: str  # the expression of the reduction's input element
    epilogue: str  # C++ of the epilogue chain from the reduction's value ``y``
    result: str  # the epilogue's result expression


Problem = GroupProblem[RowReduceDetails]


class RowReduceTemplate(GroupTemplate[RowReduceDetails]):
    name = "row_reduce"
    source_file = "row_reduce.cu.j2"
    waits_for_producers = True  # the kernel waits first (dependent_launch.j2)
    kinds = ("reduction",)

    def match(self, graph: Graph, group: FusionGroup) -> Problem:
        problem = output_problem(graph, group)
        anchor = graph.node(group.anchor)
        if anchor.op in ROW_VALUES:
            reduction, source, eps = row_value_inputs(graph, anchor)
            weight = bias = None
            if group.nodes[-1] != anchor.name:
                raise NotFusable(f"%{anchor.name}: what reads the {anchor.op} of a row runs in its own group "
                                 "(a row value has no epilogue here)")
        else:
            reduction, source, weight, bias, eps = reduction_inputs(graph, anchor, problem.shape)
        in_shape = tuple(graph.node(source.name).spec.shape)

        # read before the reduction (the prologue, or the input itself) / after it (the norm's
        # weight and bias, the epilogue): each loop of the kernel loads only its own operands
        read = anchor_input(graph, group, source.name, in_shape, indexed=True)
        prologue_operands = read.operands
        prologue_code, input_expr = read.code(" " * 16), read.expression
        if read.prologue is not None:  # the reduction reads its input as eager holds it: rounded to its dtype
            input_expr = rounded_to(input_expr, graph.node(source.name).spec.dtype)
        epilogue_operands = [outside_operand(graph, group, ref.name, name, "row")
                             for ref, name in ((weight, "weight"), (bias, "bias")) if ref is not None]
        epilogue = Chain(graph, read.after, {anchor.name: "y"}, in_shape, operand_prefix="ep")
        epilogue_operands += chain_operands(graph, group, epilogue)
        details = RowReduceDetails(
            reduction=reduction, eps=eps, row=in_shape[-1], rows=math.prod(in_shape[:-1]),
            indexed=isinstance(read.prologue, IndexedChain),
            prologue_operands=tuple(prologue_operands),
            epilogue_operands=tuple(epilogue_operands), weight="weight" if weight is not None else "",
            bias="bias" if bias is not None else "", prologue=prologue_code, input=input_expr,
            epilogue=epilogue.code(" " * 16), result=epilogue.result)
        return problem.with_operands(prologue_operands + epilogue_operands, details)

    def example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return torch.nn.LayerNorm(64).half(), (torch.randn(4, 64, dtype=torch.float16),)

    def space(self, problem: Problem) -> list[dict[str, Any]]:
        """Vector points first, then scalar ones; within each, the warp layout (rows of at most
        32 x MAX_ITEMS elements) before the CTA layout (a CTA wider than 128 threads only where
        every thread holds part of the row). Stage 1 breaks ties in this order."""
        row = problem.details.row
        widest = self.vector_width(problem)
        points = []
        vectorised = widest > 1 and row % widest == 0 and not problem.details.indexed
        for vec in ((widest, 1) if vectorised else (1,)):
            vectors = row // vec
            points += [{"row_threads": 32, "rows": rows, "vec": vec} for rows in WARP_ROWS
                       if -(-vectors // 32) * vec <= MAX_ITEMS]
            points += [{"row_threads": t, "rows": 1, "vec": vec} for t in THREAD_COUNTS
                       if -(-vectors // t) * vec <= MAX_ITEMS and (t == THREAD_COUNTS[0] or t <= vectors)]
        return points

    @staticmethod
    def vector_width(problem: Problem) -> int:
        """Elements per vector: 16 bytes of the output's type. Operands of that item size are
        read as one 16-byte load a vector; the others (an fp32 weight beside fp16 rows: Cohere's
        and T5's norms) element by element within it (`packed_operands`)."""
        return 16 // problem.dtype.itemsize

    @staticmethod
    def packed_operands(problem: Problem) -> list[str]:
        """The operands read with 16-byte loads at vector points: tensors of the output's item size."""
        graph = problem.graph
        return [op.ref for op in problem.operands
                if op.access != "scalar" and graph.node(op.ref).spec.dtype.itemsize == problem.dtype.itemsize]

    def estimate(self, problem: Problem, params: dict[str, Any], sm_count: int) -> float:
        """Bandwidth at the layout's rate (`pricing.ROW_*_RATE`), or waves of CTAs when rows
        are few (occupancy by warps: 64 per SM, at most 32 CTAs)."""
        warps = params["row_threads"] * params["rows"] // 32
        rows_per_sm = min(32, 64 // warps) * params["rows"]
        if params["vec"] == 1:
            rate = ROW_SCALAR_RATE
        else:
            rate = ROW_WARP_VECTOR_RATE if params["row_threads"] == 32 else ROW_CTA_VECTOR_RATE
        return row_reduce_us(moved_bytes(problem), problem.details.rows, rows_per_sm, sm_count, rate)

    def default_params(self, problem: Problem) -> dict[str, Any]:
        """Stage 1's pick (the first point of the best estimate)."""
        return min(self.space(problem), key=lambda params: self.estimate(problem, params, sm_count()))

    def aligned_operands(self, problem: Problem, params: dict[str, Any]) -> list[str]:
        if params["vec"] == 1:
            return []
        return self.packed_operands(problem)

    def kernel_name(self, problem: Problem, params: dict[str, Any]) -> str:
        return (f"stof_row_reduce_{problem.details.reduction}"
                f"_t{params['row_threads']}x{params['rows']}_v{params['vec']}")

    def context(self, problem: Problem, params: dict[str, Any]) -> dict[str, Any]:
        d, row = problem.details, problem.details.row
        vectors = row // params["vec"]
        packed = set(self.packed_operands(problem))
        return {"row": row, "m": d.rows, "row_value": d.reduction in ROW_VALUES,
                "packed": {op.name for op in problem.operands if op.ref in packed}, "items": -(-vectors // params["row_threads"]),
                "threads": params["row_threads"] * params["rows"], "reduction": d.reduction, "eps": f"{d.eps!r}f",
                "prologue_operands": d.prologue_operands, "epilogue_operands": d.epilogue_operands,
                "weight": d.weight, "bias": d.bias, "prologue": d.prologue, "input": d.input,
                "epilogue": d.epilogue, "result": d.result}

    def launch(self, problem: Problem, params: dict[str, Any]) -> Launch:
        return (-(-problem.details.rows // params["rows"]), 1, 1), params["row_threads"] * params["rows"], 0


def reduction_inputs(graph: Graph, node: Node, shape: tuple[int, ...]) -> tuple[str, Ref, Ref | None, Ref | None, float]:
    """(kind, input, weight, bias, eps) of a last-dimension softmax / LayerNorm / RMSNorm."""
    args = list(node.args)
    source = args[0] if args else None
    if not isinstance(source, Ref) or not isinstance(node.spec, TensorSpec):
        raise NotFusable(f"%{node.name}: {node.op} with a non-tensor input or a tuple output ({node.target})")
    in_spec = graph.node(source.name).spec
    if tuple(in_spec.shape) != shape:
        raise NotFusable(f"%{node.name}: input shape {tuple(in_spec.shape)} differs from the output's {shape}")
    row = shape[-1]
    if node.op == "softmax":
        dim = args[1] if len(args) > 1 else node.kwargs.get("dim")
        if dim is None or dim % len(shape) != len(shape) - 1:
            raise NotFusable(f"%{node.name}: softmax over dim {dim}; only the last dimension is generated")
        return "softmax", source, None, None, 0.0
    if node.op in ("layer_norm", "rms_norm"):
        normalized = args[1] if len(args) > 1 else node.kwargs.get("normalized_shape")
        if list(normalized or []) != [row]:
            raise NotFusable(f"%{node.name}: normalises over {normalized}; only the last dimension ({row}) is generated")
        weight = args[2] if len(args) > 2 else node.kwargs.get("weight")
        if node.op == "layer_norm":
            bias = args[3] if len(args) > 3 else node.kwargs.get("bias")
            eps = args[4] if len(args) > 4 else node.kwargs.get("eps", 1e-5)
        else:
            bias = None
            eps = args[3] if len(args) > 3 else node.kwargs.get("eps")
            eps = rms_norm_default_eps(in_spec.dtype) if eps is None else eps
        return node.op, source, weight, bias, float(eps)
    raise NotItsPattern(f"%{node.name}: reduction {node.op} has no row_reduce form (softmax, layer_norm, rms_norm)")


def rms_norm_default_eps(dtype: torch.dtype) -> float:
    """``rms_norm``'s eps when none is given, as torch's decomposition takes it: float32's machine
    epsilon for fp16, bf16 and fp32 inputs (not the input dtype's, which for fp16 is 8192 times
    larger and moved rows of small RMS by up to half their value: found by review), float64's else."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def row_value_inputs(graph: Graph, node: Node) -> tuple[str, Ref, float]:
    """(kind, input, var's correction) of a sum / mean / amax / var over the last dimension
    alone, keepdim or not; NotFusable otherwise."""
    source = node.args[0] if node.args else None
    if not isinstance(source, Ref) or not isinstance(node.spec, TensorSpec):
        raise NotFusable(f"%{node.name}: {node.op} with a non-tensor input or a tuple output ({node.target})")
    in_shape = tuple(graph.node(source.name).spec.shape)
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else dims
    if not in_shape or not dims or len(dims) != 1 or dims[0] % len(in_shape) != len(in_shape) - 1:
        raise NotFusable(f"%{node.name}: {node.op} over dims {dims} of {list(in_shape)}; only the last one alone "
                         "is generated")
    if math.prod(node.spec.shape) != math.prod(in_shape[:-1]):
        raise NotFusable(f"%{node.name}: {node.op} gives {node.spec}, not one value per row")
    correction = 0.0
    if node.op == "var":  # var.correction(x, dim, *, correction, keepdim); var.dim(x, dim, unbiased, keepdim)
        unbiased = node.args[2] if node.target == "aten.var.dim" and len(node.args) > 2 \
            else node.kwargs.get("unbiased", True)
        correction = node.kwargs.get("correction", 1 if unbiased else 0)
        correction = 1.0 if correction is None else float(correction)
    if node.op == "amax" and node.target not in (None, "aten.amax.default"):
        raise NotFusable(f"%{node.name}: {node.target} returns indices too; only amax is generated")
    return node.op, source, correction


ROW_REDUCE = RowReduceTemplate()
