"""Context parallelism for masked attention: one long sequence split over the ranks of a
torch.distributed process group, each rank computing the attention of its own queries.

The sequence is cut into chunks. With ``balanced=True`` (the default) there are 2 x world of
them and rank r holds chunks r and 2 x world - 1 - r, so under a causal mask every rank has the
same work (the load-balanced sharding of ring attention); otherwise rank r holds chunk r.
`shard_sequence` and `gather_sequence` move a full-sequence tensor to and from that layout.

`context_parallel_attention(q, k, v, mask, group)` takes each rank's shards. From the mask's
exact block classes (`ContextParallelPlan`, made once per mask and size), each rank learns which
key/value chunks each of its query chunks sees; it receives exactly those from their owners
(NCCL point-to-point through torch.distributed), never a chunk its queries do not see: under a
document mask whose documents lie within chunks nothing moves at all, under a sliding window only
the neighbouring chunk, where a ring sends every chunk to every rank. While the chunks travel, each
query chunk attends to the key chunks the rank holds; then to the received ones, laid side by side,
and the two partial results merge by log-sum-exp. Each call runs `stof_cc.attention` with the
matching rectangle of the mask (`masks.region`: FULL blocks stay FULL, EMPTY ones are skipped).
Each rank computes whole rows, so nothing is merged across ranks.

Not built yet: sending only the rows of a chunk that a query chunk sees (a sliding window needs
w rows of its neighbour, and gets the whole chunk), and
`torch.distributed.tensor.experimental.context_parallel`'s buffer conventions. On the CPU
(gloo ranks) each chunk runs through the torch reference instead of the kernels.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    """Which key/value chunks each query chunk sees, and so what each rank sends and receives."""

    seq: int
    world: int
    balanced: bool
    chunk: int
    sees: tuple[tuple[int, ...], ...]  # per query chunk: the key chunks with an allowed key, ascending

    def owner(self, chunk: int) -> int:
        return chunk if not self.balanced or chunk < self.world else 2 * self.world - 1 - chunk

    def receives(self, rank: int) -> list[tuple[int, int]]:
        """(source rank, chunk) pairs rank ``rank`` receives, in the order both sides post them."""
        mine = rank_chunks(rank, self.world, self.balanced)
        wanted = sorted({c for q in mine for c in self.sees[q]} - set(mine))
        return [(self.owner(c), c) for c in wanted]

    def sends(self, rank: int) -> list[tuple[int, int]]:
        """(destination rank, chunk) pairs rank ``rank`` sends, in the order both sides post them."""
        return [(dest, c) for dest in range(self.world) if dest != rank
                for source, c in self.receives(dest) if source == rank]

    def bytes_sent(self, rank: int, chunk_bytes: int) -> int:
        """What ``rank`` sends for one call, with ``chunk_bytes`` per key/value chunk (K and V)."""
        return len(self.sends(rank)) * chunk_bytes

    def ring_bytes_sent(self, chunk_bytes: int) -> int:
        """What a ring (every rank's chunks to every other rank) sends per rank."""
        return (self.world - 1) * len(rank_chunks(0, self.world, self.balanced)) * chunk_bytes


# per mask (weakly: a mask's id is reused once it is freed), its plans by sizes; its regions live on
# the mask itself (a region holds its parent: a weak-keyed table of them would keep every mask alive)
_plans: weakref.WeakKeyDictionary[MaskDescription, dict[tuple, ContextParallelPlan]] = weakref.WeakKeyDictionary()
_REGIONS = "_context_parallel_regions"
_joined: set[str] = set()  # the groups every rank has met in a collective (NCCL's communicator is made)


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
        factor = chunk // CLASS_BLOCK
        classes = mask.block_runs(seq, seq, CLASS_BLOCK, CLASS_BLOCK, batch, heads).coarsen(factor, factor).to_dense()
        seen = (classes != EMPTY).flatten(0, 1).any(0)  # [query chunk, key chunk], over batch and heads
        plans[key] = ContextParallelPlan(seq, world, balanced, chunk,
                                         tuple(tuple(seen[q].nonzero().flatten().tolist()) for q in range(n)))
    return plans[key]


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskDescription,
                               group: dist.ProcessGroup | None = None, scale: float | None = None,
                               balanced: bool = True) -> torch.Tensor:
    """Masked attention of this rank's query shard over the whole sequence: q, k, v [B, H, S / world, D]
    (K/V may have fewer heads) laid out as `shard_sequence` lays them; returns this rank's rows
    of the output in the same layout. Every rank of ``group`` calls it with the same mask.

    The transfers overlap the compute: each query chunk attends to the key chunks this rank holds
    while the others arrive, then to the received ones, and the two partial results merge by
    log-sum-exp (`merge_partials`)."""
    if not isinstance(mask, MaskDescription):
        raise TypeError(f"context_parallel_attention: mask must be a stof_cc.masks description, got "
                        f"{type(mask).__name__}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = rank_chunks(rank, world, balanced)
    seq = q.shape[-2] * world
    plan = context_parallel_plan(mask, seq, world, balanced, q.shape[0], q.shape[1])
    length = plan.chunk
    keys = {c: k[..., i * length:(i + 1) * length, :] for i, c in enumerate(mine)}
    values = {c: v[..., i * length:(i + 1) * length, :] for i, c in enumerate(mine)}
    in_flight = _post_exchange(plan, rank, group, keys, values, k, v)
    out = torch.empty_like(q)
    local_parts = {}
    for i, chunk in enumerate(mine):  # under the transfers: the key chunks held here
        rows, into = q[..., i * length:(i + 1) * length, :], out[..., i * length:(i + 1) * length, :]
        local = [c for c in plan.sees[chunk] if c in mine]
        remote = len(local) < len(plan.sees[chunk])
        if not plan.sees[chunk]:  # no allowed key: zeros, as stof_cc.attention gives such rows
            into.zero_()
        elif local:
            local_parts[i] = _attend(rows, keys, values, local, mask, seq, chunk, length, scale, into, lse=remote)
    for request in in_flight:
        request.wait()
    for i, chunk in enumerate(mine):  # then the received ones, merged with the local part
        remote = [c for c in plan.sees[chunk] if c not in mine]
        if not remote:
            continue
        rows, into = q[..., i * length:(i + 1) * length, :], out[..., i * length:(i + 1) * length, :]
        if i not in local_parts:
            _attend(rows, keys, values, remote, mask, seq, chunk, length, scale, into, lse=False)
            continue
        received = _attend(rows, keys, values, remote, mask, seq, chunk, length, scale, None, lse=True)
        into.copy_(merge_partials([local_parts[i][0], received[0]], [local_parts[i][1], received[1]])[0])
    return out


def _post_exchange(plan: ContextParallelPlan, rank: int, group: dist.ProcessGroup | None, keys: dict,
                   values: dict, k: torch.Tensor, v: torch.Tensor) -> list:
    """Post the sends of this rank's chunks where the plan says and the receives of the chunks its
    queries see (into ``keys`` / ``values``), K and V of each chunk back to back; returns the
    requests to wait on before reading what they receive."""
    shape = (*k.shape[:-2], plan.chunk, k.shape[-1])
    ops = []
    for dest, chunk in plan.sends(rank):
        peer = dist.get_global_rank(group, dest) if group is not None else dest
        ops += [dist.P2POp(dist.isend, keys[chunk].contiguous(), peer, group),
                dist.P2POp(dist.isend, values[chunk].contiguous(), peer, group)]
    for source, chunk in plan.receives(rank):
        peer = dist.get_global_rank(group, source) if group is not None else source
        keys[chunk] = k.new_empty(shape)
        values[chunk] = v.new_empty((*v.shape[:-2], plan.chunk, v.shape[-1]))
        ops += [dist.P2POp(dist.irecv, keys[chunk], peer, group), dist.P2POp(dist.irecv, values[chunk], peer, group)]
    name = (group or dist.group.WORLD).group_name
    if name not in _joined:  # a first batch_isend_irecv on a group needs every rank in it, and some have no ops
        dist.barrier(group=group)
        _joined.add(name)
    return dist.batch_isend_irecv(ops) if ops else []


def _attend(q: torch.Tensor, keys: dict, values: dict, chunks: list[int], mask: MaskDescription, seq: int,
            chunk: int, length: int, scale: float | None, out: torch.Tensor | None,
            lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Query chunk ``chunk``'s rows ``q`` over key chunks ``chunks`` laid side by side, under the
    matching rectangle of the mask (made once per rectangle and kept on the mask), into ``out``
    when given; with ``lse``, (output, log-sum-exp). stof_cc.attention on GPUs; the torch
    reference on the CPU (gloo ranks), where there are no kernels."""
    regions = mask.__dict__.setdefault(_REGIONS, {})
    where = (seq, chunk * length, length, tuple(chunks))
    if where not in regions:
        regions[where] = region(mask, seq, chunk * length, length, length, chunks)
    k = torch.cat([keys[c] for c in chunks], dim=-2) if len(chunks) > 1 else keys[chunks[0]]
    v = torch.cat([values[c] for c in chunks], dim=-2) if len(chunks) > 1 else values[chunks[0]]
    if q.is_cuda:
        return attention(q, k, v, regions[where], scale, out=out, return_lse=lse)
    dense = regions[where].to_dense(q.shape[-2], k.shape[-2], q.shape[0], q.shape[1])
    result = masked_attention(q, k, v, dense, scale)
    if out is not None:
        result = out.copy_(result)
    return (result, masked_lse(q, k, dense, scale)) if lse else result
