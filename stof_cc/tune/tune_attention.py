"""Stage 2 of the search for `stof_cc.attention`: measure the cost model's best candidates for
one problem and mask on the GPU, remember the winner, and make later calls run it."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import torch

from stof_cc.backends.attention_launch import launch_plan
from stof_cc.backends.pycuda_backend import device_arch
from stof_cc.ir.reference import masked_attention, relative_error
from stof_cc.masks import MaskDescription
from stof_cc.templates.attention import (
    ATTENTION_TEMPLATES,
    AttentionProblem,
    config_label,
    problem_of,
)
from stof_cc.tune.attention import (
    adopt_choice,
    as_description,
    cached_block_mask,
    choose,
    launched_form,
)
from stof_cc.tune.database import Device, TuningDatabase
from stof_cc.tune.search import DEFAULT_TOP_K, MAX_SHARE, Candidate, SearchReport, search


def attention_candidates(problem: AttentionProblem, description: MaskDescription) -> list[Candidate]:
    """Every candidate the model scored for (problem, mask), with its estimate and source."""
    by_strategy = {t.strategy: t for t in ATTENTION_TEMPLATES}
    out = []
    for est in choose(problem, description, own=True).estimates:
        template = by_strategy[est.params["strategy"]]
        out.append(Candidate(template, est.params, est.micros, functools.partial(template.render, problem, est.params)))
    return out


def attention_signature(problem: AttentionProblem, description: MaskDescription) -> str:
    """The group signature of the tuning key: shapes, dtype and the mask, named by its description
    (shortened) and identified by a digest of its exact 64 x 64 block structure and bits, so
    two dense or user masks of one shape never share a record."""
    coarse = cached_block_mask(description, problem, {"block_m": 64, "block_n": 64}, torch.device("cpu"))
    digest = hashlib.sha256()
    for tensor in (coarse.full_ptr, coarse.full_cols, coarse.part_ptr, coarse.part_cols, coarse.part_bits):
        digest.update(tensor.contiguous().numpy().tobytes())
    name = repr(description)
    name = name if len(name) <= 48 else name[:45] + "..."
    heads = f"H{problem.heads}" + (f"/{problem.kv_heads}" if problem.kv_heads else "")
    strided = f" strided x{problem.residues}" if problem.residues > 1 else ""  # its own kernel variant
    return (f"attention {problem.dtype_name} B{problem.batch} {heads} Sq{problem.seq_q} "
            f"Sk{problem.seq_k} D{problem.head_dim}{strided} {name} #{digest.hexdigest()[:16]}")


def tune_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, scale: float | None = None, *,
                   database: TuningDatabase | None = None, top_k: int = DEFAULT_TOP_K, runs: int = 20,
                   input_sets: int = 4, max_share: float = MAX_SHARE, splits: bool = True,
                   progress: Callable[[str], None] | None = None) -> SearchReport:
    """Measure the model's best kernels (`search.select_survivors`: at most ``top_k`` and
    ``max_share`` of them) for these inputs' sizes and mask (on fresh random inputs of the same
    sizes, rotated over ``input_sets`` copies), check each against the torch reference, and adopt
    the fastest for later `attention` calls with this mask.
    What is measured and adopted is what `attention` launches (`launched_form`): a dilated window's
    strided attentions where the split pays, not the direct kernel no call would run. ``splits``
    False for calls the runtime does not split (a compiled model's, with key padding)."""
    full_mask = as_description(mask)
    problem, description = launched_form(problem_of(q, k, v), full_mask, splits=splits)
    # contiguous: the layout the kernels read without copies, and the one `out` must have
    sets = [tuple(torch.randn(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)) for _ in range(input_sets)]
    outs = [torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(input_sets)]
    batch, heads, seq_q, _ = q.shape
    dense = full_mask.to_dense(seq_q, k.shape[2], batch=batch, heads=heads).to(q.device)
    reference = masked_attention(*sets[0], dense, scale=scale)

    def build(candidate: Candidate) -> Callable[[int], torch.Tensor]:
        block_mask = cached_block_mask(description, problem, candidate.params, q.device)
        plan = launch_plan(*sets[0], problem, candidate.template, candidate.params, block_mask, scale)

        def run(i: int) -> torch.Tensor:
            return plan.launch(*sets[i % input_sets], outs[i % input_sets])
        return run

    report = search(attention_candidates(problem, description), build, lambda out: relative_error(out, reference),
                    signature=attention_signature(problem, description), arch=device_arch(), top_k=top_k, runs=runs,
                    max_share=max_share,
                    database=database, device=Device.current() if database is not None else None,
                    progress=progress)
    adopt_choice(problem, description, report.winner.template, report.winner.params, report.winner_us)
    if progress:
        progress(f"  adopted {config_label(report.winner.params)}")
    return report


def adopt_recorded(problem: AttentionProblem, mask: MaskDescription | None, database: TuningDatabase) -> str | None:
    """Adopt the fastest winner ``database`` holds for (problem, mask) on this GPU, the two as launched
    (`attention_kernel`'s: a dilated window's residues), as `tune_attention` adopts what it measures, so
    that a compile with ``tune=False`` runs what `stof-cc tune` or an earlier compile measured (the cost
    model's pick otherwise: found by review). Returns why the attention must run in torch instead, when
    every template recorded there failed stage 2's check, else None."""
    description = as_description(mask)
    signature = attention_signature(problem, description)
    device = Device.current()
    records = [(template, record) for template in ATTENTION_TEMPLATES
               if (record := database.lookup(template, signature, device)) is not None]
    winners = [(template, record, space) for template, record in records if not record.failed
               and record.params in (space := template.space(problem))]
    if winners:
        template, record, space = min(winners, key=lambda chosen: chosen[1].micros)
        adopt_choice(problem, description, template, space[space.index(record.params)], record.micros)
        return None
    if records and all(record.failed for _, record in records):
        return "; ".join(f"{template.name}: {record.why_failed}" for template, record in records)
    return None
