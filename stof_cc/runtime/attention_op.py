"""`stof_cc.attention` as a PyTorch custom operator, ``torch.ops.stof_cc.attention`` (issue 36,
item 3): one node that `torch.compile` traces without a graph break (its fake kernel gives the
output's shape), which CUDA graphs capture as they capture the Python call.

    out = torch.ops.stof_cc.attention(q, k, v, "causal", None, key_padding)
    out = torch.ops.stof_cc.attention(q, k, v, "causal", None, None, cu_seqlens)  # packed documents
    out = torch.ops.stof_cc.attention(q, k, v, "causal", None, None, None, sinks)  # GPT-OSS's sinks [H]

The mask travels as a spec string (`stof_cc.masks.parse_spec`: ``"causal"``,
``"sliding:w=255,causal=1"``, ``"longformer:w=128,g=32"``, combinations with ``&`` and ``|``), the
one form of a mask an operator's schema can carry; None attends every key. Each spec is parsed
once, so a compiled graph calling the op reuses the same description and so the same launch
plan. ``cu_seqlens`` (FlashAttention's cumulative lengths) packs documents new every call, as
`stof_cc.attention`'s argument: data, so a compiled graph keeps one plan. On CUDA the op runs stof-cc's kernels; on the CPU it runs the torch reference
(`ir.reference.masked_attention`: fp32 inside, a query with no allowed key gives 0, as the
kernels do), so the op can be traced and checked anywhere. The output is contiguous [B, H, S_q, D].
Inference only, as `stof_cc.attention`: on CUDA, inputs that require grad under autograd are
refused with `AttentionInputError` (no backward is registered).
"""

from __future__ import annotations

import functools

import torch

from stof_cc.backends.attention_launch import sink_logits
from stof_cc.backends.row_windows import document_windows
from stof_cc.ir.reference import masked_attention
from stof_cc.masks import MaskDescription, parse_spec
from stof_cc.runtime.attention import attention
from stof_cc.templates.attention import AttentionInputError, check_layout, check_scale


@functools.lru_cache(maxsize=256)
def _described(spec: str) -> MaskDescription:
    return parse_spec(spec)


@torch.library.custom_op("stof_cc::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str | None, scale: float | None,
                 key_padding: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [B, H, S_q, D], k and v [B, H_kv, S_k, D]; ``mask`` a
    spec string or None; ``key_padding`` [B, S_k] (nonzero = attend) or None; ``cu_seqlens``
    [n + 1] packed documents or None; ``sinks`` one logit per query head ([H]) or None."""
    description = None if mask is None else _described(mask)
    return attention(q, k, v, description, scale, key_padding=key_padding, cu_seqlens=cu_seqlens,
                     sinks=sinks).contiguous()


@attention_op.register_kernel("cpu")
def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str | None, scale: float | None,
               key_padding: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference, with the checks of the CUDA path that do not depend on the kernels: its
    layout, scale, padding, packing and sinks. Any dtype and head dim run here, where the CUDA path takes fp16 and
    bf16 at head dims 32, 64 and 128 (docs/attention.md says so)."""
    check_layout(q, k, v)
    if scale is not None:
        check_scale(scale)
    if key_padding is not None and tuple(key_padding.shape) != (q.shape[0], k.shape[2]):
        raise AttentionInputError(f"key_padding must be [{q.shape[0]}, {k.shape[2]}] (batch, keys; nonzero = attend), "
                                  f"got shape {tuple(key_padding.shape)}")
    if cu_seqlens is not None and q.shape[2] != k.shape[2]:
        raise AttentionInputError(f"cu_seqlens packs one sequence of queries and keys; got {q.shape[2]} queries "
                                  f"and {k.shape[2]} keys")
    allowed = None
    if mask is not None:
        allowed = _described(mask).to_dense(q.shape[2], k.shape[2], batch=q.shape[0], heads=q.shape[1])
    if key_padding is not None:
        keys = key_padding.bool()[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    if cu_seqlens is not None:  # each row's keys [x, y), as the kernels read them
        windows = document_windows(cu_seqlens, q.shape[0], q.shape[2], q.device)[:, None]
        columns = torch.arange(k.shape[2], device=q.device)
        same = (columns >= windows[..., :1]) & (columns < windows[..., 1:])
        allowed = same if allowed is None else allowed & same
    return masked_attention(q, k, v, allowed, scale, sinks=None if sinks is None else sink_logits(sinks, q)).contiguous()


@attention_op.register_fake
def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str | None, scale: float | None,
           key_padding: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
