"""The norms rule: HF's RMSNorm spelling becomes one rms_norm node (before/expected and
against torch), other reductions stay; and canonicalize folds pure ATen ops on constants."""

from __future__ import annotations

import pytest
import torch

import stof_cc
from stof_cc.ir.graph import Ref, assert_structural_equal
from stof_cc.passes import canonicalize, recognise_patterns
from stof_cc.passes.norms import NORMS


class _HfRmsNorm(torch.nn.Module):
    def __init__(self, hidden: int = 16, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(x.dtype)


class _MeanOverTokens(torch.nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)


def test_before_expected_hf_rms_norm_becomes_one_node():
    x = torch.randn(2, 5, 16)
    before = canonicalize(stof_cc.trace(_HfRmsNorm(), (x,)))
    after = recognise_patterns(before, rules=(NORMS,))
    (norm,) = [n for n in after.nodes() if n.op == "rms_norm"]
    assert norm.args[1:] == ([16], None, 1e-6) and not any(n.op in ("pow", "mean", "rsqrt") for n in after.nodes())
    # expected: the same graph with the pow/mean/add/rsqrt/mul chain replaced by rms_norm
    def keep_until(node, out):
        if node.op in ("pow", "mean", "rsqrt") or (node.op == "add" and node.spec.shape[-1] == 1):
            return None
        if node.name == norm.name:
            return type(node)(node.name, "rms_norm", "aten.rms_norm.default",
                              (Ref(norm.args[0].name), [16], None, 1e-6), {}, node.spec)
        return node
    assert_structural_equal(after, before.rebuild(keep_until))
    torch.testing.assert_close(stof_cc.interpret(after, x), stof_cc.interpret(before, x))


def test_rms_norm_matches_torch_and_other_reductions_stay():
    torch.manual_seed(0)
    module, x = _HfRmsNorm(), torch.randn(3, 7, 16)
    graph = recognise_patterns(canonicalize(stof_cc.trace(module, (x,))), rules=(NORMS,))
    torch.testing.assert_close(stof_cc.interpret(graph, x), module(x))
    other = canonicalize(stof_cc.trace(_MeanOverTokens(), (x,)))
    assert_structural_equal(recognise_patterns(other, rules=(NORMS,)), other)


class _RotaryTable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4).float(), persistent=False)

    def forward(self, x):
        angles = torch.arange(x.shape[1]).float()[:, None] * self.inv_freq[None, :]
        return x * angles.cos() + angles.sin()


def test_pure_aten_ops_on_constants_fold():
    """cos and sin of an input-independent table (a rotary embedding's) have no registry entry,
    but their ATen overloads are pure: canonicalize folds them."""
    x = torch.randn(2, 6, 4)
    graph = canonicalize(stof_cc.trace(_RotaryTable(), (x,)))
    assert not any(n.op == "opaque" for n in graph.nodes())
    torch.testing.assert_close(stof_cc.interpret(graph, x), _RotaryTable()(x))


class _T5LayerNorm(torch.nn.Module):
    """T5's spelling: the variance of x.float(), times x itself (fp32 by type promotion)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + 1e-6)
        return self.weight * x.to(self.weight.dtype)


def test_t5_rms_norm_on_a_widened_input_is_recognised_in_half_precision():
    module = _T5LayerNorm().half()
    x = torch.randn(2, 5, 16, dtype=torch.float16)
    graph = recognise_patterns(canonicalize(stof_cc.trace(module, (x,))), rules=(NORMS,))
    (norm,) = [n for n in graph.nodes() if n.op == "rms_norm"]
    source = graph.node(norm.args[0].name)
    assert source.op == "cast" and source.spec.dtype == torch.float32  # rms_norm of x.float(): T5's arithmetic
    assert not any(n.op in ("pow", "mean", "rsqrt") for n in graph.nodes())
    fresh = torch.randn(2, 5, 16, dtype=torch.float16)
    torch.testing.assert_close(stof_cc.interpret(graph, fresh), module(fresh), rtol=1e-3, atol=1e-3)


class _WrittenLayerNorm(torch.nn.Module):
    """Cohere's LayerNorm (``shared``: x - mean computed once and read twice)."""

    def __init__(self, shared: bool, hidden: int = 16) -> None:
        super().__init__()
        self.shared = shared
        self.weight = torch.nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        centred = x - mean
        variance = (centred if self.shared else x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((centred if self.shared else x - mean) * torch.rsqrt(variance + 1e-5))


@pytest.mark.parametrize("shared", [True, False])
def test_a_written_out_layer_norm_becomes_one_layer_norm_node(shared):
    module, x = _WrittenLayerNorm(shared), torch.randn(3, 7, 16)
    graph = recognise_patterns(canonicalize(stof_cc.trace(module, (x,))), rules=(NORMS,))
    (norm,) = [n for n in graph.nodes() if n.op == "layer_norm"]
    assert norm.args[0].name == "x" and norm.args[1:] == ([16], None, None, 1e-5)
    assert sorted(n.op for n in graph.nodes() if n.op not in ("input", "constant")) == ["layer_norm", "mul"]
    fresh = torch.randn(3, 7, 16)
    torch.testing.assert_close(stof_cc.interpret(graph, fresh), module(fresh))


def test_a_mean_read_outside_the_norm_stays_computed():
    module, x = _WrittenLayerNorm(True), torch.randn(3, 7, 16)
    graph = canonicalize(stof_cc.trace(module, (x,)))
    mean = next(n for n in graph.nodes() if n.op == "mean")
    graph.outputs = [*graph.outputs, Ref(mean.name)]  # the mean is also an output: no rewrite
    result = recognise_patterns(graph, rules=(NORMS,))  # at most an RMSNorm of x - mean, the mean kept
    assert not any(n.op == "layer_norm" for n in result.nodes()) and any(n.op == "mean" for n in result.nodes())

