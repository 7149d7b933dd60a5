"""User mask_mods evaluated and packed by one compiled kernel (stof_cc/masks/compiled.py), against
the eager evaluation, on the CPU (the product compiles on CUDA only; the tests add the CPU)."""

from __future__ import annotations

import functools
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
    """Compiled from the first build, on the CPU, with fresh bookkeeping; any warning fails."""
    monkeypatch.setattr(compiled, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(compiled, "COMPILE_FROM", 1)
    for name, empty in (("_builds", compiled.OrderedDict()), ("_refused", set()), ("_warned", set()),
                        ("_functions", compiled.OrderedDict()), ("_indices", compiled.OrderedDict())):
        monkeypatch.setattr(compiled, name, empty)
    counters.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="stof-cc")
        yield


def _eager_bits(fn, ext: Extent) -> torch.Tensor:
    saved = compiled.DEVICE_TYPES
    compiled.DEVICE_TYPES = ()
    try:
        return masks.from_mask_mod(fn).packed_bits(ext)
    finally:
        compiled.DEVICE_TYPES = saved


def test_compiled_bits_are_the_eager_bits(compile_on_cpu, monkeypatch):
    """Documents from a captured table, a head-dependent window over keys that do not fill the last
    word, per-batch lengths; several row chunks, the last one ragged. Each compiled (one graph each),
    none refused."""
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
        counters.clear()
        got = masks.from_mask_mod(fn).packed_bits(ext)
        assert counters["stats"]["unique_graphs"] == 1, fn.__name__
        assert torch.equal(got, _eager_bits(fn, ext)), fn.__name__
    assert not compiled._refused


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
    masks.from_mask_mod(branching).packed_bits(Extent(64, 64))  # refused once: not tried, nor warned about, again


def test_a_refusal_is_for_the_captured_functions_too(compile_on_cpu):
    """Two closures of one combinator's code over different mask_mods: refusing one leaves the other."""
    def both(*parts):
        return lambda b, h, q, k: functools.reduce(torch.logical_and, (part(b, h, q, k) for part in parts))

    def causal(b, h, q, k):
        return q >= k

    def branching(b, h, q, k):
        return q >= k if bool((q > 3).any()) else q <= k

    def near(b, h, q, k):
        return (q - k).abs() < 9

    with pytest.warns(UserWarning, match="evaluated eagerly"):
        masks.from_mask_mod(both(causal, branching)).packed_bits(Extent(64, 64))
    counters.clear()
    fn = both(causal, near)
    assert torch.equal(masks.from_mask_mod(fn).packed_bits(Extent(64, 64)), _eager_bits(fn, Extent(64, 64)))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_wrong_mask_mod_gets_the_eager_error(compile_on_cpu):
    """The dims probe evaluates it eagerly first; compiled, a non-bool result is refused too."""
    with pytest.raises(MaskTypeError, match="torch.bool"):
        masks.from_mask_mod(lambda b, h, q, k: q - k).packed_bits(Extent(64, 64))
    b, h, q = (torch.zeros(1, 1, 1, 1, dtype=torch.int32) for _ in range(3))
    pack = compiled.packer(lambda b, h, q, k: q - k, "difference", torch.device("cpu"), 64, 1, 1, 1)
    with pytest.warns(UserWarning, match="evaluated eagerly"):
        assert pack(b, h, q) is None


def test_compiled_per_shape_from_its_second_build_counting_builds_not_chunks(monkeypatch):
    """A mask built once is never compiled, however many row chunks it takes; the second build at the
    same shape is; a build at a new shape (a decode step's one more key) is not."""
    monkeypatch.setattr(compiled, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(compiled, "_builds", compiled.OrderedDict())
    monkeypatch.setattr(compiled, "_refused", set())
    monkeypatch.setitem(user.ROW_CHUNK_ELEMENTS, "cpu", 16 * 256)  # 16 rows a chunk
    made = []
    real = compiled.packer
    monkeypatch.setattr(compiled, "packer", lambda *args: made.append(real(*args) is not None) or None)

    def causal(b, h, q, k):
        return q >= k

    masks.from_mask_mod(causal).packed_bits(Extent(256, 256))  # 16 chunks
    masks.from_mask_mod(causal).packed_bits(Extent(256, 256))
    masks.from_mask_mod(causal).packed_bits(Extent(1, 257))
    assert made == [False, True, False]


def test_never_while_torch_compile_traces(monkeypatch):
    monkeypatch.setattr(compiled, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(compiled, "COMPILE_FROM", 1)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert compiled.packer(lambda b, h, q, k: q >= k, "causal", torch.device("cpu"), 64, 64, 1, 1) is None


def _eager_block_mask(fn, seq_q, seq_k, block_m, block_n, batch, heads):
    saved = compiled.DEVICE_TYPES
    compiled.DEVICE_TYPES = ()
    try:
        return masks.from_mask_mod(fn).block_mask(seq_q, seq_k, block_m, block_n, batch=batch, heads=heads)
    finally:
        compiled.DEVICE_TYPES = saved


@pytest.mark.parametrize("chunk", [1 << 30, 3 * 128 * 1024])
def test_a_per_call_build_gives_the_eager_block_mask(compile_on_cpu, monkeypatch, chunk):
    """The grid form (evaluated, classified and packed tile by tile, compiled) and the block mask
    assembled from it (`BlockMask.from_grid`), against the eager build: documents over a table, a mask over batch and heads, a
    ragged grid; in one chunk of block rows and in several (the last one past the end). Its lists come
    from the GPU ranking's function (`lists.lists`, run eagerly here), a one-off build's from numpy."""
    from stof_cc.masks import build, lists

    monkeypatch.setattr(build, "GRID_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(compiled, "GRID_CHUNK_ELEMENTS", chunk)
    ranked = []

    def ranked_on_cpu(classes):  # lists.block_lists without its graph
        ranked.append(tuple(classes.shape))
        buffer = lists.lists(classes)
        return buffer.clone(), buffer[:3 * (classes.shape[0] + 1)].numpy().astype("int64").reshape(3, -1)

    monkeypatch.setattr(lists, "block_lists", ranked_on_cpu)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 250, 7, 643]))
    lengths, windows = torch.tensor([700, 1000]), torch.tensor([16, 64, 200])

    def documents(b, h, q, k):
        return (ids[q] == ids[k]) & (q >= k)

    def windowed(b, h, q, k):
        return (k < lengths[b]) & ((q - k).abs() <= windows[h])

    for fn, (seq_q, seq_k), (block_m, block_n), (batch, heads) in (
            (documents, (1000, 1000), (128, 128), (1, 1)), (windowed, (1000, 1000), (64, 128), (2, 3)),
            (documents, (300, 1000), (64, 32), (1, 1))):
        got = masks.from_mask_mod(fn).block_mask(seq_q, seq_k, block_m, block_n, batch=batch, heads=heads)
        want = _eager_block_mask(fn, seq_q, seq_k, block_m, block_n, batch, heads)
        assert (got.batch, got.heads) == (want.batch, want.heads)
        for name in ("full_ptr", "full_cols", "part_ptr", "part_cols", "part_bits", "any_ptr", "any_cols", "any_tile"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (fn.__name__, name)
        assert got.any_ptr_host.tolist() == got.any_ptr.tolist()  # the host copy the tile schedule reads
    assert counters["stats"]["unique_graphs"] == 3  # a grid form per (code, shape): compiled, not eager
    assert not compiled._refused
    assert len(ranked) == 3  # the three per-call builds; the eager references kept numpy's lists


def test_one_evaluation_serves_the_tiles_and_the_rows(compile_on_cpu, monkeypatch):
    """A mask_mod whose answers change from call to call still gives one mask: after a grid build, its
    row-packed bits (`to_dense`, combinations) are read off the same tiles, not evaluated again."""
    from stof_cc.masks import build

    monkeypatch.setattr(build, "GRID_DEVICE_TYPES", ("cpu",))
    phase = torch.zeros((), dtype=torch.int64)

    def stripes(b, h, q, k):  # its answers follow a tensor the caller changes between evaluations
        return (q + k + phase) % 3 == 0

    description = masks.from_mask_mod(stripes)
    block_mask = description.block_mask(200, 200, 64, 64)
    assert counters["stats"]["unique_graphs"] >= 1  # built by the grid form
    phase += 1
    dense = description.to_dense(200, 200)[0, 0]
    assert torch.equal(block_mask.to_dense()[0, 0], dense)
    assert not torch.equal(dense, masks.from_mask_mod(stripes).to_dense(200, 200)[0, 0])


def test_dims_are_probed_once_per_description_and_extent_never_per_kind(compile_on_cpu):
    """Two bound methods of one class are one kind (their objects are not part of it), yet one mask
    depends on the batch and the other does not: each gets its own dims and its own mask. A
    description probes once per extent."""
    class Documents:
        def __init__(self, ids):
            self.ids, self.probes = ids, 0

        def mask_mod(self, b, h, q, k):
            self.probes += 1
            if self.ids.dim() == 1:
                return self.ids[q] == self.ids[k]
            return self.ids[b, q] == self.ids[b, k]

    def ids(*lengths):
        return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    shared, per_batch = Documents(ids(64, 64)), Documents(torch.stack([ids(32, 96), ids(100, 28)]))
    assert masks.from_mask_mod(shared.mask_mod).mask_dims(128, batch=2) == (1, 1)
    description = masks.from_mask_mod(per_batch.mask_mod)
    assert description.mask_dims(128, batch=2) == (2, 1)
    dense = description.to_dense(128, batch=2)
    assert torch.equal(dense[1, 0], (ids(100, 28)[:, None] == ids(100, 28)[None, :]))
    assert torch.equal(description.block_mask(128, 128, 64, 64, batch=2).to_dense(), dense)
    probes = per_batch.probes
    description.mask_dims(128, batch=2)
    assert per_batch.probes == probes


def test_one_evaluation_at_every_block_shape_and_extent(compile_on_cpu, monkeypatch):
    """A mask_mod whose answers change between evaluations, built at two block shapes of one extent and
    at a second extent: every block mask and `to_dense` read the first evaluation of their extent."""
    from stof_cc.masks import build

    monkeypatch.setattr(build, "GRID_DEVICE_TYPES", ("cpu",))
    phase = torch.zeros((), dtype=torch.int64)

    def stripes(b, h, q, k):
        return (q + k + phase) % 3 == 0

    description = masks.from_mask_mod(stripes)
    first = description.block_mask(200, 200, 64, 64)
    phase += 1
    second = description.block_mask(200, 200, 128, 64)
    other = description.block_mask(300, 300, 64, 64)
    phase += 1
    assert torch.equal(first.to_dense(), second.to_dense())
    assert torch.equal(description.to_dense(200, 200), first.to_dense())
    assert torch.equal(description.to_dense(300, 300), other.to_dense())


def test_every_shape_of_a_serving_run_stays_compiled(compile_on_cpu, monkeypatch):
    """Packed batches of new lengths every call: each shape gets its own compiled copy (one guard set
    each), so shapes beyond dynamo's recompile limit are compiled too, not evaluated eagerly with a
    warning (which the fixture turns into a failure); the copies kept are the latest."""
    monkeypatch.setattr(compiled, "KEPT_FORMS", 3)
    with torch._dynamo.config.patch(recompile_limit=2):
        _build_at_lengths((96, 128, 160, 192))
        assert counters["stats"]["unique_graphs"] == 4
        assert {entry[2] for entry in compiled._functions} == {128, 160, 192}  # the first shape's copy went
        _build_at_lengths((96,))  # compiled again, right again
    assert counters["stats"]["unique_graphs"] == 5
    assert {entry[2] for entry in compiled._functions} == {160, 192, 96}


def _build_at_lengths(totals):
    """Document mask_mods over new ids at these sequence lengths, each against masks.document."""
    def documents_of(lengths):
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        return lambda b, h, q, k: ids[q] == ids[k]

    for total in totals:
        lengths = [total // 4, total - total // 4]
        fn = documents_of(lengths)
        assert masks.from_mask_mod(fn).block_classes(total, total, 32, 32).equal(
            masks.document(lengths).block_classes(total, total, 32, 32))


@pytest.mark.parametrize("shapes", [((2, 1, 5, 1), (1, 3, 1, 4)), ((5,), (2, 1, 1)), ((0, 1), (1, 7)), ((1,), ()),
                                    ((3, 4), (2, 4)), ((2, 0), (2, 3))])
def test_mask_mod_shapes_broadcast_as_torch_does(shapes):
    """The probe's own broadcast (torch's costs 60 us a call) agrees with torch.broadcast_shapes."""
    try:
        want = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        want = None
    assert user._broadcast(*shapes) == want
