"""benchmarks/kernel_timing.py's check_and_time on the CPU, its timer replaced: the implementations
are timed in alternating rounds (each keeps its median), and a wrong or failing one is reported
with an infinite time, not timed."""

from __future__ import annotations

import math
import sys

import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_timing  # noqa: E402


def test_rounds_alternate_and_each_keeps_its_median(monkeypatch):
    order, times = [], {"a": [3.0, 1.0, 2.0], "b": [5.0, 6.0, 4.0]}

    def bench(run):
        name = run()[1]
        order.append(name)
        return times[name].pop(0)

    want = torch.ones(4)
    runs = {"a": lambda: (want, "a"), "b": lambda: (want, "b")}
    monkeypatch.setattr(kernel_timing, "bench", bench)
    monkeypatch.setattr(kernel_timing, "relative_error", lambda got, ref: 0.0)
    row = {}
    kernel_timing.check_and_time(runs, want, row, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]  # neither is always second
    assert row["a_ms"] == 2.0 and row["b_ms"] == 5.0 and row["a_err"] == row["b_err"] == 0.0


def test_a_wrong_or_failing_run_is_reported_not_timed(monkeypatch):
    timed = []
    monkeypatch.setattr(kernel_timing, "bench", lambda run: timed.append(run) or 1.0)
    want = torch.ones(4)

    def broken():
        raise RuntimeError("launch failed")

    row = {}
    kernel_timing.check_and_time({"good": lambda: want, "wrong": lambda: want * 2, "broken": broken}, want, row)
    assert row["good_ms"] == 1.0 and row["wrong_ms"] == math.inf and row["broken_ms"] == math.inf
    assert row["wrong_err"] > kernel_timing.TOLERANCE and row["broken_error"].startswith("RuntimeError: launch failed")
    assert len(timed) == kernel_timing.ROUNDS  # only the good one was timed


def test_given_timers_replace_do_bench_round_by_round(monkeypatch):
    monkeypatch.setattr(kernel_timing, "bench", lambda run: (_ for _ in ()).throw(AssertionError("do_bench ran")))
    monkeypatch.setattr(kernel_timing, "relative_error", lambda got, ref: 0.0)
    laps = {"a": iter([4.0, 2.0, 3.0]), "b": iter([1.0, 9.0, 8.0])}
    want = torch.ones(4)
    row = {}
    kernel_timing.check_and_time({"a": lambda: want, "b": lambda: want}, want, row, rounds=3,
                                 timers={name: lambda name=name: next(laps[name]) for name in laps})
    assert row["a_ms"] == 3.0 and row["b_ms"] == 8.0


def test_take_turns_stops_timing_a_timer_that_raises():
    """mha.py times stof-cc, its peers and the dense floors this way: one failing while timed is named
    with an infinite time, and the others go on taking turns."""
    calls = []

    def flaky():
        calls.append("flaky")
        if len(calls) > 1:
            raise RuntimeError("out of memory")
        return 1.0

    laps = iter([3.0, 1.0, 2.0])
    times, errors = kernel_timing.take_turns({"steady": lambda: next(laps), "flaky": flaky}, rounds=3)
    assert times == {"steady": 2.0, "flaky": math.inf}
    assert errors == {"flaky": "RuntimeError: out of memory"} and calls == ["flaky", "flaky"]
