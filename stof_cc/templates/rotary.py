"""Spec of the rotary-embedding kernel (rotary.cu.j2): the ``rotary`` node of an attention
group's prologue (`passes/rotary.py`), one thread per pair of rotated elements. The source
depends on the dtype and head dim only; sizes and strides are arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.templates.attention import SUPPORTED_DTYPES
from stof_cc.templates.registry import KernelTemplate, Launch

THREADS = 128


@dataclass(frozen=True)
class RotaryProblem:
    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype

    @property
    def pairs(self) -> int:
        return self.batch * self.heads * self.seq * (self.head_dim // 2)


class RotaryTemplate(KernelTemplate[RotaryProblem]):
    name = "rotary"
    source_file = "rotary.cu.j2"
    # X C S O, heads seq, x strides over (B, H, S), table strides over (B, S), pairs
    arg_format = "PPPP" + "ii" + "q" * 6

    def space(self, problem: RotaryProblem) -> list[dict[str, Any]]:
        return [{"threads": THREADS}]

    def kernel_name(self, problem: RotaryProblem, params: dict[str, Any]) -> str:
        return f"stof_rotary_{SUPPORTED_DTYPES[problem.dtype]}_d{problem.head_dim}"

    def context(self, problem: RotaryProblem, params: dict[str, Any]) -> dict[str, Any]:
        return {"dtype": SUPPORTED_DTYPES[problem.dtype], "head_dim": problem.head_dim}

    def launch(self, problem: RotaryProblem, params: dict[str, Any]) -> Launch:
        return (-(-problem.pairs // params["threads"]), 1, 1), params["threads"], 0


ROTARY = RotaryTemplate()
