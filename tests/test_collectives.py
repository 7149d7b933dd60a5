"""runtime/collectives.py: which all-reduces run in place, and context parallelism on one rank
(a gloo group of one in this process): the answer, and nothing kept alive once the mask is gone."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from stof_cc import masks
from stof_cc.ir.graph import Graph, Node, Ref, TensorSpec
from stof_cc.runtime.collectives import in_place_all_reduces


def _reduced() -> Graph:
    spec = TensorSpec((4, 8), torch.float16)
    g = Graph("tp")
    g.add_input("x", spec)
    g.add_node(Node("y", "relu", "aten.relu.default", (Ref("x"),), spec=spec))
    g.add_node(Node("r", "opaque", "_c10d_functional.all_reduce.default", (Ref("y"), "sum", "0"), spec=spec))
    g.outputs = [Ref("r")]
    return g


def test_only_a_kernels_own_output_that_dies_there_is_reduced_in_place():
    g = _reduced()
    assert in_place_all_reduces(g, ["r"], dying=["y"], fresh={"y"}) == ("r",)
    assert in_place_all_reduces(g, ["r"], dying=["y"], fresh=set()) == ()  # maybe a view of a live value
    assert in_place_all_reduces(g, ["r"], dying=[], fresh={"y"}) == ()  # read later
    g.outputs = [Ref("r"), Ref("y")]
    assert in_place_all_reduces(g, ["r"], dying=["y"], fresh={"y"}) == ()  # the caller gets it back


def test_a_value_with_a_view_made_earlier_is_not_reduced_in_place():
    """A view of the all-reduce's input shares its memory: reduced in place, the view (read later or
    returned) would hold the sum (2.14 off on two gloo ranks, found by review)."""
    g = _reduced()
    g.add_node(Node("local", "view", "aten.view.default", (Ref("y"), [32]), spec=TensorSpec((32,), torch.float16)))
    g.outputs = [Ref("r"), Ref("local")]
    assert in_place_all_reduces(g, ["r"], dying=["y"], fresh={"y"}) == ()


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_computes_the_whole_attention_and_frees_the_mask_after(one_rank):
    from stof_cc.distributed import context_parallel_attention
    from stof_cc.ir.reference import masked_attention

    q, k, v = (torch.randn(1, 2, 512, 32) for _ in range(3))
    mask = masks.sliding_window(100)
    got = context_parallel_attention(q, k, v, mask)  # one rank holds chunks 0 and 1: the whole sequence
    torch.testing.assert_close(got, masked_attention(q, k, v, mask.to_dense(512, 512)), rtol=1e-5, atol=1e-5)
    alive = weakref.ref(mask)
    del mask
    gc.collect()
    assert alive() is None  # its plans and regions went with it
