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

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from stof_cc.ir.reference import masked_attention, masked_lse
from stof_cc.masks import EMPTY, MaskDescription
from stof_cc.masks.region import region
from stof_cc.runtime.attention import attention, merge_partials

CLASS_BLOCK = 128  # the block side at which the plan reads the mask's classes (each chunk holds whole blocks)


def rank_chunks(rank: int, world: int, balanced: bool = True) -> list[int]:
    """The chunks rank ``rank`` holds, in the order its shard lays them out."""
    return [rank, 2 * world - 1 - rank] if balanced else [rank]


def _chunks(world: int, balanced: bool) -> int:
    return 2 * world if balanced else world


def shard_sequence(x: torch.Tensor, rank: int, world: int, balanced: bool = True, dim: int = -2) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor (its chunks along ``dim``, side by side)."""
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
                               balanced: bool = True, overlap: bool = True) -> torch.Tensor:
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
    transfers."""
    if not isinstance(mask, MaskDescription):
        raise TypeError(f"context_parallel_attention: mask must be a stof_cc.masks description, got "
                        f"{type(mask).__name__}")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"context_parallel_attention: a device mesh must be 1-D (the context-parallel "
                             f"dimension), got {group.ndim} dimensions; pass mesh['cp'] or its group")
        group = group.get_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if k.shape[-2] != q.shape[-2] or v.shape[:-1] != k.shape[:-1] or k.shape[0] != q.shape[0]:
        raise ValueError(f"context_parallel_attention: q, k and v must be [B, H, S / world, D] shards of one "
                         f"sequence (K and V alike); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    mine = rank_chunks(rank, world, balanced)
    seq = q.shape[-2] * world
    plan = context_parallel_plan(mask, seq, world, balanced, q.shape[0], q.shape[1])
    length = plan.chunk
    pieces = {c: (k[..., i * length:(i + 1) * length, :], v[..., i * length:(i + 1) * length, :], c * length)
              for i, c in enumerate(mine)}  # per chunk: its keys and values here, and the first one's position
    in_flight = _post_exchange(plan, rank, group, pieces)
    out = torch.empty_like(q)
    local_lse = {}
    for i, chunk in enumerate(mine):  # under the transfers (with overlap): the key chunks held here
        into = out[..., i * length:(i + 1) * length, :]
        local = [c for c in plan.sees[chunk] if c in mine]
        if not plan.sees[chunk]:  # no allowed key: zeros, as stof_cc.attention gives such rows
            into.zero_()
        elif overlap and local:
            remote = len(local) < len(plan.sees[chunk])
            shard_keys = (k, v) if local == mine else None  # both held chunks: the shard itself, uncopied
            found = _attend(q[..., i * length:(i + 1) * length, :], pieces, local, mask, seq, chunk * length,
                            scale, into, remote, shard_keys)
            if remote:
                local_lse[i] = found[1]
    for request in in_flight:
        request.wait()
    for i, chunk in enumerate(mine):  # then the received rows
        into = out[..., i * length:(i + 1) * length, :]
        remote = [c for c in plan.sees[chunk] if c not in mine]
        if not overlap:
            if plan.sees[chunk]:
                _attend(q[..., i * length:(i + 1) * length, :], pieces, list(plan.sees[chunk]), mask, seq,
                        chunk * length, scale, into, False)
            continue
        if not remote:
            continue
        if len(remote) == len(plan.sees[chunk]):  # nothing held: one call over what arrived
            _attend(q[..., i * length:(i + 1) * length, :], pieces, remote, mask, seq, chunk * length, scale,
                    into, False)
            continue
        lo, hi = plan.query_rows(chunk, remote)
        rows = q[..., i * length + lo:i * length + hi, :]
        received, received_lse = _attend(rows, pieces, remote, mask, seq, chunk * length + lo, scale, None, True)
        part = into[..., lo:hi, :]
        merge_partials([part, received], [local_lse[i][..., lo:hi], received_lse], into=part)
    return out


def _post_exchange(plan: ContextParallelPlan, rank: int, group: dist.ProcessGroup | None, pieces: dict) -> list:
    """Post the sends of the rows of this rank's chunks that the plan says other ranks see, and
    the receives of the rows its queries see (into ``pieces``: keys, values, first position),
    K and V back to back; returns the requests to wait on before reading what they receive."""
    ops = []
    for dest, chunk, lo, hi in plan.sends(rank):
        peer = dist.get_global_rank(group, dest) if group is not None else dest
        keys, values, _ = pieces[chunk]
        ops += [dist.P2POp(dist.isend, keys[..., lo:hi, :].contiguous(), peer, group),
                dist.P2POp(dist.isend, values[..., lo:hi, :].contiguous(), peer, group)]
    held = pieces[rank_chunks(rank, plan.world, plan.balanced)[0]]
    for source, chunk, lo, hi in plan.receives(rank):
        peer = dist.get_global_rank(group, source) if group is not None else source
        keys = held[0].new_empty((*held[0].shape[:-2], hi - lo, held[0].shape[-1]))
        values = held[1].new_empty((*held[1].shape[:-2], hi - lo, held[1].shape[-1]))
        pieces[chunk] = (keys, values, chunk * plan.chunk + lo)
        ops += [dist.P2POp(dist.irecv, keys, peer, group), dist.P2POp(dist.irecv, values, peer, group)]
    joined = group or dist.group.WORLD
    if joined not in _joined:  # a first batch_isend_irecv on a group needs every rank in it, and some have no ops
        dist.barrier(group=group)
        _joined.add(joined)
    return dist.batch_isend_irecv(ops) if ops else []


def _attend(q: torch.Tensor, pieces: dict, chunks: list[int], mask: MaskDescription, seq: int, q_start: int,
            scale: float | None, out: torch.Tensor | None, lse: bool,
            shard_keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Queries ``q`` (from position ``q_start``) over the keys of ``chunks`` that ``pieces`` holds,
    laid side by side (``shard_keys``: those already side by side), under the matching rectangle of
    the mask (made once per rectangle and kept on the mask), into ``out`` when given; with ``lse``,
    (output, log-sum-exp). stof_cc.attention on GPUs; the torch reference on the CPU (gloo ranks),
    where there are no kernels."""
    ranges = tuple((pieces[c][2], pieces[c][0].shape[-2]) for c in chunks)
    regions = mask.__dict__.setdefault(_REGIONS, {})
    where = (seq, q_start, q.shape[-2], ranges)
    if where not in regions:
        regions[where] = region(mask, seq, q_start, q.shape[-2], ranges)
    if shard_keys is not None:
        k, v = shard_keys
    else:
        k, v = (torch.cat([pieces[c][j] for c in chunks], dim=-2) if len(chunks) > 1 else pieces[chunks[0]][j]
                for j in (0, 1))
    if q.is_cuda:
        return attention(q, k, v, regions[where], scale, out=out, return_lse=lse)
    dense = regions[where].to_dense(q.shape[-2], k.shape[-2], q.shape[0], q.shape[1])
    result = masked_attention(q, k, v, dense, scale)
    if out is not None:
        result = out.copy_(result)
    return (result, masked_lse(q, k, dense, scale)) if lse else result
