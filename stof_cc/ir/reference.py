"""Torch references for the fused ops the compiler introduces (their kernels are tested against these)."""

from __future__ import annotations

import math

import torch


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v in fp32, returned in q's dtype.

    ``mask`` is boolean (True = attend), broadcastable to [B, H, S_q, S_k]. A query row
    with no allowed key returns 0 (FlexAttention's convention; SDPA would give NaN). K and V
    may have fewer heads than q (grouped-query: query head h reads K/V head h // (H / H_kv)).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows: NaN -> 0
    return torch.matmul(probs, v.float()).to(q.dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Frobenius relative error of ``out`` against ``ref`` in fp32; inf if ``out`` has a NaN
    (a NaN never passes a tolerance)."""
    if torch.isnan(out).any():
        return math.inf
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-6))
