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

from stof_cc.ir.graph import CONSTANT, INPUT, Graph, Ref

ALL_REDUCE = "_c10d_functional.all_reduce.default"


def is_collective(node: Any) -> bool:
    """Whether an IR node is a torch.distributed collective (a functional c10d op)."""
    return node.op == "opaque" and "_c10d_functional" in str(node.target)


def in_place_all_reduces(graph: Graph, nodes: list[str], dying: list[str]) -> tuple[str, ...]:
    """The all-reduce nodes among ``nodes`` (one step's) that may run in place: their input is
    an intermediate value that dies at this step (``dying``) and no other node of the step reads."""
    found = []
    for name in nodes:
        node = graph.node(name)
        if str(node.target) != ALL_REDUCE or not isinstance(node.args[0], Ref):
            continue
        source = node.args[0].name
        readers = [n for n in nodes if any(r.name == source for r in graph.node(n).refs())]
        if source in dying and readers == [name] and graph.node(source).op not in (INPUT, CONSTANT) \
                and not graph.is_output(source):
            found.append(name)
    return tuple(found)


def all_reduce_in_place(graph: Graph, name: str, env: dict[str, Any]) -> torch.Tensor:
    """Run the all-reduce node ``name`` in place on its input's value (see `in_place_all_reduces`)."""
    source, reduce_op, group = graph.node(name).args[:3]
    return torch.ops._c10d_functional.all_reduce_.default(env[source.name], reduce_op, group)
