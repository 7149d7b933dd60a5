"""A compiled model's floor (benchmarks/WORKLOADS.md, issue 34): what its groups would take at
the best speed known for each kind, to report beside its measured time.

- a GEMM group: its linear in cuBLAS (`F.linear` on random operands of the same shapes and dtypes);
- an attention group: the fastest dense kernel (SDPA under the flash and cuDNN backends) on the
  same q, k, v times the density of the node's static mask (key padding, which varies per call,
  counts as dense);
- any other group: the bytes it reads (each outside value once) and writes, at 3 TB/s.

Every GEMM and attention shape is timed once per process (`triton.testing.do_bench`, median).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from stof_cc.ir.graph import Graph, TensorSpec
from stof_cc.passes.attention import attention_arguments
from stof_cc.passes.fusion import FusionGroup, is_views
from stof_cc.tune.attention import node_mask

HBM_BYTES_PER_S = 3.0e12  # what an H100 moves, about, in a streaming kernel


def group_bytes(graph: Graph, group: FusionGroup) -> int:
    """What ``group`` reads from outside it (each value once) and writes (the values read after
    it); views only move nothing."""
    if is_views(graph, group):
        return 0
    inside = set(group.nodes)
    reads = {r.name for n in group.nodes for r in graph.node(n).refs() if r.name not in inside}
    readers = {n: graph.nx_graph.successors(n) for n in group.nodes}
    writes = {n for n, after in readers.items() if any(m not in inside for m in after) or graph.is_output(n)}
    return sum(_bytes(graph.node(name).spec) for name in reads | writes)


def _bytes(spec) -> int:
    return spec.numel * spec.dtype.itemsize if isinstance(spec, TensorSpec) else 0


def group_floor_ms(graph: Graph, group: FusionGroup, timer: Callable[[Callable[[], object]], float],
                   device: str = "cuda") -> float:
    """``group``'s floor in ms (module docstring); ``timer`` times a callable (ms) on ``device``."""
    anchor = graph.node(group.anchor) if group.anchor is not None else None
    if group.kind == "gemm" and anchor is not None and anchor.op == "linear":
        x, weight, *bias = (graph.node(r.name).spec if r is not None else None for r in anchor.args)
        return _linear_ms(tuple(x.shape), tuple(weight.shape), bool(bias and bias[0] is not None), x.dtype, timer,
                          device)
    if group.kind == "attention" and anchor is not None and anchor.op == "attention":
        given = attention_arguments(anchor)
        q, k = (graph.node(given[name].name).spec for name in ("query", "key"))
        mask = node_mask(given, None)
        density = 1.0 if mask is None else mask.block_mask(q.shape[-2], k.shape[-2], 128, 128).element_density
        return _dense_attention_ms(tuple(q.shape), tuple(k.shape), q.dtype, timer, device) * density
    return group_bytes(graph, group) / HBM_BYTES_PER_S * 1e3


@functools.cache
def _linear_ms(x: tuple, weight: tuple, bias: bool, dtype: torch.dtype, timer, device: str) -> float:
    a = torch.randn(x, device=device, dtype=dtype)
    w = torch.randn(weight, device=device, dtype=dtype)
    b = torch.randn(weight[0], device=device, dtype=dtype) if bias else None
    return timer(lambda: torch.nn.functional.linear(a, w, b))


@functools.cache
def _dense_attention_ms(q_shape: tuple, k_shape: tuple, dtype: torch.dtype, timer, device: str) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(q_shape, device=device, dtype=dtype)
    k, v = (torch.randn(k_shape, device=device, dtype=dtype) for _ in range(2))
    gqa = k_shape[1] != q_shape[1]

    def timed(backend) -> float | None:
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        try:
            return timer(run)
        except RuntimeError:  # a backend that refuses the shape (cuDNN with GQA, say)
            return None

    # the fastest of flash and cuDNN; where neither takes the shape, the next kernel that does
    for tier in ((SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION), (SDPBackend.EFFICIENT_ATTENTION,),
                 (SDPBackend.MATH,)):
        times = [t for t in map(timed, tier) if t is not None]
        if times:
            return min(times)
    raise RuntimeError(f"no SDPA backend runs q {q_shape}, k {k_shape} {dtype}")


def model_floor_ms(graph: Graph, groups: list[FusionGroup], timer: Callable[[Callable[[], object]], float],
                   device: str = "cuda") -> float:
    """The sum of the groups' floors."""
    return sum(group_floor_ms(graph, group, timer, device) for group in groups)
