"""Spec of the rotary-embedding kernel (rotary.cu.j2): the ``rotary`` node of an attention
group's prologue (`passes/rotary.py`), one thread per ``vec`` adjacent pairs of rotated elements
(16-byte loads and stores at vec = 8: measured 1.4-1.5 TB/s with one 2-byte element per thread,
benchmarks/memory_bound.py). The source depends on the dtype and head dim only; sizes and
strides are arguments. It holds two entry points: the vectorized one (`kernel_name`) and
``<name>_v1`` (one pair per thread) for rows that do not start ``vec``-element aligned;
`entry_point` says which one a call takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.templates.attention import SUPPORTED_DTYPES
from stof_cc.templates.registry import KernelTemplate, Launch

THREADS = 128
VECTOR_BYTES = 16  # the widest load a thread issues


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
        """One point: the widest vector (up to 16 bytes) that divides half a row."""
        vec = VECTOR_BYTES // problem.dtype.itemsize
        while (problem.head_dim // 2) % vec:
            vec //= 2
        return [{"threads": THREADS, "vec": vec}]

    def entry_point(self, problem: RotaryProblem, params: dict[str, Any], aligned: bool) -> tuple[str, dict[str, Any]]:
        """(kernel name, params for `launch`) of the entry point a call takes: the vectorized one
        where ``aligned`` (every row of x and of the tables starts on a ``vec``-element boundary)."""
        if aligned or params["vec"] == 1:
            return self.kernel_name(problem, params), params
        return self.kernel_name(problem, params) + "_v1", {**params, "vec": 1}

    def kernel_name(self, problem: RotaryProblem, params: dict[str, Any]) -> str:
        return f"stof_rotary_{SUPPORTED_DTYPES[problem.dtype]}_d{problem.head_dim}"

    def context(self, problem: RotaryProblem, params: dict[str, Any]) -> dict[str, Any]:
        return {"dtype": SUPPORTED_DTYPES[problem.dtype], "head_dim": problem.head_dim}

    def launch(self, problem: RotaryProblem, params: dict[str, Any]) -> Launch:
        threads = params["threads"]
        return (-(-problem.pairs // params["vec"] // threads), 1, 1), threads, 0


ROTARY = RotaryTemplate()
