"""The latest-kept caches of the mask builder (compiled forms, graphs, refusals, probes): one rule."""

from __future__ import annotations

from collections import OrderedDict


def keep(cache: OrderedDict, key: object, value: object, kept: int) -> object:
    """``value`` stored under ``key`` as the latest of ``cache``, which keeps its ``kept`` latest;
    returns ``value``."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > kept:
        cache.popitem(last=False)
    return value
