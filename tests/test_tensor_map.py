"""TMA tensor-map encoding without a GPU: what is handed to cuTensorMapEncodeTiled, and refusals."""

from __future__ import annotations

import ctypes

import pytest
import torch

from stof_cc.backends.tensor_map import TensorMapError, encode_2d


class FakeLib:
    def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, element_strides, interleave,
                               swizzle, promotion, fill):
        self.seen = (dtype, rank, address.value, list(dims[:2]), strides[0], list(box[:2]), swizzle, fill)
        ctypes.memset(out, 7, 128)
        return 0

    def cuGetErrorString(self, result, text):
        return 0


def test_a_row_major_matrix_becomes_a_swizzled_2d_map():
    lib = FakeLib()
    x = torch.randn(3, 100, 256, dtype=torch.float16)
    encoded = encode_2d(x, 128, 64, lib=lib)
    assert encoded == bytes([7]) * 128
    dtype, rank, address, dims, pitch, box, swizzle, fill = lib.seen
    assert (dtype, rank, address) == (6, 2, x.data_ptr())  # fp16, 2-D
    assert dims == [256, 300] and pitch == 512 and box == [64, 128]  # innermost first; leading dims flattened
    assert swizzle == 3 and fill == 0  # 128-byte swizzle, zeros past the edges
    encode_2d(x.bfloat16(), 64, 64, lib=lib)
    assert lib.seen[0] == 9


@pytest.mark.parametrize("tensor, box, message", [
    (torch.randn(8, 64), (64, 64), "fp16/bf16"),
    (torch.randn(64, 8, dtype=torch.float16).t(), (64, 64), "contiguous"),
    (torch.randn(8, 12, dtype=torch.float16), (64, 64), "16-byte aligned address and row pitch"),
    (torch.randn(8, 64, dtype=torch.float16), (64, 32), "128-byte box rows"),
    (torch.randn(8, 64, dtype=torch.float16), (512, 64), "at most 256"),
])
def test_refusals_say_why(tensor, box, message):
    with pytest.raises(TensorMapError, match=message):
        encode_2d(tensor, *box, lib=FakeLib())
