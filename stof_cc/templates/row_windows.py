"""Spec of the row-windows kernel (row_windows.cu.j2): packed documents' per-row key windows built
from ``cu_seqlens`` on the device in one launch. The dozen torch ops it replaces cost about 45 us
per call inside a CUDA graph at S = 32768 (one launch gap each), 10-15% of a packed call's
attention at 32-64 documents (history/38); the kernel itself moves 8 bytes per row and batch
element. The source depends on the dtype of ``cu_seqlens`` only; sizes are arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.templates.registry import KernelTemplate, Launch

THREADS = 256
INDEX_TYPES = {torch.int32: "int", torch.int64: "long long"}


@dataclass(frozen=True)
class RowWindowsProblem:
    index_dtype: torch.dtype  # cu_seqlens': int32 or int64
    batch: int
    seq: int


class RowWindowsTemplate(KernelTemplate[RowWindowsProblem]):
    name = "row_windows"
    source_file = "row_windows.cu.j2"
    waits_for_producers = True  # the kernel waits first (dependent_launch.j2)
    arg_format = "PiPii"  # cu_seqlens, entries, windows, batch, seq

    def space(self, problem: RowWindowsProblem) -> list[dict[str, Any]]:
        return [{"threads": THREADS}]

    def kernel_name(self, problem: RowWindowsProblem, params: dict[str, Any]) -> str:
        return f"stof_row_windows_{str(problem.index_dtype).removeprefix('torch.')}"

    def context(self, problem: RowWindowsProblem, params: dict[str, Any]) -> dict[str, Any]:
        return {"index_type": INDEX_TYPES[problem.index_dtype]}

    def launch(self, problem: RowWindowsProblem, params: dict[str, Any]) -> Launch:
        threads = params["threads"]
        return (-(-problem.seq // threads), 1, 1), threads, 0


ROW_WINDOWS = RowWindowsTemplate()
