"""A GPT-2-style decoder block: pre-LayerNorm, causal attention written out by hand, GELU MLP.

The causal mask is a registered lower-triangular buffer applied with masked_fill before
the softmax, as GPT-2's original code does; stof-cc's attention pass recognises this form.
"""

import math

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("causal", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(hidden // self.heads)
        scores = scores.masked_fill(~self.causal[:seq, :seq], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class GPT2Block(nn.Module):
    def __init__(self, hidden: int = 128, heads: int = 4, max_seq: int = 256) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, max_seq)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def factory(batch: int = 2, seq: int = 64, hidden: int = 128, heads: int = 4):
    torch.manual_seed(0)
    model = GPT2Block(hidden, heads, max_seq=max(256, seq)).eval()
    return model, (torch.randn(batch, seq, hidden),)


if __name__ == "__main__":
    model, args = factory()
    print(model(*args).shape)
