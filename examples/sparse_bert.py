"""A sparse BERT-base encoder (hidden 768, 12 heads, FFN 3072, GELU, post-LayerNorm) whose
attention mask is chosen from stof-cc's zoo: the model of the end-to-end benchmark.

The mask is an input (a boolean [S, S] tensor, True = attend) for eager PyTorch; stof-cc gets
the same mask as a description through ``stof_cc.compile(..., mask=...)`` and builds its
block-sparse format from it. ``attention="flex"`` swaps SDPA for FlexAttention (with the
mask's block mask), the FlexAttention peer of the benchmark.

    python examples/sparse_bert.py                  # CPU: a small encoder through stof_cc.compile
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from stof_cc.masks.workloads import grid_mask


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (lin(x).view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for lin in self.qkv)
        attn = attend(q, k, v).transpose(1, 2).reshape(batch, seq, hidden)
        x = self.norm1(x + self.out(attn))
        return self.norm2(x + self.fc2(F.gelu(self.fc1(x))))


class SparseBert(nn.Module):
    def __init__(self, layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072,
                 attention: str = "sdpa", block_mask=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, heads, ffn) for _ in range(layers))
        self.attention, self.block_mask = attention, block_mask

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.attention == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            def attend(q, k, v):
                return flex_attention(q, k, v, block_mask=self.block_mask)
        else:
            def attend(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for layer in self.layers:
            x = layer(x, attend)
        return x


def factory(mask: str = "sliding", seq: int = 128, batch: int = 2, layers: int = 2, hidden: int = 128,
            heads: int = 4):
    """A small encoder for the CPU; the benchmark builds the BERT-base one."""
    torch.manual_seed(0)
    model = SparseBert(layers, hidden, heads, 4 * hidden).eval()
    dense = grid_mask(mask, seq).to_dense(seq, seq)
    return model, (torch.randn(batch, seq, hidden), dense)


if __name__ == "__main__":
    import stof_cc

    model, (x, dense) = factory()
    compiled = stof_cc.compile(model, (x, dense), mask=grid_mask("sliding", x.shape[1]), dtype=torch.float32)
    print(compiled.explain())
    print("equal to eager:", torch.allclose(compiled(x, dense), model(x, dense), atol=1e-4))
