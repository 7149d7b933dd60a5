"""TMA tensor-map encoding without a GPU: what is handed to cuTensorMapEncodeTiled, and refusals."""

from __future__ import annotations

import ctypes

import pytest
import torch

from stof_cc.backends.tensor_map import TensorMapError, encode_2d, encode_heads


class FakeLib:
    def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, element_strides, interleave,
                               swizzle, promotion, fill):
        self.seen = (dtype, rank, address.value, list(dims[:rank]), list(strides[:rank - 1]), list(box[:rank]),
                     swizzle, fill)
        self.map_address = ctypes.addressof(out)
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
    assert dims == [256, 300] and pitch == [512] and box == [64, 128]  # innermost first; leading dims flattened
    assert swizzle == 3 and fill == 0  # 128-byte swizzle, zeros past the edges
    assert lib.map_address % 64 == 0  # the driver's alignment for the map it writes
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


def test_an_attention_operand_becomes_a_5d_map_over_its_own_strides():
    lib = FakeLib()
    qkv = torch.randn(2, 100, 3, 4, 128, dtype=torch.bfloat16)  # packed qkv: [B, S, 3, H, D] memory
    k = qkv[:, :, 1].transpose(1, 2)  # [B, H, S, D] view, no copy
    encode_heads(k, 64, lib=lib)
    dtype, rank, address, dims, strides, box, swizzle, fill = lib.seen
    assert (dtype, rank, address) == (9, 5, k.data_ptr())
    assert dims == [128, 100, 1, 4, 2]  # head_dim, rows, one residue, heads, batch
    row = 3 * 4 * 128 * 2
    assert strides == [row, 100 * row, 128 * 2, 100 * row]  # bytes per row, (residue), head, batch element
    assert box == [64, 64, 1, 1, 1] and swizzle == 3 and fill == 0  # one 128-byte column block; zeros past the rows
    encode_heads(torch.randn(1, 1, 100, 64, dtype=torch.float16), 128, lib=lib)
    assert lib.seen[4] == [128, 100 * 128, 100 * 128, 100 * 128]  # extent-1 dimensions get the packed stride


def test_a_strided_split_reads_each_residue_as_its_own_sequence():
    """residues = 4: residue r's rows are r, r + 4, ...; the residue steps one row."""
    lib = FakeLib()
    q = torch.randn(2, 3, 64, 64, dtype=torch.float16)
    encode_heads(q, 16, residues=4, lib=lib)
    dims, strides = lib.seen[3], lib.seen[4]
    assert dims == [64, 16, 4, 3, 2]
    assert strides == [4 * 128, 128, 64 * 128, 3 * 64 * 128]
    with pytest.raises(TensorMapError, match="residues"):
        encode_heads(q, 16, residues=5, lib=lib)


@pytest.mark.parametrize("tensor, message", [
    (torch.randn(2, 1, 64, 64, dtype=torch.float16).expand(2, 4, 64, 64), "nonzero"),  # broadcast heads
    (torch.randn(2, 4, 64, 64, dtype=torch.float16).transpose(2, 3), "unit stride"),
    (torch.randn(4, 64, 64, dtype=torch.float16), "batch, heads, rows, head_dim"),
])
def test_attention_maps_refuse_what_tma_cannot_read(tensor, message):
    with pytest.raises(TensorMapError, match=message):
        encode_heads(tensor, 64, lib=FakeLib())
