"""Every attention template instantiation renders and compiles for sm_90 (CPU + nvcc, runs in CI)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stof_cc.backends.nvcc import CompileError, compile_cubin, parse_ptxas
from stof_cc.templates.attention import (
    ATTENTION_TEMPLATES,
    BLOCKWISE,
    ROWWISE,
    SUPPORTED_HEAD_DIMS,
    WGMMA,
    WGMMA_WS,
    AttentionProblem,
)
from stof_cc.tune.cost_model import occupancy

PROBLEMS = [AttentionProblem(2, 4, 1000, 1000, d, dt) for d in SUPPORTED_HEAD_DIMS
            for dt in (torch.float16, torch.bfloat16)]
# a strided split's kernel variants (runtime.attention._run_split), fp16 only: the residue decode is dtype-blind
STRIDED = [AttentionProblem(8, 4, 250, 250, d, torch.float16, residues=4) for d in SUPPORTED_HEAD_DIMS]


def _points(template, problem):
    """Every point of fp16 problems; bf16 and strided variants differ from those only in their
    element type or their index decode: every point at head dim 64, the first and last at the
    others (a cold `make test` on 2 cores compiles each instance with nvcc)."""
    space = template.space(problem)
    if (problem.dtype == torch.float16 and problem.residues == 1) or problem.head_dim == 64:
        return space
    return space[:1] + space[-1:] if len(space) > 1 else space


INSTANCES = [(t, p, params) for p in PROBLEMS + STRIDED for t in ATTENTION_TEMPLATES for params in _points(t, p)]
# the wgmma kernels' bias variants (the warp-specialised kernel's register split leaves them least room)
INSTANCES += [(t, p, params) for p in (dataclasses.replace(p, bias=True) for p in PROBLEMS)
              for t in (WGMMA, WGMMA_WS) for params in t.space(p)]
# the row-window variants (runtime.attention's cu_seqlens), fp16: every point of the templates that take them
WINDOWS = [dataclasses.replace(p, row_windows=True) for p in PROBLEMS if p.dtype == torch.float16 and p.head_dim >= 64]
INSTANCES += [(t, p, params) for p in WINDOWS for t in ATTENTION_TEMPLATES for params in t.space(p)]


def test_spaces_are_not_empty_and_respect_limits():
    for problem in PROBLEMS:
        for template in ATTENTION_TEMPLATES:
            space = template.space(problem)
            assert space or problem.head_dim not in template.head_dims, (template.name, problem)
            for params in space:
                assert params["warps"] * 16 * params["m_tiles"] == params["block_m"]
                assert template.shared_bytes(problem, params) <= 227 * 1024
                # heads fastest, block rows slowest: every head starts its longest row first
                # (a tile-schedule template: one CTA per tile, flattened to x)
                grid, threads, _ = template.launch(problem, params)
                producer = 128 if template is WGMMA_WS else 0  # the copy warpgroup
                tiles = (4, 2, -(-1000 // params["block_m"]))
                assert grid == ((tiles[0] * tiles[1] * tiles[2], 1, 1) if template.walks_tile_schedule else tiles)
                assert threads == 32 * params["warps"] + producer


def test_row_windows_are_a_variant_of_their_own():
    """The row-window variant (packed documents per call) takes two more pointers (the windows and
    a tile counter) and tests rows against their windows; the plain kernels' sources carry none of
    it; rowwise takes no windows."""
    problem = PROBLEMS[2]  # head_dim 64
    windows = dataclasses.replace(problem, row_windows=True)
    assert ROWWISE.space(windows) == [] and ROWWISE.space(problem)
    for template in (BLOCKWISE, WGMMA, WGMMA_WS):
        params = template.space(windows)[0]
        assert params in template.space(problem)
        plain, variant = template.render(problem, params), template.render(windows, params)
        assert "row_window" not in plain
        assert "const int2* __restrict__ row_windows, int* __restrict__ tile_counter)" in variant
        assert "row_window_span(row_windows, batch_slot, q0, seq_q" in variant and "window.x" in variant
        assert "_windows" in template.kernel_name(windows, params) and "_windows" not in template.kernel_name(
            problem, params)


def test_persistent_row_window_points_take_their_tiles_in_turn():
    """A persistent point's share of tiles is cut by the static mask's work, which row windows change
    per call: with windows its CTAs take tiles from the counter instead (and stop at the end mark);
    without, and one CTA per tile, they read their fixed range."""
    windows = dataclasses.replace(PROBLEMS[2], row_windows=True)
    points = WGMMA_WS.space(windows)
    assert {p["persistent"] for p in points} == {False, True}
    for params in points:
        in_turn = WGMMA_WS.takes_tiles_in_turn(windows, params)
        assert in_turn == params["persistent"]
        source = WGMMA_WS.render(windows, params)
        assert ("atomicAdd(tile_counter, 1)" in source) == in_turn
        assert ("if (tile_info[q_slot][0] < 0) break;" in source) == in_turn
        plain = WGMMA_WS.render(PROBLEMS[2], params)
        assert "atomicAdd" not in plain and not WGMMA_WS.takes_tiles_in_turn(PROBLEMS[2], params)
    assert not any(t.takes_tiles_in_turn(windows, t.space(windows)[0]) for t in (BLOCKWISE, WGMMA))


def test_wide_key_blocks_read_their_bit_words_from_l2():
    """160-key blocks at d = 128 only: there a PARTIAL block's bit tiles do not fit beside two Q buffers
    and two K/V stages, so the producer copies none and the consumers read the words from global memory
    (L2), which the cost model prices; the other points keep them staged beside K."""
    d128, d64 = PROBLEMS[4], PROBLEMS[2]
    assert not any(params["block_n"] == 160 for params in WGMMA_WS.space(d64))
    wide = [params for params in WGMMA_WS.space(d128) if params["block_n"] == 160]
    assert {params["persistent"] for params in wide} == {False, True}
    for params in wide:
        assert not WGMMA_WS.stages_bits(d128, params) and WGMMA_WS.exposes_bit_loads(d128, params)
        assert WGMMA_WS.shared_bytes(d128, params) <= 227 * 1024
        source = WGMMA_WS.render(d128, params)
        assert "load_bits(sBits" not in source and "sBits" not in source and "__ldg(bits + " in source
    narrow = next(params for params in WGMMA_WS.space(d128) if params["block_n"] == 128)
    assert WGMMA_WS.stages_bits(d128, narrow) and not WGMMA_WS.exposes_bit_loads(d128, narrow)
    assert "load_bits(sBits" in WGMMA_WS.render(d128, narrow)
    assert not BLOCKWISE.exposes_bit_loads(d128, BLOCKWISE.space(d128)[0])


def test_render_is_deterministic_and_names_the_kernel():
    problem, params = PROBLEMS[0], BLOCKWISE.space(PROBLEMS[0])[0]
    source = BLOCKWISE.render(problem, params)
    assert source == BLOCKWISE.render(problem, params)
    assert f"{BLOCKWISE.kernel_name(problem, params)}(" in source
    assert "mma.sync.aligned.m16n8k16" in source and "cp.async" in source


def test_wgmma_template_is_hopper_only_and_uses_wgmma():
    problem = PROBLEMS[2]  # head_dim 64
    params = WGMMA.space(problem)[0]
    source = WGMMA.render(problem, params)
    assert "wgmma.mma_async.sync.aligned.m64n" in source and "ldmatrix" not in source.split("extern \"C\"")[1]
    assert WGMMA.runs_on((9, 0)) and not WGMMA.runs_on((8, 0)) and ROWWISE.runs_on((8, 0))
    assert not ROWWISE.runs_on((7, 5)) and not BLOCKWISE.runs_on((7, 5))  # no cp.async / bf16 mma
    assert WGMMA.space(PROBLEMS[0]) == []  # head_dim 32: no whole 128-byte swizzle rows


@pytest.mark.nvcc
def test_every_instance_compiles_for_sm90_without_real_spills():
    def build(item):
        template, problem, params = item
        name = template.kernel_name(problem, params)
        source = template.render(problem, params)
        _, threads, shared = template.launch(problem, params)
        return (name, template.registers(problem, params), threads, shared,
                compile_cubin(source, arch="sm_90" + template.arch_features))

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(build, INSTANCES))
    assert len(results) == len(INSTANCES) > 0
    for name, estimated, threads, shared, compiled in results:
        assert compiled.cubin[:4] == b"\x7fELF", name
        report = compiled.resources[name]
        assert 0 < report.registers <= 255, name
        # The cost model's occupancy rests on this estimate: close to ptxas's, or at most 35% above it (a
        # bound that keeps points out of the space) where both give the same CTAs per SM.
        conservative = report.registers < estimated <= 1.35 * report.registers and (
            occupancy(threads, shared, estimated) == occupancy(threads, shared, report.registers))
        assert abs(estimated - report.registers) <= 0.2 * report.registers or conservative, f"{name}: {estimated} vs {report}"
        # ptxas occasionally trades a few bytes of spill for registers; more means the
        # register estimate that bounds the space is wrong.
        assert report.spill_stores <= 16 and report.spill_loads <= 16, f"{name} spills: {report}"
        # a wgmma issued under a branch (C7515), or a register it reads written while one is in
        # flight (C7513), makes ptxas serialise every wgmma of the kernel
        assert not report.wgmma_serialized, f"{name}: ptxas serialised its wgmma instructions (C751x)"


@pytest.mark.nvcc
def test_compile_error_names_file_and_line(tmp_path):
    source = '__global__ void broken() {\n  int x = ;\n}\n'
    with pytest.raises(CompileError) as info:
        compile_cubin(source, arch="sm_90", source_path=tmp_path / "broken.cu")
    message = str(info.value)
    assert "broken.cu" in message and "(2)" in message and "int x = ;" in message


def test_ptxas_report_flags_serialised_wgmma():
    report = (
        "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "the presence of a wgmma under a branch in the function 'slow'\n"
        "ptxas info    : Compiling entry function 'slow' for 'sm_90a'\n"
        "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem\n"
        "ptxas info    : Compiling entry function 'fast' for 'sm_90a'\n"
        "ptxas info    : Used 121 registers, used 1 barriers\n"
        "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "non wgmma instructions defining input registers of a wgmma between start and end of the pipeline stage "
        "in the function 'early_write'\n"
        "ptxas info    : Compiling entry function 'early_write' for 'sm_90a'\n"
        "ptxas info    : Used 160 registers, used 1 barriers\n")
    resources = parse_ptxas(report)
    assert resources["slow"].wgmma_serialized and resources["slow"].registers == 168
    assert not resources["fast"].wgmma_serialized
    assert resources["early_write"].wgmma_serialized  # every advisory that serialises, not C7515 alone
