"""Every group template x parameter point of the shared cases renders and compiles for sm_90 (CPU + nvcc)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from group_cases import CASES, DTYPES, GEMM_CASES, GEMM_SHAPES, SHAPES, build

from stof_cc.backends.nvcc import compile_cubin


@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module_type, template, kind, shape",
                         [(*case, shape) for case in CASES for shape in SHAPES]
                         + [(*case, shape) for case in GEMM_CASES for shape in GEMM_SHAPES])
def test_group_kernel_compiles(module_type, template, kind, shape, dtype):
    _, _, graph, group = build(module_type, kind, shape, dtype)
    problem = template.match(graph, group)
    space = template.space(problem)
    assert space

    def build_point(params):
        source = template.render(problem, params)
        assert f"// stof-cc fusion group {group.name}" in source
        return compile_cubin(source, arch="sm_90" + template.arch_features).resources[
            template.kernel_name(problem, params)]

    with ThreadPoolExecutor(max_workers=4) as pool:  # nvcc is single-threaded
        for report in pool.map(build_point, space):
            assert report.spill_stores == 0 and report.registers <= 255 and not report.wgmma_serialized, report
