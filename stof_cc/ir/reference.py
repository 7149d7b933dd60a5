"""Torch references for the fused ops the compiler introduces (their kernels are tested against these)."""

from __future__ import annotations

import math

import torch


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None = None, bias: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ bias], masked) v in fp32, returned in q's dtype.

    ``mask`` is boolean (True = attend), broadcastable to [B, H, S_q, S_k], as is the additive
    ``bias``. ``sinks`` (one logit per query head: GPT-OSS's attention sinks) are keys every row
    sees with that score and a value of 0. A query row
    with no allowed key returns 0 (FlexAttention's convention; SDPA would give NaN). K and V
    may have fewer heads than q (grouped-query: query head h reads K/V head h // (H / H_kv)).
    Query rows go in pieces whose fp32 scores take at most `SCORE_BYTES` (each row's softmax is
    its own: the result is the same).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    rows = q.shape[-2]
    row_bytes = 4 * k.shape[-2] * math.prod(q.shape[:-2])  # one query row's fp32 scores
    chunk = max(1, SCORE_BYTES // row_bytes) if row_bytes else rows
    if chunk >= rows:
        return _attend(q, k, v, mask, scale, bias, sinks)
    return torch.cat([_attend(q[..., start:start + chunk, :], k, v, _query_rows(mask, start, chunk),
                              scale, _query_rows(bias, start, chunk), sinks) for start in range(0, rows, chunk)],
                     dim=-2)


SCORE_BYTES = 1 << 30  # masked_attention's fp32 scores per piece: 32 heads at S = 16384 would be 32 GiB at once


def _query_rows(t: torch.Tensor | None, start: int, count: int) -> torch.Tensor | None:
    """Rows [start, start + count) of a mask or bias broadcastable to [..., S_q, S_k] (one that
    broadcasts over the query rows stays as it is)."""
    if t is None or t.dim() < 2 or t.shape[-2] == 1:
        return t
    return t[..., start:start + count, :]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            bias: torch.Tensor | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """masked_attention's arithmetic on K and V of q's heads, every score at once."""
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.float()
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    # a row whose every score is -inf (no allowed key) gives 0; a NaN from the inputs stays NaN (a blanket
    # nan_to_num made a NaN query, key or scale read as zeros). V's masked rows still meet P as 0 x V, as in
    # SDPA's math and the kernels' partial blocks: a NaN there reaches the rows of that block.
    if sinks is not None:  # a column of each head's sink, softmaxed with the scores, then dropped
        column = sinks.float().to(scores.device).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], -1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).masked_fill((scores == float("-inf")).all(-1, keepdim=True), 0.0)
    return torch.matmul(probs, v.float()).to(q.dtype)


def masked_lse(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each query row's log-sum-exp of its scaled (and biased), masked scores, fp32 [B, H, S_q] (-inf
    where no key is allowed): what `stof_cc.attention(..., return_lse=True)` returns beside the output."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.float()
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return torch.logsumexp(scores, dim=-1)


EMPTY_ROWS = ("zero", "mean", "nan", "unmasked")  # what a query row with no allowed key gives (empty_rows)


def fill_empty_rows(out: torch.Tensor, v: torch.Tensor, empty: torch.Tensor, how: str | None,
                    unmasked: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [B, H, S_q, D] with the query rows where ``empty`` (broadcast to [B, H, S_q, 1]) is
    True replaced by what the model's own attention gives there: ``"zero"`` (stof-cc's kernels,
    FlexAttention, SDPA's math backend), ``"mean"`` (the mean of V over every key: what softmax
    gives when every score got the same finite -huge mask value, HF's additive masks),
    ``"nan"`` (softmax over a row of -inf) or ``"unmasked"`` (the attention with no mask and no
    bias, ``unmasked``: what an fp32-accumulating kernel gives when a finite fill such as fp16's
    -65504 shifts every score of the row alike, T5 in fp16). None and ``"zero"`` leave ``out`` as
    it is (the kernels already write 0 there). V may have fewer heads than ``out`` (grouped-query)."""
    if how in (None, "zero"):
        return out
    if how == "unmasked":
        if unmasked is None:
            raise ValueError("empty_rows='unmasked' needs the attention without its mask (unmasked=)")
        return torch.where(empty, unmasked, out)
    if how == "nan":
        fill = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
    elif how == "mean":
        fill = v.float().mean(-2, keepdim=True).to(out.dtype)
        if fill.shape[-3] != out.shape[-3]:
            fill = fill.repeat_interleave(out.shape[-3] // fill.shape[-3], dim=-3)
    else:
        raise ValueError(f"empty_rows must be one of {', '.join(EMPTY_ROWS)}, got {how!r}")
    return torch.where(empty, fill, out)


def empty_query_rows(valid: torch.Tensor, s_q: int, is_causal: bool = False,
                     window: int | None = None) -> torch.Tensor:
    """[B, 1, S_q, 1] bool: the query rows that no key may attend, from the keys' validity
    ``valid`` [B, S_k] (key padding) and a static part: none, causal (key k <= query q) or a
    causal window (q - window <= k <= q). O(B x S) work, no S_q x S_k mask: the compiled model
    runs it every call."""
    batch, s_k = valid.shape
    if not is_causal:
        return (~valid.any(1)).view(batch, 1, 1, 1).expand(batch, 1, s_q, 1)
    seen = torch.cumsum(valid.to(torch.int32), 1)  # seen[:, k]: valid keys among 0..k
    seen = torch.cat((torch.zeros(batch, 1, dtype=seen.dtype, device=seen.device), seen), 1)
    q = torch.arange(s_q, device=valid.device)
    last = (q + 1).clamp(max=s_k)  # keys 0..q (those that exist)
    first = (q - window).clamp(min=0, max=s_k) if window is not None else torch.zeros_like(q)
    first = torch.minimum(first, last)
    return ((seen[:, last] - seen[:, first]) == 0).view(batch, 1, s_q, 1)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Frobenius relative error of ``out`` against ``ref`` in fp32; inf if ``out`` has a NaN
    (a NaN never passes a tolerance)."""
    if torch.isnan(out).any():
        return math.inf
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-6))
