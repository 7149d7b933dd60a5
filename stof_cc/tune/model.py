"""Tune every generated group of a partitioned model on the GPU (`stof-cc tune`).

For each group a template covers: stage 1 scores every (template, parameter point) with the
template's `estimate`; stage 2 (`search`) measures the top k on the group's real inputs
(computed by the interpreter from the example inputs) and on random copies of them, checks
each against the interpreter's value of the group's output, and stores the winner in the
tuning database. A lone linear is also timed in cuBLAS (`F.linear`), and every GEMM group with an
epilogue is tuned cut in two as well (its linear, its epilogue), so that `choose_scheme` can
keep the library and a generated epilogue where they measure faster (tune/library.py).
Attention groups go through `tune_attention`. Groups no template covers are reported and skipped.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import torch

import stof_cc.templates.builtin  # noqa: F401 (registers the built-in templates before they are chosen)
from stof_cc.backends.group_launch import GroupLaunch
from stof_cc.backends.pycuda_backend import device_arch
from stof_cc.codegen.chain import NotFusable
from stof_cc.ir.graph import Graph
from stof_cc.ir.interpret import interpret_values
from stof_cc.ir.node import Ref, map_refs
from stof_cc.ir.reference import relative_error
from stof_cc.masks import MaskDescription
from stof_cc.passes.attention import added_biases, attention_arguments
from stof_cc.passes.fusion import FusionGroup, FusionPlan
from stof_cc.templates.group import applicable_templates, group_output, group_templates
from stof_cc.templates.pricing import sm_count
from stof_cc.tune.attention import attention_kernel, node_mask
from stof_cc.tune.database import Device, TuningDatabase
from stof_cc.tune.library import LIBRARY_GEMM, is_lone_linear, linear_and_epilogue
from stof_cc.tune.scheme import choose_scheme, split_refused
from stof_cc.tune.search import (
    DEFAULT_TOP_K,
    MAX_ERROR,
    Candidate,
    NoCorrectCandidate,
    SearchReport,
    cuda_timer,
    search,
)
from stof_cc.tune.tune_attention import tune_attention

MIN_INPUT_SETS = 4  # the real inputs, then random copies: no candidate times on inputs left in L2 ...
MAX_INPUT_SETS = 64  # ... by the launch before: as many as twice the L2 takes, within these (`input_set_count`)


class InputSets:
    """Stage 2's input sets: the real inputs (set 0, which the correctness check's launch ``run(0)``
    reads) and random copies, handed out in turn to every other launch, across all the candidates
    that share this object, so that a launch finds its set last used ``len(sets) - 1`` sets ago."""

    def __init__(self, sets: list[Any]) -> None:
        self.sets = sets
        self._turn = itertools.count()

    def __call__(self, launch: int) -> Any:
        return self.sets[0] if launch == 0 else self.sets[next(self._turn) % len(self.sets)]


def input_set_count(set_bytes: int, l2_bytes: int | None = None) -> int:
    """How many input sets stage 2 rotates through (`InputSets`): enough that the sets together hold
    twice the GPU's L2, so each launch finds its operands in DRAM, as a model's layer finds its weights.
    Four sets of a small GEMM's 4 MB stayed in the 50 MB L2, and stage 2 then preferred points
    that lose once the operands come from DRAM (docs/decisions.md#deep-rings)."""
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return min(MAX_INPUT_SETS, max(MIN_INPUT_SETS, -(-2 * l2_bytes // max(set_bytes, 1))))


def group_signature(graph: Graph, group: FusionGroup) -> str:
    """Ops in order with the output's and every outside input's spec (what a person reads in the
    progress lines and `stof-cc cache list`), then a digest of the group's exact structure: every
    op's arguments (slice offsets, `gelu`'s approximation, a permutation, a constant) and which
    input or op each one reads. Without the digest, ``x[:, 1:65]`` and ``x[:, 0:64]``, or
    ``cat([x, y])`` and ``cat([y, x])``, shared one record, and the second group ran a point that
    was never checked against torch for it (found by review)."""
    inside = set(group.nodes)
    reads = sorted({r.name for n in group.nodes for r in graph.node(n).refs() if r.name not in inside})
    ops = "+".join(graph.node(n).op for n in group.nodes)
    inputs = ",".join(str(graph.node(r).spec) for r in reads)
    return (f"{group.kind} {ops} -> {graph.node(group_output(graph, group)).spec} <- {inputs} "
            f"#{_structure_digest(graph, group)}")


def _structure_digest(graph: Graph, group: FusionGroup) -> str:
    """sha256 (12 hex digits) of the group's nodes with every value they read named by its place:
    the n-th op of the group, or the n-th outside input in the order the ops first read them
    (names differ between layers, models and runs; their sorted order does too: mul_10 < mul_9),
    and each such input's spec at its place (``x[M, N] - a[N]`` and ``b[N] - y[M, N]`` list the
    same specs in name order: they shared a record, found by review)."""
    inside = set(group.nodes)
    places = {name: Ref(f"op{i}") for i, name in enumerate(group.nodes)}
    for ref in (r for n in group.nodes for r in graph.node(n).refs()):
        places.setdefault(ref.name, Ref(f"in{len(places) - len(group.nodes)}"))
    text = ";".join(f"{node.op}:{node.target}{map_refs((node.args, node.kwargs), lambda ref: places[ref.name])}"
                    f"{node.spec}"
                    for node in (graph.node(n) for n in group.nodes))
    inputs = ";".join(f"{place.name}:{graph.node(name).spec}" for name, place in places.items() if name not in inside)
    return hashlib.sha256(f"{text}|{inputs}".encode()).hexdigest()[:12]


def measured_times(graph: Graph, database: TuningDatabase, device: Device) -> Callable[[FusionGroup], float | None]:
    """A group's measured best time in ``database`` (the fastest of its templates' records) or
    None: what `choose_scheme` decides merges by once both sides were tuned."""
    def measured(group: FusionGroup) -> float | None:
        templates = [*group_templates(group.kind), *([LIBRARY_GEMM] if is_lone_linear(graph, group) else [])]
        times = [record.micros for template in templates  # a failed template's record is no time
                 if (record := database.lookup(template, group_signature(graph, group), device)) is not None
                 and not record.failed]
        return min(times) if times else None
    return measured


def groups_to_tune(graph: Graph, plan: FusionPlan, capability: tuple[int, int]) -> list[FusionGroup]:
    """Every group a scheme `choose_scheme` may pick can run: both sides of each alternative
    merge, the pieces of the groups no template generates whole, and each GEMM group's linear
    and epilogue apart (where a template generates that epilogue)."""
    groups = list(dict.fromkeys([*plan.default.groups, *(g for _, s in plan.alternatives for g in s.groups)]))
    pieces, _ = split_refused(graph, groups, capability)
    apart = [piece for g in pieces if (parts := linear_and_epilogue(graph, g)) is not None
             and applicable_templates(graph, parts[1], capability)[0] for piece in parts]  # an epilogue generated
    return list(dict.fromkeys([*groups, *pieces, *apart]))


def tune_model(graph: Graph, plan: FusionPlan, example_inputs: tuple[Any, ...],
               example_kwargs: dict[str, Any] | None = None, *, database: TuningDatabase,
               mask: MaskDescription | None = None,
               top_k: int = DEFAULT_TOP_K,
               progress: Callable[[str | SearchReport], None] = print) -> tuple[FusionPlan, list[SearchReport]]:
    """Search every group that has a template, in every scheme the plan offers (both sides of
    each alternative merge); returns the plan with its scheme chosen again by the measured times
    (``plan`` itself is not changed) and one report per tuned group."""
    if not torch.cuda.is_available():
        raise RuntimeError("tuning measures kernels on the GPU, and no CUDA device is visible")
    groups = groups_to_tune(graph, plan, torch.cuda.get_device_capability())
    needed = {r.name for g in groups for n in g.nodes for r in graph.node(n).refs()}
    needed |= {group_output(graph, g) for g in groups if _has_single_output(graph, g)}
    inputs = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in example_inputs)
    kwargs = {k: t.cuda() if isinstance(t, torch.Tensor) else t for k, t in (example_kwargs or {}).items()}
    values = interpret_values(graph, needed, *inputs, **kwargs)
    device = Device.current()
    reports = []
    for group in groups:
        if group.kind == "attention":
            report = _tune_attention_group(graph, group, values, database, top_k, progress, mask)
        else:
            report = tune_group(graph, group, values, database, device, top_k, progress)
            if is_lone_linear(graph, group):
                _time_library(graph, group, values, database, device, progress)
        if report is not None:
            progress(report)  # print shows str(report); compile's progress reads the counts
            reports.append(report)
    plan = choose_scheme(graph, plan, measured=measured_times(graph, database, device))
    for line in plan.choices:
        progress(f"scheme: {line}")
    return plan, reports


def _has_single_output(graph: Graph, group: FusionGroup) -> bool:
    try:
        group_output(graph, group)
    except NotFusable:
        return False
    return True


def tune_group(graph: Graph, group: FusionGroup, values: dict[str, torch.Tensor], database: TuningDatabase | None,
               device: Device, top_k: int = DEFAULT_TOP_K,
               progress: Callable[[str], None] = print) -> SearchReport | None:
    """Stage 1 and 2 over every template point that generates ``group`` (its inputs and output
    in ``values``: the interpreter's), the winner stored in ``database``; None, with a progress
    line, when no template applies."""
    candidates, problems = [], {}
    found, refused = applicable_templates(graph, group, torch.cuda.get_device_capability())
    for why in refused:
        progress(f"{group.name}: {why}")
    for template, problem, space in ((a.template, a.problem, a.space) for a in found):
        for params in space:
            candidate = Candidate(template, params, template.estimate(problem, params, sm_count()),
                                  functools.partial(template.render, problem, params))
            candidates.append(candidate)
            problems[id(candidate)] = problem
    if not candidates:
        progress(f"{group.name} ({group.kind}): no template applies; torch runs it")
        return None
    reference = values[group_output(graph, group)]
    operands = sorted({op.ref for problem in problems.values() for op in problem.operands})
    randomised = [k for k in operands if values[k].is_floating_point()]
    # A group that reads weights (a GEMM) finds them in DRAM in a model's forward: enough sets to
    # keep every launch's operands out of L2. One that reads only activations (a norm, an
    # elementwise chain) reads what the kernel before it just wrote: the minimum, as before.
    weighted = any(k in graph.constants for k in randomised)
    count = input_set_count(sum(values[k].nbytes for k in randomised) + reference.nbytes) if weighted \
        else MIN_INPUT_SETS
    sets = InputSets([values] + [{**values, **{k: torch.randn_like(values[k]) for k in randomised}}
                                 for _ in range(count - 1)])

    def build(candidate: Candidate):
        launch = GroupLaunch(candidate.template, problems[id(candidate)], candidate.params)
        return lambda i: launch(sets(i))

    try:
        return search(candidates, build, lambda out: relative_error(out, reference),
                      signature=group_signature(graph, group), arch=device_arch(), top_k=top_k, database=database,
                      device=device, progress=progress)
    except NoCorrectCandidate as failed:  # recorded: the compiled model runs the group in torch
        progress(f"{group.name}: {failed}; it runs in torch")
        return None


def _time_library(graph, group, values, database, device, progress) -> None:
    """Time the lone linear ``group`` in cuBLAS (`F.linear`, on the real input and random copies,
    as stage 2 times the generated candidates) and record it as `LIBRARY_GEMM`'s; a wrong
    result (never expected) records nothing."""
    signature = group_signature(graph, group)
    if database.lookup(LIBRARY_GEMM, signature, device) is not None:
        return
    node = graph.node(group.anchor)
    given = [values[r.name] if r is not None else None for r in node.args]
    error = relative_error(torch.nn.functional.linear(*given), values[node.name])
    if not error < MAX_ERROR:
        progress(f"{group.name}: the library GEMM is off by {error:.3g} against the reference; not recorded")
        return
    # the real operands, then random copies of every one (weights too), as tune_group rotates the
    # generated candidates' inputs: neither side finds its operands in L2
    count = input_set_count(sum(t.nbytes for t in given if t is not None) + values[node.name].nbytes)
    sets = InputSets([given] + [[None if t is None else torch.randn_like(t) for t in given] for _ in range(count - 1)])
    micros = cuda_timer(lambda i: torch.nn.functional.linear(*sets(i)), runs=20)
    database.store(LIBRARY_GEMM, signature, device, {}, micros)
    progress(f"{group.name}: library GEMM (cuBLAS through F.linear) {micros:.1f} us")


def _tune_attention_group(graph, group, values, database, top_k, progress, override=None) -> SearchReport | None:
    given = attention_arguments(graph.node(group.anchor))
    try:
        attention_kernel(graph, graph.node(group.anchor), mask=override)
    except NotFusable as why:
        progress(f"{group.name}: not tuned ({why})")
        return None
    if added_biases(graph, graph.node(group.anchor)) or (given.get("attn_mask") is not None and override is None):
        progress(f"{group.name}: attention with a mask tensor (a bias, or a boolean mask that is not key padding) "
                 "is not tuned: it runs the cost model's pick")
        return None
    q, k, v = (values[given[name].name] for name in ("query", "key", "value"))
    if q.dtype not in (torch.float16, torch.bfloat16):
        q, k, v = (t.half() for t in (q, k, v))  # stof-cc compiles models to fp16
    mask = node_mask(given, override)  # the same object the compiled step runs with (key padding: data, not tuned)
    try:
        return tune_attention(q, k, v, mask, given.get("scale"), database=database, top_k=top_k, progress=progress,
                              splits=given.get("key_padding") is None)  # as `attention_kernel` and the runtime split
    except NoCorrectCandidate as failed:  # recorded: the compiled model runs the attention in torch
        progress(f"{group.name}: {failed}; it runs in torch")
        return None
