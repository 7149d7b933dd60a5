"""stof_cc.attention rejects what it cannot run before touching a GPU (CPU)."""

from __future__ import annotations

import pytest
import torch

from stof_cc import AttentionInputError, attention


def test_attention_rejects_non_tensors_and_autograd_before_anything_else():
    with pytest.raises(AttentionInputError, match="q must be a torch.Tensor"):
        attention([1.0], None, None)
    q = torch.randn(1, 1, 16, 64, requires_grad=True)
    with pytest.raises(AttentionInputError, match="inference-only"):
        attention(q, q, q)
