"""`stof_cc.attention(q, k, v, mask)`: masked multi-head attention on stof-cc's own kernels.

Usable on its own, like FlexAttention (inference only: no backward). The first call for a
mask and an input layout validates the inputs, picks a template and parameters with the
analytical model (cached per problem and mask), takes
the mask in the unified storage format at that kernel's block shape (converted once and
cached per mask, sizes, block shape and device), and launches the compiled kernel on
torch's current stream (see the PyCUDA backend). Nothing here falls back to torch: an input the kernels do not
support raises `AttentionInputError` naming the argument.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.backends.pycuda_backend import Kernel, load_kernel
from stof_cc.masks import MaskDescription, from_dense, full
from stof_cc.masks.block_mask import BlockMask
from stof_cc.templates.attention import (
    ATTENTION_TEMPLATES,
    GRID_YZ_LIMIT,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    AttentionProblem,
    config_label,
)
from stof_cc.templates.pricing import sm_count
from stof_cc.templates.registry import KernelTemplate
from stof_cc.tune.cost_model import Estimate, estimate, stof_rule

LOG2E = 1.4426950408889634


class AttentionInputError(ValueError):
    """q, k, v or the mask cannot be run by the attention kernels; names the argument."""


@dataclass(frozen=True)
class AttentionChoice:
    """The selected template and parameters, with every candidate's estimate (best first)."""

    template: KernelTemplate
    params: dict[str, Any]
    estimates: tuple[Estimate, ...]
    stof_rule: tuple[float, float, str]
    measured_us: float | None = None  # set when stage 2 of the search picked it

    def explain(self) -> str:
        rho, tau, pick = self.stof_rule
        how = (f"measured {self.measured_us:.1f} us (stage 2 of the search)" if self.measured_us is not None
               else "the cost model's first choice")
        lines = [f"chosen: {self.template.name} {config_label(self.params)}, {how}",
                 f"STOF's rule: rho={rho:.4f} tau={tau:.4f} -> {pick}", "candidates (best first):"]
        lines += [f"  {e.describe()}" for e in self.estimates]
        return "\n".join(lines)


# mask description -> {(seq_q, seq_k, bm, bn, batch, heads, device): BlockMask}
_block_masks: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, BlockMask]] = weakref.WeakKeyDictionary()
_choices: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, AttentionChoice]] = weakref.WeakKeyDictionary()
_plans: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, LaunchPlan]] = weakref.WeakKeyDictionary()
_kernels: dict[tuple, Kernel] = {}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: MaskDescription | torch.Tensor | None = None, scale: float | None = None,
              *, params: dict[str, Any] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [B, H, S_q, D], k and v [B, H, S_k, D].

    ``mask``: a description from `stof_cc.masks` (may vary per batch element and head), a
    boolean tensor [S_q, S_k] or [B|1, H|1, S_q, S_k] (True = attend), or None (no mask).
    A query row with no allowed key gives 0. ``params`` pins a template's parameters
    (``{"strategy": "blockwise", "block_m": 64, ...}``) instead of the model's choice.
    ``out``, if given, receives the result: shaped and typed like q, unit stride in head_dim,
    16-byte aligned rows (contiguous, or e.g. a [B, S, H, D] buffer transposed to [B, H, S, D],
    the layout SDPA returns, which lets a following transpose + view cost nothing).

    The first call for a mask and an input layout validates, chooses and builds a
    `LaunchPlan`; later calls reuse it. A boolean-tensor mask is converted on every call:
    keep its `from_dense` description to pay that once.
    """
    description = as_description(mask)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        check_inputs(q, k, v)  # raises, naming the argument
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise AttentionInputError("stof_cc.attention is inference-only (no backward): call it under "
                                  "torch.no_grad() or pass tensors that do not require grad")
    layout = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
              q.device, k.device, v.device, scale, None if params is None else tuple(sorted(params.items())))
    per_mask = _plans.setdefault(description, {})
    plan = per_mask.get(layout)
    if plan is None:
        plan = per_mask[layout] = _plan(q, k, v, description, scale, params)
    if not plan.copy_inputs and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return plan.launch(q, k, v, out)
    # Rows must be 16-byte aligned with unit stride in head_dim: run on contiguous copies.
    q, k, v = (t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
    return attention(q, k, v, description, scale, params=params, out=out)


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
    mask_args: tuple[int, ...]  # any_ptr, any_cols, any_tile, part_bits, row_order
    size_args: tuple[int, ...]  # seq_q, seq_k, then the q, k and v strides over (B, H, S)
    end_args: tuple[Any, ...]  # mask rows per batch and per head, scale * log2(e)
    mask_tensors: tuple[torch.Tensor, ...]  # keeps what mask_args point into alive

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        elif out.shape != self.shape or out.dtype != self.dtype or out.device != self.device \
                or out.stride(3) != 1 or any(st % 8 for st in out.stride()[:3]) or out.data_ptr() % 16:
            raise AttentionInputError(f"out must be a 16-byte aligned {self.dtype} tensor of shape "
                                      f"{self.shape} on {self.device} with unit stride in head_dim and row "
                                      f"strides a multiple of 8; got {out.dtype} {tuple(out.shape)} on "
                                      f"{out.device}, strides {out.stride()}, address {out.data_ptr():#x}")
        self.kernel.launch(self.grid, self.threads, self.shared_bytes,
                           q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *self.mask_args,
                           *self.size_args, *out.stride()[:3], *self.end_args)
        return out


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, description: MaskDescription,
          scale: float | None, params: dict[str, Any] | None) -> LaunchPlan:
    """Validate the inputs, choose the kernel, fetch the mask and build the launch plan."""
    problem = check_inputs(q, k, v)
    scale = 1.0 / math.sqrt(problem.head_dim) if scale is None else float(scale)
    if not scale > 0:
        raise AttentionInputError(f"scale must be positive, got {scale}")
    choice = choose(problem, description) if params is None else _pinned(problem, params)
    block_mask = cached_block_mask(description, problem, choice.params, q.device)
    grid, threads, shared = choice.template.launch(problem, choice.params)
    mask_tensors = (block_mask.any_ptr, block_mask.any_cols, block_mask.any_tile, block_mask.part_bits,
                    _row_order(block_mask))
    rows_per_head = block_mask.n_rb if block_mask.heads > 1 else 0
    rows_per_batch = block_mask.heads * block_mask.n_rb if block_mask.batch > 1 else 0
    copy_inputs = not all(t.stride(3) == 1 and all(st % 8 == 0 for st in t.stride()[:3]) for t in (q, k, v))
    return LaunchPlan(
        kernel=compiled_kernel(choice.template, problem, choice.params),
        grid=grid, threads=threads, shared_bytes=shared,
        shape=tuple(q.shape), dtype=q.dtype, device=q.device, copy_inputs=copy_inputs,
        mask_args=tuple(t.data_ptr() for t in mask_tensors),
        size_args=(problem.seq_q, problem.seq_k, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3]),
        end_args=(rows_per_batch, rows_per_head, scale * LOG2E),
        mask_tensors=mask_tensors,
    )


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionProblem:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionInputError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if t.device.type != "cuda":
            raise AttentionInputError(f"{name} is on {t.device}; the kernels run on CUDA devices "
                                      "(stof_cc.ir.reference.masked_attention is the CPU reference)")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise AttentionInputError("q, k and v must share one dtype and one device")
    batch, heads, seq_q, head_dim = q.shape
    if k.shape[:2] != (batch, heads) or v.shape != k.shape or k.shape[3] != head_dim:
        raise AttentionInputError(f"k and v must be [{batch}, {heads}, S_k, {head_dim}] like q; "
                                  f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    return _validated(AttentionProblem(batch, heads, seq_q, k.shape[2], head_dim, q.dtype))


def _validated(problem: AttentionProblem) -> AttentionProblem:
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


def as_description(mask: MaskDescription | torch.Tensor | None) -> MaskDescription:
    if mask is None:
        return _FULL
    if isinstance(mask, MaskDescription):
        return mask
    if isinstance(mask, torch.Tensor):
        return from_dense(mask)
    raise AttentionInputError(f"mask must be a stof_cc.masks description, a bool tensor or None; "
                              f"got {type(mask).__name__}")


_FULL = full()


def candidates(problem: AttentionProblem,
               capability: tuple[int, int] | None = None) -> list[tuple[KernelTemplate, dict[str, Any]]]:
    """Every (template, params) that can run ``problem`` on a GPU of ``capability`` (default:
    the current device's, or the H100's (9, 0) on a machine without one)."""
    capability = capability or _capability()
    return [(t, p) for t in ATTENTION_TEMPLATES if t.runs_on(capability) for p in t.space(problem)]


def choose(problem: AttentionProblem, description: MaskDescription) -> AttentionChoice:
    """The model's pick for this problem and mask (cached with the mask)."""
    key = (problem, sm_count())
    per_mask = _choices.setdefault(description, {})
    if key not in per_mask:
        scored = []
        options = candidates(problem)
        if not options:
            raise AttentionInputError(f"no attention kernel runs {problem} on compute capability "
                                      f"{_capability()} (the templates need sm_80 or newer, a batch of at "
                                      f"most {GRID_YZ_LIMIT} and at most {GRID_YZ_LIMIT} block rows)")
        for template, params in options:
            bm = cached_block_mask(description, problem, params, torch.device("cpu"))
            row_blocks = (bm.any_ptr[1:] - bm.any_ptr[:-1]).tolist()
            heads_batches = problem.batch * problem.heads // (bm.batch * bm.heads)
            scored.append((estimate(params, problem.head_dim, heads_batches, row_blocks,
                                    int(bm.part_cols.numel()), template.shared_bytes(problem, params),
                                    key[1], template.registers(problem, params),
                                    template.launch(problem, params)[1]), template))
        scored.sort(key=lambda item: item[0].micros)
        best, template = scored[0]
        fine = cached_block_mask(description, problem, {"block_m": 16, "block_n": 16}, torch.device("cpu"))
        rule = stof_rule(int(fine.any_cols.numel()) // (fine.batch * fine.heads), fine.n_rb * fine.n_cb)
        per_mask[key] = AttentionChoice(template, best.params, tuple(e for e, _ in scored), rule)
    return per_mask[key]


def adopt_choice(problem: AttentionProblem, description: MaskDescription, template: KernelTemplate,
                 params: dict[str, Any], measured_us: float) -> AttentionChoice:
    """Make a measured winner the choice for (problem, mask): later `attention` calls run it."""
    modelled = choose(problem, description)
    choice = AttentionChoice(template, dict(params), modelled.estimates, modelled.stof_rule, measured_us)
    _choices[description][(problem, sm_count())] = choice
    _plans.pop(description, None)  # plans built on the model's choice
    return choice


def explain_attention(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                      mask: MaskDescription | torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float16) -> AttentionChoice:
    """The kernel `attention` would run for these sizes and mask, with every candidate's
    estimate; needs no GPU (the SM count defaults to the H100's 132 without one).
    ``choice.explain()`` formats it."""
    problem = _validated(AttentionProblem(batch, heads, seq_q, seq_k, head_dim, dtype))
    return choose(problem, as_description(mask))


def _pinned(problem: AttentionProblem, params: dict[str, Any]) -> AttentionChoice:
    by_strategy = {t.strategy: t for t in ATTENTION_TEMPLATES}
    template = by_strategy.get(params.get("strategy"))
    if template is None:
        raise AttentionInputError(f"params {params}: strategy must be one of {sorted(by_strategy)}")
    if not template.runs_on(_capability()):
        raise AttentionInputError(f"{template.name} does not run on compute capability {_capability()}")
    if params not in template.space(problem):
        raise AttentionInputError(f"params {params} are not in {template.name}'s space for {problem}")
    return AttentionChoice(template, params, (), (0.0, 0.0, ""))


def cached_block_mask(description: MaskDescription, problem: AttentionProblem,
                      params: dict[str, Any], device: torch.device) -> BlockMask:
    key = (problem.seq_q, problem.seq_k, params["block_m"], params["block_n"],
           problem.batch, problem.heads, str(device))
    per_mask = _block_masks.setdefault(description, {})
    if key not in per_mask:
        if device.type == "cpu":
            per_mask[key] = description.block_mask(problem.seq_q, problem.seq_k, params["block_m"],
                                                   params["block_n"], batch=problem.batch, heads=problem.heads)
        else:
            per_mask[key] = cached_block_mask(description, problem, params, torch.device("cpu")).to(device)
    return per_mask[key]


def compiled_kernel(template: KernelTemplate, problem: AttentionProblem, params: dict[str, Any]) -> Kernel:
    """Render, compile (nvcc, cached on disk) and load the kernel; cached per process."""
    key = (template.name, problem.dtype, problem.head_dim, tuple(sorted(params.items())))
    if key not in _kernels:
        _kernels[key] = load_kernel(template.render(problem, params), template.kernel_name(problem, params),
                                    template.arg_format, arch_features=template.arch_features,
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


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
