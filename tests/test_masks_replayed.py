"""A per-call mask_mod's grid build replayed from a CUDA graph (stof_cc/masks/replayed.py): which
mask_mods may be replayed (CPU: what the walker sees and rebuilds), and on a GPU that every replay
equals the compiled call over the new tables, and that an earlier result is not overwritten."""

from __future__ import annotations

import functools

import pytest
import torch

from stof_cc import masks
from stof_cc.masks import compiled, replayed, user

GLOBAL_TABLE = torch.zeros(4)
GLOBAL_WINDOW = 3


def _signature(fn):
    tensors = []
    return replayed._walk(fn, None, tensors, 0), tensors


def _documents(ids):
    return lambda b, h, q, k: ids[q] == ids[k]


def _and_masks(*fns):
    def both(b, h, q, k):
        out = fns[0](b, h, q, k)
        for fn in fns[1:]:
            out = out & fn(b, h, q, k)
        return out
    return both


def test_closures_of_one_code_over_tables_of_one_shape_share_a_signature():
    first, tensors = _signature(_documents(torch.zeros(8, dtype=torch.long)))
    second, _ = _signature(_documents(torch.ones(8, dtype=torch.long)))
    assert first == second and len(tensors) == 1
    assert _signature(_documents(torch.zeros(9, dtype=torch.long)))[0] != first  # another shape
    assert _signature(_documents(torch.zeros(8, dtype=torch.int32)))[0] != first  # another dtype
    window = _signature(lambda b, h, q, k, w=4: (q - k).abs() <= w)[0]
    assert window != _signature(lambda b, h, q, k, w=5: (q - k).abs() <= w)[0]  # a scalar's value counts


def test_the_proxy_reads_the_statics_through_nested_functions_and_partials():
    ids = torch.tensor([0, 0, 1, 1])
    fn = _and_masks(lambda b, h, q, k: q >= k, functools.partial(lambda t, b, h, q, k: t[q] == t[k], ids))
    _, tensors = _signature(fn)
    assert len(tensors) == 1 and tensors[0] is ids
    statics = [torch.tensor([0, 1, 2, 3])]  # every position its own document
    proxy = replayed._walk(fn, iter(statics).__next__, [], 0)
    q, k = torch.arange(4).view(-1, 1), torch.arange(4).view(1, -1)
    assert torch.equal(fn(0, 0, q, k), (q >= k) & (ids[q] == ids[k]))
    assert torch.equal(proxy(0, 0, q, k), torch.eye(4, dtype=torch.bool))  # reads the static, not ids


class _Tables:
    ids = torch.zeros(8, dtype=torch.long)


_gather = GLOBAL_TABLE.index_select


def _nested_global(b, h, q, k):
    inner = lambda: GLOBAL_TABLE  # noqa: E731 (the global is named in a nested code object only)
    return inner()[q] > 0


@pytest.mark.parametrize("fn", [
    lambda b, h, q, k: GLOBAL_TABLE[q] > 0,  # a global tensor: the proxy would read it, not a static
    lambda b, h, q, k: q >= masks.MaskError.__name__.__len__(),  # a module outside the allowed ones
    (lambda obj: (lambda b, h, q, k: q >= obj.start))(range(3)),  # a captured object
    _nested_global,  # a global tensor named by a nested function
    (lambda w: (lambda b, h, q, k: (q - k).abs() <= w))(type("Window", (int,), {"__hash__": None})(3)),  # an int subclass
    lambda b, h, q, k: _Tables.ids[q] == _Tables.ids[k],  # a class attribute
    lambda b, h, q, k: _gather(0, q) > 0,  # a method bound to a global tensor
])
def test_what_a_graph_would_bake_in_is_not_replayed(fn):
    with pytest.raises(replayed._NotReplayable):
        _signature(fn)


def test_keywords_fill_the_statics_by_name_whatever_their_order():
    def both(b, h, q, k, *, low, high):
        return (low[q] <= k) & (k < high[q])

    lows, highs = torch.zeros(4, dtype=torch.long), torch.full((4,), 2)
    first, tensors = _signature(functools.partial(both, low=lows, high=highs))
    second, swapped = _signature(functools.partial(both, high=highs + 1, low=lows + 1))
    assert first == second
    assert torch.equal(tensors[0], highs) and torch.equal(swapped[0], highs + 1)  # "high" sorts before "low"
    statics = [torch.full((4,), 3), torch.ones(4, dtype=torch.long)]  # high, low
    proxy = replayed._walk(functools.partial(both, high=highs, low=lows), iter(statics).__next__, [], 0)
    q, k = torch.arange(4).view(-1, 1), torch.arange(4).view(1, -1)
    assert torch.equal(proxy(0, 0, q, k), ((k >= 1) & (k < 3)).expand(4, 4))


def test_a_kept_graph_answers_for_its_signature(monkeypatch):
    from collections import OrderedDict

    fn = _documents(torch.zeros(8, dtype=torch.long))
    monkeypatch.setattr(replayed, "_graphs", OrderedDict())
    assert not replayed.replays(replayed.signature(fn))
    replayed._graphs[replayed._key(("compiled copy",), torch.device("cuda", 0), replayed.signature(fn))] = object()
    assert replayed.replays(replayed.signature(_documents(torch.ones(8, dtype=torch.long))))
    assert not replayed.replays(replayed.signature(_documents(torch.ones(9, dtype=torch.long))))


def test_a_global_scalar_is_part_of_the_signature():
    sig, _ = _signature(lambda b, h, q, k: (q - k).abs() <= GLOBAL_WINDOW)
    assert ("GLOBAL_WINDOW", (int, GLOBAL_WINDOW)) in sig[-1]


@pytest.mark.gpu
def test_replays_equal_the_compiled_call_over_new_tables_and_keep_earlier_results():
    from stof_cc.masks.geometry import BlockGrid, Extent

    seq = 1024
    generator = torch.Generator().manual_seed(0)

    def documents():
        cuts = torch.randint(1, seq, (7,), generator=generator).sort().values
        return torch.bucketize(torch.arange(seq), cuts, right=True).cuda()

    def build(ids):
        description = masks.from_mask_mod(_documents(ids))
        return description.block_mask(seq, seq, 128, 128, device="cuda"), description

    for _ in range(compiled.COMPILE_FROM):
        build(documents())
    replayed._graphs.clear()
    replayed._refused.clear()
    kept = []
    for _ in range(4):
        ids = documents()
        got, description = build(ids)
        kept.append((got, ids))
    assert len(replayed._graphs) == 1, "the per-call builds were not replayed"
    assert description.grid_ranked(BlockGrid(Extent(seq, seq), 128, 128)) is not None, "lists not ranked in the graph"
    for got, ids in kept:  # each against the eager mask of its own tables, after every later replay
        want = (ids[:, None] == ids[None, :]).cpu()
        assert torch.equal(got.to("cpu").to_dense()[0, 0], want)
        assert got.any_ptr_host.tolist() == got.any_ptr.tolist()


@pytest.mark.gpu
def test_dims_kept_per_replayed_signature_follow_the_tables_shapes():
    from stof_cc.masks.geometry import Extent

    seq, batch = 512, 3

    def per_batch(lengths):  # key padding per batch element where the table has one row per element
        return lambda b, h, q, k: k < lengths

    for rows, dims in ((batch, (batch, 1)), (1, (1, 1))):
        for _ in range(compiled.COMPILE_FROM + 2):
            lengths = (torch.randperm(seq - 1)[:rows] + 1).view(rows, 1, 1, 1).cuda()  # distinct: no slice collapses
            description = masks.from_mask_mod(per_batch(lengths))
            got = description.block_mask(seq, seq, 128, 128, batch=batch, device="cuda")
            want = (torch.arange(seq, device="cuda").view(1, 1, 1, -1) < lengths).expand(-1, 1, seq, seq).cpu()
            assert torch.equal(got.to("cpu").to_dense(), want)
            assert description._dims(Extent(seq, seq, batch, 1)) == dims
        assert replayed.replays(replayed.signature(per_batch(lengths)))


def test_a_capture_or_replay_that_fails_gives_way_and_is_not_tried_again():
    from collections import OrderedDict
    from types import SimpleNamespace

    graphs, refused, released = OrderedDict(), OrderedDict(), []

    def graph(name="graph"):
        return SimpleNamespace(name=name, captured=SimpleNamespace(release=lambda: released.append(name)))

    def broken():
        raise RuntimeError("operation not permitted when stream is capturing")

    replayed._warned.clear()
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph .RuntimeError"):
        assert replayed.replay(graphs, refused, "a", broken, lambda g: 1, 2) is None and "a" in refused
    assert replayed.replay(graphs, refused, "a", graph, lambda g: 1, 2) is None  # not again

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.warns(UserWarning, match="OutOfMemoryError"):
        assert replayed.replay(graphs, refused, "b", out_of_memory, lambda g: 1, 2) is None and "b" in refused
    assert replayed.replay(graphs, refused, "c", graph, lambda g: g.name + "!", 2) == "graph!"

    def failing_run(g):
        raise RuntimeError("replay failed")

    with pytest.warns(UserWarning, match="could not be replayed"):
        assert replayed.replay(graphs, refused, "c", graph, failing_run, 2) is None
    assert "c" not in graphs and "c" in refused
    for key in "def":  # the latest two kept; the evicted one released after its last replay, then refused
        replayed.replay(graphs, refused, key, lambda key=key: graph(key), lambda g: g, 2)
    assert list(graphs) == ["e", "f"] and released == ["d"] and "d" in refused
    assert replayed.replay(graphs, refused, "d", graph, lambda g: g, 2) is None  # keys taking turns: no recapture


class _EagerCaptured:
    """`replayed.Captured` on the CPU: ``work()`` run again at each replay, its results written over
    the first ones in place (as a graph's outputs are), so a reader that kept them sees them change."""

    def __init__(self, device, work):
        self.work, self.outputs = work, work()

    def replay(self, fill, read):
        fill()
        fresh = self.work()
        for static, new in zip(*((self.outputs, fresh) if isinstance(fresh, tuple) else ((self.outputs,), (fresh,))),
                               strict=True):
            static.copy_(new)
        return read(self.outputs)

    def release(self):
        pass


@pytest.fixture
def replayed_on_cpu(monkeypatch):
    """The per-call path as it runs on a GPU (compiled forms, replays, lists ranked from the graph's
    buffer), on the CPU: graphs stood in for by `_EagerCaptured`."""
    from collections import OrderedDict

    from stof_cc.masks import build, lists

    monkeypatch.setattr(compiled, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(build, "GRID_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(replayed, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(replayed, "Captured", _EagerCaptured)
    for module, name in ((replayed, "_graphs"), (replayed, "_refused"), (lists, "_graphs"), (lists, "_refused"),
                         (compiled, "_builds"), (compiled, "_functions"), (compiled, "_indices")):
        monkeypatch.setattr(module, name, OrderedDict())
    monkeypatch.setattr(compiled, "_refused", set())
    return lists


def test_per_call_builds_through_the_replays_equal_eager_masks_and_keep_earlier_ones(replayed_on_cpu):
    from stof_cc.masks.geometry import BlockGrid, Extent

    lists = replayed_on_cpu
    seq, generator = 640, torch.Generator().manual_seed(0)

    def documents():
        cuts = torch.randint(1, seq, (5,), generator=generator).sort().values
        return torch.bucketize(torch.arange(seq), cuts, right=True)

    def causal_documents(ids):  # nested: the walker follows the captured function and its table
        return _and_masks(lambda b, h, q, k: q >= k, _documents(ids))

    built = []
    for _ in range(compiled.COMPILE_FROM + 3):
        ids = documents()
        description = masks.from_mask_mod(causal_documents(ids), device="cpu")
        built.append((description.block_mask(seq, seq, 128, 64), description, ids))
    assert len(replayed._graphs) == 1, "the per-call builds were not replayed"
    assert not lists._graphs, "the lists were ranked by a graph of their own, not with the grid"
    assert built[-1][1].grid_ranked(BlockGrid(Extent(seq, seq), 128, 64)) is not None
    assert not replayed._refused and not lists._refused
    kind = replayed.signature(causal_documents(ids))
    assert replayed.replays(kind) and (kind, Extent(seq, seq)) in user._replayed_dims  # the probe skipped from here
    for got, description, ids in built:  # each against its own tables, after every later replay
        q, k = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
        want = (q >= k) & (ids[q] == ids[k])
        assert torch.equal(got.to_dense()[0, 0], want)
        assert torch.equal(description.to_dense(seq)[0, 0], want)  # its kept grid, not the graph's outputs
        assert got.any_ptr_host.tolist() == got.any_ptr.tolist()
    last = built[-1][0]  # ranked with the grid (the first builds evaluate eagerly: numpy's lists)
    rows, blocks = seq // 128, (seq // 128) * (seq // 64)
    assert last.nbytes == 4 * (3 * (rows + 1) + 5 * blocks + last.part_bits.numel())  # the lists' padded buffer


@pytest.mark.parametrize("equal_slices", [False, True])
def test_per_call_builds_with_a_batch_dim(replayed_on_cpu, equal_slices):
    """A mask_mod over per-sequence tables [B, S], built per call: the lists ranked with the grid
    cover every batch slice, each slice its own mask; where every slice is equal the mask collapses
    to one slice, as every other build of it does (the lists then ranked again, for one slice)."""
    from stof_cc.masks.geometry import BlockGrid, Extent

    seq, batch, generator = 384, 3, torch.Generator().manual_seed(1)
    built = []
    for _ in range(compiled.COMPILE_FROM + 2):
        cuts = torch.randint(1, seq, (batch, 3), generator=generator).sort(-1).values
        if equal_slices:
            cuts[:] = cuts[0]
        ids = torch.stack([torch.bucketize(torch.arange(seq), row, right=True) for row in cuts])
        description = masks.from_mask_mod(lambda b, h, q, k, ids=ids: ids[b, q] == ids[b, k], device="cpu")
        built.append((description.block_mask(seq, seq, 64, 64, batch=batch), description, ids))
    assert len(replayed._graphs) == 1
    assert built[-1][1].grid_ranked(BlockGrid(Extent(seq, seq, batch), 64, 64)) is not None
    q, k = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
    for got, _, ids in built:
        assert got.batch == (1 if equal_slices else batch)  # Bm = 1 where every slice is equal, whatever the path
        for b in range(got.batch):
            assert torch.equal(got.to_dense()[b, 0], ids[b, q] == ids[b, k])
        assert got.any_ptr_host.tolist() == got.any_ptr.tolist()


def test_lists_ranked_with_a_grid_go_with_its_tiles(replayed_on_cpu, monkeypatch):
    """The lists a description keeps beside a per-call grid go when its tiles go (the packed bits'
    budget evicting that extent): nothing holds the grid's memory past the budget."""
    import gc
    import weakref

    from stof_cc.masks.geometry import BlockGrid, Extent

    def causal(b, h, q, k):
        return q >= k

    for _ in range(compiled.COMPILE_FROM):
        masks.from_mask_mod(causal, device="cpu").block_mask(512, 512, 64, 64)
    description = masks.from_mask_mod(causal, device="cpu")
    description.block_mask(512, 512, 64, 64)
    grid = BlockGrid(Extent(512, 512), 64, 64)
    assert description.grid_ranked(grid) is not None
    tiles = weakref.ref(description._grid_tiles(grid))
    monkeypatch.setattr(user, "PACKED_BUDGET", 512 * 16 * 4 + 1)  # one extent's packed bits
    description.block_mask(500, 500, 64, 64)  # another extent (not compiled there): 512's bits evicted
    gc.collect()
    assert description.grid_ranked(grid) is None and tiles() is None
