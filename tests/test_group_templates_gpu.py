"""The group templates (elementwise, row_reduce, gemm_epilogue) on the GPU against torch, fp16
and bf16, fresh random inputs: every parameter point on odd shapes (edges in every tile
configuration), the default point on BERT-base shapes."""

from __future__ import annotations

import pytest
import torch
from group_cases import ALIGNED_PIECES, CASES, DTYPES, GEMM_CASES, GEMM_SHAPES, SHAPES, build

from stof_cc.backends.group_launch import precompile, run_group
from stof_cc.ir.graph import INPUT
from stof_cc.ir.reference import relative_error

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
                         [(*case, shape) for case in CASES for shape in SHAPES] + ALIGNED_PIECES
                         + [(*case, shape) for case in GEMM_CASES for shape in GEMM_SHAPES])
def test_group_kernel_matches_torch(module_type, template, kind, shape, dtype):
    module, (x, r), graph, group = build(module_type, kind, shape, dtype)
    problem = template.match(graph, group)
    want = module.float()(x.float(), r.float()).cuda()
    values = {n.name: t.cuda() for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x, r), strict=True)}
    values |= {name: t.cuda() for name, t in graph.constants.items()}
    if not template.runs_on(torch.cuda.get_device_capability()):
        pytest.skip(f"{template.name} needs compute capability {template.capabilities or template.min_capability}")
    precompile(template, problem, points(template, problem, shape))
    for params in points(template, problem, shape):
        got = run_group(template, problem, params, values)
        assert not torch.isnan(got).any(), params
        err = relative_error(got, want)
        assert err < 1e-2, f"{template.name} {params} {shape} {dtype}: relative error {err}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize("raster", [1, 2])
@pytest.mark.parametrize("module_name", ["LinearGelu", "LinearResidual"])
def test_persistent_gemm_walks_many_tiles_per_cta(module_name, raster, ctas, dtype, monkeypatch):
    """At most one CTA per SM walks the tiles, so on the odd shapes every CTA has one tile at
    most; a grid of 1 or 3 CTAs makes each walk dozens: both ping-pong teams, the ring's laps
    across tile boundaries and ragged last tiles, and (the residual) the staged operand's tile
    loaded into each warpgroup's staging tile again and again. ``raster`` 2: the tiles in bands
    of two row tiles, the last band (of M = 333's three or six row tiles) partial or whole.
    Without a staged operand the output leaves through a ring of two staging boxes: at block_n
    256 each tile's four boxes wrap it twice; with one (the residual), through four boxes holding
    the staged tile at three stages, and at four through the ring of two, the staged operand's
    later boxes requested as the stores free their slots (N = 264: the second column tile's
    boxes past N complete their slots' barriers empty). The deep rings (eight stages) wrap within
    and across tiles at other ring positions."""
    import group_cases

    import stof_cc.templates.gemm_epilogue as gemm_epilogue
    from stof_cc.backends.group_launch import GroupLaunch
    from stof_cc.templates.gemm_epilogue import GEMM_EPILOGUE

    monkeypatch.setattr(gemm_epilogue, "raster_rows", lambda *_: raster)

    if not GEMM_EPILOGUE.runs_on(torch.cuda.get_device_capability()):
        pytest.skip("gemm_epilogue needs sm_90")
    module, (x, r), graph, group = build(getattr(group_cases, module_name), "gemm", (3, 111, 264), dtype)  # M = 333
    problem = GEMM_EPILOGUE.match(graph, group)
    assert (problem.details.staged is not None) == (module_name == "LinearResidual")
    want = module.float()(x.float(), r.float()).cuda()
    values = {n.name: t.cuda() for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x, r), strict=True)}
    values |= {name: t.cuda() for name, t in graph.constants.items()}
    for params in ({"schedule": "cooperative", "block_m": 128, "block_n": 128, "stages": 3},
                   {"schedule": "pingpong", "block_m": 64, "block_n": 128, "stages": 3},
                   {"schedule": "pingpong", "block_m": 128, "block_n": 64, "stages": 4},
                   {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 3},
                   {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 4},
                   {"schedule": "cooperative", "block_m": 64, "block_n": 128, "stages": 8},  # deep rings
                   {"schedule": "pingpong", "block_m": 64, "block_n": 128, "stages": 8},
                   # W multicast: one or three clusters of two walk the units (M = 333: the last unit's second tile
                   # lies past M), each CTA's ring slots released by both CTAs' consumers
                   {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 3, "multicast": 2},
                   {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 4, "multicast": 2}):
        assert params in GEMM_EPILOGUE.space(problem), params
        ring = params["block_n"] == 256 and params["stages"] == 4 or module_name == "LinearGelu"
        assert gemm_epilogue.staging_boxes(problem.details, params) == (min(2, params["block_n"] // 64) if ring
                                                                         else params["block_n"] // 64), params
        launch = GroupLaunch(GEMM_EPILOGUE, problem, params)
        _, threads, shared = launch.geometry
        launch.geometry = ((ctas * params.get("multicast", 1), 1, 1), threads, shared)
        got = launch(values)
        err = relative_error(got, want)
        assert err < 1e-2, f"{params} on {launch.geometry[0][0]} CTA(s): relative error {err}"


def test_gelu_is_within_its_fitted_bound():
    """Generated GELU (gelu_erf: a fitted form of Abramowitz & Stegun 7.1.28, not erff) against torch's
    in float64 over [-10, 10] in fp32, where rounding to fp16/bf16 hides nothing: the fit's bound is 3e-5."""
    from stof_cc.ir.frontend import trace
    from stof_cc.passes import canonicalize, partition
    from stof_cc.templates.elementwise import ELEMENTWISE

    x = torch.linspace(-10, 10, 1 << 20)
    graph = canonicalize(trace(torch.nn.GELU(), (x,), {}))
    (group,) = partition(graph).default.groups
    problem = ELEMENTWISE.match(graph, group)
    got = run_group(ELEMENTWISE, problem, ELEMENTWISE.default_params(problem), {graph.inputs[0].name: x.cuda()})
    want = torch.nn.functional.gelu(x.double())
    assert float((got.double().cpu() - want).abs().max()) < 3e-5


class _CastToBf16(torch.nn.Module):
    """fp16 products, a bf16 output: TMA-stored, staged in the output's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(264, 528)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x)).to(torch.bfloat16)


class _ViewSplitsN(torch.nn.Module):
    """A view that splits N ([.., 768] -> [.., 3, 4, 64]): stored directly, not through the output map."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(264, 768)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).view(3, 111, 3, 4, 64)


@pytest.mark.parametrize("module_type", [_CastToBf16, _ViewSplitsN])
def test_gemm_output_layouts_and_dtypes(module_type):
    from stof_cc.ir.frontend import trace
    from stof_cc.passes import canonicalize, partition
    from stof_cc.templates.gemm_epilogue import GEMM_EPILOGUE

    if not GEMM_EPILOGUE.runs_on(torch.cuda.get_device_capability()):
        pytest.skip("gemm_epilogue needs sm_90")
    module, x = module_type().half(), torch.randn(3, 111, 264, dtype=torch.float16)
    graph = canonicalize(trace(module, (x,), {}))
    (group,) = [g for g in partition(graph).default.groups if g.kind == "gemm"]
    problem = GEMM_EPILOGUE.match(graph, group)
    values = {graph.inputs[0].name: x.cuda()} | {name: t.cuda() for name, t in graph.constants.items()}
    want = module.float()(x.float()).float().cuda()
    points = GEMM_EPILOGUE.space(problem)
    precompile(GEMM_EPILOGUE, problem, points)
    for params in points:
        got = run_group(GEMM_EPILOGUE, problem, params, values)
        err = relative_error(got, want)
        assert got.dtype == problem.dtype  # bf16 for the cast, fp16 for the view
        assert err < 1e-2, f"{module_type.__name__} {params}: relative error {err}"


@pytest.mark.parametrize("module_type", ["RowAmax", "RowMean"])
def test_a_row_value_with_nan_in_its_row_is_nan(module_type):
    """torch.amax and mean give NaN for a row holding a NaN; so does every point of the kernel."""
    import group_cases

    from stof_cc.templates.row_reduce import ROW_REDUCE

    module, (x, r), graph, group = build(getattr(group_cases, module_type), "reduction", (3, 7, 1000), torch.float16)
    x[1, 2, 500] = float("nan")
    problem = ROW_REDUCE.match(graph, group)
    values = {n.name: t.cuda() for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x, r), strict=True)}
    values |= {name: t.cuda() for name, t in graph.constants.items()}
    want = module.float()(x.float(), r.float()).cuda()
    for params in ROW_REDUCE.space(problem):
        got = run_group(ROW_REDUCE, problem, params, values).float()
        assert torch.equal(got.isnan(), want.isnan()), params
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, equal_nan=True)
