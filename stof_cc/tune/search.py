"""Stage 2 of the search: measure the model's best few candidates and keep the fastest correct one.

Stage 1 (`cost_model`) scores every candidate without running it; `search` keeps the survivors
(`select_survivors`: at most ``top_k``, default 8, and a quarter of the candidates, at least 4, the
best of each tile height included), compiles them in parallel (one nvcc process per candidate, started from
a thread pool: no fork of a process that holds a CUDA context; the cubins land in the on-disk
cache the launcher reads), runs each once against the torch reference
(relative error under 1e-2, no NaN, else it is out with the reason), times the survivors
(warm-up, then the median of ``runs`` launches timed by CUDA events, rotating over several
input sets so that no candidate finds its inputs in L2), and returns the fastest. A
candidate that fails to compile, to launch or to match is timed as infinite, never fatal.

With a `TuningDatabase`, the winners are remembered per template (the key covers the
template's sources, the group signature and the GPU): when every template of the candidate
list has a record, nothing is compiled or measured and the fastest record wins. A template none
of whose measured points worked is recorded as failed (`Record.failed`); a group with no correct
candidate at all raises `NoCorrectCandidate`, which the callers turn into a torch step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stof_cc.backends.nvcc import NVCC_MISSING, compile_many
from stof_cc.templates.registry import KernelTemplate
from stof_cc.tune.database import Device, TuningDatabase

DEFAULT_TOP_K = 8
MAX_SHARE = 0.25  # stage 2 measures at most this share of the candidates (issue 6's bar) ...
MIN_MEASURED = 4  # ... but at least this many, where there are as many
MAX_ERROR = 1e-2


@dataclass(frozen=True)
class Candidate:
    """One (template, parameter point) with the model's estimate and its source: the text, or a
    function rendering it, called only if the candidate is compiled (a search the database
    answers renders nothing)."""

    template: KernelTemplate
    params: dict[str, Any]
    estimate_us: float
    source: str | Callable[[], str]

    def cuda_source(self) -> str:
        return self.source() if callable(self.source) else self.source


class NoCorrectCandidate(RuntimeError):
    """Stage 2 found no candidate of a group that compiled, launched and matched torch (measured
    now, or recorded so by an earlier search): the group runs in torch. Each template's failure
    is recorded, so a warm database does not measure it again."""


@dataclass
class Outcome:
    candidate: Candidate
    micros: float = math.inf
    failure: str = ""
    lasting: bool = True  # a failure of the candidate itself (another run would fail again), not of the run's
    # surroundings (no nvcc on PATH, memory another process holds): only a lasting one is remembered


@dataclass
class SearchReport:
    """What one search did: counts, time, the winner and where the model ranked it."""

    signature: str
    candidates: int
    pruned: int
    measured: int
    seconds: float
    winner: Candidate
    winner_us: float
    winner_model_rank: int  # 1 = the model's own first choice
    from_database: bool = False
    outcomes: list[Outcome] = field(default_factory=list)

    def __str__(self) -> str:
        if self.from_database:
            return (f"{self.signature}: {self.winner.template.name} {self.winner.params} from the tuning database "
                    f"({self.winner_us:.1f} us when measured); nothing measured, {self.seconds:.2f} s")
        failed = [o for o in self.outcomes if o.failure]
        lines = [f"{self.signature}: {self.candidates} candidates, {self.pruned} pruned by the model, "
                 f"{self.measured} measured, {len(failed)} failed, {self.seconds:.1f} s",
                 f"  winner {self.winner.template.name} {self.winner.params}: {self.winner_us:.1f} us, "
                 f"rank {self.winner_model_rank} under the model"]
        lines += [f"  failed {o.candidate.template.name} {o.candidate.params}: {o.failure}" for o in failed]
        return "\n".join(lines)


# GPU cycles the stream sleeps before each timed launch (about 0.1 ms on an H100): longer than the
# host takes to issue the start event, the launch (Python argument checks included) and the end
# event, so the events bracket the kernel alone. Without it, the H100 run of the MHA grid timed
# launch overhead: every candidate read 15-25 us slow and stage 2 picked by noise. A launch the
# sleep did not cover (the start event already passed once the end event is issued) is timed
# again with twice the sleep, up to MAX_LEAD_CYCLES.
LEAD_CYCLES = 200_000
MAX_LEAD_CYCLES = 8 * LEAD_CYCLES


def cuda_timer(run: Callable[[int], Any], runs: int, warmup: int = 3) -> float:
    """Median microseconds of ``run(i)`` over ``runs`` launches, each timed by CUDA events
    recorded while the stream is still busy with a sleep (``LEAD_CYCLES``); ``i`` counts
    launches (0, 1, ... through the warm-up and on) so the caller can rotate its input sets."""
    import torch

    for i in range(warmup):
        run(i)
    times, lead = [], LEAD_CYCLES
    for i in range(warmup, warmup + runs):  # the launches count on from the warm-up's
        while True:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(lead)
            start.record()
            run(i)
            end.record()
            uncovered = start.query()  # the GPU reached the start before the launch was issued
            end.synchronize()
            if not uncovered or lead >= MAX_LEAD_CYCLES:
                break
            lead *= 2
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def search(candidates: Sequence[Candidate], build: Callable[[Candidate], Callable[[int], Any]],
           check: Callable[[Any], float], *, signature: str, arch: str = "sm_90", top_k: int = DEFAULT_TOP_K,
           runs: int = 20, max_share: float = MAX_SHARE,
           timer: Callable[[Callable[[int], Any], int], float] = cuda_timer,
           database: TuningDatabase | None = None, device: Device | None = None, workers: int = 4,
           progress: Callable[[str], None] | None = None) -> SearchReport:
    """Pick the fastest correct candidate.

    ``build(candidate)`` returns ``run(i)``, which launches the candidate's kernel on input
    set ``i`` (mod the caller's number of sets) and returns its output; ``check(output)`` is
    the output's relative error against the torch reference for input set 0.
    """
    if not candidates:
        raise ValueError(f"{signature}: no candidate to search")
    started = time.perf_counter()
    ranked = sorted(candidates, key=lambda c: c.estimate_us)
    survivors = select_survivors(ranked, top_k, max_share)
    if database is not None and device is not None:
        remembered = _from_database(survivors, ranked, database, signature, device)
        if remembered is not None:
            winner, micros = remembered
            return SearchReport(signature, len(ranked), len(ranked), 0, time.perf_counter() - started, winner,
                                micros, ranked.index(winner) + 1, from_database=True)
    say = progress or (lambda _: None)
    say(f"{signature}: compiling {len(survivors)} of {len(ranked)} candidates")
    errors = compile_many([(c.cuda_source(), arch + c.template.arch_features) for c in survivors], workers)
    outcomes = []
    for index, (candidate, error) in enumerate(zip(survivors, errors, strict=True), start=1):
        outcome = Outcome(candidate, failure=f"compile: {error.splitlines()[0]}" if error else "",
                          lasting=NVCC_MISSING not in error)
        if not error:
            _measure(outcome, build, check, timer, runs)
        outcomes.append(outcome)
        say(f"  [{index}/{len(survivors)}] {candidate.template.name} {candidate.params}: "
            + (outcome.failure or f"{outcome.micros:.1f} us"))
    best = min(outcomes, key=lambda o: o.micros)
    if database is not None and device is not None:
        for template in {id(o.candidate.template): o.candidate.template for o in outcomes}.values():
            mine = [o for o in outcomes if o.candidate.template is template]
            fastest = min(mine, key=lambda o: o.micros)
            if math.isinf(fastest.micros):
                if all(o.lasting for o in mine) and _no_winner_recorded(database, template, signature, device):
                    database.store_failure(template, signature, device, _failures(mine))
            else:
                database.store(template, signature, device, fastest.candidate.params, fastest.micros)
    if math.isinf(best.micros):
        raise NoCorrectCandidate(f"{signature}: every measured candidate failed: {_failures(outcomes)}")
    return SearchReport(signature, len(ranked), len(ranked) - len(survivors), len(survivors),
                        time.perf_counter() - started, best.candidate, best.micros,
                        ranked.index(best.candidate) + 1, outcomes=outcomes)


def select_survivors(ranked: Sequence[Candidate], top_k: int, max_share: float = MAX_SHARE) -> list[Candidate]:
    """The candidates stage 2 measures, from ``ranked`` (best estimate first): min(top_k,
    max(MIN_MEASURED, max_share of them)), in estimate order, except that the best-estimated
    candidate of every tile height (``block_m``) gets a place first. Tile height trades waves
    against occupancy, the model's least reliable call: on the H100's MHA grid its top 8 were all
    128-row tiles for the document mask, 8% slower than the best 64-row one (RESULTS.md)."""
    count = min(top_k, len(ranked), max(MIN_MEASURED, int(max_share * len(ranked))))
    heights: dict[Any, Candidate] = {}
    for candidate in ranked:
        heights.setdefault(candidate.params.get("block_m"), candidate)
    chosen = {id(c) for c in list(heights.values())[:count]}
    for candidate in ranked:
        if len(chosen) >= count:
            break
        chosen.add(id(candidate))
    return [c for c in ranked if id(c) in chosen]


def _measure(outcome: Outcome, build, check, timer, runs: int) -> None:
    try:
        run = build(outcome.candidate)
        error = check(run(0))
        if not error < MAX_ERROR:  # NaN fails too
            outcome.failure = f"wrong result: relative error {error:.3g} against the torch reference"
            return
        outcome.micros = timer(run, runs)
    except Exception as exc:  # a launch failure disqualifies this candidate, not the search
        outcome.failure = f"{type(exc).__name__}: {exc}"
        outcome.lasting = not _passing(exc)


def _passing(exc: Exception) -> bool:
    """Whether ``exc`` says more about the run than the candidate: memory (torch's or PyCUDA's MemoryError,
    which another process may hold) or the file system; stage 2 then stores no failure for it."""
    return isinstance(exc, MemoryError | OSError) or type(exc).__name__ in ("OutOfMemoryError", "MemoryError")


def _no_winner_recorded(database: TuningDatabase, template: KernelTemplate, signature: str, device: Device) -> bool:
    """Whether no record of a measured winner would be lost by storing a failure in its place."""
    record = database.lookup(template, signature, device)
    return record is None or record.failed


def _failures(outcomes: list[Outcome]) -> str:
    return "; ".join(f"{o.candidate.template.name} {o.candidate.params}: {o.failure}" for o in outcomes)


def _from_database(survivors: list[Candidate], ranked: list[Candidate], database: TuningDatabase, signature: str,
                   device: Device) -> tuple[Candidate, float] | None:
    """The fastest remembered winner, when every template among the model's survivors (the
    ones stage 2 would measure, and so store) has a record: a winner whose parameters are still
    legal, or a failure; `NoCorrectCandidate` when every one of them failed."""
    best, failed = None, []
    for template in {id(c.template): c.template for c in survivors}.values():
        record = database.lookup(template, signature, device)
        if record is not None and record.failed:
            failed.append(f"{template.name}: {record.why_failed}")
            continue
        match = record and next((c for c in ranked if c.template is template and c.params == record.params), None)
        if match is None:
            return None
        if best is None or record.micros < best[1]:
            best = (match, record.micros)
    if best is None:
        raise NoCorrectCandidate(f"{signature}: every template failed when last measured (tuning database "
                                 f"{database.path}): {'; '.join(failed)}")
    return best
