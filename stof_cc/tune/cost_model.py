"""Stage 1 of the search: an analytical time estimate for each attention candidate.

The model prices one launch of a masked-attention template as

    t = t_launch + max(t_throughput, t_critical)

* ``t_throughput``: the work of all block iterations of all CTAs spread over the SMs.
  One iteration over a (bm x bn) block costs

    - tensor-core time, 4 * bm * bn * d flops at ``TENSOR_FLOPS_PER_US``, inflated by
      ``FRAGMENT_OVERHEAD / m_tiles`` (each K/V fragment read from shared memory feeds
      ``m_tiles`` row tiles, so warps owning more rows load less per flop); for the
      wgmma template, which reads its operands from shared memory itself, the flops at
      ``WGMMA_FLOPS_PER_US``;
    - softmax time, bm * bn elements at ``EXP_PER_US``, added to the tensor-core time, except
      in the warp-specialised kernel, whose consumer warpgroups take turns on the tensor cores
      so that one's softmax overlaps another's products: there the larger of the two counts;
      for PARTIAL blocks the bit tests, bm * bn at ``BIT_TESTS_PER_US``;
    - the K and V tiles, 4 * bn * d bytes, streamed into shared memory at
      ``TILE_BYTES_PER_US`` (this is what makes CTAs with more rows cheaper per flop);
    - a fixed latency ``ITER_US`` (barriers, waits, row reductions; ``WS_ITER_US`` for the
      warp-specialised kernel, whose warpgroups meet at no CTA-wide barrier), plus, with one stage,
      the K/V load that nothing overlaps (``EXPOSED_LOAD_US`` per KiB). Latency is hidden
      by the other CTAs resident on the SM, so it is divided by the occupancy (CTAs per
      SM under the shared-memory, register, warp and CTA limits).

  Each CTA also pays ``CTA_FIXED_US`` (Q load, output store), in waves of SMs x occupancy.
* ``t_critical``: the longest block row (global tokens make one row long) run by one CTA
  alone, which can use only ``warps / 8`` of an SM's issue slots.

Block counts come from the `BlockMask` at the candidate's own block shape, so finer
blocks are rewarded exactly where the mask has fine structure. The constants are per-SM
rates for an H100 SXM (sm_90, 132 SMs, fp16, d = 64), fitted to sweeps of
`benchmarks/mha.py --sweep` (the fit minimises the time lost by the model's pick; see
benchmarks/RESULTS.md); other GPUs scale by their SM count. STOF's rule (rho = non-empty
16x16 blocks over (S/16)^2 against tau = 1/log2(S/16)^2) is reported beside the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Per-SM rates (H100 SXM, mma.sync path), in units per microsecond, and latencies in us.
TENSOR_FLOPS_PER_US = 4.86e7   # fitted factor, paired with FRAGMENT_OVERHEAD (not a hardware rate)
WGMMA_FLOPS_PER_US = 2.4e6    # wgmma (attention_wgmma) flops per SM, issue to completion
FRAGMENT_OVERHEAD = 40.8        # tensor time x (1 + this / m_tiles): shared-memory fragment loads dominate
EXP_PER_US = 2.53e5            # exp2 + scaling + max/sum per element
BIT_TESTS_PER_US = 1.01e5      # PARTIAL-block bit tests (word loads and selects)
TILE_BYTES_PER_US = 5.03e5     # K/V tile bytes streamed from L2 into shared memory
ITER_US = 0.018                # fixed latency of one block iteration
WS_ITER_US = 0.058             # the same for attention_wgmma_ws (no CTA-wide barrier per block)
EXPOSED_LOAD_US = 3.4e-05     # per KiB of K/V a one-stage kernel waits for
CTA_FIXED_US = 0.165           # per CTA: Q tile load, output store, prologue
LAUNCH_US = 10.7               # kernel launch, first wave ramp and tail
SM_SHARED_BYTES = 228 * 1024
SM_REGISTERS = 64 * 1024
SM_MAX_WARPS = 64
SM_MAX_CTAS = 32


@dataclass(frozen=True)
class Estimate:
    """The model's view of one candidate."""

    params: dict[str, Any]
    micros: float
    occupancy: int
    blocks: int
    partial_blocks: int
    max_row_blocks: int

    def describe(self) -> str:
        from stof_cc.templates.attention import config_label

        return (f"{config_label(self.params)}: {self.micros:.1f} us est, {self.blocks} blocks ({self.partial_blocks} partial), "
                f"longest row {self.max_row_blocks}, {self.occupancy} CTA/SM")


def occupancy(threads: int, shared_bytes: int, registers_per_thread: int) -> int:
    """CTAs resident per SM under the shared-memory, register, warp and CTA limits."""
    warps = threads // 32
    by_smem = SM_SHARED_BYTES // max(shared_bytes + 1024, 1)  # 1 KB reserved per CTA
    by_regs = SM_REGISTERS // max(min(registers_per_thread, 255) * threads, 1)
    return max(0, min(by_smem, by_regs, SM_MAX_WARPS // warps, SM_MAX_CTAS))


def estimate(params: dict[str, Any], head_dim: int, heads_batches: int, row_blocks: Any,
             partial_blocks: int, shared_bytes: int, sm_count: int,
             registers_per_thread: int = 128, threads: int | None = None) -> Estimate:
    """Estimate one candidate.

    ``row_blocks`` holds the non-empty block count of every block row of every distinct
    mask (a 1-D integer tensor or list); ``heads_batches`` is how many (batch, head)
    pairs each distinct mask serves; ``threads`` is the CTA size (default: its warps).
    """
    bm, bn, warps = params["block_m"], params["block_n"], params["warps"]
    counts = [int(c) for c in row_blocks]
    blocks = sum(counts) * heads_batches
    partial = partial_blocks * heads_batches
    n_ctas = len(counts) * heads_batches
    occ = occupancy(threads or warps * 32, shared_bytes, registers_per_thread)
    if occ == 0:
        return Estimate(params, math.inf, 0, blocks, partial, max(counts, default=0))

    if params["strategy"].startswith("wgmma"):  # operands come straight from shared memory: no fragment term
        tensor_us = 4 * bm * bn * head_dim / WGMMA_FLOPS_PER_US
    else:
        tensor_us = 4 * bm * bn * head_dim / TENSOR_FLOPS_PER_US * (1 + FRAGMENT_OVERHEAD / params["m_tiles"])
    softmax_us = bm * bn / EXP_PER_US
    if params["strategy"] == "wgmma_ws":  # ping-pong: one warpgroup's softmax under another's wgmmas
        compute_us = max(tensor_us, softmax_us)
    else:
        compute_us = tensor_us + softmax_us
    per_block = compute_us + 4 * bn * head_dim / TILE_BYTES_PER_US
    latency = (WS_ITER_US if params["strategy"] == "wgmma_ws" else ITER_US) + (EXPOSED_LOAD_US * 4 * bn * head_dim / 1024 if params["stages"] == 1 else 0.0)
    per_partial = bm * bn / BIT_TESTS_PER_US
    sm_work = blocks * (per_block + latency / occ) + partial * per_partial + n_ctas * CTA_FIXED_US
    waves = math.ceil(n_ctas / (sm_count * occ))
    t_throughput = max(sm_work / sm_count, waves * CTA_FIXED_US)
    single_cta_share = min(1.0, warps / 8)
    t_critical = (max(counts, default=0) * (per_block + latency) + CTA_FIXED_US) / single_cta_share
    micros = LAUNCH_US + max(t_throughput, t_critical)
    return Estimate(params, micros, occ, blocks, partial, max(counts, default=0))


def stof_rule(nonempty_16: int, blocks_16: int) -> tuple[float, float, str]:
    """STOF's selection rule, for comparison: (rho, tau, 'blockwise' | 'rowwise'), from the
    non-empty and total counts of 16 x 16 blocks of one mask slice."""
    rho = nonempty_16 / max(blocks_16, 1)
    tau = 1.0 / max(math.log2(math.sqrt(max(blocks_16, 1))), 1.0) ** 2
    return rho, tau, "blockwise" if rho >= tau else "rowwise"


# -- fusion-group templates (elementwise, row_reduce, gemm_epilogue) ---------------------------
# First-principles rates for the H100 SXM: HBM3 bandwidth, launch cost. The GEMM constants below
# are fitted (random search on log(time of the pick / best) plus the estimates' log error) to
# H100 runs of every gemm_epilogue point with TMA stores (benchmarks/gemm_points.py, plain and
# --gelu, 2026-11-23 fifth session): the pick is the measured best at K, N = 768, 3072 and
# 3072, 768 (plain and GELU) and 1% behind at 768, 768. In-sample: the fit saw those runs.
# A wgmma rate per SM reached by a warpgroup tile of FULL_RATE_INTENSITY (rows x cols /
# (rows + cols)) or more, less below it; the epilogue's elements at a per-warpgroup rate.
HBM_BYTES_PER_US = 3.0e6        # about 3 TB/s of the 3.35 TB/s peak
GEMM_FLOPS_PER_US = 5.28e6      # per SM: about 700 TFLOP/s over 132 SMs at full intensity
FULL_RATE_INTENSITY = 48.6      # 64 x 192 is 48, 128 x 128 is 64: shared-memory operand traffic per flop
INTENSITY_EXPONENT = 1.57       # the rate falls as (intensity / FULL_RATE_INTENSITY) ** 1.57 below it
ONE_ROW_BLOCK_RATE = 0.785      # 64-row tiles: one m64 wgmma stream per tile at a time hides less latency
THREE_STAGE_RATE = 0.83         # a 3-buffer ring exposes more of each TMA load's latency
PINGPONG_RATE = 0.86            # ping-pong's turn-taking on the tensor cores
EPILOGUE_ELEMENTS_PER_US = 1.43e5  # one warpgroup's bare epilogue (value, convert, stage), elements per us
# per element, in bare-epilogue units; fitted when gelu_erf took ~16 instructions (11 since 2026-11-24, which
# made FFN1 + GELU 41.2 -> 39.7 us); the estimates still rank the measured best first (RESULTS.md)
EPILOGUE_OP_COST = {"gelu": 6.0}
OTHER_EPILOGUE_OP_COST = 0.25      # any other elementwise op (add, scale, relu...)
GROUP_LAUNCH_US = 4.0
ROW_CTA_US = 1.5                # one row_reduce CTA: loads, two CTA-wide reductions, store


def memory_bound_us(bytes_moved: float, efficiency: float = 1.0) -> float:
    """A kernel that streams ``bytes_moved`` once through HBM at ``efficiency`` of the rate."""
    return GROUP_LAUNCH_US + bytes_moved / (HBM_BYTES_PER_US * efficiency)


# row_reduce's share of HBM_BYTES_PER_US by layout, inferred from ONE measurement each (H100 SXM,
# LayerNorm(x + bias + residual) over 4096 x 768 fp16, about 19 MB moved), not fitted to sweeps:
# - scalar 2-byte loads and stores, one CTA per row (the old template; its default point there was
#   512 threads): 13.9 us, 1.36 TB/s, about 0.45 of the 3 TB/s rate; taken for every scalar point,
#   the warp layout's included;
# - one warp per row with 16-byte vectors (4 rows per CTA): measured in BERT-base end to end on
#   the H100 (2026-11-23, fifth session): 4.1 us per LayerNorm with the residual add, where
#   Triton's fused add + LayerNorm takes 6.2-6.5 us; its inputs come L2-resident from the GEMM
#   before it, so it beats the HBM rate there; 1.0 keeps the estimate an HBM bound;
# - a CTA per row with 16-byte vectors: not measured, put between the two (its barriers remain).
ROW_WARP_VECTOR_RATE = 1.0
ROW_CTA_VECTOR_RATE = 0.75
ROW_SCALAR_RATE = 0.45


def row_reduce_us(bytes_moved: float, rows: int, rows_per_sm: int, sm_count: int, efficiency: float = 1.0) -> float:
    """Bandwidth at ``efficiency`` of the rate, or the waves of CTAs (``rows_per_sm`` resident
    rows per SM, ROW_CTA_US a wave) when rows are few and short."""
    waves = math.ceil(rows / (sm_count * max(rows_per_sm, 1)))
    return GROUP_LAUNCH_US + max(bytes_moved / (HBM_BYTES_PER_US * efficiency), waves * ROW_CTA_US)


# gemm_layernorm's norm epilogue beyond the GEMM tiles' estimate: two cluster barriers,
# distributed-shared-memory row sums, two passes, one tile per CTA (no overlap with a next tile).
# Fitted to two H100 measurements of co_m128_n256_s4 at M = 4096, N = 768 (2026-11-23, fifth
# session): 29.6 us at K = 768 (estimate of the tiles 19.3 + 10.3), about 54 us at K = 3072
# (49.5 + ~5); the 1 us guess before let stage 1 merge at K = 768 where the two kernels apart
# measured faster.
ROW_EXCHANGE_US = 8.0
# gemm_layernorm clusters of more than 3 CTAs (one CTA per SM each): inferred, not fitted. On the
# H100 the 128 x 256 tile (3 CTAs per row block) was the fastest of the 12 points in both sweeps
# at K = 768 and 3072 (RESULTS.md), while the tile model alone ranks 128 x 192 (4 CTAs) first;
# and BERT-base end to end was 0.29 ms slower with 4-CTA clusters than with the two-kernel form.
# A GPC of 16-18 SMs holds fewer 4-CTA than 3-CTA clusters' worth of SMs at once.
WIDE_CLUSTER_RATE = 0.7


def gemm_us(m: int, n: int, k: int, block_m: int, block_n: int, stages: int, epilogue_bytes: float,
            sm_count: int, pingpong: bool = False, epilogue_ops: float = 0.0, tma_store: bool = False) -> float:
    """Tiles in waves over the SMs (wave quantisation and tile waste on ragged shapes both count:
    a partial tile costs a whole one), each at the wgmma rate scaled by its warpgroups' operand
    intensity (a cooperative warpgroup holds 64 rows of the tile, a ping-pong one all of it),
    the ring depth and the consumer count. Each tile's epilogue computes its elements
    (``epilogue_ops``: the chain's cost per element beyond the store, `EPILOGUE_OP_COST`) on the
    warpgroups that own it: after the products when they share the tile (cooperative), under
    the other warpgroup's products under ping-pong, where a tile costs max(products, (products
    + epilogue) / 2). Then the output's traffic: all of it exposed when cooperative consumers
    store directly, only the last wave's when the store is asynchronous (TMA) or ping-pong."""
    tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
    waves = math.ceil(tiles / sm_count)
    rows = block_m if pingpong else 64
    efficiency = min(1.0, rows * block_n / (rows + block_n) / FULL_RATE_INTENSITY) ** INTENSITY_EXPONENT
    efficiency *= (ONE_ROW_BLOCK_RATE if block_m == 64 else 1.0) * (THREE_STAGE_RATE if stages == 3 else 1.0)
    efficiency *= PINGPONG_RATE if pingpong else 1.0
    products_us = 2 * block_m * block_n * k / (GEMM_FLOPS_PER_US * efficiency)
    owners = 1 if pingpong else block_m // 64  # warpgroups computing one tile's epilogue
    epilogue_us = block_m * block_n * (1.0 + epilogue_ops) / (EPILOGUE_ELEMENTS_PER_US * owners)
    tile_us = max(products_us, (products_us + epilogue_us) / 2) if pingpong else products_us + epilogue_us
    exposed_store = 1 / waves if pingpong or tma_store else 1.0
    return GROUP_LAUNCH_US + waves * tile_us + exposed_store * epilogue_bytes / HBM_BYTES_PER_US


def epilogue_cost(ops: list[str]) -> float:
    """An elementwise chain's cost per element in a GEMM epilogue, in units of the bare store."""
    return sum(EPILOGUE_OP_COST.get(op, OTHER_EPILOGUE_OP_COST) for op in ops)


def sm_count() -> int:
    """SMs of the current GPU; without one, the H100's 132 (estimates still rank on the CPU)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132
