"""Errors for bad mask input, and the argument checks that raise them.

Every message starts with the function that was called and names the argument, so a bad
value inside a spec string or a combination of masks is still easy to trace.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


class MaskError(ValueError):
    """A mask description, size or spec that cannot be honoured."""


class MaskTypeError(MaskError, TypeError):
    """An argument of the wrong type (also a TypeError, so either except clause catches it)."""


def _bound(minimum: int, maximum: int | None) -> str:
    if maximum is not None:
        return f"an int in {minimum}..{maximum}"
    return {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")


def check_int(
    fn: str, arg: str, value: object, minimum: int = 1, maximum: int | None = None,
    limit: tuple[int, str] | None = None,
) -> int:
    """`value` as a Python int in [minimum, maximum]; bools and floats are refused. ``limit``
    (largest, why) is a bound of the machinery rather than of the meaning, named only when
    it is passed."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise MaskTypeError(f"{fn}: {arg} must be {_bound(minimum, maximum)}, got {value!r}") from None
    if number < minimum or (maximum is not None and number > maximum):
        raise MaskError(f"{fn}: {arg} must be {_bound(minimum, maximum)}, got {number}")
    if limit is not None and number > limit[0]:
        raise MaskError(f"{fn}: {arg} must be at most {limit[0]} ({limit[1]}), got {number}")
    return number


def check_values(fn: str, arg: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor that holds no values (on the meta device): there is no mask to read."""
    if tensor.is_meta:
        raise MaskError(f"{fn}: {arg} is on the meta device and holds no values; pass a CPU or CUDA tensor")


def check_int_list(fn: str, arg: str, values: object, minimum: int) -> list[int]:
    """A non-empty list (or 1-D integer tensor) of ints >= minimum, as Python ints."""
    what = f"a non-empty list of {_bound(minimum, None)}s or a 1-D integer tensor"
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise MaskTypeError(
                f"{fn}: {arg} must be {what}, got a {values.dtype} tensor of shape "
                f"{tuple(values.shape)}"
            )
        check_values(fn, arg, values)
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise MaskTypeError(f"{fn}: {arg} must be {what}, got {values!r}")
    return [check_int(fn, f"{arg}[{n}]", v, minimum) for n, v in enumerate(values)]
