"""Spec of the row-windows kernels (row_windows.cu.j2): packed documents' per-row key windows built
on the device in one launch, from FlashAttention's cumulative lengths (``cu_seqlens``: one thread per
row) or from HF's position ids (a CTA per tile of rows, which looks around its tile for the nearest
document openings). The dozen torch ops each replaces cost 36 and 179 us per call inside a CUDA graph
at S = 32768 (history/39), 10-15% of a packed call's attention at 32-64 documents. The source depends
on what the windows are read from (and ``cu_seqlens``' dtype) only; sizes are arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.templates.registry import KernelTemplate, Launch

ROW_THREADS = 256  # cu_seqlens: one row per thread
SCAN_THREADS = 1024  # position ids: a CTA per tile of SCAN_THREADS rows and id row
SCAN_ROWS = 8  # each looks around its tile SCAN_THREADS x SCAN_ROWS rows a step
INDEX_TYPES = {torch.int32: "int", torch.int64: "long long"}


@dataclass(frozen=True)
class RowWindowsProblem:
    source: str  # "cu_seqlens" or "position_ids"
    index_dtype: torch.dtype  # cu_seqlens': int32 or int64; position ids are read as int64
    batch: int
    seq: int
    id_rows: int = 1  # position ids: 1 (every batch element alike) or batch


class RowWindowsTemplate(KernelTemplate[RowWindowsProblem]):
    name = "row_windows"
    source_file = "row_windows.cu.j2"
    waits_for_producers = True  # the kernels wait first (dependent_launch.j2)
    arg_format = "PiPii"  # cu_seqlens and its entries, or position ids and their rows; windows, batch, seq

    def space(self, problem: RowWindowsProblem) -> list[dict[str, Any]]:
        if problem.source == "cu_seqlens":
            return [{"threads": ROW_THREADS}]
        return [{"threads": SCAN_THREADS, "rows_per_thread": SCAN_ROWS}]

    def kernel_name(self, problem: RowWindowsProblem, params: dict[str, Any]) -> str:
        if problem.source == "cu_seqlens":
            return f"stof_row_windows_{str(problem.index_dtype).removeprefix('torch.')}"
        return "stof_row_windows_positions"

    def context(self, problem: RowWindowsProblem, params: dict[str, Any]) -> dict[str, Any]:
        return {"source": problem.source, "index_type": INDEX_TYPES[problem.index_dtype]}

    def launch(self, problem: RowWindowsProblem, params: dict[str, Any]) -> Launch:
        threads = params["threads"]
        tiles = -(-problem.seq // threads)
        return (tiles, 1 if problem.source == "cu_seqlens" else problem.id_rows, 1), threads, 0


ROW_WINDOWS = RowWindowsTemplate()
