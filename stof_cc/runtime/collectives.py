"""The torch.distributed collectives of a tensor-parallel rank's graph (functional c10d ops that
AOTAutograd writes), as a compiled model runs them.

An ``all_reduce`` whose input no later step reads runs in place on that input
(``_c10d_functional.all_reduce_``): the functional op clones its input first, a copy of the whole
activation (64 MB at hidden 8192, S = 4096) that nothing needs, and in place the reduced value
stays where the CUDA graph before it wrote it, which the graph after it was captured reading
(runtime/capture.py)."""

from __future__ import annotations

from typing import Any

import torch

from stof_cc.ir.graph import Graph, Ref

ALL_REDUCE = "_c10d_functional.all_reduce.default"


def is_collective(node: Any) -> bool:
    """Whether an IR node is a torch.distributed collective (a functional c10d op)."""
    return node.op == "opaque" and "_c10d_functional" in str(node.target)


def in_place_all_reduces(graph: Graph, nodes: list[str], dying: list[str], fresh: set[str]) -> tuple[str, ...]:
    """The all-reduce nodes among ``nodes`` (one step's) that may run in place: their input is a
    value a generated kernel wrote (``fresh``: a tensor of its own, no view of another value), it
    dies at this step (``dying``), the all-reduce is its only reader in the whole graph (a view of
    it made by an earlier step shares its memory, and would read the reduced sum: found by review),
    and it is no graph output."""
    found = []
    for name in nodes:
        node = graph.node(name)
        if str(node.target) != ALL_REDUCE or not isinstance(node.args[0], Ref):
            continue
        source = node.args[0].name
        readers = {user.name for user in graph.users(source)}
        if source in fresh and source in dying and readers == {name} and not graph.is_output(source):
            found.append(name)
    return tuple(found)


def all_reduce_in_place(graph: Graph, name: str, env: dict[str, Any]) -> torch.Tensor:
    """Run the all-reduce node ``name`` in place on its input's value (see `in_place_all_reduces`);
    the functional op (a reduced copy) where that value is not contiguous, which NCCL needs."""
    source, reduce_op, group = graph.node(name).args[:3]
    value = env[source.name]
    if not value.is_contiguous():
        return torch.ops._c10d_functional.all_reduce.default(value, reduce_op, group)
    return torch.ops._c10d_functional.all_reduce_.default(value, reduce_op, group)


def wait(value: Any) -> Any:
    """A collective's result made complete on the current stream (a no-op for any other tensor)."""
    return torch.ops._c10d_functional.wait_tensor.default(value) if isinstance(value, torch.Tensor) else value
