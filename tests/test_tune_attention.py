"""Stage 2 for attention: candidates and signatures on the CPU; measuring on the GPU."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from stof_cc import masks
from stof_cc.ir.reference import relative_error
from stof_cc.runtime.attention import attention
from stof_cc.templates.attention import AttentionProblem
from stof_cc.tune.attention import choose, explain_attention
from stof_cc.tune.database import TuningDatabase
from stof_cc.tune.tune_attention import attention_candidates, attention_signature, tune_attention


def test_candidates_follow_the_model_and_render():
    problem = AttentionProblem(2, 4, 1024, 1024, 64, torch.float16)
    mask = masks.sliding_window(64)
    candidates = attention_candidates(problem, mask)
    assert len(candidates) > 8
    assert [c.estimate_us for c in candidates] == sorted(c.estimate_us for c in candidates)
    assert candidates[0].params == explain_attention(2, 4, 1024, 1024, 64, mask).params
    assert all("extern \"C\"" in c.cuda_source() for c in candidates[:3])
    signature = attention_signature(problem, mask)
    assert "float16 B2 H4 Sq1024 Sk1024 D64" in signature
    one, two = (masks.from_dense(torch.rand(1024, 1024) > 0.5) for _ in range(2))
    assert attention_signature(problem, one) != attention_signature(problem, two)  # same repr, other bits
    assert attention_signature(problem, mask) == attention_signature(problem, masks.sliding_window(64))


def test_points_taking_tiles_in_turn_are_priced_as_their_twins_and_ranked_before_them():
    """Per-call row windows: the persistent points (tiles taken in turn) visit the blocks their
    one-CTA-per-tile twins visit, so the model prices each as its twin, and picks it (measured faster)."""
    problem = AttentionProblem(1, 16, 8192, 8192, 128, torch.bfloat16, row_windows=True)
    estimates = choose(problem, masks.causal()).estimates
    by_point = {tuple(sorted(e.params.items())): e for e in estimates}
    in_turn = [e for e in estimates if e.params.get("persistent")]
    assert in_turn and estimates[0].params.get("persistent")
    for estimate in in_turn:
        twin = by_point[tuple(sorted((estimate.params | {"persistent": False}).items()))]
        assert estimate.micros == twin.micros and estimates.index(estimate) < estimates.index(twin)
    plain = choose(dataclasses.replace(problem, row_windows=False), masks.causal()).estimates
    assert any(e.params.get("persistent") for e in plain[:2])  # static masks still price persistence


@pytest.mark.gpu
def test_tune_attention_measures_adopts_and_remembers(tmp_path: Path):
    q, k, v = (torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = masks.causal()
    db = TuningDatabase(tmp_path / "t.sqlite")
    report = tune_attention(q, k, v, mask, database=db, top_k=4, runs=5)
    assert report.measured == 4 and not report.from_database and report.winner_us > 0
    choice = explain_attention(2, 4, 1000, 1000, 64, mask)
    assert choice.params == report.winner.params and choice.measured_us == report.winner_us
    out = attention(q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert relative_error(out, ref) < 1e-2
    again = tune_attention(q, k, v, mask, database=db, top_k=4, runs=5)
    assert again.from_database and again.measured == 0 and again.winner.params == report.winner.params


def test_documents_with_new_boundaries_share_the_kernel_choice(monkeypatch):
    """Packed sequences bring new document boundaries every call: a mask of the same kind (total
    length, about as many documents; under causal too) takes the choice already priced."""
    import stof_cc.tune.attention as tune_attention
    from stof_cc import masks
    from stof_cc.templates.attention import AttentionProblem

    problem = AttentionProblem(1, 4, 1024, 1024, 64, torch.float16)
    first = tune_attention.choose(problem, masks.document([300, 500, 224]) & tune_attention.CAUSAL)
    priced = []
    counts = tune_attention.coarse_counts
    monkeypatch.setattr(tune_attention, "coarse_counts", lambda *a, **k: priced.append(1) or counts(*a, **k))
    again = tune_attention.choose(problem, masks.document([100, 600, 324]) & masks.causal())  # causal() anew
    assert again is first and not priced
    own = tune_attention.choose(problem, masks.document([100, 600, 324]) & masks.causal(), own=True)
    assert own.params == first.params and own is not first and len(priced) == 1  # explain and the tuner: its own
    priced.clear()
    tune_attention.choose(problem, masks.document([64] * 16) & tune_attention.CAUSAL)  # 16 documents, not 3
    tune_attention.choose(problem, masks.document(segment_ids=torch.arange(1024) // 256))  # another kind
    tune_attention.choose(problem, masks.sliding_window(100, causal=True))  # a mask that does not change: its own
    assert len(priced) == 3
    assert masks.causal().choice_group() is None


def test_mask_mods_over_new_tables_share_the_kernel_choice(monkeypatch):
    """A mask_mod over per-call tables is a new description every call: closures of one code over
    tables of the same shapes take the choice already priced; another shape, another captured
    scalar or another code is priced anew."""
    import stof_cc.tune.attention as tune_attention
    from stof_cc import masks
    from stof_cc.masks.user import mask_mod_kind
    from stof_cc.templates.attention import AttentionProblem

    def documents(ids, window=None):
        if window is None:
            return lambda b, h, q, k: ids[q] == ids[k]
        return lambda b, h, q, k: (ids[q] == ids[k]) & ((q - k).abs() <= window)

    problem = AttentionProblem(1, 4, 1024, 1024, 64, torch.float16)
    first = tune_attention.choose(problem, masks.from_mask_mod(documents(torch.arange(1024) // 300)))
    priced = []
    counts = tune_attention.coarse_counts
    monkeypatch.setattr(tune_attention, "coarse_counts", lambda *a, **k: priced.append(1) or counts(*a, **k))
    again = tune_attention.choose(problem, masks.from_mask_mod(documents(torch.arange(1024) // 100)))
    assert again is first and not priced
    tune_attention.choose(problem, masks.from_mask_mod(documents(torch.arange(2048) // 100)))  # another table shape
    tune_attention.choose(problem, masks.from_mask_mod(documents(torch.arange(1024) // 100, window=64)))
    tune_attention.choose(problem, masks.from_mask_mod(documents(torch.arange(1024) // 100, window=128)))
    tune_attention.choose(problem, masks.from_mask_mod(lambda b, h, q, k: q >= k))
    assert len(priced) == 4
    assert mask_mod_kind(documents(torch.arange(8))) == mask_mod_kind(documents(torch.arange(8) // 2))
    config = [64]
    config.append(config)  # a list that holds itself: a kind two levels deep, no endless walk
    assert masks.from_mask_mod(lambda b, h, q, k: (q - k).abs() <= config[0]).choice_group() is not None

    class Window(int):  # equal by value, not hashable: no kind, so the mask keeps its own choice
        def __eq__(self, other):
            return int(self) == other
        __hash__ = None

    window = Window(64)
    unhashable = masks.from_mask_mod(lambda b, h, q, k: (q - k).abs() <= window)
    assert unhashable.choice_group() is None
    tune_attention.choose(problem, unhashable)
    assert mask_mod_kind(documents(torch.arange(8))) != mask_mod_kind(documents(torch.arange(8.0)))  # dtype


def test_a_mask_that_is_not_a_description_gets_the_call_that_makes_one():
    """A newcomer's review: a spec string, a zoo function not called, a FlexAttention mask_mod: the
    error names what makes a description of each."""
    from stof_cc.templates.attention import AttentionInputError

    for mask, says in (("causal", "masks.parse_spec('causal')"), (masks.causal, "call it: masks.causal(...)"),
                       (lambda b, h, q, k: q >= k, "masks.from_mask_mod(fn)")):
        with pytest.raises(AttentionInputError, match=re.escape(says)):
            explain_attention(1, 2, 128, 128, 64, mask)


@pytest.mark.parametrize("case", ["k and v broadcast over the batch", "v with another head dim"])
def test_attention_the_kernels_do_not_take_is_refused_at_compile(case):
    """K/V broadcast over the batch or a V head dim unlike q's: NotFusable at compile (torch runs
    it), where the first call on the GPU raised the kernels' input error (found by review)."""
    from stof_cc.codegen import NotFusable
    from stof_cc.ir.frontend import trace
    from stof_cc.passes import canonicalize, recognise_attention
    from stof_cc.tune.attention import attention_kernel

    q, k, v = (torch.randn(2, 4, 16, 64) for _ in range(3))
    if case == "k and v broadcast over the batch":
        k, v = k[:1], v[:1]
    else:
        v = torch.randn(2, 4, 16, 32)

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    graph = recognise_attention(canonicalize(trace(Sdpa(), (q, k, v), {})))
    (node,) = [n for n in graph.nodes() if n.op == "attention"]
    with pytest.raises(NotFusable, match="has no stof-cc kernel"):
        attention_kernel(graph, node)


def test_a_dilated_window_is_explained_and_compiled_as_the_strided_attentions_that_run():
    """Where a dilated window splits (S = 8192), `explain_attention`, a compiled model's attention kernel
    and the tuner's candidates are the residues' (B * d slots of S / d positions, each residue's sliding
    window), the strided kernel variant the runtime launches; they were the direct kernel's, which no
    call ran (found by the thirty-fourth session's sweep: stage 2 timed 0.39 ms where the call took 0.12).
    With key padding, which a compiled model passes converted and the runtime then never splits, the
    direct kernel."""
    from stof_cc.ir.frontend import trace
    from stof_cc.passes import canonicalize, describe_key_padding, recognise_attention
    from stof_cc.tune.attention import attention_kernel, launched_form, residue_problem

    mask = masks.dilated(512, 4)
    d, sub = mask.strided_split()
    problem = AttentionProblem(1, 12, 8192, 8192, 64, torch.float16)
    launched, launched_mask = launched_form(problem, mask)
    assert (launched, launched_mask) == (residue_problem(problem, d), sub) and launched.residues == 4
    assert launched_form(problem, mask, splits=False) == (problem, mask)
    choice = explain_attention(1, 12, 8192, 8192, 64, mask)
    assert choice.strided == (4, repr(sub)) and choice.params == choose(launched, sub, own=True).params
    assert "runs as 4 strided attentions" in choice.explain()
    assert explain_attention(1, 12, 8192, 8192, 64, masks.causal()).strided is None
    assert [c.params for c in attention_candidates(launched, sub)][0] == choice.params
    assert " strided x4 " in attention_signature(launched, sub)
    assert attention_signature(launched, sub) != attention_signature(residue_problem(problem, 1), sub)

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v, padding=None):
            keep = None if padding is None else padding[:, None, None, :].bool()
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    q = torch.randn(1, 12, 8192, 64)
    for args, splits in (((q, q, q), True), ((q, q, q, torch.ones(1, 8192, dtype=torch.long)), False)):
        graph = describe_key_padding(recognise_attention(canonicalize(trace(Sdpa(), args, {}))))
        (node,) = [n for n in graph.nodes() if n.op == "attention"]
        kernel = attention_kernel(graph, node, mask)
        if splits:
            assert (kernel.problem, kernel.mask, kernel.params) == (launched, sub, choice.params)
            assert "_strided" in kernel.template.kernel_name(kernel.problem, kernel.params)
        else:
            assert kernel.problem.residues == 1 and kernel.mask is mask


@pytest.mark.gpu
def test_tuning_a_dilated_window_measures_and_adopts_what_runs():
    """Stage 2 on a dilated window that splits measures the strided launch and adopts it for the residue
    problem the runtime plans: the next call runs the winner, correctly."""
    from stof_cc.ir.reference import masked_attention
    from stof_cc.runtime import attention as runtime_attention
    from stof_cc.tune.attention import launched_form

    q, k, v = (torch.randn(1, 4, 8192, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = masks.dilated(256, 4)
    launched, sub = launched_form(AttentionProblem(1, 4, 8192, 8192, 64, torch.float16), mask)
    assert launched.residues == 4
    report = tune_attention(q, k, v, mask, top_k=3, runs=5)
    assert report.measured == 3 and report.winner_us > 0
    assert choose(launched, sub).params == report.winner.params and choose(launched, sub).measured_us == report.winner_us
    out = attention(q, k, v, mask)
    (plan,) = runtime_attention._plans[sub].values()  # the one plan the call built: the residues', on the winner
    assert plan.residues == 4 and plan.kernel.name == report.winner.template.kernel_name(launched, report.winner.params)
    assert relative_error(out, masked_attention(q, k, v, mask.to_dense(8192).cuda())) < 1e-2


@pytest.mark.gpu
def test_a_compiled_model_tunes_the_strided_attentions_it_runs_and_a_later_compile_adopts_them(tmp_path: Path):
    """`stof_cc.compile(mask=dilated)` measures the residues' strided kernels (the record names the split),
    writes the strided kernel out, matches the reference; a second compile with ``tune=False`` adopts the
    record for the residue problem it launches."""
    import stof_cc
    from stof_cc.ir.reference import masked_attention
    from stof_cc.tune.attention import _choices, launched_form

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = (torch.randn(1, 4, 8192, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = masks.dilated(256, 4)
    launched, sub = launched_form(AttentionProblem(1, 4, 8192, 8192, 64, torch.float16), mask)
    db = TuningDatabase(tmp_path / "t.sqlite")
    compiled = stof_cc.compile(Sdpa().eval(), (q, k, v), mask=mask, database=db, build_dir=tmp_path / "build")
    assert relative_error(compiled(q, k, v), masked_attention(q, k, v, mask.to_dense(8192).cuda())) < 1e-2
    assert any("_strided" in path.read_text() for path in (tmp_path / "build").rglob("*.cu"))  # the launched kernel
    signatures = [record.signature for record in db.records()]
    assert signatures and all(" strided x4 " in signature for signature in signatures)
    measured = choose(launched, sub).measured_us
    assert measured is not None
    _choices.pop(sub, None)  # forget the adoption: the next compile must take it from the database
    assert choose(launched, sub).measured_us is None
    stof_cc.compile(Sdpa().eval(), (q, k, v), mask=mask, database=db, tune=False)
    assert choose(launched, sub).measured_us == measured


def test_compile_writes_out_the_kernel_of_the_mask_it_was_given(tmp_path: Path):
    """`stof_cc.compile(build_dir=, mask=)` wrote each attention group's kernel for the node's own mask (none
    here: the dense pick), not for ``mask=`` that the model runs (found with the dilated window's test); a
    dilated window's is the residues' strided kernel. The inputs on the CPU: traced, fused and written."""
    import stof_cc
    from stof_cc.tune.attention import launched_choice

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q = torch.randn(1, 4, 8192, 64, dtype=torch.float16)
    problem = AttentionProblem(1, 4, 8192, 8192, 64, torch.float16)
    launched, dense = launched_choice(problem, masks.full())
    unmasked = dense.template.kernel_name(launched, dense.params)
    for label, mask in (("dilated", masks.dilated(256, 4)), ("sliding", masks.sliding_window(64))):
        launched, choice = launched_choice(problem, mask)
        name = choice.template.kernel_name(launched, choice.params)
        assert name != unmasked and ("_strided" in name) == (label == "dilated")
        stof_cc.compile(Sdpa().eval(), (q, q, q), mask=mask, build_dir=tmp_path / label, tune=False)
        (source,) = (tmp_path / label).rglob("*.cu")
        assert f"attention: {name}\n" in source.read_text()


def test_explain_names_the_kind_pick_that_runs_and_asking_changes_nothing():
    """A document mask whose kind another mask priced first runs that mask's pick: `explain_attention`
    said the mask's own pick, and by pricing it made later plans of the mask run that one (found by
    review). Now it names the pick that runs, its own beside it, and the runtime's pick stays."""
    problem = AttentionProblem(1, 14, 4096, 4096, 64, torch.float16)  # sizes no other test prices documents at
    first, later = masks.document([3459, 637]), masks.document([2095, 1860, 141])
    assert first.choice_group() == later.choice_group()
    runs = choose(problem, first)
    assert choose(problem, later) is runs  # the kind's pick
    own = choose(problem, later, own=True)
    assert own.params != runs.params  # these documents would pick another point alone
    told = explain_attention(1, 14, 4096, 4096, 64, later)
    assert told.params == runs.params and told.own_pick == own.params and told.estimates == own.estimates
    assert "the pick of an earlier mask of the same kind" in told.explain()
    assert choose(problem, later) is runs  # asking changed nothing that runs
    alone = explain_attention(1, 14, 4096, 4096, 64, masks.causal())
    assert alone.own_pick is None and "earlier mask" not in alone.explain()
