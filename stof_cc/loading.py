"""Load a user's example: ``path/to/file.py:factory`` -> (module, args, kwargs).

A factory returns ``(module, example_args)`` or ``(module, example_args, example_kwargs)``;
every command that takes a model (inspect, and later compile and tune) reads it this way.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch


class FactoryError(ValueError):
    """The FILE.py:FACTORY reference cannot be loaded or returns the wrong thing."""


def load_factory(reference: str) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    path_text, sep, factory_name = reference.rpartition(":")
    if not sep or not path_text or not factory_name:
        raise FactoryError(f"expected FILE.py:FACTORY, got {reference!r}")
    path = Path(path_text)
    if not path.is_file():
        raise FactoryError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"stof_example_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise FactoryError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise FactoryError(f"{path} has no function {factory_name!r}")
    return _unpack(reference, factory())


def _unpack(reference: str, result: Any) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise FactoryError(f"{reference} must return (module, args) or (module, args, kwargs)")
    model, args, *rest = result
    kwargs = rest[0] if rest else {}
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"{reference} returned {type(model).__name__} where an nn.Module belongs")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise FactoryError(f"{reference}: example args must be a tuple and kwargs a dict")
    return model, tuple(args), kwargs
