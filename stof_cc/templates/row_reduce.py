"""Spec of the `row_reduce` template (row_reduce.cu.j2): softmax, LayerNorm or RMSNorm over
the last dimension, with the group's elementwise prologue (e.g. bias + residual) and
epilogue fused; one CTA per row, the row held in registers (rows up to 32 x threads)."""

from __future__ import annotations

import math
from typing import Any

import torch

from stof_cc.codegen import Chain, NotFusable
from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec
from stof_cc.passes.fusion import FusionGroup
from stof_cc.templates.group import (
    GroupProblem,
    GroupTemplate,
    c_type,
    chain_operands,
    kernel_operand,
    moved_bytes,
    output_problem,
)
from stof_cc.templates.registry import register_template
from stof_cc.tune.cost_model import row_reduce_us

THREAD_COUNTS = (128, 256, 512)
MAX_ITEMS = 32  # row elements per thread kept in registers


class RowReduceTemplate(GroupTemplate):
    name = "row_reduce"
    source_file = "row_reduce.cu.j2"
    kinds = ("reduction",)

    def match(self, graph: Graph, group: FusionGroup) -> GroupProblem:
        problem = output_problem(graph, group)
        anchor = graph.node(group.anchor)
        reduction, source, weight, bias, eps = reduction_inputs(graph, anchor, problem.shape)
        position = group.nodes.index(anchor.name)
        before, after = list(group.nodes[:position]), list(group.nodes[position + 1:])
        operands: list[dict[str, Any]] = []

        if before:
            if source.name != before[-1]:
                raise NotFusable(f"%{anchor.name}: its input %{source.name} is not the end of the group's prologue")
            prologue = Chain(graph, before, {}, problem.shape, operand_prefix="in")
            operands += chain_operands(graph, group, prologue)
            prologue_code, input_expr = prologue.code(" " * 12), prologue.result
        else:
            operands.append(kernel_operand(graph, source.name, "x_in", "full"))
            prologue_code, input_expr = "", "LOAD_FULL(x_in)"
        for ref, name in ((weight, "weight"), (bias, "bias")):
            if ref is not None:
                operands.append(kernel_operand(graph, ref.name, name, "row"))
        epilogue = Chain(graph, after, {anchor.name: "y"}, problem.shape, operand_prefix="ep")
        operands += chain_operands(graph, group, epilogue)
        problem.details = {"reduction": reduction, "eps": eps, "operands": operands,
                           "weight": "weight" if weight is not None else "", "bias": "bias" if bias is not None else "",
                           "prologue": prologue_code, "input": input_expr,
                           "epilogue": epilogue.code(" " * 12), "result": epilogue.result}
        return problem

    def example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return torch.nn.LayerNorm(64).half(), (torch.randn(4, 64, dtype=torch.float16),)

    def space(self, problem: GroupProblem) -> list[dict[str, Any]]:
        row = problem.shape[-1]
        return [{"threads": t} for t in THREAD_COUNTS
                if -(-row // t) <= MAX_ITEMS and (t == THREAD_COUNTS[0] or t <= row)]

    def estimate(self, problem: GroupProblem, params: dict[str, Any], sm_count: int) -> float:
        """Bandwidth, or waves of one-row CTAs (occupancy by warps: 64 per SM, at most 32 CTAs)."""
        ctas_per_sm = min(32, 64 // (params["threads"] // 32))
        return row_reduce_us(moved_bytes(problem), math.prod(problem.shape[:-1]), ctas_per_sm, sm_count)

    def kernel_name(self, problem: GroupProblem, params: dict[str, Any]) -> str:
        return f"stof_{problem.group.name}_row_reduce_{problem.details['reduction']}_t{params['threads']}"

    def render(self, problem: GroupProblem, params: dict[str, Any]) -> str:
        d, row = problem.details, problem.shape[-1]
        return self.render_source(name=self.kernel_name(problem, params), header=self.header(problem, params),
                           row=row, items=-(-row // params["threads"]), out_type=c_type(problem.dtype, f"%{problem.output}"),
                           eps=f"{d['eps']!r}f", **{k: d[k] for k in ("reduction", "operands", "weight", "bias",
                                                                       "prologue", "input", "epilogue", "result")},
                           **params)

    def launch(self, problem: GroupProblem, params: dict[str, Any]) -> tuple[tuple[int, int, int], int, int]:
        return (math.prod(problem.shape[:-1]), 1, 1), params["threads"], 0


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
            eps = torch.finfo(in_spec.dtype).eps if eps is None else eps
        return node.op, source, weight, bias, float(eps)
    raise NotFusable(f"%{node.name}: reduction {node.op} has no row_reduce form (softmax, layer_norm, rms_norm)")


ROW_REDUCE = register_template(RowReduceTemplate(), validate=False)  # validated in tests/test_register_template.py
