"""The group templates (elementwise, row_reduce, gemm_epilogue) on the GPU against torch, fp16
and bf16, fresh random inputs: every parameter point on odd shapes (edges in every tile
configuration), the default point on BERT-base shapes."""

from __future__ import annotations

import pytest
import torch
from group_cases import CASES, DTYPES, GEMM_CASES, GEMM_SHAPES, SHAPES, build

from stof_cc.ir.graph import INPUT
from stof_cc.runtime.group import run_group

pytestmark = pytest.mark.gpu
BERT_BASE_ROWS = 4096


def points(template, problem, shape: tuple[int, ...]) -> list[dict]:
    """Every point where no tile divides the shape; the default one at BERT-base's 4096 rows."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return [template.default_params(problem)] if rows == BERT_BASE_ROWS else template.space(problem)


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
    for params in points(template, problem, shape):
        got = run_group(template, problem, params, values)
        assert not torch.isnan(got).any(), params
        err = float((got.float() - want).norm() / want.norm())
        assert err < 1e-2, f"{template.name} {params} {shape} {dtype}: relative error {err}"
