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


class _FusedProjections(torch.nn.Module):
    """Phi-3's fused projections: qkv sliced, gate_up chunked into SwiGLU."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 8 + 4 + 4, bias=True)
        self.gate_up = torch.nn.Linear(16, 2 * 12, bias=False)

    def forward(self, x):
        qkv = self.qkv(x)
        q, k, v = qkv[..., :8], qkv[..., 8:12], qkv[..., 12:]
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return q.sum(-1) + k.sum(-1) * v.sum(-1), torch.nn.functional.silu(gate) * up


def test_a_linear_read_only_through_pieces_becomes_one_linear_per_piece():
    x = torch.randn(3, 5, 16)
    module = _FusedProjections()
    graph = canonical_gemms(canonicalize(stof_cc.trace(module, (x,))))
    histogram = graph.op_histogram()
    assert histogram["linear"] == 5 and not {"slice", "split", "getitem"} & set(histogram)
    shapes = sorted(tuple(n.spec.shape) for n in graph.nodes() if n.op == "linear")
    assert shapes == [(3, 5, 4), (3, 5, 4), (3, 5, 8), (3, 5, 12), (3, 5, 12)]
    fresh = torch.randn(3, 5, 16)
    for got, want in zip(stof_cc.interpret(graph, fresh), module(fresh), strict=True):
        torch.testing.assert_close(got, want)


def test_aotautograds_linears_become_linears_again():
    """AOTAutograd writes a linear as t(W) and mm (no bias) or addmm (bias) on the flattened input
    (the tensor-parallel route's graphs): each becomes a linear reading W itself."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from stof_cc.runtime.dynamo_backend import _FrozenWeights

    torch.manual_seed(0)
    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 24), torch.nn.Linear(24, 8, bias=False)

        def forward(self, x):
            return (self.down(torch.nn.functional.gelu(self.up(x))),)

    model = TwoLinears().eval()
    x = torch.randn(2, 5, 16)
    params = list(model.parameters())
    grabbed = []

    def grab(graph_module, _):
        grabbed.append(graph_module)
        return graph_module

    with torch.no_grad():
        aot_module_simplified(model, (x,), fw_compiler=grab)(x)
        (graph_module,) = grabbed
        ops = {str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"}
        assert {"aten.mm.default", "aten.addmm.default", "aten.t.default"} <= ops, ops  # the forms this is about
        frozen = _FrozenWeights(graph_module, [*params, x], slots=list(range(len(params))))
        graph = canonical_gemms(canonicalize(stof_cc.trace(frozen, (x,))))
    histogram = graph.op_histogram()
    assert histogram["linear"] == 2 and not {"mm", "addmm"} & set(histogram), histogram
    assert not any(n.name.endswith("_t") for n in graph.nodes() if n.op == "constant")  # no transposed copy
    fresh = torch.randn(2, 5, 16)
    got = stof_cc.interpret(graph, fresh)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, model(fresh)[0].detach())


def test_an_addmm_with_a_broadcast_bias_stays():
    """linear's bias is one value per output column: a bias of shape [1] broadcast by addmm is not
    one (the GEMM epilogue would read past it)."""

    class OneBias(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.randn(24, 16)), torch.nn.Parameter(torch.randn(1))

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight.t())

    x = torch.randn(5, 16)
    graph = canonical_gemms(canonicalize(stof_cc.trace(OneBias(), (x,))))
    assert graph.op_histogram().get("linear", 0) == 0 and graph.op_histogram()["addmm"] == 1


def test_aotautograds_sibling_linears_read_one_input_and_merge():
    """AOTAutograd flattens the input before each projection's mm, one view per projection: the
    linears read the unflattened input itself, so Q, K and V merge as in an export."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from stof_cc.passes import merge_parallel_linears
    from stof_cc.runtime.dynamo_backend import _FrozenWeights

    class Projections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(16, 8, bias=False) for _ in range(3))

        def forward(self, x):
            return tuple(p(x).view(2, 5, 2, 4).transpose(1, 2) for p in (self.q, self.k, self.v))

    torch.manual_seed(0)
    model, x = Projections().eval(), torch.randn(2, 5, 16)
    params, grabbed = list(model.parameters()), []
    with torch.no_grad():
        aot_module_simplified(model, (x,), fw_compiler=lambda gm, _: grabbed.append(gm) or gm)(x)
        frozen = _FrozenWeights(grabbed[0], [*params, x], slots=list(range(len(params))))
        graph = merge_parallel_linears(canonical_gemms(canonicalize(stof_cc.trace(frozen, (x,)))))
    (linear,) = [n for n in graph.nodes() if n.op == "linear"]
    assert graph.node(linear.args[0].name).op == "input" and tuple(linear.spec.shape) == (2, 5, 24)
    fresh = torch.randn(2, 5, 16)
    for got, want in zip(stof_cc.interpret(graph, fresh), model(fresh), strict=True):
        torch.testing.assert_close(got, want.detach())
