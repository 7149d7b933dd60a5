"""Spec of the `gemm_epilogue` template (gemm_epilogue.cu.j2): a GEMM group anchored by
``linear`` (x W^T + b), its elementwise epilogue (activation, residual, scale, cast) applied
to the fp32 accumulators, and trailing view/transpose/permute nodes folded into the store
index (the head split of Q/K/V projections).

Hopper only (sm_90a): wgmma fed by TMA from a producer warpgroup, A and W read through tensor
maps the launcher encodes (`tensor_maps`). Persistent: one CTA per SM walks the output tiles,
its producer running ahead into the next tile; under ``pingpong`` two consumer warpgroups take
alternate tiles so one's epilogue hides under the other's tensor-core work, under
``cooperative`` they share each tile. Row-major outputs (N a multiple of 8) leave through a
ring of two shared staging boxes (one at block_n 64) and asynchronous TMA stores (``tma_store``); a residual, if
any, is *staged*: TMA loads its boxes into the staging area (the whole tile where it fits beside the stages, else
the ring) from under the products on. Rings of 3 or 4 operand stages, and the deepest of up to 8
that fits, for small cold GEMMs. Where the tiles make at most two waves, cooperative 128 x 256 tiles
also come as W-multicast twins (``"multicast": 2``): clusters of two CTAs on units of two row tiles
sharing a column tile, each loading half of every W chunk into both, which is how cuBLAS runs
those shapes; priced as their one-CTA twins, so only stage 2's measurement picks them.
Why (with the figures): docs/decisions.md#gemm-on-wgmma, #gemm-operands-by-tma,
#staged-residual, #staging-ring, #staged-residual-ring, #deep-rings, #mainloop-instructions, #multicast-clusters (taken out
twice at more waves, back for one or two),
#taller-cooperative-tiles, #deferred-epilogue, #split-k-and-stream-k; the tile order: #tile-bands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from stof_cc.codegen import Chain, NotFusable, NotItsPattern
from stof_cc.ir.graph import Graph, Node, Ref
from stof_cc.passes.fusion import FusionGroup
from stof_cc.templates.group import (
    MIRROR_MAP,
    OUTPUT_MAP,
    GroupProblem,
    GroupTemplate,
    KernelOperand,
    chain_operands,
    kernel_operand,
    moved_bytes,
    output_problem,
)
from stof_cc.templates.pricing import epilogue_cost, gemm_us, sm_count
from stof_cc.templates.registry import Launch

BLOCK_MS = (64, 128)   # cooperative: one or two consumer warpgroups of 64 rows; ping-pong: per warpgroup
BLOCK_NS = (64, 128, 192, 256)  # 192: N = 768 in four column tiles fills 132 SMs better
STAGE_COUNTS = (3, 4)  # 5 and 6 stages were never a shape's best point in the fifth session (docs/decisions.md#staging-ring)
DEEP_STAGES = 8  # and the deepest ring that fits, up to this, where it is deeper than 4 (docs/decisions.md#deep-rings)
SCHEDULES = ("cooperative", "pingpong")
MULTICAST = 2  # CTAs per cluster of a multicast twin
MULTICAST_WAVES = 2  # multicast twins where the tiles make at most this many waves
SMEM_LIMIT = 227 * 1024
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232  # (65536 - 128 x 40) / 256, rounded down to a multiple of 8
LAYOUT_OPS = ("view", "contiguous", "clone", "unsqueeze", "squeeze")  # keep the row-major element order
MMA_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
ROW_MAJOR_STORE = " " * 12 + "long long out_index = (long long)row * N + col;"


@dataclass(frozen=True, kw_only=True)
class GemmDetails:
    """What `GemmEpilogueTemplate.match` works out beside the operands (A, W, the bias, then the
    epilogue chain's); every field is a value of the source."""

    m: int  # rows of A (every leading dimension)
    n: int  # rows of W: output columns
    k: int
    dtype: str  # the products' input type: "float16" or "bfloat16"
    chain: str  # C++ from the accumulator ``acc_v`` (plus the bias) to ``result``
    result: str
    epilogue_ops: float  # the chain's cost for stage 1 (`pricing.epilogue_cost`)
    staged: int | None  # index in the operands of the residual loaded into the staging tile, or None
    paired_store: bool  # columns (c, c + 1), c even, adjacent and pair-aligned in the output
    store_index: str = ROW_MAJOR_STORE  # C++ computing ``out_index`` of element (row, col)
    tma_store: bool = False  # the output leaves through staging tiles and TMA stores
    mirror: bool = False  # each box also stored into a peer GPU's buffer (`mirrored`; runtime/peer_exchange.py)


Problem = GroupProblem[GemmDetails]


class GemmEpilogueTemplate(GroupTemplate[GemmDetails]):
    name = "gemm_epilogue"
    source_file = "gemm_epilogue.cu.j2"
    waits_for_producers = True  # the kernel waits first (dependent_launch.j2)
    kinds = ("gemm",)
    arch_features = "a"
    capabilities = ((9, 0),)

    def match(self, graph: Graph, group: FusionGroup) -> Problem:
        problem = output_problem(graph, group)
        anchor, tail = gemm_anchor(graph, group)
        elementwise, layout = split_epilogue(graph, tail)
        n = graph.node(anchor.args[1].name).spec.shape[0]
        # TMA stores the output where it stays row-major [..., N] with 16-byte rows (the launcher
        # encodes the output's map over its last dimension: a view that splits N cannot use it)
        row_major = all(node.op != "transpose" for node in layout) and problem.shape[-1] == n
        tma_store = row_major and problem.dtype in MMA_DTYPES and n % 8 == 0
        operands, details = gemm_details(graph, group, anchor, elementwise, problem.dtype if tma_store else None)
        store_index, paired = _store_index(graph, anchor, layout)
        details = replace(details, store_index=store_index, paired_store=paired, tma_store=tma_store)
        return problem.with_operands(operands, details)

    def example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return torch.nn.Linear(64, 64).half(), (torch.randn(4, 64, dtype=torch.float16),)

    def space(self, problem: Problem) -> list[dict[str, Any]]:
        points = []
        for schedule in SCHEDULES:
            for block_m in BLOCK_MS:
                for block_n in BLOCK_NS:
                    for stages in _stage_counts(problem, schedule, block_m, block_n):
                        params = {"schedule": schedule, "block_m": block_m, "block_n": block_n, "stages": stages}
                        # accumulators (a warpgroup's rows x block_n / 128 threads), addressing and the epilogue
                        registers = _rows_per_warpgroup(params) * block_n // 128 + 48
                        limit = CONSUMER_REGISTERS if _consumer_warpgroups(params) > 1 else 255
                        if self.shared_bytes(problem, params) <= SMEM_LIMIT and registers <= limit:
                            points.append(params)
        return points + [params | {"multicast": MULTICAST} for params in points if _multicast_twin(problem.details, params)]

    def default_params(self, problem: Problem) -> dict[str, Any]:
        """Stage 1's pick (how it compares with the measured best: docs/decisions.md#gemm-default-point)."""
        return min(self.space(problem), key=lambda params: self.estimate(problem, params, sm_count()))

    def estimate(self, problem: Problem, params: dict[str, Any], sm_count: int) -> float:
        d = problem.details
        a_and_w = (d.m + d.n) * d.k * problem.dtype.itemsize
        staged = d.m * d.n * problem.dtype.itemsize if d.staged is not None else 0  # under the products
        epilogue = moved_bytes(problem) - a_and_w - staged  # the output and the epilogue's other operands
        return gemm_us(d.m, d.n, d.k, params["block_m"], params["block_n"], params["stages"], epilogue,
                       sm_count, pingpong=params["schedule"] == "pingpong", epilogue_ops=d.epilogue_ops,
                       tma_store=d.tma_store)

    def aligned_operands(self, problem: Problem, params: dict[str, Any]) -> list[str]:
        staged = problem.details.staged
        mapped = [0, 1] + ([staged] if staged is not None else [])  # TMA needs 16-byte addresses
        return [problem.operands[index].ref for index in mapped]

    def tensor_maps(self, problem: Problem, params: dict[str, Any]) -> list[tuple[int, int, int]]:
        """A and W: 64-column (128-byte) boxes of a tile's rows; the output (TMA store) and the
        staged operand: a consumer warpgroup's rows."""
        maps = [(0, params["block_m"], 64), (1, params["block_n"] // _multicast(params), 64)]
        if problem.details.tma_store:
            maps.append((OUTPUT_MAP, _rows_per_warpgroup(params), 64))
        if problem.details.mirror:
            maps.append((MIRROR_MAP, _rows_per_warpgroup(params), 64))
        if problem.details.staged is not None:
            maps.append((problem.details.staged, _rows_per_warpgroup(params), 64))
        return maps

    def kernel_name(self, problem: Problem, params: dict[str, Any]) -> str:
        return f"stof_gemm_{point_tag(params)}" + ("_mirror" if problem.details.mirror else "")

    def context(self, problem: Problem, params: dict[str, Any]) -> dict[str, Any]:
        """The details' fields, the register split, the consumer warpgroups per CTA and the
        tile raster's band height."""
        return {**fields_of(problem.details), "producer_registers": PRODUCER_REGISTERS,
                "consumer_registers": CONSUMER_REGISTERS, "consumer_wgs": _consumer_warpgroups(params),
                "staging_boxes": staging_boxes(problem.details, params),
                "raster_rows": _unit_raster_rows(problem.details, params)}

    def launch(self, problem: Problem, params: dict[str, Any]) -> Launch:
        """Persistent: at most one CTA per SM (each walks the tiles blockIdx.x + i gridDim.x; under
        multicast each cluster the units, the grid a multiple of the cluster, set in the source)."""
        per_unit = _multicast(params)
        units = -(-problem.details.m // (params["block_m"] * per_unit)) * -(-problem.details.n // params["block_n"])
        grid = min(units, sm_count() // per_unit) * per_unit
        return (grid, 1, 1), _consumer_warpgroups(params) * 128 + 128, self.shared_bytes(problem, params)

    @staticmethod
    def shared_bytes(problem: Problem, params: dict[str, Any]) -> int:
        return _shared_bytes(params, staging_boxes(problem.details, params) if problem.details.tma_store else 0)


def mirrored(problem: Problem) -> Problem:
    """``problem`` with every output box stored twice: into the output, and through a second tensor map
    (`MIRROR_MAP`, the launcher's ``mirror`` tensor) into another GPU's buffer of the output's shape. The
    all-reduce of two tensor-parallel ranks then moves nothing after the GEMM (runtime/peer_exchange.py).
    Only outputs that leave through TMA stores can (row-major, fp16 or bf16)."""
    if not problem.details.tma_store:
        raise NotFusable("only a GEMM whose output leaves through TMA stores (row-major fp16 or bf16) mirrors it")
    return problem.with_operands(problem.operands, replace(problem.details, mirror=True))


def _stage_counts(problem: Problem, schedule: str, block_m: int, block_n: int) -> list[int]:
    """STAGE_COUNTS, then the deepest ring of up to DEEP_STAGES that fits shared memory beside the
    staging, where that is deeper: small tiles on few-tile shapes wait on their operands' first trip
    from DRAM, and cuBLAS runs those with 8-10 stages (docs/decisions.md#deep-rings)."""
    def fits(stages: int) -> bool:
        params = {"schedule": schedule, "block_m": block_m, "block_n": block_n, "stages": stages}
        return GemmEpilogueTemplate.shared_bytes(problem, params) <= SMEM_LIMIT
    deepest = max((s for s in range(max(STAGE_COUNTS) + 1, DEEP_STAGES + 1) if fits(s)), default=None)
    return [*STAGE_COUNTS, *([deepest] if deepest else [])]


def _shared_bytes(params: dict[str, Any], boxes: int) -> int:
    """The ring of A and W chunks, ``boxes`` staging boxes per consumer warpgroup (64 columns of
    its rows each: under ping-pong a warpgroup holds a whole tile's rows), plus 1024 to align
    them for the 128-byte swizzle."""
    ring = params["stages"] * (params["block_m"] + params["block_n"]) * 64 * 2
    return ring + _consumer_warpgroups(params) * _rows_per_warpgroup(params) * 64 * boxes * 2 + 1024


def raster_rows(m: int, n: int, params: dict[str, Any], sm_count: int) -> int:
    """How many row tiles a band of the tile order spans (1: row-major; the kernel's
    ``unit_origin``). The tiles in flight at once (one per CTA, two under ping-pong) are
    consecutive in that order; in bands of ``r`` row tiles, column-major inside a band, they
    cover about ``r`` row blocks of A and ``in_flight / r`` column blocks of W, which is what one
    wave reads from DRAM (the rest hits L2). The band height (a power of two) minimises those
    bytes; ties keep the lower band. (The kernel's ``unit_origin`` walks units: one row tile, or a
    multicast cluster's two.) Row-major order at N = 28672 (112 column tiles of 256) reads
    236 MB per wave for 50 us of products: it ran at 0.63x cuBLAS (benchmarks/RESULTS.md)."""
    block_m, block_n = params["block_m"], params["block_n"]
    m_tiles, n_tiles = -(-m // block_m), -(-n // block_n)
    in_flight = min(m_tiles * n_tiles, sm_count * (2 if params["schedule"] == "pingpong" else 1))
    best, best_bytes = 1, math.inf
    rows = 1
    while rows <= m_tiles:
        touched_m, touched_n = set(), set()
        for tile in range(in_flight):
            m_tile, n_tile = _tile_origin(tile, rows, m_tiles, n_tiles)
            touched_m.add(m_tile)
            touched_n.add(n_tile)
        wave_bytes = len(touched_m) * block_m + len(touched_n) * block_n  # x K x the element size
        if wave_bytes < best_bytes:
            best, best_bytes = rows, wave_bytes
        rows *= 2
    return best


def _tile_origin(tile: int, rows: int, m_tiles: int, n_tiles: int) -> tuple[int, int]:
    """(row tile, column tile) of ``tile`` in bands of ``rows`` row tiles: the kernel's
    ``unit_origin`` (where a unit is one row tile, or a multicast cluster's two)."""
    band, in_band = divmod(tile, rows * n_tiles)
    first = band * rows
    height = min(m_tiles - first, rows)
    return first + in_band % height, in_band // height


def staging_boxes(details: GemmDetails, params: dict[str, Any]) -> int:
    """Staging boxes (64 output columns each) per consumer warpgroup: a ring of two, so a box is
    filled while the one before drains and the shared memory left holds more operand stages (a
    128 x 256 tile gets four instead of three: docs/decisions.md#staging-ring). A staged operand
    takes the whole tile where that fits beside the point's stages (all its boxes requested under
    the products), else the ring too (later boxes requested as the stores free their slots:
    docs/decisions.md#staged-residual-ring); stage 2 measures both forms, as 3 and 4 stages. A mirrored
    output (`mirrored`) takes the whole tile where it fits too: its second stores cross NVLink, slower to
    read a box than the local ones, and a ring of two held the epilogue on them."""
    ring = min(2, params["block_n"] // 64)
    whole = params["block_n"] // 64
    if (details.staged is not None or details.mirror) and _shared_bytes(params, whole) <= SMEM_LIMIT:
        return whole
    return ring


def point_tag(params: dict[str, Any]) -> str:
    """A point's short name, as in kernel names and benchmark tables: ``pp_m64_n256_s4``,
    ``co_m128_n256_s4_mc2`` (a multicast twin)."""
    schedule = "pp" if params["schedule"] == "pingpong" else "co"
    multicast = f"_mc{params['multicast']}" if _multicast(params) > 1 else ""
    return f"{schedule}_m{params['block_m']}_n{params['block_n']}_s{params['stages']}{multicast}"


def _multicast(params: dict[str, Any]) -> int:
    return params.get("multicast", 1)


def _multicast_twin(details: GemmDetails, params: dict[str, Any]) -> bool:
    """Whether a point gets a W-multicast twin: cooperative 128 x 256 tiles making at most
    MULTICAST_WAVES waves. There the tiles in flight at once read every W column block several
    times, and cuBLAS shares each among a cluster (ncu at M = 1024: its L2 throughput 46% against
    this kernel's 80%). At M = 1024 the 128 x 256 twins gained 2-3% where K = 14336 and the
    narrower ones lost 2-7%; at more waves the twins lost at 62 of 70 points
    (docs/decisions.md#multicast-clusters)."""
    return (params["schedule"] == "cooperative" and params["block_m"] == 128 and params["block_n"] == 256
            and details.m > params["block_m"] and _tiles(details, params) <= MULTICAST_WAVES * sm_count())


def _unit_raster_rows(details: GemmDetails, params: dict[str, Any]) -> int:
    """`raster_rows` for the kernel's walk: over units of `_multicast` row tiles, one per cluster
    in flight."""
    per_unit = _multicast(params)
    return raster_rows(details.m, details.n, params | {"block_m": params["block_m"] * per_unit},
                       sm_count() // per_unit)


def _tiles(details: GemmDetails, params: dict[str, Any]) -> int:
    return -(-details.m // params["block_m"]) * -(-details.n // params["block_n"])


def _consumer_warpgroups(params: dict[str, Any]) -> int:
    return 2 if params["schedule"] == "pingpong" else params["block_m"] // 64


def _rows_per_warpgroup(params: dict[str, Any]) -> int:
    return params["block_m"] if params["schedule"] == "pingpong" else 64


def gemm_anchor(graph: Graph, group: FusionGroup) -> tuple[Node, tuple[str, ...]]:
    """The group's ``linear`` anchor (checked: fp16/bf16, K a multiple of 8, no prologue) and the
    nodes after it."""
    anchor = graph.node(group.anchor)
    if anchor.op != "linear":
        raise NotItsPattern(f"%{anchor.name}: {anchor.op} is not generated yet (only linear: x W^T + b)")
    position = group.nodes.index(anchor.name)
    if position:
        raise NotFusable(f"%{anchor.name}: prologue {list(group.nodes[:position])} is not generated yet")
    x_spec, w_spec = graph.node(anchor.args[0].name).spec, graph.node(anchor.args[1].name).spec
    if x_spec.dtype != w_spec.dtype or x_spec.dtype not in MMA_DTYPES:
        raise NotFusable(f"%{anchor.name}: operands {x_spec} and {w_spec} (fp16 or bf16, one dtype)")
    if x_spec.shape[-1] % 8:
        raise NotFusable(f"%{anchor.name}: K = {x_spec.shape[-1]} is not a multiple of 8 (TMA needs 16-byte rows)")
    # the kernels read W as [N, K] and the bias as one value per output column: a 1-d weight (a
    # [..., K] x [K] product, whose output has no N) wrote M x K values into an M-element output, and
    # a [M, N] bias, which F.linear broadcasts, was read as its first row (found by review)
    if len(w_spec.shape) != 2:
        raise NotFusable(f"%{anchor.name}: a weight of shape {tuple(w_spec.shape)} (the kernels take a 2-d [N, K] weight)")
    bias = anchor.args[2] if len(anchor.args) > 2 else anchor.kwargs.get("bias")
    if isinstance(bias, Ref):
        b_shape = tuple(graph.node(bias.name).spec.shape)
        if not b_shape or b_shape[-1] != w_spec.shape[0] or math.prod(b_shape) != w_spec.shape[0]:
            raise NotFusable(f"%{anchor.name}: a bias of shape {b_shape} (the kernels add one value per output "
                             f"column: a bias of {w_spec.shape[0]} values)")
    return anchor, group.nodes[position + 1:]


def fields_of(details: GemmDetails) -> dict[str, Any]:
    """The details' fields by name (not `dataclasses.asdict`, which copies them)."""
    return {field.name: getattr(details, field.name) for field in fields(details)}


def gemm_details(graph: Graph, group: FusionGroup, anchor: Node, elementwise: list[str],
                 staged_dtype: torch.dtype | None = None) -> tuple[list[KernelOperand], GemmDetails]:
    """The operands (A, W, bias, then the chain's) and details (sizes, the epilogue chain's C++,
    a row-major store) of a GEMM group.

    With ``staged_dtype`` (the output's, where the output is TMA-stored), the chain's first
    output-shaped operand of that dtype (a residual) is *staged*: the kernel loads its tile with
    TMA into the output's staging tile while the products run, and the chain reads it as
    ``staged_v`` from there; ``staged`` is its index in the operands (else None)."""
    x, w = anchor.args[0], anchor.args[1]
    bias = anchor.args[2] if len(anchor.args) > 2 else anchor.kwargs.get("bias")
    x_spec, w_spec = graph.node(x.name).spec, graph.node(w.name).spec
    known, shape = {anchor.name: "acc_b"}, tuple(anchor.spec.shape)
    chain = Chain(graph, elementwise, known, shape, operand_prefix="ep")
    residual = next((op.ref.name for op in chain.operands
                     if op.access == "full" and graph.node(op.ref.name).spec.dtype == staged_dtype), None)
    operands = [kernel_operand(graph, x.name, "A", "full"), kernel_operand(graph, w.name, "W", "full")]
    if isinstance(bias, Ref):
        operands.append(kernel_operand(graph, bias.name, "bias", "row"))
    staged = None
    if residual is not None:
        chain = Chain(graph, elementwise, known | {residual: "staged_v"}, shape, operand_prefix="ep")
        staged = len(operands)
        operands.append(kernel_operand(graph, residual, "staged", "staged"))
    operands += chain_operands(graph, group, chain)
    acc = "acc_v + LOAD_ROW(bias)" if isinstance(bias, Ref) else "acc_v"
    ops = [graph.node(name).op for name in elementwise] + (["add"] if isinstance(bias, Ref) else [])
    n = w_spec.shape[0]
    return operands, GemmDetails(
        m=math.prod(x_spec.shape[:-1]), n=n, k=x_spec.shape[-1], dtype=MMA_DTYPES[x_spec.dtype],
        chain=" " * 12 + f"const float acc_b = {acc};\n" + chain.code(" " * 12), result=chain.result,
        epilogue_ops=epilogue_cost(ops), staged=staged, paired_store=n % 2 == 0)


def split_epilogue(graph: Graph, nodes: tuple[str, ...]) -> tuple[list[str], list[Node]]:
    """Elementwise nodes first, then only layout nodes (the head split): the store folds those."""
    elementwise, layout = [], []
    for name in nodes:
        node = graph.node(name)
        if node.op in LAYOUT_OPS or node.op == "transpose":
            layout.append(node)
        elif layout:
            raise NotFusable(f"%{name}: {node.op} after a layout change is not generated")
        else:
            elementwise.append(name)
    return elementwise, layout


def _store_index(graph: Graph, anchor: Node, layout: list[Node]) -> tuple[str, bool]:
    """C++ computing `out_index` of element (row, col) through the trailing views and permutes,
    and whether columns (c, c + 1), c even, stay adjacent and pair-aligned in the output (every
    permute keeps an even innermost axis innermost)."""
    lines = [ROW_MAJOR_STORE.lstrip()]
    shape = list(anchor.spec.shape)
    paired = shape[-1] % 2 == 0
    for node in layout:
        if node.op != "transpose":
            shape = list(node.spec.shape)  # a view keeps the row-major element order
            continue
        order = _permutation(node, len(shape))
        paired = paired and order[-1] == len(shape) - 1 and shape[-1] % 2 == 0
        new_shape = [shape[d] for d in order]
        old_strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        new_strides = [math.prod(new_shape[i + 1:]) for i in range(len(new_shape))]
        terms = [f"(out_index / {old_strides[d]}LL % {shape[d]}LL) * {new_strides[i]}LL" for i, d in enumerate(order)]
        lines.append(f"out_index = {' + '.join(terms)};  // permute {order}")
        shape = new_shape
        if tuple(shape) != tuple(node.spec.shape):
            raise NotFusable(f"%{node.name}: permuted shape {shape} disagrees with {node.spec}")
    return "\n".join(" " * 12 + line for line in lines), paired


def _permutation(node: Node, rank: int) -> list[int]:
    target = node.target or ""
    if target.startswith("aten.permute"):
        return [d % rank for d in node.args[1]]
    if target.split(".")[:2] == ["aten", "t"]:
        return [1, 0]
    a, b = (d % rank for d in node.args[1:3])
    order = list(range(rank))
    order[a], order[b] = order[b], order[a]
    return order


GEMM_EPILOGUE = GemmEpilogueTemplate()
