"""The all-reduce of two tensor-parallel ranks without a transfer after its GEMM.

The row-parallel GEMM before an all-reduce (attention's output projection, the MLP's down
projection) stores each output box twice (gemm_epilogue's `mirrored`): into its own output and,
through a second tensor map, into the other rank's receive buffer, a tensor in torch's symmetric
memory (`torch.distributed._symmetric_memory`, mapped over NVLink). The boxes cross while the
GEMM's later tiles compute, so the all-reduce is then a barrier (both ranks' GEMMs done, its
stores landed) and the add of the received partial, in place. On two H200s NCCL's all-reduce of
that 64 MB output took 250-290 us after the GEMM (docs/decisions.md#mirrored-gemm-stores). The
steps hold no NCCL call, so CUDA graphs capture them with the rest (runtime/capture.py).

Every rank must take the same road at every all-reduce, or one waits for ever: the plan is agreed
over the all-reduce's own group (a MIN all-reduce of every rank's flags, at compile time) before
any buffer is made. Taken only where every rank can: a group of two ranks (at W ranks the GEMM
would store W times), a sum in fp16 or bf16, an all-reduce that runs in place on a generated
GEMM's output stored by TMA, and ``STOF_CC_PEER_EXCHANGE`` not "0". Anything else keeps NCCL.

The receive slots alternate (two, or three for an odd count so that a call's last and the next
call's first differ): the peer writes slot s during its GEMM, which starts after the barrier of
the exchange before, and this rank reaches that barrier only after reading the slot's previous
contents (one exchange a call: a barrier before its GEMM too)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from stof_cc.ir.graph import Graph, Ref
from stof_cc.runtime.collectives import ALL_REDUCE

SWITCH = "STOF_CC_PEER_EXCHANGE"  # "0": every all-reduce through NCCL
SLOT_ALIGN = 1024  # bytes: every slot starts at a TMA-aligned address


@dataclass
class PeerExchange:
    """One variant's receive slots in symmetric memory, rendezvoused over a group of two ranks."""

    group_name: str
    slots: int
    slot_bytes: int
    buffer: torch.Tensor = field(repr=False)  # this rank's slots (held: the handle maps this allocation)
    handle: Any = field(repr=False)  # torch's _SymmetricMemory over the group
    before_gemm: bool  # one exchange a call: the peer may write its slot only after this rank read it

    @classmethod
    def create(cls, group_name: str, exchanges: int, slot_bytes: int, device: torch.device) -> PeerExchange:
        import torch.distributed._symmetric_memory as symm_mem

        slots = 1 if exchanges == 1 else 2 if exchanges % 2 == 0 else 3
        slot_bytes = -(-slot_bytes // SLOT_ALIGN) * SLOT_ALIGN
        buffer = symm_mem.empty(slots * slot_bytes, dtype=torch.uint8, device=device)
        return cls(group_name, slots, slot_bytes, buffer, symm_mem.rendezvous(buffer, group_name), exchanges == 1)

    def slot_of(self, index: int, exchanges: int) -> int:
        """The slot of a call's ``index``-th exchange of ``exchanges``: alternating, the last of an odd
        count in a third (it differs from the next call's first)."""
        if self.slots == 3 and index == exchanges - 1:
            return 2
        return index % min(self.slots, 2)

    def _view(self, rank: int, slot: int, like: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.handle.get_buffer(rank, tuple(like), dtype, slot * self.slot_bytes // dtype.itemsize)

    def peer_slot(self, slot: int, like: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The other rank's slot as a tensor here (its memory, mapped): where the mirrored GEMM stores."""
        if self.before_gemm:
            self.handle.barrier(channel=1)
        return self._view(1 - self.handle.rank, slot, like, dtype)

    def finish(self, slot: int, value: torch.Tensor) -> torch.Tensor:
        """The all-reduce of ``value`` (this rank's partial, which the GEMM also stored into the peer's
        slot): once both ranks' GEMMs are done, ``value`` plus the peer's partial, in place."""
        self.handle.barrier(channel=0)
        return value.add_(self._view(self.handle.rank, slot, value.shape, value.dtype))


@dataclass(frozen=True)
class Candidate:
    """An all-reduce this rank could run by peer stores: its node, its group, the kernel step
    that writes its input and the all-reduce's step (indices into the variant's steps)."""

    node: str
    group_name: str
    kernel_step: int
    reduce_step: int


def all_reduce_nodes(graph: Graph) -> list[str]:
    """Every all-reduce of the graph, in graph order (the same list on every rank)."""
    return [node.name for node in graph.nodes() if node.op == "opaque" and str(node.target) == ALL_REDUCE]


def candidate(graph: Graph, name: str, steps: list[Any]) -> Candidate | None:
    """The all-reduce ``name`` as a `Candidate` on this rank, or None: it runs in place (its step's
    ``in_place``) on the output of a gemm_epilogue kernel that leaves through TMA stores, sums fp16 or
    bf16, over a group of two ranks."""
    from stof_cc.templates.gemm_epilogue import GemmEpilogueTemplate

    node = graph.node(name)
    source, reduce_op, group_name = node.args[:3]
    if reduce_op != "sum" or not isinstance(source, Ref) or not isinstance(group_name, str):
        return None
    reduce_step = next((i for i, step in enumerate(steps) if name in step.in_place), None)
    kernel_step = next((i for i, step in enumerate(steps)
                        if step.kind == "kernel" and step.kernel[1].output == source.name), None)
    if reduce_step is None or kernel_step is None:
        return None
    template, problem, _ = steps[kernel_step].kernel
    if type(template) is not GemmEpilogueTemplate or not problem.details.tma_store:
        return None
    if problem.dtype not in (torch.float16, torch.bfloat16) or _group_size(group_name) != 2:
        return None
    return Candidate(name, group_name, kernel_step, reduce_step)


def _group_size(group_name: str) -> int:
    import torch.distributed as dist

    try:
        return dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))
    except (RuntimeError, ValueError, KeyError):
        return 0


def agreed(graph: Graph, steps: list[Any], device: torch.device) -> list[Candidate]:
    """The all-reduces every rank of their group runs by peer stores: this rank's candidates, kept
    where every rank has the same one (a MIN all-reduce of flags over the group, on ``device``: the
    group's backend must take it; the graphs' all-reduce counts are compared first). A collective call
    on every rank, at compile time."""
    import torch.distributed as dist

    names = all_reduce_nodes(graph)
    if not names:
        return []
    group_name = graph.node(names[0]).args[2]  # the same on every rank: the agreement's group
    if not isinstance(group_name, str) or _group_size(group_name) != 2:
        return []  # not a two-rank group: every rank sees the same, so none asks the others
    found = {name: candidate(graph, name, steps) for name in names}
    process_group = dist.distributed_c10d._resolve_process_group(group_name)

    def everyone(values: list[int]) -> list[int]:
        both = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=process_group)
        return both.tolist()

    count, minus_count = everyone([len(names), -len(names)])  # one size on every rank: the flags' length next
    if count != -minus_count:  # another rank's graph holds other all-reduces: every rank sees it
        return []
    switched_on = os.environ.get(SWITCH, "1") != "0" and _symmetric_memory_here()
    flags = everyone([int(switched_on and found[n] is not None and found[n].group_name == group_name) for n in names])
    return [found[name] for name, flag in zip(names, flags, strict=True) if flag]


def _symmetric_memory_here() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def attach(graph: Graph, steps: list[Any], device: torch.device) -> PeerExchange | None:
    """Run the `agreed` all-reduces by peer stores: each one's GEMM step mirrored (compiled again) and
    told its slot (``step.mirror``), each all-reduce step given it (``step.exchanged``); None where no
    all-reduce is taken. A collective call on every rank of the group, at compile time."""
    from stof_cc.backends.group_launch import GroupLaunch
    from stof_cc.backends.nvcc import compile_many
    from stof_cc.backends.pycuda_backend import device_arch
    from stof_cc.templates.gemm_epilogue import mirrored

    taken = sorted(agreed(graph, steps, device), key=lambda c: c.reduce_step)
    if not taken:
        return None
    outputs = [steps[c.kernel_step].kernel[1] for c in taken]
    exchange = PeerExchange.create(taken[0].group_name, len(taken), max(math.prod(p.shape) * p.dtype.itemsize for p in outputs),
                                   device)
    kernels = [(template, mirrored(problem), params)
               for template, problem, params in (steps[c.kernel_step].kernel for c in taken)]
    arch = device_arch()
    errors = compile_many([(t.render(p, params), arch + t.arch_features) for t, p, params in kernels])
    if any(errors):  # every rank compiles the same sources: none takes a road the others do not
        raise RuntimeError(f"stof_cc: a mirrored GEMM did not compile: {next(e for e in errors if e).splitlines()[0]}")
    for index, (c, kernel) in enumerate(zip(taken, kernels, strict=True)):
        slot = exchange.slot_of(index, len(taken))
        kernel_step, reduce_step = steps[c.kernel_step], steps[c.reduce_step]
        kernel_step.kernel, kernel_step.launch, kernel_step.mirror = kernel, GroupLaunch(*kernel), (exchange, slot)
        kernel_step.note += f"; also stores its output into the other rank's slot {slot} (%{c.node} by peer stores)"
        reduce_step.exchanged[c.node] = (exchange, slot)
        reduce_step.note += f"; %{c.node}: the peer's partial, stored by its GEMM, added (slot {slot}), no NCCL"
    return exchange
