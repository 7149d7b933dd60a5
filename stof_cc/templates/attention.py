"""Specs of the masked-attention templates (sources: attention.cu.j2 for the mma.sync
strategies, attention_wgmma.cu.j2 for Hopper; shared pieces in attention_common.j2).

* ``attention_rowwise``: one warp per CTA owns a 16- or 32-row query strip and walks
  that strip's own non-empty blocks (mask blocks are that high, so skipping is fine-grained).
  Many small CTAs: good for short sequences and very sparse or irregular masks.
* ``attention_blockwise``: 2 to 8 warps per CTA share each K/V tile of a 64- or 128-row
  block row, staged by cp.async (one or two stages): K/V reuse for long sequences.
* ``attention_wgmma``: Hopper only (sm_90a). The blockwise walk with one to three
  warpgroups per CTA issuing ``wgmma.mma_async`` straight from 128-byte-swizzled shared
  memory instead of ``mma.sync`` on ldmatrix fragments; head dim 64 and 128.

The kernel reads the mask as a `BlockMask` whose block shape equals the kernel's
(block_m, block_n); `stof_cc.attention` builds and caches it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch

from stof_cc.templates.registry import KernelTemplate, Launch

SUPPORTED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
SUPPORTED_HEAD_DIMS = (32, 64, 128)
SMEM_LIMIT = 227 * 1024  # Hopper's per-block opt-in limit
SM_REGISTER_FILE = 64 * 1024  # 32-bit registers per SM: one CTA's threads x registers must fit
GRID_YZ_LIMIT = 65535  # CUDA's limit on gridDim.y (batch) and gridDim.z (block rows)
# wgmma kernels' registers per thread by (head_dim, block_n): the sm_90a ptxas reports, which vary
# by a few registers over block_m and dtype (checked in CI)
WGMMA_REGISTERS = {(64, 64): 121, (64, 128): 185, (128, 64): 160, (128, 128): 208, (128, 160): 232}
# The bias variant's loads and row pointers: keeps out the points whose bias variants spill (sm_90a ptxas,
# nvcc 13: d = 128 with n128, 68-72 bytes at 255 registers, and m192 n64, 116 bytes at its 168), leaves in
# those that compile without (161-249 registers).
WGMMA_BIAS_REGISTERS = 48
MAX_REGISTERS = 255  # estimated registers per thread; above this ptxas spills (checked in CI)
# A strided split's kernel variant (the residue decode) near the register limit spilled: blockwise d64
# m64 n64 w2 (estimated 239) 12 / 20 bytes at 255, the ws m192 n128 d64 consumers (160 of 160) 32 / 40
# bytes: a strided space keeps this margin.
STRIDED_REGISTERS = 20
# The row-window variant's per-row window loads and tests (runtime.attention's cu_seqlens), in the
# estimate; WS_WINDOW_REGISTERS is its margin in the warp-specialised space. With both, no point of the
# blockwise, wgmma and wgmma_ws spaces spills at d = 64 and 128 (nvcc 13); with no margin, the
# three-warpgroup points with n128 at d = 64 and n64 at d = 128 did (4-24 bytes). Rowwise takes no
# windows: one warp per 16-32 rows spilled at d = 128, and packed sequences are long.
WINDOW_REGISTERS = 10


def _accumulator_registers(head_dim: int, block_n: int, m_tiles: int) -> int:
    """Registers per thread for the S and O accumulators and the Q fragments of mma.sync."""
    return m_tiles * (block_n // 2 + head_dim // 2 + head_dim // 4)


@dataclass(frozen=True)
class AttentionProblem:
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: torch.dtype
    kv_heads: int | None = None  # grouped-query attention: fewer K/V heads (None: as many as q)
    bias: bool = False  # an additive bias is read and added to the scores (its own kernel variant)
    # Per-call row windows (packed documents: each query row's keys [x, y), read on the device) narrow
    # the mask (its own kernel variant; `runtime.attention`'s ``cu_seqlens``).
    row_windows: bool = False
    # A strided split's d (its own kernel variant): batch and seq_q / seq_k are then the split's, B * d
    # slots of S / d positions, slot b * d + r reading positions r, r + d, ... of batch element b.
    residues: int = 1

    @property
    def dtype_name(self) -> str:
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head (query head h reads K/V head h // kv_group)."""
        return 1 if self.kv_heads is None else self.heads // self.kv_heads


class AttentionInputError(ValueError):
    """q, k, v or the mask cannot be run by the attention kernels; names the argument."""


# The smallest softmax scale the kernels take: a row's scores may pass its softmax reference by 2^8 before it
# moves (attention_common.j2's softmax_scores), 8 / (scale * log2(e)) in raw-score units, which must stay a finite
# fp32 number (it does down to about 1.6e-38; 1e-30 keeps a wide margin).
SMALLEST_SCALE = 1e-30


def takes_scale(scale: float) -> bool:
    """Whether the kernels take ``scale``: positive, finite and at least SMALLEST_SCALE."""
    return SMALLEST_SCALE <= scale < math.inf


def check_scale(scale: float) -> None:
    """AttentionInputError naming ``scale`` where the kernels do not take it (`takes_scale`)."""
    if not takes_scale(scale):
        raise AttentionInputError(f"scale must be positive and finite, at least {SMALLEST_SCALE:g} (the kernels' "
                                  f"softmax divides by it), got {scale}")


def problem_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionProblem:
    """The problem q, k and v pose, checked (`check_layout`, CUDA, sizes and a dtype the kernels
    support); AttentionInputError naming the argument otherwise."""
    check_layout(q, k, v)
    if v.shape[3] != q.shape[3]:
        raise AttentionInputError(f"v's head dim must be q's {q.shape[3]} (the kernels take one); got v {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise AttentionInputError(f"{name} is on {t.device}; the kernels run on CUDA devices (the CPU reference: "
                                      "stof_cc.ir.reference.masked_attention(q, k, v, dense), dense a bool tensor, "
                                      "mask.to_dense(S_q, S_k) for a stof-cc mask, or None)")
    batch, heads, seq_q, head_dim = q.shape
    kv_heads = None if k.shape[1] == heads else k.shape[1]
    return validated_problem(AttentionProblem(batch, heads, seq_q, k.shape[2], head_dim, q.dtype, kv_heads))


def check_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q [B, H, S_q, D], k [B, H_kv, S_k, D] and v [B, H_kv, S_k, D_v] with H_kv dividing H, tensors
    of one dtype and device: what every attention path needs, the CPU reference included (which
    also takes D_v != D); AttentionInputError naming the argument otherwise."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionInputError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise AttentionInputError("q, k and v must share one dtype and one device")
    batch, heads, _, head_dim = q.shape
    if k.shape[0] != batch or k.shape[1] < 1 or heads % k.shape[1] or v.shape[:3] != k.shape[:3] \
            or k.shape[3] != head_dim:
        raise AttentionInputError(f"k and v must be [{batch}, H_kv, S_k, {head_dim}] like q, with H_kv dividing "
                                  f"q's {heads} heads; got k {tuple(k.shape)}, v {tuple(v.shape)}")


def validated_problem(problem: AttentionProblem) -> AttentionProblem:
    """The checks on sizes and dtype that `attention` and `explain_attention` share."""
    sizes = {}
    for name in ("batch", "heads", "seq_q", "seq_k", "head_dim"):
        value = getattr(problem, name)
        try:
            if isinstance(value, bool):
                raise TypeError
            sizes[name] = operator.index(value)
        except TypeError:
            raise AttentionInputError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None
    problem = dataclasses.replace(problem, **sizes)
    if problem.kv_heads is not None and (isinstance(problem.kv_heads, bool) or not isinstance(problem.kv_heads, int)
                                         or problem.kv_heads < 1 or problem.heads % problem.kv_heads):
        raise AttentionInputError(f"kv_heads must be a positive int dividing heads={problem.heads}, "
                                  f"got {problem.kv_heads!r}")
    if problem.kv_heads == problem.heads:
        problem = dataclasses.replace(problem, kv_heads=None)
    if not isinstance(problem.dtype, torch.dtype) or problem.dtype not in SUPPORTED_DTYPES:
        raise AttentionInputError(f"dtype {problem.dtype!r} is not supported; supported: torch.float16, torch.bfloat16")
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        raise AttentionInputError(f"head_dim {problem.head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if min(problem.batch, problem.heads, problem.seq_q, problem.seq_k) <= 0:
        raise AttentionInputError(f"sizes must be positive, got batch={problem.batch} heads={problem.heads} "
                                  f"seq_q={problem.seq_q} seq_k={problem.seq_k}")
    if problem.batch > GRID_YZ_LIMIT:
        raise AttentionInputError(f"batch {problem.batch} exceeds {GRID_YZ_LIMIT}, the grid's y limit; "
                                  "split the batch")
    return problem


def config_label(params: dict[str, Any]) -> str:
    """Short unique name of a parameter point, e.g. ``blockwise m64 n64 w4 s2``."""
    return (f"{params['strategy']} m{params['block_m']} n{params['block_n']} "
            f"w{params['warps']} s{params['stages']}" + (" persistent" if params.get("persistent") else ""))


class _AttentionTemplate(KernelTemplate[AttentionProblem]):
    source_file = "attention.cu.j2"
    # Q K V O, any_ptr any_cols any_tile part_bits row_order, key_range key_valid, seq_q seq_k, 16 strides
    # (batch, head, row, residue of q, k, v, o), 2 mask-row strides, scale * log2(e), the K/V head
    # multiplier (attention_launch.kv_head_magic), residues and theirs, bias, its strides over
    # (B, H, S_q), 1 / scale, the log-sum-exp output (or null) and its strides over (B, H, row, residue),
    # the per-head sink logits (fp32 [H], or null); the row-window variant then takes the windows and a
    # tile counter (`attention_launch.compiled_kernel` adds their "PP"; the counter is read by
    # `takes_tiles_in_turn` points only, null for the others)
    arg_format = "P" * 11 + "ii" + "q" * 16 + "iifIiI" + "P" + "qqq" + "f" + "P" + "q" * 4 + "P"
    strategy: str
    mma = "mma_sync"  # the tensor-core instruction family the source is rendered for
    min_capability = (8, 0)  # cp.async, ldmatrix and bf16 mma.sync m16n8k16
    waits_for_producers = True  # attention_common.setup() waits first
    walks_tile_schedule = False  # True: grid (CTAs, 1, 1) over a `tile_schedule` passed as row_order
    takes_row_windows = True  # renders the row-window variant (problem.row_windows; WINDOW_REGISTERS)
    loads_with_tma = False  # True: takes Q, K, V and O's tensor maps before arg_format's arguments (attention_launch)
    shapes: tuple[tuple[int, int], ...]  # (block_m, m_tiles): each warp owns 16 * m_tiles rows
    block_ns = (32, 64, 128)
    stage_counts = (1, 2)
    head_dims = SUPPORTED_HEAD_DIMS

    def space(self, problem: AttentionProblem) -> list[dict[str, Any]]:
        if problem.head_dim not in self.head_dims or problem.batch > GRID_YZ_LIMIT \
                or problem.row_windows and (not self.takes_row_windows or problem.residues > 1):
            return []
        points = []
        for (block_m, m_tiles), block_n, stages in product(self.shapes, self.block_ns_of(problem), self.stage_counts):
            params = {"strategy": self.strategy, "block_m": block_m, "block_n": block_n,
                      "warps": block_m // (16 * m_tiles), "m_tiles": m_tiles, "stages": stages}
            registers = self.registers(problem, params) + STRIDED_REGISTERS * (problem.residues > 1)
            if -(-problem.seq_q // block_m) > GRID_YZ_LIMIT:  # block rows are the grid's z
                continue
            if (registers <= MAX_REGISTERS and registers * params["warps"] * 32 <= SM_REGISTER_FILE
                    and self.shared_bytes(problem, params) <= SMEM_LIMIT):
                points.append(params)
        return points

    @staticmethod
    def takes_tiles_in_turn(problem: AttentionProblem, params: dict[str, Any]) -> bool:
        """Whether the point's CTAs take their tiles one at a time from a counter the launch zeroes
        (none here: one CTA per tile)."""
        return False

    def block_ns_of(self, problem: AttentionProblem) -> tuple[int, ...]:
        """The key block widths the space takes for this problem."""
        return self.block_ns

    def exposes_bit_loads(self, problem: AttentionProblem, params: dict[str, Any]) -> bool:
        """Whether the point reads PARTIAL blocks' bit words where a warp-specialised kernel would have them
        copied beside K (the cost model prices the exposed load); the one-CTA kernels' words are priced in
        their bit tests."""
        return False

    def registers(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        """Registers per thread as ptxas allocates them: 1.34 x the accumulators plus 25 for
        addressing, softmax state and mask words (a least-squares fit to the sm_90 reports)."""
        return (round(1.34 * _accumulator_registers(problem.head_dim, params["block_n"], params["m_tiles"])) + 25
                + WINDOW_REGISTERS * problem.row_windows)

    def shared_bytes(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        rows = params["block_m"] + 2 * params["stages"] * params["block_n"]
        return rows * (problem.head_dim + 8) * 2

    def kernel_name(self, problem: AttentionProblem, params: dict[str, Any]) -> str:
        return (f"stof_attn_{self.strategy}_{problem.dtype_name}_d{problem.head_dim}"
                f"_m{params['block_m']}_n{params['block_n']}_w{params['warps']}_s{params['stages']}"
                + ("_bias" if problem.bias else "") + ("_strided" if problem.residues > 1 else "")
                + ("_windows" if problem.row_windows else ""))

    def context(self, problem: AttentionProblem, params: dict[str, Any]) -> dict[str, Any]:
        return {"mma": self.mma, "dtype": problem.dtype_name, "head_dim": problem.head_dim, "bias": problem.bias,
                "strided": problem.residues > 1, "row_windows": problem.row_windows}

    def launch(self, problem: AttentionProblem, params: dict[str, Any]) -> Launch:
        """One CTA per (head, batch, block row), heads fastest so the scheduler starts all long
        rows first."""
        n_block_rows = -(-problem.seq_q // params["block_m"])
        return (problem.heads, problem.batch, n_block_rows), params["warps"] * 32, self.shared_bytes(problem, params)


class RowwiseAttention(_AttentionTemplate):
    name = "attention_rowwise"
    strategy = "rowwise"
    shapes = ((16, 1), (32, 2))  # one warp per CTA
    takes_row_windows = False


class BlockwiseAttention(_AttentionTemplate):
    name = "attention_blockwise"
    strategy = "blockwise"
    shapes = ((64, 1), (64, 2), (128, 1), (128, 2))


class WgmmaAttention(_AttentionTemplate):
    name = "attention_wgmma"
    source_file = "attention_wgmma.cu.j2"
    strategy = "wgmma"
    mma = "wgmma"
    stage_counts = (2,)  # K and V double-buffered: the software pipeline retires both every block
    arch_features = "a"  # wgmma exists only in the arch-specific sm_90a target
    capabilities = ((9, 0),)
    shapes = ((64, 1), (128, 1), (192, 1))  # 1 to 3 warpgroups of 64 rows share each K/V tile
    # (not 4: docs/decisions.md#attention-wgmma-warpgroups)
    block_ns = (64, 128)
    head_dims = (64, 128)  # whole 128-byte swizzle rows

    bias_registers = WGMMA_BIAS_REGISTERS  # what a bias variant needs beyond the plain kernel

    def registers(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        return (WGMMA_REGISTERS[(problem.head_dim, params["block_n"])] + WINDOW_REGISTERS * problem.row_windows
                + self.bias_registers * problem.bias)

    def shared_bytes(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        rows = params["block_m"] + 2 * params["stages"] * params["block_n"]
        return rows * problem.head_dim * 2 + 1024  # unpadded swizzled rows, 1 KB to align the tiles


PRODUCER_THREADS = 128  # attention_wgmma_ws's copy warpgroup
PRODUCER_REGISTERS = 24  # attention_wgmma_ws's producer: one thread issues every TMA copy
# taking tiles from a counter and narrowing each to its row windows: at 24 the producer spilled 16-24 bytes
IN_TURN_PRODUCER_REGISTERS = 32
# What attention_wgmma_ws's consumer warpgroups need per thread, by (head_dim, block_n): no copy code, so
# less than WGMMA_REGISTERS; (64, 128) compiles into the 160 that three consumer warpgroups get.
WS_CONSUMER_REGISTERS = {(64, 64): 121, (64, 128): 160, (128, 64): 160, (128, 128): 208, (128, 160): 232}
# More for the bias variant (its loads and row pointers): keeps out the points whose bias variants
# spilled: every three-warpgroup one (52-368 bytes at 160 registers) and m128 n128 at d = 128 (112-148
# bytes at 240); CI compiles the rest without spills.
WS_BIAS_REGISTERS = 40
WS_WINDOW_REGISTERS = 16  # the same for the row-window variant (WINDOW_REGISTERS)


class WarpSpecialisedWgmmaAttention(WgmmaAttention):
    """attention_wgmma with a producer warpgroup feeding 2 or 3 consumer warpgroups through
    mbarriers (no CTA-wide barrier per block), registers moved to the consumers by setmaxnreg,
    and the consumers taking turns to issue their wgmmas (ping-pong)."""

    name = "attention_wgmma_ws"
    source_file = "attention_wgmma_ws.cu.j2"
    strategy = "wgmma_ws"
    shapes = ((128, 1), (192, 1))  # 2 or 3 consumer warpgroups: one alone gains nothing from the split
    stage_counts = (2, 3)
    walks_tile_schedule = True
    loads_with_tma = True
    bias_registers = WS_BIAS_REGISTERS
    schedules = (False, True)  # params["persistent"]: one CTA per tile, or one per SM (tile_schedule)

    def block_ns_of(self, problem: AttentionProblem) -> tuple[int, ...]:
        """160-key blocks at d = 128 only (FlashAttention-3's 176 in whole 32-key bit words: 4-8% faster
        than n128 on long causal and full masks on an H200); at d = 64 they ran 0.85-0.93x the model's
        pick (history/41)."""
        return self.block_ns + ((160,) if problem.head_dim == 128 else ())

    def producer_registers(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        """Registers per producer thread after setmaxnreg."""
        return IN_TURN_PRODUCER_REGISTERS if self.takes_tiles_in_turn(problem, params) else PRODUCER_REGISTERS

    def consumer_registers(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        """Registers per consumer thread after setmaxnreg: the launch's own share plus what the
        producer gives up, a multiple of 8, at most 240. setmaxnreg.inc draws only on registers the CTA
        was launched with (the launch cap per thread times its threads): consumers asking more wait
        forever (a producer at 32 beside consumers at 240 hung every launch on the H200)."""
        consumers = params["warps"] * 32
        launched = SM_REGISTER_FILE // (consumers + PRODUCER_THREADS) // 8 * 8
        given_up = (launched - self.producer_registers(problem, params)) * PRODUCER_THREADS
        return min(240, (launched + given_up // consumers) // 8 * 8)

    def space(self, problem: AttentionProblem) -> list[dict[str, Any]]:
        """Three consumer warpgroups (block_m 192) take 3 stages: each K/V buffer stays held until
        the third has read it (measured on the H100: 2 stages no faster, and ptxas spilled one
        of its variants)."""
        needed = (STRIDED_REGISTERS * (problem.residues > 1) + WS_BIAS_REGISTERS * problem.bias
                  + WS_WINDOW_REGISTERS * problem.row_windows)
        points = [params | {"persistent": persistent} for params in super().space(problem)
                  if params["block_m"] == 128 or params["stages"] == 3 for persistent in self.schedules]
        return [params for params in points if WS_CONSUMER_REGISTERS[(problem.head_dim, params["block_n"])] + needed
                <= self.consumer_registers(problem, params)]

    @staticmethod
    def takes_tiles_in_turn(problem: AttentionProblem, params: dict[str, Any]) -> bool:
        """A persistent point with per-call row windows: its CTAs take the schedule's tiles one at a
        time from a counter (zeroed before each launch) instead of fixed shares. A share is cut by
        the static mask's work, which the windows change in every call: under a causal mask the CTA
        holding many short early rows would hold as many whole documents."""
        return bool(params.get("persistent")) and problem.row_windows

    def kernel_name(self, problem: AttentionProblem, params: dict[str, Any]) -> str:
        return super().kernel_name(problem, params) + ("_persistent" if params["persistent"] else "")

    def shared_bytes(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        """Two Q buffers (a persistent CTA loads the next tile's Q while this one's S read the
        other) and, where they fit, a partial block's bit tile per stage (`stages_bits`)."""
        return self._buffers_bytes(problem, params) + self.stages_bits(problem, params) * self._bit_tiles_bytes(params)

    def stages_bits(self, problem: AttentionProblem, params: dict[str, Any]) -> bool:
        """Whether the producer copies each PARTIAL block's bit tile into shared memory beside its K. Where
        the tiles do not fit beside the buffers (d = 128 with n160: 225 KB of Q, K and V), the consumers read
        the words from global memory (L2) instead, issued under the block's matrix products."""
        return self._buffers_bytes(problem, params) + self._bit_tiles_bytes(params) <= SMEM_LIMIT

    def exposes_bit_loads(self, problem: AttentionProblem, params: dict[str, Any]) -> bool:
        return not self.stages_bits(problem, params)

    def _buffers_bytes(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        return super().shared_bytes(problem, params) + params["block_m"] * problem.head_dim * 2  # a second Q buffer

    @staticmethod
    def _bit_tiles_bytes(params: dict[str, Any]) -> int:
        return params["stages"] * params["block_m"] * params["block_n"] // 8

    def registers(self, problem: AttentionProblem, params: dict[str, Any]) -> int:
        """What ptxas reports and the launch reserves: the register file split evenly over all
        threads (setmaxnreg then moves registers from the producer to the consumers)."""
        launch_cap = SM_REGISTER_FILE // (params["warps"] * 32 + PRODUCER_THREADS) // 8 * 8
        return min(super().registers(problem, params), launch_cap)

    def context(self, problem: AttentionProblem, params: dict[str, Any]) -> dict[str, Any]:
        return super().context(problem, params) | {"producer_registers": self.producer_registers(problem, params),
                                                   "consumer_registers": self.consumer_registers(problem, params),
                                                   "in_turn": self.takes_tiles_in_turn(problem, params),
                                                   "staged_bits": self.stages_bits(problem, params)}

    def launch(self, problem: AttentionProblem, params: dict[str, Any]) -> Launch:
        """One CTA per tile, flattened to x; `attention_launch.launch_plan` narrows a persistent
        point's grid to the GPU's SMs."""
        (heads, batch, rows), threads, shared = super().launch(problem, params)
        return (heads * batch * rows, 1, 1), threads + PRODUCER_THREADS, shared


ROWWISE = RowwiseAttention()
BLOCKWISE = BlockwiseAttention()
WGMMA = WgmmaAttention()
WGMMA_WS = WarpSpecialisedWgmmaAttention()
ATTENTION_TEMPLATES = (ROWWISE, BLOCKWISE, WGMMA, WGMMA_WS)
