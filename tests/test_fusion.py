"""The fusion partition on the example models: complete, one anchor per group, acyclic, by kinds."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from stof_cc.ir.frontend import trace
from stof_cc.ir.graph import CONSTANT, INPUT
from stof_cc.ir.ops import pattern_kind
from stof_cc.loading import load_factory
from stof_cc.passes import canonicalize, partition, recognise_attention, run_passes
from stof_cc.passes.fusion import ANCHOR_KINDS, FOLDABLE_KINDS, _quotient

EXAMPLES = ("encoder_layer", "gpt2_block", "tiny_bert")


def _passes(example: str):
    module, args, kwargs = load_factory(f"examples/{example}.py:factory")
    return recognise_attention(canonicalize(trace(module, args, kwargs)))


@pytest.mark.parametrize("example", EXAMPLES)
def test_partition_is_complete_acyclic_and_by_kind(example):
    graph = _passes(example)
    plan = partition(graph)
    computed = [n.name for n in graph.nodes() if n.op not in (INPUT, CONSTANT)]
    placed = [n for g in plan.default.groups for n in g.nodes]
    assert sorted(placed) == sorted(computed)  # every computed node in exactly one group
    for group in plan.default.groups:
        kinds = [pattern_kind(graph.node(n).op) for n in group.nodes]
        anchors = [n for n in group.nodes if pattern_kind(graph.node(n).op) in ANCHOR_KINDS]
        if group.kind in ANCHOR_KINDS:
            assert anchors == [group.anchor] and pattern_kind(graph.node(group.anchor).op) == group.kind
        elif group.kind == "elementwise":
            assert group.anchor is None and set(kinds) <= set(FOLDABLE_KINDS)
        else:
            assert group.kind == "opaque" and len(group.nodes) == 1
    for _, scheme in [("default", plan.default), *plan.alternatives]:
        assert nx.is_directed_acyclic_graph(_quotient(graph, scheme))
    assert any(g.kind == "attention" for g in plan.default.groups)


def test_encoder_layer_groups_and_layernorm_alternatives():
    graph = _passes("encoder_layer")
    plan = partition(graph)
    gelu = next(n for n in graph.nodes() if n.op == "gelu")
    assert graph.node(plan.default.group_of(gelu.name).anchor).op == "linear"  # GEMM + bias + GELU
    residuals = [n for n in graph.nodes() if n.op == "add"]
    assert all(plan.default.group_of(n.name).kind == "gemm" for n in residuals)  # GEMM + bias + residual
    # GEMM + bias + residual + LayerNorm offered as the alternative for both LayerNorms
    assert len(plan.alternatives) == 2
    for label, scheme in plan.alternatives:
        merged = [g for g in scheme.groups if g.kind == "gemm" and any(graph.node(n).op == "layer_norm" for n in g.nodes)]
        assert len(merged) == 1 and "layer_norm" in label
        assert len(scheme.groups) == len(plan.default.groups) - 1


def test_a_graph_output_stops_an_epilogue_with_a_reason():
    plan = partition(_passes("tiny_bert"))
    assert any("is a graph output" in why for why in plan.refused)
    assert "alternative:" in str(plan) and "anchor" in str(plan)


def test_a_split_ends_an_epilogue_so_the_gemm_stays_generatable():
    """GPT-2's c_attn linear feeds a 3-way split: the split (three outputs) cannot be a kernel's
    epilogue, so it joins the attention group's views and the GEMM group is the linear alone."""
    graph = _passes("gpt2_block")
    plan = partition(graph)
    assert any("split" in why and "3 outputs" in why for why in plan.refused)
    (qkv,) = [g for g in plan.default.groups if g.kind == "gemm" and graph.node(g.anchor).spec.shape[-1] == 3 * 128]
    assert qkv.nodes == (qkv.anchor,)
    (attention,) = [g for g in plan.default.groups if g.kind == "attention"]
    assert any(graph.node(n).op == "split" for n in attention.nodes)


def test_stage_one_merges_layernorm_into_the_gemm_only_where_a_template_generates_it(norm_merges_win):
    from stof_cc.templates.pricing import H100
    from stof_cc.tune.scheme import choose_scheme

    module, args, kwargs = load_factory("examples/encoder_layer.py:factory")
    half = recognise_attention(canonicalize(trace(module.half(), tuple(a.half() for a in args), kwargs)))
    plan = choose_scheme(half, partition(half), H100)
    merged = [g for g in plan.scheme.groups if any(half.node(n).op == "layer_norm" for n in g.nodes)]
    assert len(merged) == 2 and all(g.kind == "gemm" for g in merged)  # gemm_layernorm beats two kernels
    assert len(plan.scheme.groups) == len(plan.default.groups) - 2
    assert all(": merged (" in line for line in plan.choices) and len(plan.choices) == 2
    assert nx.is_directed_acyclic_graph(_quotient(half, plan.scheme))
    # fp32: no GEMM template (wgmma takes fp16/bf16), so nothing is merged and the reason says so
    single = _passes("encoder_layer")
    plan = choose_scheme(single, partition(single), H100)

    def merges(graph, scheme):
        return [g for g in scheme.groups if {graph.node(n).op for n in g.nodes} >= {"linear", "layer_norm"}]
    assert not merges(single, plan.scheme)
    assert all("kept apart (no template generates it)" in line for line in plan.choices if "+" in line)
    # a GPU the GEMM templates do not run on merges nothing either
    assert not merges(half, choose_scheme(half, partition(half), (8, 0)).scheme)


def test_measured_times_decide_a_merge_where_both_sides_were_measured():
    """Stage 2 over schemes: with the tuning database's times for the merged group and for the
    groups it replaces, the merge is decided by them; where a side has no record, by estimates."""
    from stof_cc.templates.pricing import H100
    from stof_cc.tune.scheme import choose_scheme

    module, args, kwargs = load_factory("examples/encoder_layer.py:factory")
    half = recognise_attention(canonicalize(trace(module.half(), tuple(a.half() for a in args), kwargs)))
    plan = partition(half)
    merged = {next(g for g in alt.groups if g not in plan.default.groups) for _, alt in plan.alternatives}
    replaced = {g for _, alt in plan.alternatives for g in plan.default.groups if g not in alt.groups}

    def times(merged_us):
        return lambda group: merged_us if group in merged else 10.0 if group in replaced else None

    plan = choose_scheme(half, plan, H100, measured=times(5.0))  # 5 us merged against 10 + 10 apart
    assert all(": merged (5.0 us measured against 20.0 us apart)" in line for line in plan.choices)
    assert len(plan.scheme.groups) == len(plan.default.groups) - 2
    plan = choose_scheme(half, plan, H100, measured=times(25.0))
    assert all("kept apart (merged 25.0 us measured against 20.0 us apart)" in line for line in plan.choices)
    assert plan.scheme.groups == plan.default.groups
    plan = choose_scheme(half, plan, H100, measured=lambda group: 1.0 if group in merged else None)
    assert all(" us estimated against " in line for line in plan.choices)  # the groups apart were never measured


class _LayerNormTimesCumsum(torch.nn.Module):
    """The merged GEMM + LayerNorm group's trailing multiply reads a group (cumsum) whose node
    comes after the GEMM: ordering groups by their first node would run the merge too early."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)) * torch.cumsum(y, -1)


def test_groups_run_in_dependency_order_after_a_merge(norm_merges_win):
    import stof_cc
    from stof_cc.templates.pricing import H100
    from stof_cc.tune.scheme import choose_scheme

    module = _LayerNormTimesCumsum().half()
    x, y = torch.randn(4, 64, dtype=torch.float16), torch.randn(4, 64, dtype=torch.float16)
    graph = recognise_attention(canonicalize(trace(module, (x, y), {})))
    plan = choose_scheme(graph, partition(graph), H100)
    assert any("merged" in line for line in plan.choices)
    for scheme in (plan.default, plan.scheme, *(s for _, s in plan.alternatives)):
        seen: set[str] = set()
        for group in scheme.groups:
            inputs = {r.name for n in group.nodes for r in graph.node(n).refs()} - set(group.nodes)
            assert all(graph.node(i).op in (INPUT, CONSTANT) or i in seen for i in inputs), group
            seen |= set(group.nodes)
    compiled = stof_cc.compile(module, (x, y), cuda_graphs=False)
    assert torch.equal(compiled(x, y), module(x, y))


# -- before / expected: the groups of small graphs, as literal data -----------------------------


def _groups(graph, scheme) -> list[tuple]:
    """Each group as (name, kind, anchor, prologue, epilogue); for groups without an anchor, the
    nodes in place of the prologue. The epilogue is what the anchor's value flows to."""
    rows = []
    for group in scheme.groups:
        if group.anchor is None:
            rows.append((group.name, group.kind, None, group.nodes, ()))
            continue
        after = nx.descendants(graph.nx_graph, group.anchor)
        prologue = tuple(n for n in group.nodes if n != group.anchor and n not in after)
        rows.append((group.name, group.kind, group.anchor, prologue, tuple(n for n in group.nodes if n in after)))
    return rows


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(torch.relu(x)))  # %relu, %linear, %gelu
        return self.norm(self.fc2(h) + y * 2)                   # %linear_1, %mul, %add, %layer_norm


def test_partition_of_a_feed_forward_block():
    graph = canonicalize(trace(_Mlp(), (torch.randn(2, 4, 8), torch.randn(2, 4, 8))))
    plan = partition(graph)
    assert _groups(graph, plan.default) == [
        ("g0", "gemm", "linear", ("relu",), ("gelu",)),      # relu(x) only feeds the GEMM: its prologue
        ("g1", "gemm", "linear_1", ("mul",), ("add",)),      # y * 2 only feeds the residual add
        ("g2", "reduction", "layer_norm", (), ()),
    ]
    assert [g.nodes for g in plan.default.groups] == [("relu", "linear", "gelu"), ("linear_1", "mul", "add"),
                                                      ("layer_norm",)]
    assert [(label, _groups(graph, scheme)) for label, scheme in plan.alternatives] == [
        ("linear_1 + layer_norm (row 8)", [("g0", "gemm", "linear", ("relu",), ("gelu",)),
                                           ("g1", "gemm", "linear_1", ("mul",), ("add", "layer_norm"))]),
    ]
    assert plan.refused == []


class _NoAnchor(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(torch.relu(x) * 2, -1) + y.transpose(0, 1)


def test_partition_without_anchors_makes_elementwise_runs_and_opaque_singles():
    graph = canonicalize(trace(_NoAnchor(), (torch.randn(4, 4), torch.randn(4, 4))))
    plan = partition(graph)
    assert _groups(graph, plan.default) == [
        ("g0", "elementwise", None, ("relu", "mul"), ()),
        ("g1", "opaque", None, ("cumsum",), ()),              # unregistered: torch runs it alone
        ("g2", "elementwise", None, ("transpose", "add"), ()),
    ]
    assert plan.alternatives == [] and plan.refused == []


class _Returned(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        h = self.fc(x)
        return h, torch.relu(h)


def test_partition_stops_an_epilogue_at_a_graph_output():
    graph = canonicalize(trace(_Returned(), (torch.randn(2, 8),)))
    plan = partition(graph)
    assert _groups(graph, plan.default) == [("g0", "gemm", "linear", (), ()), ("g1", "elementwise", None, ("relu",), ())]
    assert plan.refused == ["%relu not in linear's epilogue: %linear is a graph output"]


class _SelfAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (lin(x).view(2, 4, 2, 4).transpose(1, 2) for lin in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(2, 4, 8))


def test_partition_folds_the_layout_around_attention_into_its_group():
    graph = run_passes(trace(_SelfAttention(), (torch.randn(2, 4, 8),)))  # Q/K/V merged into one linear + split
    plan = partition(graph)
    heads = ("linear_merged_split", "linear", "view", "transpose", "linear_1", "view_1", "transpose_1",
             "linear_2", "view_2", "transpose_2")
    assert _groups(graph, plan.default) == [
        ("g0", "gemm", "linear_merged", (), ()),  # the split has three outputs: it ends the epilogue
        ("g1", "attention", "scaled_dot_product_attention", heads, ("transpose_3", "reshape")),
        ("g2", "gemm", "linear_3", (), ()),
    ]
    assert plan.refused == ["%linear_merged_split not in linear_merged's epilogue: it has 3 outputs"]
    assert plan.alternatives == []


class _WrittenOutGelu(torch.nn.Module):
    """fc1 -> tanh-GELU as GPT-2 writes it (the GEMM's value read three times) -> fc2."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = self.fc1(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.fc2(h)


def test_an_epilogue_that_reads_the_gemm_value_several_times_joins_the_gemm():
    """The region from fc1 to the GELU's last multiply leaves one value: it is fc1's epilogue
    (not fc2's prologue), and fc2 stays a plain GEMM."""
    graph = run_passes(trace(_WrittenOutGelu(), (torch.randn(4, 16),)))
    plan = partition(graph)
    gemms = [g for g in plan.default.groups if g.kind == "gemm"]
    assert len(gemms) == 2 and len(plan.default.groups) == 2
    fc1, fc2 = gemms
    assert {graph.node(n).op for n in fc1.nodes} >= {"tanh", "pow", "mul", "add"}
    assert fc2.nodes == (fc2.anchor,)
    assert fc1.nodes[-1] in {r.name for r in graph.node(fc2.anchor).refs()}  # the region's one value, last


class _EpilogueWithAnUnknownOp(torch.nn.Module):
    """A GEMM whose epilogue holds tanh between two ops the chains generate; the test takes
    tanh's code generator away, as if it had none."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 128)

    def forward(self, x):
        return torch.relu(torch.tanh(self.lin(x) * 2.0))


def test_a_refusal_ends_the_group_at_the_op_not_the_whole_group(monkeypatch):
    from stof_cc.codegen import chain
    from stof_cc.templates.group import applicable_templates
    from stof_cc.templates.pricing import H100
    from stof_cc.tune.scheme import choose_scheme

    monkeypatch.delitem(chain.EMITTERS, "tanh")
    graph = canonicalize(trace(_EpilogueWithAnUnknownOp().half(), (torch.randn(32, 64, dtype=torch.float16),)))
    plan = choose_scheme(graph, partition(graph), H100)
    (default,) = [g for g in plan.default.groups if g.kind == "gemm"]
    assert [graph.node(n).op for n in default.nodes] == ["linear", "mul", "tanh", "relu"]
    generated = {g.name: bool(applicable_templates(graph, g, H100)[0]) for g in plan.scheme.groups}
    ops = {g.name: [graph.node(n).op for n in g.nodes] for g in plan.scheme.groups}
    assert sorted(ops.values()) == [["linear", "mul"], ["relu"], ["tanh"]]  # the GEMM keeps what it can
    assert [generated[name] for name in sorted(ops, key=lambda n: ops[n])] == [True, True, False]
    assert any("no template generates it whole; split into" in line for line in plan.choices)
    assert nx.is_directed_acyclic_graph(_quotient(graph, plan.scheme))


def test_a_write_through_a_view_keeps_every_node_in_its_place():
    """``z[:, 0] = 0`` on a clone cannot be made functional, and the fill has no data edge to the
    later reader of ``z``: ordered by data edges, the reader ran first (4.5 off eager: a helper's
    hunt). Such a graph is not fused and keeps its order, compiled and under torch.compile."""
    import stof_cc

    class WriteThroughView(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            z = y.clone()
            z[:, 0] = 0
            return z + y

    model, x = WriteThroughView().eval(), torch.randn(2, 5, 8)
    with torch.no_grad():
        compiled = stof_cc.compile(model, (x,), dtype=torch.float32, tune=False, cuda_graphs=False)
        fresh = torch.randn(2, 5, 8)
        torch.testing.assert_close(compiled(fresh), model(fresh))
        dynamo = torch.compile(model, backend=stof_cc.backend(), dynamic=False)
        torch.testing.assert_close(dynamo(fresh), model(fresh))
    from stof_cc.passes import lower

    _, plan = lower(model, (x,))
    assert all(len(group.nodes) == 1 for group in plan.default.groups) and "nothing fused" in plan.refused[0]
