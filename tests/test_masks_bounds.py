"""Mask parameters at their limits (issue 32, item 6) and user masks evaluated once (item 14):
a length past every position means 'unbounded' and works (also on FlexAttention's int32
indices), nothing is allocated in proportion to a parameter's value, what cannot be honoured
is a MaskError naming the argument, and a mask_mod whose answers change between calls still
gives one mask to `to_dense`, every block shape and every combination."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from stof_cc import masks
from stof_cc.masks.cli import main
from stof_cc.masks.picture import render

HUGE = 10**30


UNBOUNDED = {  # a description with a huge parameter -> the same mask stated plainly, at S = 40
    "sliding_window(HUGE)": (lambda: masks.sliding_window(HUGE), masks.full),
    "sliding_window(HUGE, causal)": (lambda: masks.sliding_window(HUGE, causal=True), masks.causal),
    "dilated(1e10, 1e10)": (lambda: masks.dilated(10**10, 10**10), lambda: masks.dilated(1, 50)),  # the diagonal
    "strided(HUGE)": (lambda: masks.strided(HUGE), masks.causal),
    "fixed(HUGE, HUGE / 3)": (lambda: masks.fixed(HUGE, HUGE // 3), masks.causal),
    "key_padding([HUGE, 3])": (lambda: masks.key_padding([HUGE, 3]), lambda: masks.key_padding([40, 3])),
    "document([HUGE, 5])": (lambda: masks.document([HUGE, 5]), masks.full),
    "document([1e10])": (lambda: masks.document([10**10]), masks.full),
    "global_tokens([3, HUGE])": (lambda: masks.global_tokens([3, HUGE]), lambda: masks.global_tokens([3])),
    "longformer(8, 1e9)": (lambda: masks.longformer(8, 10**9), masks.full),
    "random_blocks(1e400, HUGE)": (lambda: masks.random_blocks(10**400, block=HUGE), masks.full),
    "bigbird(HUGE, HUGE, 0)": (lambda: masks.bigbird(HUGE, HUGE, 0), masks.full),
}


@pytest.mark.parametrize("name", UNBOUNDED)
def test_a_length_past_every_position_is_unbounded(name):
    """Was an OverflowError deep in zoo.py (or an 80 GB allocation for document([10**10]))."""
    make, plain = UNBOUNDED[name]
    desc = make()
    want = plain().to_dense(40, 40, batch=2 if "key_padding" in name else None)
    assert torch.equal(desc.to_dense(40, 40), want)
    for block in ((16, 16), (7, 64)):
        assert torch.equal(desc.block_mask(40, 40, *block).to_dense(), want)
    assert "000000000" in repr(desc)  # the label shows what was given


def test_the_mask_mod_stays_exact_on_int32_indices():
    """FlexAttention evaluates mask_mods on int32 indices, where torch wraps a Python int past
    int32 silently: sliding_window(2**40) attended only the diagonal there."""
    q = torch.arange(50, dtype=torch.int32).view(-1, 1)
    k = torch.arange(50, dtype=torch.int32).view(1, -1)
    zero = torch.zeros(1, 1, dtype=torch.int32)
    for desc in (masks.sliding_window(2**40), masks.dilated(2**20, 2**20), masks.strided(2**40),
                 masks.fixed(2**40, 2**39), masks.key_padding([2**40])):
        got = desc.mask_mod(zero, zero, q, k)
        assert torch.equal(got.expand(50, 50), desc.to_dense(50)[0, 0]), desc


def test_huge_parameters_allocate_nothing_in_proportion():
    """longformer(8, 10**9) made an 8 GB arange before any length was known; document([10**10])
    an 80 GB one. Peak memory of a fresh process, above its import."""
    code = """
import json, resource, torch
from stof_cc import masks
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
made = [masks.longformer(8, 10**9), masks.global_tokens(10**9), masks.document([10**10, 10**9]),
        masks.bigbird(8, 10**9, 2), masks.key_padding([10**18] * 4), masks.dilated(10**9, 10**9)]
for desc in made:
    desc.block_mask(4096, batch=4 if "key_padding" in repr(desc) else None)
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024))
"""
    grown = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True, timeout=300).stdout)
    assert grown < 200, f"{grown:.0f} MiB"


@pytest.mark.parametrize("make, message", [
    (lambda: masks.causal().block_mask(2**40),
     r"block_mask: seq_q must be at most 2147483647 \(positions are int32 indices\), got 1099511627776"),
    (lambda: masks.causal().to_dense(8, 2**31), r"to_dense: seq_k must be at most 2147483647"),
    (lambda: masks.causal().block_mask(64, block_m=10**20), r"block_mask: block_m must be at most 8192"),
    (lambda: masks.bigbird(8, 2, 1, seed=2**64), r"bigbird: seed must be at most 18446744073709551615"),
    (lambda: masks.random_blocks(1, seed=2**70), r"random_blocks: seed must be at most"),
    (lambda: render(masks.causal().block_mask(64), max_px=10**9), r"render: max_px must be at most 8192"),
])
def test_what_cannot_be_honoured_is_named(make, message):
    with pytest.raises(masks.MaskError, match=message):
        make()


META = torch.zeros(4, device="meta")


def _uses_meta_table(b, h, q, k):
    return (q - k).abs() <= META[h]


@pytest.mark.parametrize("make, message", [
    (lambda: masks.from_mask_mod(_uses_meta_table).to_dense(8),
     "from_mask_mod: _uses_meta_table would run on the meta device"),
    (lambda: masks.from_mask_mod(lambda b, h, q, k: q >= k, device="meta"), "would run on the meta device"),
    (lambda: masks.from_dense(torch.ones(4, 4, dtype=torch.bool, device="meta")),
     "from_dense: mask is on the meta device and holds no values"),
    (lambda: masks.document(segment_ids=torch.zeros(8, dtype=torch.long, device="meta")),
     "document: segment_ids is on the meta device"),
    (lambda: masks.key_padding(torch.zeros(2, dtype=torch.long, device="meta")),
     "key_padding: lengths is on the meta device"),
])
def test_tensors_without_values_are_named(make, message):
    """A mask_mod capturing a meta tensor ended in NotImplementedError from user.py."""
    with pytest.raises(masks.MaskError, match=message):
        make()


def test_show_takes_a_huge_window_and_names_a_huge_length(tmp_path, capsys):
    """`masks show sliding:w=100000000000000000000 --seq 64` was a raw traceback."""
    assert main(["show", "sliding:w=100000000000000000000", "--seq", "64", "--out", str(tmp_path / "w.png")]) == 0
    assert "1 full, 0 partial, 0 empty" in capsys.readouterr().out
    assert main(["show", "causal", "--seq", str(10**12), "--out", str(tmp_path / "s.png")]) == 2
    assert "seq_q must be at most 2147483647" in capsys.readouterr().err


def test_a_mask_mod_that_changes_its_answers_is_evaluated_once():
    """Item 14: to_dense, every block shape (the kernel's and the cost model's), and
    combinations all read one evaluation per extent, so they agree even for a mask_mod that
    draws random numbers; several extents are kept side by side."""
    calls = []

    def coin(b, h, q, k):
        calls.append(tuple(q.shape))
        return torch.rand(torch.broadcast_shapes(q.shape, k.shape)) < 0.5

    desc = masks.from_mask_mod(coin)
    dense = desc.to_dense(100, 90)
    small = desc.to_dense(50)
    for block in ((16, 16), (32, 32), (64, 128), (7, 5)):
        assert torch.equal(desc.block_mask(100, 90, *block).to_dense(), dense), block
    assert torch.equal(desc.block_classes(100, 90, 16, 16), masks.from_dense(dense[0, 0]).block_classes(100, 90, 16, 16))
    causal = masks.causal().to_dense(100, 90)
    for combined, want in ((desc | masks.causal(), dense | causal), (desc & ~masks.causal(), dense & ~causal)):
        assert torch.equal(combined.to_dense(100, 90), want)
        assert torch.equal(combined.block_mask(100, 90, 32, 64).to_dense(), want)
    assert torch.equal(desc.to_dense(50), small) and torch.equal(desc.to_dense(100, 90), dense)
    assert torch.equal(desc.block_mask(50, block_m=16, block_n=16).to_dense(), small)
