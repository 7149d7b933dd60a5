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


@pytest.mark.nvcc
def test_precompile_fills_the_cache_for_every_point(monkeypatch):
    """What the GPU tests and benchmarks call before launching points one by one (on the H100
    16 parallel nvcc processes compiled 867 kernels in about 50 s; one by one took minutes)."""
    import torch

    import stof_cc.backends.nvcc
    import stof_cc.backends.pycuda_backend
    from stof_cc.runtime.group import precompile

    monkeypatch.setattr(stof_cc.backends.pycuda_backend, "device_arch", lambda: "sm_90")
    template = CASES[0][1]
    _, _, graph, group = build(CASES[0][0], CASES[0][2], (3, 7, 1000), torch.float16)
    problem = template.match(graph, group)
    points = template.space(problem)
    precompile(template, problem, points)

    def no_nvcc() -> str:
        raise AssertionError("precompile left a point to compile")

    monkeypatch.setattr(stof_cc.backends.nvcc, "_require_nvcc", no_nvcc)
    for params in points:  # every one a cache hit now
        compile_cubin(template.render(problem, params), arch="sm_90" + template.arch_features)
