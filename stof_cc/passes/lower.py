"""`lower`: the one road from a module to a fusion plan.

    module + example inputs -> cast to dtype -> trace -> the passes of `PIPELINE`, in order -> partition

`stof_cc.compile`, every `stof-cc` command and template validation lower through here, so they
all see the same graph for the same model (before, `stof-cc tune` skipped the cast that
`compile` made and could tune other signatures than `compile` looked up). An ``instrument``,
like Hidet's pass instruments, sees the graph after tracing and after each pass: `dump_to`
writes each one to a file.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from stof_cc.ir.frontend import trace
from stof_cc.ir.graph import Graph
from stof_cc.ir.memory import bytes_spanned, spans_meet
from stof_cc.passes.attention import AttentionReport, recognise_attention
from stof_cc.passes.canonicalize import CanonicalizeReport, canonicalize
from stof_cc.passes.fusion import FusionPlan, partition
from stof_cc.passes.gemm_forms import GemmFormsReport, canonical_gemms
from stof_cc.passes.gqa import GqaReport, read_kv_heads_directly
from stof_cc.passes.horizontal import HorizontalReport, merge_parallel_linears
from stof_cc.passes.key_padding import KeyPaddingReport, describe_key_padding
from stof_cc.passes.layout import LayoutReport, simplify_gemm_layouts
from stof_cc.passes.patterns import RULES, recognise_patterns
from stof_cc.passes.rules import RulesReport

Instrument = Callable[[str, Graph], None]  # (stage name, the graph after it)


@dataclass(frozen=True)
class Pass:
    """One stage of `run_passes`: its name (instruments and dump files use it), the `PassReports`
    field holding its report, the function ``(graph, report=...) -> graph`` and what it does,
    in one line (docs/pipeline.md's list is `pipeline_text`)."""

    name: str
    report: str
    run: Callable[..., Graph]
    does: str


PIPELINE: tuple[Pass, ...] = (
    Pass("canonicalize", "canonical", canonicalize,
         "exact in-place ops made out-of-place, constants folded, identities dropped"),
    Pass("canonical_gemms", "gemms", canonical_gemms,
         "addmm, mm(x, t(W)) and x @ W.T -> linear; a linear read through pieces -> one per piece"),
    Pass("recognise_patterns", "patterns", recognise_patterns,
         "the rules of passes/patterns.py: " + ", ".join(rule.name for rule in RULES)),
    Pass("merge_parallel_linears", "horizontal", merge_parallel_linears,
         "linears of one input read through views -> one wider linear"),
    Pass("recognise_attention", "attention", recognise_attention,
         "SDPA and the hand-written chains -> one attention node"),
    Pass("describe_key_padding", "padding", describe_key_padding,
         "masks -> key padding + causal / window + a bias"),
    Pass("read_kv_heads_directly", "gqa", read_kv_heads_directly, "repeat_kv dropped: GQA reads H_kv heads"),
    Pass("simplify_gemm_layouts", "layouts", simplify_gemm_layouts, "layouts moved off GEMM inputs and epilogues"),
)


@dataclass
class PassReports:
    """What each pass did and refused, filled in by `run_passes` (one field per `PIPELINE` pass)."""

    canonical: CanonicalizeReport = field(default_factory=CanonicalizeReport)
    gemms: GemmFormsReport = field(default_factory=GemmFormsReport)
    patterns: RulesReport = field(default_factory=RulesReport)
    horizontal: HorizontalReport = field(default_factory=HorizontalReport)
    attention: AttentionReport = field(default_factory=AttentionReport)
    padding: KeyPaddingReport = field(default_factory=KeyPaddingReport)
    gqa: GqaReport = field(default_factory=GqaReport)
    layouts: LayoutReport = field(default_factory=LayoutReport)

    def __str__(self) -> str:
        return "\n".join(str(getattr(self, p.report)) for p in PIPELINE)


def run_passes(graph: Graph, reports: PassReports | None = None, instrument: Instrument | None = None) -> Graph:
    """Every `PIPELINE` pass in order (each pure: ``graph`` is not modified). A graph whose in-place
    ops canonicalize could not make functional (a write through a view) stops there: a rewrite
    around a mutation could change what its readers see (canonicalize's report says which ops), and
    `partition` keeps its nodes apart, in order."""
    reports = reports if reports is not None else PassReports()
    for stage in PIPELINE:
        graph = stage.run(graph, report=getattr(reports, stage.report))
        if instrument is not None:
            instrument(stage.name, graph)
        if stage.report == "canonical" and reports.canonical.skipped:
            break
    return graph


def pipeline_text() -> str:
    """The passes as docs/pipeline.md lists them (tests/test_docs.py keeps the page equal to it)."""
    width = max(len(p.name) for p in PIPELINE)
    return "\n".join(f"{p.name:<{width}}  {p.does}" for p in PIPELINE)


def lower(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
          dtype: torch.dtype | None = None, mask: object | None = None, name: str | None = None,
          reports: PassReports | None = None, instrument: Instrument | None = None) -> tuple[Graph, FusionPlan]:
    """The verified graph of ``module`` after every pass, and its fusion plan (the default
    scheme and the alternatives; `stof_cc.tune.scheme.choose_scheme` picks among them).

    ``dtype``: the module (cast in place: pass a copy to keep yours) and the floating inputs are
    cast to it first; None keeps them as they are. ``mask``: the ``compile(mask=...)`` that will
    replace the recognised attention nodes' masks; a warning says when it would change nothing.
    ``reports`` collects what the passes did; ``instrument`` sees each stage's graph."""
    if dtype is not None:
        module = convert_weights(module, dtype)
        args, kwargs = cast_floating((tuple(args), dict(kwargs or {})), dtype)
    graph = trace(module, args, kwargs, name=name)
    graph.verify()
    if instrument is not None:
        instrument("trace", graph)
    graph = run_passes(graph, reports, instrument)
    graph.verify()
    if mask is not None:
        _warn_if_mask_applies_nowhere(graph)
    return graph, partition(graph)


def converted_dtypes(module: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """The floating dtypes `convert_weights` converts to ``dtype``: the parameters' others (for a
    model without floating parameters, its buffers')."""
    return sorted(str(d) for d in _model_dtypes(module) if d != dtype)


def convert_weights(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` in ``dtype``, converted in place: its floating parameters, and the floating buffers
    in a dtype the parameters had (converted with them, as ``.to(dtype)`` converts a model); a buffer
    the model keeps in a dtype of its own stays in it. HF builds an fp16 Llama with its rotary
    ``inv_freq`` in fp32 and computes the angles in fp32; converted to fp16 with the weights, the
    angles were off by up to 1.7 rad at 8k positions (found by review)."""
    converted = {d for d in _model_dtypes(module) if d != dtype}
    if not converted:
        return module
    for parameter in module.parameters():  # in place: tied parameters stay one
        if parameter.dtype in converted:
            parameter.data = parameter.data.to(dtype)
    done: dict[int, torch.Tensor] = {}
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.dtype in converted:
                if id(buffer) not in done:  # a buffer two modules share is converted once, and stays shared
                    done[id(buffer)] = buffer.to(dtype)
                submodule._buffers[name] = done[id(buffer)]
    return module


def _model_dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    """The floating dtypes of the model's parameters, or of its buffers where it has none."""
    parameters = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return parameters or {b.dtype for b in module.buffers() if b.is_floating_point()}


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor of a pytree in ``dtype`` (integer and bool tensors untouched). Tensors that
    may overlap stay overlapping: one tensor given twice is cast once, and views whose bytes meet (``y``
    and ``y[:2]``; also q, k and v interleaved in one fused tensor, which the test cannot tell apart)
    become views of one cast of their storage, laid out as given, so a model writing into one argument
    reads the write through the other, as in eager (a review found two copies)."""
    leaves = {id(t): t for t in pytree.tree_leaves(tree)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype}
    if not leaves:  # inputs already in the compile dtype (every call of a model fed so): nothing to rebuild
        return tree
    spans = {i: bytes_spanned(t) for i, t in leaves.items()}
    overlapping = {i for i in leaves for j in leaves if i != j and spans_meet(spans[i], spans[j])}
    whole: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # per storage that overlapping tensors share, its cast
    copies: dict[int, torch.Tensor] = {}

    def cast(t: Any) -> Any:
        if id(t) not in leaves:
            return t
        if id(t) not in copies:
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if id(t) in overlapping:
                if key not in whole:
                    storage = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
                    whole[key] = storage.to(dtype)
                copies[id(t)] = whole[key].as_strided(t.shape, t.stride(), t.storage_offset())
            else:
                copies[id(t)] = t.to(dtype)
        return copies[id(t)]
    return pytree.tree_map(cast, tree)


def dump_to(folder: str | Path) -> Instrument:
    """An instrument writing each stage's graph to ``folder/<n>_<stage>.txt`` (its printed form)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    count = iter(range(1_000_000))

    def dump(stage: str, graph: Graph) -> None:
        (folder / f"{next(count):02d}_{stage}.txt").write_text(f"{graph}\n")
    return dump


def _warn_if_mask_applies_nowhere(graph: Graph) -> None:
    """``compile(mask=...)`` replaces the masks of recognised attention nodes (a float mask, a
    bias, is kept and added under it); warn when a graph has none, or keeps SDPA calls the
    passes could not recognise (they run with their own mask), so a mask that changes nothing
    never passes unnoticed."""
    recognised = [n for n in graph.nodes() if n.op == "attention"]
    left = [n.name for n in graph.nodes() if n.op == "scaled_dot_product_attention"]
    if left:
        warnings.warn(f"stof_cc.compile: mask= does not apply to {', '.join('%' + n for n in left)}: "
                      "attention the passes did not recognise runs with the model's own mask "
                      "(stof-cc inspect --passes says why)", stacklevel=4)
    elif not recognised:
        warnings.warn(f"stof_cc.compile: mask= was given, but graph {graph.name!r} has no attention node: "
                      "the mask changes nothing there (under torch.compile a graph break splits a model into "
                      "graphs: the mask applies to those that hold its attention)", stacklevel=4)
