"""What a helper's fuzzing of the lowering found on the CPU (the compiled module runs each group
through torch from the IR, so a wrong rewrite shows as a difference from eager): a mask that also
reads how many keys a row keeps taken for plain key padding, and three compile-time crashes (an
empty cat piece that decides the dtype, an in-place op whose operand promotes, attention operands
the attention node cannot take). Each compiled model now equals eager."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import stof_cc


def _compiled(module: torch.nn.Module, args: tuple, dtype: torch.dtype = torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return stof_cc.compile(module, args, dtype=dtype, tune=False)


class _ShortRowsSeeAll(torch.nn.Module):
    def forward(self, q, k, v, attention_mask):
        kv = attention_mask.bool()
        allowed = kv | (kv.sum(-1, keepdim=True) <= 2)  # a row keeping at most two tokens attends every key
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None, None, :])


def test_a_mask_that_reads_how_many_keys_a_row_keeps_is_not_taken_for_key_padding():
    """Four random probes (60% of the keys kept) never left a row with two keys: the mask became
    key_padding and row 1 was 2.3 off eager."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 16) for _ in range(3))
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[1, 2:] = 0
    module = _ShortRowsSeeAll()
    compiled = _compiled(module, (q, k, v, mask))
    torch.testing.assert_close(compiled(q, k, v, mask), module(q, k, v, mask))
    q2 = torch.randn_like(q)
    mask[0, 40:] = 0
    torch.testing.assert_close(compiled(q2, k, v, mask), module(q2, k, v, mask))


class _EmptyCacheThenKeys(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        past = torch.zeros(x.shape[0], 0, 8)  # an empty fp32 cache: the cat is fp32 in eager
        return torch.cat([past, self.proj(x)], dim=1)


def test_an_empty_cat_piece_that_decides_the_dtype_is_kept():
    x = torch.randn(2, 4, 8)
    module = _EmptyCacheThenKeys()
    want = module.half()(x.half())
    got = _compiled(module, (x,), torch.float16)(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)


class _Bf16PlusFp32Table(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.register_buffer("positions", torch.randn(32, 16))  # kept fp32 by the model

    def forward(self, ids):
        h = self.embed(ids) * 1.0
        h += self.positions[: ids.shape[1]]  # in place: h stays bf16
        return h


def test_an_in_place_op_whose_operand_promotes_keeps_the_written_dtype():
    module = _Bf16PlusFp32Table()
    module.embed.to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 8))
    want = module(ids)
    got = _compiled(module, (ids,), torch.bfloat16)(ids)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class _Written(torch.nn.Module):
    def forward(self, q, k, v):
        return (q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v


@pytest.mark.parametrize("module", [_Sdpa(), _Written()], ids=["sdpa", "written"])
@pytest.mark.parametrize("shapes", [[(8, 16)] * 3, [(2, 1, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16)]],
                         ids=["2-d", "q over more kv heads"])
def test_attention_operands_the_node_cannot_take_stay_plain_ops(module, shapes):
    args = tuple(torch.randn(*shape) for shape in shapes)
    compiled = _compiled(module, args)
    assert all(node.op != "attention" for node in next(iter(compiled.variants.values())).graph.nodes())
    torch.testing.assert_close(compiled(*args), module(*args))
