"""benchmarks/packed.py's plumbing on the CPU: the boundary sets, the sampled reference and the
table (the timed run needs CUDA, PyCUDA and nvcc)."""

from __future__ import annotations

import importlib.util
import math
import sys

import torch
from conftest import ROOT

from stof_cc import masks
from stof_cc.ir.reference import masked_attention

sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("benchmark_packed", ROOT / "benchmarks" / "packed.py")
packed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(packed)


def test_boundary_sets_cut_the_row_into_that_many_documents_anew_each_call():
    sets = packed.boundary_sets(1000, 8, 5)
    assert len(sets) == 5 and all(len(s) == 8 and sum(s) == 1000 and min(s) >= 1 for s in sets)
    assert len({tuple(s) for s in sets}) == 5  # new boundaries every call
    assert sets == packed.boundary_sets(1000, 8, 5)  # and the same sets in every run


def test_the_sampled_reference_is_the_dense_references_rows():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    lengths = [30, 50, 16]
    rows = torch.tensor([0, 29, 30, 31, 80, 95])
    dense = (masks.causal() & masks.document(lengths)).to_dense(96, 96)
    want = masked_attention(q, k, v, dense)[:, :, rows]
    torch.testing.assert_close(packed.sampled_reference(q, k, v, lengths, rows), want)


def test_the_table_says_which_peer_failed_or_was_wrong():
    row = {"seq": 32768, "docs": 8, "stof_varlen_ms": 1.0, "stof_ms": 1.2, "stof_prebuilt_ms": 0.95, "fa4_varlen_ms": 1.5,
           "flex_ms": math.inf, "flex_flash_ms": math.inf, "flex_flash_error": "NYI"}
    text = packed.table([row], "head")
    assert "| 32768 | 8 | 1.000 | - | 1.200 | - | 0.950 | 1.500 | wrong | error | 1.05x | 1.50x |" in text
