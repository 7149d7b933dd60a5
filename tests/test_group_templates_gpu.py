"""The group templates (elementwise, row_reduce) on the GPU against torch, fp16 and bf16,
BERT-base and odd shapes, fresh random inputs, every parameter point."""

from __future__ import annotations

import pytest
import torch
from group_cases import CASES, DTYPES, GEMM_CASES, GEMM_SHAPES, SHAPES, build

from stof_cc.ir.graph import INPUT
from stof_cc.runtime.group import run_group

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module_type, template, kind, shape",
                         [(*case, shape) for case in CASES for shape in SHAPES]
                         + [(*case, shape) for case in GEMM_CASES for shape in GEMM_SHAPES])
def test_group_kernel_matches_torch(module_type, template, kind, shape, dtype):
    module, (x, r), graph, group = build(module_type, kind, shape, dtype)
    problem = template.match(graph, group)
    want = module.float()(x.float(), r.float()).cuda()
    values = {n.name: t.cuda() for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x, r), strict=True)}
    values |= {name: t.cuda() for name, t in graph.constants.items()}
    if not template.runs_on(torch.cuda.get_device_capability()):
        pytest.skip(f"{template.name} needs compute capability {template.capabilities or template.min_capability}")
    for params in template.space(problem):
        got = run_group(template, problem, params, values)
        assert not torch.isnan(got).any(), params
        err = float((got.float() - want).norm() / want.norm())
        assert err < 1e-2, f"{template.name} {params} {shape} {dtype}: relative error {err}"
