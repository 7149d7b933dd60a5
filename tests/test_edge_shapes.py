"""Groups at edge shapes that a template accepted and then computed wrongly (found by review): a
linear's bias that is not one value per column, a 1-d weight, a slice starting before the
tensor, `narrow` pieces of a linear, a norm's weight computed inside its group. On the CPU:
each is refused by the template, or lowered and rendered right; on the GPU: each model's compiled
answer against torch."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import stof_cc
from stof_cc.passes import lower
from stof_cc.templates.group import applicable_templates
from stof_cc.templates.pricing import H100

HALF = torch.float16


class BiasPerRow(torch.nn.Module):
    """F.linear broadcasts a [M, N] bias; the kernel added its first row to every row."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(128, 64) / 8)

    def forward(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w, b)


class VectorWeight(torch.nn.Module):
    """[M, K] x [K]: an output with no N; the kernel wrote M x K values into it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


class LastHundred(torch.nn.Module):
    """x[:, -100:] of a row of 8: torch clamps the start to 0; the kernel read 92 elements early."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -100:] * 2.0


class NarrowGate(torch.nn.Module):
    """narrow's fourth argument is a length, which the projection cut read as an end."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return F.silu(y.narrow(-1, 0, 128)) * y.narrow(-1, 128, 128) + x.narrow(1, -8, 4).sum()


class ComputedNormWeight(torch.nn.Module):
    """A layer norm whose weight the group computes: no kernel reads it from memory."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(64))

    def forward(self, x: torch.Tensor, r: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        weight = g * 2.0  # first: the group is mul, add, layer_norm, the add its prologue
        return F.layer_norm(x + r, (64,), weight, self.b)


CASES = {
    "bias_per_row": (BiasPerRow, lambda: (torch.randn(3, 64), torch.randn(3, 128))),
    "vector_weight": (VectorWeight, lambda: (torch.randn(3, 64),)),
    "last_hundred": (LastHundred, lambda: (torch.randn(4, 8),)),
    "narrow_gate": (NarrowGate, lambda: (torch.randn(4, 64),)),
    "computed_norm_weight": (ComputedNormWeight, lambda: (torch.randn(4, 64), torch.randn(4, 64), torch.randn(64))),
}


def _templates(module: torch.nn.Module, inputs: tuple) -> dict[str, list[str]]:
    """Each group's ops (joined) -> the templates that accept it on an H100."""
    graph, plan = lower(module, inputs)
    return {"+".join(graph.node(n).op for n in g.nodes): [a.template.name for a in applicable_templates(graph, g, H100)[0]]
            for g in plan.default.groups}


@pytest.mark.parametrize("case", ["bias_per_row", "vector_weight"])
def test_the_gemm_templates_refuse_what_they_cannot_read(case):
    factory, inputs = CASES[case]
    found = _templates(factory().half(), tuple(t.half() for t in inputs()))
    assert not any(name.startswith("gemm") for names in found.values() for name in names), found


def test_a_norm_weight_computed_in_the_group_is_refused():
    factory, inputs = CASES["computed_norm_weight"]
    graph, plan = lower(factory().half(), tuple(t.half() for t in inputs()))
    (group,) = [g for g in plan.default.groups if "layer_norm" in g.nodes]
    assert group.nodes[0] == "mul"  # the weight is computed inside the group
    found, refused = applicable_templates(graph, group, H100)
    assert not found and any("computed inside the group" in why for why in refused), refused


def test_a_slice_starting_before_the_tensor_starts_at_0():
    graph, plan = lower(LastHundred(), (torch.randn(4, 8, dtype=HALF),))
    (group,) = plan.default.groups
    found, _ = applicable_templates(graph, group, H100)
    source = found[0].template.render(found[0].problem, found[0].template.default_params(found[0].problem))
    assert not re.search(r"\(-\d+LL", source)  # no negative offset into the input


def test_narrow_pieces_of_a_linear_lower_to_the_right_weights():
    graph, _ = lower(NarrowGate(), (torch.randn(4, 64),))
    pieces = sorted(node.args[1].name for node in graph.nodes() if node.op == "linear")
    assert [graph.constants[name].shape[0] for name in pieces] == [128, 128]
    assert pieces[0].endswith("0_128") and pieces[1].endswith("128_256"), pieces  # rows 0-127, then 128-255


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_compiled_edge_case_matches_torch(case, tmp_path):
    factory, inputs = CASES[case]
    torch.manual_seed(0)
    module = factory().cuda().half().eval()
    given = tuple(t.cuda().half() for t in inputs())
    with torch.no_grad():
        want = module.float()(*(t.float() for t in given))
        module.half()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = stof_cc.compile(module, given, database=tmp_path / "tuning.sqlite")
        got = compiled(*given)
    assert got.shape == want.shape
    error = float((got.float() - want).norm() / want.norm())
    assert error < 1e-2, (case, error, compiled.explain())
