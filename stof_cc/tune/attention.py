"""Stage 1 of the search for masked attention: which template point runs a problem and mask.

`choose` scores every candidate with the analytical model (`cost_model.estimate`) on the
`BlockMask` at the candidate's own block shape and caches the pick per mask description;
`adopt_choice` replaces it with a measured winner (stage 2, `tune_attention`); what the
runtime built on the old pick is dropped through the listeners registered with
`on_adopt`. `attention_kernel` makes the same choice for an attention node of the IR.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from stof_cc.codegen import NotFusable
from stof_cc.ir.graph import Graph, Node
from stof_cc.masks import MaskDescription, causal, from_dense, full, sliding_window
from stof_cc.masks.block_mask import BlockMask, coarse_counts
from stof_cc.masks.geometry import FULL, PARTIAL
from stof_cc.masks.row_origins import document_row_origins, key_blocks, window_keys
from stof_cc.passes.attention import added_biases, attention_arguments, is_bias
from stof_cc.templates.attention import (
    ATTENTION_TEMPLATES,
    GRID_YZ_LIMIT,
    SMALLEST_SCALE,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    WGMMA_WS,
    AttentionInputError,
    AttentionProblem,
    config_label,
    takes_scale,
    validated_problem,
)
from stof_cc.templates.pricing import sm_count, target_capability
from stof_cc.templates.registry import KernelTemplate
from stof_cc.tune.cost_model import Estimate, estimate, stof_rule


@dataclass(frozen=True)
class AttentionChoice:
    """The selected template and parameters, with every candidate's estimate (best first)."""

    template: KernelTemplate
    params: dict[str, Any]
    estimates: tuple[Estimate, ...]
    stof_rule: tuple[float, float, str]
    measured_us: float | None = None  # set when stage 2 of the search picked it
    document_tiles: int | None = None  # the pick's tiles per (batch, head) where they start at documents (row_origins)
    key_walks: int = 0  # of those, the tiles that walk their one document's keys from its start (document_keys)
    strided: tuple[int, str] | None = None  # (d, each residue's mask) where the mask runs as d strided attentions
    own_pick: dict[str, Any] | None = None  # where the pick is its kind's (`choice_group`): this mask's own pick

    def explain(self) -> str:
        """The pick (and its document tiles), STOF's rule beside it (and, where they differ, the
        two estimates), then every candidate."""
        how = (f"measured {self.measured_us:.1f} us (stage 2 of the search)" if self.measured_us is not None
               else "the cost model's first choice")
        lines = [f"chosen: {self.template.name} {config_label(self.params)}, {how}"]
        if self.own_pick is not None:
            lines.append(f"  the pick of an earlier mask of the same kind, which masks of one kind share so that masks built "
                         f"per call are not priced again (docs/decisions.md#one-kernel-choice-per-kind-of-per-call-mask); "
                         f"this mask's own pricing, below, picks {config_label(self.own_pick)}")
        if self.strided is not None:
            d, residue_mask = self.strided
            lines.append(f"  the mask runs as {d} strided attentions in one launch (positions r, r + {d}, ...; each "
                         f"residue's mask {residue_mask}), priced and measured as such "
                         "(docs/decisions.md#dilated-windows-as-strided-windows)")
        if self.document_tiles is not None:
            lines.append(f"  its {self.document_tiles} tiles per (batch, head) are laid out from the documents' starts, "
                         "a document's last overlapping the one before (docs/decisions.md#document-tiles)")
        if self.key_walks:
            lines.append(f"  {self.key_walks} of them lie in one document and walk its keys in blocks from its start "
                         "(docs/decisions.md#document-key-walks)")
        lines += [self._against_stof_rule(), "candidates (best first):"]
        lines += [f"  {e.describe()}" for e in self.estimates]
        return "\n".join(lines)

    def _against_stof_rule(self) -> str:
        rho, tau, suggested = self.stof_rule
        rule = (f"STOF's density rule suggests {suggested} (rho={rho:.4f}, the share of 16 x 16 blocks with an allowed "
                f"element, {'>=' if rho >= tau else '<'} tau={tau:.4f})")
        strategy = self.params["strategy"]
        if strategy == suggested:
            return f"{rule}: the chosen strategy too"
        ours = next((e.micros for e in self.estimates if e.params == self.params), float("nan"))
        theirs = next((e for e in self.estimates if e.params["strategy"] == suggested), None)
        who = "the cost model" if self.measured_us is None else "stage 2 of the search"
        why = (f"estimated {ours:.1f} us against {theirs.micros:.1f} us for the best {suggested} point "
               f"({config_label(theirs.params)})" if theirs else f"no {suggested} point runs this problem")
        return f"{rule}; {who} picks {strategy} instead:\n  {why}"


# mask description -> {(seq_q, seq_k, bm, bn, batch, heads, device): BlockMask}
_block_masks: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, BlockMask]] = weakref.WeakKeyDictionary()
_choices: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, AttentionChoice]] = weakref.WeakKeyDictionary()
# a mask's own pick where its group's runs (`choose(own=True)`): never read by the runtime
_own_choices: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, AttentionChoice]] = weakref.WeakKeyDictionary()
_group_choices: collections.OrderedDict[tuple, AttentionChoice] = collections.OrderedDict()  # (choice group, key)
GROUP_CHOICES_KEPT = 256
_adopt_listeners: list[Callable[[MaskDescription], None]] = []


def as_description(mask: MaskDescription | torch.Tensor | None) -> MaskDescription:
    if mask is None:
        return _FULL
    if isinstance(mask, MaskDescription):
        return mask
    if isinstance(mask, torch.Tensor):
        return from_dense(mask)
    hint = ""
    if isinstance(mask, str):
        hint = f" (a spec: masks.parse_spec({mask!r}))"
    elif callable(mask) and getattr(mask, "__module__", "").startswith("stof_cc.masks"):
        hint = f" (call it: masks.{mask.__name__}(...))"
    elif callable(mask):
        hint = " (a FlexAttention-style mask_mod: masks.from_mask_mod(fn))"
    raise AttentionInputError(f"mask must be a stof_cc.masks description, a bool tensor or None; "
                              f"got {type(mask).__name__}{hint}")


_FULL = full()
FINE_BLOCK = 16  # the class grid the cost model counts every candidate's blocks on


def candidates(problem: AttentionProblem,
               capability: tuple[int, int] | None = None) -> list[tuple[KernelTemplate, dict[str, Any]]]:
    """Every (template, params) that can run ``problem`` on a GPU of ``capability`` (default:
    the current device's, or the H100's (9, 0) on a machine without one)."""
    capability = capability or target_capability()
    return [(t, p) for t in ATTENTION_TEMPLATES if t.runs_on(capability) for p in t.space(problem)]


def choose(problem: AttentionProblem, description: MaskDescription, *, own: bool = False) -> AttentionChoice:
    """The pick `attention` runs for this problem and mask (cached with the mask): the mask's own, or,
    for a mask of a `choice_group` another mask of which was priced first, that group's pick, which
    carries the estimates of the mask it was priced on. ``own`` asks for the mask's own pricing
    (`explain_attention`, the tuner): kept apart where the group's pick runs, so that asking changes
    nothing that runs (it did: found by review)."""
    key = (problem, sm_count())
    per_mask = _choices.setdefault(description, {})
    if key in per_mask:  # its own pick, or a measured winner adopted for it
        return per_mask[key]
    group = description.choice_group()
    shared = None if group is None else (group, key)
    group_choice = None if shared is None else _group_choices.get(shared)
    if group_choice is not None:
        if not own:  # a mask of the same kind chose already
            with contextlib.suppress(KeyError):  # another thread may have evicted it since
                _group_choices.move_to_end(shared)
            return group_choice
        apart = _own_choices.setdefault(description, {})
        if key not in apart:
            apart[key] = _scored_choice(problem, description)
        return apart[key]
    per_mask[key] = _scored_choice(problem, description)
    if shared is not None and shared not in _group_choices:
        _group_choices[shared] = per_mask[key]
        while len(_group_choices) > GROUP_CHOICES_KEPT:
            _group_choices.popitem(last=False)
    return per_mask[key]


def _scored_choice(problem: AttentionProblem, description: MaskDescription) -> AttentionChoice:
    """The cost model's pick for this problem and mask, every candidate scored."""
    scored = []
    options = candidates(problem)
    if not options:
        raise AttentionInputError(f"no attention kernel runs {problem} on compute capability "
                                  f"{target_capability()} (the templates need sm_80 or newer, a batch of at "
                                  f"most {GRID_YZ_LIMIT} and at most {GRID_YZ_LIMIT} block rows)")
    # One 16 x 16 classification prices every candidate shape (`coarse_counts`): the mask is
    # evaluated once, not once per shape (a user mask at S = 32768 took 7 s the other way), and
    # no block mask is built for it (its CSR arrays and recounted classes were 60% of a first
    # pick at S = 32768 on the H100). It is held as runs per block row, so its memory follows
    # the runs (O(S) for causal), not the (S / 16)^2 blocks (4 GiB at S = 1M).
    fine = description.block_runs(problem.seq_q, problem.seq_k, FINE_BLOCK, FINE_BLOCK,
                                  batch=problem.batch, heads=problem.heads)
    slices = fine.batch * fine.heads
    heads_batches = problem.batch * problem.heads // slices
    shapes = sorted({(params["block_m"], params["block_n"]) for _, params in options})
    counts = {shape: (rows.tolist(), partial) for shape, (rows, partial) in
              coarse_counts(fine, FINE_BLOCK, FINE_BLOCK, problem.seq_q, problem.seq_k, shapes).items()}
    for template, params in options:
        row_blocks, partial = counts[(params["block_m"], params["block_n"])]
        # A point whose CTAs take tiles in turn (per-call row windows) is priced as its one-CTA-per-tile
        # twin, which counts the same blocks, and ranked before it: on an H200 (S = 32768, d = 64 and 128,
        # 8-64 documents) it was 1.02-1.23x its twin once its consumers' wgmma descriptors stayed in
        # uniform registers (history/38; 0.89-1.12x before, history/37).
        in_turn = template.takes_tiles_in_turn(problem, params)
        origins = row_origins(description, problem, params)
        if origins is not None:  # tiles that start where documents start: their own blocks
            row_blocks, partial = _window_counts(description, problem, params, origins)
        priced = _priced(template, problem, params | {"persistent": False} if in_turn else params, params,
                         heads_batches, row_blocks, partial)
        scored.append((dataclasses.replace(priced, params=params) if in_turn else priced, template, in_turn,
                       origins))
    scored.sort(key=lambda item: (item[0].micros, not item[2]))
    best, template, _, origins = scored[0]
    rule = stof_rule(fine.total(PARTIAL, FULL) // slices, fine.n_rb * fine.n_cb)
    tiles, walks = _tile_layout(description, problem, best.params, origins)
    return AttentionChoice(template, best.params, tuple(item[0] for item in scored), rule,
                           document_tiles=tiles, key_walks=walks)


def adopt_choice(problem: AttentionProblem, description: MaskDescription, template: KernelTemplate,
                 params: dict[str, Any], measured_us: float) -> AttentionChoice:
    """Make a measured winner the choice for (problem, mask): later `attention` calls run it."""
    modelled = choose(problem, description, own=True)
    tiles, walks = _tile_layout(description, problem, params, row_origins(description, problem, params))
    choice = AttentionChoice(template, dict(params), modelled.estimates, modelled.stof_rule, measured_us,
                             document_tiles=tiles, key_walks=walks)
    _choices[description][(problem, sm_count())] = choice
    for listener in _adopt_listeners:  # e.g. the runtime's launch plans built on the model's pick
        listener(description)
    return choice


def on_adopt(listener: Callable[[MaskDescription], None]) -> None:
    """Call ``listener(description)`` whenever a measured winner replaces the pick for a mask."""
    _adopt_listeners.append(listener)


def explain_attention(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                      mask: MaskDescription | torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float16) -> AttentionChoice:
    """The kernel `attention` would run for these sizes and mask, with every candidate's
    estimate; needs no GPU (the SM count defaults to the H100's 132 without one).
    ``choice.explain()`` formats it."""
    problem = validated_problem(AttentionProblem(batch, heads, seq_q, seq_k, head_dim, dtype))
    return launched_choice(problem, as_description(mask))[1]


# A mask that splits into d strided attentions (`MaskDescription.strided_split`: a dilated window is d
# sliding windows over every d-th position) runs as one launch of them where the cost model expects
# that to take less than this share of one launch on the sparse mask: the model prices both alike but
# has no term for the direct kernel's d-fold sparser partial blocks.
SPLIT_MARGIN = 0.8


def residue_problem(problem: AttentionProblem, residues: int) -> AttentionProblem:
    """The problem a strided split into ``residues`` poses: each residue of each batch element
    is a batch slot of its own, its sequences 1 / residues as long."""
    if residues == 1:
        return problem
    return dataclasses.replace(problem, batch=problem.batch * residues, seq_q=problem.seq_q // residues,
                               seq_k=problem.seq_k // residues, residues=residues)


def strided_split(problem: AttentionProblem, description: MaskDescription) -> tuple[int, MaskDescription] | None:
    """`description.strided_split()` where it applies to ``problem`` (equal sequences that d
    divides, B * d batch slots within the grid's limit, no bias) and the cost model prices the
    split below SPLIT_MARGIN of the direct kernel; else None."""
    found = description.strided_split()
    if found is None or problem.bias:
        return None
    d, sub = found
    if problem.seq_q != problem.seq_k or problem.seq_q % d or problem.batch * d > GRID_YZ_LIMIT:
        return None
    direct_us = choose(problem, description, own=True).estimates[0].micros
    split_us = choose(residue_problem(problem, d), sub, own=True).estimates[0].micros
    return found if split_us < SPLIT_MARGIN * direct_us else None


def launched_form(problem: AttentionProblem, description: MaskDescription, *,
                  splits: bool = True) -> tuple[AttentionProblem, MaskDescription]:
    """The problem and mask `attention` launches for (problem, description): each residue's mask over
    the residue problem where the split pays (`strided_split`), else the two as they are. What the
    tuner measures, `explain` shows and a compiled model writes out. ``splits`` False where the runtime
    does not split (pinned parameters, key padding converted beforehand, as compiled models pass it)."""
    split = strided_split(problem, description) if splits else None
    return (problem, description) if split is None else (residue_problem(problem, split[0]), split[1])


def launched_choice(problem: AttentionProblem, description: MaskDescription, *,
                    splits: bool = True) -> tuple[AttentionProblem, AttentionChoice]:
    """The problem `attention` launches (`launched_form`) and the pick it runs there (`running_choice`),
    with the split named where there is one."""
    launched, mask = launched_form(problem, description, splits=splits)
    choice = running_choice(launched, mask)
    if launched.residues > 1:
        choice = dataclasses.replace(choice, strided=(launched.residues, repr(mask)))
    return launched, choice


def running_choice(problem: AttentionProblem, description: MaskDescription) -> AttentionChoice:
    """The pick `attention` runs for (problem, mask), as `choose` makes it, told with the mask's own
    estimates: where the pick is its kind's (an earlier mask of the same `choice_group`), the mask's
    own pick is named beside it."""
    runs, own = choose(problem, description), choose(problem, description, own=True)
    if runs is own:
        return own
    tiles, walks = _tile_layout(description, problem, runs.params, row_origins(description, problem, runs.params))
    return dataclasses.replace(own, template=runs.template, params=runs.params, measured_us=runs.measured_us,
                               document_tiles=tiles, key_walks=walks, own_pick=own.params)


def pinned_choice(problem: AttentionProblem, params: dict[str, Any]) -> AttentionChoice:
    by_strategy = {t.strategy: t for t in ATTENTION_TEMPLATES}
    template = by_strategy.get(params.get("strategy"))
    if template is None:
        raise AttentionInputError(f"params {params}: strategy must be one of {sorted(by_strategy)}")
    if not template.runs_on(target_capability()):
        raise AttentionInputError(f"{template.name} does not run on compute capability {target_capability()}")
    if params not in template.space(problem):
        raise AttentionInputError(f"params {params} are not in {template.name}'s space for {problem}")
    return AttentionChoice(template, params, (), (0.0, 0.0, ""))


def _priced(template: KernelTemplate, problem: AttentionProblem, priced_as: dict[str, Any], params: dict[str, Any],
            heads_batches: int, row_blocks: Any, partial: int) -> Estimate:
    """The model's estimate of ``params`` (priced as ``priced_as``) on these block counts."""
    return estimate(priced_as, problem.head_dim, heads_batches, row_blocks, partial,
                    template.shared_bytes(problem, params), sm_count(), template.registers(problem, params),
                    template.launch(problem, params)[1], template.exposes_bit_loads(problem, params))


def row_origins(description: MaskDescription, problem: AttentionProblem,
                params: dict[str, Any]) -> tuple[int, ...] | None:
    """Block rows that start where documents start (`masks.row_origins`) for a point of the
    kernel that reads each tile's first row from its schedule (attention_wgmma_ws), where the mask
    is documents alone and the model prices such tiles below the plain ones (fewer partial blocks,
    more or fewer blocks: a document's last tile overlaps the one before); else None. At S = 8192
    with four documents and 192-row tiles: 704 blocks, none partial, against 720 of which 64
    partial (docs/decisions.md#document-tiles)."""
    if params.get("strategy") != WGMMA_WS.strategy or problem.residues > 1 or problem.seq_q != problem.seq_k:
        return None
    starts = description.document_starts(problem.seq_q)
    if starts is None or problem.seq_q < params["block_m"]:
        return None
    origins = document_row_origins(starts, problem.seq_q, params["block_m"])
    if origins is None:  # tiles already start at documents: as windows they may still walk documents' keys
        origins = tuple(range(0, problem.seq_q, params["block_m"]))
    sizes = (problem.seq_q, problem.seq_k, params["block_m"], params["block_n"])
    dims = {"batch": problem.batch, "heads": problem.heads}
    priced_as = params | {"persistent": False} if WGMMA_WS.takes_tiles_in_turn(problem, params) else params

    plain = description.block_runs(*sizes, **dims)
    heads_batches = problem.batch * problem.heads // (plain.batch * plain.heads)  # windows have the same slices

    def micros(row_blocks: list[int], partial: int) -> float:
        return _priced(WGMMA_WS, problem, priced_as, params, heads_batches, row_blocks, partial).micros
    plain_us = micros(plain.per_row(FULL, PARTIAL).tolist(), plain.total(PARTIAL))
    return origins if micros(*_window_counts(description, problem, params, origins)) < plain_us else None


def document_keys(description: MaskDescription, problem: AttentionProblem, params: dict[str, Any],
                  origins: tuple[int, ...] | None) -> tuple[tuple[int, int], ...] | None:
    """The key ranges of a point's document tiles (`masks.row_origins.window_keys`): a tile inside one
    document walks that document's keys from its start. Not with per-call row windows, whose narrowing
    reads the block lists."""
    if origins is None or problem.row_windows:
        return None
    keys = description.document_keys(problem.seq_q)
    return None if keys is None else window_keys(description.document_starts(problem.seq_q), keys, origins,
                                                 params["block_m"])


def _tile_layout(description: MaskDescription, problem: AttentionProblem, params: dict[str, Any],
                 origins: tuple[int, ...] | None) -> tuple[int | None, int]:
    """(document tiles per (batch, head) or None, how many of them walk one document's keys): what
    `AttentionChoice.explain` reports of a point's tiles."""
    keys = document_keys(description, problem, params, origins)
    return None if origins is None else len(origins), 0 if keys is None else sum(start >= 0 for start, _ in keys)


def _window_counts(description: MaskDescription, problem: AttentionProblem, params: dict[str, Any],
                   origins: tuple[int, ...]) -> tuple[list[int], int]:
    """(blocks per tile, PARTIAL blocks) of a point's document tiles: a tile inside one document walks its
    keys in FULL blocks from the document's start (`document_keys`), the others their block lists."""
    runs = description.block_runs(problem.seq_q, problem.seq_k, params["block_m"], params["block_n"],
                                  batch=problem.batch, heads=problem.heads, row_origins=origins)
    rows, partial = runs.per_row(FULL, PARTIAL), runs.per_row(PARTIAL)
    keys = document_keys(description, problem, params, origins)
    if keys is not None:
        spans, blocks = key_blocks(keys, params["block_n"])
        slices = rows.numel() // len(origins)
        inside = torch.from_numpy(spans[:, 0] >= 0).repeat(slices)
        rows = torch.where(inside, torch.from_numpy(blocks).repeat(slices), rows)
        partial = torch.where(inside, 0, partial)
    return rows.tolist(), int(partial.sum())


def cached_block_mask(description: MaskDescription, problem: AttentionProblem,
                      params: dict[str, Any], device: torch.device, origins: object = ...) -> BlockMask:
    """The block mask a point runs ``description`` with, on ``device``, kept per mask (and its
    `row_origins`, worked out here unless given). Per-call row windows are part of the key: their
    kernels read the block lists, never the document key walks (`document_keys`) a plain call's
    mask carries (shared, a cu_seqlens call after a plain one read a walk's key start as a block
    index and faulted: found by review)."""
    if origins is ...:
        origins = row_origins(description, problem, params)
    key = (problem.seq_q, problem.seq_k, params["block_m"], params["block_n"],
           problem.batch, problem.heads, str(device), origins, problem.row_windows)
    per_mask = _block_masks.setdefault(description, {})
    if key not in per_mask:
        if device.type == "cpu" or description.evaluates_on(device):  # built where its tiles are evaluated
            mask = description.block_mask(problem.seq_q, problem.seq_k, params["block_m"], params["block_n"],
                                          batch=problem.batch, heads=problem.heads, device=device, row_origins=origins)
            keys = document_keys(description, problem, params, origins)
            per_mask[key] = mask if keys is None else dataclasses.replace(mask, row_keys=keys)
        else:
            per_mask[key] = cached_block_mask(description, problem, params, torch.device("cpu"), origins).to(device)
    return per_mask[key]


CAUSAL = causal()  # one object: attention's choices (and tuned winners) are cached per description


causal_window = functools.cache(lambda window: sliding_window(window, causal=True))  # one object per window, as CAUSAL
two_sided_window = functools.cache(lambda window: sliding_window(window))  # |q - k| <= window, one object each


def node_mask(given: dict[str, Any], override: MaskDescription | None) -> MaskDescription | None:
    """The description an attention node runs with: ``compile``'s override, else its static
    structure (causal, a causal window) or none; key padding is data the kernel reads on the
    device, not part of the description. One object per structure: choices and tuned winners are cached per description."""
    if override is not None:
        return override
    if not given.get("is_causal"):
        return None
    return CAUSAL if given.get("window") is None else causal_window(given["window"])


class AttentionKernel(NamedTuple):
    """What a compiled model launches for an attention node: the template and point, the problem
    and mask as launched (`launched_form`: a dilated window's residues and their mask), the estimate."""

    template: KernelTemplate
    problem: AttentionProblem
    params: dict[str, Any]
    estimate_us: float  # the model's estimate of this point (an adopted winner's too)
    mask: MaskDescription


def attention_kernel(graph: Graph, node: Node, mask: MaskDescription | None = None) -> AttentionKernel:
    """The attention template, problem, parameters and estimate the cost model picks for an SDPA
    or recognised attention node under ``mask`` (`compile(mask=)`, replacing the node's own mask,
    a boolean tensor included), else its own static mask (causal, a causal window or none); key
    padding is read by the kernel per call and chosen for as if no key were padded. NotFusable
    with the reason.
    An fp32 node gets the fp16 kernel: stof-cc compiles models to fp16 (or bf16)."""
    given = attention_arguments(node)
    q, k, v = (graph.node(given[name].name).spec for name in ("query", "key", "value"))
    attn_mask = given.get("attn_mask")
    bias = bool(added_biases(graph, node))  # a float mask, ALiBi: the kernel variant that adds it (kept under mask=)
    if attn_mask is not None and mask is None and not is_bias(graph, attn_mask):  # (`compile(mask=)` replaces it)
        raise NotFusable(f"%{node.name}: a boolean mask tensor that is not key padding is known only at run time "
                         "(give the mask as a description: stof_cc.compile(..., mask=), stof_cc.backend(mask=) or "
                         "stof-cc compile --mask SPEC)")
    if given.get("dropout_p"):  # the pass refuses it as training; the runtime asked this function alone
        raise NotFusable(f"%{node.name}: attention with dropout_p = {given['dropout_p']} (training mode) has no "
                         "stof-cc kernel")
    if given.get("softcap") is not None:
        raise NotFusable(f"%{node.name}: softcapped scores (c * tanh(s / c), c = {given['softcap']}) are not in "
                         "stof-cc's attention kernels yet")
    scale = given.get("scale")
    if isinstance(scale, (int, float)) and not takes_scale(scale):
        raise NotFusable(f"%{node.name}: attention with scale {scale} (the kernels take a positive scale of at least "
                         f"{SMALLEST_SCALE:g})")
    if len(q.shape) != 4 or q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise NotFusable(f"%{node.name}: attention on {q} has no stof-cc kernel (4-d, head_dim {SUPPORTED_HEAD_DIMS})")
    # the kernels' contract (templates/attention.py's input checks): K and V as q's batch and head
    # dim, V as K's keys and heads; else the first call raised where torch runs it (found by review)
    if len(k.shape) != 4 or tuple(v.shape) != tuple(k.shape) or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] \
            or q.shape[1] % k.shape[1]:
        raise NotFusable(f"%{node.name}: attention with q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(K and V broadcast over the batch, or another head dim or key count) has no stof-cc kernel")
    dtype = q.dtype if q.dtype in SUPPORTED_DTYPES else torch.float16
    b, h, s_q, d = q.shape
    kv_heads = k.shape[1] if k.shape[1] != h else None  # grouped-query: the kernel reads K/V head h // group
    # the problem the runtime plans (`runtime.attention`: its bias and K/V heads), split as it splits:
    # compiled models pass key padding converted beforehand, which the runtime never splits
    problem = validated_problem(AttentionProblem(b, h, s_q, k.shape[2], d, dtype, kv_heads, bias))
    launched, launched_mask = launched_form(problem, as_description(node_mask(given, mask)),
                                            splits=given.get("key_padding") is None)
    choice = running_choice(launched, launched_mask)
    estimate = next((e.micros for e in choice.estimates if e.params == choice.params), choice.estimates[0].micros)
    return AttentionKernel(choice.template, launched, choice.params, estimate, launched_mask)
