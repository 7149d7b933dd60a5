"""A hand-written BERT-style encoder layer: SDPA with a boolean attention mask, post-LayerNorm.

The mask is an input tensor, so its pattern is known only at run time: compiled as it is, the layer's
attention runs in torch (stof-cc says so). Describe the mask and it runs stof-cc's attention kernel:
`stof-cc inspect examples/encoder_layer.py:factory --mask sliding:w=8`, or
`stof_cc.compile(layer, args, mask=masks.sliding_window(8))` (`make demo` shows both).
"""

import torch
from torch import nn
from torch.nn import functional as F


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int = 128, heads: int = 4, ffn: int = 512) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(0.1)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        return x.view(batch, seq, self.heads, hidden // self.heads).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.permute(0, 2, 1, 3).contiguous().view(batch, seq, hidden)
        x = self.norm1(x + self.dropout(self.out(attn)))
        return self.norm2(x + self.dropout(self.fc2(F.gelu(self.fc1(x)))))


def factory(batch: int = 2, seq: int = 64, hidden: int = 128, heads: int = 4, window: int = 8):
    torch.manual_seed(0)
    model = EncoderLayer(hidden, heads, 4 * hidden).eval()
    pos = torch.arange(seq)
    mask = (pos[:, None] - pos[None, :]).abs() <= window  # a sliding window, True = attend
    return model, (torch.randn(batch, seq, hidden), mask)


if __name__ == "__main__":
    model, args = factory()
    print(model(*args).shape)
