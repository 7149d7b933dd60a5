"""Code generation for a partitioned graph: one `.cu` file per fusion group that a template
covers, written to ``<build dir>/<model>/<group>.cu`` and (optionally) compiled by nvcc.

Which template runs a group, and with which parameters, is decided here until the search
(issue 6) measures: attention groups take the cost model's pick for their anchor,
elementwise and reduction groups the first group template that matches, at its default
point. GEMM groups have no template yet and, like opaque ops and groups no template
matches, run through torch; the table says so, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stof_cc.backends.nvcc import Resources, compile_cubin
from stof_cc.codegen.chain import NotFusable
from stof_cc.ir.graph import Graph, Node
from stof_cc.masks import causal, key_padding
from stof_cc.passes.attention import attention_arguments
from stof_cc.passes.fusion import FusionGroup, FusionPlan
from stof_cc.runtime.attention import explain_attention
from stof_cc.templates.attention import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, AttentionProblem
from stof_cc.templates.group import group_header, group_templates
from stof_cc.templates.registry import KernelTemplate

H100_SM_COUNT = 132  # estimates in the build report: the GPU the constants describe


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


def attention_kernel(graph: Graph, node: Node,
                     ignore_mask: bool = False) -> tuple[KernelTemplate, AttentionProblem, dict[str, Any], float]:
    """The attention template, problem, parameters and estimate the cost model picks for an SDPA
    or recognised attention node (its own mask: causal, none, or key padding, which is known
    only per call and is chosen for here as if no key were padded); NotFusable with the reason.
    An fp32 node gets the fp16 kernel: stof-cc compiles models to fp16 (or bf16)."""
    given = attention_arguments(node)
    q, k = (graph.node(given[name].name).spec for name in ("query", "key"))
    if given.get("attn_mask") is not None and not ignore_mask:  # (ignored: `compile(mask=)` replaces it)
        raise NotFusable(f"%{node.name}: a mask tensor that is not key padding is known only at run time "
                         "(pass mask= to stof_cc.compile)")
    if len(q.shape) != 4 or q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise NotFusable(f"%{node.name}: attention on {q} has no stof-cc kernel (4-d, head_dim {SUPPORTED_HEAD_DIMS})")
    dtype = q.dtype if q.dtype in SUPPORTED_DTYPES else torch.float16
    b, h, s_q, d = q.shape
    mask = causal() if given.get("is_causal") else None
    if given.get("key_padding") is not None:  # known per call: chosen here for unpadded keys
        mask = key_padding([k.shape[2]] * b) & mask if mask is not None else key_padding([k.shape[2]] * b)
    choice = explain_attention(b, h, s_q, k.shape[2], d, mask, dtype=dtype)
    return (choice.template, AttentionProblem(b, h, s_q, k.shape[2], d, dtype), choice.params,
            choice.estimates[0].micros)


def build_groups(graph: Graph, plan: FusionPlan, out_dir: Path, compile_kernels: bool = True,
                 measured: Callable[[KernelTemplate, FusionGroup], float | None] | None = None) -> list[GroupBuild]:
    """Write (and compile) the kernel of every group a template covers; one entry per group.
    ``measured(template, group)``, if given, looks up a tuned time (the tuning database)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    builds = []
    for group in plan.scheme.groups:
        try:
            template, source, params, note, estimate_us = _generate(graph, group)
        except NotFusable as why:
            builds.append(GroupBuild(group, None, None, None, f"torch: {why}"))
            continue
        path = out_dir / f"{group.name}.cu"
        path.write_text(source)
        resources = None
        if compile_kernels:
            compiled = compile_cubin(source, arch="sm_90" + template.arch_features, source_path=path)
            resources = next(iter(compiled.resources.values()), None)
        builds.append(GroupBuild(group, template.name, params, path, note, resources, estimate_us,
                                 measured(template, group) if measured else None))
    return builds


def _generate(graph: Graph, group: FusionGroup) -> tuple[KernelTemplate, str, dict[str, Any], str, float]:
    if group.kind == "attention":
        template, problem, params, estimate_us = attention_kernel(graph, graph.node(group.anchor))
        header = group_header(graph, group, template.name, params)
        others = [n for n in group.nodes if n != group.anchor]
        note = "anchor only; " + (f"{', '.join(others)} stay torch views" if others else "nothing else")
        return template, f"{header}\n{template.render(problem, params)}", params, note, estimate_us
    templates = group_templates(group.kind)
    if not templates:
        raise NotFusable(f"no template serves {group.kind} groups")
    reasons = []
    for template in templates:
        try:
            problem = template.match(graph, group)
        except NotFusable as why:
            reasons.append(f"{template.name}: {why}")
            continue
        params = template.default_params(problem)
        header = group_header(graph, group, template.name, params)
        return (template, f"{header}\n{template.render(problem, params)}", params, "fused",
                template.estimate(problem, params, H100_SM_COUNT))
    raise NotFusable("; ".join(reasons))


def format_builds(builds: list[GroupBuild], plan: FusionPlan) -> str:
    """The partition as a table: group, kind, anchor, fused ops, template, file or reason."""
    rows = [("group", "kind", "anchor", "fused ops", "template", "file / note")]
    for b in builds:
        fused = ", ".join(n for n in b.group.nodes if n != b.group.anchor) or "-"
        where = f"{b.path} ({b.note})" if b.path else b.note
        rows.append((b.group.name, b.group.kind, b.group.anchor or "-", fused, b.template or "torch", where))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:5], widths, strict=True)) + "  " + r[5] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 11)
    lines.append(f"scheme: {'chosen' if plan.chosen else 'default'} ({len(plan.scheme.groups)} groups); "
                 f"{len(plan.alternatives)} alternative(s):")
    lines += [f"  {line}" for line in plan.choices or [label for label, _ in plan.alternatives]]
    return "\n".join(lines)
