"""canonical_gemms: GPT-2's Conv1D (view, addmm with a [K, N] weight, view back) becomes a linear
on the unflattened input, with the views collapsed; other addmm stay."""

from __future__ import annotations

import torch

import stof_cc
from stof_cc.passes import canonical_gemms, canonicalize


class _Conv1D(torch.nn.Module):
    """transformers' GPT-2 Conv1D: out = addmm(bias, x.view(-1, K), weight[K, N]).view(..., N)."""

    def __init__(self, k: int = 16, n: int = 24) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(k, n))
        self.bias = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        flat = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)
        return torch.nn.functional.gelu(flat.view(*x.shape[:-1], -1)) + 1


class _ScaledAddmm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 24))

    def forward(self, x, b):
        return torch.addmm(b, x, self.weight, beta=0.5)


def test_conv1d_becomes_a_linear_and_its_views_collapse():
    torch.manual_seed(0)
    module, x = _Conv1D(), torch.randn(2, 5, 16)
    before = canonicalize(stof_cc.trace(module, (x,)))
    after = canonical_gemms(before)
    ops = [n.op for n in after.nodes() if n.op not in ("input", "constant")]
    assert ops == ["linear", "gelu", "add"], ops  # the flatten, the addmm and the view back are gone
    (linear,) = [n for n in after.nodes() if n.op == "linear"]
    assert after.node(linear.args[0].name).op == "input" and tuple(linear.spec.shape) == (2, 5, 24)
    torch.testing.assert_close(stof_cc.interpret(after, x), module(x))


def test_an_addmm_that_is_not_the_conv1d_form_stays():
    x, b = torch.randn(5, 16), torch.randn(24)
    before = canonicalize(stof_cc.trace(_ScaledAddmm(), (x, b)))
    assert [n.op for n in canonical_gemms(before).nodes() if n.op == "addmm"] == ["addmm"]
