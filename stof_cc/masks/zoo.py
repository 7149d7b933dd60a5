"""The mask zoo: full, causal, sliding window, dilated, Sparse Transformer (strided, fixed),
global tokens, random blocks, Longformer, BigBird, document (packed sequences), key padding.

Each pattern states its definition twice, and both must agree: `_eval` elementwise (the
mask_mod) and `_classify` per block from the block's q and k ranges, vectorised over the
grid. Classification may answer PARTIAL when unsure, never FULL or EMPTY wrongly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from stof_cc.masks.description import MaskDescription, Union
from stof_cc.masks.errors import MaskError, MaskTypeError, check_int, check_int_list
from stof_cc.masks.geometry import BlockGrid, Extent, classes_from


def _label(fn: str, **params: object) -> str:
    return f"{fn}(" + ", ".join(f"{k}={v!r}" for k, v in params.items()) + ")"


class _Labelled(MaskDescription):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def __repr__(self) -> str:
        return self.label


class _Full(_Labelled):
    """Every element attends: the mask of unmasked attention."""

    invariant = True

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return torch.ones_like(q - k, dtype=torch.bool)

    def _classify(self, grid: BlockGrid) -> Tensor:
        every = torch.ones(grid.n_rb, grid.n_cb, dtype=torch.bool)
        return classes_from(every, ~every)


class _Band(_Labelled):
    """lo <= q - k (<= hi): causal and sliding windows."""

    invariant = True

    def __init__(self, lo: int, hi: int | None, label: str) -> None:
        super().__init__(label)
        self.lo, self.hi = lo, hi

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        d = q - k
        return d >= self.lo if self.hi is None else (d >= self.lo) & (d <= self.hi)

    def _classify(self, grid: BlockGrid) -> Tensor:
        d_min, d_max = grid.diagonals()
        full, empty = d_min >= self.lo, d_max < self.lo
        if self.hi is not None:
            full, empty = full & (d_max <= self.hi), empty | (d_min > self.hi)
        return classes_from(full, empty)


class _Dilated(_Labelled):
    """|q - k| <= w * dilation and (q - k) % dilation == 0."""

    invariant = True

    def __init__(self, w: int, dilation: int, label: str) -> None:
        super().__init__(label)
        self.reach, self.dilation = w * dilation, dilation
        self._residue_mask = sliding_window(w)  # one object: plans and choices are cached per description

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        d = q - k
        return (d.abs() <= self.reach) & (d % self.dilation == 0)

    def strided_split(self) -> tuple[int, MaskDescription]:
        """Positions r, r + d, r + 2d, ... attend each other within w steps: a sliding window."""
        return self.dilation, self._residue_mask

    def _classify(self, grid: BlockGrid) -> Tensor:
        d_min, d_max = grid.diagonals()
        lo, hi = d_min.clamp(min=-self.reach), d_max.clamp(max=self.reach)
        no_multiple = (hi // self.dilation) * self.dilation < lo
        full = (d_min >= -self.reach) & (d_max <= self.reach) & (self.dilation == 1)
        return classes_from(full, (hi < lo) | no_multiple)


class _Strided(_Labelled):
    """Sparse Transformer 'strided': q >= k and (q - k < stride or (q - k) % stride == 0)."""

    invariant = True

    def __init__(self, stride: int, label: str) -> None:
        super().__init__(label)
        self.stride = stride

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        d = q - k
        return (d >= 0) & ((d < self.stride) | (d % self.stride == 0))

    def _classify(self, grid: BlockGrid) -> Tensor:
        s = self.stride
        d_min, d_max = grid.diagonals()
        lo = d_min.clamp(min=0)
        empty = (d_max < 0) | ((lo >= s) & ((d_max // s) * s < lo))
        return classes_from((d_min >= 0) & (d_max < s), empty)


class _Fixed(_Labelled):
    """Sparse Transformer 'fixed': q >= k and (k // stride == q // stride or
    k % stride >= stride - c, the c 'summary' columns at the end of every stride)."""

    def __init__(self, stride: int, c: int, label: str) -> None:
        super().__init__(label)
        self.stride, self.c = stride, c

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        s = self.stride
        return (q >= k) & ((q // s == k // s) | (k % s >= s - self.c))

    def _classify(self, grid: BlockGrid) -> Tensor:
        s, first = self.stride, self.stride - self.c
        q_lo, q_hi, k_lo, k_hi = grid.q_lo, grid.q_hi, grid.k_lo, grid.k_hi
        # first summary column at or after k_lo; any before min(k_hi, q_hi) makes a True
        summary = torch.where(k_lo % s >= first, k_lo, k_lo - k_lo % s + first)
        has_summary = summary <= torch.minimum(k_hi, q_hi)
        chunks_meet = (k_hi // s >= q_lo // s) & (k_lo // s <= q_hi // s)
        empty = (q_hi < k_lo) | (~chunks_meet & ~has_summary)
        one_chunk = (q_lo // s == q_hi // s) & (k_lo // s == q_lo // s) & (k_hi // s == q_lo // s)
        all_summary = (k_lo // s == k_hi // s) & (k_lo % s >= first)
        return classes_from((q_lo >= k_hi) & (one_chunk | all_summary), empty)


class _GlobalTokens(_Labelled):
    """q or k is a global token: a set of positions, as a bool table with prefix sums."""

    def __init__(self, positions: Tensor, label: str) -> None:
        super().__init__(label)
        size = int(positions.max()) + 1 if positions.numel() else 0
        self.table = torch.zeros(size, dtype=torch.bool)
        self.table[positions] = True
        self.prefix = torch.nn.functional.pad(self.table.long().cumsum(0), (1, 0))

    def _contains(self, x: Tensor) -> Tensor:
        size = self.table.numel()
        lookup = self._on(
            "table", x.device, lambda: torch.cat([self.table, self.table.new_zeros(1)])
        )
        return lookup[x.clamp(max=size)]

    def _count(self, lo: Tensor, hi: Tensor) -> Tensor:
        size = self.table.numel()
        return self.prefix[(hi + 1).clamp(max=size)] - self.prefix[lo.clamp(max=size)]

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return self._contains(q) | self._contains(k)

    def _classify(self, grid: BlockGrid) -> Tensor:
        in_q = self._count(grid.q_lo, grid.q_hi)
        in_k = self._count(grid.k_lo, grid.k_hi)
        full = (in_q == grid.q_hi - grid.q_lo + 1) | (in_k == grid.k_hi - grid.k_lo + 1)
        return classes_from(full, (in_q == 0) & (in_k == 0))


class _RandomBlocks(_Labelled):
    """A random grid of `block` x `block` cells, each on with probability
    min(1, random_blocks / n_cols), drawn from torch.Generator().manual_seed(seed)."""

    size_dependent = True

    def __init__(self, random_blocks: int, block: int, seed: int, label: str) -> None:
        super().__init__(label)
        self.random_blocks, self.block, self.seed = random_blocks, block, seed

    def cells(self, seq_q: int, seq_k: int) -> Tensor:
        """The on/off cell grid [ceil(seq_q/block), ceil(seq_k/block)]: deterministic."""
        rows, cols = -(-seq_q // self.block), -(-seq_k // self.block)
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(rows, cols, generator=generator) < self.random_blocks / cols

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        assert ext is not None, "size-dependent masks are evaluated with their extent"
        key = ("cells", ext.seq_q, ext.seq_k)
        cells = self._on(key, q.device, lambda: self.cells(ext.seq_q, ext.seq_k))
        return cells[q // self.block, k // self.block]

    def _classify(self, grid: BlockGrid) -> Tensor:
        cells = self.cells(grid.ext.seq_q, grid.ext.seq_k).long()
        table = torch.nn.functional.pad(cells.cumsum(0).cumsum(1), (1, 0, 1, 0))
        r0, r1 = grid.q_lo // self.block, grid.q_hi // self.block + 1
        c0, c1 = grid.k_lo // self.block, grid.k_hi // self.block + 1
        on = table[r1, c1] - table[r0, c1] - table[r1, c0] + table[r0, c0]
        return classes_from(on == (r1 - r0) * (c1 - c0), on == 0)


class _Document(_Labelled):
    """doc(q) == doc(k) >= 0 from segment ids [Bd, L] (Bd = 1 or one row per batch element).
    Negative ids, and positions past the ids of a `lengths` description, are padding and
    attend nothing."""

    def __init__(self, ids: Tensor, label: str, *, covers_all: bool) -> None:
        super().__init__(label)
        self.ids = ids
        self.covers_all = covers_all  # segment ids must cover every position

    def _fixed(self) -> tuple[int | None, int | None]:
        return (self.ids.shape[0] if self.ids.shape[0] > 1 else None), None

    def _dims(self, ext: Extent) -> tuple[int, int]:
        rows, size = self.ids.shape
        if self.covers_all and size < max(ext.seq_q, ext.seq_k):
            raise MaskError(
                f"document: segment_ids cover {size} positions, but the mask is "
                f"{ext.seq_q} x {ext.seq_k}"
            )
        if rows > 1 and rows != ext.batch:
            raise MaskError(
                f"document: segment_ids has {rows} rows (one per batch element), "
                f"but batch={ext.batch}"
            )
        return rows, 1

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        size = self.ids.shape[1]
        table = self._on(
            "ids", q.device, lambda: torch.nn.functional.pad(self.ids, (0, 1), value=-1)
        )
        row = b if self.ids.shape[0] > 1 else torch.zeros_like(b)
        doc_q, doc_k = table[row, q.clamp(max=size)], table[row, k.clamp(max=size)]
        return (doc_q == doc_k) & (doc_q >= 0)

    def _block_range(self, seq: int, block: int) -> tuple[Tensor, Tensor]:
        """Min and max id over each block of positions, [Bd, n_blocks]; the ragged tail is
        padded with its last id, positions past the ids with -1."""
        n = -(-seq // block)
        ids = self.ids[:, :seq]
        ids = torch.nn.functional.pad(ids, (0, seq - ids.shape[1]), value=-1)
        ids = torch.cat([ids, ids[:, -1:].expand(-1, n * block - seq)], dim=1).view(-1, n, block)
        return ids.amin(-1), ids.amax(-1)

    def _classify(self, grid: BlockGrid) -> Tensor:
        q_min, q_max = (t[:, :, None] for t in self._block_range(grid.ext.seq_q, grid.block_m))
        k_min, k_max = (t[:, None, :] for t in self._block_range(grid.ext.seq_k, grid.block_n))
        full = (q_min == q_max) & (k_min == k_max) & (q_min == k_min) & (q_min >= 0)
        empty = (q_max < k_min) | (k_max < q_min) | (q_max < 0) | (k_max < 0)
        return classes_from(full, empty).transpose(0, 1)


class _KeyPadding(_Labelled):
    """k < lengths[b]: each batch element attends to its first lengths[b] keys."""

    def __init__(self, lengths: Tensor, label: str) -> None:
        super().__init__(label)
        self.lengths = lengths

    def _fixed(self) -> tuple[int | None, int | None]:
        return self.lengths.numel(), None

    def _dims(self, ext: Extent) -> tuple[int, int]:
        if ext.batch != self.lengths.numel():
            raise MaskError(
                f"key_padding: {self.lengths.numel()} lengths given (one per batch element), "
                f"but batch={ext.batch}"
            )
        return ext.batch, 1

    def _eval(self, ext: Extent | None, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return k < self._on("lengths", k.device, lambda: self.lengths)[b]

    def _classify(self, grid: BlockGrid) -> Tensor:
        lengths = self.lengths.view(-1, 1, 1, 1)
        return classes_from(grid.k_hi < lengths, grid.k_lo >= lengths)


# -- the public constructors: validate, then build ------------------------------------------


def full() -> MaskDescription:
    """No masking: every query attends to every key (all blocks FULL)."""
    return _Full("full()")


def causal() -> MaskDescription:
    """q >= k."""
    return _Band(0, None, "causal()")


def sliding_window(w: int, causal: bool = False) -> MaskDescription:
    """|q - k| <= w; with causal=True, 0 <= q - k <= w."""
    w = check_int("sliding_window", "w", w)
    if not isinstance(causal, bool):
        raise MaskTypeError(f"sliding_window: causal must be a bool, got {causal!r}")
    label = _label("sliding_window", w=w, causal=True) if causal else _label("sliding_window", w=w)
    return _Band(0 if causal else -w, w, label)


def dilated(w: int, dilation: int) -> MaskDescription:
    """|q - k| <= w * dilation and (q - k) % dilation == 0: w keys each side, every
    dilation-th position."""
    w = check_int("dilated", "w", w)
    dilation = check_int("dilated", "dilation", dilation)
    return _Dilated(w, dilation, _label("dilated", w=w, dilation=dilation))


def strided(stride: int) -> MaskDescription:
    """Child et al.'s strided pattern: q >= k and (q - k < stride or (q - k) % stride == 0)."""
    stride = check_int("strided", "stride", stride)
    return _Strided(stride, _label("strided", stride=stride))


def fixed(stride: int, c: int) -> MaskDescription:
    """Child et al.'s fixed pattern: q >= k and (k // stride == q // stride or
    k % stride >= stride - c)."""
    stride = check_int("fixed", "stride", stride)
    c = check_int("fixed", f"c (stride={stride})", c, 1, stride)
    return _Fixed(stride, c, _label("fixed", stride=stride, c=c))


def _token_positions(fn: str, arg: str, tokens: object) -> tuple[Tensor, object]:
    """Global tokens as positions: an int n means the first n positions."""
    if isinstance(tokens, Tensor) and tokens.dim() == 0 or isinstance(tokens, (int, np.integer)):
        count = check_int(fn, arg, tokens, 0)
        return torch.arange(count), count
    positions = check_int_list(fn, arg, tokens, 0)
    return positions, positions.tolist()


def _global(positions: Tensor, shown: object) -> MaskDescription:
    return _GlobalTokens(positions, _label("global_tokens", tokens=shown))


def _random(r: int, block: int, seed: int) -> MaskDescription:
    return _RandomBlocks(
        r, block, seed, _label("random_blocks", random_blocks=r, block=block, seed=seed)
    )


def global_tokens(tokens: int | list[int] | Tensor) -> MaskDescription:
    """q or k is a global token; `tokens` is a count n (the first n positions) or positions."""
    return _global(*_token_positions("global_tokens", "tokens", tokens))


def random_blocks(random_blocks: int, block: int = 64, seed: int = 0) -> MaskDescription:
    """Random cells of block x block: each on with probability random_blocks / n_cols (about
    random_blocks cells per block row), deterministic for given sizes and seed."""
    r = check_int("random_blocks", "random_blocks", random_blocks, 0)
    block = check_int("random_blocks", "block", block)
    seed = check_int("random_blocks", "seed", seed, 0)
    return _random(r, block, seed)


def longformer(w: int, global_tokens: int | list[int] | Tensor) -> MaskDescription:
    """Longformer: |q - k| <= w, or q or k is a global token (a count n or positions)."""
    w = check_int("longformer", "w", w)
    positions, shown = _token_positions("longformer", "global_tokens", global_tokens)
    return Union(
        (sliding_window(w), _global(positions, shown)),
        label=_label("longformer", w=w, global_tokens=shown),
    )


def bigbird(
    w: int, n_global: int, random_blocks: int, block: int = 64, seed: int = 0
) -> MaskDescription:
    """BigBird: longformer(w, n_global) or a random block grid at `block` granularity, each
    cell on with probability random_blocks / n_block_cols (seeded; depends on the sizes)."""
    w = check_int("bigbird", "w", w)
    n_global = check_int("bigbird", "n_global", n_global, 0)
    r = check_int("bigbird", "random_blocks", random_blocks, 0)
    block = check_int("bigbird", "block", block)
    seed = check_int("bigbird", "seed", seed, 0)
    label = _label("bigbird", w=w, n_global=n_global, random_blocks=r, block=block, seed=seed)
    return Union((longformer(w, n_global), _random(r, block, seed)), label=label)


def document(
    lengths: list[int] | Tensor | None = None, *, segment_ids: Tensor | None = None
) -> MaskDescription:
    """Packed sequences: doc(q) == doc(k). Either `lengths` of consecutive documents
    (positions past their sum are padding), or `segment_ids`, an integer tensor [S] or
    [B, S] (one row per batch element) where a negative id marks padding."""
    if (lengths is None) == (segment_ids is None):
        raise MaskTypeError("document: give exactly one of lengths or segment_ids")
    if lengths is not None:
        sizes = check_int_list("document", "lengths", lengths, 1)
        ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes)[None]
        return _Document(ids, _label("document", lengths=sizes.tolist()), covers_all=False)
    if (
        not isinstance(segment_ids, Tensor)
        or segment_ids.dtype.is_floating_point
        or segment_ids.dtype == torch.bool
    ):
        raise MaskTypeError(f"document: segment_ids must be an integer tensor, got {segment_ids!r}")
    if segment_ids.dim() not in (1, 2) or segment_ids.shape[-1] == 0:
        raise MaskError(
            f"document: segment_ids must have shape [S] or [B, S], got {tuple(segment_ids.shape)}"
        )
    ids = segment_ids.reshape(-1, segment_ids.shape[-1]).long().cpu()
    return _Document(
        ids, f"document(segment_ids=<{'x'.join(map(str, segment_ids.shape))}>)", covers_all=True
    )


def key_padding(lengths: list[int] | Tensor) -> MaskDescription:
    """Per batch element b: k < lengths[b] (padded keys are never attended)."""
    sizes = check_int_list("key_padding", "lengths", lengths, 0)
    return _KeyPadding(sizes, _label("key_padding", lengths=sizes.tolist()))
