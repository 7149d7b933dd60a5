"""Every group template x parameter point of the shared cases renders and compiles for sm_90 (CPU + nvcc)."""

from __future__ import annotations

import pytest
from group_cases import CASES, DTYPES, SHAPES, build

from stof_cc.backends.nvcc import compile_cubin


@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("module_type, template, kind", CASES)
def test_group_kernel_compiles(module_type, template, kind, shape, dtype):
    _, _, graph, group = build(module_type, kind, shape, dtype)
    problem = template.match(graph, group)
    space = template.space(problem)
    assert space
    for params in space:
        source = template.render(problem, params)
        assert f"// stof-cc fusion group {group.name}" in source
        report = compile_cubin(source, arch="sm_90").resources[template.kernel_name(problem, params)]
        assert report.spill_stores == 0 and report.registers <= 255, report
