"""The `row_reduce` template without a GPU: its space (warp and CTA layouts, 16-byte vectors),
names, launch geometry, aligned operands and stage-1 ranking; and its numerics on the host: the
rendered kernel compiled as host C++ (one std::thread per CUDA thread, a row's threads meeting
at a barrier in the emulated row_sum / row_max) against torch."""

from __future__ import annotations

import json
import math
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from group_cases import (
    Fp32WeightNorm,
    ResidualLayerNormSilu,
    RmsNorm,
    RowAmax,
    RowMean,
    RowVar,
    ScaledSoftmax,
    build,
)

from stof_cc.backends.nvcc import nvcc_path
from stof_cc.ir.frontend import trace
from stof_cc.ir.graph import INPUT
from stof_cc.ir.reference import relative_error
from stof_cc.passes import canonicalize, partition
from stof_cc.templates.pricing import H100
from stof_cc.templates.row_reduce import MAX_ITEMS, ROW_REDUCE
from stof_cc.tune.scheme import choose_scheme


def _problem(module_type, shape, dtype=torch.float16):
    module, inputs, graph, group = build(module_type, "reduction", shape, dtype)
    return module, inputs, graph, ROW_REDUCE.match(graph, group)


class LayerNormOnly(torch.nn.Module):
    """No prologue: the kernel reads the norm's input itself (x_in)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        torch.nn.init.normal_(self.norm.weight)
        torch.nn.init.normal_(self.norm.bias)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * r


class RoundingError(torch.nn.Module):
    """A cast to fp16 inside the prologue rounds there: each row's summed fp16 rounding error (a
    cast read as a no-op gave 0)."""

    def __init__(self, width: int) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = x * 3.1 + r
        return (y - y.half().float()).sum(-1)


class DefaultEpsRmsNorm(torch.nn.Module):
    """``nn.RMSNorm`` without an eps over rows of small RMS (about 0.014): torch adds float32's
    epsilon for fp16 rows too; the fp16 epsilon (1e-3, the kernel's before a review) moved them
    by up to half their value."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm((x + r) * 0.01)


class MixedSoftmax(torch.nn.Module):
    """An fp16 input, an fp32 residual and output: vectors of the output's item size."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.float() * 0.125 + r, dim=-1)


def test_space_holds_the_warp_and_cta_layouts_with_vectors():
    _, _, _, problem = _problem(ResidualLayerNormSilu, (8, 512, 768))
    space = ROW_REDUCE.space(problem)
    assert space == [{"row_threads": 32, "rows": 4, "vec": 8}, {"row_threads": 32, "rows": 8, "vec": 8},
                     {"row_threads": 128, "rows": 1, "vec": 8},  # 96 vectors: wider CTAs would idle
                     {"row_threads": 32, "rows": 4, "vec": 1}, {"row_threads": 32, "rows": 8, "vec": 1},
                     {"row_threads": 128, "rows": 1, "vec": 1}, {"row_threads": 256, "rows": 1, "vec": 1},
                     {"row_threads": 512, "rows": 1, "vec": 1}]
    assert json.loads(json.dumps(space)) == space  # the tuning database stores them
    names = {ROW_REDUCE.kernel_name(problem, params) for params in space}
    assert len(names) == len(space)
    for params in space:  # the row fits its threads' registers
        vectors = problem.shape[-1] // params["vec"]
        assert math.ceil(vectors / params["row_threads"]) * params["vec"] <= MAX_ITEMS


def test_vectors_need_whole_vectors_per_row_and_load_by_the_outputs_item_size():
    _, _, _, problem = _problem(ScaledSoftmax, (5, 100))  # 100 is not a multiple of 8
    assert {params["vec"] for params in ROW_REDUCE.space(problem)} == {1}
    _, _, _, problem = _problem(RmsNorm, (4, 96), torch.float32)
    assert {params["vec"] for params in ROW_REDUCE.space(problem)} == {1, 4}
    x, r = torch.randn(4, 64, dtype=torch.float16), torch.randn(4, 64)
    graph = canonicalize(trace(MixedSoftmax(), (x, r), {}))
    (group,) = [g for g in choose_scheme(graph, partition(graph), H100).scheme.groups if g.kind == "reduction"]
    problem = ROW_REDUCE.match(graph, group)  # fp32 vectors of 4: r in 16-byte loads, x (fp16) element by element
    assert {params["vec"] for params in ROW_REDUCE.space(problem)} == {1, 4}
    assert ROW_REDUCE.packed_operands(problem) == ["r"]
    assert ROW_REDUCE.aligned_operands(problem, {"row_threads": 32, "rows": 4, "vec": 4}) == ["r"]


def test_long_rows_have_only_the_cta_layout():
    _, _, _, problem = _problem(ResidualLayerNormSilu, (4, 2048))
    space = ROW_REDUCE.space(problem)
    assert space and all(params["row_threads"] >= 128 and params["rows"] == 1 for params in space)
    assert {"row_threads": 256, "rows": 1, "vec": 8} in space


def test_launch_covers_every_row_and_vector_points_need_aligned_operands():
    _, _, _, problem = _problem(ResidualLayerNormSilu, (3, 7, 1000))  # 21 rows
    assert ROW_REDUCE.launch(problem, {"row_threads": 32, "rows": 4, "vec": 8}) == ((6, 1, 1), 128, 0)
    assert ROW_REDUCE.launch(problem, {"row_threads": 32, "rows": 8, "vec": 1}) == ((3, 1, 1), 256, 0)
    assert ROW_REDUCE.launch(problem, {"row_threads": 256, "rows": 1, "vec": 1}) == ((21, 1, 1), 256, 0)
    operands = problem.operands
    assert {op.name for op in operands} >= {"weight", "bias"}
    assert ROW_REDUCE.aligned_operands(problem, {"row_threads": 32, "rows": 4, "vec": 8}) == [
        op.ref for op in operands]  # row operands (bias, weight) too
    assert ROW_REDUCE.aligned_operands(problem, {"row_threads": 32, "rows": 4, "vec": 1}) == []


def test_stage_one_ranks_warp_vectors_then_cta_vectors_then_scalars():
    _, _, _, problem = _problem(ResidualLayerNormSilu, (8, 512, 768))
    estimate = lambda params: ROW_REDUCE.estimate(problem, params, 132)  # noqa: E731
    warp_vec, cta_vec = {"row_threads": 32, "rows": 4, "vec": 8}, {"row_threads": 128, "rows": 1, "vec": 8}
    scalars = [params for params in ROW_REDUCE.space(problem) if params["vec"] == 1]
    assert estimate(warp_vec) < estimate(cta_vec) < min(map(estimate, scalars))
    assert ROW_REDUCE.default_params(problem) == warp_vec
    _, _, _, few = _problem(ScaledSoftmax, (5, 100))  # five rows: one wave, ties go to the space's order
    assert ROW_REDUCE.default_params(few) == ROW_REDUCE.space(few)[0]


def test_warp_layout_source_reads_each_operand_where_it_is_used():
    _, _, _, problem = _problem(ResidualLayerNormSilu, (8, 512, 768))
    source = ROW_REDUCE.render(problem, {"row_threads": 32, "rows": 4, "vec": 8})
    body = source[source.index('extern "C"'):]
    assert "__syncthreads" not in source and "__shared__" not in body
    loads = [line for line in body.splitlines() if "__ldg(reinterpret_cast<const uint4*>" in line]
    assert len(loads) == len(problem.operands)
    reduced = body.index("row_sum(")
    for op in problem.details.prologue_operands:
        assert body.index(f"{op.name}_pack =") < reduced
    for op in problem.details.epilogue_operands:
        assert body.index(f"{op.name}_pack =") > reduced
    assert "__stwb(reinterpret_cast<uint4*>(out + row_start + v * VEC), out_pack)" in body
    cta = ROW_REDUCE.render(problem, {"row_threads": 256, "rows": 1, "vec": 1})
    assert "__syncthreads" in cta and "uint4" not in cta[cta.index('extern "C"'):]


# -- numerics on the host ------------------------------------------------------------------------

HOST_SHIM = """#include <barrier>
#include <memory>
#include <thread>
#include <vector>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector_types.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
struct EmuDim3 { unsigned x, y, z; };
thread_local EmuDim3 threadIdx, blockIdx;
thread_local std::barrier<>* emu_barrier;
thread_local float* emu_values;
thread_local int emu_lane, emu_threads;
// device-only math the prelude may use, for the host
inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float v) { return std::exp(v); }
inline float __logf(float v) { return std::log(v); }
inline float __frcp_rn(float v) { return 1.f / v; }
inline float __saturatef(float v) { return std::fmin(std::fmax(v, 0.f), 1.f); }
inline uint4 __ldg(const uint4* p) { return *p; }
inline void __stwb(uint4* p, uint4 v) { *p = v; }
inline float emu_reduce(float v, bool is_max) {  // every thread of the row gets the result
    emu_values[emu_lane] = v;
    emu_barrier->arrive_and_wait();
    float r = is_max ? -INFINITY : 0.f;
    for (int i = 0; i < emu_threads; ++i)  // max keeps NaN, as the device's max.NaN
        r = is_max ? (r != r || emu_values[i] != emu_values[i] ? NAN : fmaxf(r, emu_values[i])) : r + emu_values[i];
    emu_barrier->arrive_and_wait();
    return r;
}
inline float row_sum(float v, float*) { return emu_reduce(v, false); }
inline float row_max(float v, float*) { return emu_reduce(v, true); }
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
"""


def _host_program(problem, params, tensors: list[torch.Tensor]) -> str:
    """The rendered kernel with its device reductions replaced, and a main() that runs the grid
    one CTA at a time: operands from argv[1] (raw, in order), the output to argv[2]."""
    source = ROW_REDUCE.render(problem, params)
    start = source.index("// Every value is computed in fp32")
    reductions = source.index("__device__ __forceinline__ float row_sum")
    reductions = source.rindex("\n//", 0, reductions)  # with the comment above them
    kernel = source[source.index('extern "C"'):]
    device_code = source[start:reductions] + "\n" + kernel  # the prelude, macros and the kernel
    ops, out_type = problem.operands, {2: "uint16_t", 4: "float"}[problem.dtype.itemsize]
    out_ctype = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}[problem.dtype]
    rows, row_threads = params["rows"], params["row_threads"]
    (ctas, _, _), _, _ = ROW_REDUCE.launch(problem, params)  # the grid the GPU runs
    args = "".join(f"(const {op.ctype}*)bufs[{i}], " for i, op in enumerate(ops)) + f"({out_ctype}*)out"
    sizes = ", ".join(str(t.numel() * t.element_size()) for t in tensors)
    return HOST_SHIM + device_code + f"""
int main(int, char** argv) {{
    const long long sizes[] = {{{sizes}}};
    std::vector<void*> bufs;
    FILE* in = std::fopen(argv[1], "rb");
    for (long long size : sizes) {{
        void* p = std::aligned_alloc(64, (size + 63) / 64 * 64);
        if (std::fread(p, 1, size, in) != (size_t)size) return 2;
        bufs.push_back(p);
    }}
    std::fclose(in);
    const long long out_bytes = {math.prod(problem.shape)}LL * sizeof({out_type});
    void* out = std::aligned_alloc(64, (out_bytes + 63) / 64 * 64);
    std::memset(out, 0xff, out_bytes);  // NaN: an element no thread stores shows
    for (unsigned b = 0; b < {ctas}u; ++b) {{
        std::vector<std::unique_ptr<std::barrier<>>> barriers;
        for (int r = 0; r < {rows}; ++r) barriers.push_back(std::make_unique<std::barrier<>>({row_threads}));
        std::vector<std::vector<float>> values({rows}, std::vector<float>({row_threads}));
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < {rows * row_threads}u; ++t)
            threads.emplace_back([&, t] {{
                threadIdx = {{t, 0, 0}};
                blockIdx = {{b, 0, 0}};
                emu_barrier = barriers[t / {row_threads}].get();
                emu_values = values[t / {row_threads}].data();
                emu_lane = t % {row_threads};
                emu_threads = {row_threads};
                {ROW_REDUCE.kernel_name(problem, params)}({args});
            }});
        for (std::thread& thread : threads) thread.join();
    }}
    FILE* result = std::fopen(argv[2], "wb");
    std::fwrite(out, 1, out_bytes, result);
    std::fclose(result);
}}
"""


def _run_on_host(tmp_path: Path, problem, params, values) -> torch.Tensor:
    tensors = [values[op.ref].contiguous() for op in problem.operands]
    name = ROW_REDUCE.kernel_name(problem, params)
    cpp, exe, data, out = (tmp_path / f"{name}{suffix}" for suffix in (".cpp", "", ".in", ".out"))
    cpp.write_text(_host_program(problem, params, tensors))
    subprocess.run([nvcc_path(), "-x", "c++", "-std=c++20", "-O1", "-w", str(cpp), "-o", str(exe), "-lpthread"],
                   check=True, capture_output=True, text=True)
    data.write_bytes(b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors))
    subprocess.run([str(exe), str(data), str(out)], check=True, timeout=120)
    raw = bytearray(out.read_bytes())
    bits = {2: torch.int16, 4: torch.int32}[problem.dtype.itemsize]
    return torch.frombuffer(raw, dtype=bits).view(problem.dtype).reshape(problem.shape)


@pytest.mark.nvcc
@pytest.mark.parametrize("module_type, shape, dtype", [
    (ResidualLayerNormSilu, (3, 7, 1000), torch.float16),  # 21 rows, 125 vectors a row: ragged both ways
    (ScaledSoftmax, (5, 100), torch.bfloat16),             # no vectors (100 % 8)
    (RmsNorm, (2, 3, 264), torch.float32),                 # 4-element vectors
    (LayerNormOnly, (9, 40), torch.bfloat16),              # no prologue; 5 vectors a row
    (RowMean, (3, 7, 1000), torch.float16),                # one value per row, after a prologue
    (RowVar, (9, 40), torch.bfloat16),
    (RowAmax, (2, 3, 264), torch.float32),                 # not keepdim
    (MixedSoftmax, (3, 7, 96), torch.float16),             # fp16 x element by element in fp32 vectors
    (Fp32WeightNorm, (3, 7, 1000), torch.float16),         # Cohere: an fp16 row, an fp32 weight
    (RoundingError, (3, 7, 264), torch.float32),           # a cast to fp16 mid-prologue rounds
    (DefaultEpsRmsNorm, (3, 7, 264), torch.float16),      # torch's default eps for fp16 rows
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_point_matches_torch_on_the_host(tmp_path: Path, module_type, shape, dtype):
    torch.manual_seed(0)
    module = module_type() if module_type in (ScaledSoftmax, MixedSoftmax) else module_type(shape[-1])
    module = module.to(dtype)
    x, r = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    graph = canonicalize(trace(module, (x, r), {}))
    (group,) = [g for g in choose_scheme(graph, partition(graph), H100).scheme.groups if g.kind == "reduction"]
    problem = ROW_REDUCE.match(graph, group)
    with torch.no_grad():
        want = module.float()(x.float(), r.float())
    values = {n.name: t for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x, r), strict=True)}
    values |= {name: t.detach() for name, t in graph.constants.items()}
    points = ROW_REDUCE.space(problem)
    assert any(params["vec"] > 1 for params in points) == (module_type is not ScaledSoftmax)

    with ThreadPoolExecutor(max_workers=4) as pool:  # nvcc is single-threaded
        results = list(pool.map(lambda params: _run_on_host(tmp_path, problem, params, values), points))
    for params, got in zip(points, results, strict=True):
        assert not torch.isnan(got).any(), params
        err = relative_error(got, want)
        assert err < 1e-2, f"{params}: relative error {err}"


@pytest.mark.nvcc
def test_a_row_max_keeps_nan_on_the_host(tmp_path: Path):
    """torch.amax of a row holding a NaN is NaN; the warp and CTA layouts' max keeps it too."""
    torch.manual_seed(0)
    shape = (2, 3, 264)
    module = RowAmax(shape[-1]).float()
    x, r = torch.randn(shape), torch.randn(shape)
    x[1, 0, 100] = float("nan")
    graph = canonicalize(trace(module, (x, r), {}))
    (group,) = [g for g in choose_scheme(graph, partition(graph), H100).scheme.groups if g.kind == "reduction"]
    problem = ROW_REDUCE.match(graph, group)
    values = {n.name: t for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x, r), strict=True)}
    want = module(x, r)
    for params in (ROW_REDUCE.space(problem)[0], ROW_REDUCE.space(problem)[-1]):  # a warp and a CTA layout
        got = _run_on_host(tmp_path, problem, params, values)
        torch.testing.assert_close(got, want, equal_nan=True, msg=str(params))


class PooledTokens(torch.nn.Module):
    """Mean pooling over tokens: a reduction over a middle axis, read through a permute."""

    def __init__(self, width: int) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (x * r).sum(1)


@pytest.mark.nvcc
def test_a_prologue_with_layout_ops_is_an_indexed_chain_checked_on_the_host(tmp_path: Path):
    """The permute that moves the reduced axis last is read in the kernel's prologue (index
    arithmetic at scalar points): one kernel, no copy of the permuted tensor."""
    torch.manual_seed(0)
    shape = (3, 40, 24)
    module = PooledTokens(shape[-1])
    x, r = torch.randn(shape), torch.randn(shape)
    graph = canonicalize(trace(module, (x, r), {}))
    groups = choose_scheme(graph, partition(graph), H100).scheme.groups
    (group,) = [g for g in groups if g.kind == "reduction"]
    assert len(groups) == 1 and "transpose" in [graph.node(n).op for n in group.nodes]
    problem = ROW_REDUCE.match(graph, group)
    assert problem.details.indexed and {p["vec"] for p in ROW_REDUCE.space(problem)} == {1}
    values = {n.name: t for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x, r), strict=True)}
    for params in ROW_REDUCE.space(problem):
        got = _run_on_host(tmp_path, problem, params, values)
        torch.testing.assert_close(got, module(x, r), rtol=1e-4, atol=1e-4, msg=str(params))


class FinfoMinMaskedSoftmax(torch.nn.Module):
    """HF's additive mask written out: finfo(fp16).min where ``r`` hides a key."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x + (r > 0).to(x.dtype) * torch.finfo(x.dtype).min, dim=-1)


class FinfoMinMaskedSoftmaxInFp32(torch.nn.Module):
    """The same sum cast to fp32 before the softmax (a common HF form): the cast keeps eager's fp16 sum."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.softmax((x + (r > 0).to(x.dtype) * torch.finfo(x.dtype).min).float(), dim=-1)


@pytest.mark.nvcc
@pytest.mark.parametrize("module_type", [FinfoMinMaskedSoftmax, FinfoMinMaskedSoftmaxInFp32])
def test_a_softmax_reads_its_prologue_as_eager_holds_it_on_the_host(tmp_path: Path, module_type):
    """The prologue's sum rounded to fp16 before the softmax, as eager holds it: a row whose every
    key is hidden at finfo.min is then uniform, as in eager (in fp32 the scores survived the add
    and the row came out softmax(x): found by review; again through a cast to fp32, found by the next);
    every row equal to eager's."""
    torch.manual_seed(0)
    module = module_type()
    x, r = torch.randn(4, 6, 128, dtype=torch.float16), torch.randn(4, 6, 128, dtype=torch.float16)
    r[1, 2] = 1.0  # every key hidden
    graph = canonicalize(trace(module, (x, r), {}))
    (group,) = [g for g in choose_scheme(graph, partition(graph), H100).scheme.groups if g.kind == "reduction"]
    problem = ROW_REDUCE.match(graph, group)
    values = {n.name: t for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x, r), strict=True)}
    values |= {name: t.detach() for name, t in graph.constants.items()}
    want = module(x, r)
    assert torch.equal(want[1, 2], torch.full((128,), 1 / 128, dtype=want.dtype))
    for params in (ROW_REDUCE.space(problem)[0], ROW_REDUCE.space(problem)[-1]):  # a warp and a CTA layout
        got = _run_on_host(tmp_path, problem, params, values)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3, msg=str(params))


class LargeCorrection(torch.nn.Module):
    """A variance whose correction exceeds the row: torch divides by max(0, N - correction), so inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).var(-1, correction=3)


@pytest.mark.nvcc
def test_a_variance_with_a_correction_beyond_the_row_is_inf_on_the_host(tmp_path: Path):
    """It was negative: the kernel divided by N - correction (found by review)."""
    torch.manual_seed(0)
    module, x = LargeCorrection(), torch.randn(4, 2)
    graph = canonicalize(trace(module, (x,), {}))
    (group,) = [g for g in choose_scheme(graph, partition(graph), H100).scheme.groups if g.kind == "reduction"]
    problem = ROW_REDUCE.match(graph, group)
    values = {n.name: t for n, t in zip((n for n in graph.nodes() if n.op == INPUT), (x,), strict=True)}
    want = module(x)
    assert torch.isinf(want).all()
    for params in (ROW_REDUCE.space(problem)[0], ROW_REDUCE.space(problem)[-1]):
        got = _run_on_host(tmp_path, problem, params, values)
        torch.testing.assert_close(got.reshape(want.shape), want, msg=str(params))
