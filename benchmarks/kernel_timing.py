"""What benchmarks/gemm.py and memory_bound.py share: one group's searched kernel as a callable,
each implementation checked against the fp32 result, then timed, and the run over the points."""

from __future__ import annotations

import datetime
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from fusion import bench
from work_log import append_to_work_log

from stof_cc.backends.group_launch import GroupLaunch
from stof_cc.ir.graph import Graph
from stof_cc.ir.interpret import interpret_values
from stof_cc.ir.reference import relative_error
from stof_cc.passes.fusion import FusionGroup
from stof_cc.templates.group import applicable_templates, group_output
from stof_cc.tune.database import Device
from stof_cc.tune.model import tune_group

TOLERANCE = 1e-2
ROUNDS = 3  # alternating timing rounds per implementation (check_and_time)


def searched_kernel(graph: Graph, group: FusionGroup, inputs: tuple[torch.Tensor, ...], top_k: int = 8) \
        -> tuple[GroupLaunch, str, dict[str, torch.Tensor]]:
    """(the winner of the search `stof-cc tune` runs for ``group``, loaded: call it on a values
    dict; its template and point; the values it reads and writes, ``inputs`` among them): stage 1
    over every point, stage 2 measuring ``top_k``."""
    values = interpret_values(graph, [*(r.name for n in group.nodes for r in graph.node(n).refs()),
                                      group_output(graph, group)], *inputs)
    report = tune_group(graph, group, values, None, Device.current(), top_k, progress=lambda _: None)
    found, _ = applicable_templates(graph, group, torch.cuda.get_device_capability())
    problem = next(a.problem for a in found if a.template is report.winner.template)
    launch = GroupLaunch(report.winner.template, problem, report.winner.params)
    return launch, f"{report.winner.template.name} {report.winner.params}", values


def check_and_time(runs: dict[str, Callable[[], Any]], want: torch.Tensor, row: dict, rounds: int = ROUNDS,
                   timers: dict[str, Callable[[], float]] | None = None) -> None:
    """``row[name_err]`` and ``row[name_ms]`` for each run: its relative error against ``want``,
    and its median time where that is under `TOLERANCE` (else infinite); a run that raises gets
    ``row[name_error]`` and an infinite time, reported, not hidden. The correct runs are timed in
    ``rounds`` rounds, in turn and in reversed order every other round, and each keeps the median of its rounds: a GEMM of milliseconds
    heats the GPU, and its clock drifts under whichever run comes second (one shape read 0.85x
    cuBLAS in one call and 1.16x in the next when each was timed once, one after the other).
    Each round times a run with `bench` (do_bench), or with ``timers[name]`` where given (ms)."""
    timed = {}
    for name, run in runs.items():
        try:
            error = relative_error(run(), want)
            row[f"{name}_err"] = error
            row[f"{name}_ms"] = math.inf
            if error < TOLERANCE:
                timed[name] = run
        except Exception as exc:  # noqa: BLE001
            row[f"{name}_ms"], row[f"{name}_error"] = math.inf, f"{type(exc).__name__}: {str(exc)[:200]}"
    times, errors = take_turns({name: timers[name] if timers else (lambda run=run: bench(run))
                                for name, run in timed.items()}, rounds)
    for name, error in errors.items():
        row[f"{name}_error"] = error
    for name, ms in times.items():
        row[f"{name}_ms"] = ms


def take_turns(timers: dict[str, Callable[[], float]], rounds: int = ROUNDS) -> tuple[dict[str, float], dict[str, str]]:
    """Each timer (a callable returning ms) run in ``rounds`` rounds, in turn and in reversed order every
    other round: ({name: the median of its rounds, infinite for one that raised}, {name: why it raised}).
    Timed once each, one after the other, the first of a process or the second of two ran at another clock:
    the same attention kernel read 36.6 us first in one process and 27.3 us in turns in the next."""
    times: dict[str, list[float]] = {name: [] for name in timers}
    errors: dict[str, str] = {}
    for round_ in range(max(rounds, 1)):
        order = list(timers.items())
        for name, timer in order if round_ % 2 == 0 else order[::-1]:  # A B, B A, ...: neither is always second
            if name in errors:
                continue
            try:
                times[name].append(timer())
            except Exception as exc:  # noqa: BLE001
                errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {name: math.inf if name in errors else statistics.median(measured)
            for name, measured in times.items()}, errors


def stream_ms(calls: list[Callable[[], Any]], min_launches: int = 16, replays: int = 15) -> float:
    """Median time per launch of ``calls`` (each reading its own inputs and writing a new output)
    run back to back, in turn, at least ``min_launches`` launches, in one CUDA graph: the steady
    state of a model's memory-bound kernels, where each launch pays the DRAM write-back of the
    output its predecessor left dirty in L2, and no more. `triton.testing.do_bench` flushes L2 by
    zeroing 256 MB, which leaves the whole L2 dirty: a 67 MB kernel timed after it also pays for
    up to 50 MB of the flush's writes (a plain copy of 67 MB: 2.35 TB/s there, 2.76 here;
    benchmarks/history/21-2026-11-27.md). Give enough calls that their inputs hold twice the L2
    (`stof_cc.tune.model.input_set_count`), or the launches read from L2."""
    for call in calls:  # warm-up: compiles, allocations, Inductor's guards
        call()
    torch.cuda.synchronize()
    laps = -(-min_launches // len(calls))
    graph, outputs = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        for _ in range(laps):
            for call in calls:
                outputs.append(call())  # kept: every launch writes memory no other launch wrote
    graph.replay()
    return replayed_ms(graph, laps * len(calls), replays)


def replayed_ms(graph: torch.cuda.CUDAGraph, launches: int, replays: int) -> float:
    """Median time per launch of ``replays`` replays of ``graph``, which holds ``launches``."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def sustained_ms(calls: list[Callable[[], Any]], heat_s: float = 1.0, replay_ms: float = 20.0,
                 replays: int = 10, max_launches: int = 2000) -> float:
    """Median time per launch of ``calls`` (one per input set, each reading its own operands; their
    outputs are not kept) run back to back in a CUDA graph, after ``heat_s`` seconds of the same
    work: the state a model's GEMMs run in. A stream of large GEMMs holds the GPU at its power
    limit (an H200 at 690 W ran the 70B layer's GEMMs at about 1440 MHz), where do_bench's short
    bursts after idle moments time them at higher clocks that drift between runs
    (benchmarks/history/35-2026-11-28.md)."""
    for call in calls:  # warm-up: loads, allocations
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    end.synchronize()
    lap_ms = max(start.elapsed_time(end), 1e-3)
    laps = max(1, min(math.ceil(replay_ms / lap_ms), max_launches // len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(laps):
            for call in calls:
                call()
    began = time.perf_counter()
    while time.perf_counter() - began < heat_s:  # to the power state the timed replays run in
        graph.replay()
        torch.cuda.synchronize()
    return replayed_ms(graph, laps * len(calls), replays)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"4096x14336,768x768"`` -> [(4096, 14336), (768, 768)]."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def run_points(points: Iterable[Callable[[], dict]], table: Callable[[list[dict], str], str], dtype: str,
               json_path: str | None, append: bool, title: str) -> None:
    """Run each point (printing its row, rewriting ``json_path`` after each: a run cut short keeps
    what it measured), then print the table and, with ``append``, add it to the work log."""
    rows = []
    for point in points:
        rows.append(point())
        print(rows[-1], flush=True)
        if json_path:
            Path(json_path).write_text(json.dumps(rows, indent=1))
    head = (f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, {dtype}")
    text = table(rows, head)
    print(text)
    if append:
        append_to_work_log(f"\n## {title}\n\n{text}\n")
