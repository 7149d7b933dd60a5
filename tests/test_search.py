"""Stage 2 of the search on the CPU: pruning, failures, the database short-cut (fake timer, real nvcc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stof_cc.templates.elementwise import ELEMENTWISE
from stof_cc.templates.row_reduce import ROW_REDUCE
from stof_cc.tune.database import Device, TuningDatabase
from stof_cc.tune.search import Candidate, NoCorrectCandidate, search, select_survivors

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), "13.0")
GOOD = 'extern "C" __global__ void k{i}(float* x) {{ x[threadIdx.x] += {i}; }}\n'
TIMES = {i: 10.0 + (i * 7) % 5 for i in range(10)}  # measured us per candidate; the model ranks by i


def _candidates(template=ELEMENTWISE, count=10, broken=()):
    return [Candidate(template, {"i": i}, float(i), "this is not CUDA" if i in broken else GOOD.format(i=i))
            for i in range(count)]


class FakeRun:
    """Stands in for a launch: its "output" is its error against the reference."""

    def __init__(self, i: int, wrong: bool) -> None:
        self.i, self.wrong = i, wrong

    def __call__(self, input_set: int) -> float:
        return 0.5 if self.wrong else 0.0


def _fake(wrong=(), raising=()):
    """(build, check, timer) for candidates whose measured time is TIMES[i]."""
    def build(candidate):
        i = candidate.params["i"]
        if i in raising:
            raise RuntimeError("launch failed: too many resources requested")
        return FakeRun(i, i in wrong)
    return build, (lambda error: error), (lambda run, runs: TIMES[run.i])


@pytest.mark.nvcc
def test_top_k_pruning_and_model_rank():
    build, check, timer = _fake()
    report = search(_candidates(), build, check, signature="g0", top_k=3, timer=timer, workers=2)
    assert (report.candidates, report.pruned, report.measured) == (10, 7, 3)
    assert report.winner.params == {"i": 0} and report.winner_us == 10.0  # 10, 12, 14 us for i = 0, 1, 2
    assert report.winner_model_rank == 1 and "3 measured" in str(report)


@pytest.mark.nvcc
def test_failures_are_timed_as_infinite_not_fatal():
    build, check, timer = _fake(wrong={0}, raising={1})
    report = search(_candidates(broken={2}), build, check, signature="g1", top_k=4, timer=timer, workers=2)
    failures = {o.candidate.params["i"]: o.failure for o in report.outcomes if o.failure}
    assert set(failures) == {0, 1, 2}
    assert "wrong result" in failures[0] and "too many resources" in failures[1] and failures[2].startswith("compile")
    assert report.winner.params == {"i": 3} and report.winner_model_rank == 4
    build, check, timer = _fake(wrong=set(range(10)))
    with pytest.raises(RuntimeError, match="every measured candidate failed"):
        search(_candidates(), build, check, signature="g2", top_k=2, timer=timer)


@pytest.mark.nvcc
def test_a_warm_database_measures_nothing(tmp_path: Path):
    db = TuningDatabase(tmp_path / "t.sqlite")
    candidates = _candidates(ELEMENTWISE, 4) + [Candidate(ROW_REDUCE, {"i": 9}, 9.0, GOOD.format(i=9))]
    build, check, timer = _fake()
    first = search(candidates, build, check, signature="g3", top_k=8, max_share=1.0, timer=timer, database=db,
                   device=H100)
    assert not first.from_database and first.measured == 5
    assert {r.template for r in db.records()} == {"elementwise", "row_reduce"}

    def must_not_build(candidate):
        raise AssertionError("a warm database must not measure")

    def must_not_render():
        raise AssertionError("a warm database must not render")

    lazy = [Candidate(c.template, c.params, c.estimate_us, must_not_render) for c in candidates]
    second = search(lazy, must_not_build, check, signature="g3", max_share=1.0, timer=timer, database=db,
                    device=H100)
    assert second.from_database and second.measured == 0
    assert second.winner.params == first.winner.params and "nothing measured" in str(second)
    other_gpu = Device("NVIDIA A100-SXM4-80GB", (8, 0), "13.0")
    third = search(candidates, build, check, signature="g3", max_share=1.0, timer=timer, database=db,
                   device=other_gpu)
    assert not third.from_database


@pytest.mark.nvcc
def test_templates_outside_the_survivors_need_no_record(tmp_path: Path):
    db = TuningDatabase(tmp_path / "t.sqlite")
    candidates = _candidates(ELEMENTWISE, 4) + [Candidate(ROW_REDUCE, {"i": 9}, 9.0, GOOD.format(i=9))]
    build, check, timer = _fake()
    search(candidates, build, check, signature="g4", top_k=2, timer=timer, database=db, device=H100)
    again = search(candidates, build, check, signature="g4", top_k=2, timer=timer, database=db, device=H100)
    assert again.from_database  # row_reduce was never a survivor, so it has (and needs) no record


def test_survivors_are_a_quarter_at_most_and_every_tile_height_has_a_place():
    # 40 candidates: the model's best 20 are 128-row tiles, the 64-row ones rank below them
    ranked = [Candidate(ELEMENTWISE, {"block_m": 128 if i < 20 else 64, "i": i}, float(i), "") for i in range(40)]
    chosen = select_survivors(ranked, top_k=8)
    assert len(chosen) == 8 and [c.params["i"] for c in chosen] == [0, 1, 2, 3, 4, 5, 6, 20]
    assert len(select_survivors(ranked[:24], top_k=8)) == 6  # a quarter of 24
    assert len(select_survivors(ranked[:6], top_k=8)) == 4  # but at least 4 where there are
    assert len(select_survivors(ranked[:24], top_k=8, max_share=1.0)) == 8
    plain = [Candidate(ELEMENTWISE, {"i": i}, float(i), "") for i in range(12)]  # no block_m: estimate order
    assert [c.params["i"] for c in select_survivors(plain, top_k=8)] == [0, 1, 2, 3]


def test_cuda_timer_records_each_start_event_behind_a_gpu_sleep(monkeypatch):
    """The H100 run of the MHA grid showed events around a bare Python launch time the host's
    launch path; the stream must be busy (asleep) when the start event is recorded, and a
    launch the sleep did not cover is timed again with a longer one."""
    import torch

    from stof_cc.tune import search as search_module

    calls: list[str] = []

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            self.name = "end" if sum(c.startswith("new") for c in calls) % 2 else "start"
            calls.append("new")

        def record(self) -> None:
            calls.append(f"record {self.name}")

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            calls.append(f"query {self.name}")
            return len([c for c in calls if c.startswith("query")]) == 1  # the first timed launch was not covered

        def elapsed_time(self, other) -> float:
            return 0.025

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(f"sleep {cycles}"))
    micros = search_module.cuda_timer(lambda i: calls.append("launch"), runs=3, warmup=1)
    assert micros == 25.0
    timed = [c for c in calls if c != "new"][1:]  # after the warm-up launch
    lead = search_module.LEAD_CYCLES
    once = ["record start", "launch", "record end", "query start"]
    assert timed == [f"sleep {lead}", *once, f"sleep {2 * lead}", *once] + [f"sleep {2 * lead}", *once] * 2


@pytest.mark.nvcc
def test_a_group_with_no_correct_candidate_is_recorded_and_not_measured_again(tmp_path: Path):
    """Every candidate wrong: `NoCorrectCandidate` (the group runs in torch), each template's
    failure recorded, and a warm database answers the same without compiling or timing anything
    (it re-measured the group on every compile: found by review)."""
    db = TuningDatabase(tmp_path / "t.sqlite")
    candidates = _candidates(ELEMENTWISE, 3) + [Candidate(ROW_REDUCE, {"i": 9}, 9.0, "this is not CUDA")]
    build, check, timer = _fake(wrong={0, 1, 2})
    with pytest.raises(NoCorrectCandidate, match="every measured candidate failed"):
        search(candidates, build, check, signature="g9", top_k=8, max_share=1.0, timer=timer, database=db, device=H100)
    records = {r.template: r for r in db.records()}
    assert set(records) == {"elementwise", "row_reduce"} and all(r.failed for r in records.values())
    assert "wrong result" in records["elementwise"].why_failed and "compile" in records["row_reduce"].why_failed

    def must_not_build(candidate):
        raise AssertionError("a warm database must not measure")

    with pytest.raises(NoCorrectCandidate, match="when last measured"):
        search(candidates, must_not_build, check, signature="g9", top_k=8, max_share=1.0, timer=timer,
               database=db, device=H100)


@pytest.mark.nvcc
def test_a_template_that_failed_gives_way_to_one_that_worked(tmp_path: Path):
    db = TuningDatabase(tmp_path / "t.sqlite")
    candidates = _candidates(ELEMENTWISE, 2) + [Candidate(ROW_REDUCE, {"i": 9}, 9.0, GOOD.format(i=9))]
    build, check, timer = _fake(wrong={0, 1})
    report = search(candidates, build, check, signature="g10", top_k=8, max_share=1.0, timer=timer, database=db,
                    device=H100)
    assert report.winner.template is ROW_REDUCE
    warm = search(candidates, None, check, signature="g10", top_k=8, max_share=1.0, timer=timer, database=db,
                  device=H100)
    assert warm.from_database and warm.winner.template is ROW_REDUCE


@pytest.mark.nvcc
def test_a_run_short_of_memory_or_of_nvcc_stores_no_failure_and_keeps_a_winner(tmp_path: Path, monkeypatch):
    """Another process holding the GPU's memory, or nvcc missing from PATH for one run, was stored as the
    template's lasting failure: later runs never measured it again, and a re-search replaced a winner's
    record with the failure (a review). Now nothing is stored for them, and a winner is never replaced."""
    import torch

    db = TuningDatabase(tmp_path / "t.sqlite")
    build, check, timer = _fake()

    def short_of_memory(candidate):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def search_with(builder, signature):
        return search(_candidates(), builder, check, signature=signature, top_k=8, max_share=1.0, timer=timer,
                      database=db, device=H100)

    with pytest.raises(NoCorrectCandidate):
        search_with(short_of_memory, "oom")
    assert not db.records()
    assert search_with(build, "oom").winner_us == 10.0  # measured again, once the memory is free
    # a re-search (another template has no record) in which every candidate fails keeps the winner's record
    both = _candidates(ELEMENTWISE, 2) + [Candidate(ROW_REDUCE, {"i": 9}, 9.0, GOOD.format(i=9))]
    wrong, _, _ = _fake(wrong={0, 1, 9})
    with pytest.raises(NoCorrectCandidate):
        search(both, wrong, check, signature="oom", top_k=8, max_share=1.0, timer=timer, database=db, device=H100)
    assert not db.lookup(ELEMENTWISE, "oom", H100).failed and db.lookup(ROW_REDUCE, "oom", H100).failed
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    with pytest.raises(NoCorrectCandidate, match="nvcc not found"):
        search(_candidates(), build, check, signature="no nvcc", top_k=8, max_share=1.0, timer=timer,
               database=db, device=H100)
    assert [r.signature for r in db.records()] == ["oom", "oom"]
