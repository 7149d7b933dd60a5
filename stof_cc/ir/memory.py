"""Where tensors lie in memory: the bytes a tensor's elements span, and whether tensors overlap
(themselves, or each other). The runtime keeps overlapping inputs overlapping when it casts them, and
the attention launcher refuses an output that overlaps anything it reads."""

from __future__ import annotations

import torch


def bytes_spanned(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [first, past the last) of ``t``'s elements (strides are never negative); (0, 0)
    for no element."""
    if not t.numel():
        return 0, 0
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def spans_meet(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two `bytes_spanned` ranges share an address (on one device, two allocations never do)."""
    return a[0] < b[1] and b[0] < a[1]


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements may be one (a zero stride, an expanded tensor, rows that overlap):
    false where each dim's stride, smallest first, steps past everything the smaller dims span."""
    spanned = 0
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
        if st <= spanned:
            return True
        spanned += (n - 1) * st
    return False
