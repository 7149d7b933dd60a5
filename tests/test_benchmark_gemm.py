"""benchmarks/gemm.py's plumbing on the CPU: each epilogue module forms one GEMM group holding
its epilogue (what the benchmark searches and times), and the table's ratios and geomeans (the
GPU run itself needs CUDA, PyCUDA and nvcc)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("benchmark_gemm", ROOT / "benchmarks" / "gemm.py")
gemm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gemm)


@pytest.mark.parametrize(("epilogue", "ops"), [("none", ["linear"]), ("bias_gelu", ["linear", "gelu"]),
                                               ("residual", ["linear", "add"]), ("swiglu", ["linear", "silu", "mul"])])
def test_each_epilogue_is_one_gemm_group(epilogue, ops):
    module = gemm.EPILOGUES[epilogue](64, 96).half()
    x, r = torch.randn(32, 64, dtype=torch.float16), torch.randn(32, 96, dtype=torch.float16)
    graph, group = gemm.gemm_group(module, x, r)
    assert [graph.node(n).op for n in group.nodes] == ops


def test_the_table_reports_tflops_ratios_and_geomeans():
    flops = 2 * 1024 * 768 * 768
    rows = [{"m": 1024, "k": 768, "n": 768, "epilogue": "none", "flops": flops, "stof_ms": 0.01, "cublas_ms": 0.011,
             "stof_point": "co_m128_n128_s4"},
            {"m": 1024, "k": 768, "n": 768, "epilogue": "bias_gelu", "flops": flops, "stof_ms": 0.01,
             "cublas_ms": 0.02, "max_autotune_ms": 0.012}]
    text = gemm.table(rows, "head")
    assert f"| {flops / 0.01 / 1e9:.0f} | {flops / 0.011 / 1e9:.0f} | - | 1.10x |" in text
    assert "bare: geomean 1.100x cuBLAS over 1 points, lowest 1.100x" in text
    assert "epilogue: geomean 2.000x cuBLAS + its separate epilogue over 1 points" in text
    assert "epilogue (best peer): geomean 1.200x the best correct peer" in text  # max-autotune was faster
    assert gemm.parse_pairs("4096x14336,768x768") == [(4096, 14336), (768, 768)]  # kernel_timing's


def test_the_profiling_driver_names_points_and_refuses_unknown_ones():
    spec = importlib.util.spec_from_file_location("benchmark_profile_gemm", ROOT / "benchmarks" / "profile_gemm.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    _, problem, graph = profile.gemm_problem(256, 128, 512)
    params = profile.point_named(problem, "co_m128_n256_s4")
    assert params == {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 4}
    assert [graph.node(ref).op for ref in (op.ref for op in problem.operands)][0] == "input"
    with pytest.raises(SystemExit, match=r"no point 'co_m128_n512_s4' for this shape; its points: co_m64_n64_s3"):
        profile.point_named(problem, "co_m128_n512_s4")
