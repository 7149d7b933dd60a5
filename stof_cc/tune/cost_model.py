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
      for PARTIAL blocks the bit tests, bm * bn at ``BIT_TESTS_PER_US``, plus ``EXPOSED_BITS_US`` where a
      warp-specialised point reads the words from L2 instead of having them copied beside K;
    - the K and V tiles, 4 * bn * d bytes, streamed into shared memory at
      ``TILE_BYTES_PER_US`` (this is what makes CTAs with more rows cheaper per flop);
    - a fixed latency ``ITER_US`` (barriers, waits, row reductions; ``WS_ITER_US`` for the
      warp-specialised kernel, whose warpgroups meet at no CTA-wide barrier), plus, with one stage,
      the K/V load that nothing overlaps (``EXPOSED_LOAD_US`` per KiB). Latency is hidden
      by the other CTAs resident on the SM, so it is divided by the occupancy (CTAs per
      SM under the shared-memory, register, warp and CTA limits).

  Each CTA also pays ``CTA_FIXED_US`` (Q load, output store), in waves of SMs x occupancy.
  A persistent point (one CTA per SM running many tiles) pays ``PERSISTENT_TILE_US`` per tile
  instead (the producer loads the next tile's Q while the consumers finish the last), in one wave.
  The work is spread as whole tiles, longest first (`tile_imbalance`): the busiest SM's share
  over an even one scales it.
* ``t_critical``: the longest block row (global tokens make one row long) run by one CTA
  alone, which can use only ``warps / 8`` of an SM's issue slots.

Block counts are those of the mask at the candidate's own block shape (reduced from one
16 x 16 classification held as runs per block row, `block_mask.coarse_counts`), so finer blocks are rewarded exactly where the
mask has fine structure. The constants are per-SM
rates for an H100 SXM (sm_90, 132 SMs), fitted to sweeps of `benchmarks/mha.py --sweep`
(the D = 64 fp16 and D = 128 bf16 grids at S = 1024-16384, kept in benchmarks/sweeps/; the fit minimises
the time lost by the model's pick; see benchmarks/RESULTS.md, "Search quality"); other GPUs scale by their
SM count. They are fitted factors, not hardware rates: the last fit put the wgmma kernels' cost in the
per-block and per-CTA latencies (WS_ITER_US, CTA_FIXED_US) more than in their flops, which is what ranks
the points as the sweeps measured them (the warp-specialised kernel is latency-bound, not tensor-bound:
docs/decisions.md#the-softmaxs-pipes). STOF's rule (rho = non-empty
16x16 blocks over (S/16)^2 against tau = 1/log2(S/16)^2) is reported beside the choice.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from stof_cc.backends.tile_schedule import TILE_FIXED_BLOCKS, longest_first_makespan
from stof_cc.templates.attention import config_label

# Per-SM rates (H100 SXM, mma.sync path), in units per microsecond, and latencies in us.
TENSOR_FLOPS_PER_US = 7.79e+07   # fitted factor, paired with FRAGMENT_OVERHEAD (not a hardware rate)
WGMMA_FLOPS_PER_US = 4.25e+07    # wgmma (attention_wgmma) flops per SM: a fitted factor (the latencies carry the rest)
FRAGMENT_OVERHEAD = 6.53        # tensor time x (1 + this / m_tiles): shared-memory fragment loads dominate
EXP_PER_US = 1.74e+04            # exp2 + scaling + max/sum per element
BIT_TESTS_PER_US = 2.19e+04      # PARTIAL-block bit tests (word loads and selects)
TILE_BYTES_PER_US = 1.55e+05     # K/V tile bytes streamed from L2 into shared memory
ITER_US = 0.572                # fixed latency of one block iteration
WS_ITER_US = 0.375             # the same for attention_wgmma_ws (no CTA-wide barrier per block)
EXPOSED_LOAD_US = 3.57e-04     # per KiB of K/V a one-stage kernel waits for
CTA_FIXED_US = 1.89           # per CTA: Q tile load, output store, prologue
EXPOSED_BITS_US = 0.235        # per PARTIAL block whose words a ws consumer reads from L2 (no room to stage them):
                               # set from one A/B (dilated, S = 16384, d = 128, H200: n160 1.06x slower than n128)
PERSISTENT_TILE_US = 0.055     # per tile of a persistent CTA, instead of CTA_FIXED_US: set (not fitted); with
                               # the fitted CTA_FIXED_US persistent points rank ahead, as the sweeps measured them
LAUNCH_US = 3.15               # kernel launch, first wave ramp and tail
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
             registers_per_thread: int = 128, threads: int | None = None,
             exposed_bit_loads: bool = False) -> Estimate:
    """Estimate one candidate.

    ``row_blocks`` holds the non-empty block count of every block row of every distinct
    mask (a 1-D integer tensor or list); ``heads_batches`` is how many (batch, head)
    pairs each distinct mask serves; ``threads`` is the CTA size (default: its warps);
    ``exposed_bit_loads``: the point's consumers read PARTIAL blocks' words from L2 themselves.
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
    per_partial = bm * bn / BIT_TESTS_PER_US + (EXPOSED_BITS_US if exposed_bit_loads else 0.0)
    persistent = params.get("persistent", False)
    sm_work = (blocks * (per_block + latency / occ) + partial * per_partial
               + n_ctas * (PERSISTENT_TILE_US if persistent else CTA_FIXED_US))
    waves = 1 if persistent else math.ceil(n_ctas / (sm_count * occ))
    t_throughput = max(sm_work / sm_count * tile_imbalance(tuple(counts), heads_batches, sm_count),
                       waves * CTA_FIXED_US)
    single_cta_share = min(1.0, warps / 8)
    t_critical = (max(counts, default=0) * (per_block + latency) + CTA_FIXED_US) / single_cta_share
    micros = LAUNCH_US + max(t_throughput, t_critical)
    return Estimate(params, micros, occ, blocks, partial, max(counts, default=0))


@functools.lru_cache(maxsize=256)
def tile_imbalance(counts: tuple[int, ...], heads_batches: int, slots: int) -> float:
    """How much longer than an even share the busiest of ``slots`` SMs works (a persistent grid's CTA
    per SM, or the CTAs the SMs take in the same longest-first order): whole tiles do not divide
    evenly. Document S = 8192 at d = 64 in 192-row tiles: 516 tiles of 16 or 32 blocks
    on 132 CTAs, the busiest 84 units against an even 69 (1.21; measured 1.15x slower than 128-row
    tiles, 1.03, which the model had ranked second). 1 where every tile has an SM of its own (the
    longest is `estimate`'s critical path), and where the bound mean + longest tile is within 2% of
    the mean (many tiles per CTA), without running the schedule."""
    if len(counts) * heads_batches <= slots:
        return 1.0
    tiles = np.repeat(np.asarray(counts, dtype=np.int64) + TILE_FIXED_BLOCKS, heads_batches)
    mean = tiles.sum() / slots
    if tiles.max() <= 0.02 * mean:
        return 1.0
    return float(longest_first_makespan(np.sort(tiles)[::-1], slots) / mean)


def stof_rule(nonempty_16: int, blocks_16: int) -> tuple[float, float, str]:
    """STOF's selection rule, for comparison: (rho, tau, 'blockwise' | 'rowwise'), from the
    non-empty and total counts of 16 x 16 blocks of one mask slice."""
    rho = nonempty_16 / max(blocks_16, 1)
    tau = 1.0 / max(math.log2(math.sqrt(max(blocks_16, 1))), 1.0) ** 2
    return rho, tau, "blockwise" if rho >= tau else "rowwise"
