"""Load a user's example: ``path/to/file.py:factory`` -> (module, args, kwargs).

A factory returns ``(module, example_args)`` or ``(module, example_args, example_kwargs)``;
every command that takes a model (inspect, compile, tune) reads it this way. A file that does not
load (a syntax error, a failed import, an exception) or a factory that raises is a `FactoryError`
naming the file, the line and the cause in one line, chained to the original exception; so is
a file or factory that calls ``sys.exit`` (an ``argparse`` at import time does). The file's folder
goes first on ``sys.path``, as ``python FILE.py`` puts it, so it imports modules beside it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
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
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # its own folder first, as `python FILE.py` has it: a model beside the file imports
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # SystemExit: the file exits, or parses sys.argv, as it is imported
        sys.modules.pop(spec.name, None)
        raise FactoryError(f"{path} does not load: {_cause(exc, path)}{_exit_hint(exc)}") from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise FactoryError(f"{path} has no function {factory_name!r}")
    try:
        result = factory()
    except (Exception, SystemExit) as exc:
        raise FactoryError(f"{reference} raised {_cause(exc, path)}{_exit_hint(exc)}") from exc
    return _unpack(reference, result)


def _exit_hint(exc: BaseException) -> str:
    return ("; the file exits (or parses the command line) when it runs: put that under "
            "`if __name__ == \"__main__\":`" if isinstance(exc, SystemExit) else "")


def _cause(exc: BaseException, path: Path) -> str:
    """``exc`` in one line, with the line it came from: a syntax error's own (in whichever file it
    is), else the innermost frame in ``path`` (the user's code, not the library it called)."""
    if isinstance(exc, SyntaxError):
        text, file, line = exc.msg, exc.filename, exc.lineno
    else:
        text = str(exc).strip().split("\n")[0]
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if _same_file(f.filename, path)]
        file, line = path, frames[-1].lineno if frames else None
    where = "" if not line else f" (line {line})" if _same_file(file, path) else f" ({file}, line {line})"
    return f"{type(exc).__name__}{': ' if text else ''}{text}{where}"


def _same_file(name: str | Path | None, path: Path) -> bool:
    return name is not None and os.path.abspath(name) == os.path.abspath(path)


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
