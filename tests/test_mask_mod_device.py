"""A mask_mod runs on the device of the tensors it captures (found without a GPU here: a
`meta` tensor stands in for a CUDA one), and a mask_mod that mixes devices is named."""

from __future__ import annotations

import functools

import pytest
import torch

from stof_cc import masks
from stof_cc.masks.user import captured_device

TABLE = torch.zeros(4, device="meta")


def _global_table(b, h, q, k):
    return (q - k).abs() <= TABLE[h]


def test_the_device_of_captured_tensors_is_found():
    windows = torch.zeros(4, device="meta")
    assert captured_device(lambda b, h, q, k: (q - k).abs() <= windows[h]) == torch.device("meta")
    assert captured_device(_global_table) == torch.device("meta")

    def with_default(b, h, q, k, w=windows):
        return (q - k).abs() <= w[h]

    assert captured_device(with_default) == torch.device("meta")
    assert captured_device(functools.partial(lambda w, b, h, q, k: q >= k, windows)) == torch.device("meta")
    cpu = torch.zeros(4)
    assert captured_device(lambda b, h, q, k: (q - k).abs() <= cpu[h]) == torch.device("cpu")  # stays there
    assert captured_device(lambda b, h, q, k: q >= k) is None  # runs anywhere: on a GPU if there is one


def test_index_tensors_go_to_the_mask_mods_device_and_back():
    seen = []

    def on_cpu_really(b, h, q, k):
        seen.append(q.device)
        return q >= k

    mask = masks.from_mask_mod(on_cpu_really, device="cpu")
    assert torch.equal(mask.to_dense(40, 50)[0, 0], torch.ones(40, 50, dtype=torch.bool).tril())
    assert set(seen) == {torch.device("cpu")}


def test_a_mask_mod_that_mixes_devices_is_named():
    def mixes(b, h, q, k):
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")

    with pytest.raises(masks.MaskError, match=r"from_mask_mod: mixes mixes devices .* pass from_mask_mod\(fn, device=...\)"):
        masks.from_mask_mod(mixes).block_mask(64)


def test_an_empty_closure_cell_is_no_obstacle():
    def outer():
        def mask_mod(b, h, q, k):
            return q >= later.shape[0]

        found = captured_device(mask_mod)  # `later` is still unassigned here
        later = torch.zeros(1)
        return found

    assert outer() is None


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1000, 4096])
def test_a_user_mask_built_on_the_gpu_equals_the_cpu_build(seq):
    """The packed evaluation on the GPU (a mask_mod with a CUDA table, one that captures
    nothing, from_dense, and a union) gives the same block mask as on the CPU."""
    table = torch.randint(0, 2, (-(-seq // 64), -(-seq // 64)), dtype=torch.bool)
    w = max(64, seq // 16)

    def user(t):
        return lambda b, h, q, k: ((q - k).abs() <= w) | (q < 32) | t[q // 64, k // 64]

    dense = torch.rand(seq, seq) < 0.1
    pairs = [(masks.from_mask_mod(user(table.cuda())), masks.from_mask_mod(user(table))),
             (masks.from_mask_mod(lambda b, h, q, k: (q - k) % 7 == 0),
              masks.from_mask_mod(lambda b, h, q, k: (q - k) % 7 == 0, device="cpu")),
             (masks.from_dense(dense) | masks.causal(), None)]
    for on_gpu, on_cpu in pairs:
        for block in ((64, 64), (128, 128)):
            want = on_cpu.block_mask(seq, seq, *block).to_dense() if on_cpu is not None else \
                (dense | torch.ones(seq, seq, dtype=torch.bool).tril())[None, None]
            got = on_gpu.block_mask(seq, seq, *block).to_dense()
            assert torch.equal(got, want), (on_gpu, block)
            # built on the GPU itself (the tiles never visit the host): every tensor there, same blocks
            built = on_gpu.block_mask(seq, seq, *block, device="cuda")
            assert all(t.is_cuda for t in (built.any_ptr, built.any_cols, built.any_tile, built.part_bits))
            assert torch.equal(built.to("cpu").to_dense(), want), (on_gpu, block, "built on the GPU")
            if on_cpu is not None:  # assembled on the GPU (BlockMask.from_grid): the CPU's arrays exactly
                _assert_same_arrays(built, on_cpu.block_mask(seq, seq, *block))


@pytest.mark.gpu
def test_a_mask_mod_over_batch_and_heads_is_assembled_on_the_gpu_as_on_the_cpu():
    """Per-sequence lengths and per-head windows (a CUDA table): the block mask assembled on the
    GPU keeps the batch and head dims the CPU's keeps, array for array; one over neither dim
    collapses to 1 x 1 there too."""
    lengths = torch.tensor([700, 1000])

    def mask_mod(table):
        return lambda b, h, q, k: (k < table[b]) & ((q - k).abs() <= 64 * (h + 1))

    for fn_gpu, fn_cpu in ((mask_mod(lengths.cuda()), mask_mod(lengths)),
                           (lambda b, h, q, k: (k <= q) | (h < 0), lambda b, h, q, k: (k <= q) | (h < 0))):
        for block in (64, 128):
            built = masks.from_mask_mod(fn_gpu).block_mask(1000, 1000, block, block, batch=2, heads=3, device="cuda")
            _assert_same_arrays(built, masks.from_mask_mod(fn_cpu, device="cpu").block_mask(
                1000, 1000, block, block, batch=2, heads=3))


def _assert_same_arrays(got, want):
    assert (got.batch, got.heads) == (want.batch, want.heads)
    for name in ("full_ptr", "full_cols", "part_ptr", "part_cols", "part_bits", "any_ptr", "any_cols", "any_tile"):
        a, b = getattr(got, name).cpu(), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
