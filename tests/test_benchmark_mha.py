"""benchmarks/mha.py's FlashAttention-4 peer on the CPU, with a stand-in `flash_attn.cute` (the
real one is staged on the lent GPU machine): FA4's [B, S, H, D] convention is kept (inputs laid
out once, the output read back as [B, H, S, D]), the causal and window options reach it, and it
joins the peers and the dense floors only where it imports."""

from __future__ import annotations

import importlib.util
import sys
import types

import torch
import torch.nn.functional as F
from conftest import ROOT

from stof_cc.masks.workloads import grid_window

sys.path.insert(0, str(ROOT / "benchmarks"))


def _load_mha():
    spec = importlib.util.spec_from_file_location("benchmark_mha", ROOT / "benchmarks" / "mha.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_fa4(calls: list[dict]):
    """flash_attn_func on [B, S, H, D] as FA4 defines it (window (left, right) around the diagonal)."""
    def flash_attn_func(q, k, v, causal=False, window_size=(None, None)):
        calls.append({"causal": causal, "window_size": window_size, "layout": tuple(q.shape)})
        seq = q.shape[1]
        distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
        allowed = torch.ones(seq, seq, dtype=torch.bool)
        if causal:
            allowed &= distance >= 0
        left, right = window_size
        if left is not None:
            allowed &= (distance <= left) & (-distance <= right)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=allowed)
        return out.transpose(1, 2).contiguous(), None
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    package = types.ModuleType("flash_attn")
    package.cute = cute
    return {"flash_attn": package, "flash_attn.cute": cute}


def test_the_fa4_peer_keeps_its_layout_and_its_mask(monkeypatch):
    calls: list[dict] = []
    for name, module in _fake_fa4(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    mha = _load_mha()
    assert mha.fa4_available() and "fa4" in mha.dense_floors()
    q, k, v = (torch.randn(2, 3, 256, 16) for _ in range(3))
    causal = mha.fa4_peer(causal=True)(q, k, v)
    torch.testing.assert_close(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)
    assert calls[-1]["layout"] == (2, 256, 3, 16)  # FA4's [B, S, H, D]
    w = grid_window(256)
    monkeypatch.setattr(mha, "flex_peer", lambda *args, **kwargs: None)  # no Flex on the CPU
    sliding = mha.peers("sliding", None, 2, 3, 256)["fa4"](q, k, v)
    assert calls[-1]["window_size"] == (w, w)
    band = (torch.arange(256)[:, None] - torch.arange(256)[None, :]).abs() <= w
    torch.testing.assert_close(sliding, F.scaled_dot_product_attention(q, k, v, attn_mask=band), rtol=1e-5, atol=1e-5)
    assert set(mha.peers("bigbird", None, 2, 3, 256)) == {"flex", "flex_flash"}  # FA4 has no such mask


def test_without_fa4_the_peers_are_torchs_own(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    mha = _load_mha()
    monkeypatch.setattr(mha, "flex_peer", lambda *args, **kwargs: None)
    assert not mha.fa4_available() and "fa4" not in mha.dense_floors()
    assert set(mha.peers("causal", None, 2, 3, 256)) == {"flash_causal", "cudnn_causal", "flex"}
