"""The elementwise chain generator and the `elementwise` template, without a GPU.

Numerics are checked on the host: the generated statements are compiled by nvcc into a
host program (the same C++ the kernels run, with the LOAD_* macros reading float arrays),
run on random inputs and compared with torch in fp32.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch

from stof_cc.backends.nvcc import compile_cubin
from stof_cc.codegen import Chain, NotFusable
from stof_cc.ir.frontend import trace
from stof_cc.passes import canonicalize, partition
from stof_cc.templates.elementwise import ELEMENTWISE
from stof_cc.templates.group import group_templates
from stof_cc.templates.registry import TEMPLATE_DIR

SHAPE = (3, 5, 16)


class Mix(torch.nn.Module):
    """Every emitter with a row bias, a full residual and a scalar tensor."""

    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate
        self.bias = torch.nn.Parameter(torch.randn(SHAPE[-1]))
        self.register_buffer("gain", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(x + self.bias, approximate=self.approximate) * self.gain
        y = y - torch.sigmoid(r) + torch.nn.functional.silu(r) / 3.0
        y = torch.maximum(torch.tanh(y), torch.relu(r) - 0.25).clamp(-0.9, 0.8)
        y = (1.0 - y) + torch.exp(-r * r) + y.pow(2.0) + torch.rsqrt(r * r + 1.0)
        return y


def _group(module: torch.nn.Module, *inputs: torch.Tensor):
    graph = canonicalize(trace(module, inputs, {}))
    groups = [g for g in partition(graph).default.groups if g.kind == "elementwise"]
    assert len(groups) == 1, partition(graph)
    return graph, groups[0]


def _host_program(chain: Chain, n: int, row: int) -> str:
    loads = "\n".join(f"    std::vector<float> {op.name} = read(argv[{i + 1}]);" for i, op in enumerate(chain.operands))
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)))
    prelude = environment.from_string('{% import "group_common.j2" as c %}{{ c.prelude() }}').render()  # gelu_erf
    return f"""#include <cmath>
#include <cstdio>
#include <vector>
{prelude}
static std::vector<float> read(const char* path) {{
    std::vector<float> v; FILE* f = std::fopen(path, "rb"); float x;
    while (std::fread(&x, sizeof x, 1, f) == 1) v.push_back(x);
    std::fclose(f); return v;
}}
#define LOAD_FULL(p) p[idx]
#define LOAD_ROW(p) p[idx % {row}]
#define LOAD_SCALAR(p) p[0]
#define LOAD_COLUMNS(p, offset, row_stride) p[(idx / {row}) * (row_stride) + (offset) + idx % {row}]
int main(int argc, char** argv) {{
{loads}
    for (long long idx = 0; idx < {n}; ++idx) {{
{chain.code(" " * 8)}
        std::printf("%.9g\\n", (double)({chain.result}));
    }}
}}
"""


def _chain_on_host(tmp_path: Path, chain: Chain, values: dict[str, torch.Tensor], shape: tuple[int, ...],
                   flags: tuple[str, ...] = ()) -> torch.Tensor:
    """The chain's statements compiled by nvcc (with ``flags``) into a host program (`_host_program`) and run
    over ``values`` (IR value name -> tensor, written as float32 files): its output of ``shape``."""
    args = []
    for op in chain.operands:
        path = tmp_path / f"{op.name}.bin"
        values[op.ref.name].numpy().astype(np.float32).tofile(path)
        args.append(str(path))
    source = tmp_path / "chain.cu"
    source.write_text(_host_program(chain, math.prod(shape), shape[-1]))
    subprocess.run(["nvcc", "-O2", *flags, "-o", str(tmp_path / "chain"), str(source)], check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "chain"), *args], check=True, capture_output=True, text=True).stdout
    return torch.tensor([float(v) for v in out.split()]).view(shape)


@pytest.mark.nvcc
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_chain_numerics_match_torch_on_the_host(tmp_path: Path, approximate: str):
    torch.manual_seed(0)
    module = Mix(approximate)
    x, r = torch.randn(SHAPE), torch.randn(SHAPE)
    graph, group = _group(module, x, r)
    chain = Chain(graph, group.nodes, {}, SHAPE)
    assert {op.access for op in chain.operands} == {"full", "row", "scalar"}
    values = {"x": x, "r": r, "p_bias": module.bias.detach(), "b_gain": module.gain}
    got = _chain_on_host(tmp_path, chain, values, SHAPE)
    want = module(x, r).detach()
    # exact GELU is a fit within 3e-5 (group_common.j2), scaled by the gain and at most doubled after
    tolerance = 1.5e-4 if approximate == "none" else 1e-5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=tolerance)


class Pieces(torch.nn.Module):
    """A split along the last dimension, a slice of it and views that regroup the leading dimensions."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        rows = (torch.nn.functional.silu(gate) * up).reshape(-1, x.shape[-1] // 2)
        return rows.view(*x.shape[:-1], -1) - r[..., 3:3 + x.shape[-1] // 2] * 0.5


@pytest.mark.nvcc
def test_pieces_of_a_split_and_flat_views_read_the_right_elements_on_the_host(tmp_path: Path):
    """`Chain(layouts=True)`: each piece of the split and the slice is a ``columns`` operand (its first column
    and its source's row length), the views pass through, and the values are torch's."""
    torch.manual_seed(0)
    shape, module = (3, 5, 24), Pieces()
    x, r = torch.randn(shape), torch.randn(shape)
    graph, group = _group(module, x, r)
    out_shape = (3, 5, 12)
    chain = Chain(graph, group.nodes, {}, out_shape, layouts=True)
    assert [(op.access, op.offset, op.row_stride) for op in chain.operands] == [
        ("columns", 0, 24), ("columns", 12, 24), ("columns", 3, 24)]
    with pytest.raises(NotFusable):  # without layouts the split has no code generator
        Chain(graph, group.nodes, {}, out_shape)
    got = _chain_on_host(tmp_path, chain, {"x": x, "r": r}, out_shape)
    torch.testing.assert_close(got, module(x, r), rtol=1e-5, atol=1e-6)


class Powers(torch.nn.Module):
    """Powers of negative values: small and large integer exponents, a root, a tensor exponent."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return x.pow(3.0) + 0.1 * x.pow(7) - 0.5 * x.pow(2) / (1.0 + x.pow(-2)) + (r * r + 0.25).pow(0.5) \
            + (r * r + 0.5).pow(x)


@pytest.mark.nvcc
def test_powers_of_negative_values_hold_under_fast_math(tmp_path: Path):
    """The kernels build with --use_fast_math, where powf(x, 3) is NaN for x < 0."""
    torch.manual_seed(0)
    x, r = torch.randn(SHAPE), torch.randn(SHAPE)
    got = _run_on_host(tmp_path, Powers(), x, r, ["--use_fast_math"])
    torch.testing.assert_close(got, Powers()(x, r), rtol=1e-5, atol=1e-4)


class TensorPower(torch.nn.Module):
    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return x.pow(r) + r


@pytest.mark.nvcc
def test_a_negative_base_to_an_integer_valued_tensor_power_is_a_number(tmp_path: Path):
    """Only a constant fractional exponent makes a negative base NaN up front; a tensor exponent
    is C's pow per element (x ** 2 of a negative x is positive)."""
    torch.manual_seed(0)
    x, r = torch.randn(SHAPE) * 3, torch.randint(-3, 4, SHAPE).float()
    got = _run_on_host(tmp_path, TensorPower(), x, r, ["--use_fast_math"])
    torch.testing.assert_close(got, TensorPower()(x, r), rtol=1e-4, atol=1e-4)


def _run_on_host(tmp_path: Path, module: torch.nn.Module, x: torch.Tensor, r: torch.Tensor,
                 flags: list[str]) -> torch.Tensor:
    """``module``'s elementwise group generated as a chain, compiled for the host by nvcc with
    ``flags`` and run on x and r: its output."""
    graph, group = _group(module, x, r)
    return _chain_on_host(tmp_path, Chain(graph, group.nodes, {}, SHAPE), {"x": x, "r": r}, SHAPE, tuple(flags))


@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_elementwise_template_renders_and_compiles(dtype: torch.dtype):
    module = Mix("none").to(dtype)
    x, r = torch.randn(SHAPE, dtype=dtype), torch.randn(SHAPE, dtype=dtype)
    graph, group = _group(module, x, r)
    assert group_templates("elementwise") == [ELEMENTWISE]
    problem = ELEMENTWISE.match(graph, group)
    space = ELEMENTWISE.space(problem)
    assert {p["vec"] for p in space} == {1, 8}  # 16-bit tensors, rows of 16: whole vectors
    for params in space:
        source = ELEMENTWISE.render(problem, params)
        # the kernel's header names the template and operators, not the group's nodes (build files add those)
        assert source.startswith("// stof-cc elementwise kernel") and f"%{group.nodes[0]}" not in source
        name = ELEMENTWISE.kernel_name(problem, params)
        report = compile_cubin(source, arch="sm_90").resources[name]
        assert report.spill_stores == 0


def test_unsupported_nodes_are_refused_by_name():
    """`Chain` (output-indexed, floating values: GEMM tiles, vectors) refuses comparisons and
    broadcasts other than full / row / scalar by name; the elementwise template then takes the
    group through `IndexedChain` (tests/test_indexed_chain.py)."""
    from stof_cc.codegen import IndexedChain

    class Compare(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.where(x > 0, x, x * 0.1)

    x = torch.randn(SHAPE)
    graph, group = _group(Compare(), x)
    with pytest.raises(NotFusable, match=r"%gt: op compare .* has no elementwise code generator"):
        Chain(graph, group.nodes, {}, SHAPE)
    assert isinstance(ELEMENTWISE.match(graph, group).details.chain, IndexedChain)

    class Outer(torch.nn.Module):
        def forward(self, x: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + col)

    graph, group = _group(Outer(), x, torch.randn(SHAPE[0], 1, 1))
    with pytest.raises(NotFusable, match=r"%col of shape \(3, 1, 1\) broadcasts to .*only full, row and scalar"):
        Chain(graph, group.nodes, {}, SHAPE)
    assert isinstance(ELEMENTWISE.match(graph, group).details.chain, IndexedChain)


class NanPaths(torch.nn.Module):
    """relu, maximum, minimum and clamp, which torch makes NaN for a NaN input."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + torch.maximum(x, r) - torch.minimum(r, x) + x.clamp(-0.5, 0.5) * 2.0


@pytest.mark.nvcc
@pytest.mark.parametrize("fast_math", [False, True])
def test_nan_stays_nan_through_relu_maximum_minimum_and_clamp(tmp_path: Path, fast_math: bool):
    torch.manual_seed(0)
    x, r = torch.randn(SHAPE), torch.randn(SHAPE)
    x.view(-1)[::7] = float("nan")
    r.view(-1)[3::11] = float("nan")
    got = _run_on_host(tmp_path, NanPaths(), x, r, ["--use_fast_math"] if fast_math else [])
    torch.testing.assert_close(got, NanPaths()(x, r), rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.nvcc
def test_gelu_erf_keeps_nan_and_infinity(tmp_path: Path):
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)))
    prelude = environment.from_string('{% import "group_common.j2" as c %}{{ c.prelude() }}').render()
    source = tmp_path / "gelu.cu"
    source.write_text(prelude + """
#include <cstdio>
int main() {
    const float xs[] = {NAN, INFINITY, -INFINITY, 0.f, 1.f, -1.f, 3.f, -3.f, 0.7f, -0.7f, 12.f, -12.f};
    for (float x : xs) std::printf("%.9g\\n", (double)gelu_erf(x));
}
""")
    subprocess.run(["nvcc", "-o", str(tmp_path / "gelu"), str(source)], check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "gelu")], check=True, capture_output=True, text=True).stdout.split()
    got = torch.tensor([float(v) for v in out])
    assert got[0].isnan() and got[1] == float("inf") and got[2] == 0
    want = torch.nn.functional.gelu(torch.tensor([0.0, 1.0, -1.0, 3.0, -3.0, 0.7, -0.7, 12.0, -12.0], dtype=torch.float64))
    assert float((got[3:].double() - want).abs().max()) < 3e-5  # the fit's bound (group_common.j2)


def test_a_scalar_of_another_width_leaves_the_vectors_whole():
    """An fp32 gain read once (at 0) beside bf16 tensors: the vectors stay 16 bytes of bf16 (found by review:
    it counted among the widths and halved them)."""

    class Gain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("g", torch.tensor([1.5]))

        def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            return (x * self.g).to(x.dtype) + r

    x, r = (torch.randn(4, 64, dtype=torch.bfloat16) for _ in range(2))
    graph, group = _group(Gain(), x, r)
    problem = ELEMENTWISE.match(graph, group)
    assert {op.access for op in problem.operands} == {"full", "scalar"}
    assert {p["vec"] for p in ELEMENTWISE.space(problem)} == {1, 8}
