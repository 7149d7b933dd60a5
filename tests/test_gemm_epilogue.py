"""gemm_epilogue without a GPU: the store-index remap of the head split on the host, and refusals."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from group_cases import HeadSplit, build

from stof_cc.codegen import NotFusable
from stof_cc.ir.frontend import trace
from stof_cc.passes import canonicalize, partition
from stof_cc.templates.gemm_epilogue import GEMM_EPILOGUE


@pytest.mark.nvcc
def test_head_split_store_index_matches_torch_permute(tmp_path: Path):
    shape = (2, 5, 128)
    _, _, graph, group = build(HeadSplit, "gemm", shape, torch.float16)
    problem = GEMM_EPILOGUE.match(graph, group)
    m, n = problem.details.m, problem.details.n
    source = tmp_path / "index.cu"
    source.write_text(f"""#include <cstdio>
constexpr long long N = {n};
int main() {{
    static long long out[{m * n}];
    for (int row = 0; row < {m}; ++row)
        for (int col = 0; col < N; ++col) {{
{problem.details.store_index}
            out[out_index] = (long long)row * N + col;
        }}
    for (long long i = 0; i < {m * n}; ++i) std::printf("%lld\\n", out[i]);
}}
""")
    subprocess.run(["nvcc", "-o", str(tmp_path / "index"), str(source)], check=True, capture_output=True)
    got = [int(v) for v in subprocess.run([str(tmp_path / "index")], check=True, capture_output=True,
                                          text=True).stdout.split()]
    want = torch.arange(m * n).view(2, 5, 2, 64).transpose(-3, -2).contiguous().flatten().tolist()
    assert got == want
    # the epilogue stores columns (c, c + 1), c even, as one pair: adjacent and pair-aligned in the output
    position = {source: i for i, source in enumerate(got)}
    assert problem.details.paired_store
    assert all(position[i + 1] == position[i] + 1 and position[i] % 2 == 0 for i in range(0, m * n, 2))


def test_a_permute_of_the_innermost_axis_stores_single_elements():
    class HeadSplitTransposed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 128)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).view(2, 5, 2, 64).transpose(-1, -2)

    graph, group = _gemm_group(HeadSplitTransposed().half(), torch.randn(2, 5, 64, dtype=torch.float16))
    problem = GEMM_EPILOGUE.match(graph, group)
    assert not problem.details.paired_store


def _gemm_group(module: torch.nn.Module, x: torch.Tensor):
    graph = canonicalize(trace(module, (x,), {}))
    (group,) = [g for g in partition(graph).default.groups if g.kind == "gemm"]
    return graph, group


def test_refusals_name_the_node():
    class MatMul(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ x.transpose(-1, -2)

    graph, group = _gemm_group(MatMul(), torch.randn(4, 16, dtype=torch.float16))
    with pytest.raises(NotFusable, match=r"matmul is not generated yet \(only linear"):
        GEMM_EPILOGUE.match(graph, group)
    graph, group = _gemm_group(torch.nn.Linear(16, 8), torch.randn(4, 16))
    with pytest.raises(NotFusable, match=r"fp16 or bf16"):
        GEMM_EPILOGUE.match(graph, group)
    graph, group = _gemm_group(torch.nn.Linear(12, 8).half(), torch.randn(4, 12, dtype=torch.float16))
    with pytest.raises(NotFusable, match=r"K = 12 is not a multiple of 8"):
        GEMM_EPILOGUE.match(graph, group)


def test_row_major_outputs_store_through_a_tensor_map_and_staging_tiles():
    from stof_cc.templates.group import OUTPUT_MAP

    graph, group = _gemm_group(torch.nn.Linear(64, 200).half(), torch.randn(2, 5, 64, dtype=torch.float16))
    problem = GEMM_EPILOGUE.match(graph, group)
    assert problem.details.tma_store
    for params in GEMM_EPILOGUE.space(problem):
        rows = params["block_m"] if params["schedule"] == "pingpong" else 64  # a consumer warpgroup's rows
        assert GEMM_EPILOGUE.tensor_maps(problem, params)[-1] == (OUTPUT_MAP, rows, 64)
        ring = params["stages"] * (params["block_m"] + params["block_n"]) * 128
        boxes = min(2, params["block_n"] // 64)  # no staged operand: a ring of two 64-column boxes per warpgroup
        staging = (2 if params["schedule"] == "pingpong" else 1) * params["block_m"] * 64 * boxes * 2
        assert GEMM_EPILOGUE.shared_bytes(problem, params) == ring + staging + 1024 <= 227 * 1024
        assert "map_out" in GEMM_EPILOGUE.render(problem, params)
    # the head split permutes rows of the output: stored element by element, no output map
    _, _, graph, group = build(HeadSplit, "gemm", (2, 5, 128), torch.float16)
    problem = GEMM_EPILOGUE.match(graph, group)
    assert not problem.details.tma_store
    params = GEMM_EPILOGUE.default_params(problem)
    assert len(GEMM_EPILOGUE.tensor_maps(problem, params)) == 2 and "map_out" not in GEMM_EPILOGUE.render(problem, params)
    # N not a multiple of 8: rows are not 16-byte aligned
    graph, group = _gemm_group(torch.nn.Linear(64, 36).half(), torch.randn(3, 64, dtype=torch.float16))
    assert not GEMM_EPILOGUE.match(graph, group).details.tma_store


def test_tma_store_only_where_the_output_keeps_n_as_its_last_dimension_and_stages_in_its_dtype():
    class ViewSplitsN(torch.nn.Module):  # [.., 768] -> [.., 3, 4, 64]: the output map would misplace boxes
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 768)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).view(2, 5, 3, 4, 64)

    graph, group = _gemm_group(ViewSplitsN().half(), torch.randn(2, 5, 64, dtype=torch.float16))
    assert not GEMM_EPILOGUE.match(graph, group).details.tma_store

    class CastToBf16(torch.nn.Module):  # fp16 products, bf16 output: staged as bf16 pairs
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 128)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).to(torch.bfloat16)

    graph, group = _gemm_group(CastToBf16().half(), torch.randn(2, 5, 64, dtype=torch.float16))
    problem = GEMM_EPILOGUE.match(graph, group)
    source = GEMM_EPILOGUE.render(problem, GEMM_EPILOGUE.default_params(problem))
    assert problem.details.tma_store and "__floats2bfloat162_rn(a, b)" in source
    assert "const __half2 v" not in source


def test_a_residual_of_the_output_dtype_is_staged_through_a_tensor_map():
    from group_cases import LinearGelu, LinearResidual

    from stof_cc.templates.group import OUTPUT_MAP

    _, _, graph, group = build(LinearResidual, "gemm", (2, 5, 128), torch.float16)
    problem = GEMM_EPILOGUE.match(graph, group)
    staged = problem.details.staged
    assert problem.operands[staged].access == "staged"
    assert "staged_v" in problem.details.chain and "LOAD_FULL" not in problem.details.chain
    for params in GEMM_EPILOGUE.space(problem):
        rows = params["block_m"] if params["schedule"] == "pingpong" else 64
        assert GEMM_EPILOGUE.tensor_maps(problem, params)[-2:] == [(OUTPUT_MAP, rows, 64), (staged, rows, 64)]
        assert problem.operands[staged].ref in GEMM_EPILOGUE.aligned_operands(problem, params)
    assert "map_staged" in GEMM_EPILOGUE.render(problem, GEMM_EPILOGUE.default_params(problem))
    # nothing output-shaped to stage: no map, the chain as before
    _, _, graph, group = build(LinearGelu, "gemm", (2, 5, 128), torch.float16)
    problem = GEMM_EPILOGUE.match(graph, group)
    assert problem.details.staged is None
    assert "map_staged" not in GEMM_EPILOGUE.render(problem, GEMM_EPILOGUE.default_params(problem))


def test_a_residual_of_another_dtype_or_under_a_permuted_store_is_read_from_global_memory():
    class Fp32Residual(torch.nn.Module):  # the staging tile holds the output's dtype only
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 128)

        def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            return (self.fc(x).float() + r).half()

    module = Fp32Residual().half()
    x, r = torch.randn(2, 5, 64, dtype=torch.float16), torch.randn(2, 5, 128)
    graph = canonicalize(trace(module, (x, r), {}))
    (group,) = [g for g in partition(graph).default.groups if g.kind == "gemm"]
    problem = GEMM_EPILOGUE.match(graph, group)
    assert problem.details.tma_store and problem.details.staged is None
    assert "LOAD_FULL" in problem.details.chain

    class ResidualThenHeadSplit(torch.nn.Module):  # no TMA store (rows permuted), so no staging tile
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 128)

        def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            return (self.fc(x) + r).view(2, 5, 2, 64).transpose(1, 2)

    module = ResidualThenHeadSplit().half()
    x, r = torch.randn(2, 5, 64, dtype=torch.float16), torch.randn(2, 5, 128, dtype=torch.float16)
    graph = canonicalize(trace(module, (x, r), {}))
    (group,) = [g for g in partition(graph).default.groups if g.kind == "gemm"]
    problem = GEMM_EPILOGUE.match(graph, group)
    assert not problem.details.tma_store and problem.details.staged is None


@pytest.mark.parametrize("m_tiles, n_tiles", [(1, 1), (3, 5), (32, 112), (7, 9)])
@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_the_banded_tile_order_visits_every_tile_once(m_tiles, n_tiles, rows):
    from stof_cc.templates.gemm_epilogue import _tile_origin

    seen = [_tile_origin(tile, rows, m_tiles, n_tiles) for tile in range(m_tiles * n_tiles)]
    assert sorted(seen) == [(i, j) for i in range(m_tiles) for j in range(n_tiles)]
    if rows == 1:  # row-major, as before bands
        assert seen == [(i, j) for i in range(m_tiles) for j in range(n_tiles)]


def test_bands_span_several_row_tiles_only_where_a_wave_reads_less_from_dram():
    from stof_cc.templates.gemm_epilogue import raster_rows

    point = {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 3}
    assert raster_rows(4096, 28672, point, 132) > 1  # 112 column tiles: row-major re-reads all of W per row block
    assert raster_rows(4096, 1024, point, 132) == 1  # 128 tiles, one wave: any order reads everything once
    assert raster_rows(4096, 768, point, 132) == 1


def test_a_staged_residual_takes_the_whole_tile_where_it_fits_else_the_ring():
    """128 x 256 at four stages has no room for a whole staged tile (64 KB) beside its operand ring
    (192 KB): the residual goes through the ring of two boxes, its later boxes requested after each
    store (the ``load_staged_box`` after ``bulk_commit``); at three stages it takes the whole tile."""
    from group_cases import LinearResidual

    from stof_cc.templates.gemm_epilogue import SMEM_LIMIT, staging_boxes

    _, _, graph, group = build(LinearResidual, "gemm", (2, 512, 1024), torch.float16)
    problem = GEMM_EPILOGUE.match(graph, group)
    space = GEMM_EPILOGUE.space(problem)
    four = {"schedule": "cooperative", "block_m": 128, "block_n": 256, "stages": 4}
    three = {**four, "stages": 3}
    assert four in space and three in space
    assert staging_boxes(problem.details, four) == 2 and staging_boxes(problem.details, three) == 4
    for params in space:
        assert GEMM_EPILOGUE.shared_bytes(problem, params) <= SMEM_LIMIT
    ring_source, whole_source = GEMM_EPILOGUE.render(problem, four), GEMM_EPILOGUE.render(problem, three)
    assert "load_staged_box(b + STAGING_BOXES" in ring_source
    assert "load_staged_box(b + STAGING_BOXES" not in whole_source and "load_staged_box(b, " in whole_source


def test_a_launch_assembles_maps_operands_and_output(monkeypatch):
    """GroupLaunch without a GPU (the kernel load and the tensor-map encoder stand-ins): the
    argument format it loads the kernel with and the tensor maps in the template's order."""
    from group_cases import LinearResidual

    from stof_cc.backends import group_launch
    from stof_cc.backends.tensor_map import TENSOR_MAP_FORMAT

    loaded = []
    monkeypatch.setattr(group_launch, "load_kernel", lambda source, name, arg_format, **_: loaded.append(arg_format))
    monkeypatch.setattr(group_launch, "encode_2d", lambda tensor, rows, cols: (tensor.data_ptr(), rows, cols))
    monkeypatch.setattr(group_launch, "_kernels", {})
    _, _, graph, group = build(LinearResidual, "gemm", (1, 1024, 768), torch.float16)
    problem = GEMM_EPILOGUE.match(graph, group)
    params = {"schedule": "cooperative", "block_m": 128, "block_n": 192, "stages": 4}
    launch = group_launch.GroupLaunch(GEMM_EPILOGUE, problem, params)
    maps = GEMM_EPILOGUE.tensor_maps(problem, params)
    assert loaded == [TENSOR_MAP_FORMAT * len(maps) + "P" * (len(problem.operands) + 1)]
    tensors = [torch.zeros(problem.graph.node(op.ref).spec.shape) for op in problem.operands]
    out = torch.zeros(problem.shape)
    encoded = launch.tensor_map_args(tensors, out)
    assert [rows_cols[1:] for rows_cols in encoded] == [(rows, cols) for _, rows, cols in maps]


def test_multicast_twins_only_for_128_by_256_tiles_in_at_most_two_waves():
    """W-multicast twins (clusters of two CTAs on units of two row tiles): a twin of each cooperative
    128 x 256 point where the tiles make at most two waves, priced as the plain point; W's tensor map
    loads half a chunk per CTA; the grid is whole clusters; the source sets the cluster size."""
    from stof_cc.templates.gemm_epilogue import point_tag
    from stof_cc.templates.pricing import sm_count

    graph, group = _gemm_group(torch.nn.Linear(4096, 4096, bias=False).half(), torch.randn(1000, 4096, dtype=torch.float16))
    problem = GEMM_EPILOGUE.match(graph, group)  # 8 x 16 tiles of 128 x 256: one wave
    space = GEMM_EPILOGUE.space(problem)
    twins = [p for p in space if p.get("multicast")]
    assert [point_tag(p) for p in twins] == ["co_m128_n256_s3_mc2", "co_m128_n256_s4_mc2"]
    for twin in twins:
        plain = {k: v for k, v in twin.items() if k != "multicast"}
        assert plain in space
        assert GEMM_EPILOGUE.estimate(problem, twin, sm_count()) == GEMM_EPILOGUE.estimate(problem, plain, sm_count())
        assert GEMM_EPILOGUE.tensor_maps(problem, twin)[1] == (1, 128, 64)
        (grid, _, _), threads, shared = GEMM_EPILOGUE.launch(problem, twin)
        assert grid == 128 and (threads, shared) == GEMM_EPILOGUE.launch(problem, plain)[1:]
        source = GEMM_EPILOGUE.render(problem, twin)
        assert "__cluster_dims__(MULTICAST, 1, 1)" in source and "#define MULTICAST 2" in source
        assert "__cluster_dims__" not in GEMM_EPILOGUE.render(problem, plain)
    assert GEMM_EPILOGUE.default_params(problem).get("multicast") is None  # ties keep the plain point
    graph, group = _gemm_group(torch.nn.Linear(4096, 4096, bias=False).half(), torch.randn(4096, 4096, dtype=torch.float16))
    assert not any(p.get("multicast") for p in GEMM_EPILOGUE.space(GEMM_EPILOGUE.match(graph, group)))  # 512 tiles
