"""A block mask's lists ranked on the GPU (stof_cc/masks/lists.py) against numpy's (`BlockMask.from_grid`'s
host path): the function itself on the CPU over random class grids, and on a GPU the captured graph
of a per-call grid, replay after replay; a one-off grid keeps numpy's."""

from __future__ import annotations

import pytest
import torch

from stof_cc.masks import block_mask, lists
from stof_cc.masks.block_mask import BlockMask
from stof_cc.masks.geometry import EMPTY, FULL, PARTIAL


def _grid(rows: int, n_cb: int, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (rows, n_cb), generator=generator).to(torch.int8).to(device)


@pytest.mark.parametrize(("rows", "n_cb", "seed"), [(1, 1, 0), (5, 7, 1), (64, 64, 2), (3, 130, 3)])
def test_the_gpu_ranking_equals_numpys_lists(rows, n_cb, seed):
    classes = _grid(rows, n_cb, seed)
    assert {EMPTY, FULL, PARTIAL} >= set(classes.unique().tolist())
    ptr_host, arrays = block_mask._host_lists(classes, "test")
    full_ptr, full_cols, part_ptr, part_cols, any_ptr, any_cols, any_tile, part_at = arrays
    buffer = lists.lists(classes)
    blocks = rows * n_cb
    offsets = buffer[:3 * (rows + 1)].view(3, rows + 1)
    assert torch.equal(offsets[0], full_ptr) and torch.equal(offsets[1], part_ptr) and torch.equal(offsets[2], any_ptr)
    assert ptr_host.tolist() == any_ptr.tolist()
    padded = buffer[3 * (rows + 1):].view(5, blocks)
    for row, want in zip(padded, (full_cols, part_cols, any_cols, any_tile, part_at), strict=True):
        assert torch.equal(row[:len(want)], want)


def test_no_graph_for_a_cpu_grid():
    assert lists.block_lists(_grid(4, 4, 0)) is None


@pytest.mark.gpu
def test_a_per_call_grid_is_ranked_by_its_graph_as_numpy_ranks_it():
    lists._graphs.clear()
    lists._refused.clear()
    rows, n_cb, words = 12, 40, 4
    tiles = torch.randint(-2**31, 2**31 - 1, (1, 1, rows, n_cb, words), dtype=torch.int32, device="cuda")
    built = []
    for seed in range(4):
        classes = _grid(rows, n_cb, seed, "cuda").view(1, 1, rows, n_cb)
        built.append((BlockMask.from_grid(classes, tiles, rows * 16, n_cb * 32, 16, 32, ranked_on_device=True), classes))
    assert len(lists._graphs) == 1, "the per-call grid was not ranked by a graph"
    for got, classes in built:  # every earlier result intact after the later replays
        want = BlockMask.from_grid(classes, tiles, rows * 16, n_cb * 32, 16, 32)  # numpy's lists
        for name in block_mask._TENSORS:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.any_ptr_host.tolist() == want.any_ptr_host.tolist()
    assert len(lists._graphs) == 1  # a one-off grid is not captured


def test_a_one_off_grid_keeps_numpys_lists(monkeypatch):
    def refuse(classes):
        raise AssertionError("a one-off grid went to the GPU ranking")

    monkeypatch.setattr(lists, "block_lists", refuse)
    classes = _grid(3, 5, 0).view(1, 1, 3, 5)
    tiles = torch.zeros(1, 1, 3, 5, 4, dtype=torch.int32)
    assert BlockMask.from_grid(classes, tiles, 48, 160, 16, 32).n_nonempty == int((classes != EMPTY).sum())
