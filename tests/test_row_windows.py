"""Packed documents given per call (`stof_cc.attention(..., cu_seqlens=...)`): the row windows built on
the device, their errors on the CPU, and the kernels' row-window variant against the reference on the GPU."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from stof_cc import masks
from stof_cc.backends.nvcc import compile_cubin
from stof_cc.backends.row_windows import (
    document_windows,
    position_windows,
    position_windows_on_device,
    windows_of,
    windows_of_positions,
    windows_on_device,
)
from stof_cc.ir.reference import masked_attention, masked_lse, relative_error
from stof_cc.runtime.attention import _plans as runtime_plans
from stof_cc.runtime.attention import attention
from stof_cc.templates.attention import GRID_YZ_LIMIT, AttentionInputError, problem_of
from stof_cc.templates.row_windows import ROW_WINDOWS, RowWindowsProblem
from stof_cc.tune.attention import candidates


def _boundaries(seq: int, documents: int, seed: int, tail: int = 0) -> list[int]:
    """0, then the ends of ``documents`` documents (one of them empty when there are three or
    more) covering the first ``seq - tail`` rows: the last ``tail`` rows are padding."""
    generator = torch.Generator().manual_seed(seed)
    used = seq - tail
    cuts = sorted(torch.randperm(used - 1, generator=generator)[: documents - 1].add(1).tolist())
    if documents >= 3:
        cuts[1] = cuts[0]  # an empty document
    return [0, *cuts, used]


def _dense(bounds: list[int], seq: int, causal: bool) -> torch.Tensor:
    """The mask the windows mean: same document (rows past the last end see nothing), causal or not."""
    rows = torch.arange(seq)
    document = torch.bucketize(rows, torch.tensor(bounds[1:]), right=True)
    inside = rows < bounds[-1]
    allowed = (document[:, None] == document[None, :]) & inside[:, None] & inside[None, :]
    return allowed & (rows[None, :] <= rows[:, None]) if causal else allowed


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_windows_give_each_row_its_documents_keys(dtype):
    seq = 300
    for documents, tail in ((1, 0), (5, 0), (9, 37)):
        bounds = _boundaries(seq, documents, seed=documents, tail=tail)
        windows = document_windows(torch.tensor(bounds, dtype=dtype), 2, seq, torch.device("cpu"))
        assert windows.shape == (2, seq, 2) and windows.dtype == torch.int32 and windows.is_contiguous()
        keys = torch.arange(seq)
        got = (keys[None, :] >= windows[0, :, :1]) & (keys[None, :] < windows[0, :, 1:])
        assert torch.equal(got, _dense(bounds, seq, causal=False)), (documents, tail)
        assert torch.equal(windows[0], windows[1])
        assert (windows[0, 1:] >= windows[0, :-1]).all()  # both ends never decrease: what the kernels assume


@pytest.mark.parametrize(("cu_seqlens", "message"), [
    (torch.tensor([[0, 4]]), "1-D int32 or int64"),
    (torch.tensor([0.0, 4.0]), "1-D int32 or int64"),
    (torch.tensor([0]), "1-D int32 or int64"),
    (torch.tensor([1, 4]), "start at 0"),
    (torch.tensor([0, 6, 4]), "never decrease"),
    (torch.tensor([0, 4, 20]), "at most at the sequence length 16"),
])
def test_bad_cu_seqlens_are_named(cu_seqlens, message):
    with pytest.raises(AttentionInputError, match=message):
        document_windows(cu_seqlens, 1, 16, torch.device("cpu"))


def test_rows_outside_every_document_see_no_key():
    """A device cu_seqlens is not validated (that would be a host read): rows before its first
    entry or past its last get an empty window, values past the sequence are clamped, and both
    ends still never decrease."""
    windows = windows_of(torch.tensor([3, 6, 9, 40]), 1, 12)[0]
    assert windows[:3].tolist() == [[0, 0]] * 3
    assert windows[3:6].tolist() == [[3, 6]] * 3 and windows[6:9].tolist() == [[6, 9]] * 3
    assert windows[9:].tolist() == [[9, 12]] * 3  # the last document clamped to the sequence
    assert (windows[1:] >= windows[:-1]).all()


def _positions(bounds: list[int], seq: int) -> torch.Tensor:
    """HF's position ids for documents ``bounds`` (0, then each end): counting from 0 in each; the
    padded rows past the last end count on from the last document (HF pads that way)."""
    rows = torch.arange(seq)
    starts = torch.tensor(bounds[:-1])
    start = starts[torch.bucketize(rows.clamp(max=bounds[-1] - 1), starts, right=True) - 1]
    return rows - start


def test_position_ids_give_the_same_windows_as_cu_seqlens_per_batch_element():
    """Position ids restarting at 0 (per batch element: each its own documents) give the windows the
    cumulative lengths give; a one-row document and an empty one (no row of its own) included."""
    seq = 300
    per_element = [_boundaries(seq, documents, seed=documents) for documents in (1, 6)]
    ids = torch.stack([_positions(bounds, seq) for bounds in per_element])
    windows = position_windows(ids, 2, seq, torch.device("cpu"))
    for element, bounds in enumerate(per_element):
        distinct = sorted(set(bounds))  # an empty document has no row that restarts its ids
        assert torch.equal(windows[element], document_windows(torch.tensor(distinct), 1, seq, torch.device("cpu"))[0])
    shared = position_windows(ids[1], 2, seq, torch.device("cpu"))
    assert torch.equal(shared[0], shared[1]) and torch.equal(shared[0], windows[1])


@pytest.mark.parametrize("ids", [[0, 1, 2, 0, 1, 2], [1, 2, 3, 1, 2, 3], [0, 1, 2, 7, 8, 9], [0, 1, 2, 3, 1, 2],
                                 [5, 6, 7, 0, 1, 2], [0, 0, 0, 0], [0, 1, 2, 0, 1, 2, 3, 4]],
                         ids=["restart at 0", "restart at 1", "a jump", "back to 1", "first offset", "ones", "tail"])
def test_position_ids_split_documents_as_transformers_does(ids):
    """Documents open wherever an id is not its predecessor's + 1, as transformers'
    find_packed_sequence_indices says; ids restarting at 1 or jumping let rows see another
    document's keys before (12 such pairs for [1, 2, 3, 1, 2, 3]: found by review)."""
    from transformers.masking_utils import find_packed_sequence_indices

    ids = torch.tensor(ids)
    windows = position_windows(ids, 1, len(ids), torch.device("cpu"))[0]
    keys = torch.arange(len(ids))
    seen = (keys[None] >= windows[:, :1]) & (keys[None] < windows[:, 1:])
    documents = find_packed_sequence_indices(ids[None])
    documents = torch.zeros_like(ids) if documents is None else documents[0]
    assert torch.equal(seen, documents[:, None] == documents[None, :])


def test_position_ids_for_more_batch_elements_than_the_grid_holds_are_named():
    batch = GRID_YZ_LIMIT + 1
    with pytest.raises(AttentionInputError, match=f"{batch} batch elements"):
        position_windows(torch.zeros(batch, 1, dtype=torch.int8), batch, 1, torch.device("cpu"))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: document_windows(torch.tensor([0, 4]), 1, 0, torch.device("cpu")), "1 to .* rows"),
    (lambda: position_windows(torch.zeros(1, 0, dtype=torch.long), 1, 0, torch.device("cpu")), "1 to .* rows"),
    (lambda: windows_on_device(torch.tensor([4]), 1, 8), "1-D int32 or int64"),
    (lambda: windows_on_device(torch.tensor([0.0, 4.0]), 1, 8), "int32 or int64"),
    (lambda: position_windows_on_device(torch.zeros(3, 8, dtype=torch.long), 2, 8), r"\[1 or 2, 8\]"),
    (lambda: position_windows_on_device(torch.zeros(8, dtype=torch.long), 1, 8), r"\[1 or 1, 8\]"),
])
def test_the_window_builders_name_what_they_refuse_before_any_launch(call, message):
    with pytest.raises(AttentionInputError, match=message):
        call()


def test_bad_position_ids_are_named_or_kept_in_bounds():
    with pytest.raises(AttentionInputError, match=r"integer tensor \[16\] or \[2, 16\]"):
        position_windows(torch.zeros(3, 16, dtype=torch.long), 2, 16, torch.device("cpu"))
    with pytest.raises(AttentionInputError, match="integer tensor"):
        position_windows(torch.zeros(16), 2, 16, torch.device("cpu"))
    windows = position_windows(torch.tensor([5, 9, 0, 7, 1, 2]), 1, 6, torch.device("cpu"))[0]
    rows = torch.arange(6)
    assert (windows[:, 0] <= rows).all() and (windows[:, 1] > rows).all() and (windows[:, 1] <= 6).all()
    assert (windows[1:] >= windows[:-1]).all()


@pytest.mark.nvcc
@pytest.mark.parametrize(("source", "dtype"), [("cu_seqlens", torch.int32), ("cu_seqlens", torch.int64),
                                               ("position_ids", torch.int64)])
def test_the_row_windows_kernels_compile(source, dtype):
    problem = RowWindowsProblem(source, dtype, 2, 1000)
    (params,) = ROW_WINDOWS.space(problem)
    compiled = compile_cubin(ROW_WINDOWS.render(problem, params), arch="sm_90")
    report = compiled.resources[ROW_WINDOWS.kernel_name(problem, params)]
    assert report.spill_stores == 0, report


def test_cu_seqlens_need_one_packed_sequence_of_queries_and_keys_and_no_bias():
    q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    k = v = torch.randn(1, 2, 24, 64, dtype=torch.float16)
    with pytest.raises(AttentionInputError, match="16 queries and 24 keys"):
        attention(q, k, v, masks.causal(), cu_seqlens=torch.tensor([0, 16]))
    with pytest.raises(AttentionInputError, match="cu_seqlens with a bias is not supported"):
        attention(q, q, q, masks.causal(), cu_seqlens=torch.tensor([0, 16]), bias=torch.zeros(16, 16))
    with pytest.raises(AttentionInputError, match="not both"):
        attention(q, q, q, masks.causal(), cu_seqlens=torch.tensor([0, 16]), position_ids=torch.arange(16))


# ---- on the GPU ----------------------------------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16)
BATCH, HEADS = 2, 3


def _inputs(seq: int, head_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(BATCH, HEADS, seq, head_dim, device="cuda", dtype=dtype) for _ in range(3)]


def _check(out: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    assert not torch.isnan(out).any(), f"{label}: NaN in output"
    err = relative_error(out, ref)
    assert err < 1e-2, f"{label}: relative error {err:.2e}"
    assert (out.float() - ref.float()).abs().max() < 5e-2, f"{label}: max abs error"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_every_template_point_matches_the_reference_with_new_documents_each_call(dtype, head_dim, causal):
    """Every point of every template that takes row windows, on a ragged length (1000: no block
    divides it), two boundary sets in turn through one plan: documents cut blocks anywhere, one is
    empty, the second set leaves 37 rows of padding (they give 0)."""
    seq = 1000
    q, k, v = _inputs(seq, head_dim, dtype)
    static = masks.causal() if causal else None
    problem = dataclasses.replace(problem_of(q, k, v), row_windows=True)
    for template, params in candidates(problem):
        for documents, tail in ((6, 0), (11, 37)):
            bounds = _boundaries(seq, documents, seed=documents, tail=tail)
            cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device="cuda")
            out = torch.full_like(q, float("nan"))
            attention(q, k, v, static, cu_seqlens=cu_seqlens, params=params, out=out)
            dense = _dense(bounds, seq, causal).cuda()
            _check(out, masked_attention(q, k, v, dense),
                   f"{template.name} {params}, {documents} documents, {tail} padded rows")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_row_windows_kernel_gives_the_torch_ops_windows(dtype):
    """The kernel a GPU call builds its windows with, value for value against `windows_of`'s torch ops
    (the CPU's form): ragged lengths, empty documents, a padded tail, one document, one document per
    row, and entries a device buffer may hold that the CPU check refuses (negative, decreasing, past
    the sequence), for which both must agree too."""
    generator = torch.Generator().manual_seed(7)
    cases = [(1000, _boundaries(1000, documents, seed=documents, tail=tail))
             for documents, tail in ((1, 0), (6, 0), (11, 37), (64, 5))]
    cases += [(129, list(range(130))), (4096, [0, 4096]), (300, [3, 6, 9, 400]), (300, [-5, 40, 20, 250, 250, 90]),
              (777, sorted(torch.randint(-50, 900, (40,), generator=generator).tolist()))]
    cases += [(512, torch.randint(-20, 600, (17,), generator=generator).tolist()) for _ in range(4)]
    if dtype == torch.int64:  # clamped before they are narrowed to rows
        cases += [(300, [-(2 ** 40), 100, 2 ** 40]), (300, [0, 2 ** 40 + 5, 2 ** 62])]
    for seq, bounds in cases:
        cu_seqlens = torch.tensor(bounds, dtype=dtype, device="cuda")
        for batch in (0, 1, 3):
            got = windows_on_device(cu_seqlens, batch, seq)
            want = windows_of(cu_seqlens, batch, seq)
            assert got.shape == (batch, seq, 2) and got.dtype == torch.int32 and got.is_contiguous()
            assert torch.equal(got, want), (seq, bounds[:8], batch)


@pytest.mark.gpu
def test_the_position_windows_kernel_gives_the_torch_ops_windows():
    """The position-id form, value for value against `windows_of_positions`: one id row for every
    batch element and one per element, lengths around the kernel's 1024-row tiles and its 8192-row
    look-around steps, documents opening exactly at and beside those edges, HF's ids restarting at 0,
    ids restarting at 1 or jumping, one document, every row its own document, int32 ids, and ids near
    int64's ends (their + 1 wraps, as torch's does)."""
    generator = torch.Generator().manual_seed(11)
    seqs = (1, 5, 1000, 1023, 1024, 1025, 2048, 8191, 8192, 8193, 2 * 8192 + 1000)
    for seq in seqs:
        per_element = [_positions(_boundaries(seq, documents, seed=seq + documents), seq) if seq > documents
                       else torch.arange(seq) for documents in (1, 7)]
        edges = [0] + [edge for edge in (1023, 1024, 1025, 8191, 8192, 8193, 16384) if edge < seq] + [seq]
        cases = [torch.stack(per_element), per_element[1][None], _positions(edges, seq)[None],
                 torch.zeros(1, seq, dtype=torch.long),
                 torch.randint(0, 3, (2, seq), generator=generator), (torch.arange(seq) % 37 + 1)[None].to(torch.int32),
                 torch.full((1, seq), 2 ** 63 - 1), torch.tensor([2 ** 63 - 1, -(2 ** 63)] * seq)[:seq][None]]
        for ids in cases:
            ids = ids.cuda()
            for batch in {ids.shape[0], 2, 0}:
                if ids.shape[0] not in (1, batch):
                    continue
                got = position_windows_on_device(ids, batch, seq)
                assert got.shape == (batch, seq, 2) and got.is_contiguous()
                assert torch.equal(got, windows_of_positions(ids, batch, seq)), (seq, ids[0, :8].tolist(), batch)


def _captured(call) -> torch.cuda.CUDAGraph:
    """``call`` run once on a side stream (its plan is built outside the capture, as torch.cuda.graph
    asks), then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


@pytest.mark.gpu
def test_a_captured_call_replays_with_new_documents():
    """The boundaries are data on the device: a call captured in a CUDA graph replays with new
    boundaries copied into the same buffer, with no new plan."""
    seq = 2048
    q, k, v = _inputs(seq, 128, torch.bfloat16)
    causal, out = masks.causal(), torch.empty_like(q)
    cu_seqlens = torch.tensor(_boundaries(seq, 8, seed=0), dtype=torch.int32, device="cuda")
    graph = _captured(lambda: attention(q, k, v, causal, cu_seqlens=cu_seqlens, out=out))
    for seed, documents in ((1, 8), (2, 8), (3, 3)):  # the buffer keeps 9 entries: fewer documents end empty ones
        bounds = _boundaries(seq, documents, seed=seed, tail=40 * seed)
        bounds += [bounds[-1]] * (cu_seqlens.numel() - len(bounds))
        cu_seqlens.copy_(torch.tensor(bounds, dtype=torch.int32))
        graph.replay()
        _check(out, masked_attention(q, k, v, _dense(bounds, seq, causal=True).cuda()),
               f"replayed with {documents} documents")


@pytest.mark.gpu
@pytest.mark.parametrize("documents", [False, True])
def test_a_captured_call_outlives_its_mask(documents):
    """A graph captured around a call whose mask the caller drops afterwards (or whose plan a tuning
    run's adopted winner replaces): the runtime's plans go with their mask, and every replay would read
    the plan's freed device memory (its tile schedule, its block mask). Freed blocks are refilled before
    the replay; it must still give the right answer. (Found by a scratch A/B that rebuilt its plans in a
    loop: wrong timings, then an illegal address.)"""
    seq = 2048
    q, k, v = _inputs(seq, 128, torch.bfloat16)
    out = torch.empty_like(q)
    bounds = _boundaries(seq, 8, seed=5)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device="cuda") if documents else None
    allowed = _dense(bounds, seq, causal=True) if documents else torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = masks.causal()
    graph = _captured(lambda mask=mask: attention(q, k, v, mask, cu_seqlens=cu_seqlens, out=out))
    plans = [weakref.ref(plan) for plan in runtime_plans[mask].values()]
    del mask
    gc.collect()
    assert plans and all(plan() is not None for plan in plans), "a captured plan went with its mask"
    clutter = [torch.full((size,), -1, dtype=torch.int32, device="cuda") for size in (2 ** n for n in range(6, 22))
               for _ in range(4)]  # whatever was freed holds -1 now
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    del clutter
    _check(out, masked_attention(q, k, v, allowed.cuda()), f"replayed after its mask went ({documents=})")


@pytest.mark.gpu
def test_persistent_ctas_taking_tiles_in_turn_cover_every_tile_in_every_replay():
    """Persistent points with row windows take tiles from a counter zeroed per launch: with many
    tiles per CTA (2 x 16 heads x 32 block rows for at most one CTA per SM), every tile is computed
    in the first call and in each replay of a captured call (a counter left at its last value would
    skip every tile: the output would stay NaN)."""
    seq = 4096
    q, k, v = (torch.randn(2, 16, seq, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    problem = dataclasses.replace(problem_of(q, k, v), row_windows=True)
    persistent = [params for template, params in candidates(problem) if template.takes_tiles_in_turn(problem, params)]
    assert persistent
    causal = masks.causal()
    for params in persistent[:2]:
        cu_seqlens = torch.tensor(_boundaries(seq, 16, seed=3), dtype=torch.int32, device="cuda")
        out = torch.full_like(q, float("nan"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the plan is built outside the capture, as torch.cuda.graph asks
            attention(q, k, v, causal, cu_seqlens=cu_seqlens, params=params, out=out)
        torch.cuda.current_stream().wait_stream(side)
        _check(out, masked_attention(q, k, v, _dense(cu_seqlens.tolist(), seq, causal=True).cuda()), f"{params}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attention(q, k, v, causal, cu_seqlens=cu_seqlens, params=params, out=out)
        for seed in (4, 5):
            cu_seqlens.copy_(torch.tensor(_boundaries(seq, 16, seed=seed), dtype=torch.int32))
            out.fill_(float("nan"))
            graph.replay()
            _check(out, masked_attention(q, k, v, _dense(cu_seqlens.tolist(), seq, causal=True).cuda()),
                   f"{params}, replay with seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
def test_documents_over_a_static_mask_with_gaps_in_its_block_rows(persistent):
    """The kernels narrow a block row's list to the rows' windows by guessing a column's place from a
    gapless run, then search where the guess misses: a static mask that never attends keys 256-639
    (three key blocks missing from every later row) under documents that span the gap."""
    seq = 1024
    q, k, v = _inputs(seq, 128, torch.bfloat16)
    keys = torch.arange(seq)
    static = masks.causal().to_dense(seq) & ~((keys >= 256) & (keys < 640))[None, :]
    problem = dataclasses.replace(problem_of(q, k, v), row_windows=True)
    points = [params for template, params in candidates(problem)
              if params["strategy"] == "wgmma_ws" and params["persistent"] == persistent]
    for params in points[:2]:
        for bounds in ([0, 100, 700, 1024], [0, 300, 301, 900, 1000]):
            cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device="cuda")
            out = attention(q, k, v, masks.from_dense(static), cu_seqlens=cu_seqlens, params=params)
            dense = (static & _dense(bounds, seq, causal=False)).cuda()
            _check(out, masked_attention(q, k, v, dense), f"{params}, documents {bounds}")


@pytest.mark.gpu
def test_a_plan_is_kept_for_its_kind_of_call():
    """The row-window plan and the plain one are different kernels: each call finds its own."""
    q, k, v = _inputs(256, 64, torch.float16)
    causal = masks.causal()
    cu_seqlens = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    with_windows = attention(q, k, v, causal, cu_seqlens=cu_seqlens)
    plain = attention(q, k, v, causal)
    _check(with_windows, masked_attention(q, k, v, _dense([0, 100, 256], 256, causal=True).cuda()), "windows")
    _check(plain, masked_attention(q, k, v, masks.causal().to_dense(256).cuda()), "plain")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_documents_with_key_padding_grouped_heads_a_padded_tail_and_the_lse(causal):
    """Documents on top of key padding with a hole, grouped-query heads (3 per K/V head), and a
    tail of 400 padded rows (whole block rows whose windows are empty): those rows give exactly 0
    and a log-sum-exp of -inf; every other row matches the reference, its log-sum-exp too."""
    seq, tail = 1000, 400
    q = torch.randn(BATCH, 6, seq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(BATCH, 2, seq, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    padding = torch.ones(BATCH, seq, dtype=torch.int64, device="cuda")
    padding[1, 50:60] = 0  # a hole: the kernels test those keys one by one
    bounds = _boundaries(seq, 7, seed=5, tail=tail)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    out, lse = attention(q, k, v, masks.causal() if causal else None, cu_seqlens=cu_seqlens, key_padding=padding,
                         return_lse=True)
    dense = _dense(bounds, seq, causal).cuda()[None, None] & (padding != 0)[:, None, None, :]
    _check(out, masked_attention(q, k, v, dense), "documents + key padding")
    assert (out[:, :, seq - tail:] == 0).all(), "padded rows must give exactly 0"
    want_lse = masked_lse(q, k, dense)
    assert torch.isneginf(lse[:, :, seq - tail:]).all()
    live = torch.isfinite(want_lse)
    assert torch.equal(live, torch.isfinite(lse)) and (lse[live] - want_lse[live]).abs().max() < 2e-2


@pytest.mark.gpu
def test_position_ids_give_each_batch_element_its_own_documents():
    """Position ids [B, S]: batch element 0 one document with a padded tail, element 1 nine; the
    kernels read them on the device."""
    seq = 1000
    q, k, v = _inputs(seq, 128, torch.bfloat16)
    per_element = [_boundaries(seq, 1, seed=1, tail=200), _boundaries(seq, 9, seed=9)]
    ids = torch.stack([_positions(bounds, seq) for bounds in per_element]).cuda()
    out = attention(q, k, v, masks.causal(), position_ids=ids)
    # the padded rows count on from the last document (HF's padding), so they join it
    dense = torch.stack([_dense(sorted(set(bounds[:-1])) + [seq], seq, causal=True) for bounds in per_element])
    _check(out, masked_attention(q, k, v, dense[:, None].cuda()), "position ids per batch element")


def test_a_plain_call_and_a_windows_call_on_one_mask_keep_their_own_block_masks():
    """Documents alone give a plain call's tiles key walks (`row_keys`), which the row-window kernels
    cannot read: a cu_seqlens call after a plain call on the same description took the plain call's
    cached block mask and faulted on the H200 (found by review). Each keeps its own."""
    from stof_cc.backends.tile_schedule import tile_schedule
    from stof_cc.templates.attention import AttentionProblem
    from stof_cc.tune.attention import cached_block_mask, choose

    documents = masks.document([3475, 621])
    plain = AttentionProblem(1, 8, 4096, 4096, 64, torch.float16)
    windows = dataclasses.replace(plain, row_windows=True)
    first = cached_block_mask(documents, plain, choose(plain, documents).params, torch.device("cpu"))
    params = choose(windows, documents).params
    second = cached_block_mask(documents, windows, params, torch.device("cpu"))
    assert first.row_keys is not None and second.row_keys is None and first is not second
    schedule = tile_schedule(second, 1, 8, 132, in_turn=True)
    entries = schedule.table[schedule.ctas + 1:].view(-1, 5)
    assert (entries[:, 3] >= 0).all()  # block-list ranges only, no key walks


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["plain", "cu_seqlens"])
def test_one_document_mask_runs_plain_and_with_cu_seqlens_in_either_order(first):
    """The same description, called plain and with per-call documents on top, in either order: both right
    (the second call faulted with an illegal address when the plain call came first)."""
    torch.manual_seed(0)
    documents = masks.document([3475, 621])
    q, k, v = (torch.randn(1, 8, 4096, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 2000, 4096], dtype=torch.int32, device="cuda")
    ids = torch.searchsorted(cu[1:], torch.arange(4096, device="cuda"), right=True)
    plain_dense = documents.to_dense(4096, 4096).cuda()
    windows_dense = plain_dense & (ids[:, None] == ids[None, :])
    calls = {"plain": (lambda: attention(q, k, v, documents), plain_dense),
             "cu_seqlens": (lambda: attention(q, k, v, documents, cu_seqlens=cu), windows_dense)}
    for name in (first, *(n for n in calls if n != first)):
        call, dense = calls[name]
        out = call()
        torch.cuda.synchronize()
        assert relative_error(out, masked_attention(q, k, v, dense)) < 1e-2, name
