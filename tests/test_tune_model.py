"""`stof-cc tune` and tune_model: signatures and the no-GPU error on the CPU; a real run on the GPU."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from group_cases import LinearResidual, ResidualLayerNormSilu, build

from stof_cc.cli import main
from stof_cc.ir.frontend import trace
from stof_cc.passes import canonicalize, partition
from stof_cc.tune.database import TuningDatabase
from stof_cc.tune.model import (
    MAX_INPUT_SETS,
    MIN_INPUT_SETS,
    InputSets,
    group_signature,
    input_set_count,
    tune_model,
)


def test_group_signature_names_ops_and_specs():
    _, _, graph, group = build(ResidualLayerNormSilu, "reduction", (4, 96), torch.float16)
    signature = group_signature(graph, group)
    assert signature.startswith("reduction add+add+layer_norm+silu -> f16[4,96] <- ")
    _, _, other, group2 = build(ResidualLayerNormSilu, "reduction", (4, 128), torch.float16)
    assert group_signature(other, group2) != signature  # another shape, another record


class _SliceGelu(torch.nn.Module):
    def __init__(self, start: int, approximate: str = "none", swap: bool = False) -> None:
        super().__init__()
        self.start, self.approximate, self.swap = start, approximate, swap

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pieces = (y, x) if self.swap else (x, y)
        s = torch.cat(pieces, -1)[:, self.start:self.start + 64]
        return torch.nn.functional.gelu(s, approximate=self.approximate) * 2.0


def test_groups_that_compute_different_things_never_share_a_signature():
    """Same ops and specs, other arguments: a slice offset, gelu's approximation. They shared a
    record, and the second ran a point never checked against torch for it (found by review).
    Identical groups (a model's layers) still share theirs, and so do groups that differ only in
    which model input each operand is (``cat([y, x])`` is ``cat([x, y])`` with its operands named
    the other way round: one kernel computes both)."""
    from stof_cc.passes import lower
    from stof_cc.tune.scheme import choose_scheme

    def signatures(module):
        x, y = torch.randn(8, 64, dtype=torch.float16), torch.randn(8, 64, dtype=torch.float16)
        graph, plan = lower(module, (x, y))
        return [group_signature(graph, g) for g in choose_scheme(graph, plan).scheme.groups]

    variants = [_SliceGelu(0), _SliceGelu(1), _SliceGelu(0, "tanh")]
    found = [tuple(signatures(m)) for m in variants]
    assert len(set(found)) == len(variants)
    assert len({s.split(" #")[0] for s in found[0] + found[1]}) == len(found[0])  # only the digest tells them apart
    assert tuple(signatures(_SliceGelu(0))) == tuple(signatures(_SliceGelu(0, swap=True))) == found[0]


class _RowDifferences(torch.nn.Module):
    """x - a (a row broadcast over x) beside b - y: the same ops and, in name order, the same
    input specs; only which operand is the row differs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(64))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return x - self.a, self.b - y


def test_groups_whose_inputs_swap_places_never_share_a_signature():
    """x[M, N] - a[N] and b[N] - y[M, N] shared a record (the specs were listed in name order and
    the digest named places without their specs): the second group ran the first's point, never
    checked against torch for it, or went to torch on the first's failure (found by review)."""
    from stof_cc.passes import lower
    from stof_cc.tune.scheme import choose_scheme

    x, y = torch.randn(32, 64, dtype=torch.float16), torch.randn(32, 64, dtype=torch.float16)
    graph, plan = lower(_RowDifferences().half(), (x, y))
    first, second = (group_signature(graph, g) for g in choose_scheme(graph, plan).scheme.groups)
    assert first.split(" #")[0] == second.split(" #")[0] == "elementwise sub -> f16[32,64] <- f16[64],f16[32,64]"
    assert first != second


def test_stage_2_rotates_through_twice_the_l2():
    """Enough input sets that a launch finds its operands in DRAM: 4 MB sets on a 50 MB L2 take 25,
    large sets the minimum, tiny ones the cap."""
    l2 = 50 * 2**20
    assert input_set_count(4 * 2**20, l2) == 25
    assert input_set_count(512 * 2**20, l2) == MIN_INPUT_SETS
    assert input_set_count(4096, l2) == MAX_INPUT_SETS
    assert input_set_count(0, l2) == MAX_INPUT_SETS


def test_input_sets_hand_set_0_to_the_check_and_the_rest_in_turn_across_candidates():
    """run(0) (the correctness check, and the warm-up's first launch) reads the real inputs; every
    other launch takes the next set in turn, and two candidates sharing the sets carry the turn on,
    so no set comes back before every other set has been read."""
    sets = InputSets(["real", "a", "b", "c"])
    first = [sets(i) for i in range(6)]
    second = [sets(i) for i in range(6)]
    assert first[0] == second[0] == "real"
    assert first[1:] + second[1:] == ["real", "a", "b", "c", "real", "a", "b", "c", "real", "a"]


def test_tune_without_a_gpu_is_a_clear_error(monkeypatch, example_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", example_path("encoder_layer")]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


@pytest.mark.gpu
def test_tune_model_then_a_warm_database_measures_nothing(tmp_path: Path):
    module = LinearResidual(768).half()
    inputs = (torch.randn(8, 128, 768, dtype=torch.float16), torch.randn(8, 128, 768, dtype=torch.float16))
    graph = canonicalize(trace(module, inputs, {}))
    plan = partition(graph)
    db = TuningDatabase(tmp_path / "t.sqlite")
    _, first = tune_model(graph, plan, inputs, database=db, top_k=4, progress=lambda _: None)
    assert first and all(r.measured > 0 for r in first)
    started = time.perf_counter()
    _, second = tune_model(graph, plan, inputs, database=db, top_k=4, progress=lambda _: None)
    assert all(r.from_database and r.measured == 0 for r in second)
    assert time.perf_counter() - started < 10
