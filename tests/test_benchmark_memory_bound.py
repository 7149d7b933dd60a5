"""benchmarks/memory_bound.py's plumbing on the CPU: each case lowers to the one generated group
the benchmark times (its template's kind named), bytes moved count every outside read and the
write once, and the table (the GPU run itself needs CUDA, PyCUDA and nvcc)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from conftest import ROOT

from stof_cc.templates.group import applicable_templates

sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("benchmark_memory_bound", ROOT / "benchmarks" / "memory_bound.py")
memory_bound = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_bound)
H100 = (9, 0)


@pytest.mark.parametrize(("case", "template"), [("rms_norm", "row_reduce"), ("layer_norm", "row_reduce"),
                                                ("softmax", "row_reduce"), ("bias_gelu_residual", "elementwise"),
                                                ("silu_mul", "elementwise")])
def test_each_case_is_one_generated_group(case, template):
    module = memory_bound.CASES[case][0](256).half()
    inputs = memory_bound.case_inputs(case, 64, 256, torch.float16, "cpu")
    graph, group = memory_bound.kernel_group(module, inputs)
    found, refused = applicable_templates(graph, group, H100)
    assert found and found[0].template.name == template, refused
    activations = memory_bound.CASES[case][1] + 1  # read each input once, write the output once
    weights = {"rms_norm": 256, "layer_norm": 2 * 256, "bias_gelu_residual": 256}.get(case, 0)
    assert memory_bound.group_bytes(graph, group) == (activations * 64 * 256 + weights) * 2


def test_the_rotary_case_has_the_kernels_layout():
    x, cos, sin = memory_bound.case_inputs("rotary", 64, 256, torch.float16, "cpu")
    assert x.shape == (1, 2, 64, 128) and cos.shape == sin.shape == (1, 1, 64, 128)
    want = memory_bound.Rotary(256)(x.float(), cos.float(), sin.float())
    half = 64
    assert torch.allclose(want[..., :half], x[..., :half].float() * cos[..., :half] - x[..., half:].float() * sin[..., :half])


def test_the_table_reports_stream_rates_the_flushed_ones_and_the_ratio_to_inductor():
    rows = [{"case": "rms_norm", "rows": 4096, "width": 4096, "bytes": 64_000_000, "stof_kernel": "row_reduce {}",
             "stof_ms": 0.032, "copy_ms": 0.025, "stof_stream_ms": 0.025, "inductor_stream_ms": 0.03,
             "eager_stream_ms": 0.1, "copy_stream_ms": 0.024, "inductor_ms": 0.5}]
    text = memory_bound.table(rows, "head")
    assert "| rms_norm | 4096 x 4096 | 64 | row_reduce {} | 2.56 | 2.13 | 0.64 | 2.67 | 2.00 / 2.56 | 1.20x |" in text
