"""Hardware constants and stage-1 pricing for the fusion-group templates (elementwise,
row_reduce, gemm_epilogue, gemm_layernorm): each template's `estimate` prices its points with
these. They sit with the templates, below `tune`, because templates price themselves; the
masked-attention model, which the search applies across templates, is `tune/cost_model.py`.
The constants are for an H100 SXM; where they were fitted or inferred, and from which runs,
is in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import math

import torch

# H100 SXM rates: HBM bandwidth and launch cost from first principles; the GEMM rates fitted to
# sweeps of every gemm_epilogue point (how, and on which runs: docs/decisions.md#group-pricing).
# A warpgroup tile of FULL_RATE_INTENSITY (rows x cols / (rows + cols)) or more reaches the wgmma
# rate, less below it; the epilogue's elements go at a per-warpgroup rate.
HBM_BYTES_PER_US = 3.0e6        # about 3 TB/s of the 3.35 TB/s peak
GEMM_FLOPS_PER_US = 5.28e6      # per SM: about 700 TFLOP/s over 132 SMs at full intensity
FULL_RATE_INTENSITY = 48.6      # 64 x 192 is 48, 128 x 128 is 64: shared-memory operand traffic per flop
INTENSITY_EXPONENT = 1.57       # the rate falls as (intensity / FULL_RATE_INTENSITY) ** 1.57 below it
ONE_ROW_BLOCK_RATE = 0.785      # 64-row tiles: one m64 wgmma stream per tile at a time hides less latency
THREE_STAGE_RATE = 0.83         # a 3-buffer ring exposes more of each TMA load's latency
PINGPONG_RATE = 0.86            # ping-pong's turn-taking on the tensor cores
EPILOGUE_ELEMENTS_PER_US = 1.43e5  # one warpgroup's bare epilogue (value, convert, stage), elements per us
# an epilogue op's cost per element, in units of the bare epilogue (docs/decisions.md#group-pricing)
EPILOGUE_OP_COST = {"gelu": 6.0}
OTHER_EPILOGUE_OP_COST = 0.25      # any other elementwise op (add, scale, relu...)
GROUP_LAUNCH_US = 4.0
# A k-step's operands on their way from DRAM (a small, cold GEMM): a ring of `stages` buffers keeps
# that many k-steps in flight, so a tile takes at least k-steps x this / stages
# (docs/decisions.md#deep-rings)
LOAD_LATENCY_US = 2.0
ROW_CTA_US = 1.5                # one row_reduce CTA: loads, two CTA-wide reductions, store


def memory_bound_us(bytes_moved: float, efficiency: float = 1.0) -> float:
    """A kernel that streams ``bytes_moved`` once through HBM at ``efficiency`` of the rate."""
    return GROUP_LAUNCH_US + bytes_moved / (HBM_BYTES_PER_US * efficiency)


# row_reduce's share of HBM_BYTES_PER_US by layout: a warp per row with 16-byte vectors, a CTA per
# row with them, scalar accesses. Each inferred from one measurement, not fitted to sweeps
# (docs/decisions.md#row-reduce-rates).
ROW_WARP_VECTOR_RATE = 1.0
ROW_CTA_VECTOR_RATE = 0.75
ROW_SCALAR_RATE = 0.45


def row_reduce_us(bytes_moved: float, rows: int, rows_per_sm: int, sm_count: int, efficiency: float = 1.0) -> float:
    """Bandwidth at ``efficiency`` of the rate, or the waves of CTAs (``rows_per_sm`` resident
    rows per SM, ROW_CTA_US a wave) when rows are few and short."""
    waves = math.ceil(rows / (sm_count * max(rows_per_sm, 1)))
    return GROUP_LAUNCH_US + max(bytes_moved / (HBM_BYTES_PER_US * efficiency), waves * ROW_CTA_US)


# gemm_layernorm's norm epilogue beyond the GEMM tiles' estimate (two cluster barriers, row sums
# over distributed shared memory, two passes); fitted to two measurements (docs/decisions.md#gemm-layernorm)
ROW_EXCHANGE_US = 8.0
# gemm_layernorm clusters of more than 3 CTAs run slower than the tile model says (fewer fit a
# GPC at once); inferred, not fitted (docs/decisions.md#gemm-layernorm)
WIDE_CLUSTER_RATE = 0.7


def gemm_us(m: int, n: int, k: int, block_m: int, block_n: int, stages: int, epilogue_bytes: float,
            sm_count: int, pingpong: bool = False, epilogue_ops: float = 0.0, tma_store: bool = False) -> float:
    """Tiles in waves over the SMs (wave quantisation and tile waste on ragged shapes both count:
    a partial tile costs a whole one), each at the wgmma rate scaled by its warpgroups' operand
    intensity (a cooperative warpgroup holds 64 rows of the tile, a ping-pong one all of it),
    the ring depth and the consumer count, and no faster than its ring brings the operands from
    DRAM (`LOAD_LATENCY_US` per k-step over the stages in flight). Each tile's epilogue
    computes its elements (``epilogue_ops``: the chain's cost per element beyond the store,
    `EPILOGUE_OP_COST`) on the warpgroups that own it: after the products when they share the tile
    (cooperative), under the other warpgroup's products under ping-pong, where a tile costs
    max(products, (products + epilogue) / 2). Then the output's traffic: all of it exposed when
    cooperative consumers store directly, only the last wave's when the store is asynchronous (TMA)
    or ping-pong."""
    tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
    waves = math.ceil(tiles / sm_count)
    rows = block_m if pingpong else 64
    efficiency = min(1.0, rows * block_n / (rows + block_n) / FULL_RATE_INTENSITY) ** INTENSITY_EXPONENT
    efficiency *= (ONE_ROW_BLOCK_RATE if block_m == 64 else 1.0) * (THREE_STAGE_RATE if stages == 3 else 1.0)
    efficiency *= PINGPONG_RATE if pingpong else 1.0
    products_us = max(2 * block_m * block_n * k / (GEMM_FLOPS_PER_US * efficiency),
                      math.ceil(k / 64) * LOAD_LATENCY_US / stages)
    owners = 1 if pingpong else block_m // 64  # warpgroups computing one tile's epilogue
    epilogue_us = block_m * block_n * (1.0 + epilogue_ops) / (EPILOGUE_ELEMENTS_PER_US * owners)
    tile_us = max(products_us, (products_us + epilogue_us) / 2) if pingpong else products_us + epilogue_us
    exposed_store = 1 / waves if pingpong or tma_store else 1.0
    return GROUP_LAUNCH_US + waves * tile_us + exposed_store * epilogue_bytes / HBM_BYTES_PER_US


def epilogue_cost(ops: list[str]) -> float:
    """An elementwise chain's cost per element in a GEMM epilogue, in units of the bare store."""
    return sum(EPILOGUE_OP_COST.get(op, OTHER_EPILOGUE_OP_COST) for op in ops)


H100 = (9, 0)  # the target when no GPU is visible (kernels are written and compiled for sm_90)
H100_SM_COUNT = 132  # the GPU the constants describe
# Targets the shell commands can generate for without that GPU (`--arch`): capability, SMs and the
# GPU whose SM count stands for the family (estimates scale by SM count).
TARGETS = {"sm_80": ((8, 0), 108, "A100"), "sm_86": ((8, 6), 84, "A40"), "sm_89": ((8, 9), 142, "L40S"),
           "sm_90": (H100, H100_SM_COUNT, "H100")}
_chosen_target: str | None = None  # `choose_target`'s, while set


def choose_target(arch: str | None) -> None:
    """Generate for ``arch`` (a TARGETS key) instead of the visible GPU or the H100 (None: back to
    those): what `stof-cc compile --arch` and friends do; nothing runs kernels then."""
    global _chosen_target
    if arch is not None and arch not in TARGETS:
        raise ValueError(f"unknown target {arch!r}; known: {', '.join(TARGETS)}")
    _chosen_target = arch


def chosen_target() -> str | None:
    """`choose_target`'s arch, or None."""
    return _chosen_target


def target_name() -> str:
    """The target as commands print it: 'sm_90 (H100, 132 SMs)'."""
    major, minor = target_capability()
    arch = f"sm_{major}{minor}"
    gpu = TARGETS[_chosen_target][2] if _chosen_target else torch.cuda.get_device_name() \
        if torch.cuda.is_available() else "H100"
    return f"{arch} ({gpu}, {sm_count()} SMs)"


def target_capability() -> tuple[int, int]:
    """The compute capability kernels are chosen for: `choose_target`'s, else the current GPU's,
    else the H100's."""
    if _chosen_target:
        return TARGETS[_chosen_target][0]
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else H100


def sm_count() -> int:
    """SMs of `choose_target`'s GPU, else the current GPU's; without one, the H100's 132
    (estimates still rank on the CPU)."""
    if _chosen_target:
        return TARGETS[_chosen_target][1]
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return H100_SM_COUNT
