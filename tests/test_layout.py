"""simplify_gemm_layouts: torch.nn's TransformerEncoder (batch-first MultiheadAttention)
keeps its meaning (fp32 interpreter against eager) while its in-projection reads x directly,
its out-projection meets the residual add, and the input chain becomes permute + reshape;
each rewrite alone on a small module; the plan then generates both projections (CPU) and
the compiled model matches eager on the GPU."""

from __future__ import annotations

import pytest
import torch

import stof_cc
from stof_cc.ir.frontend import trace
from stof_cc.ir.interpret import interpret
from stof_cc.passes import lower
from stof_cc.passes.layout import LayoutReport, simplify_gemm_layouts
from stof_cc.passes.lower import PassReports


def _encoder(width: int = 128, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, activation="gelu", batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def _inputs(width: int = 128):
    padding = torch.zeros(2, 64, dtype=torch.bool)
    padding[1, 40:] = True  # torch.nn's convention: True = padding
    return (torch.randn(2, 64, width),), {"src_key_padding_mask": padding}


class TransposedIn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 24)

    def forward(self, x):
        return self.proj(x.transpose(1, 0)).relu()


class LayoutBeforeResidual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 24)

    def forward(self, y, r):  # y [S * B, 16] rows ordered (s, b); r [B, S, 24]
        return r + self.proj(y).view(5, 3, 24).transpose(1, 0)


def test_the_encoder_keeps_its_meaning_with_every_rewrite():
    model, (args, kwargs) = _encoder(), _inputs()
    reports = PassReports()
    graph, _ = lower(model, args, kwargs, reports=reports)
    layouts = reports.layouts
    assert (len(layouts.transposed_outputs), len(layouts.moved_before), len(layouts.collapsed)) == (2, 2, 2)
    assert all("True = padding" in source for source in reports.padding.rewritten.values())
    with torch.no_grad():
        want, got = model(*args, **kwargs), interpret(graph, *args, **kwargs)
    real = ~kwargs["src_key_padding_mask"]
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_a_transposed_input_becomes_a_transposed_output():
    module, x = TransposedIn(), torch.randn(5, 3, 16)
    report = LayoutReport()
    graph = simplify_gemm_layouts(trace(module, (x,)), report)
    (linear,) = [n for n in graph.nodes() if n.op == "linear"]
    assert report.transposed_outputs and linear.args[0].name == "x"
    torch.testing.assert_close(interpret(graph, x), module(x))


def test_a_layout_chain_before_a_residual_moves_onto_the_gemm_input():
    module, y, r = LayoutBeforeResidual(), torch.randn(15, 16), torch.randn(3, 5, 24)
    report = LayoutReport()
    graph = simplify_gemm_layouts(trace(module, (y, r)), report)
    (linear,) = [n for n in graph.nodes() if n.op == "linear"]
    (add,) = [n for n in graph.nodes() if n.op == "add"]
    assert report.moved_before and linear.name in {a.name for a in add.args}
    torch.testing.assert_close(interpret(graph, y, r), module(y, r))


def test_the_plan_generates_both_projections(tmp_path):
    from stof_cc.runtime.build import build_groups
    from stof_cc.tune.scheme import choose_scheme

    (args, kwargs) = _inputs()
    graph, plan = lower(_encoder(), args, kwargs, dtype=torch.float16)
    builds = build_groups(graph, choose_scheme(graph, plan), tmp_path, compile_kernels=False)
    gemms = [b for b in builds if b.group.kind == "gemm"]
    assert len(gemms) == 8 and all(b.template is not None for b in gemms), [b.note for b in gemms]
    assert sum(b.template is not None for b in builds) >= 3 * len(builds) / 4


@pytest.mark.gpu
def test_the_compiled_encoder_matches_eager_on_the_gpu():
    model = _encoder().cuda()
    (x,), kwargs = _inputs()
    x, kwargs = x.cuda(), {k: v.cuda() for k, v in kwargs.items()}
    with torch.no_grad():
        want = model(x, **kwargs)
    compiled = stof_cc.compile(model, (x,), kwargs, tune=False)
    real = ~kwargs["src_key_padding_mask"]
    for _ in range(2):  # the second call replays the captured graph
        got = compiled(x, **kwargs)
        assert torch.linalg.norm(got[real].float() - want[real]) / torch.linalg.norm(want[real]) < 1e-2
    (variant,) = compiled.variants.values()
    assert all(s.kind in ("kernel", "attention") for s in variant.steps if s.group.kind in ("gemm", "attention"))


class FlattenBeforeResidual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 24)

    def forward(self, y, r):
        return self.proj(y).flatten(0, 1) + r


def test_a_flatten_between_a_gemm_and_its_residual_is_left_in_place():
    """flatten / unflatten are views whose arguments are dims, not a shape: not moved."""
    module, y, r = FlattenBeforeResidual(), torch.randn(3, 5, 16), torch.randn(15, 24)
    report = LayoutReport()
    graph = simplify_gemm_layouts(trace(module, (y, r)), report)
    assert not report.moved_before
    torch.testing.assert_close(interpret(graph, y, r), module(y, r))
