"""The all-reduce of two tensor-parallel ranks without a transfer after its GEMM.

The row-parallel GEMM before an all-reduce (attention's output projection, the MLP's down
projection) stores each output box twice (gemm_epilogue's `mirrored`): into its own output and,
through a second tensor map, into the other rank's receive buffer, a tensor in torch's symmetric
memory (`torch.distributed._symmetric_memory`, mapped over NVLink). The boxes cross while the
GEMM's later tiles compute, so the all-reduce is then a barrier (both ranks' GEMMs done, its
stores landed) and the add of the received partial: in the one generated kernel that reads the
all-reduced value, rebuilt to add it as it loads the value and round the sum as the add would
(`consumer_adding`: a residual add, a norm's prologue), else in place after the barrier. On two H200s NCCL's all-reduce of
that 64 MB output took 250-290 us after the GEMM, and the separate add 45 us
(docs/decisions.md#mirrored-gemm-stores). The steps hold no NCCL call, so CUDA graphs capture
them with the rest (runtime/capture.py).

Every rank must take the same road at every all-reduce, or one waits for ever: the plan is agreed
over the group of the graph's all-reduces (the first one's; all-reduces over another group keep
NCCL) by a MIN all-reduce of every rank's flags at the graph's first compile, after the mirrored
kernels compiled and loaded, before any buffer is made; a compile of the same graph again takes
that plan without asking (`attach`). Taken only where every rank can: a group of two ranks (at W
ranks the GEMM would store W - 1 times), a sum in fp16 or bf16, an all-reduce that runs in place on
a generated GEMM's output stored by TMA, and ``STOF_CC_PEER_EXCHANGE`` not "0". Anything else
keeps NCCL. Each graph holds two or three slots of its largest all-reduced output in symmetric
memory (128 MB at Llama-70B's TP = 2 layer, S = 4096).

The receive slots alternate (two, or three for an odd count so that a call's last and the next
call's first differ): the peer writes slot s during its GEMM, which starts after the barrier of
the exchange before, and this rank reaches that barrier only after reading the slot's previous
contents (one exchange a call: a barrier before its GEMM too). A consumer that adds the received
partial reads the slot later than the barrier, so it is taken only where it runs before the next
exchange's barrier."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from stof_cc.ir.graph import Graph, Ref
from stof_cc.ir.node import Node
from stof_cc.runtime.collectives import ALL_REDUCE

SWITCH = "STOF_CC_PEER_EXCHANGE"  # "0": every all-reduce through NCCL
SLOT_ALIGN = 1024  # bytes: every slot starts at a TMA-aligned address


@dataclass
class PeerExchange:
    """One graph's receive slots in symmetric memory, rendezvoused over a group of two ranks (kept for
    the process: a compile of the graph again takes them, `attach`)."""

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

    def received(self, slot: int, value: torch.Tensor) -> torch.Tensor:
        """The other rank's partial of ``value``'s all-reduce (this rank's partial, which the GEMM also
        stored into the peer's slot), in this rank's slot, once both ranks' GEMMs are done (a barrier)."""
        self.handle.barrier(channel=0)
        return self._view(self.handle.rank, slot, value.shape, value.dtype)

    def finish(self, slot: int, value: torch.Tensor) -> torch.Tensor:
        """The all-reduce of ``value``: ``value`` plus the received partial, in place."""
        return value.add_(self.received(slot, value))


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


def agreed(names: list[str], found: dict[str, Candidate | None], group_name: str,
           device: torch.device) -> list[str]:
    """The all-reduces of ``names`` (the graph's, in order) that every rank of ``group_name`` runs by
    peer stores: those where every rank has a candidate in ``found`` (a MIN all-reduce of flags over the
    group, on ``device``: the group's backend must take it; the graphs' all-reduce counts are compared
    first). A collective call on every rank, at compile time."""
    import torch.distributed as dist

    process_group = dist.distributed_c10d._resolve_process_group(group_name)

    def everyone(values: list[int]) -> list[int]:
        both = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=process_group)
        return both.tolist()

    count, minus_count = everyone([len(names), -len(names)])  # one size on every rank: the flags' length next
    if count != -minus_count:  # another rank's graph holds other all-reduces: every rank sees it
        return []
    flags = everyone([int(found.get(name) is not None) for name in names])
    return [name for name, flag in zip(names, flags, strict=True) if flag]


def _symmetric_memory_here() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def attach(graph: Graph, steps: list[Any], device: torch.device) -> PeerExchange | None:
    """Run the all-reduces that every rank can by peer stores: each one's GEMM step mirrored and told its
    slot (``step.mirror``), each all-reduce step given it (``step.exchanged``); None where none is taken.
    The mirrored kernels are compiled and loaded before the ranks agree, so a failure here keeps NCCL on
    every rank. The first compile of a graph asks every rank of the group (collective calls); a graph
    compiled again (new weights, a hook, ``refresh()``) on one rank only takes its first plan and slots
    without asking, and raises where that plan no longer fits its steps: asking would pair with the
    other rank's next all-reduce, or wait for ever."""
    names = all_reduce_nodes(graph)
    group_name = graph.node(names[0]).args[2] if names else None  # the same on every rank: the agreement's
    if not isinstance(group_name, str) or _group_size(group_name) != 2:
        return None  # not a two-rank group: every rank sees the same, so none asks the others
    switched_on = os.environ.get(SWITCH, "1") != "0" and _symmetric_memory_here()  # off here: none agreed
    ready = _mirrored_here(graph, names, group_name, steps) if switched_on else {}
    key = (graph.name, group_name, tuple((name, str(graph.node(name).spec)) for name in names))
    if key in _PLANS:
        taken, exchange = _PLANS[key]
        missing = [name for name in taken if name not in ready]
        if missing:
            raise RuntimeError(f"stof_cc: graph {graph.name} compiled again on this rank, and the all-reduce(s) "
                               f"{', '.join('%' + n for n in missing)} that every rank agreed to run by peer stores "
                               "can no longer (their GEMM is not a generated kernel now); recompile on every rank "
                               f"together in a new process, or set {SWITCH}=0")
    else:
        taken = tuple(agreed(names, {name: entry[0] for name, entry in ready.items()}, group_name, device))
        exchange = None
        if taken:
            outputs = [steps[ready[name][0].kernel_step].kernel[1] for name in taken]
            exchange = PeerExchange.create(group_name, len(taken),
                                           max(math.prod(p.shape) * p.dtype.itemsize for p in outputs), device)
        _PLANS[key] = (taken, exchange)
    slots = {name: exchange.slot_of(index, len(taken)) for index, name in enumerate(taken)}
    for name in taken:
        (c, kernel, launch), slot = ready[name], slots[name]
        kernel_step = steps[c.kernel_step]
        kernel_step.kernel, kernel_step.launch, kernel_step.mirror = kernel, launch, (exchange, slot)
        kernel_step.note += f"; also stores its output into the other rank's slot {slot} (%{name} by peer stores)"
    adding = _consumers_adding(graph, steps, [ready[name][0] for name in taken])  # after the mirrors: it skips them
    for name in taken:
        reduce_step, slot, received, where = steps[ready[name][0].reduce_step], slots[name], None, ""
        if name in adding:
            index, kernel, launch, received = adding[name]
            consumer = steps[index]
            consumer.kernel, consumer.launch = kernel, launch
            consumer.adds_received[graph.users(name)[0].name] = (name, received)
            consumer.note += f"; adds the other rank's partial of %{name} as it reads it (no separate add)"
            where = f" by group {consumer.group.name} as it reads it"
        reduce_step.exchanged[name] = (exchange, slot, received)
        reduce_step.note += f"; %{name}: the peer's partial, stored by its GEMM, added{where} (slot {slot}), no NCCL"
    return exchange


def consumer_adding(graph: Graph, steps: list[Any], c: Candidate) -> tuple[int, tuple, str] | None:
    """The kernel step that reads ``c``'s all-reduced value (through its wait), rebuilt to add the
    received partial itself as it loads the value: (step index, its kernel (template, problem,
    params), the received partial's value name), or None where no one generated kernel reads the
    value alone or its template does not take the rebuilt group at the step's point. The rebuilt
    group reads this rank's partial (%all_reduce: the GEMM's output) and the received one and rounds
    their sum to the dtype, as the add after the barrier and NCCL do: the two roads give the same
    bits, so each rank may take either. At Llama-70B's TP = 2 layer the separate add's 64 MB
    read-modify-write (45 us on an H200) becomes one more 64 MB read in that kernel."""
    users = graph.users(c.node)
    if len(users) != 1 or "wait_tensor" not in str(users[0].target) or graph.is_output(c.node):
        return None
    wait = users[0]
    readers = graph.users(wait.name)
    index = next((i for i, step in enumerate(steps) if readers and readers[0].name in step.group.nodes), None)
    if index is None or graph.is_output(wait.name):
        return None
    step = steps[index]
    if step.kind != "kernel" or step.mirror is not None or any(r.name not in step.group.nodes for r in readers):
        return None
    received, summed = graph.fresh_name(f"{c.node}_received"), graph.fresh_name(f"{c.node}_summed")

    def add_received(node: Node, rebuilt: Graph) -> Node:  # the wait becomes the rounded sum of the two partials
        if node.name != wait.name:
            return node
        rebuilt.add_input(received, node.spec)
        rebuilt.add_node(Node(summed, "add", args=(Ref(c.node), Ref(received)), spec=node.spec))
        return Node(wait.name, "cast", target="aten._to_copy.default", args=(Ref(summed),),
                    kwargs={"dtype": node.spec.dtype}, spec=node.spec)

    from stof_cc.templates.group import applicable_templates
    from stof_cc.templates.pricing import target_capability

    rebuilt = graph.rebuild(add_received)
    template, _, params = step.kernel
    group = replace(step.group, nodes=(summed, wait.name, *step.group.nodes))
    found, _ = applicable_templates(rebuilt, group, target_capability())
    same = next((a for a in found if type(a.template) is type(template)), None)
    if same is None or params not in same.space:
        return None
    return index, (same.template, same.problem, params), received


def in_time(graph: Graph, steps: list[Any], taken: list[Candidate]) -> dict[str, tuple[int, tuple, str]]:
    """`consumer_adding` of each taken all-reduce whose consumer runs before the next exchange's barrier
    (in step order: after that barrier the other rank may write the slot again), one all-reduce per
    consumer. A consumer that cannot be rebuilt (any error) keeps the add after the barrier, with a
    warning: the agreement is made, so this rank must not fail now while the other waits."""
    found: dict[str, tuple[int, tuple, str]] = {}
    ordered = sorted(taken, key=lambda c: c.reduce_step)
    for i, c in enumerate(ordered):
        try:
            rebuilt = consumer_adding(graph, steps, c)
        except Exception as why:  # noqa: BLE001 (the add after the barrier keeps the answer, to the bit)
            warnings.warn(f"stof_cc: the kernel after %{c.node} could not be rebuilt to add the other rank's partial "
                          f"({type(why).__name__}: {why}); that partial is added after the barrier", stacklevel=2)
            continue
        if rebuilt is None or (i + 1 < len(ordered) and rebuilt[0] >= ordered[i + 1].reduce_step):
            continue
        if all(rebuilt[0] != index for index, _, _ in found.values()):
            found[c.node] = rebuilt
    return found


def _consumers_adding(graph: Graph, steps: list[Any], taken: list[Candidate]) -> dict[str, tuple]:
    """Per `in_time` consumer whose kernel compiled and loaded: (step index, kernel, its `GroupLaunch`,
    received name). This rank's choice alone: both ranks meet at the same barriers and hold the
    same bits whichever adds; a kernel that fails keeps the add after the barrier, with a warning."""
    found = in_time(graph, steps, taken)
    launches = _loaded({name: kernel for name, (_, kernel, _) in found.items()},
                       "the kernel that would add the other rank's partial of %{name} did not compile or load "
                       "({why}); that partial is added after the barrier")
    return {name: (index, kernel, launches[name], received)
            for name, (index, kernel, received) in found.items() if name in launches}


def _loaded(kernels: dict[str, tuple], failure: str) -> dict[str, Any]:
    """name -> the `GroupLaunch` of each of ``kernels`` (name -> (template, problem, params)) that
    compiled (nvcc, in parallel) and loaded; each other one is warned about (``failure``, formatted
    with the name and why) and left out, also when the compile itself raises (an unusable kernel
    cache): a rank must not fail alone here while the other waits for it in a collective."""
    from stof_cc.backends.group_launch import GroupLaunch
    from stof_cc.backends.nvcc import compile_many
    from stof_cc.backends.pycuda_backend import device_arch

    if not kernels:
        return {}
    try:
        arch = device_arch()
        errors = compile_many([(t.render(p, params), arch + t.arch_features) for t, p, params in kernels.values()])
    except Exception as why:  # noqa: BLE001 (as for a kernel that failed)
        errors = [f"{type(why).__name__}: {why}"] * len(kernels)
    launches = {}
    for (name, kernel), error in zip(kernels.items(), errors, strict=True):
        try:
            if error:
                raise RuntimeError(error.splitlines()[0])
            launches[name] = GroupLaunch(*kernel)
        except Exception as why:  # noqa: BLE001 (the caller's fallback keeps the answer)
            warnings.warn("stof_cc: " + failure.format(name=name, why=why), stacklevel=3)
    return launches


def in_turn(found: list[Candidate]) -> list[Candidate]:
    """``found`` in step order, each kept where its GEMM comes after the step of the all-reduce kept
    before it: the slots' alternation rests on a barrier between one exchange's add and the peer's
    next mirrored GEMM, which two GEMMs before their all-reduces would not have (found by review)."""
    kept, last_reduce = [], -1
    for c in sorted(found, key=lambda c: c.reduce_step):
        if c.kernel_step > last_reduce:
            kept.append(c)
            last_reduce = c.reduce_step
    return kept


# The plan each graph's first compile agreed (`attach`), by graph name, group and all-reduces
_PLANS: dict[tuple, tuple[tuple[str, ...], PeerExchange | None]] = {}


def _mirrored_here(graph: Graph, names: list[str], group_name: str, steps: list[Any]) -> dict[str, tuple]:
    """This rank's candidates over ``group_name``, taken `in_turn`, whose mirrored GEMM compiled and
    loaded: name -> (`Candidate`, the mirrored kernel (template, problem, params), its `GroupLaunch`).
    One that fails keeps NCCL on every rank: `attach` agrees after."""
    from stof_cc.templates.gemm_epilogue import mirrored

    found = [c for c in (candidate(graph, name, steps) for name in names) if c is not None and c.group_name == group_name]
    ordered = {c.node: c for c in in_turn(found)}
    kernels = {name: (template, mirrored(problem), params)
               for name, (template, problem, params) in ((n, steps[c.kernel_step].kernel) for n, c in ordered.items())}
    launches = _loaded(kernels, "the mirrored GEMM before %{name} did not compile or load ({why}); that all-reduce "
                                "runs in NCCL")
    return {name: (ordered[name], kernels[name], launches[name]) for name in kernels if name in launches}
