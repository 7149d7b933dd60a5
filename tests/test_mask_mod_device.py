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
    assert captured_device(lambda b, h, q, k: (q - k).abs() <= cpu[h]) is None
    assert captured_device(lambda b, h, q, k: q >= k) is None


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
