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


def test_problems_past_the_grid_limits_are_named():
    from stof_cc import explain_attention
    from stof_cc.templates.attention import AttentionProblem
    from stof_cc.tune.attention import candidates

    long = AttentionProblem(1, 1, 65536 * 64, 65536 * 64, 64, torch.float16)  # too many rows for m64 and below
    assert candidates(long) and all(p["block_m"] > 64 for _, p in candidates(long))
    with pytest.raises(AttentionInputError, match="batch 70000 exceeds 65535"):
        explain_attention(70000, 1, 16, 16, 64)  # batch is the grid's y
    with pytest.raises(AttentionInputError, match="no attention kernel runs"):
        explain_attention(1, 1, 65536 * 192 + 1, 16, 64)


@pytest.mark.parametrize("bad", ["128", 128.0, True, None])
def test_explain_attention_names_a_size_that_is_not_an_int(bad):
    from stof_cc import explain_attention

    with pytest.raises(AttentionInputError, match=r"seq_q must be an int, got"):
        explain_attention(1, 1, bad, 128, 64)
    with pytest.raises(AttentionInputError, match="dtype 'fp16' is not supported"):
        explain_attention(1, 1, 128, 128, 64, dtype="fp16")
