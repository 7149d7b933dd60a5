"""Templates for fusion groups (everything but attention): the matching contract.

A group template says which group kinds it serves and, through `match`, whether it can
generate one particular group; `match` returns the `GroupProblem` the template renders
from (the group's output, the tensors its kernel reads as `KernelOperand`s, and the
template's own typed ``details``), or raises `NotFusable` naming the node and the reason.
Shapes are static: a group's kernel is generated for the shapes it was traced with.
"""

from __future__ import annotations

import math
import operator
import traceback
import warnings
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch

from stof_cc.codegen import Chain, IndexedChain, NotFusable, NotItsPattern
from stof_cc.codegen import chain as codegen_chain
from stof_cc.codegen import indexed as codegen_indexed
from stof_cc.codegen.indexed import C_TYPES as INDEXED_C_TYPES
from stof_cc.ir.graph import Graph, TensorSpec
from stof_cc.ir.ops import PATTERN_KINDS
from stof_cc.passes.fusion import FusionGroup, is_views
from stof_cc.passes.lower import lower
from stof_cc.templates.pricing import memory_bound_us
from stof_cc.templates.registry import (
    KernelTemplate,
    Launch,
    TemplateRegistrationError,
    registered_templates,
)

C_TYPES = {dtype: INDEXED_C_TYPES[dtype] for dtype in (torch.float16, torch.bfloat16, torch.float32)}
# what a template whose chains compute integers and booleans too (`any_dtype`) reads and writes
ANY_C_TYPES = INDEXED_C_TYPES
MAX_THREADS = 1024  # per CTA
D = TypeVar("D")  # a template's own details
D2 = TypeVar("D2")

# How a kernel indexes an operand: at the output element's flat index (``full``), at its
# column (``row``: a vector over the last dimension), at 0 (``scalar``), or from the tile
# TMA loaded into shared memory (``staged``, gemm_epilogue's residual), or a run of whole columns of a
# wider tensor (``columns``: the elementwise template's pieces of a split along the last dimension).
Access = Literal["full", "row", "scalar", "staged", "gather", "columns"]  # gather: `LOAD_AT(p, i)` at any index


@dataclass(frozen=True)
class KernelOperand:
    """One tensor a group kernel reads: its C parameter name, the IR value the runtime passes
    for it (``ref``), how the kernel indexes it and its C element type."""

    name: str
    ref: str
    access: Access
    ctype: str
    offset: int = 0  # columns: the first column read and the source's row length
    row_stride: int = 0


@dataclass(frozen=True)
class GroupProblem(Generic[D]):
    """One group as a template sees it: its single output value, shape and dtype; the tensors
    its kernel reads, in parameter order (the runtime passes them, then the output); and what
    the template's `match` worked out for its own source (``details``: the template's own
    dataclass, None for a template that needs nothing more)."""

    graph: Graph
    group: FusionGroup
    output: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    operands: tuple[KernelOperand, ...]
    details: D

    def with_operands(self, operands: Iterable[KernelOperand], details: D2 = None) -> GroupProblem[D2]:
        """This problem reading ``operands``, with the template's ``details``."""
        return GroupProblem(self.graph, self.group, self.output, self.shape, self.dtype, tuple(operands), details)


def c_type(dtype: torch.dtype, what: str, any_dtype: bool = False) -> str:
    """The C element type of ``dtype``: fp16, bf16 and fp32, or (``any_dtype``, the templates
    that compute integer and boolean values too) every dtype of `ANY_C_TYPES`."""
    table = ANY_C_TYPES if any_dtype else C_TYPES
    if dtype not in table:
        kinds = "fp16, bf16, fp32, integers and bool" if any_dtype else "fp16, bf16 and fp32"
        raise NotFusable(f"{what}: dtype {dtype} (generated kernels read and write {kinds})")
    return table[dtype]


def group_output(graph: Graph, group: FusionGroup) -> str:
    """The one value the group hands on (read outside it, or returned by the graph)."""
    inside = set(group.nodes)
    leaving = [n for n in group.nodes
               if graph.is_output(n) or any(u.name not in inside for u in graph.users(n))]
    if len(leaving) != 1:
        raise NotFusable(f"group {group.name} hands on {len(leaving)} values ({', '.join(leaving) or 'none'}); "
                         "the generated kernels write exactly one")
    return leaving[0]


def output_problem(graph: Graph, group: FusionGroup, any_dtype: bool = False) -> GroupProblem[None]:
    """The group's output as a problem that reads nothing yet (`GroupProblem.with_operands`
    adds the kernel's operands and the template's details)."""
    output = group_output(graph, group)
    spec = graph.node(output).spec
    if not isinstance(spec, TensorSpec):
        shown = ", ".join(map(str, spec)) if isinstance(spec, tuple) else str(spec)
        raise NotFusable(f"%{output}: the group's output is not one tensor ({shown}); a kernel writes one")
    c_type(spec.dtype, f"%{output}", any_dtype)
    return GroupProblem(graph, group, output, tuple(spec.shape), spec.dtype, (), None)


class GroupTemplate(KernelTemplate[GroupProblem[D]], Generic[D]):
    """A template for fusion groups of the kinds in ``kinds``; ``D`` is the type of its
    problems' ``details``. Its source receives `common_context`'s values (``name``, ``header``,
    ``operands``, ``out_type`` and the point's parameters) and those of its `context`."""

    kinds: tuple[str, ...]
    renders_with = (codegen_chain, codegen_indexed)  # every chain of a group kernel is written there
    any_dtype = False  # reads and writes integer and boolean tensors too (its chains are `IndexedChain`s)

    @abstractmethod
    def match(self, graph: Graph, group: FusionGroup) -> GroupProblem[D]:
        """The problem to render for ``group``, or NotFusable with the reason."""

    @abstractmethod
    def example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        """A small module and inputs with a group this template generates: registration checks
        the spec on it, and it documents what the template is for."""

    def common_context(self, problem: GroupProblem[D], params: dict[str, Any]) -> dict[str, Any]:
        """The kernel's ``name``, the ``header`` comment, the ``operands`` it reads (for
        group_common.j2's ``parameters`` macro), the output's C type ``out_type`` and the point's
        parameters under their own names."""
        return {**super().common_context(problem, params), "header": self.header(problem, params),
                "operands": problem.operands,
                "out_type": c_type(problem.dtype, f"%{problem.output}", self.any_dtype)}

    def validate(self) -> None:
        """The spec matches a group of its example, has parameters there, renders, and gives a
        launch geometry."""
        kinds = getattr(self, "kinds", None)
        if not isinstance(kinds, tuple | list) or not kinds or any(kind not in PATTERN_KINDS for kind in kinds):
            raise TemplateRegistrationError(f"template {self.name!r}: kinds must be a tuple of group kinds, some of "
                                            f"{', '.join(PATTERN_KINDS)}; got {kinds!r}")
        module, inputs = self.example()
        graph, plan = lower(module, inputs)
        reasons = []
        for group in plan.default.groups:
            if group.kind not in self.kinds:
                continue
            try:
                problem = self.match(graph, group)
            except NotFusable as why:
                reasons.append(str(why))
                continue
            except Exception as exc:
                raise TemplateRegistrationError(f"template {self.name!r}: match() failed on group {group.name} of "
                                                f"its example: {type(exc).__name__}: {exc}") from exc
            space = self.space(problem)
            if not space:
                raise TemplateRegistrationError(f"template {self.name!r}: its parameter space is empty for "
                                                f"group {group.name} of its example")
            default = self.default_params(problem)
            if default not in space:  # the point a group runs untuned
                raise TemplateRegistrationError(f"template {self.name!r}: default_params() gives {default}, which "
                                                f"is not a point of its space() for group {group.name} of its example")
            for params in space:  # every point stage 2 may measure and a step may run
                self._check_point(problem, params)
            return
        raise TemplateRegistrationError(f"template {self.name!r} matches no {'/'.join(self.kinds)} group of its "
                                        f"example" + (f" ({'; '.join(reasons)})" if reasons else ""))

    def _check_point(self, problem: GroupProblem[D], params: dict[str, Any]) -> None:
        """``params`` is a dict of plain numbers, strings and bools (what the tuning database stores
        and reads back equal: a tuple comes back a list and never matches again, a numpy int does not
        store at all), renders a source defining the kernel and gives a launch the driver accepts."""
        odd = {name: type(value).__name__ for name, value in params.items()
               if type(value) not in (int, float, str, bool) and value is not None} if isinstance(params, dict) else {}
        if not isinstance(params, dict) or odd:
            raise TemplateRegistrationError(
                f"template {self.name!r}: a point of space() must be a dict of int, float, str or bool values "
                f"(the tuning database stores them as JSON); got {params!r}"
                + (f" ({', '.join(f'{n}: {t}' for n, t in odd.items())})" if odd else ""))
        try:
            context = self.context(problem, params)
            source = self.render(problem, params)
        except Exception as exc:
            raise TemplateRegistrationError(f"template {self.name!r} does not render for {params}{_render_place(exc)}: "
                                            f"{type(exc).__name__}: {exc}") from exc
        unfilled = [key for key, value in context.items() if value is Ellipsis]
        if unfilled:  # a placeholder copied from the walkthrough renders as "Ellipsis" (found by a newcomer)
            raise TemplateRegistrationError(f"template {self.name!r}: context() gives ... for {', '.join(unfilled)}: "
                                            "fill in a value")
        if f"{self.kernel_name(problem, params)}(" not in source:
            raise TemplateRegistrationError(f"template {self.name!r}: the rendered source does not define "
                                            f"{self.kernel_name(problem, params)}")
        _check_launch(self, self.launch(problem, params), params)

    def header(self, problem: GroupProblem[D], params: dict[str, Any]) -> str:
        """The comment opening the kernel source: template, parameters and the operators, but no
        node or group names, so that identical layers render one source (one nvcc run, one
        module; the file in the build folder adds the group's nodes, `group_header`)."""
        ops = ", ".join(problem.graph.node(n).op for n in problem.group.nodes)
        return f"// stof-cc {self.name} kernel ({problem.group.kind}: {ops})\n{_parameters_line(params)}"

    def estimate(self, problem: GroupProblem[D], params: dict[str, Any], sm_count: int) -> float:
        """Stage 1's microseconds for this point without running it. The default, for templates
        whose author gives none: every tensor read and the output written once at HBM speed."""
        return memory_bound_us(moved_bytes(problem))

    def aligned_operands(self, problem: GroupProblem[D], params: dict[str, Any]) -> list[str]:
        """Values the kernel reads with 16-byte accesses: their tensors must be 16-byte aligned."""
        return []

    def tensor_maps(self, problem: GroupProblem[D], params: dict[str, Any]) -> list[tuple[int, int, int]]:
        """TMA tensor maps the kernel takes first, by value: (operand index, box rows, box
        columns) each, index `OUTPUT_MAP` for the output; the launcher encodes them from the
        tensors (`tensor_map`)."""
        return []

    def default_params(self, problem: GroupProblem[D]) -> dict[str, Any]:
        """The point used where nothing was measured (no tuning record, no search): the
        space's last (widest)."""
        return self.space(problem)[-1]


def _check_launch(template: GroupTemplate, launch: Launch, params: dict[str, Any]) -> None:
    """A launch geometry the driver accepts: three positive grid sizes, 1 to MAX_THREADS threads,
    non-negative shared bytes."""
    try:
        (x, y, z), threads, shared = launch
        x, y, z, threads, shared = map(operator.index, (x, y, z, threads, shared))
        well_formed = min(x, y, z) > 0 and 0 < threads <= MAX_THREADS and shared >= 0
    except (TypeError, ValueError):
        well_formed = False
    if not well_formed:
        raise TemplateRegistrationError(f"template {template.name!r}: launch() gives {launch!r} for {params}; "
                                        f"expected ((x, y, z) CTAs, 1 to {MAX_THREADS} threads, shared bytes >= 0)")


OUTPUT_MAP = -1  # `tensor_maps` index of the group's output tensor
MIRROR_MAP = -2  # `tensor_maps` index of a peer GPU's copy of the output (gemm_epilogue's `mirrored`)


def kernel_operand(graph: Graph, ref: str, name: str, access: Access, any_dtype: bool = False,
                   offset: int = 0, row_stride: int = 0) -> KernelOperand:
    """The operand reading IR value ``ref`` as C parameter ``name``; its C type from the value's dtype."""
    spec = graph.node(ref).spec
    if not isinstance(spec, TensorSpec):
        raise NotFusable(f"%{ref}: not a tensor ({spec})")
    return KernelOperand(name, ref, access, c_type(spec.dtype, f"%{ref}", any_dtype), offset, row_stride)


def _render_place(exc: BaseException) -> str:
    """" at FILE:LINE" of the template line that raised (Jinja puts the template's own frames in the
    traceback; its UndefinedError names no line itself), or ""."""
    frames = [(frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(exc.__traceback__)
              if frame.f_code.co_filename.endswith(".j2")]
    return f" at {frames[-1][0]}:{frames[-1][1]}" if frames else ""


def outside_operand(graph: Graph, group: FusionGroup, name: str, role: str, access: str) -> KernelOperand:
    """A kernel operand read from memory (a norm's weight, say), refused where the group computes
    it itself: the kernel never writes it, and the launch then found nothing to read (found by review)."""
    if name in group.nodes:
        raise NotFusable(f"group {group.name}: its {role} %{name} is computed inside the group")
    return kernel_operand(graph, name, role, access)


def chain_operands(graph: Graph, group: FusionGroup, chain: Chain | IndexedChain,
                   any_dtype: bool = False) -> list[KernelOperand]:
    """The kernel operands of a chain; a value the group computes itself cannot be one (the
    kernel never writes it to memory)."""
    inside = [op.ref.name for op in chain.operands if op.ref.name in group.nodes]
    if inside:
        raise NotFusable(f"group {group.name}: %{inside[0]} is computed inside the group and read again")
    return [kernel_operand(graph, op.ref.name, op.name, op.access, any_dtype, op.offset, op.row_stride)
            for op in chain.operands]


@dataclass(frozen=True)
class AnchorInput:
    """How an anchored group's kernel reads its anchor's input: through the prologue chain of the
    group's nodes before the anchor (None: the input itself, read as ``x_in``), the operands that
    reads, and the group's nodes after the anchor."""

    prologue: Chain | IndexedChain | None
    operands: list[KernelOperand]
    after: tuple[str, ...]

    def code(self, indent: str) -> str:
        return self.prologue.code(indent) if self.prologue is not None else ""

    @property
    def expression(self) -> str:
        """The C expression of the anchor's input element."""
        return self.prologue.result if self.prologue is not None else "LOAD_FULL(x_in)"


def anchor_input(graph: Graph, group: FusionGroup, source: str, shape: tuple[int, ...],
                 indexed: bool = False) -> AnchorInput:
    """The group's nodes before its anchor as the prologue computing the anchor's input
    ``source`` (it must end there), or ``source`` read directly when there are none. With
    ``indexed`` a prologue the vectorised chain refuses (a layout op, a broadcast of another
    shape) is an `IndexedChain` over the flat index ``idx`` (the template's scalar points)."""
    anchor = group.anchor
    position = group.nodes.index(anchor)
    before, after = group.nodes[:position], tuple(group.nodes[position + 1:])
    if not before:
        return AnchorInput(None, [kernel_operand(graph, source, "x_in", "full")], after)
    if source != before[-1]:
        raise NotFusable(f"%{anchor}: its input %{source} is not the end of the group's prologue")
    try:
        prologue: Chain | IndexedChain = Chain(graph, before, {}, shape, operand_prefix="in")
    except NotFusable:
        if not indexed:
            raise
        prologue = IndexedChain(graph, before, shape, index="idx", operand_prefix="in")
    return AnchorInput(prologue, chain_operands(graph, group, prologue), after)


def moved_bytes(problem: GroupProblem[Any]) -> int:
    """Bytes a group kernel reads (each operand once; of a ``columns`` operand, its columns) and writes
    (its output)."""
    graph = problem.graph
    read = sum((math.prod(problem.shape) if op.access == "columns" else math.prod(graph.node(op.ref).spec.shape))
               * graph.node(op.ref).spec.dtype.itemsize for op in problem.operands)
    return read + math.prod(problem.shape) * problem.dtype.itemsize


def group_header(graph: Graph, group: FusionGroup, template: str, params: dict[str, Any]) -> str:
    """The comment that opens every generated file in the build folder: which group, which IR
    nodes, which parameters (the kernel source after it is shared by identical groups)."""
    lines = [f"// stof-cc fusion group {group.name} ({group.kind}) -> {template}", _parameters_line(params),
             "// IR nodes implemented:"]
    lines += [f"//   {graph.node(n)}" for n in group.nodes]
    return "\n".join(lines)


def _parameters_line(params: dict[str, Any]) -> str:
    return f"// parameters: {', '.join(f'{k}={v}' for k, v in sorted(params.items()))}"


@dataclass(frozen=True)
class Applicable:
    """A template that can generate a group on the target GPU, with its problem and points."""

    template: GroupTemplate[Any]
    problem: GroupProblem[Any]
    space: tuple[dict[str, Any], ...]


_warned_raises: set[str] = set()  # `applicable_templates`' warnings already given


def applicable_templates(graph: Graph, group: FusionGroup,
                         capability: tuple[int, int]) -> tuple[list[Applicable], list[str]]:
    """The templates that generate ``group`` for a GPU of ``capability`` (`group_templates`' order:
    the first is the default choice), and why each other one does not: the reasons that matter
    first, those of templates written for another pattern (`NotItsPattern`) last. The one place a
    group template is chosen: compile, stage 1 and 2 of the search and the build folder all ask here."""
    if is_views(graph, group):
        return [], ["views only: torch makes them without a kernel or a copy"]
    templates = group_templates(group.kind)
    if not templates:
        return [], [f"no template serves {group.kind} groups"]
    found, refused, not_its_pattern = [], [], []
    for template in templates:
        try:
            problem = template.match(graph, group)
            space = template.space(problem)
        except NotFusable as why:
            (not_its_pattern if isinstance(why, NotItsPattern) else refused).append(f"{template.name}: {why}")
            continue
        except Exception as exc:  # a template's bug on a group unlike its example: the others (or torch) take it
            why = f"{template.name}: match() or space() raised {type(exc).__name__}: {exc}"
            if why not in _warned_raises:  # once per process: compile, the scheme and the search all ask here
                _warned_raises.add(why)
                warnings.warn(f"stof-cc: template {template.name!r}: match() or space() raised {type(exc).__name__} "
                              f"({exc}) on a group unlike its example; it is skipped where it does, and another "
                              "template or torch runs those groups", stacklevel=2)
            refused.append(why)
            continue
        if not template.runs_on(capability):
            refused.append(f"{template.name}: not for compute capability {capability[0]}.{capability[1]}")
            continue
        if not space:
            refused.append(f"{template.name}: no parameter point fits this group")
            continue
        found.append(Applicable(template, problem, tuple(space)))
    return found, refused + not_its_pattern


def group_templates(kind: str) -> list[GroupTemplate]:
    """Registered group templates serving ``kind``: users' in registration order, then the built-ins
    in `builtin.BUILTIN_TEMPLATES`' order (registered by importing `stof_cc.templates.builtin`)."""
    serving = [t for t in registered_templates() if isinstance(t, GroupTemplate) and kind in t.kinds]
    # a user's template first: registering one for a pattern says it should serve it (the
    # built-in elementwise template now takes nearly any chain, a user's swiglu_split included)
    return sorted(serving, key=lambda t: type(t).__module__.startswith("stof_cc.templates."))
