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
import warnings
import weakref
from collections import Counter
from typing import Any

import torch

from stof_cc.backends.attention_launch import (
    SINKS_WITH_LSE,
    KeyPadding,
    LaunchPlan,
    bias_view,
    key_padding_on_device,
    launch_plan,
    sink_logits,
)
from stof_cc.backends.pycuda_backend import current_device
from stof_cc.backends.row_windows import document_windows, position_windows
from stof_cc.masks import MaskDescription
from stof_cc.masks.zoo import PACKED_GROUP, SEGMENTS_GROUP
from stof_cc.templates.attention import (
    AttentionInputError,
    problem_of,
)
from stof_cc.tune.attention import (
    as_description,
    cached_block_mask,
    choose,
    on_adopt,
    pinned_choice,
    residue_problem,
    strided_split,
)

_plans: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, LaunchPlan]] = weakref.WeakKeyDictionary()
# New document masks planned per (choice group, layout): past PER_CALL_DOCUMENTS of them, one warning that
# cu_seqlens / position_ids read the documents on the device instead (`_advise_device_documents`).
_documents_planned: Counter[tuple] = Counter()
PER_CALL_DOCUMENTS = 8


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: MaskDescription | torch.Tensor | None = None, scale: float | None = None,
              *, key_padding: torch.Tensor | KeyPadding | None = None, bias: torch.Tensor | None = None,
              params: dict[str, Any] | None = None, out: torch.Tensor | None = None,
              return_lse: bool = False, cu_seqlens: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale, masked) v for q [B, H, S_q, D], k and v [B, H, S_k, D].

    ``mask``: a description from `stof_cc.masks` (may vary per batch element and head), a
    boolean tensor [S_q, S_k] or [B|1, H|1, S_q, S_k] (True = attend), or None (no mask).
    ``key_padding`` [B, S_k] (nonzero = attend, like HF's ``attention_mask``; any pattern, not
    only right padding) hides keys per batch element on top of ``mask``; the kernels read it on
    the device, so a call with it needs no host read and can be captured in a CUDA graph
    (`key_padding_on_device` converts it once where several calls share it).
    ``bias``, broadcastable to [B, H, S_q, S_k] (T5's relative position bias, ALiBi), is added
    to the scaled scores, as SDPA adds a float ``attn_mask``.
    A query row with no allowed key gives 0. ``params`` pins a template's parameters
    (``{"strategy": "blockwise", "block_m": 64, ...}``) instead of the model's choice.
    ``out``, if given, receives the result: shaped and typed like q, unit stride in head_dim,
    16-byte aligned rows (contiguous, or e.g. a [B, S, H, D] buffer transposed to [B, H, S, D],
    the layout SDPA returns, which lets a following transpose + view cost nothing), neither expanded
    nor lying where q, k or v lie (tiles read their inputs while others write).
    ``return_lse``: also return each query row's log-sum-exp of its scaled scores, fp32
    [B, H, S_q] (natural log; -inf where no key is allowed), as FlashAttention does: partial
    results over disjoint key sets merge with it (`merge_partials`).
    ``cu_seqlens`` (FlashAttention's cumulative lengths [n + 1], int32 or int64: 0, then each
    document's end): packed documents, new in every call, on top of ``mask`` (``masks.causal()``
    for a decoder's packed batch, None for an encoder's): each query row attends only to its own
    document's keys. The boundaries are read on the device (`document_windows`) by the kernels'
    row-window variant, so the call needs no host read and no new plan when they change, and a
    CUDA graph replays it with whatever the same buffer holds (a device ``cu_seqlens``; a CPU one is
    copied, and cannot be captured); ``mask`` keeps its one plan. Equal query and key lengths; not
    with a bias. ``position_ids`` ([S] or [B, S]: HF's padding-free batches, a document opening
    wherever an id is not its predecessor's + 1, as transformers reads them) says the same per
    batch element instead (`position_windows`).
    ``sinks``: one logit per query head ([H]: GPT-OSS's attention sinks, transformers' ``s_aux``),
    each a key every row sees with that score and a value of 0: it takes its share of the row's
    softmax and adds nothing (a row with no allowed key still gives 0; finite logits: an infinite or NaN
    one gives rows of 0 where the eager chain gives NaN). Not with ``return_lse``
    (partial results merged by their log-sum-exp would count each sink once per part).

    The first call for a mask and an input layout validates, chooses and builds a
    `LaunchPlan`; later calls reuse it. A boolean-tensor mask is converted on every call:
    keep its `from_dense` description to pay that once.
    """
    description = as_description(mask)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        problem_of(q, k, v)  # raises, naming the argument
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, bias)):
        raise AttentionInputError("stof_cc.attention is inference-only (no backward): call it under "
                                  "torch.no_grad() or pass tensors (q, k, v and the bias) that do not require grad")
    if key_padding is not None and not isinstance(key_padding, torch.Tensor | KeyPadding):
        raise AttentionInputError(f"key_padding must be a [B, S_k] tensor (nonzero: a key to attend) or a KeyPadding, "
                                  f"got {type(key_padding).__name__}")
    if q.is_cuda and q.device.index != current_device():  # kernels launch on the current device
        with torch.cuda.device(q.device):
            return attention(q, k, v, description, scale, key_padding=key_padding, bias=bias, params=params, out=out,
                             return_lse=return_lse, cu_seqlens=cu_seqlens, position_ids=position_ids, sinks=sinks)
    if sinks is not None:
        if return_lse:
            raise AttentionInputError(SINKS_WITH_LSE)
        problem_of(q, k, v)  # q's heads are what the sinks are checked against
        sinks = sink_logits(sinks, q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if return_lse else None
    if cu_seqlens is not None or position_ids is not None:
        packing = "cu_seqlens" if cu_seqlens is not None else "position_ids"
        if cu_seqlens is not None and position_ids is not None:
            raise AttentionInputError("pass cu_seqlens or position_ids, not both: each says where the documents are")
        if q.dim() != 4 or k.dim() != 4:
            problem_of(q, k, v)  # raises, naming the argument
        if q.shape[2] != k.shape[2]:
            raise AttentionInputError(f"{packing} packs one sequence of queries and keys; got {q.shape[2]} "
                                      f"queries and {k.shape[2]} keys")
        if bias is not None:
            raise AttentionInputError(f"{packing} with a bias is not supported yet (the kernels' variant for both "
                                      "is not built: its wgmma points spilled); describe the documents with "
                                      "masks.document(lengths) instead")
        windows = (document_windows(cu_seqlens, q.shape[0], q.shape[2], q.device) if cu_seqlens is not None
                   else position_windows(position_ids, q.shape[0], q.shape[2], q.device))
        plan = _planned(q, k, v, description, scale, params, False, windows=True)
        out, lse = _launched(plan, q, k, v, description, scale, params, key_padding, None, out, lse, windows, sinks)
        return (out, lse) if return_lse else out
    split = _strided_split(q, k, v, description, key_padding, bias, params)
    if split is not None:
        out = _run_split(q, k, v, split, scale, key_padding, out, lse, sinks)
        return (out, lse) if return_lse else out
    plan = _planned(q, k, v, description, scale, params, bias is not None)
    out, lse = _launched(plan, q, k, v, description, scale, params, key_padding, bias, out, lse, sinks=sinks)
    return (out, lse) if return_lse else out


def _launched(plan: LaunchPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              description: MaskDescription | None, scale: float | None, params: dict[str, Any] | None,
              key_padding: Any, bias: torch.Tensor | None, out: torch.Tensor | None, lse: torch.Tensor | None,
              windows: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, lse): ``plan`` launched, or its twin for contiguous copies of q, k, v where the
    plan cannot take their layout; key padding and the bias in the kernels' forms (``sinks`` already
    `sink_logits`')."""
    if isinstance(key_padding, torch.Tensor):
        key_padding = key_padding_on_device(key_padding)
    if bias is not None:
        bias = bias_view(bias, q, k.shape[2])
    if plan.copy_inputs or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        # Rows must be 16-byte aligned with unit stride in head_dim: run on contiguous copies.
        q, k, v = (t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
        plan = _planned(q, k, v, description, scale, params, bias is not None, windows=windows is not None)
    return plan.launch(q, k, v, out, key_padding, bias, lse, windows, sinks), lse


def _planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, description: MaskDescription | None,
             scale: float | None, params: dict[str, Any] | None, bias: bool, residues: int = 1,
             windows: bool = False) -> LaunchPlan:
    """The launch plan for this mask and input layout (``residues``: a strided split's d, the
    mask then being each residue's; ``windows``: the row-window variant): built on the first
    call, then reused."""
    layout = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
              q.device, k.device, v.device, scale, None if params is None else tuple(sorted(params.items())), bias,
              residues, windows)
    per_mask = _plans.setdefault(description, {})
    plan = per_mask.get(layout)
    if plan is None:
        if not (bias or windows):  # cu_seqlens takes no bias; with windows the documents are on the device already
            _advise_device_documents(description, layout)
        plan = per_mask[layout] = _plan(q, k, v, description, scale, params, bias, residues, windows)
    return plan


def _advise_device_documents(description: MaskDescription | None, layout: tuple) -> None:
    """Warn once per kind and layout when documents described anew every call (`masks.document(lengths)`,
    `masks.document(segment_ids=ids)`: new boundaries, a new description) keep being planned: each is classified, laid
    out and scheduled on the host (20-25 ms at S = 32768 on the lent H200's host, history/41) where
    `cu_seqlens` or `position_ids` read the documents on the device into the one plan their mask has."""
    group = None if description is None else description.choice_group()
    if not _names_documents(group):
        return
    _documents_planned[group, layout] += 1
    if _documents_planned[group, layout] == PER_CALL_DOCUMENTS:
        warnings.warn(f"stof_cc.attention: {PER_CALL_DOCUMENTS} different document masks of one kind ({description!r} "
                      "the latest) have each been planned for the same inputs: every new one is classified, laid out "
                      "and scheduled on the host (tens of ms at S = 32768). For documents that change every call, "
                      "pass cu_seqlens= (or position_ids=) with the mask the documents sit under (masks.causal() "
                      "or None): they are read on the device into one plan, and a CUDA graph can replay the call",
                      stacklevel=4)


def _names_documents(group: object) -> bool:
    """Whether a choice group (`MaskDescription.choice_group`: nested tuples for combined masks) holds
    packed documents' or segment ids' group."""
    if not isinstance(group, tuple) or not group:
        return False
    return group[0] in (PACKED_GROUP, SEGMENTS_GROUP) or any(
        _names_documents(part) for part in group if isinstance(part, tuple))


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, description: MaskDescription,
          scale: float | None, params: dict[str, Any] | None, bias: bool, residues: int,
          windows: bool = False) -> LaunchPlan:
    """Validate the inputs, choose the kernel, fetch the mask and build the launch plan."""
    problem = residue_problem(dataclasses.replace(problem_of(q, k, v), bias=bias, row_windows=windows), residues)
    choice = choose(problem, description) if params is None else pinned_choice(problem, params)
    block_mask = cached_block_mask(description, problem, choice.params, q.device)
    return launch_plan(q, k, v, problem, choice.template, choice.params, block_mask, scale)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor],
                   into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of disjoint key sets from each set's output [B, H, S, D] and
    log-sum-exp [B, H, S] (`attention(..., return_lse=True)`): each next output mixed in with
    weight exp(lse_i - lse) by one `lerp` pass (the weights of the sets so far and of the next sum
    to 1), written into ``into`` when given (it may be ``outs[0]``). A row no set allows stays 0
    with lse -inf. The weight is rounded to the outputs' dtype (bf16: 2^-9 relative, below the
    outputs' own rounding); one pass, where blending in fp32 would take four."""
    if into is None:
        out = outs[0].clone() if len(outs) > 1 else outs[0]
    else:
        out = into if into is outs[0] else into.copy_(outs[0])
    lse = lses[0]
    for other, other_lse in zip(outs[1:], lses[1:], strict=True):
        merged = torch.logaddexp(lse, other_lse)
        weight = torch.exp(other_lse - merged).nan_to_num(0.0)  # both -inf: NaN -> keep the zeros
        out.lerp_(other, weight.unsqueeze(-1).to(out.dtype))
        lse = merged
    return out, lse


_splits: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, tuple | None]] = weakref.WeakKeyDictionary()


def _strided_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, description: MaskDescription | None,
                   key_padding: Any, bias: torch.Tensor | None,
                   params: dict[str, Any] | None) -> tuple[int, MaskDescription] | None:
    """(d, sub-mask) when the mask splits into d strided attentions and the split pays
    (`tune.attention.strided_split`: a dilated window is d sliding windows over every d-th position);
    else None. Decided once per mask and problem. Not with a bias, pinned parameters or pre-converted key
    padding (`launched_form`'s ``splits``)."""
    if description is None or bias is not None or params is not None or isinstance(key_padding, KeyPadding):
        return None
    per_mask = _splits.setdefault(description, {})
    sizes = (q.shape, k.shape, v.shape, q.dtype, q.device)
    if sizes not in per_mask:
        per_mask[sizes] = strided_split(problem_of(q, k, v), description)
    return per_mask[sizes]


def _run_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: tuple[int, MaskDescription],
               scale: float | None, key_padding: torch.Tensor | None, out: torch.Tensor | None,
               lse: torch.Tensor | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The d strided attentions (residue r: positions r, r + d, ...) in one launch, each residue
    a batch slot reading and writing its own rows of q, k, v and out; a row's keys all lie in its
    residue, so each row's softmax, its sink included, is whole in one of them."""
    d, sub = split
    plan = _planned(q, k, v, sub, scale, None, False, d)
    if plan.copy_inputs or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        # Rows must be 16-byte aligned with unit stride in head_dim: run on contiguous copies.
        q, k, v = (t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
        plan = _planned(q, k, v, sub, scale, None, False, d)
    padding = None
    if key_padding is not None:  # batch slot b * d + r reads key_padding[b, r::d]
        if key_padding.dim() != 2 or key_padding.shape[1] != k.shape[2]:
            raise AttentionInputError(f"key_padding must be [batch, {k.shape[2]}] (nonzero = attend), got shape "
                                      f"{tuple(key_padding.shape)}")
        per_residue = key_padding.reshape(key_padding.shape[0], -1, d).transpose(1, 2)
        padding = key_padding_on_device(per_residue.reshape(-1, key_padding.shape[1] // d))
    return plan.launch(q, k, v, out, padding, lse=lse, sinks=sinks)


on_adopt(lambda description: _plans.pop(description, None))  # plans built on the model's pick
