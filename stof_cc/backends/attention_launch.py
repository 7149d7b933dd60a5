"""Launch one masked-attention template point: its kernel compiled and loaded once per
(template, dtype, head dim, parameters), and a `LaunchPlan` that fixes every argument but the
tensor pointers for one input layout and mask. `stof_cc.attention` runs its chosen point
through here; stage 2 of the search runs each candidate the same way."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from stof_cc.backends.pycuda_backend import Kernel, load_kernel
from stof_cc.backends.tensor_map import TENSOR_MAP_FORMAT, encode_heads
from stof_cc.backends.tile_schedule import tile_schedule
from stof_cc.ir.memory import bytes_spanned, overlaps_itself, spans_meet
from stof_cc.masks.block_mask import BlockMask
from stof_cc.templates.attention import AttentionInputError, AttentionProblem, check_scale
from stof_cc.templates.registry import KernelTemplate

LOG2E = 1.4426950408889634

_kernels: dict[tuple, Kernel] = {}
# Plans a CUDA graph captured a launch of: every replay reads their device tensors (the tile schedule, the
# block mask) by address, and the runtime's own plans go with their mask, which a caller may have built
# inline and dropped. Held for the process; a graph cannot say when it is destroyed.
_captured_plans: dict[int, LaunchPlan] = {}
MAX_CACHED_MAPS = 64  # per plan: the (q, k, v, out) address sets whose tensor maps are kept (least recent out)
OUT_BOX_ROWS = 64  # the output map's box: a consumer warpgroup's rows (attention_wgmma_ws stores them with TMA)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything about a call that the inputs' layout and the mask fix: the kernel, its
    geometry and every argument but the tensor pointers, so that a repeated call costs a
    dictionary lookup, an output allocation and one driver launch."""

    kernel: Kernel
    grid: tuple[int, int, int]
    threads: int
    shared_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    copy_inputs: bool  # the strides do not suit the kernel: callers pass contiguous copies
    mask_args: tuple[int, ...]  # any_ptr, any_cols, any_tile, part_bits, row_order (or the tile schedule)
    size_args: tuple[int, ...]  # seq_q, seq_k, then the q, k and v strides over (B, H, S, residue)
    end_args: tuple[Any, ...]  # mask rows per batch and per head, scale * log2(e), K/V head multiplier, residues
    # and their multiplier
    mask_tensors: tuple[torch.Tensor, ...]  # keeps what mask_args point into alive
    bias_to_raw: float  # 1 / scale: a bias is added to the raw scores, before the scale
    reads_bias: bool  # the kernel variant that adds a bias (problem.bias)
    reads_windows: bool  # the kernel variant that narrows rows to per-call windows (problem.row_windows)
    takes_tiles_in_turn: bool = False  # CTAs take tiles from a counter, zeroed for each launch (template.takes_tiles_in_turn)
    tma_box_rows: tuple[int, int] | None = None  # Q's and K/V's tile rows when the kernel loads (and stores) with TMA
    residues: int = 1  # a strided split's d (problem.residues)
    _maps: OrderedDict[tuple[int, ...], list[bytes]] = field(default_factory=OrderedDict, compare=False,
                                                             repr=False)

    def tensor_maps(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> list[bytes]:
        """Q, K, V and O's tensor maps for a TMA kernel (none otherwise; O's boxes are a warpgroup's
        64 rows), encoded once per address and stride set and kept for the MAX_CACHED_MAPS sets used
        last: a model's buffers, or a CUDA graph's, are encoded on their first call only (the
        caching allocator hands a call's new output the address the last one freed)."""
        if self.tma_box_rows is None:
            return []
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *out.stride())
        maps = self._maps.get(key)
        if maps is None:
            if len(self._maps) >= MAX_CACHED_MAPS:
                self._maps.popitem(last=False)
            q_rows, kv_rows = self.tma_box_rows
            maps = self._maps[key] = [encode_heads(t, rows, self.residues)
                                      for t, rows in ((q, q_rows), (k, kv_rows), (v, kv_rows), (out, OUT_BOX_ROWS))]
        else:
            with contextlib.suppress(KeyError):  # another thread's call may have evicted it since
                self._maps.move_to_end(key)
        return maps

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None, padding: KeyPadding | None = None,
               bias: torch.Tensor | None = None, lse: torch.Tensor | None = None,
               windows: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Launch on q, k, v (laid out as planned) into ``out`` (or a new tensor), with key
        padding (per batch slot: [B * residues, S_k / residues]) and an additive ``bias``
        (`bias_view`'s result) when given; ``lse``, an fp32 [B, H, S_q] tensor (unit stride over
        rows), receives each row's log-sum-exp; ``windows`` (`document_windows`' int32 [B, S_q, 2])
        narrows each query row to its keys [x, y) in the plan's row-window variant; ``sinks``
        (`sink_logits`' contiguous fp32 [H]) adds each head's sink to its rows' softmax denominators."""
        if torch.cuda.is_current_stream_capturing():
            _captured_plans[id(self)] = self
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        elif out.shape != self.shape or out.dtype != self.dtype or out.device != self.device \
                or out.stride(3) != 1 or any(st % 8 for st in out.stride()[:3]) or out.data_ptr() % 16:
            raise AttentionInputError(f"out must be a 16-byte aligned {self.dtype} tensor of shape "
                                      f"{self.shape} on {self.device} with unit stride in head_dim and row "
                                      f"strides a multiple of 8; got {out.dtype} {tuple(out.shape)} on "
                                      f"{out.device}, strides {out.stride()}, address {out.data_ptr():#x}")
        elif overlaps_itself(out) or _lies_where(out, (q, k, v)):
            # every CTA writes its rows while others still read q, k and v: one element written twice, or
            # an input overwritten before a tile (document tiles overlap, L2 sections reorder) reads it
            raise AttentionInputError(f"out must not overlap itself (strides {out.stride()} for shape "
                                      f"{tuple(out.shape)}: an expanded tensor) nor lie where q, k or v lie")
        if padding is None:
            padding_args = (0, 0)
        elif padding.ranges.shape[0] != self.shape[0] * self.residues or padding.valid.shape[1] != self.size_args[1] \
                or padding.ranges.device != self.device:
            rows = "batch elements" if self.residues == 1 else f"batch slots ({self.residues} per batch element)"
            raise AttentionInputError(f"key_padding is for {padding.valid.shape[0]} {rows} of "
                                      f"{padding.valid.shape[1]} keys on {padding.ranges.device}; these "
                                      f"inputs have {self.shape[0] * self.residues} of {self.size_args[1]} keys "
                                      f"on {self.device}")
        else:
            padding_args = (padding.ranges.data_ptr(), padding.valid.data_ptr())
        if (bias is not None) != self.reads_bias:
            raise AttentionInputError("this plan was built " + ("with" if self.reads_bias else "without")
                                      + " a bias; pass the same kind of call")
        bias_args = (0, 0, 0, 0) if bias is None else (bias.data_ptr(), *bias.stride()[:3])
        if (windows is not None) != self.reads_windows:
            raise AttentionInputError("this plan was built " + ("with" if self.reads_windows else "without")
                                      + " row windows (cu_seqlens); pass the same kind of call")
        window_args = ()
        if windows is not None:
            if windows.shape != (self.shape[0], self.size_args[0], 2) or windows.dtype != torch.int32 \
                    or windows.device != self.device or not windows.is_contiguous() or windows.data_ptr() % 8:
                raise AttentionInputError(f"row windows must be a contiguous int32 tensor [{self.shape[0]}, "
                                          f"{self.size_args[0]}, 2] on {self.device} (`document_windows`), got "
                                          f"{windows.dtype} {tuple(windows.shape)} on {windows.device}")
            # a counter per launch, from the stream's allocator: launches on two streams (or two graphs'
            # replays) never share one, and a captured launch replays its zeroing
            counter = torch.zeros(1, dtype=torch.int32, device=self.device) if self.takes_tiles_in_turn else None
            window_args = (windows.data_ptr(), 0 if counter is None else counter.data_ptr())
        if lse is None:
            lse_args = (0, 0, 0, 0, 0)
        elif lse.shape != self.shape[:3] or lse.dtype != torch.float32 or lse.device != self.device or lse.stride(2) != 1:
            raise AttentionInputError(f"lse must be a float32 tensor of shape {self.shape[:3]} on {self.device} with "
                                      f"unit stride over rows; got {lse.dtype} {tuple(lse.shape)} on {lse.device}, "
                                      f"strides {lse.stride()}")
        else:
            lse_args = (lse.data_ptr(), *residue_strides(lse.unsqueeze(-1), self.residues))
        if sinks is not None and lse is not None:
            raise AttentionInputError(SINKS_WITH_LSE)
        if sinks is not None and (sinks.shape != self.shape[1:2] or sinks.dtype != torch.float32
                                  or sinks.device != self.device or sinks.stride(0) != 1):
            raise AttentionInputError(f"sinks must be a contiguous float32 tensor [{self.shape[1]}] on {self.device} "
                                      f"(`sink_logits`), got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
        self.kernel.launch(self.grid, self.threads, self.shared_bytes, *self.tensor_maps(q, k, v, out),
                           q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *self.mask_args,
                           *padding_args, *self.size_args, *residue_strides(out, self.residues), *self.end_args,
                           *bias_args, self.bias_to_raw, *lse_args, 0 if sinks is None else sinks.data_ptr(),
                           *window_args)
        return out


def _lies_where(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``out`` may hold some of the inputs' bytes."""
    span = bytes_spanned(out)
    return any(spans_meet(span, bytes_spanned(t)) for t in inputs)


def bias_view(bias: torch.Tensor, q: torch.Tensor, seq_k: int) -> torch.Tensor:
    """An additive bias broadcastable to [B, H, S_q, S_k] as the kernels read it: 4-D in q's
    dtype (rounded to it, a finite value beyond its range saturated at its largest), expanded
    (size-1 dims get stride 0) and unit stride over keys."""
    b, h, s_q = q.shape[:3]
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.device != q.device:
        raise AttentionInputError(f"bias must be a floating tensor on {q.device}, got "
                                  f"{type(bias).__name__ if not isinstance(bias, torch.Tensor) else f'{bias.dtype} on {bias.device}'}")
    if bias.dtype != q.dtype:  # saturated: fp32's -1e9 or +7e4 gave fp16's -inf / +inf (a hidden row, NaN)
        limits = torch.finfo(q.dtype)
        bias = torch.where(bias.isinf(), bias, bias.clamp(limits.min, limits.max)).to(q.dtype)
    try:
        bias = bias.expand(b, h, s_q, seq_k)
    except RuntimeError:
        raise AttentionInputError(f"bias of shape {tuple(bias.shape)} does not broadcast to "
                                  f"[{b}, {h}, {s_q}, {seq_k}]") from None
    return bias if bias.stride(3) == 1 else bias.contiguous()


# A part's log-sum-exp holds no sink: parts merged by it would count each sink once per part
SINKS_WITH_LSE = ("sinks with return_lse (an lse output) is not supported: partial results merged by their "
                  "log-sum-exp would count each sink once per part")


def sink_logits(sinks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Attention sinks as the kernels read them: one logit per query head (GPT-OSS's ``sinks``,
    transformers' ``s_aux``: a [H] tensor, or any shape with H elements), a contiguous fp32 [H] on
    q's device. Each counts as a key whose score is the logit and whose value is 0: it takes its
    share of every row's softmax and adds nothing to the output."""
    heads = q.shape[1]
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.device != q.device \
            or sinks.numel() != heads:
        got = type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else \
            f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        raise AttentionInputError(f"sinks must be a floating tensor of {heads} logits (one per query head) on "
                                  f"{q.device}, got {got}")
    return sinks.reshape(heads).to(torch.float32).contiguous()


@dataclass(frozen=True)
class KeyPadding:
    """Key padding as the kernels read it, on the device: ``ranges`` int32 [B, 3] holds per
    batch element the first attended key, one past the last, and 1 when padding lies between
    them (the kernel then tests ``valid`` [B, S_k] uint8 key by key). Built by torch ops with
    no host read, so padded models replay CUDA graphs."""

    ranges: torch.Tensor
    valid: torch.Tensor


def key_padding_on_device(padding: torch.Tensor) -> KeyPadding:
    """``padding`` [B, S_k] (nonzero = attend, e.g. HF's ``attention_mask``) as a `KeyPadding`."""
    if padding.dim() != 2:
        raise AttentionInputError(f"key_padding must be [batch, keys] (nonzero = attend), got shape "
                                  f"{tuple(padding.shape)}")
    valid = padding != 0
    seq_k = valid.shape[1]
    index = torch.arange(seq_k, device=valid.device, dtype=torch.int32)
    start = torch.where(valid, index, seq_k).amin(1)
    end = torch.where(valid, index + 1, 0).amax(1)
    holes = (end - start) > valid.sum(1, dtype=torch.int32)
    ranges = torch.stack((start, end, holes.to(torch.int32)), 1).to(torch.int32).contiguous()
    return KeyPadding(ranges, valid.to(torch.uint8).contiguous())


def kv_bytes_per_query_head(problem: AttentionProblem) -> int:
    """The K and V one query head reads, in bytes: a K/V head's whole K and V (of a strided split's
    sequence) over the query heads that share it (grouped-query attention); what the tile schedule
    fits into L2 sections."""
    element_bytes = torch.finfo(problem.dtype).bits // 8
    return 2 * problem.seq_k * problem.head_dim * element_bytes * (problem.kv_heads or problem.heads) // problem.heads


def launch_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem,
                template: KernelTemplate, params: dict[str, Any], block_mask: BlockMask,
                scale: float | None) -> LaunchPlan:
    """The plan for running ``template`` at ``params`` on inputs laid out like q, k, v (already
    checked as ``problem``) with ``block_mask`` (on q's device, at the point's block shape).
    A strided split's problem (``problem.residues`` d > 1: batch B * d, sequences S / d) runs
    in one launch on the unsplit q, k, v, each residue's positions r, r + d, ... a sequence of its own."""
    residues = problem.residues
    scale = 1.0 / math.sqrt(problem.head_dim) if scale is None else float(scale)
    check_scale(scale)
    grid, threads, shared = template.launch(problem, params)
    in_turn = template.takes_tiles_in_turn(problem, params)
    if template.walks_tile_schedule:  # grid (CTAs, 1, 1), the schedule in place of row_order
        device = torch.cuda.get_device_properties(q.device)
        ctas = device.multi_processor_count if params["persistent"] else None
        schedule = tile_schedule(block_mask, problem.batch, problem.heads, ctas, device.multi_processor_count,
                                 kv_bytes_per_query_head(problem), device.L2_cache_size,
                                 in_turn=in_turn)
        grid, order = (schedule.ctas, 1, 1), schedule.table
    else:
        order = _row_order(block_mask)
    part_bits = block_mask.part_bits
    if template.loads_with_tma and part_bits.data_ptr() % 16:  # bit tiles are bulk-copied from 16-byte aligned rows
        part_bits = part_bits.clone()
    mask_tensors = (block_mask.any_ptr, block_mask.any_cols, block_mask.any_tile, part_bits, order)
    rows_per_head = block_mask.n_rb if block_mask.heads > 1 else 0
    rows_per_batch = block_mask.heads * block_mask.n_rb if block_mask.batch > 1 else 0
    copy_inputs = not all(_suits_kernel(t, template.loads_with_tma) for t in (q, k, v))
    return LaunchPlan(
        kernel=compiled_kernel(template, problem, params),
        grid=grid, threads=threads, shared_bytes=shared,
        shape=tuple(q.shape), dtype=q.dtype, device=q.device, copy_inputs=copy_inputs,
        mask_args=tuple(t.data_ptr() for t in mask_tensors),
        size_args=(problem.seq_q, problem.seq_k, *(st for t in (q, k, v) for st in residue_strides(t, residues))),
        end_args=(rows_per_batch, rows_per_head, scale * LOG2E, kv_head_magic(problem), residues,
                  division_magic(residues, problem.batch)),
        mask_tensors=mask_tensors, bias_to_raw=1.0 / scale, reads_bias=problem.bias,
        reads_windows=problem.row_windows, takes_tiles_in_turn=in_turn,
        tma_box_rows=(params["block_m"], params["block_n"]) if template.loads_with_tma else None,
        residues=residues,
    )


def residue_strides(t: torch.Tensor, residues: int) -> tuple[int, int, int, int]:
    """A [B, H, S, D] operand's strides as the kernels take them: batch, head, row (a residue's
    rows are ``residues`` apart) and residue (one row)."""
    batch, head, row = t.stride()[:3]
    return batch, head, row * residues, row


def _suits_kernel(t: torch.Tensor, tma: bool) -> bool:
    """Unit stride in head_dim and 16-byte row strides (cp.async and TMA); for TMA also no
    broadcast (stride 0) dimension, which a tensor map cannot describe."""
    strides_ok = t.stride(3) == 1 and all(st % 8 == 0 for st in t.stride()[:3])
    return strides_ok and not (tma and any(st == 0 and n > 1 for st, n in zip(t.stride()[:3], t.shape[:3], strict=True)))


def kv_head_magic(problem: AttentionProblem) -> int:
    """The kernels' multiplier for query head h -> K/V head h // group (`division_magic`)."""
    return division_magic(problem.kv_group, problem.heads)


def division_magic(divisor: int, below: int) -> int:
    """The kernels' multiplier for x -> x // divisor: ceil(2^32 / divisor), so that
    umulhi(x, magic) == x // divisor for every x < ``below`` (checked); 0 for divisor 1."""
    if divisor == 1:
        return 0
    magic = -(-(1 << 32) // divisor)
    assert all((x * magic) >> 32 == x // divisor for x in range(below))
    return magic


def compiled_kernel(template: KernelTemplate, problem: AttentionProblem, params: dict[str, Any]) -> Kernel:
    """Render, compile (nvcc, cached on disk) and load the kernel; cached per process."""
    key = (template.name, problem.dtype, problem.head_dim, problem.bias, problem.residues > 1, problem.row_windows,
           tuple(sorted(params.items())))
    if key not in _kernels:
        arg_format = TENSOR_MAP_FORMAT * 4 * template.loads_with_tma + template.arg_format + "PP" * problem.row_windows
        _kernels[key] = load_kernel(template.render(problem, params), template.kernel_name(problem, params),
                                    arg_format, arch_features=template.arch_features,
                                    waits_for_producers=template.waits_for_producers)
    return _kernels[key]


_row_orders: weakref.WeakKeyDictionary[BlockMask, torch.Tensor] = weakref.WeakKeyDictionary()


def _row_order(block_mask: BlockMask) -> torch.Tensor:
    """Block rows by descending block count over all mask slices (longest first), int32 on the
    mask's device: the CTA scheduler then never starts a long row last."""
    if block_mask not in _row_orders:
        counts = (block_mask.any_ptr[1:] - block_mask.any_ptr[:-1]).view(-1, block_mask.n_rb).sum(0)
        order = torch.sort(counts.cpu(), descending=True, stable=True).indices.to(torch.int32)
        _row_orders[block_mask] = order.to(block_mask.any_ptr.device)
    return _row_orders[block_mask]
