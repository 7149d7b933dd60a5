"""User mask_mods evaluated and packed by one compiled kernel (stof_cc/masks/compiled.py), against
the eager evaluation, on the CPU (the product compiles on CUDA only; the tests add the CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from stof_cc import masks
from stof_cc.masks import compiled, user
from stof_cc.masks.errors import MaskTypeError
from stof_cc.masks.geometry import Extent


@pytest.fixture
def compile_on_cpu(monkeypatch):
    """Compiled from the first evaluation, on the CPU, with fresh bookkeeping."""
    monkeypatch.setattr(compiled, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(compiled, "COMPILE_FROM", 1)
    monkeypatch.setattr(compiled, "_evaluations", {})
    monkeypatch.setattr(compiled, "_refused", set())
    counters.clear()


def _eager_bits(fn, ext: Extent) -> torch.Tensor:
    saved = compiled.DEVICE_TYPES
    compiled.DEVICE_TYPES = ()
    try:
        return masks.from_mask_mod(fn).packed_bits(ext)
    finally:
        compiled.DEVICE_TYPES = saved


def test_compiled_bits_are_the_eager_bits(compile_on_cpu, monkeypatch):
    """Documents from a captured table, a head-dependent window over keys that do not fill the last
    word, per-batch lengths; several row chunks, the last one ragged."""
    monkeypatch.setitem(user.ROW_CHUNK_ELEMENTS, "cpu", 3 * 333 * 100)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 250, 7, 643]))
    lengths = torch.tensor([333, 41])

    def documents(b, h, q, k):
        return (ids[q] == ids[k]) & (q >= k)

    def widening(b, h, q, k):
        return (q - k).abs() <= 8 * (h + 1)

    def padded(b, h, q, k):
        return k < lengths[b]

    for fn, ext in ((documents, Extent(1000, 1000)), (widening, Extent(300, 333, 1, 3)),
                    (padded, Extent(250, 333, 2, 1))):
        got = masks.from_mask_mod(fn).packed_bits(ext)
        assert counters["stats"]["unique_graphs"] >= 1, "not compiled"
        assert torch.equal(got, _eager_bits(fn, ext)), fn.__name__


def test_closures_over_new_tables_reuse_one_compiled_kernel(compile_on_cpu):
    """A mask_mod rebuilt per batch (a closure over that batch's document ids): compiled once."""
    def documents_of(lengths):
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        return lambda b, h, q, k: ids[q] == ids[k]

    for lengths in ([500, 500], [100, 900], [300, 300, 400], [1000]):
        fn = documents_of(lengths)
        description = masks.from_mask_mod(fn)
        assert torch.equal(description.packed_bits(Extent(1000, 1000)), _eager_bits(fn, Extent(1000, 1000)))
        assert description.block_classes(1000, 1000, 64, 64).equal(
            masks.document(lengths).block_classes(1000, 1000, 64, 64))
    assert counters["stats"]["unique_graphs"] == 1


def test_what_torch_compile_refuses_is_evaluated_eagerly_with_one_warning(compile_on_cpu):
    def branching(b, h, q, k):
        if bool((q > 3).any()):  # data-dependent Python control flow: no whole graph
            return q >= k
        return q <= k

    with pytest.warns(UserWarning, match=r"from_mask_mod\(branching\) is evaluated eagerly"):
        got = masks.from_mask_mod(branching).packed_bits(Extent(64, 64))
    assert torch.equal(got, _eager_bits(branching, Extent(64, 64)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused once: not tried, nor warned about, again
        masks.from_mask_mod(branching).packed_bits(Extent(64, 64))


def test_a_wrong_mask_mod_gets_the_eager_error(compile_on_cpu):
    """The dims probe evaluates it eagerly first; compiled, a non-bool result would be refused too."""
    with pytest.raises(MaskTypeError, match="torch.bool"):
        masks.from_mask_mod(lambda b, h, q, k: q - k).packed_bits(Extent(64, 64))
    b, h, q = (torch.zeros(1, 1, 1, 1, dtype=torch.int32) for _ in range(3))
    with pytest.warns(UserWarning, match="evaluated eagerly"):
        assert compiled.packed_words(lambda b, h, q, k: q - k, "difference", b, h, q, 64, 1, 1) is None


def test_a_mask_mod_is_compiled_from_its_second_evaluation(monkeypatch):
    monkeypatch.setattr(compiled, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(compiled, "_evaluations", {})
    monkeypatch.setattr(compiled, "_refused", set())
    calls = []
    monkeypatch.setattr(compiled, "packed_words", lambda *args, **kwargs: calls.append(args) or None)

    def causal(b, h, q, k):
        return q >= k

    masks.from_mask_mod(causal).packed_bits(Extent(64, 64))
    assert not calls  # a mask built once never pays for compiling
    masks.from_mask_mod(causal).packed_bits(Extent(64, 64))
    assert len(calls) == 1
