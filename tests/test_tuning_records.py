"""What a compiled model does with the tuning database's records (CPU: a hand-made database and a
pretend H100): failures recorded by stage 2, parameters read back as the space's own points, and
attention winners adopted by a compile that does not tune."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import pytest
import torch

from stof_cc.masks import causal
from stof_cc.passes import lower
from stof_cc.runtime.compiled import CompiledModule
from stof_cc.templates.attention import ATTENTION_TEMPLATES, AttentionProblem
from stof_cc.templates.elementwise import ELEMENTWISE
from stof_cc.tune import attention as attention_choice
from stof_cc.tune.database import Device, TuningDatabase
from stof_cc.tune.model import group_signature
from stof_cc.tune.scheme import choose_scheme
from stof_cc.tune.tune_attention import adopt_recorded, attention_signature

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), "13.0")


class Gate(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * 2.0 + 1.0


@pytest.fixture
def gate_group(tmp_path: Path, monkeypatch):
    """(graph, plan, its one elementwise group's signature, an empty database)."""
    monkeypatch.setattr(Device, "current", staticmethod(lambda: H100))
    graph, plan = lower(Gate(), (torch.randn(64, 256, dtype=torch.float16),))
    plan = choose_scheme(graph, plan)
    (group,) = plan.scheme.groups
    return graph, plan, group_signature(graph, group), TuningDatabase(tmp_path / "tuning.sqlite")


def _step(graph, plan, database):
    compiled = CompiledModule(Gate(), torch.float16, None, True, None, database=database, tune=False)
    (step,) = compiled.steps(graph, plan, gpu=True)
    return step


def test_a_group_whose_every_template_failed_runs_in_torch(gate_group):
    """Stage 2 found every point wrong against torch: the step must not run the template's
    unchecked default point (before, such a search raised and the compile stopped)."""
    graph, plan, signature, database = gate_group
    database.store_failure(ELEMENTWISE, signature, H100, "wrong result: relative error 0.5")
    (record,) = database.records()
    assert record.failed and record.why_failed == "wrong result: relative error 0.5" and math.isinf(record.micros)
    with pytest.warns(UserWarning, match="no correct point of elementwise .*; it runs in torch"):
        step = _step(graph, plan, database)
    assert step.kind == "torch" and "no correct point of elementwise" in step.note


def test_record_parameters_run_as_the_space_points_they_equal(gate_group):
    """A record's {"threads": 128.0} equals the point {"threads": 128}; the step runs the space's
    point, not the record's floats (which rendered `#define THREADS 128.0` and failed in nvcc)."""
    graph, plan, signature, database = gate_group
    point = ELEMENTWISE.space(ELEMENTWISE.match(graph, plan.scheme.groups[0]))[-1]
    database.store(ELEMENTWISE, signature, H100, {k: float(v) for k, v in point.items()}, 7.0)
    step = _step(graph, plan, database)
    assert step.kind == "kernel" and step.kernel[2] == point
    assert all(type(step.kernel[2][k]) is type(point[k]) for k in point)


def test_a_record_with_a_parameter_that_is_no_scalar_is_not_trusted(gate_group):
    graph, plan, signature, database = gate_group
    point = ELEMENTWISE.space(ELEMENTWISE.match(graph, plan.scheme.groups[0]))[0]
    database.store(ELEMENTWISE, signature, H100, point, 7.0)
    with sqlite3.connect(database.path) as raw:
        raw.execute("UPDATE records SET params = ?", ('{"threads": [128], "vec": 4}',))
    with pytest.warns(UserWarning, match="not a number, a string"):
        assert database.records() == []
    step = _step(graph, plan, database)
    assert step.kind == "kernel" and not step.tuned  # measured again where it tunes; the default point here


def test_a_compile_that_does_not_tune_runs_the_recorded_attention_winner(tmp_path: Path, monkeypatch):
    """`stof-cc tune` (or a tuning compile) records attention winners; a compile with tune=False
    used the cost model's pick regardless (found by review). `adopt_recorded` adopts the fastest
    legal record, and reports a problem whose every recorded template failed."""
    monkeypatch.setattr(Device, "current", staticmethod(lambda: H100))
    database = TuningDatabase(tmp_path / "tuning.sqlite")
    problem = AttentionProblem(1, 3, 384, 384, 64, torch.float16)  # shapes no other test asks for
    mask = causal()
    signature = attention_signature(problem, attention_choice.as_description(mask))
    template = ATTENTION_TEMPLATES[0]
    space = template.space(problem)
    modelled = attention_choice.choose(problem, mask, own=True).params
    recorded = next(p for p in space if p != modelled)
    database.store(template, signature, H100, recorded, 3.0)
    assert adopt_recorded(problem, mask, database) is None
    assert attention_choice.choose(problem, mask).params == recorded
    other = AttentionProblem(1, 3, 768, 768, 64, torch.float16)
    other_signature = attention_signature(other, attention_choice.as_description(mask))
    for failed in ATTENTION_TEMPLATES[:2]:
        database.store_failure(failed, other_signature, H100, "wrong result")
    assert "wrong result" in adopt_recorded(other, mask, database)
