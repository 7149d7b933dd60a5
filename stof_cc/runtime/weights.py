"""The contract between a compiled module and the weights of the module it was compiled from.

A compiled module reads the parameters and buffers of the user's module as they are when it is
compiled: shared, not copied, when they are already in the compile dtype (constants derived from
them, such as the merged Q/K/V weight, are computed then), a converted copy otherwise. Before
every call, `WeightWatch.changed` checks that they are still those tensors: the same parameter
and buffer objects under the same submodules, the same data (storage, offset, shape, strides),
dtypes and version counters, and no parameter, buffer or submodule added (a bias set on a
`Linear(bias=False)`, a layer appended to a `Sequential`: found by review). PyTorch bumps a
tensor's version counter on every in-place write through it (`load_state_dict`, ``param.copy_()``, an optimizer step, ``with torch.no_grad(): p.mul_(2)``),
and ``.to()``, ``.half()`` or ``p.data = ...`` change its storage, offset, shape or strides. On a change the compiled
module warns, naming the first changed tensor, and compiles again from the module as it is now
(kernels and tuning records are cached, so this costs a trace, not a tuning).

Tensors kept as plain attributes of a submodule (not registered as buffers), or in a dict, list
or tuple attribute, are watched the same way (reviews found both read stale), and so are each
submodule's forward hooks and pre-hooks, which the trace ran: one added or removed compiles again.
A tensor read from elsewhere (a global, a closure) cannot be watched: compile says so
(`runtime.compiled._say_unwatched_tensors`).

The trace runs on `tracing_copy`, never on the user's module: torch.export swaps fake tensors
into the module it traces, which other threads would meet.

What it cannot see: a write through ``p.data`` (``p.data.mul_(2)``) goes around the version
counter, as it goes around autograd; nor Python numbers on a module (``self.scale = 3.0``), which
the trace read as constants. After either, call ``compiled.refresh()``
(docs/troubleshooting.md#changed-weights).

The check walks every tensor and submodule once per call in Python (about 0.7 us each on a 2-core
EPYC host: 145 us for BERT-base's 201 tensors, about 100 before it compared shapes and strides too).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from stof_cc.passes.lower import convert_weights, converted_dtypes


class WeightWatch:
    """The parameters, buffers and submodules of ``module`` as they were when watched."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.reset()

    def reset(self) -> None:
        """Take the module's tensors as they are now as the ones compiled. Built aside and published
        in one assignment: a `changed` in another thread reads the old state or the new, whole."""
        modules: list[tuple[dict, str, Any, str]] = []  # (parent._modules, name, child, path)
        tensors: list[tuple[dict, str, str]] = []  # (owner._parameters or _buffers, name, path)
        hooks: list[tuple[torch.nn.Module, str, tuple, bool]] = []  # (module, path, its hooks' ids, any hooks)
        held: list[tuple[dict, str, Any, Any, str]] = []  # (owner.__dict__, attribute, its dict or list, key, path)
        tables: list[tuple[dict, int, frozenset, str]] = []  # (a _parameters, _buffers or _modules, its size, its Nones)
        self._walk(self.module, "", modules, tensors, hooks, held, tables)
        self._state = (modules, tensors, [_identity(store[name]) for store, name, _ in tensors], hooks,
                       held, [_identity(box[key]) for _, _, box, key, _ in held], tables)

    def _walk(self, module: torch.nn.Module, prefix: str, modules: list, tensors: list, hooks: list,
              held: list, tables: list) -> None:
        ids, where = _hook_ids(module), prefix.rstrip(".") or "the model"
        hooks.append((module, where, ids, any(ids)))
        for store in (module._parameters, module._buffers, module._modules):  # an entry added, or a None one set
            tables.append((store, len(store), frozenset(name for name, t in store.items() if t is None), where))
        for store in (module._parameters, module._buffers):
            tensors += [(store, name, prefix + name) for name, t in store.items() if t is not None]
        # tensors kept as plain attributes (``self.c = torch.tensor(...)``), or in a dict, list or tuple
        # attribute (``self.tables = {"a": t}``): traced as constants too
        for name, value in module.__dict__.items():
            if isinstance(value, torch.Tensor):
                tensors.append((module.__dict__, name, prefix + name))
            elif isinstance(value, dict | list | tuple) and name not in _MODULE_TABLES:
                items = value.items() if isinstance(value, dict) else enumerate(value)
                held += [(module.__dict__, name, value, key, f"{prefix}{name}[{key!r}]") for key, t in items
                         if isinstance(t, torch.Tensor)]
        for name, child in module._modules.items():
            modules.append((module._modules, name, child, prefix + name))
            if child is not None:
                self._walk(child, f"{prefix}{name}.", modules, tensors, hooks, held, tables)

    def watched(self) -> list[torch.Tensor]:
        """Every tensor the watch compares (parameters, buffers, tensor attributes, tensors in dict,
        list and tuple attributes)."""
        _, tensors, seen_tensors, _, _, seen_held, _ = self._state
        return [seen[0] for seen in (*seen_tensors, *seen_held)]

    def changed(self) -> str | None:
        """The qualified name of the first submodule or tensor that is not the one compiled
        (replaced, moved, cast or written in place), or None when all are."""
        modules, tensors, seen_tensors, hooks, held, seen_held, tables = self._state
        for parent, name, child, path in modules:
            if parent.get(name) is not child:
                return f"submodule {path!r}"
        for store, size, nones, where in tables:  # a bias set where there was None, a layer appended (found by review)
            if len(store) != size or any(store.get(name) is not None for name in nones):
                return f"the parameters, buffers or submodules of {where if where == 'the model' else repr(where)}"
        for (owner, name, box, key, path), seen in zip(held, seen_held, strict=True):
            if owner.get(name) is not box or _changed(_item(box, key), seen):
                return repr(path)
        # per tensor, every call: the object, its version (in-place writes), its storage, offset, shape and
        # strides, all four in one call against an alias taken when watched (``.data =``, ``module.half()``
        # and ``.to(device)`` keep the object and the version; ``.data = w[:n]`` or ``w.t()``, a view from
        # the same first element, kept the address that was compared before: found by review) and its
        # dtype (a reinterpreting view keeps all four).
        for (store, name, path), (seen, version, alias, dtype) in zip(tensors, seen_tensors, strict=True):
            tensor = store.get(name)  # inline, not `_changed`: this loop runs over every weight on every call
            if tensor is not seen or (version is not None and tensor._version != version) \
                    or not tensor.is_set_to(alias) or tensor.dtype is not dtype:
                return repr(path)
        for module, path, ids, hooked in hooks:  # the ids compared only where a hook is or was
            if (hooked or module._forward_hooks or module._forward_pre_hooks) and _hook_ids(module) != ids:
                return f"the forward hooks of {path if path == 'the model' else repr(path)}"
        return None


def _hook_ids(module: torch.nn.Module) -> tuple:
    return tuple(module._forward_hooks), tuple(module._forward_pre_hooks)


def _identity(tensor: torch.Tensor) -> tuple:
    """The tensor, its version (None for an inference tensor, which has none: torch.export cannot trace
    one, and compile's error says so, where the watch raised torch's bare error first), an alias of its
    data as it is now (storage, offset, shape and strides: `Tensor.is_set_to` compares all four) and its
    dtype."""
    return tensor, None if tensor.is_inference() else tensor._version, tensor.detach(), tensor.dtype


def _changed(tensor: Any, identity: tuple) -> bool:
    seen, version, alias, dtype = identity
    return tensor is not seen or (version is not None and tensor._version != version) \
        or not tensor.is_set_to(alias) or tensor.dtype is not dtype


def _item(box: dict | list | tuple, key: Any) -> Any:
    """``box[key]``, or None where it is gone."""
    if isinstance(box, dict):
        return box.get(key)
    return box[key] if key < len(box) else None


_MODULE_TABLES = frozenset(vars(torch.nn.Module()))  # nn.Module's own dicts and sets: parameters, hooks...


def weights_to_compile(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The module whose tensors a compiled module reads: ``module`` itself when its floating
    parameters are already in ``dtype`` (shared: no second copy of the weights; buffers it keeps in
    another dtype stay so, as `convert_weights` says), else a copy converted to ``dtype`` (the
    user's module is never changed)."""
    return convert_weights(copy.deepcopy(module), dtype) if converted_dtypes(module, dtype) else module


def tracing_copy(module: torch.nn.Module, copies: dict[int, torch.nn.Module] | None = None) -> torch.nn.Module:
    """``module`` for torch.export to trace: each submodule a shallow copy with parameter, buffer
    and submodule tables of its own, holding the same tensors. The trace swaps fake tensors into
    those tables and the modules' modes while it runs; on the user's module, other threads calling
    it meanwhile (eagerly, or through the compiled module, whose weight watch then saw every weight
    changed) met fake tensors (found by review). A submodule held twice is copied once."""
    copies = {} if copies is None else copies
    if id(module) not in copies:
        clone = copies[id(module)] = object.__new__(type(module))  # not copy.copy: a __getstate__ may drop state
        clone.__dict__.update(module.__dict__)
        clone._parameters, clone._buffers = dict(module._parameters), dict(module._buffers)
        clone._modules = {name: None if child is None else tracing_copy(child, copies)
                          for name, child in module._modules.items()}
    return copies[id(module)]


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode for a trace, its own mode restored after (dropout off: stof-cc
    compiles inference)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
