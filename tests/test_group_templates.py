"""Every group template x parameter point of the shared cases renders and compiles for sm_90 (CPU + nvcc); bf16 at
the first and last point of each space (it differs from fp16 in element type alone)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from group_cases import ALIGNED_PIECES, CASES, DTYPES, GEMM_CASES, GEMM_SHAPES, SHAPES, build

from stof_cc.backends.nvcc import compile_cubin


@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module_type, template, kind, shape",
                         [(*case, shape) for case in CASES for shape in SHAPES] + ALIGNED_PIECES
                         + [(*case, shape) for case in GEMM_CASES for shape in GEMM_SHAPES])
def test_group_kernel_compiles(module_type, template, kind, shape, dtype):
    _, _, graph, group = build(module_type, kind, shape, dtype)
    problem = template.match(graph, group)
    space = template.space(problem)
    assert space
    if dtype != torch.float16:  # bf16 differs from fp16 in element type alone: its first and last points
        space = space[:1] + space[-1:]

    def build_point(params):
        source = template.render(problem, params)
        assert source.startswith(f"// stof-cc {template.name} kernel ({kind}: ")
        return compile_cubin(source, arch="sm_90" + template.arch_features).resources[
            template.kernel_name(problem, params)]

    with ThreadPoolExecutor(max_workers=4) as pool:  # nvcc is single-threaded
        for report in pool.map(build_point, space):
            assert report.spill_stores == 0 and report.registers <= 255 and not report.wgmma_serialized, report


@pytest.mark.nvcc
def test_precompile_fills_the_cache_for_every_point(monkeypatch):
    """What the GPU tests and benchmarks call before launching points one by one: one nvcc
    process per point, in parallel (docs/decisions.md#parallel-precompile)."""
    import torch

    import stof_cc.backends.group_launch
    import stof_cc.backends.nvcc
    from stof_cc.backends.group_launch import precompile

    monkeypatch.setattr(stof_cc.backends.group_launch, "device_arch", lambda: "sm_90")
    template = CASES[0][1]
    _, _, graph, group = build(CASES[0][0], CASES[0][2], (3, 7, 1000), torch.float16)
    problem = template.match(graph, group)
    points = template.space(problem)
    precompile(template, problem, points)

    real_run = stof_cc.backends.nvcc.subprocess.run

    def no_compile(cmd, *args, **kwargs):  # `nvcc --version` (the key's build) may run; a compile may not
        if "-cubin" in cmd:
            raise AssertionError("precompile left a point to compile")
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(stof_cc.backends.nvcc.subprocess, "run", no_compile)
    for params in points:  # every one a cache hit now
        compile_cubin(template.render(problem, params), arch="sm_90" + template.arch_features)


def test_identical_layers_share_one_kernel_source_and_the_build_files_name_their_groups(tmp_path):
    """Kernel sources carry no group or node names (the chain's values are numbered, kernel names
    and headers name the template and operators), so a 3-layer encoder's layers render one source
    per kind of group: one nvcc run and one loaded module each. The build folder's files still
    open with their own group's nodes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import torch
    from sparse_bert import factory

    from stof_cc.passes import lower
    from stof_cc.runtime.build import build_groups
    from stof_cc.templates.group import group_templates
    from stof_cc.tune.scheme import choose_scheme

    model, (x, mask) = factory(layers=3)
    graph, plan = lower(model, (x, mask), dtype=torch.float16)
    plan = choose_scheme(graph, plan)
    sources = []
    for group in plan.scheme.groups:
        if group.kind in ("gemm", "reduction"):
            template = group_templates(group.kind)[0]
            problem = template.match(graph, group)
            sources.append(template.render(problem, template.default_params(problem)))
    assert len(sources) == 3 * 6 and len(set(sources)) == 5  # Q/K/V, out-projection, FFN1, FFN2, LayerNorm
    builds = build_groups(graph, plan, tmp_path, compile_kernels=False)
    for b in builds:
        if b.path is not None:
            text = b.path.read_text()
            assert text.startswith(f"// stof-cc fusion group {b.group.name} ") and f"%{b.group.anchor}" in text
