"""The vendor GEMM as a measured choice (tune/library.py): a GEMM group splits into cuBLAS and a
generated epilogue only where measured faster than the fused kernel, a lone linear runs in
cuBLAS only where its record beats the generated one; on the GPU, a tuned model records the
library's time and a model whose records favour it runs it and matches eager."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from group_cases import H100, LinearResidual, LinearResidualLayerNorm, build

import stof_cc
from stof_cc.passes import partition
from stof_cc.runtime.compiled import CompiledModule, _lifetimes
from stof_cc.templates.group import applicable_templates
from stof_cc.tune.database import Device, TuningDatabase
from stof_cc.tune.library import (
    LIBRARY_GEMM,
    is_lone_linear,
    library_split,
    library_wins,
    linear_and_epilogue,
)
from stof_cc.tune.model import group_signature, measured_times
from stof_cc.tune.scheme import choose_scheme

FAKE_GPU = Device("NVIDIA H100 80GB HBM3", (9, 0), "13.0")


def _gemm_with_epilogue():
    _, inputs, graph, group = build(LinearResidual, "gemm", (8, 128, 256), torch.float16)
    return inputs, graph, group


def test_a_gemm_group_is_cut_into_its_linear_and_the_epilogue():
    _, graph, group = _gemm_with_epilogue()
    linear, epilogue = linear_and_epilogue(graph, group)
    assert [graph.node(n).op for n in group.nodes] == ["linear", "add"]
    assert linear.nodes == group.nodes[:1] and is_lone_linear(graph, linear) and linear.kind == "gemm"
    assert epilogue.nodes == group.nodes[1:] and epilogue.kind == "elementwise" and epilogue.anchor is None
    assert linear_and_epilogue(graph, linear) is None  # nothing to cut off a lone linear


def test_a_merged_norm_stays_a_reduction_when_cut_off():
    _, _, graph, group = build(LinearResidualLayerNorm, "gemm", (8, 128, 256), torch.float16)
    linear, epilogue = linear_and_epilogue(graph, group)
    assert is_lone_linear(graph, linear)
    assert epilogue.kind == "reduction" and graph.node(epilogue.anchor).op == "layer_norm"
    assert applicable_templates(graph, epilogue, H100)[0][0].template.name == "row_reduce"


@pytest.mark.parametrize(("fused_us", "split"), [(30.0, True), (10.0, False)])
def test_the_split_is_taken_only_where_measured_faster(fused_us, split):
    _, graph, group = _gemm_with_epilogue()
    linear, epilogue = linear_and_epilogue(graph, group)
    times = {group.nodes: fused_us, linear.nodes: 15.0, epilogue.nodes: 5.0}
    groups, notes = library_split(graph, [group], lambda g: times.get(g.nodes))
    assert [g.nodes for g in groups] == ([linear.nodes, epilogue.nodes] if split else [group.nodes])
    assert notes == [f"{group.name}: " + ("linear and epilogue apart (15.0 + 5.0 us measured against 30.0 us fused)"
                                          if split else "fused (10.0 us measured against 20.0 us apart)")]


def test_no_split_without_measurements_of_every_side():
    _, graph, group = _gemm_with_epilogue()
    linear, _ = linear_and_epilogue(graph, group)
    times = {group.nodes: 30.0, linear.nodes: 1.0}  # the epilogue never measured
    assert library_split(graph, [group], lambda g: times.get(g.nodes)) == ([group], [])
    plan = partition(graph)  # untuned: estimates only, and no estimate of cuBLAS exists
    assert any(g.nodes == group.nodes for g in choose_scheme(graph, plan, H100).scheme.groups)


def test_the_library_wins_only_where_faster():
    assert library_wins(9.0, 10.0) and not library_wins(11.0, 10.0) and not library_wins(None, 10.0)
    assert library_wins(9.0, None)  # the generated GEMM has no record


def _database_favouring_the_library(tmp_path: Path, graph, group, library_us: float) -> TuningDatabase:
    """Records as a tune would leave them: the fused group slower than cuBLAS plus the epilogue."""
    linear, epilogue = linear_and_epilogue(graph, group)
    db = TuningDatabase(tmp_path / "t.sqlite")
    gemm = next(a for a in applicable_templates(graph, linear, H100)[0])
    elementwise = next(a for a in applicable_templates(graph, epilogue, H100)[0])
    fused = next(a for a in applicable_templates(graph, group, H100)[0])
    for applicable, part, micros in ((fused, group, 40.0), (gemm, linear, 30.0), (elementwise, epilogue, 5.0)):
        db.store(applicable.template, group_signature(graph, part), FAKE_GPU,
                 applicable.template.default_params(applicable.problem), micros)
    db.store(LIBRARY_GEMM, group_signature(graph, linear), FAKE_GPU, {}, library_us)
    return db


@pytest.mark.parametrize(("library_us", "step_kind"), [(20.0, "library"), (35.0, "kernel")])
def test_the_steps_follow_the_records(tmp_path, monkeypatch, library_us, step_kind):
    monkeypatch.setattr(Device, "current", staticmethod(lambda: FAKE_GPU))
    _, graph, group = _gemm_with_epilogue()
    db = _database_favouring_the_library(tmp_path, graph, group, library_us)
    measured = measured_times(graph, db, FAKE_GPU)
    plan = choose_scheme(graph, partition(graph), H100, measured=measured)
    linear, epilogue = linear_and_epilogue(graph, group)
    assert [g.nodes for g in plan.scheme.groups if g.nodes in (linear.nodes, epilogue.nodes)] \
        == [linear.nodes, epilogue.nodes]  # apart either way: min(library, 30 us) + 5 us < 40 us fused
    module = CompiledModule(torch.nn.Identity(), torch.float16, None, use_gpu_kernels=False, build_dir=None,
                            database=db)
    steps = module.steps(graph, plan, gpu=True)
    kinds = {s.group.nodes: s.kind for s in steps}
    assert kinds[linear.nodes] == step_kind and kinds[epilogue.nodes] == "kernel"
    _lifetimes(graph, steps)  # every step's reads written before it
    note = next(s.note for s in steps if s.group.nodes == linear.nodes)
    assert note.startswith("cuBLAS through F.linear (20.0 us measured against 30.0 us generated)" if step_kind == "library"
                           else "gemm_epilogue"), note


def test_a_library_record_is_keyed_apart_from_every_template(tmp_path):
    _, graph, group = _gemm_with_epilogue()
    linear, _ = linear_and_epilogue(graph, group)
    db = TuningDatabase(tmp_path / "t.sqlite")
    db.store(LIBRARY_GEMM, group_signature(graph, linear), FAKE_GPU, {}, 12.5)
    assert db.lookup(LIBRARY_GEMM, group_signature(graph, linear), FAKE_GPU).micros == 12.5
    assert measured_times(graph, db, FAKE_GPU)(linear) == 12.5
    assert measured_times(graph, db, FAKE_GPU)(group) is None  # the fused group has no library record


@pytest.mark.gpu
def test_a_tuned_model_records_the_library_and_runs_what_won(tmp_path):
    torch.manual_seed(0)
    module = LinearResidual(1024).half().cuda()
    inputs = tuple(torch.randn(8, 512, 1024, dtype=torch.float16, device="cuda") for _ in range(2))
    db = TuningDatabase(tmp_path / "t.sqlite")
    compiled = stof_cc.compile(module, inputs, database=db)
    with torch.no_grad():
        want = copy.deepcopy(module).float()(*(t.float() for t in inputs))
    got = compiled(*inputs)
    assert torch.linalg.norm(got.float() - want) / torch.linalg.norm(want) < 1e-2
    assert any(r.template == LIBRARY_GEMM.name for r in db.records())
    (variant,) = compiled.variants.values()
    assert {s.kind for s in variant.steps} <= {"kernel", "library"}


@pytest.mark.gpu
def test_a_model_whose_records_favour_the_library_runs_cublas_and_matches_eager(tmp_path, monkeypatch):
    torch.manual_seed(0)
    module = LinearResidual(256).half().cuda()
    inputs = tuple(torch.randn(8, 128, 256, dtype=torch.float16, device="cuda") for _ in range(2))
    _, graph, group = _gemm_with_epilogue()
    db = _database_favouring_the_library(tmp_path, graph, group, 20.0)
    monkeypatch.setattr(Device, "current", staticmethod(lambda: FAKE_GPU))  # the records' device
    compiled = stof_cc.compile(module, inputs, database=db, tune=False)
    with torch.no_grad():
        want = copy.deepcopy(module).float()(*(t.float() for t in inputs))
    for _ in range(2):  # the second call replays the captured graph
        got = compiled(*inputs)
        assert torch.linalg.norm(got.float() - want) / torch.linalg.norm(want) < 1e-2
    (variant,) = compiled.variants.values()
    assert sorted(s.kind for s in variant.steps) == ["kernel", "library"]
