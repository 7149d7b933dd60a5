"""A compiled variant as CUDA graphs: captured once, replayed every call, in pieces around the
steps a graph must not hold.

Those steps are NCCL's collectives (the all-reduce of a tensor-parallel rank's graph; one taken by
mirrored GEMM stores, runtime/peer_exchange.py, is a barrier and an add, captured). NCCL can run
inside a captured graph, but a communicator that a live graph captured cannot be destroyed:
`torch.distributed.destroy_process_group()` then hangs for ever (pytorch/pytorch#115388; it hung
here on two H100s). So the steps between collectives are captured as graphs that share one
memory pool, and each collective runs eagerly between them. An all-reduce runs in place
(runtime/collectives.py), so its result is already where the next graph reads it; any other
eager result is copied into the tensor the next graph was captured reading.
A variant without collectives is one graph, as before."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stof_cc.runtime.collectives import wait


@dataclass
class _EagerPiece:
    """Steps run outside the graphs: what they read (the graphs' static tensors, held here) and
    the tensors later graphs were captured reading, which each call's results are copied into."""

    steps: list[int]
    reads: dict[Any, Any]
    slots: dict[Any, torch.Tensor]


class CapturedRun:
    """The pieces of one variant in order: CUDA graphs and eager pieces."""

    def __init__(self, pieces: list[torch.cuda.CUDAGraph | _EagerPiece],
                 run_step: Callable[[int, dict[Any, Any]], None]) -> None:
        self.pieces, self.run_step = pieces, run_step

    @property
    def graphs(self) -> int:
        return sum(isinstance(p, torch.cuda.CUDAGraph) for p in self.pieces)

    def replay(self) -> None:
        for piece in self.pieces:
            if isinstance(piece, torch.cuda.CUDAGraph):
                piece.replay()
                continue
            env = dict(piece.reads)
            for index in piece.steps:
                self.run_step(index, env)
            for name, slot in piece.slots.items():
                value = wait(env[name])  # a collective's result is complete before a graph reads it
                if value.data_ptr() != slot.data_ptr():  # an all-reduce in place is there already
                    slot.copy_(value)


def capture(eager: Sequence[bool], run_step: Callable[[int, dict[Any, Any]], None], env: dict[Any, Any],
            stream: torch.cuda.Stream) -> CapturedRun:
    """Run every step once on ``env`` (static inputs and constants; it ends holding the static
    outputs), capturing each stretch of steps with ``eager[i]`` False as a CUDA graph on
    ``stream``, all in one memory pool (they replay in the order captured). ``run_step(i, env)``
    runs step ``i`` and drops the values that die after it."""
    pool = torch.cuda.graph_pool_handle()
    pieces: list[torch.cuda.CUDAGraph | _EagerPiece] = []
    start = 0
    with torch.cuda.stream(stream):
        while start < len(eager):
            end = start
            while end < len(eager) and eager[end] == eager[start]:
                end += 1
            if eager[start]:
                reads = dict(env)  # the values alive here: static tensors the eager steps may read
                before = {name: id(value) for name, value in env.items()}
                for index in range(start, end):
                    run_step(index, env)
                slots = {name: wait(value) for name, value in env.items()
                         if isinstance(value, torch.Tensor) and before.get(name) != id(value)}
                untracked = sorted(str(name) for name, value in env.items()
                                   if not isinstance(value, torch.Tensor) and before.get(name) != id(value))
                if untracked:  # a later graph would read them as they were at capture
                    raise RuntimeError(f"stof_cc: steps outside the CUDA graphs wrote non-tensor values "
                                       f"({', '.join(untracked)}), which the graphs after them cannot follow")
                pieces.append(_EagerPiece(list(range(start, end)), reads, slots))
            else:
                graph = torch.cuda.CUDAGraph()
                # thread-local: another thread's CUDA work during the capture is not an error (global mode
                # refuses every thread's unsafe calls while any stream captures)
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    for index in range(start, end):
                        run_step(index, env)
                pieces.append(graph)
            start = end
    return CapturedRun(pieces, run_step)
