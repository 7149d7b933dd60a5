"""Spec of the `gemm_layernorm` template (gemm_layernorm.cu.j2, which extends gemm_epilogue's):
GEMM + bias + elementwise (the residual add) + LayerNorm or RMSNorm over the GEMM's rows +
elementwise, one kernel. The fusion pass offers this group as an alternative scheme (a norm
reading only a GEMM group's output, rows of at most 1024); `stof_cc.tune.scheme` takes it when
its estimate beats the two-kernel form (gemm_epilogue, then row_reduce).

A row of N = 768 does not fit one CTA's accumulators at a tile height that fills the GPU
(4096 rows / 64 = 64 CTAs for 132 SMs), so a cluster of ceil(N / block_n) CTAs (at most 8,
the portable cluster size) holds the rows and sums them through distributed shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.codegen import Chain, NotFusable, NotItsPattern
from stof_cc.ir.graph import Graph
from stof_cc.passes.fusion import FusionGroup
from stof_cc.templates.gemm_epilogue import (
    BLOCK_MS,
    BLOCK_NS,
    SMEM_LIMIT,
    STAGE_COUNTS,
    GemmDetails,
    GemmEpilogueTemplate,
    fields_of,
    gemm_anchor,
    gemm_details,
    split_epilogue,
)
from stof_cc.templates.group import GroupProblem, chain_operands, output_problem, outside_operand
from stof_cc.templates.pricing import ROW_EXCHANGE_US, WIDE_CLUSTER_RATE
from stof_cc.templates.registry import Launch
from stof_cc.templates.row_reduce import reduction_inputs

NORMS = ("layer_norm", "rms_norm")
MAX_CLUSTER = 8  # portable cluster size
ROW_LIMIT = 1024  # widest row a cluster holds in registers and shared memory


@dataclass(frozen=True, kw_only=True)
class GemmLayerNormDetails(GemmDetails):
    """gemm_epilogue's details (the chain up to the norm; a row-major store, not through TMA)
    and the norm's: the operands add its weight and bias, then the trailing chain's."""

    norm: str  # "layer_norm" or "rms_norm"
    eps: float
    weight: str  # the norm weight's C name ("ln_weight"), "" without one
    bias: str  # the norm bias's C name ("ln_bias"), "" without one
    post_chain: str  # C++ of the trailing chain from the normalised value ``acc_v``
    post_result: str
    post_ops: int  # nodes in the trailing chain (its registers, `_fits_registers`)


Problem = GroupProblem[GemmLayerNormDetails]


class GemmLayerNormTemplate(GemmEpilogueTemplate):
    name = "gemm_layernorm"
    source_file = "gemm_layernorm.cu.j2"

    def match(self, graph: Graph, group: FusionGroup) -> Problem:
        problem = output_problem(graph, group)
        anchor, tail = gemm_anchor(graph, group)
        norms = [name for name in tail if graph.node(name).op in NORMS]
        if len(norms) != 1:
            refusal = NotFusable if norms else NotItsPattern
            raise refusal(f"%{anchor.name}: gemm_layernorm needs one LayerNorm or RMSNorm after the GEMM, "
                          f"found {len(norms)}")
        at = tail.index(norms[0])
        norm = graph.node(norms[0])
        kind, source, weight, bias, eps = reduction_inputs(graph, norm, problem.shape)
        if source.name != (tail[at - 1] if at else anchor.name):
            raise NotFusable(f"%{norm.name}: normalises %{source.name}, not the end of the GEMM's epilogue")
        before, before_layout = split_epilogue(graph, tail[:at])
        after, after_layout = split_epilogue(graph, tail[at + 1:])
        if before_layout or after_layout:
            raise NotFusable(f"%{norm.name}: layout changes around the norm are not generated")
        operands, gemm = gemm_details(graph, group, anchor, before)  # a row-major store without TMA
        if gemm.n > ROW_LIMIT:
            raise NotFusable(f"%{norm.name}: rows of {gemm.n} (at most {ROW_LIMIT})")
        for ref, role in ((weight, "ln_weight"), (bias, "ln_bias")):
            if ref is not None:
                operands.append(outside_operand(graph, group, ref.name, role, "row"))
        post = Chain(graph, after, {norm.name: "acc_v"}, problem.shape, operand_prefix="post")
        operands += chain_operands(graph, group, post)
        details = GemmLayerNormDetails(
            **fields_of(gemm), norm=kind, eps=eps, weight="ln_weight" if weight is not None else "",
            bias="ln_bias" if bias is not None else "", post_chain=post.code(" " * 12), post_result=post.result,
            post_ops=len(after))
        return problem.with_operands(operands, details)

    def example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).half(), (
            torch.randn(4, 64, dtype=torch.float16),)

    def space(self, problem: Problem) -> list[dict[str, Any]]:
        """Cooperative tiles only (the cluster holds one row block at a time); block_n so that
        at most 8 CTAs cover a row; and no point whose registers would spill (see
        `_fits_registers`)."""
        points = []
        for block_m in BLOCK_MS:
            for block_n in BLOCK_NS:
                if (-(-problem.details.n // block_n) > MAX_CLUSTER
                        or not _fits_registers(block_m, block_n, problem.details.post_ops)):
                    continue
                for stages in STAGE_COUNTS:
                    params = {"schedule": "cooperative", "block_m": block_m, "block_n": block_n, "stages": stages}
                    if self.shared_bytes(problem, params) + 2 * block_m * 4 <= SMEM_LIMIT:
                        points.append(params)
        return points

    def estimate(self, problem: Problem, params: dict[str, Any], sm_count: int) -> float:
        tiles_us = super().estimate(problem, params, sm_count)
        if self._cluster(problem, params) > 3:
            tiles_us /= WIDE_CLUSTER_RATE
        return tiles_us + ROW_EXCHANGE_US

    def kernel_name(self, problem: Problem, params: dict[str, Any]) -> str:
        return super().kernel_name(problem, params).replace("_gemm_", "_gemm_ln_", 1)

    def context(self, problem: Problem, params: dict[str, Any]) -> dict[str, Any]:
        """gemm_epilogue's, the norm's eps as a C float and the cluster size; row-major tiles
        (a cluster's CTAs, consecutive in the grid, hold one row block)."""
        return super().context(problem, params) | {"eps": f"{problem.details.eps!r}f", "raster_rows": 1,
                                                   "cluster": self._cluster(problem, params)}

    def launch(self, problem: Problem, params: dict[str, Any]) -> Launch:
        """One tile per CTA (grid = row blocks x cluster, the cluster along x, set in the source)."""
        tiles = -(-problem.details.m // params["block_m"]) * self._cluster(problem, params)
        return (tiles, 1, 1), params["block_m"] // 64 * 128 + 128, self.shared_bytes(problem, params)

    @staticmethod
    def _cluster(problem: Problem, params: dict[str, Any]) -> int:
        return -(-problem.details.n // params["block_n"])


def _fits_registers(block_m: int, block_n: int, post_ops: int) -> bool:
    """Whether a consumer thread's pre-norm values (block_n / 2: a warpgroup holds 64 rows),
    the norm's state and addressing (~40) and the trailing chain (~8 per op) fit ptxas's cap:
    168 registers at 384 threads (block_m 128; ptxas allocates by the launch bound, not the
    setmaxnreg raise), 255 at 256; checked against ptxas (docs/decisions.md#layernorm-gemm-registers).
    One measured exception: 64 x 256 with a trailing op takes 254-255 registers and spills 8 bytes."""
    cap = 168 if block_m == 128 else 255
    if block_m == 64 and block_n == 256 and post_ops:
        return False
    return block_n // 2 + 40 + 8 * post_ops <= cap


GEMM_LAYERNORM = GemmLayerNormTemplate()
