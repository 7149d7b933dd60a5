"""Context parallelism (stof_cc/distributed.py): the plan read off the mask's block classes, and
the attention of every rank's shard on gloo ranks on the CPU (the chunks through the torch
reference there) against one process's masked attention; on GPUs (NCCL, the kernels) against
one GPU's `stof_cc.attention`."""

from __future__ import annotations

import textwrap

import pytest
import torch
from ranks import torchrun, two_gpus

from stof_cc import masks
from stof_cc.distributed import context_parallel_plan, rank_chunks, shard_sequence
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL
from stof_cc.masks.region import region


def test_balanced_chunks_pair_the_first_with_the_last():
    assert [rank_chunks(r, 2) for r in (0, 1)] == [[0, 3], [1, 2]]
    x = torch.arange(8).view(1, 1, 8, 1)
    assert shard_sequence(x, 1, 2).flatten().tolist() == [2, 3, 4, 5]
    assert shard_sequence(x, 1, 2, balanced=False).flatten().tolist() == [4, 5, 6, 7]
    for rank in (2, -1):  # rank 2 of 2 returned chunks 2 and 1; -1 raised a bare IndexError (a helper's audit)
        with pytest.raises(ValueError, match=r"shard_sequence: rank must be in \[0, 2\)"):
            shard_sequence(x, rank, 2)


def test_the_plan_sends_only_the_chunks_queries_see():
    seq = 4 * 256
    causal = context_parallel_plan(masks.causal(), seq, 2)
    assert causal.sees == ((0,), (0, 1), (0, 1, 2), (0, 1, 2, 3))
    assert causal.receives(0) == [(1, 1, 0, 256), (1, 2, 0, 256)] and causal.receives(1) == [(0, 0, 0, 256)]
    assert causal.sends(1) == [(0, 1, 0, 256), (0, 2, 0, 256)] and causal.sends(0) == [(1, 0, 0, 256)]
    assert causal.bytes_sent(1, 1) == 512 == causal.ring_bytes_sent(1)
    documents = context_parallel_plan(masks.document([256] * 4), seq, 2)
    assert documents.receives(0) == documents.receives(1) == [] and documents.bytes_sent(0, 1) == 0
    window = context_parallel_plan(masks.sliding_window(64), 8 * 256, 4)  # reaching the neighbouring chunks
    assert window.sees[3] == (2, 3, 4)
    # only the neighbours' edge rows travel (whole 128-blocks): chunk 3's queries see rows 128-255 of
    # chunk 2 and 0-127 of chunk 4, and only its first and last 128 rows see them
    assert window.spans[3][2] == ((0, 128), (128, 256)) and window.spans[3][4] == ((128, 256), (0, 128))
    assert window.query_rows(3, [2, 4]) == (0, 256)
    assert window.receives(3) == [(2, 2, 128, 256), (2, 5, 0, 128)] and window.bytes_sent(1, 1) == 4 * 128
    assert all(window.bytes_sent(r, 1) <= window.ring_bytes_sent(1) / 3 for r in range(4))


def test_a_ranks_calls_run_the_held_keys_first_and_merge_the_received_ones():
    """Causal on two ranks: rank 1 (chunks 1 and 2) attends to its own chunks while chunk 0 travels,
    then to chunk 0's rows and merges; without overlap, one call per chunk after the transfers."""
    from stof_cc.distributed import AttentionCall

    plan = context_parallel_plan(masks.causal(), 1024, 2)
    assert plan.calls(1) == [
        AttentionCall(0, 1, (0, 256), (1,), False, returns_lse=True),
        AttentionCall(1, 2, (0, 256), (1, 2), False, returns_lse=True),
        AttentionCall(0, 1, (0, 256), (0,), True, returns_lse=True, merges=True),
        AttentionCall(1, 2, (0, 256), (0,), True, returns_lse=True, merges=True)]
    assert plan.calls(1, overlap=False) == [AttentionCall(0, 1, (0, 256), (0, 1), True),
                                            AttentionCall(1, 2, (0, 256), (0, 1, 2), True)]
    assert plan.calls(0)[0] == AttentionCall(0, 0, (0, 256), (0,), False)  # chunk 0 sees only itself
    window = context_parallel_plan(masks.sliding_window(64), 2048, 4)
    merged = [c for c in window.calls(3) if c.merges]  # rank 3 holds chunks 3 and 4
    assert [(c.chunk, c.rows, c.key_chunks) for c in merged] == [(3, (0, 128), (2,)), (4, (128, 256), (5,))]
    assert window.key_ranges(3, (2, 3)) == ((2 * 256 + 128, 128), (3 * 256, 256))


@pytest.mark.slow
def test_precompile_compiles_every_kernel_the_ranks_will_launch(monkeypatch, tmp_path):
    """On this machine (nvcc, no GPU): the kernels of both ranks' calls land in the cache."""
    from stof_cc.distributed import precompile

    monkeypatch.setenv("STOF_CC_CACHE", str(tmp_path))
    count = precompile(masks.sliding_window(300), 4096, 2, heads=2, head_dim=64, dtype=torch.float16)
    assert count >= 1 and len(list((tmp_path / "cubin").rglob("*.cubin"))) >= count


def test_a_region_is_the_rectangle_of_the_mask_with_its_key_chunks_side_by_side():
    seq, chunk = 1024, 128
    for mask in (masks.causal(), masks.sliding_window(100), masks.document([300, 424, 300]),
                 masks.bigbird(64, 1, 2, 1)):
        dense = mask.to_dense(seq, seq)[..., 5 * chunk:7 * chunk, :]
        want = torch.cat([dense[..., c * chunk:(c + 1) * chunk] for c in (0, 2, 5)], dim=-1)
        part = region(mask, seq, 5 * chunk, 2 * chunk, [(c * chunk, chunk) for c in (0, 2, 5)])
        assert torch.equal(part.to_dense(2 * chunk, 3 * chunk).expand_as(want), want), mask
        # whole parent blocks; a ragged row; blocks pooled from 32 x 128 and 64 x 64 parent blocks; evaluated
        for block_m, block_n in ((64, 64), (160, 64), (96, 128), (192, 64), (80, 40)):
            built = part.block_mask(2 * chunk, 3 * chunk, block_m, block_n)
            assert torch.equal(built.to_dense().expand_as(want), want), (mask, block_m, block_n)


def test_a_malformed_key_range_is_named():
    from stof_cc.masks.errors import MaskError

    with pytest.raises(MaskError, match=r"\(start, length\) pairs"):
        region(masks.causal(), 10, 0, 6, [(0,)])


def test_a_region_whose_blocks_do_not_divide_its_start_is_classified_without_evaluating_the_mask(monkeypatch):
    """The kernel's 192-row blocks at rank 3's last chunk of causal CP = 4 at S = 524288 (a start of
    7 x 65536): pooled from the parent's 64 x 64 classes, exact, nothing evaluated (it was 2.6e10
    elements over the evaluation budget, found on four H100s)."""
    import stof_cc.masks.build as build

    seq, chunk = 524288, 65536
    part = region(masks.causal(), seq, 7 * chunk, chunk, [(c * chunk, chunk) for c in range(1, 8)])
    grid_rows, grid_cols = -(-chunk // 192), 7 * chunk // 64
    monkeypatch.setattr(build, "EVALUATION_BUDGET", 0)  # any evaluation raises
    runs = part.block_runs(chunk, 7 * chunk, 192, 64)
    classes = runs.to_dense()[0, 0]
    assert classes.shape == (grid_rows, grid_cols)
    assert bool((classes[:, :6 * chunk // 64] == FULL).all())  # the six earlier chunks
    diagonal = classes[:, 6 * chunk // 64:]
    rows, cols = torch.arange(grid_rows).view(-1, 1), torch.arange(chunk // 64).view(1, -1)
    first_q, last_q = rows * 192, (rows * 192 + 191).clamp(max=chunk - 1)
    first_k, last_k = cols * 64, cols * 64 + 63
    want = torch.where(last_k <= first_q, FULL, torch.where(first_k > last_q, EMPTY, PARTIAL))
    assert torch.equal(diagonal, want.to(torch.int8))


SCRIPT = textwrap.dedent('''
    import sys
    import torch, torch.distributed as dist
    from stof_cc import masks
    from stof_cc.distributed import context_parallel_attention, context_parallel_plan, gather_sequence, shard_sequence
    from stof_cc.ir.reference import masked_attention
    from stof_cc.runtime.attention import attention

    kind, seq = sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo" if kind == "cpu" else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu" if kind == "cpu" else f"cuda:{rank}"
    if kind != "cpu":
        torch.cuda.set_device(device)
    dtype = torch.float32 if kind == "cpu" else torch.float16
    torch.manual_seed(0)  # every rank the same full inputs
    q = torch.randn(1, 4, seq, 64, device=device, dtype=dtype)
    k, v = (torch.randn(1, 2, seq, 64, device=device, dtype=dtype) for _ in range(2))
    found = {}
    for name, mask in (("causal", masks.causal()), ("sliding", masks.sliding_window(seq // 8)),
                       ("document", masks.document([seq // 4] * 4)), ("bigbird", masks.bigbird(64, 1, 2, 1))):
        with torch.no_grad():
            shards = [shard_sequence(t, rank, world) for t in (q, k, v)]
            got = [gather_sequence(context_parallel_attention(*shards, mask, overlap=overlap)) for overlap in (True, False)]
            if kind == "cpu":
                want = masked_attention(q, k, v, mask.to_dense(seq, seq, 1, 4))
            else:
                want = attention(q, k, v, mask)
        error = max(float((g.float() - want.float()).norm() / want.float().norm()) for g in got)
        row_bytes = 2 * k[..., :1, :].numel() * k.element_size()
        plan = context_parallel_plan(mask, seq, world, batch=1, heads=4)
        found[name] = (error, plan.bytes_sent(rank, row_bytes), plan.ring_bytes_sent(row_bytes))
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as out:
        out.write(repr(found))
    dist.barrier()  # both ranks done before either closes its connections (a gloo rank can abort otherwise)
    dist.destroy_process_group()
''')


def _run(tmp_path, kind: str, seq: int) -> list[dict]:
    script = tmp_path / "cp.py"
    script.write_text(SCRIPT)
    run = torchrun(str(script), str(tmp_path), kind, str(seq))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return [eval((tmp_path / f"rank{rank}.txt").read_text()) for rank in (0, 1)]  # noqa: S307 (the script's repr)


@pytest.mark.slow
def test_two_cpu_ranks_compute_what_one_process_does_sending_only_what_is_seen(tmp_path):
    for found in _run(tmp_path, "cpu", 1024):
        for name, (error, sent, ring) in found.items():
            assert error < 1e-5, (name, found)
            assert sent <= ring, (name, found)
        # documents within chunks: nothing moves; causal: at most a ring (the plan test has the exact counts)
        assert found["document"][1] == 0 and found["causal"][1] <= found["causal"][2], found


TORCH_CONVENTION = textwrap.dedent('''
    import sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from stof_cc import masks
    from stof_cc.distributed import context_parallel_attention, shard_sequence
    from stof_cc.ir.reference import masked_attention

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 512, 16) for _ in range(3))
    mask = masks.causal()
    buffers = [t.clone() for t in (q, k, v)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
        same_layout = torch.equal(buffers[0], shard_sequence(q, rank, world))
        out = context_parallel_attention(*buffers, mask, mesh)
    (full,) = context_parallel_unshard(mesh, [out], [2])
    error = float((full - masked_attention(q, k, v, mask.to_dense(512, 512, 1, 2))).abs().max())
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as found:
        found.write(repr((same_layout, error)))
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_buffers_sharded_by_pytorchs_context_parallel_go_in_as_they_are(tmp_path):
    """torch's `context_parallel` shards q, k, v in place (head-tail load balancing), the call
    takes them and a device mesh, and torch's `context_parallel_unshard` gathers the output."""
    script = tmp_path / "torch_cp.py"
    script.write_text(TORCH_CONVENTION)
    run = torchrun(str(script), str(tmp_path))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for rank in (0, 1):
        same_layout, error = eval((tmp_path / f"rank{rank}.txt").read_text())  # noqa: S307 (the script's repr)
        assert same_layout and error < 1e-5, (rank, same_layout, error)


MISTAKES = textwrap.dedent('''
    import datetime, sys
    import torch, torch.distributed as dist
    from stof_cc import masks
    from stof_cc.distributed import context_parallel_attention

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a regression fails, not hangs
    rank = dist.get_rank()
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    said = {}

    def attempt(name, *args, grad=False, **kwargs):
        try:
            with torch.set_grad_enabled(grad):
                context_parallel_attention(*args, **kwargs)
            said[name] = "ran"
        except Exception as exc:
            said[name] = f"{type(exc).__name__}: {exc}"

    attempt("grad", q.requires_grad_(), k, v, masks.causal(), grad=True)
    q = q.detach()
    attempt("v head dim", q, k, v[..., :1], masks.causal())
    attempt("masks differ", q, k, v, masks.causal() if rank == 0 else masks.sliding_window(64))
    attempt("lengths differ", q if rank == 0 else q[..., :128, :], k if rank == 0 else k[..., :128, :],
            v if rank == 0 else v[..., :128, :], masks.causal())
    attempt("agreed", q, k, v, masks.causal())
    attempt("differ after agreeing", q, k, v, masks.causal() if rank == 0 else masks.sliding_window(64),
            check_every_call=True)
    dense = masks.causal().to_dense(512, 512)[0, 0] if rank == 0 else torch.ones(512, 512, dtype=torch.bool)
    attempt("dense masks differ", q, k, v, masks.from_dense(dense))
    attempt("integer inputs", q.long(), k.long(), v.long(), masks.causal(), balanced=False)
    attempt("balanced not a bool", q, k, v, masks.causal(), balanced="no")
    attempt("one rank's dtype", q if rank == 0 else q.double(), k if rank == 0 else k.double(),
            v if rank == 0 else v.double(), masks.causal(), check_every_call=True)  # rank 0's call was agreed
    table = torch.arange(512 if rank == 0 else 256) // 100  # rank 1: its own shard's table, too short
    attempt("one rank's mask_mod fails", q, k, v, masks.from_mask_mod(lambda b, h, i, j: table[i] == table[j]))
    attempt("scales differ", q, k, v, masks.causal(), scale=0.25 if rank == 0 else 0.5)
    alone = dist.new_group([0])  # every rank makes the group; rank 1 is not in it
    if rank == 1:
        attempt("not a member", q, k, v, masks.causal(), alone)
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as out:
        out.write(repr(said))
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_mistakes_are_refused_on_every_rank_before_anything_is_sent(tmp_path):
    """Found by a helper's hunt: autograd on gave wrong dK and dV without a word (keys sent to another
    rank carry no gradient back), V of head dim 1 was broadcast into a q-shaped output, and ranks
    passing different masks or shard lengths aborted gloo or hung, also with dense masks of one shape,
    or after a first agreed call (with check_every_call), or where one rank's own check failed. Each is
    now an error on every rank."""
    script = tmp_path / "mistakes.py"
    script.write_text(MISTAKES)
    run = torchrun(str(script), str(tmp_path))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for rank in (0, 1):
        said = eval((tmp_path / f"rank{rank}.txt").read_text())  # noqa: S307 (the script's repr)
        assert said["grad"].startswith("AttentionInputError") and "inference-only" in said["grad"], said
        assert said["v head dim"].startswith("ValueError") and "v (1, 2, 256, 1)" in said["v head dim"], said
        assert said["masks differ"].startswith("ValueError") and "rank 1: mask" in said["masks differ"], said
        assert said["lengths differ"].startswith("ValueError") and "rank 1: q (1, 2, 128, 16)" in said["lengths differ"]
        assert said["agreed"] == "ran", said
        # with check_every_call, a rank that had agreed on its call no longer skips the check while the
        # other enters it (a hang, and still one without it); two dense masks of one shape have one repr,
        # and the plan in the fingerprint tells them apart: both hung before (found by review)
        assert said["differ after agreeing"].startswith("ValueError") and "rank 1: mask" in said["differ after agreeing"]
        assert said["dense masks differ"].startswith("ValueError") and "plan of the mask (another)" in \
            said["dense masks differ"], said
        # a helper's audit: int64 shards ran on one rank and crashed the other's merge after the sends; a
        # truthy string ran as balanced; a rank outside the group crashed in the fingerprint's weakref
        assert said["integer inputs"].startswith("AttentionInputError") and "got torch.int64" in said["integer inputs"]
        assert said["balanced not a bool"].startswith("TypeError") and "balanced must be a bool" in \
            said["balanced not a bool"], said
        # a review: a rank whose own check or mask failed raised before the fingerprint, and the other waited in
        # it until the group's timeout; ranks passing different scales ran, 2.5 off
        assert said["scales differ"].startswith("ValueError") and "rank 1: scale 0.5" in said["scales differ"], said
        assert said["one rank's dtype"].startswith("ValueError") and "rank 1: dtype torch.float64" in \
            said["one rank's dtype"] and "AttentionInputError" in said["one rank's dtype"], said
        assert said["one rank's mask_mod fails"].startswith("ValueError") and "rank 1:" in \
            said["one rank's mask_mod fails"] and "indexed past a table it reads" in said["one rank's mask_mod fails"], \
            said
    assert "not a member of group" in eval((tmp_path / "rank1.txt").read_text())["not a member"]  # noqa: S307


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs two GPUs")
def test_two_gpus_compute_what_one_gpu_does(tmp_path):
    for found in _run(tmp_path, "cuda", 4096):
        for name, (error, _, _) in found.items():
            assert error < 1e-2, (name, found)


@pytest.mark.gpu
def test_the_kernels_attend_with_a_region_as_with_its_dense_mask():
    """One GPU: each query chunk of a rank, its keys gathered, through stof_cc.attention with the
    region mask (the parent's FULL and EMPTY blocks, a ragged block row where the kernel's block
    does not divide the chunk) against the torch reference with the region's dense mask."""
    from stof_cc.ir.reference import masked_attention
    from stof_cc.runtime.attention import attention

    seq, chunk = 4096, 1024
    torch.manual_seed(0)
    for mask in (masks.causal(), masks.sliding_window(512), masks.document([1024] * 4), masks.bigbird(64, 1, 2, 1)):
        part = region(mask, seq, 3 * chunk, chunk, [(c * chunk, chunk) for c in (0, 2, 3)])
        q = torch.randn(1, 4, chunk, 64, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(1, 2, 3 * chunk, 64, device="cuda", dtype=torch.float16) for _ in range(2))
        with torch.no_grad():
            got = attention(q, k, v, part)
        want = masked_attention(q, k, v, part.to_dense(chunk, 3 * chunk, 1, 4).cuda())
        error = float((got.float() - want.float()).norm() / want.float().norm())
        assert error < 1e-2, (mask, error)


def test_partial_results_merge_by_log_sum_exp_into_the_whole():
    """The reference's (output, lse) over disjoint key sets, one of which leaves rows with no key,
    merge into the attention over all of them; a row no set reaches stays 0 with lse -inf."""
    from stof_cc.ir.reference import masked_attention, masked_lse
    from stof_cc.runtime.attention import merge_partials

    q, k, v = (torch.randn(2, 3, 64, 16) for _ in range(3))
    dense = masks.causal().to_dense(64).clone()
    dense[..., 5, :] = False
    parts = [(masked_attention(q, k[..., cut, :], v[..., cut, :], dense[..., cut]),
              masked_lse(q, k[..., cut, :], dense[..., cut])) for cut in (slice(0, 40), slice(40, 64))]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    assert torch.allclose(out, masked_attention(q, k, v, dense), atol=1e-5)  # fp32 arithmetic
    assert torch.allclose(lse, masked_lse(q, k, dense))
    assert (out[..., 5, :] == 0).all() and torch.isinf(lse[..., 5]).all()
