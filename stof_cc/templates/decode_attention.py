"""Spec of the decode-attention kernel (decode_attention.cu.j2): a few queries per sequence (a
generation step's tokens) against a long KV cache, split over the keys (flash-decoding), the G query
heads of a KV head taken together so each K and V tile is read once for all of them. Masks it takes:
a band of positions (causal, sliding windows, none) and key padding; anything else is the caller's
to refuse. The source depends on the dtype, head dim and the padded row count only; sizes and
strides are arguments. Two entry points: the split pass (`kernel_name`) and its ``_combine``.
Correct on the H100 against a float32 reference (tests/test_decode_attention.py; docs/decisions.md#decode-kernel)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.templates.attention import SUPPORTED_DTYPES
from stof_cc.templates.pricing import sm_count
from stof_cc.templates.registry import KernelTemplate, Launch

THREADS = 128
TILE_KEYS = 64
HEAD_DIMS = (64, 128)
MAX_ROWS = 16  # query heads per KV head x tokens, per CTA
CTAS_PER_SM = 2  # the split count aims at this many CTAs per SM


@dataclass(frozen=True)
class DecodeProblem:
    batch: int
    kv_heads: int
    heads_per_kv: int  # G
    tokens: int  # T: queries per sequence
    seq_k: int
    head_dim: int
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        """G x T padded to a power of two (at least 2: the score phase splits the rows in two)."""
        return max(2, 1 << math.ceil(math.log2(self.heads_per_kv * self.tokens)))


class DecodeAttentionTemplate(KernelTemplate[DecodeProblem]):
    name = "decode_attention"
    source_file = "decode_attention.cu.j2"
    # Q K V valid part_acc part_ml, G T S_k keys_per_split, strides (q 3, k 3, v 3, valid 1), scale, positions and band
    arg_format = "PPPPPP" + "iiii" + "q" * 10 + "f" + "q" * 4
    # part_acc part_ml out sinks (null without), G T splits, out's strides
    combine_arg_format = "PPPP" + "iii" + "qqq"

    def space(self, problem: DecodeProblem) -> list[dict[str, Any]]:
        """One point: as many key splits as bring the CTAs to CTAS_PER_SM per SM, whole tiles each."""
        tiles = -(-problem.seq_k // TILE_KEYS)
        splits = max(1, min(tiles, -(-CTAS_PER_SM * sm_count() // (problem.batch * problem.kv_heads))))
        keys_per_split = -(-tiles // splits) * TILE_KEYS
        return [{"splits": -(-problem.seq_k // keys_per_split), "keys_per_split": keys_per_split}]

    def kernel_name(self, problem: DecodeProblem, params: dict[str, Any]) -> str:
        return f"stof_decode_{SUPPORTED_DTYPES[problem.dtype]}_d{problem.head_dim}_r{problem.rows}"

    def context(self, problem: DecodeProblem, params: dict[str, Any]) -> dict[str, Any]:
        return {"dtype": SUPPORTED_DTYPES[problem.dtype], "head_dim": problem.head_dim, "rows": problem.rows,
                "tile_keys": TILE_KEYS, "threads": THREADS, "ctas_per_sm": CTAS_PER_SM}

    def launch(self, problem: DecodeProblem, params: dict[str, Any]) -> Launch:
        """The split pass: a CTA per (split, KV head, sequence); its shared memory is static."""
        return (params["splits"], problem.kv_heads, problem.batch), THREADS, 0

    def combine_launch(self, problem: DecodeProblem) -> Launch:
        """The merge: a CTA per (query row, KV head, sequence), a thread per dim."""
        return (problem.heads_per_kv * problem.tokens, problem.kv_heads, problem.batch), problem.head_dim, 0


DECODE_ATTENTION = DecodeAttentionTemplate()
