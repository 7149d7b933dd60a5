"""ATen overloads that share an IR op, read by the passes and generators with their own arguments
(found by review): rsub and alpha in the norms rule, unbind's default dim, integer constants
compared with fp16 tensors, dropout in training mode, SDPA with dropout, clamp with tensor bounds,
and signatures that tell overloads apart."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import stof_cc
from stof_cc.codegen import NotFusable
from stof_cc.passes import lower
from stof_cc.tune.model import group_signature
from stof_cc.tune.scheme import choose_scheme


def _matches_eager(module: torch.nn.Module, *inputs: torch.Tensor) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = stof_cc.compile(module, inputs, dtype=torch.float32)
    return float((compiled(*inputs) - module(*inputs)).abs().max())


class _Normed(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean(-1, keepdim=True)
        d = {"rsub": lambda: torch.rsub(x, m), "alpha": lambda: torch.sub(x, m, alpha=0.5),
             "plain": lambda: x - m}[self.how]()
        var = (d * d).mean(-1, keepdim=True)
        eps = torch.add(var, 1.0, alpha=3.0) if self.how == "alpha" else var + 1e-5
        return d * torch.rsqrt(eps)


@pytest.mark.parametrize("how", ["rsub", "alpha", "plain"])
def test_the_norms_rule_reads_rsub_and_alpha_as_they_are(how):
    """rsub(x, m) is m - x: read as x - m it gave -layer_norm (off by 5.1)."""
    assert _matches_eager(_Normed(how), torch.randn(4, 16)) < 1e-5


class _Unbound(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc(x).unbind()  # the default dim, left out by the export
        return a * b


def test_unbind_with_its_default_dim_lowers():
    assert _matches_eager(_Unbound(), torch.randn(2, 16)) < 1e-5


class _Compared(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x == 2049).to(x.dtype) + (x >= 257).to(x.dtype)


def test_an_int_compared_with_fp16_is_rounded_as_torch_rounds_it():
    graph, plan = lower(_Compared(), (torch.tensor([2048.0, 1.0, 2048.0, 3.0], dtype=torch.float16),))
    from stof_cc.templates.group import applicable_templates
    from stof_cc.templates.pricing import H100
    (group,) = plan.default.groups
    found, _ = applicable_templates(graph, group, H100)
    source = found[0].template.render(found[0].problem, found[0].template.default_params(found[0].problem))
    assert "2049.0f" not in source and "2048.0f" in source


class _TrainingDropout(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * 2.0, 0.5, training=True) + 1.0


def test_dropout_in_training_mode_is_never_generated_as_the_identity():
    from stof_cc.codegen.chain import Chain
    graph, _ = lower(_TrainingDropout(), (torch.randn(4, 8, dtype=torch.float16),))
    nodes = [n.name for n in graph.nodes() if n.op not in ("input", "constant")]
    assert "dropout" in [graph.node(n).op for n in nodes]
    with pytest.raises(NotFusable, match="dropout in training mode"):
        Chain(graph, nodes, {}, (4, 8)).code("")


def test_attention_with_dropout_gets_no_kernel():
    from stof_cc.tune.attention import attention_kernel

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    q = torch.randn(1, 2, 128, 64, dtype=torch.float16)
    graph, _ = lower(Attn(), (q, q.clone(), q.clone()))
    (node,) = [n for n in graph.nodes() if "attention" in n.op]
    with pytest.raises(NotFusable, match="dropout_p"):
        attention_kernel(graph, node)


class _Compare(torch.nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.op(x, y).to(x.dtype) * 2.0


def test_overloads_of_one_ir_op_have_different_signatures():
    """x > y and x < y are one IR op ("compare") with other ATen targets: they shared a record."""
    x, y = torch.randn(8, 64, dtype=torch.float16), torch.randn(8, 64, dtype=torch.float16)
    signatures = []
    for op in (torch.gt, torch.lt):
        graph, plan = lower(_Compare(op), (x, y))
        signatures.append([group_signature(graph, g) for g in choose_scheme(graph, plan).scheme.groups])
    assert signatures[0] != signatures[1]


class _ClampByTensor(torch.nn.Module):
    def forward(self, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x * 2.0, min=low) + 1.0


def test_clamp_with_a_tensor_bound_is_refused_clearly():
    from stof_cc.templates.group import applicable_templates
    from stof_cc.templates.pricing import H100
    graph, plan = lower(_ClampByTensor(), (torch.randn(4, 8, dtype=torch.float16), torch.randn(4, 8, dtype=torch.float16)))
    reasons = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a template bug would warn; a refusal does not
        for group in plan.default.groups:
            found, refused = applicable_templates(graph, group, H100)
            if any(graph.node(n).op == "clamp" for n in group.nodes):
                assert not found
                reasons += refused
    assert any("clamp with tensor bounds" in why for why in reasons), reasons


class _Larger(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.max(x * 2.0, y) + torch.min(x, y)


def test_elementwise_max_of_two_tensors_is_maximum_not_a_reduction():
    """torch.max(x, y) (aten.max.other) was the reduction amax: refused with 'object of type Ref has
    no len()', the group in torch."""
    from stof_cc.templates.group import applicable_templates
    from stof_cc.templates.pricing import H100
    x, y = torch.randn(4, 8, dtype=torch.float16), torch.randn(4, 8, dtype=torch.float16)
    graph, plan = lower(_Larger(), (x, y))
    assert {"maximum", "minimum"} <= {n.op for n in graph.nodes()}
    (group,) = plan.default.groups
    found, refused = applicable_templates(graph, group, H100)
    assert [a.template.name for a in found] == ["elementwise"], refused
    assert _matches_eager(_Larger(), x.float(), y.float()) < 1e-6
