"""The build folder of a partitioned graph: one `.cu` file per fusion group that a template
covers, written to ``<build dir>/<model>/<group>.cu`` and (optionally) compiled by nvcc for the
visible GPU (without one, the H100: sm_90), with a table of every group.

Each group's file holds the kernel a compile would start from: attention groups the cost
model's pick for their anchor (and the rotary kernel of their rotary nodes), other groups the first applicable template
(`applicable_templates`) at its default point. `stof_cc.compile(build_dir=)` writes what its steps run
instead (``running``): a tuned winner, the point that replaced a default that spilled, no file for a
group the library GEMM runs; its attention picks are the adopted ones. Groups no template covers (and
opaque ops) run through torch; the table says so, with the reason. File names are the names made path
components (`ir/paths.py`), checked to stay inside the folder.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import stof_cc.templates.builtin  # noqa: F401 (registers the built-in templates before they are chosen)
from stof_cc.backends.nvcc import Resources, compile_cubin
from stof_cc.backends.rotary_launch import rotary_unsupported
from stof_cc.codegen.chain import NotFusable
from stof_cc.ir.graph import Graph
from stof_cc.ir.paths import blocking_file, path_in
from stof_cc.masks import MaskDescription
from stof_cc.passes.fusion import FusionGroup, FusionPlan
from stof_cc.templates.group import applicable_templates, group_header
from stof_cc.templates.pricing import sm_count, target_capability
from stof_cc.templates.registry import KernelTemplate
from stof_cc.templates.rotary import ROTARY, RotaryProblem
from stof_cc.tune.attention import attention_kernel


@dataclass
class GroupBuild:
    """What became of one group: its template and file, or why torch runs it."""

    group: FusionGroup
    template: str | None
    params: dict[str, Any] | None
    path: Path | None
    note: str
    resources: Resources | None = None
    estimate_us: float | None = None  # stage 1 of the search
    measured_us: float | None = None  # from the tuning database, when it has a record
    refused: tuple[str, ...] = ()  # a group torch runs: every template's reason, the one that matters first


class _NoTemplate(NotFusable):
    """Every group template refused the group (`applicable_templates`' reasons, kept apart)."""

    def __init__(self, refused: list[str]) -> None:
        super().__init__("; ".join(refused))
        self.refused = tuple(refused)


def build_groups(graph: Graph, plan: FusionPlan, out_dir: Path, compile_kernels: bool = True,
                 measured: Callable[[KernelTemplate, FusionGroup], float | None] | None = None,
                 mask: MaskDescription | None = None,
                 running: Mapping[str, tuple[KernelTemplate, Any, dict[str, Any]] | str] | None = None) -> list[GroupBuild]:
    """Write (and compile) the kernel of every group a template covers; one entry per group.
    ``measured(template, group)``, if given, looks up a tuned time (the tuning database); ``mask``
    replaces the attention nodes' own masks, as `stof_cc.compile(mask=)` does; ``running`` names, per
    group name, the kernel a compiled model runs for it (template, problem, params) or why no generated
    kernel runs (a library GEMM: no file), in place of the default point."""
    out_dir.mkdir(parents=True, exist_ok=True)
    builds = []
    for group in plan.scheme.groups:
        runs = (running or {}).get(group.name)
        if isinstance(runs, str):
            builds.append(GroupBuild(group, None, None, None, runs))
            continue
        try:
            template, source, params, note, estimate_us = _generate(graph, group, mask, runs)
        except NotFusable as why:
            refused = why.refused if isinstance(why, _NoTemplate) else (str(why),)
            builds.append(GroupBuild(group, None, None, None, f"torch: {why}", refused=refused))
            continue
        path = path_in(out_dir, f"{group.name}.cu")
        path.write_text(source)
        resources = None
        if compile_kernels:
            major, minor = target_capability()
            compiled = compile_cubin(source, arch=f"sm_{major}{minor}" + template.arch_features, source_path=path)
            resources = next(iter(compiled.resources.values()), None)
        builds.append(GroupBuild(group, template.name, params, path, note, resources, estimate_us,
                                 measured(template, group) if measured else None))
    _remove_stale_sources(out_dir, {b.path for b in builds if b.path is not None})
    return builds


def _remove_stale_sources(out_dir: Path, written: set[Path]) -> None:
    """Remove the group sources (``g<N>.cu``) an earlier build left in ``out_dir`` that this one did
    not write: a reader of the folder took them for this build's kernels (a group that now runs in
    torch, a plan with fewer groups). Other files are the user's and stay."""
    for path in out_dir.glob("g*.cu"):
        if re.fullmatch(r"g\d+\.cu", path.name) and path not in written and path.is_file():
            path.unlink(missing_ok=True)


def check_build_dir(build_dir: object, argument: str) -> None:
    """Refuse up front a ``build_dir`` that can never be a folder (not a path: TypeError; a file,
    or under one: ValueError), naming ``argument``, rather than meet a bare NotADirectoryError
    deep in the first compile (`stof_cc.compile`; the torch.compile backend's first call)."""
    if build_dir is None:
        return
    if not isinstance(build_dir, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a folder path or None, got {type(build_dir).__name__}")
    path = Path(build_dir)
    blocker = blocking_file(path)
    if blocker == path:
        raise ValueError(f"{argument} {path} is a file, not a folder")
    if blocker is not None:
        raise ValueError(f"{argument} {path}: {blocker} is a file, not a folder")


def _rotary_sources(graph: Graph, group: FusionGroup) -> tuple[list[str], list[str]]:
    """The rotary kernels of an attention group's ``rotary`` nodes (one source per distinct
    kernel: q and k usually share it), and a note per node."""
    sources: dict[str, str] = {}
    notes = []
    for name in group.nodes:
        node = graph.node(name)
        if node.op != "rotary":
            continue
        x, table = (graph.node(r.name).spec for r in node.args[:2])
        why = rotary_unsupported(x, table)
        if why is not None:
            notes.append(f"%{name} in torch ({why})")
            continue
        problem = RotaryProblem(*x.shape, x.dtype)
        params = ROTARY.space(problem)[0]
        sources.setdefault(ROTARY.kernel_name(problem, params), ROTARY.render(problem, params))
        notes.append(f"%{name} by {ROTARY.kernel_name(problem, params)}")
    return list(sources.values()), notes


def _generate(graph: Graph, group: FusionGroup, mask: MaskDescription | None,
              runs: tuple[KernelTemplate, Any, dict[str, Any]] | None = None
              ) -> tuple[KernelTemplate, str, dict[str, Any], str, float]:
    if group.kind == "attention":
        template, problem, params, estimate_us, _ = attention_kernel(graph, graph.node(group.anchor), mask)
        header = group_header(graph, group, template.name, params)
        rotary, rotary_notes = _rotary_sources(graph, group)
        views = any(n != group.anchor and graph.node(n).op != "rotary" for n in group.nodes)
        note = "; ".join([*rotary_notes, *(["the other fused ops stay torch views"] if views else [])])
        return template, "\n".join([header, template.render(problem, params), *rotary]), params, note, estimate_us
    if runs is not None:
        template, problem, params = runs
    else:
        found, refused = applicable_templates(graph, group, target_capability())
        if not found:
            raise _NoTemplate(refused)
        template, problem = found[0].template, found[0].problem
        params = template.default_params(problem)
    header = group_header(graph, group, template.name, params)
    return (template, f"{header}\n{template.render(problem, params)}", params, "",
            template.estimate(problem, params, sm_count()))


TABLE_WIDTH = 120  # columns `format_builds` keeps within, where names allow


def format_builds(builds: list[GroupBuild], plan: FusionPlan, why: bool = False) -> str:
    """The partition as a table: group, kind, anchor, template, file and the fused ops (wrapped).
    Under a group torch runs, the reason that matters (with ``why``, every template's reason); under
    an attention group, what its kernel leaves to torch. Then the schemes stage 1 weighed."""
    head = ("group", "kind", "anchor", "template", "file")
    rows = [(b.group.name, b.group.kind, b.group.anchor or "-", b.template or "torch", b.path.name if b.path else "-")
            for b in builds]
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    fused_at = sum(widths) + 2 * len(widths)
    fused_width = max(TABLE_WIDTH - fused_at, 30)

    def cells(row: tuple[str, ...]) -> str:
        return "".join(cell.ljust(width + 2) for cell, width in zip(row, widths, strict=True))

    lines = [cells(head) + "fused ops", cells(tuple("-" * w for w in widths)) + "-" * fused_width]
    hidden = 0
    for b, row in zip(builds, rows, strict=True):
        fused = ", ".join(n for n in b.group.nodes if n != b.group.anchor) or "-"
        first, *more = textwrap.wrap(fused, fused_width, break_long_words=False, break_on_hyphens=False)
        lines += [cells(row) + first, *(" " * fused_at + line for line in more)]
        shown = b.refused if why else b.refused[:1]
        hidden += len(b.refused) - len(shown)
        notes = [("torch: " if i == 0 else " " * 7) + reason for i, reason in enumerate(shown)]
        for note in notes or ([b.note] if b.note else []):
            lines += textwrap.wrap(note, TABLE_WIDTH, initial_indent=" " * 7, subsequent_indent=" " * 16,
                                   break_long_words=False, break_on_hyphens=False)
    if hidden:
        lines.append(f"(--why adds {hidden} more template refusal(s) under the groups torch runs)")
    lines.append(f"scheme: {'chosen' if plan.chosen else 'default'} ({len(plan.scheme.groups)} groups); "
                 f"{len(plan.alternatives)} alternative(s):")
    lines += [f"  {line}" for line in plan.choices or [label for label, _ in plan.alternatives]]
    return "\n".join(lines)
