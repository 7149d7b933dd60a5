"""Context parallelism for masked attention: one long sequence split over the ranks of a
torch.distributed process group, each rank computing the attention of its own queries.

The sequence is cut into chunks. With ``balanced=True`` (the default) there are 2 x world of
them and rank r holds chunks r and 2 x world - 1 - r, so under a causal mask every rank has the
same work (the load-balanced sharding of ring attention); otherwise rank r holds chunk r.
`shard_sequence` and `gather_sequence` move a full-sequence tensor to and from that layout.

`context_parallel_attention(q, k, v, mask, group)` takes each rank's shards. From the mask's
exact block classes at 128-row blocks (`ContextParallelPlan`, made once per mask and size), each
rank learns which rows of which key/value chunks each of its query chunks sees; it receives exactly
those rows from their owners (NCCL point-to-point through torch.distributed): under a document mask
whose documents lie within chunks nothing moves at all, under a sliding window of w each neighbour
sends its w edge rows, where a ring sends every chunk to every rank. While they travel, each query
chunk attends to the key chunks the rank holds; then the query rows that see received keys attend
to them, and the two partial results merge by log-sum-exp (one `lerp` pass over those rows). Each
call runs `stof_cc.attention` with the matching rectangle of the mask (`masks.region`: FULL blocks
stay FULL, EMPTY ones are skipped). Each rank computes whole rows, so nothing is merged across ranks.
Measured figures: benchmarks/RESULTS.md, "Context parallelism".

The balanced layout is that of PyTorch's `context_parallel` (its head-tail load balancer): buffers
it shards go in as they are. On the CPU (gloo ranks) each chunk runs through the torch reference
instead of the kernels.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from stof_cc.backends.nvcc import CompileError, compile_many
from stof_cc.ir.reference import masked_attention, masked_lse
from stof_cc.masks import EMPTY, MaskDescription
from stof_cc.masks.region import region
from stof_cc.runtime.attention import attention, merge_partials
from stof_cc.templates.attention import (
    AttentionInputError,
    AttentionProblem,
    check_layout,
    problem_of,
    validated_problem,
)
from stof_cc.templates.pricing import target_capability
from stof_cc.tune.attention import choose

CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the CPU reference path computes (in fp32)
CLASS_BLOCK = 128  # the block side at which the plan reads the mask's classes (each chunk holds whole blocks)


def rank_chunks(rank: int, world: int, balanced: bool = True) -> list[int]:
    """The chunks rank ``rank`` holds, in the order its shard lays them out."""
    return [rank, 2 * world - 1 - rank] if balanced else [rank]


def _chunks(world: int, balanced: bool) -> int:
    return 2 * world if balanced else world


def shard_sequence(x: torch.Tensor, rank: int, world: int, balanced: bool = True, dim: int = -2) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor (its chunks along ``dim``, side by side)."""
    if not 0 <= rank < world:
        raise ValueError(f"shard_sequence: rank must be in [0, {world}) for world={world}, got {rank}")
    pieces = x.chunk(_chunks(world, balanced), dim=dim)
    if len(pieces) != _chunks(world, balanced) or x.shape[dim] % _chunks(world, balanced):
        raise ValueError(f"shard_sequence: a sequence of {x.shape[dim]} does not split into "
                         f"{_chunks(world, balanced)} equal chunks")
    return torch.cat([pieces[c] for c in rank_chunks(rank, world, balanced)], dim=dim)


def gather_sequence(shard: torch.Tensor, group: dist.ProcessGroup | None = None, balanced: bool = True,
                    dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard (an all-gather, then the chunks put in order)."""
    world = dist.get_world_size(group)
    shards = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    per_rank = len(rank_chunks(0, world, balanced))
    found = {}
    for rank, piece in enumerate(shards):
        for chunk, part in zip(rank_chunks(rank, world, balanced), piece.chunk(per_rank, dim=dim), strict=True):
            found[chunk] = part
    return torch.cat([found[c] for c in range(_chunks(world, balanced))], dim=dim)


@dataclass(frozen=True)
class AttentionCall:
    """One `stof_cc.attention` call of a rank: query rows ``rows`` of the shard's slot ``slot``
    (query chunk ``chunk``) over the keys of ``key_chunks`` laid side by side (held chunks whole,
    received ones their received rows). ``after_transfers``: it reads received rows. ``merges``: its
    result merges by log-sum-exp into the rows the slot's first call wrote, which then returned its
    log-sum-exp (``returns_lse``)."""

    slot: int
    chunk: int
    rows: tuple[int, int]
    key_chunks: tuple[int, ...]
    after_transfers: bool
    returns_lse: bool = False
    merges: bool = False


@dataclass(frozen=True)
class ContextParallelPlan:
    """Which key/value chunks each query chunk sees, and which rows of them: so what each rank
    sends and receives. Rows are positions within a chunk, whole CLASS_BLOCKs."""

    seq: int
    world: int
    balanced: bool
    chunk: int
    sees: tuple[tuple[int, ...], ...]  # per query chunk: the key chunks with an allowed key, ascending
    # per query chunk, per key chunk it sees: (its query rows that see the key chunk, the key rows they see)
    spans: tuple[dict[int, tuple[tuple[int, int], tuple[int, int]]], ...]

    @cached_property
    def layout(self) -> str:
        """What each rank sends and receives, as text the ranks compare (`_check_ranks_agree`)."""
        return repr((self.sees, tuple(sorted(s.items()) for s in self.spans)))

    def owner(self, chunk: int) -> int:
        return chunk if not self.balanced or chunk < self.world else 2 * self.world - 1 - chunk

    def key_rows(self, rank: int, chunk: int) -> tuple[int, int]:
        """The rows of key chunk ``chunk`` that some query chunk of ``rank`` sees: [lo, hi)."""
        spans = [self.spans[q][chunk][1] for q in rank_chunks(rank, self.world, self.balanced) if chunk in self.spans[q]]
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def query_rows(self, chunk: int, key_chunks: list[int]) -> tuple[int, int]:
        """The rows of query chunk ``chunk`` that see any of ``key_chunks``: [lo, hi)."""
        spans = [self.spans[chunk][c][0] for c in key_chunks]
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def receives(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(source rank, chunk, first row, end row) of what ``rank`` receives, in the order both sides post them."""
        mine = rank_chunks(rank, self.world, self.balanced)
        wanted = sorted({c for q in mine for c in self.sees[q]} - set(mine))
        return [(self.owner(c), c, *self.key_rows(rank, c)) for c in wanted]

    def sends(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(destination rank, chunk, first row, end row) of what ``rank`` sends, in the order both sides post them."""
        return [(dest, c, lo, hi) for dest in range(self.world) if dest != rank
                for source, c, lo, hi in self.receives(dest) if source == rank]

    def key_ranges(self, rank: int, key_chunks: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """(first position, length) of the keys ``rank`` has of each chunk: held chunks whole, the
        others the rows it receives."""
        mine = rank_chunks(rank, self.world, self.balanced)
        ranges = []
        for c in key_chunks:
            lo, hi = (0, self.chunk) if c in mine else self.key_rows(rank, c)
            ranges.append((c * self.chunk + lo, hi - lo))
        return tuple(ranges)

    def calls(self, rank: int, overlap: bool = True) -> list[AttentionCall]:
        """The attention calls of ``rank``, in order: those over held keys only first (they run
        while the transfers do). With ``overlap``, a query chunk that sees held and received keys
        attends to the held ones first, then its rows that see received keys attend to those and
        merge; without, it makes one call after the transfers. A chunk that sees no key has no call
        (its rows are 0)."""
        mine = rank_chunks(rank, self.world, self.balanced)
        first, then = [], []
        for slot, chunk in enumerate(mine):
            seen = self.sees[chunk]
            local = tuple(c for c in seen if c in mine)
            remote = tuple(c for c in seen if c not in mine)
            whole = (0, self.chunk)
            if not seen:
                continue
            if not remote:  # without overlap, every call waits for the transfers (a serial baseline)
                (first if overlap else then).append(AttentionCall(slot, chunk, whole, seen, not overlap))
            elif not overlap or not local:
                then.append(AttentionCall(slot, chunk, whole, seen, True))
            else:
                first.append(AttentionCall(slot, chunk, whole, local, False, returns_lse=True))
                then.append(AttentionCall(slot, chunk, self.query_rows(chunk, list(remote)), remote, True,
                                          returns_lse=True, merges=True))
        return first + then

    def bytes_sent(self, rank: int, row_bytes: int) -> int:
        """What ``rank`` sends for one call, with ``row_bytes`` per key row (K and V)."""
        return sum(hi - lo for _, _, lo, hi in self.sends(rank)) * row_bytes

    def ring_bytes_sent(self, row_bytes: int) -> int:
        """What a ring (every rank's chunks to every other rank) sends per rank."""
        return (self.world - 1) * len(rank_chunks(0, self.world, self.balanced)) * self.chunk * row_bytes


# per mask (weakly: a mask's id is reused once it is freed), its plans by sizes; its regions live on
# the mask itself (a region holds its parent: a weak-keyed table of them would keep every mask alive)
_plans: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, ContextParallelPlan]] = weakref.WeakKeyDictionary()
_REGIONS = "_context_parallel_regions"
# the groups every rank has met in a collective (NCCL's communicator is made); by object, since a
# group's name comes back after destroy_process_group and a new init
_joined: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def context_parallel_plan(mask: MaskDescription, seq: int, world: int, balanced: bool = True,
                          batch: int = 1, heads: int = 1) -> ContextParallelPlan:
    """The plan for ``mask`` over sequences of ``seq`` split over ``world`` ranks (made once)."""
    n = _chunks(world, balanced)
    if seq % (n * CLASS_BLOCK):
        raise ValueError(f"context parallelism: the sequence ({seq}) must split into {n} chunks of a multiple "
                         f"of {CLASS_BLOCK} positions")
    plans = _plans.setdefault(mask, {})
    key = (seq, world, balanced, batch, heads)
    if key not in plans:
        chunk = seq // n
        per = chunk // CLASS_BLOCK
        classes = mask.block_runs(seq, seq, CLASS_BLOCK, CLASS_BLOCK, batch, heads).to_dense()
        seen = (classes != EMPTY).flatten(0, 1).any(0).view(n, per, n, per)  # [q chunk, q block, k chunk, k block]
        sees, spans = [], []
        for q in range(n):
            pairs = {}
            for c in seen[q].any(0).any(1).nonzero().flatten().tolist():
                block = seen[q, :, c]
                rows, cols = block.any(1).nonzero().flatten(), block.any(0).nonzero().flatten()
                pairs[c] = ((int(rows[0]) * CLASS_BLOCK, (int(rows[-1]) + 1) * CLASS_BLOCK),
                            (int(cols[0]) * CLASS_BLOCK, (int(cols[-1]) + 1) * CLASS_BLOCK))
            sees.append(tuple(pairs))
            spans.append(pairs)
        plans[key] = ContextParallelPlan(seq, world, balanced, chunk, tuple(sees), tuple(spans))
    return plans[key]


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskDescription,
                               group: dist.ProcessGroup | DeviceMesh | None = None, scale: float | None = None,
                               balanced: bool = True, overlap: bool = True,
                               check_every_call: bool = False) -> torch.Tensor:
    """Masked attention of this rank's query shard over the whole sequence: q, k, v [B, H, S / world, D]
    (K/V may have fewer heads) laid out as `shard_sequence` lays them; returns this rank's rows
    of the output in the same layout. Every rank of ``group`` (a process group, or a 1-D device
    mesh) calls it with the same mask.

    That layout is PyTorch's: buffers that `torch.distributed.tensor.experimental.context_parallel`
    shards (its head-tail load balancing; ``balanced=False`` where that is off) can be passed as
    they are, and `context_parallel_unshard` gathers the output.

    Each rank receives only the rows of other ranks' key chunks that its queries see. With
    ``overlap``, each query chunk attends to the key chunks this rank holds while those rows
    travel, then the rows of its queries that see received keys attend to them, and the two
    results merge by log-sum-exp (`merge_partials`); without, one call per query chunk after the
    transfers. Rows that merge are rounded to q's dtype once more than a one-process call's (the
    first partial is stored, then blended): in bf16 about 1.5-2.7x its relative error.

    Inference-only, as `stof_cc.attention` is. The inputs are checked before anything is sent, and
    on the first call with each shape, dtype, mask and plan the ranks compare them (one all-reduce
    of a fingerprint on the host): where a rank differs, every rank gets a ValueError (unchecked,
    it aborted gloo or hung). ``check_every_call`` compares them on every call (a host round trip,
    about 0.35 ms): without it, a rank that changes its call alone after an agreed call (its mask, or
    inputs its own checks refuse) hangs. It must be the same on every rank (it decides whether a rank
    takes part in the comparison).
    """
    if not isinstance(mask, MaskDescription):
        raise TypeError(f"context_parallel_attention: mask must be a stof_cc.masks description, got "
                        f"{type(mask).__name__}")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"context_parallel_attention: a device mesh must be 1-D (the context-parallel "
                             f"dimension), got {group.ndim} dimensions; pass mesh['cp'] or its group")
        group = group.get_group()
    if not isinstance(balanced, bool):  # a truthy string ran as balanced, whatever the shards' layout
        raise TypeError(f"context_parallel_attention: balanced must be a bool, got {balanced!r}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:  # torch answers -1 for a rank outside the group; it crashed deep in the fingerprint
        raise ValueError(f"context_parallel_attention: this rank (global rank {dist.get_rank()}) is not a member "
                         "of group; call it on the group's ranks only")
    plan = _check_ranks_agree(group, q, k, v, mask, scale, balanced, check_every_call)
    mine = rank_chunks(rank, world, balanced)
    length = plan.chunk
    pieces = {c: (k[..., i * length:(i + 1) * length, :], v[..., i * length:(i + 1) * length, :])
              for i, c in enumerate(mine)}  # per chunk: the keys and values this rank has of it
    in_flight = _post_exchange(plan, rank, group, pieces)
    out = torch.empty_like(q)
    first_lse, covered = {}, set()
    for call in plan.calls(rank, overlap):
        if call.after_transfers and in_flight:
            for request in in_flight:
                request.wait()
            in_flight = []
        lo, hi = call.slot * length + call.rows[0], call.slot * length + call.rows[1]
        into = out[..., lo:hi, :]
        keys = (k, v) if call.key_chunks == tuple(mine) else _side_by_side(pieces, call.key_chunks)
        where = _region(mask, plan, rank, call)
        if call.merges:
            found, found_lse = _attend(q[..., lo:hi, :], *keys, where, scale, None, True)
            rows = slice(*call.rows)
            merge_partials([into, found], [first_lse[call.slot][..., rows], found_lse], into=into)
        else:
            found = _attend(q[..., lo:hi, :], *keys, where, scale, into, call.returns_lse)
            if call.returns_lse:
                first_lse[call.slot] = found[1]
        covered.add(call.slot)
    for request in in_flight:  # sends still in flight (a rank that receives nothing)
        request.wait()
    for slot in set(range(len(mine))) - covered:  # no allowed key: zeros, as stof_cc.attention gives such rows
        out[..., slot * length:(slot + 1) * length, :].zero_()
    return out


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What `stof_cc.attention` checks, before any transfer is posted (a failure after it left the
    other ranks waiting): no autograd, one sequence's shards, q's head dim for k and v, heads that divide."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise AttentionInputError("context_parallel_attention is inference-only (no backward: keys sent to "
                                  "other ranks carry no gradient back): call it under torch.no_grad()")
    if isinstance(q, torch.Tensor) and q.is_cuda:  # the kernels' checks too (dtype, head dim): after the
        problem_of(q, k, v)  # transfers were posted, their error left the other ranks waiting
    else:  # the CPU reference computes in fp32: fp16, bf16 and fp32 only (an int64 q crashed one rank's merge)
        check_layout(q, k, v)
        if q.dtype not in CPU_DTYPES:
            raise AttentionInputError(f"context_parallel_attention: q, k and v must be float16, bfloat16 or float32, "
                                      f"got {q.dtype}")
    if k.shape[-2] != q.shape[-2] or v.shape[-1] != q.shape[-1]:
        raise ValueError(f"context_parallel_attention: q, k and v must be [B, H, S / world, D] shards of one "
                         f"sequence (K and V alike); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


_agreed: weakref.WeakKeyDictionary[dist.ProcessGroup, set[int]] = weakref.WeakKeyDictionary()


def _check_ranks_agree(group: dist.ProcessGroup | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: MaskDescription, scale: float | None, balanced: bool,
                       every_call: bool) -> ContextParallelPlan:
    """Every rank's inputs (`_check_inputs`), shapes, dtype, mask, scale and plan (what each rank sends and
    receives: `repr` alone does not tell two dense masks apart, found by review), compared through a
    fingerprint, one all-reduce of two int64 on the host (`_host_group`); where they differ, a ValueError
    on every rank naming those that differ from rank 0 (with the error of a rank whose own check or plan
    failed); where they agree on a failure, that error. Unchecked, a rank that differs aborted gloo or
    hung; a rank whose check failed before the fingerprint left the others waiting in it (a review: one
    rank's dtype, a mask_mod indexing past its table).
    Compared on the first call of each fingerprint, or with ``every_call`` on every call: a rank
    that repeats an agreed call skips the check, so if another rank changes its call alone, that
    rank waits in the check while the first waits in the exchange (a hang). The check costs a host
    round trip, 0.35 ms a call on two H100s' host (16 documents at S = 32768: 0.44 -> 0.82 ms a call),
    which is why it is not made on every call by default. Returns the call's plan."""
    failed = None
    try:
        _check_inputs(q, k, v)
        seq = q.shape[-2] * dist.get_world_size(group)
        plan = context_parallel_plan(mask, seq, dist.get_world_size(group), balanced, q.shape[0], q.shape[1])
        layout = plan.layout
    except Exception as exc:  # raised below, once every rank has compared fingerprints
        failed, plan, layout = exc, None, ""
    shapes = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (q, k, v))
    error = None if failed is None else f"{type(failed).__name__}: {failed}"
    mine = (*shapes, str(getattr(q, "dtype", None)), repr(mask), balanced, scale, error)
    digest = int.from_bytes(hashlib.blake2b(repr((mine, layout)).encode(), digest_size=7).digest(), "little")
    agreed = _agreed.setdefault(group if group is not None else dist.group.WORLD, set())
    if digest in agreed and not every_call:
        return plan
    both = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=_host_group(group))
    if int(both[0]) != -int(both[1]):  # the largest and the smallest fingerprint differ
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (*mine, layout), group=_host_group(group))
        differ = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
        fields = ("q", "k", "v", "dtype", "mask", "balanced", "scale", "error", "plan of the mask")
        shown = [[value if name != "plan of the mask" else "(another)" for name, value in zip(fields, theirs, strict=True)]
                 for theirs in everyone]
        said = "; ".join(f"rank {rank}: " + ", ".join(f"{name} {shown[rank][i]}" for i, name in enumerate(fields)
                                                      if everyone[rank][i] != everyone[0][i]) for rank in differ)
        raise ValueError(f"context_parallel_attention: every rank must pass valid shards of one shape and dtype, the "
                         f"same mask and scale; rank 0 has q {shown[0][0]}, k {shown[0][1]}, v {shown[0][2]}, "
                         f"{shown[0][3]}, mask {shown[0][4]}, balanced={shown[0][5]}, scale={shown[0][6]}"
                         f"{'' if shown[0][7] is None else ', error ' + shown[0][7]}; {said}") from failed
    if failed is not None:  # the same error on every rank
        raise failed
    agreed.add(digest)
    return plan


_host_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def _host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group`` itself where it reduces CPU tensors (gloo), else a gloo group of its ranks, made
    once by them alone (``use_local_synchronization``). The fingerprint's all-reduce on an NCCL
    group ran on the GPU and its read waited for the GPU to finish the previous call: the host's
    work for each call no longer overlapped the GPU's, 0.44 -> 0.92 ms a call for 16 documents at
    S = 32768 on two H100s; on the host it waits for the other ranks' hosts only."""
    group = group if group is not None else dist.group.WORLD
    if dist.get_backend(group) == "gloo":
        return group
    if group not in _host_groups:
        _host_groups[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                             use_local_synchronization=True)
    return _host_groups[group]


def precompile(mask: MaskDescription, seq: int, world: int, *, heads: int, head_dim: int, dtype: torch.dtype,
               kv_heads: int | None = None, batch: int = 1, balanced: bool = True, overlap: bool = True) -> int:
    """Compile every attention kernel that `context_parallel_attention` will launch on any of
    ``world`` ranks for this mask and these sizes (nvcc, into the kernel cache, in parallel), on a
    machine with nvcc and no GPU as well (kernels chosen and compiled for the current GPU, else the
    H100): a job's ranks then start without compiling. Returns how many distinct kernels
    were compiled or found cached; raises CompileError naming the first that failed."""
    plan = context_parallel_plan(mask, seq, world, balanced, batch, heads)
    major, minor = target_capability()
    arch = f"sm_{major}{minor}"
    jobs = []
    for rank in range(world):
        for call in plan.calls(rank, overlap):
            rows = call.rows[1] - call.rows[0]
            keys = sum(length for _, length in plan.key_ranges(rank, call.key_chunks))
            problem = validated_problem(AttentionProblem(batch, heads, rows, keys, head_dim, dtype, kv_heads))
            choice = choose(problem, _region(mask, plan, rank, call))
            jobs.append((choice.template.render(problem, choice.params), arch + choice.template.arch_features))
    jobs = list(dict.fromkeys(jobs))
    failed = [error for error in compile_many(jobs) if error]
    if failed:
        raise CompileError(f"context-parallel precompile: {len(failed)} of {len(jobs)} kernels failed; "
                           f"the first: {failed[0]}")
    return len(jobs)


def _post_exchange(plan: ContextParallelPlan, rank: int, group: dist.ProcessGroup | None, pieces: dict) -> list:
    """Post the sends of the rows of this rank's chunks that the plan says other ranks see, and
    the receives of the rows its queries see (into ``pieces``: keys, values), K and V back to
    back; returns the requests to wait on before reading what they receive."""
    ops = []
    for dest, chunk, lo, hi in plan.sends(rank):
        peer = dist.get_global_rank(group, dest) if group is not None else dest
        keys, values = pieces[chunk]
        ops += [dist.P2POp(dist.isend, keys[..., lo:hi, :].contiguous(), peer, group),
                dist.P2POp(dist.isend, values[..., lo:hi, :].contiguous(), peer, group)]
    held = pieces[rank_chunks(rank, plan.world, plan.balanced)[0]]
    for source, chunk, lo, hi in plan.receives(rank):
        peer = dist.get_global_rank(group, source) if group is not None else source
        keys = held[0].new_empty((*held[0].shape[:-2], hi - lo, held[0].shape[-1]))
        values = held[1].new_empty((*held[1].shape[:-2], hi - lo, held[1].shape[-1]))
        pieces[chunk] = (keys, values)
        ops += [dist.P2POp(dist.irecv, keys, peer, group), dist.P2POp(dist.irecv, values, peer, group)]
    joined = group or dist.group.WORLD
    if joined not in _joined:  # a first batch_isend_irecv on a group needs every rank in it, and some have no ops
        dist.barrier(group=group)
        _joined.add(joined)
    return dist.batch_isend_irecv(ops) if ops else []


def _side_by_side(pieces: dict, chunks: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of ``chunks`` laid side by side (one chunk: as it is, uncopied)."""
    if len(chunks) == 1:
        return pieces[chunks[0]]
    return tuple(torch.cat([pieces[c][j] for c in chunks], dim=-2) for j in (0, 1))


def _region(mask: MaskDescription, plan: ContextParallelPlan, rank: int, call: AttentionCall) -> MaskDescription:
    """The rectangle of the mask that ``call`` attends with, made once and kept on the mask."""
    q_start = call.chunk * plan.chunk + call.rows[0]
    where = (plan.seq, q_start, call.rows[1] - call.rows[0], plan.key_ranges(rank, call.key_chunks))
    regions = mask.__dict__.setdefault(_REGIONS, {})
    if where not in regions:
        regions[where] = region(mask, *where)
    return regions[where]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskDescription, scale: float | None,
            out: torch.Tensor | None, lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``q`` over ``k``, ``v`` under ``mask`` (a region), into ``out`` when given; with ``lse``,
    (output, log-sum-exp). stof_cc.attention on GPUs; the torch reference on the CPU (gloo ranks),
    where there are no kernels."""
    if q.is_cuda:
        return attention(q, k, v, mask, scale, out=out, return_lse=lse)
    dense = mask.to_dense(q.shape[-2], k.shape[-2], q.shape[0], q.shape[1])
    result = masked_attention(q, k, v, dense, scale)
    if out is not None:
        result = out.copy_(result)
    return (result, masked_lse(q, k, dense, scale)) if lse else result
