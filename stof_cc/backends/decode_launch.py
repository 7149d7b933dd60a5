"""Run the decode-attention kernel (`templates/decode_attention.py`): q [B, H, T, D] (a few tokens)
against k, v [B, H_kv, S_k, D] (a KV cache, any strides with unit stride in D and 16-byte rows),
under a band of positions and optional key padding. Compiled and loaded once per (dtype, head dim,
padded rows). `attn_implementation="stof_cc"` sends `generate()`'s decode steps here
(docs/decisions.md#decode-kernel)."""

from __future__ import annotations

import math

import torch

from stof_cc.backends.attention_launch import sink_logits
from stof_cc.backends.pycuda_backend import Kernel, load_kernel
from stof_cc.masks import MaskDescription
from stof_cc.masks.zoo import band_of
from stof_cc.templates.attention import SMALLEST_SCALE, SUPPORTED_DTYPES, takes_scale
from stof_cc.templates.decode_attention import DECODE_ATTENTION, HEAD_DIMS, MAX_ROWS, DecodeProblem

UNBOUNDED = 1 << 40  # a band side with no limit
GRID_LIMIT = 65535  # a grid's y and z (KV heads, batch)
_kernels: dict[tuple, tuple[Kernel, Kernel]] = {}


class DecodeInputError(ValueError):
    """q, k, v, the mask or the padding are not what the decode kernel takes; names the culprit."""


def decode_unsupported(q: torch.Tensor, k: torch.Tensor, mask: MaskDescription | None) -> str | None:
    """Why the decode kernel cannot run this call, or None."""
    if not q.is_cuda or q.dtype not in SUPPORTED_DTYPES:
        return f"the decode kernel is CUDA fp16/bf16; q is {q.dtype} on {q.device}"
    if q.dim() != 4 or k.dim() != 4 or 0 in (*q.shape, *k.shape):
        return f"q [B, H, T, D] and k [B, H_kv, S_k, D] with no empty dim; got {tuple(q.shape)} and {tuple(k.shape)}"
    if q.shape[0] != k.shape[0]:
        return f"q's batch {q.shape[0]} is not k's {k.shape[0]}"
    if max(q.shape[0], k.shape[1]) > GRID_LIMIT:
        return f"batch {q.shape[0]} or {k.shape[1]} KV heads: the decode kernel's grid takes at most {GRID_LIMIT}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"the decode kernel takes head dims {HEAD_DIMS}, not {q.shape[-1]}"
    if q.shape[1] % k.shape[1] or q.shape[1] // k.shape[1] * q.shape[2] > MAX_ROWS:
        return (f"{q.shape[1] // max(k.shape[1], 1)} query heads per KV head x {q.shape[2]} tokens: the decode "
                f"kernel takes at most {MAX_ROWS} rows per KV head")
    if mask is not None and band_of(mask) is None:
        return f"{mask!r} is not a band of positions (causal, a sliding window): the decode kernel takes bands only"
    return None


def every_key_counts(tokens: int, keys: int, mask: MaskDescription | None, q_position: int, k_position: int) -> bool:
    """Whether each of ``tokens`` queries (at q_position ..) attends every one of ``keys`` keys (at
    k_position ..) under ``mask`` (a band, or None): a generation step's attention over its whole cache,
    which SDPA's flash kernel runs faster than this one (docs/decisions.md#decode-kernel)."""
    if mask is None:
        return True
    band = band_of(mask)
    if band is None:
        return False
    lo, hi = band
    nearest = q_position - (k_position + keys - 1)  # the first query and the last key
    farthest = q_position + tokens - 1 - k_position  # the last query and the first key
    return nearest >= lo and (hi is None or farthest <= hi)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskDescription | None = None, *,
                     scale: float | None = None, q_position: int = 0, k_position: int = 0,
                     key_padding: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T scale) v for the T queries of each sequence at absolute positions q_position ..
    q_position + T - 1 against keys at k_position .., under ``mask`` (a band: `masks.causal()`,
    `masks.sliding_window(w, causal=...)`, or None for every key) and ``key_padding`` ([B, S_k] bool,
    True = attend); ``sinks`` ([H], one logit per query head: GPT-OSS's) as `stof_cc.attention` takes
    them. Returns [B, H, T, D], contiguous; a query with no key allowed gets zeros."""
    why = decode_unsupported(q, k, mask)
    if why is not None:
        raise DecodeInputError(why)
    batch, heads, tokens, dim = q.shape
    if k.dim() != 4 or v.shape != k.shape or k.shape[0] != batch or k.shape[3] != dim:
        raise DecodeInputError(f"k and v must be [{batch}, H_kv, S_k, {dim}] alike; got {tuple(k.shape)} and "
                               f"{tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device or t.stride(-1) != 1:
            raise DecodeInputError(f"{name} must be {q.dtype} on {q.device} with unit stride in D; got {t.dtype} on "
                                   f"{t.device}, strides {t.stride()}")
    for name, t in (("k", k), ("v", v)):  # 16-byte loads of key rows
        if t.data_ptr() % 16 or any(stride % 8 for stride in t.stride()[:3]):
            raise DecodeInputError(f"{name}'s key rows must start on 16 bytes (address {t.data_ptr()}, strides "
                                   f"{t.stride()})")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if not takes_scale(scale):  # as stof_cc.attention refuses it: a negative, zero or NaN scale is no softmax
        raise DecodeInputError(f"scale must be positive and finite, at least {SMALLEST_SCALE:g}; got {scale}")
    kv_heads, seq_k = k.shape[1], k.shape[2]
    valid = None
    if key_padding is not None:
        if key_padding.shape != (batch, seq_k) or key_padding.device != q.device:
            raise DecodeInputError(f"key_padding must be [{batch}, {seq_k}] on {q.device}; got "
                                   f"{tuple(key_padding.shape)} on {key_padding.device}")
        valid = (key_padding != 0).to(torch.uint8).contiguous()
    sinks = None if sinks is None else sink_logits(sinks, q)
    lo, hi = (-UNBOUNDED, UNBOUNDED) if mask is None else band_of(mask)
    problem = DecodeProblem(batch, kv_heads, heads // kv_heads, tokens, seq_k, dim, q.dtype)
    with torch.cuda.device(q.device):  # the kernels, their cache and the SM count are the current device's
        return _launch(problem, q, k, v, valid, scale, q_position, k_position, lo, hi, sinks)


def _launch(problem: DecodeProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
            scale: float, q_position: int, k_position: int, lo: int, hi: int | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    batch, heads, tokens, dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    params = DECODE_ATTENTION.space(problem)[0]
    split_kernel, combine_kernel = _loaded(problem, params)
    rows = problem.rows
    part_acc = torch.empty(batch, kv_heads, params["splits"], rows, dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch, kv_heads, params["splits"], rows, 2, dtype=torch.float32, device=q.device)
    grid, threads, shared = DECODE_ATTENTION.launch(problem, params)
    split_kernel.launch(grid, threads, shared, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                        0 if valid is None else valid.data_ptr(), part_acc.data_ptr(), part_ml.data_ptr(),
                        problem.heads_per_kv, tokens, seq_k, params["keys_per_split"], *q.stride()[:3],
                        *k.stride()[:3], *v.stride()[:3], seq_k, scale * math.log2(math.e),
                        q_position, k_position, -UNBOUNDED if lo is None else lo, UNBOUNDED if hi is None else hi)
    out = torch.empty(batch, heads, tokens, dim, dtype=q.dtype, device=q.device)
    grid, threads, shared = DECODE_ATTENTION.combine_launch(problem)
    combine_kernel.launch(grid, threads, shared, part_acc.data_ptr(), part_ml.data_ptr(), out.data_ptr(),
                          0 if sinks is None else sinks.data_ptr(), problem.heads_per_kv, tokens, params["splits"], *out.stride()[:3])
    return out


def _loaded(problem: DecodeProblem, params: dict) -> tuple[Kernel, Kernel]:
    key = (problem.dtype, problem.head_dim, problem.rows, torch.cuda.current_device())
    if key not in _kernels:
        source, name = DECODE_ATTENTION.render(problem, params), DECODE_ATTENTION.kernel_name(problem, params)
        _kernels[key] = (load_kernel(source, name, DECODE_ATTENTION.arg_format),
                         load_kernel(source, name + "_combine", DECODE_ATTENTION.combine_arg_format))
    return _kernels[key]
